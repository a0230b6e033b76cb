// CUDA kernel of torchstruct::global_norm.
//
// Multi-tensor and chunked, without host synchronization:
//  1. The host builds one int64 metadata buffer: per dtype group, the data
//     pointers and sizes of its tensors and a chunk table (tensor index, start
//     element) with kChunk elements per chunk. It is copied to the device from
//     pinned memory, asynchronously on the current stream.
//  2. One launch per dtype group of `partial_kernel`: one block per chunk, each
//     thread accumulates in acc_t (float for float/half/bfloat16, double for
//     double), a block reduction writes the block's partial into its slot of a
//     double workspace.
//  3. `finish_kernel` (one block) reduces all partials and applies the root,
//     writing the 0-dim result (float32, or float64 if any input is float64).
#include "../common.h"

#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace torchstruct {
namespace {

constexpr int64_t kChunk = 64 * 1024;  // elements per block
constexpr int kThreads = 512;

template <typename T>
__device__ __forceinline__ T nan_max(T acc, T a) {
  return (a > acc || a != a) ? a : acc;
}

template <typename acc_t>
__device__ __forceinline__ acc_t accumulate(acc_t acc, acc_t a, int kind, acc_t p) {
  switch (kind) {
    case static_cast<int>(NormKind::kInf):
      return nan_max(acc, a);
    case static_cast<int>(NormKind::kOne):
      return acc + a;
    case static_cast<int>(NormKind::kTwo):
      return acc + a * a;
    default:
      return acc + pow(a, p);
  }
}

template <typename T>
__device__ __forceinline__ T combine(T a, T b, int kind) {
  return kind == static_cast<int>(NormKind::kInf) ? nan_max(a, b) : a + b;
}

// Block-wide reduction (sum or NaN-propagating max); the result is valid in
// thread 0. blockDim.x must be kThreads.
template <typename T>
__device__ T block_reduce(T v, int kind) {
  __shared__ T smem[kThreads];
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      smem[threadIdx.x] = combine(smem[threadIdx.x], smem[threadIdx.x + stride], kind);
    }
    __syncthreads();
  }
  return smem[0];
}

// meta layout for one group of n tensors and c chunks (int64 each):
//   [ptr_0..ptr_{n-1} | numel_0..numel_{n-1} | chunk_tensor_0.. | chunk_start_0..]
template <typename scalar_t, typename acc_t>
__global__ void partial_kernel(const int64_t* __restrict__ meta, int64_t num_tensors,
                               int64_t num_chunks, int kind, double p,
                               double* __restrict__ partials) {
  const int64_t chunk = blockIdx.x;
  const int64_t* ptrs = meta;
  const int64_t* numels = meta + num_tensors;
  const int64_t* chunk_tensor = meta + 2 * num_tensors;
  const int64_t* chunk_start = meta + 2 * num_tensors + num_chunks;

  const int64_t t = chunk_tensor[chunk];
  const int64_t begin = chunk_start[chunk];
  const int64_t end = min(begin + kChunk, numels[t]);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(ptrs[t]);
  const acc_t pp = static_cast<acc_t>(p);

  acc_t acc = acc_t(0);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const acc_t a = ::abs(static_cast<acc_t>(x[i]));
    acc = accumulate(acc, a, kind, pp);
  }
  const acc_t total = block_reduce<acc_t>(acc, kind);
  if (threadIdx.x == 0) partials[chunk] = static_cast<double>(total);
}

template <typename out_t>
__global__ void finish_kernel(const double* __restrict__ partials, int64_t n, int kind,
                              double p, out_t* __restrict__ out) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc = combine(acc, partials[i], kind);
  const double r = block_reduce<double>(acc, kind);
  if (threadIdx.x == 0) {
    double v;
    switch (kind) {
      case static_cast<int>(NormKind::kInf):
      case static_cast<int>(NormKind::kOne):
        v = r;
        break;
      case static_cast<int>(NormKind::kTwo):
        v = sqrt(r);
        break;
      default:
        v = pow(r, 1.0 / p);
    }
    *out = static_cast<out_t>(v);
  }
}

struct Group {
  c10::ScalarType dtype;
  std::vector<at::Tensor> tensors;  // contiguous, non-empty
  int64_t meta_offset = 0;
  int64_t num_chunks = 0;
  int64_t partial_offset = 0;
};

