// CUDA kernels of torchstruct::scale_ and torchstruct::clip_by_global_norm_.
//
// clip_by_global_norm_, with no host synchronization (all launches on the
// current stream):
//  1. every input is checked on the host (nothing is written when a check fails);
//  2. the norm partials of norm.cuh: one partial_kernel launch per dtype group;
//  3. `clip_finish_kernel` (one block) reduces the partials, writes the 0-dim
//     norm (in the promoted dtype of the grads, as clip_grad_norm_ returns it)
//     and the coefficient min(max_norm / (norm + 1e-6), 1), evaluated as torch
//     evaluates it in the accumulation dtype, into a device double;
//  4. `scale_kernel` launches per dtype group over the chunks of the tensors
//     that are dense spans (read in place; chunk tables as kernel arguments,
//     see multi_tensor.cuh): each block reads the coefficient
//     from device memory and returns at once when it is exactly 1 (x * 1 == x:
//     the result is what PyTorch's unconditional multiply gives).
// Tensors that are not dense spans (read from copies in step 2) are scaled with
// out-of-place ops on the device, the coefficient still never leaving it. When
// two entries of the list share memory (the same grad twice, as torch allows),
// step 4 runs entry by entry in list order instead, so a duplicate is
// multiplied twice, as in torch, and no two blocks write the same element.
#include "norm.cuh"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchstruct {
namespace {

using namespace torchstruct::cuda;

template <typename out_t>
__device__ __forceinline__ out_t from_double(double v) {
  if constexpr (std::is_same_v<out_t, double>) {
    return v;
  } else if constexpr (std::is_same_v<out_t, float>) {
    return static_cast<float>(v);
  } else {
    return out_t(static_cast<float>(v));
  }
}

template <typename out_t, typename acc_t>
__global__ void clip_finish_kernel(const double* __restrict__ partials, int64_t n, int kind,
                                   double max_norm, out_t* __restrict__ out,
                                   double* __restrict__ coef) {
  const double v = reduce_partials(partials, n, kind);
  if (threadIdx.x == 0) {
    *out = from_double<out_t>(v);
    *coef = static_cast<double>(clip_coefficient<acc_t>(static_cast<acc_t>(v), max_norm));
  }
}

// Multiplies the chunks of a launch in place by the coefficient (read from
// `coef_ptr` on the device, or `coef_value` when coef_ptr is null), in acc_t.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(NormArgs args, const double* __restrict__ coef_ptr, double coef_value) {
  const acc_t c = static_cast<acc_t>(coef_ptr != nullptr ? *coef_ptr : coef_value);
  if (c == acc_t(1)) return;
  const Chunk r = chunk_of(args);
  scalar_t* x = static_cast<scalar_t*>(args.ptr[0][r.tensor]) + r.begin;
  for (int64_t i = threadIdx.x; i < r.size; i += kThreads) {
    x[i] = static_cast<scalar_t>(static_cast<acc_t>(x[i]) * c);
  }
}

template <typename scalar_t, typename acc_t>
void launch_scale_of(const Group& g, const double* coef_ptr, double coef_value,
                     cudaStream_t stream) {
  // only the tensors used in place (the first num_direct of the group)
  for_each_group_launch(g, g.num_direct, [&](const NormArgs& args, int blocks) {
    scale_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(args, coef_ptr, coef_value);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_scale(const Plan& plan, const double* coef_ptr, double coef_value,
                  cudaStream_t stream) {
  for (const Group& g : plan.groups) {
    if (g.num_direct_chunks == 0) continue;
    switch (g.dtype) {
      case c10::kFloat:
        launch_scale_of<float, float>(g, coef_ptr, coef_value, stream);
        break;
      case c10::kDouble:
        launch_scale_of<double, double>(g, coef_ptr, coef_value, stream);
        break;
      case c10::kHalf:
        launch_scale_of<c10::Half, float>(g, coef_ptr, coef_value, stream);
        break;
      case c10::kBFloat16:
        launch_scale_of<c10::BFloat16, float>(g, coef_ptr, coef_value, stream);
        break;
      default:
        TORCH_CHECK(false, "torchstruct: unsupported dtype ", g.dtype);
    }
  }
}

// Checks everything that could make an in-place write fail (before any write).
void check_writable(at::TensorList tensors, const char* op) {
  check_inplace_allowed(tensors, op);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 1 && !is_dense_span(t)) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensor ", i,
                  " has elements that share memory (e.g. an expanded tensor) and cannot be "
                  "written in place");
    }
  }
}

// Whether the memory of two non-empty entries overlaps.
bool entries_overlap(at::TensorList tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(tensors.size());
  bool sorted = true;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    int64_t last = 0;  // strides are >= 0: the elements lie between the first and the last
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const uintptr_t end = begin + static_cast<uintptr_t>(last + 1) * t.element_size();
    if (!spans.empty() && begin < spans.back().second) sorted = false;
    spans.emplace_back(begin, end);
  }
  if (sorted) return false;
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

