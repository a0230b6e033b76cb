// CUDA p-norm reduction over many tensors, shared by the torchstruct CUDA
// kernels (global_norm, clip_by_global_norm_, ...).
//
// Multi-tensor and chunked, without host synchronization and safe to capture in
// a CUDA graph:
//  1. make_plan groups the non-empty tensors by dtype. Tensors whose memory is a
//     dense span (contiguous, or a permutation of dims) are used in place and come
//     first in their group (those an in-place kernel may write); any other tensor
//     is read from a contiguous copy.
//  2. launch_partials: per dtype group, launches of `partial_kernel` whose chunk
//     tables travel as kernel arguments (multi_tensor.cuh): one block per chunk of
//     kChunk elements. The norm type is a template parameter (no branch in the
//     loop); each thread reads 16-byte vectors (when the tensor is 16-byte
//     aligned) into independent accumulators in acc_t (float for
//     float/half/bfloat16, double for double); a block reduction writes the
//     block's partial into its slot of a double workspace. The norm types are 1, 2
//     and inf (check_norm_type); a general p runs on PyTorch's ops (see common.h).
//  3. The caller reduces the partials on the device (see `reduce_partials`).
#pragma once

#include "../common.h"
#include "multi_tensor.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace torchstruct {
namespace cuda {

template <typename T>
__device__ __forceinline__ T nan_max(T acc, T a) {
  return (a > acc || a != a) ? a : acc;
}

// One element into an accumulator; the norm type is known at compile time.
template <NormKind K, typename acc_t>
__device__ __forceinline__ acc_t accumulate(acc_t acc, acc_t x) {
  const acc_t a = ::abs(x);
  if constexpr (K == NormKind::kInf) {
    return nan_max(acc, a);
  } else if constexpr (K == NormKind::kOne) {
    return acc + a;
  } else {
    return acc + a * a;
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
                                                  int kind) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc = combine(acc, partials[i], kind);
  const double r = block_reduce<double>(acc, kind);
  return kind == static_cast<int>(NormKind::kTwo) ? sqrt(r) : r;
}

using NormArgs = ChunkArgs<1, 110, 320>;

template <typename scalar_t, int kSize>
struct alignas(16) Vec {
  scalar_t val[kSize];
};

// The partial of one chunk: 16-byte vector loads (kVec elements each) into kVec
// independent accumulators, two loads in flight per thread; scalar loads with
// four accumulators when the tensor is not 16-byte aligned.
// At least 3 blocks per SM: a whole launch (up to 320 blocks) is resident at once on
// a large GPU (132 SMs on an H100), instead of a second, mostly empty wave. (sm_75
// holds 1024 threads per SM: 2 blocks there.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
#define TORCHSTRUCT_NORM_MIN_BLOCKS 2
#else
#define TORCHSTRUCT_NORM_MIN_BLOCKS 3
#endif
template <NormKind K, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, TORCHSTRUCT_NORM_MIN_BLOCKS)
    partial_kernel(NormArgs args, double* __restrict__ partials) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  constexpr int kUnroll = sizeof(scalar_t) >= 4 ? 2 : 1;  // 2-byte types: 8 accumulators already
  const Chunk c = chunk_of(args);
  const scalar_t* x = static_cast<const scalar_t*>(args.ptr[0][c.tensor]) + c.begin;

  acc_t acc[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = acc_t(0);
  int64_t tail = 0;  // first element not covered by vectors
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    using V = Vec<scalar_t, kVec>;
    const V* xv = reinterpret_cast<const V*>(x);
    const int64_t nvec = c.size / kVec;
    for (int64_t base = threadIdx.x; base < nvec; base += kThreads * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i < nvec) v[u] = xv[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * kThreads < nvec) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            acc[j] = accumulate<K>(acc[j], static_cast<acc_t>(v[u].val[j]));
          }
        }
      }
    }
    tail = nvec * kVec;
  }
  // the rest (all of it when unaligned): scalar loads, four in flight, into four
  // more accumulators (named, so that they stay in registers)
  acc_t r0 = acc_t(0), r1 = acc_t(0), r2 = acc_t(0), r3 = acc_t(0);
  int64_t i = tail + threadIdx.x;
  for (; i + 3 * kThreads < c.size; i += 4 * kThreads) {
    const acc_t a0 = static_cast<acc_t>(x[i]);
    const acc_t a1 = static_cast<acc_t>(x[i + kThreads]);
    const acc_t a2 = static_cast<acc_t>(x[i + 2 * kThreads]);
    const acc_t a3 = static_cast<acc_t>(x[i + 3 * kThreads]);
    r0 = accumulate<K>(r0, a0);
    r1 = accumulate<K>(r1, a1);
    r2 = accumulate<K>(r2, a2);
    r3 = accumulate<K>(r3, a3);
  }
  for (; i < c.size; i += kThreads) r0 = accumulate<K>(r0, static_cast<acc_t>(x[i]));
  constexpr int kind = static_cast<int>(K);
  acc_t total = combine(combine(r0, r1, kind), combine(r2, r3, kind), kind);