at::Tensor global_norm_cuda(at::TensorList tensors, double norm_type) {
  check_norm_type(norm_type);
  const c10::ScalarType out_dtype = check_global_norm_inputs(tensors);
  const c10::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "torchstruct::global_norm: CUDA kernel called with tensors on ",
              device);
  const c10::cuda::CUDAGuard guard(device);
  const int kind = static_cast<int>(norm_kind(norm_type));

  // Group the non-empty tensors by dtype (order of first appearance).
  std::vector<Group> groups;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    Group* g = nullptr;
    for (Group& existing : groups) {
      if (existing.dtype == t.scalar_type()) g = &existing;
    }
    if (g == nullptr) {
      groups.push_back(Group{t.scalar_type(), {}});
      g = &groups.back();
    }
    g->tensors.push_back(t.contiguous());
  }

  at::Tensor out = at::empty({}, tensors[0].options().dtype(out_dtype));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Metadata for all groups in one buffer.
  int64_t meta_size = 0;
  int64_t total_chunks = 0;
  for (Group& g : groups) {
    g.meta_offset = meta_size;
    g.partial_offset = total_chunks;
    for (const at::Tensor& t : g.tensors) g.num_chunks += (t.numel() + kChunk - 1) / kChunk;
    meta_size += 2 * static_cast<int64_t>(g.tensors.size()) + 2 * g.num_chunks;
    total_chunks += g.num_chunks;
  }
  // At least one slot, so the finish kernel always has a valid buffer.
  at::Tensor partials = at::empty({std::max<int64_t>(total_chunks, 1)},
                                  tensors[0].options().dtype(c10::kDouble));

  if (total_chunks > 0) {
    at::Tensor meta_host = at::empty(
        {meta_size}, at::TensorOptions().dtype(c10::kLong).device(c10::kCPU).pinned_memory(true));
    int64_t* m = meta_host.data_ptr<int64_t>();
    for (const Group& g : groups) {
      const int64_t n = static_cast<int64_t>(g.tensors.size());
      int64_t* ptrs = m + g.meta_offset;
      int64_t* numels = ptrs + n;
      int64_t* chunk_tensor = numels + n;
      int64_t* chunk_start = chunk_tensor + g.num_chunks;
      int64_t c = 0;
      for (int64_t i = 0; i < n; ++i) {
        const at::Tensor& t = g.tensors[i];
        ptrs[i] = reinterpret_cast<int64_t>(t.const_data_ptr());
        numels[i] = t.numel();
        for (int64_t s = 0; s < t.numel(); s += kChunk, ++c) {
          chunk_tensor[c] = i;
          chunk_start[c] = s;
        }
      }
    }
    // Pinned source + non_blocking: no host synchronization; the caching host
    // allocator keeps the buffer alive until the copy has run.
    at::Tensor meta = meta_host.to(device, /*non_blocking=*/true);
    const int64_t* meta_dev = meta.const_data_ptr<int64_t>();
    double* partials_dev = partials.data_ptr<double>();

    for (const Group& g : groups) {
      const int64_t n = static_cast<int64_t>(g.tensors.size());
      const dim3 grid(static_cast<unsigned int>(g.num_chunks));
      const int64_t* gm = meta_dev + g.meta_offset;
      double* gp = partials_dev + g.partial_offset;
      switch (g.dtype) {
        case c10::kFloat:
          partial_kernel<float, float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, kind,
                                                                      norm_type, gp);
          break;
        case c10::kDouble:
          partial_kernel<double, double><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks,
                                                                        kind, norm_type, gp);
          break;
        case c10::kHalf:
          partial_kernel<c10::Half, float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks,
                                                                          kind, norm_type, gp);
          break;
        case c10::kBFloat16:
          partial_kernel<c10::BFloat16, float><<<grid, kThreads, 0, stream>>>(
              gm, n, g.num_chunks, kind, norm_type, gp);
          break;
        default:
          TORCH_CHECK(false, "torchstruct::global_norm: unsupported dtype ", g.dtype);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  if (out_dtype == c10::kDouble) {
    finish_kernel<double><<<1, kThreads, 0, stream>>>(partials.const_data_ptr<double>(),
                                                      total_chunks, kind, norm_type,
                                                      out.data_ptr<double>());
  } else {
    finish_kernel<float><<<1, kThreads, 0, stream>>>(partials.const_data_ptr<double>(),
                                                     total_chunks, kind, norm_type,
                                                     out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CUDA, m) {
  m.impl("global_norm", &torchstruct::global_norm_cuda);
}
