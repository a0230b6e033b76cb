// CUDA p-norm reduction over many tensors, shared by the torchstruct CUDA
// kernels (global_norm, clip_by_global_norm_, ...).
//
// Multi-tensor and chunked, without host synchronization:
//  1. make_plan groups the non-empty tensors by dtype and builds one int64
//     metadata buffer: per group, the data pointers and sizes of its tensors and
//     a chunk table (tensor index, start element) with kChunk elements per
//     chunk. It is copied to the device from pinned memory, asynchronously on
//     the current stream. Tensors whose memory is a dense span (contiguous, or
//     a permutation of dims) are used in place and come first in their group
//     (their chunks are a prefix of the group's chunk table: those an in-place
//     kernel may write); any other tensor is read from a contiguous copy.
//  2. launch_partials: one launch per dtype group of `partial_kernel`: one
//     block per chunk, each thread accumulates in acc_t (float for
//     float/half/bfloat16, double for double), a block reduction writes the
//     block's partial into its slot of a double workspace.
//  3. The caller reduces the partials on the device (see `reduce_partials`).
#pragma once

#include "../common.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace torchstruct {
namespace cuda {

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

// Reduces n partials with one block (kThreads threads) and applies the root;
// the result is valid in thread 0.
__device__ __forceinline__ double reduce_partials(const double* __restrict__ partials, int64_t n,
                                                  int kind, double p) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc = combine(acc, partials[i], kind);
  const double r = block_reduce<double>(acc, kind);
  switch (kind) {
    case static_cast<int>(NormKind::kInf):
    case static_cast<int>(NormKind::kOne):
      return r;
    case static_cast<int>(NormKind::kTwo):
      return sqrt(r);
    default:
      return pow(r, 1.0 / p);
  }
}

// meta layout for one group of n tensors and c chunks (int64 each):
//   [ptr_0..ptr_{n-1} | numel_0..numel_{n-1} | chunk_tensor_0.. | chunk_start_0..]
struct ChunkRef {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ ChunkRef chunk_ref(const int64_t* __restrict__ meta, int64_t num_tensors,
                                              int64_t num_chunks, int64_t chunk) {
  const int64_t* numels = meta + num_tensors;
  const int64_t* chunk_tensor = meta + 2 * num_tensors;
  const int64_t* chunk_start = meta + 2 * num_tensors + num_chunks;
  const int64_t t = chunk_tensor[chunk];
  const int64_t begin = chunk_start[chunk];
  return ChunkRef{t, begin, min(begin + kChunk, numels[t])};
}

template <typename scalar_t, typename acc_t>
__global__ void partial_kernel(const int64_t* __restrict__ meta, int64_t num_tensors,
                               int64_t num_chunks, int kind, double p,
                               double* __restrict__ partials) {
  const ChunkRef c = chunk_ref(meta, num_tensors, num_chunks, blockIdx.x);
  const scalar_t* x = reinterpret_cast<const scalar_t*>(meta[c.tensor]);
  const acc_t pp = static_cast<acc_t>(p);

  acc_t acc = acc_t(0);
  for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    const acc_t a = ::abs(static_cast<acc_t>(x[i]));
    acc = accumulate(acc, a, kind, pp);
  }
  const acc_t total = block_reduce<acc_t>(acc, kind);
  if (threadIdx.x == 0) partials[blockIdx.x] = static_cast<double>(total);
}

// The elements of `t` as one contiguous run, in place (see the file comment).
inline bool is_dense_span(const at::Tensor& t) {
  return t.is_contiguous() || t.is_non_overlapping_and_dense();
}

struct Group {
  c10::ScalarType dtype;
  std::vector<at::Tensor> tensors;  // non-empty; dense spans first, then contiguous copies
  int64_t num_direct = 0;           // tensors that are the inputs themselves
  int64_t meta_offset = 0;
  int64_t num_chunks = 0;
  int64_t num_direct_chunks = 0;    // chunks of the first num_direct tensors
  int64_t partial_offset = 0;
};

struct Plan {
  std::vector<Group> groups;
  at::Tensor meta;  // on the device (undefined when there is no chunk)
  int64_t total_chunks = 0;
  bool all_direct = true;
};

inline Plan make_plan(at::TensorList tensors) {
  Plan plan;
  std::vector<std::vector<at::Tensor>> copies;  // per group
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    size_t gi = 0;
    while (gi < plan.groups.size() && plan.groups[gi].dtype != t.scalar_type()) ++gi;
    if (gi == plan.groups.size()) {
      plan.groups.push_back(Group{t.scalar_type(), {}});
      copies.emplace_back();
    }
    if (is_dense_span(t)) {
      plan.groups[gi].tensors.push_back(t);
    } else {
      copies[gi].push_back(t.contiguous());
      plan.all_direct = false;
    }
  }
  int64_t meta_size = 0;
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    Group& g = plan.groups[gi];
    g.num_direct = static_cast<int64_t>(g.tensors.size());
    for (at::Tensor& c : copies[gi]) g.tensors.push_back(std::move(c));
    g.meta_offset = meta_size;
    g.partial_offset = plan.total_chunks;
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      const int64_t n = (g.tensors[i].numel() + kChunk - 1) / kChunk;
      g.num_chunks += n;
      if (static_cast<int64_t>(i) < g.num_direct) g.num_direct_chunks += n;
    }
    meta_size += 2 * static_cast<int64_t>(g.tensors.size()) + 2 * g.num_chunks;
    plan.total_chunks += g.num_chunks;
  }
  if (plan.total_chunks == 0) return plan;

  at::Tensor meta_host = at::empty(
      {meta_size}, at::TensorOptions().dtype(c10::kLong).device(c10::kCPU).pinned_memory(true));
  int64_t* m = meta_host.data_ptr<int64_t>();
  for (const Group& g : plan.groups) {
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
  plan.meta = meta_host.to(tensors[0].device(), /*non_blocking=*/true);
  return plan;
}

// One partial_kernel launch per dtype group, writing partials[0 .. total_chunks).
inline void launch_partials(const Plan& plan, int kind, double p, double* partials,
                            cudaStream_t stream, const char* op) {
  if (plan.total_chunks == 0) return;
  const int64_t* meta_dev = plan.meta.const_data_ptr<int64_t>();
  for (const Group& g : plan.groups) {
    const int64_t n = static_cast<int64_t>(g.tensors.size());
    const dim3 grid(static_cast<unsigned int>(g.num_chunks));
    const int64_t* gm = meta_dev + g.meta_offset;
    double* gp = partials + g.partial_offset;
    switch (g.dtype) {
      case c10::kFloat:
        partial_kernel<float, float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, kind, p, gp);
        break;
      case c10::kDouble:
        partial_kernel<double, double><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, kind, p, gp);
        break;
      case c10::kHalf:
        partial_kernel<c10::Half, float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, kind, p, gp);
        break;
      case c10::kBFloat16:
        partial_kernel<c10::BFloat16, float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, kind,
                                                                            p, gp);
        break;
      default:
        TORCH_CHECK(false, op, ": unsupported dtype ", g.dtype);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace torchstruct