#pragma unroll
  for (int j = 0; j < kVec; ++j) total = combine(total, acc[j], kind);
  total = block_reduce<acc_t>(total, kind);
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
  int64_t num_chunks = 0;
  int64_t num_direct_chunks = 0;    // chunks of the first num_direct tensors
  int64_t partial_offset = 0;
};

struct Plan {
  std::vector<Group> groups;
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
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    Group& g = plan.groups[gi];
    g.num_direct = static_cast<int64_t>(g.tensors.size());
    for (at::Tensor& c : copies[gi]) g.tensors.push_back(std::move(c));
    g.partial_offset = plan.total_chunks;
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      const int64_t n = num_chunks(g.tensors[i].numel());
      g.num_chunks += n;
      if (static_cast<int64_t>(i) < g.num_direct) g.num_direct_chunks += n;
    }
    plan.total_chunks += g.num_chunks;
  }
  return plan;
}

// Calls launch(args, num_blocks) for the chunks of the first `count` tensors of a
// group, in order (launch i covers the next num_blocks chunks).
template <typename Launch>
void for_each_group_launch(const Group& g, int64_t count, Launch launch) {
  for_each_launch<NormArgs>(
      count,
      [&](NormArgs& args, int slot, int64_t i) {
        args.ptr[0][slot] = const_cast<void*>(g.tensors[i].const_data_ptr());
        args.numel[slot] = g.tensors[i].numel();
      },
      [&](int64_t i) { return g.tensors[i].numel(); }, launch);
}

template <NormKind K, typename scalar_t, typename acc_t>
void launch_partials_of(const Group& g, double* partials, cudaStream_t stream) {
  int64_t offset = 0;
  for_each_group_launch(g, static_cast<int64_t>(g.tensors.size()),
                        [&](const NormArgs& args, int blocks) {
                          partial_kernel<K, scalar_t, acc_t>
                              <<<blocks, kThreads, 0, stream>>>(args, partials + offset);
                          C10_CUDA_KERNEL_LAUNCH_CHECK();
                          offset += blocks;
                        });
}

template <NormKind K>
void launch_partials_kind(const Plan& plan, double* partials, cudaStream_t stream,
                          const char* op) {
  using acc_t = float;
  for (const Group& g : plan.groups) {
    double* gp = partials + g.partial_offset;
    switch (g.dtype) {
      case c10::kFloat:
        launch_partials_of<K, float, acc_t>(g, gp, stream);
        break;
      case c10::kDouble:
        launch_partials_of<K, double, double>(g, gp, stream);
        break;
      case c10::kHalf:
        launch_partials_of<K, c10::Half, acc_t>(g, gp, stream);
        break;
      case c10::kBFloat16:
        launch_partials_of<K, c10::BFloat16, acc_t>(g, gp, stream);
        break;
      default:
        TORCH_CHECK(false, op, ": unsupported dtype ", g.dtype);
    }
  }
}

// The partials of every chunk of every group: partials[0 .. total_chunks).
inline void launch_partials(const Plan& plan, int kind, double* partials, cudaStream_t stream,
                            const char* op) {
  if (plan.total_chunks == 0) return;
  switch (static_cast<NormKind>(kind)) {
    case NormKind::kInf:
      return launch_partials_kind<NormKind::kInf>(plan, partials, stream, op);
    case NormKind::kOne:
      return launch_partials_kind<NormKind::kOne>(plan, partials, stream, op);
    case NormKind::kTwo:
      return launch_partials_kind<NormKind::kTwo>(plan, partials, stream, op);
  }
}

}  // namespace cuda
}  // namespace torchstruct