// t *= coef (a 0-dim double tensor on t's device) for a tensor that is not a
// dense span, in acc arithmetic: float for float/half/bfloat16, double for double.
void scale_strided(const at::Tensor& t, const at::Tensor& coef) {
  const c10::ScalarType acc = t.scalar_type() == c10::kDouble ? c10::kDouble : c10::kFloat;
  t.copy_(at::mul(t.to(acc), coef.to(acc)));
}

// The scale step for all of `tensors` (checked), the coefficient a 0-dim double
// tensor on their device.
void scale_all(at::TensorList tensors, const Plan& plan, const at::Tensor& coef,
               cudaStream_t stream) {
  const double* coef_dev = coef.const_data_ptr<double>();
  if (!entries_overlap(tensors)) {
    launch_scale(plan, coef_dev, 0.0, stream);
    if (!plan.all_direct) {
      for (const at::Tensor& t : tensors) {
        if (t.numel() > 0 && !is_dense_span(t)) scale_strided(t, coef);
      }
    }
    return;
  }
  // Shared memory between entries: entry by entry, in list order.
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    if (is_dense_span(t)) {
      const Plan one = make_plan(at::TensorList(&t, 1));
      launch_scale(one, coef_dev, 0.0, stream);
    } else {
      scale_strided(t, coef);
    }
  }
}

void check_cuda(at::TensorList tensors, const char* op) {
  TORCH_CHECK(tensors[0].device().is_cuda(), op, ": CUDA kernel called with tensors on ",
              tensors[0].device());
}

void scale_cuda(at::TensorList tensors, const at::Tensor& scale) {
  constexpr const char* op = "torchstruct::scale_";
  check_float_tensors(tensors, op);
  check_cuda(tensors, op);
  TORCH_CHECK(scale.defined() && scale.dim() == 0, op, ": scale must be a 0-dim tensor");
  TORCH_CHECK(scale.device().is_cpu() || scale.device() == tensors[0].device(), op,
              ": scale must be on cpu or on ", tensors[0].device(), ", got ", scale.device());
  TORCH_CHECK_TYPE(is_supported_float(scale.scalar_type()), op, ": scale has dtype ",
                   scale.scalar_type(), "; expected a floating-point dtype");
  check_writable(tensors, op);
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  bump_versions(tensors);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // A CPU scalar is read on the host (no sync); a device scalar stays there.
  const at::Tensor coef = scale.device().is_cpu()
                              ? at::empty({}, tensors[0].options().dtype(c10::kDouble))
                                    .fill_(scale.item<double>())
                              : scale.to(c10::kDouble);
  const Plan plan = make_plan(tensors);
  scale_all(tensors, plan, coef, stream);
}

at::Tensor clip_by_global_norm_cuda(at::TensorList grads, double max_norm, double norm_type) {
  constexpr const char* op = "torchstruct::clip_by_global_norm_";
  const int kind = static_cast<int>(check_norm_type(norm_type, op));
  check_max_norm(max_norm, op);
  const c10::ScalarType acc_dtype = check_float_tensors(grads, op);
  check_cuda(grads, op);
  check_writable(grads, op);
  const c10::Device device = grads[0].device();
  bump_versions(grads);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const Plan plan = make_plan(grads);
  const c10::ScalarType out_dtype = promoted_dtype(grads);
  at::Tensor out = at::empty({}, grads[0].options().dtype(out_dtype));
  at::Tensor coef = at::empty({}, grads[0].options().dtype(c10::kDouble));
  at::Tensor partials = at::empty({std::max<int64_t>(plan.total_chunks, 1)},
                                  grads[0].options().dtype(c10::kDouble));
  launch_partials(plan, kind, partials.data_ptr<double>(), stream, op);

  const double* parts = partials.const_data_ptr<double>();
  double* coef_dev = coef.data_ptr<double>();
  const int64_t n = plan.total_chunks;
#define TS_CLIP_FINISH(out_t, acc_t)                                                      \
  clip_finish_kernel<out_t, acc_t><<<1, kThreads, 0, stream>>>(                           \
      parts, n, kind, max_norm, reinterpret_cast<out_t*>(out.data_ptr()), coef_dev)
  const bool acc_double = acc_dtype == c10::kDouble;
  switch (out_dtype) {
    case c10::kDouble: TS_CLIP_FINISH(double, double); break;
    case c10::kFloat:
      if (acc_double) { TS_CLIP_FINISH(float, double); } else { TS_CLIP_FINISH(float, float); }
      break;
    case c10::kHalf: TS_CLIP_FINISH(c10::Half, float); break;
    case c10::kBFloat16: TS_CLIP_FINISH(c10::BFloat16, float); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", out_dtype);
  }
#undef TS_CLIP_FINISH
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  scale_all(grads, plan, coef, stream);
  return out;
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CUDA, m) {
  m.impl("scale_", &torchstruct::scale_cuda);
  m.impl("clip_by_global_norm_", &torchstruct::clip_by_global_norm_cuda);
}
