// CUDA kernels of torchstruct::sgd_step_ and torchstruct::adamw_step_.
//
// Multi-tensor and chunked, without host synchronization and safe to capture
// in a CUDA graph:
//  1. Per dtype group, launches whose chunk tables travel as kernel arguments
//     (multi_tensor.cuh): for each tensor its pointers (param, grad, state...,
//     mask, step) and size, and for each block its tensor and chunk of kChunk
//     elements. Nothing is staged in host or device buffers.
//  2. One block per chunk; each thread updates elements begin + threadIdx.x,
//     + blockDim.x, ... in one pass (read param, grad, state, mask; write param
//     and state). clip_coef, grad_scale and found_inf are read on the device;
//     with found_inf != 0 every block returns before writing.
//  3. AdamW: last small launches advance the step counts (not when
//     found_inf != 0). The main launches read each count and use count + 1, so
//     no block sees a half-updated one. Every parameter has its own count (a
//     shared one is refused by the checks), so no two threads advance one count.
// The checks (optim_common.h) also refuse a parameter listed twice: two blocks
// would race on its elements.
// The arithmetic is torch.optim's, with explicit rounding intrinsics (no
// contraction by the compiler) and fma where PyTorch's CPU kernels fuse;
// float16/bfloat16 compute in float32.
#include "../optim_common.h"
#include "multi_tensor.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace torchstruct {
namespace {

using cuda::Chunk;
using cuda::chunk_of;
using cuda::kChunk;
using cuda::kThreads;

// per tensor: param, grad, s0, s1, s2, mask, step (and its numel)
enum Field { kParam = 0, kGrad, kS0, kS1, kS2, kMask, kStep, kNumFields };
using StepArgs = cuda::ChunkArgs<kNumFields, 32, 256>;

// ---------------------------------------------------------------------------
// rounding-exact arithmetic in the compute type
// ---------------------------------------------------------------------------

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float fmadd(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fmadd(double a, double b, double c) { return __fma_rn(a, b, c); }

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename C, typename T>
__device__ __forceinline__ C load(T x) {
  return static_cast<C>(x);
}

template <typename T, typename C>
__device__ __forceinline__ T store(C x) {
  return static_cast<T>(x);
}

__device__ __forceinline__ double read_scalar(const void* p, int is_double) {
  return is_double ? *static_cast<const double*>(p)
                   : static_cast<double>(*static_cast<const float*>(p));
}

// Per-launch scalars read on the device: true when the step is skipped.
struct Device {
  const void* clip_coef;
  const void* grad_scale;
  const void* found_inf;
  int clip_double;
  int scale_double;
  int inf_double;
};

__device__ __forceinline__ bool skipped(const Device& d) {
  return d.found_inf != nullptr && read_scalar(d.found_inf, d.inf_double) != 0.0;
}

template <typename C>
__device__ __forceinline__ void grad_factors(const Device& d, C* inv_scale, C* clip) {
  // GradScaler unscales with inv_scale = float32(1 / float64(scale)).
  *inv_scale = d.grad_scale == nullptr
                   ? C(1)
                   : static_cast<C>(static_cast<float>(1.0 / read_scalar(d.grad_scale,
                                                                         d.scale_double)));
  *clip = d.clip_coef == nullptr ? C(1) : static_cast<C>(read_scalar(d.clip_coef, d.clip_double));
}

// ---------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------

struct SgdArgs {
  int mode;  // 0: no momentum, 1: first step, 2: momentum
  int nesterov;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(StepArgs args, SgdArgs a, SgdScalars<typename Acc<T>::type> s, Device d) {
  using C = typename Acc<T>::type;
  if (skipped(d)) return;
  const Chunk c = chunk_of(args);
  T* p = static_cast<T*>(args.ptr[kParam][c.tensor]);
  const T* g = static_cast<const T*>(args.ptr[kGrad][c.tensor]);
  T* buf = static_cast<T*>(args.ptr[kS0][c.tensor]);
  const bool* mask = static_cast<const bool*>(args.ptr[kMask][c.tensor]);
  const int64_t begin = c.begin;
  const int64_t end = c.begin + c.size;

  C inv_scale, clip;
  grad_factors(d, &inv_scale, &clip);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if (mask != nullptr && !mask[i]) continue;  // masked out: not written at all
    const C p0 = load<C>(p[i]);
    C gi = mul(mul(mul(load<C>(g[i]), inv_scale), clip), s.sign);
    if (s.has_wd) gi = fmadd(p0, s.weight_decay, gi);
    if (a.mode != 0) {
      const C b = a.mode == 1 ? gi : fmadd(gi, s.one_minus_damp, mul(load<C>(buf[i]), s.momentum));
      buf[i] = store<T>(b);
      gi = a.nesterov ? fmadd(b, s.momentum, gi) : b;
    }
    p[i] = store<T>(fmadd(gi, s.neg_lr, p0));
  }
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

struct AdamArgs {
  double lr, beta1, beta2;
  int amsgrad;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(StepArgs args, AdamArgs a, AdamScalars<typename Acc<T>::type> s, Device d) {
  using C = typename Acc<T>::type;
  if (skipped(d)) return;
  const Chunk c = chunk_of(args);
  T* p = static_cast<T*>(args.ptr[kParam][c.tensor]);
  const T* g = static_cast<const T*>(args.ptr[kGrad][c.tensor]);
  T* m = static_cast<T*>(args.ptr[kS0][c.tensor]);
  T* v = static_cast<T*>(args.ptr[kS1][c.tensor]);
  T* vmax = static_cast<T*>(args.ptr[kS2][c.tensor]);
  const bool* mask = static_cast<const bool*>(args.ptr[kMask][c.tensor]);
  const float* step_ptr = static_cast<const float*>(args.ptr[kStep][c.tensor]);
  const int64_t begin = c.begin;
  const int64_t end = c.begin + c.size;

  C inv_scale, clip;
  grad_factors(d, &inv_scale, &clip);
  // As torch.optim: step_t += 1 (float32), then the bias corrections in double.
  const double step = static_cast<double>(__fadd_rn(*step_ptr, 1.0f));
  const double bc1 = 1.0 - pow(a.beta1, step);
  const double bc2 = 1.0 - pow(a.beta2, step);
  const C neg_step_size = static_cast<C>(-(a.lr / bc1));
  const C bc2_sqrt = static_cast<C>(sqrt(bc2));

  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if (mask != nullptr && !mask[i]) continue;  // masked out: not written at all
    const C gi = mul(mul(mul(load<C>(g[i]), inv_scale), clip), s.sign);
    const C p1 = mul(load<C>(p[i]), s.decay);  // exact (x * 1) without weight decay
    const C m0 = load<C>(m[i]);
    const C m1 = s.small_w1 ? fmadd(s.w1, sub(gi, m0), m0) : fmadd(s.w1_minus_1, sub(gi, m0), gi);
    const C v1 = fmadd(mul(s.one_minus_b2, gi), gi, mul(load<C>(v[i]), s.beta2));
    C vv = v1;
    if (a.amsgrad) {
      const C vm0 = load<C>(vmax[i]);
      vv = (vm0 > v1 || vm0 != vm0) ? vm0 : v1;  // torch.maximum: NaN wins
      vmax[i] = store<T>(vv);
    }
    const C denom = add(div(sqrt_rn(vv), bc2_sqrt), s.eps);
    p[i] = store<T>(add(p1, div(mul(neg_step_size, m1), denom)));
    m[i] = store<T>(m1);
    v[i] = store<T>(v1);
  }
}

// Up to kMaxSteps distinct step counts per launch, as a kernel argument.
constexpr int kMaxSteps = 480;
struct StepPtrs {
  float* ptr[kMaxSteps];
  int n;
};
static_assert(sizeof(StepPtrs) + sizeof(Device) <= 4000, "kernel arguments are limited to 4 KiB");

__global__ void advance_steps_kernel(StepPtrs steps, Device d) {
  if (skipped(d)) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < steps.n) steps.ptr[i][0] = __fadd_rn(steps.ptr[i][0], 1.0f);
}

// ---------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------

struct Group {
  c10::ScalarType dtype;
  std::vector<int64_t> index;  // into the op's lists
};

void* ptr_of(at::TensorList list, int64_t i) {
  return list.empty() ? nullptr : list[i].data_ptr();
}

Device device_scalars(const std::optional<at::Tensor>& clip_coef,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  Device d{nullptr, nullptr, nullptr, 0, 0, 0};
  if (has(clip_coef)) {
    d.clip_coef = clip_coef->const_data_ptr();
    d.clip_double = clip_coef->scalar_type() == c10::kDouble;
  }
  if (has(grad_scale)) {
    d.grad_scale = grad_scale->const_data_ptr();
    d.scale_double = grad_scale->scalar_type() == c10::kDouble;
  }
  if (has(found_inf)) {
    d.found_inf = found_inf->const_data_ptr();
    d.inf_double = found_inf->scalar_type() == c10::kDouble;
  }
  return d;
}

// The non-empty parameters grouped by dtype, in order of first appearance.
std::vector<Group> dtype_groups(at::TensorList params) {
  std::vector<Group> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    Group* g = nullptr;
    for (Group& existing : groups) {
      if (existing.dtype == params[i].scalar_type()) g = &existing;
    }
    if (g == nullptr) {
      groups.push_back(Group{params[i].scalar_type(), {}});
      g = &groups.back();
    }
    g->index.push_back(static_cast<int64_t>(i));
  }
  return groups;
}

// Calls launch(args, num_blocks) over the chunks of a group's parameters. `lists` are the
// pointer sources of fields kGrad..kS2, in order (a state list may be empty: null).
template <typename Launch>
void for_each_step_launch(const Group& g, at::TensorList params,
                          const std::vector<at::TensorList>& lists,
                          const c10::List<std::optional<at::Tensor>>& masks, at::TensorList steps,
                          Launch launch) {
  cuda::for_each_launch<StepArgs>(
      static_cast<int64_t>(g.index.size()),
      [&](StepArgs& args, int slot, int64_t k) {
        const int64_t i = g.index[k];
        args.ptr[kParam][slot] = params[i].data_ptr();
        for (int l = 0; l < kMask - kGrad; ++l) {
          args.ptr[kGrad + l][slot] =
              l < static_cast<int>(lists.size()) ? ptr_of(lists[l], i) : nullptr;
        }
        args.ptr[kMask][slot] = nullptr;
        if (masks.size() > 0) {
          const std::optional<at::Tensor> mk = masks.get(i);
          if (mk.has_value() && mk->defined()) {
            args.ptr[kMask][slot] = const_cast<void*>(mk->const_data_ptr());
          }
        }
        args.ptr[kStep][slot] = steps.empty() ? nullptr : steps[i].data_ptr();
        args.numel[slot] = params[i].numel();
      },
      [&](int64_t k) { return params[g.index[k]].numel(); }, launch);
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   const c10::List<std::optional<at::Tensor>>& masks, double lr,
                   double momentum, double dampening, double weight_decay, bool nesterov,
                   bool maximize, bool first_step, const std::optional<at::Tensor>& clip_coef,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
  check_sgd_inputs(params, grads, momentum_buffers, masks, lr, momentum, dampening,
                   weight_decay, clip_coef, grad_scale, found_inf);
  if (params.empty()) return;
  const c10::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "torchstruct::sgd_step_: CUDA kernel called with tensors on ",
              device);
  const c10::cuda::CUDAGuard guard(device);
  const std::vector<Group> groups = dtype_groups(params);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SgdArgs args{momentum == 0.0 ? 0 : (first_step ? 1 : 2), nesterov ? 1 : 0};
  const SgdScalars<float> sf = sgd_scalars<float>(lr, momentum, dampening, weight_decay, maximize);
  const SgdScalars<double> sd =
      sgd_scalars<double>(lr, momentum, dampening, weight_decay, maximize);
  const Device d = device_scalars(clip_coef, grad_scale, found_inf);
  for (const Group& g : groups) {
    for_each_step_launch(g, params, {grads, momentum_buffers}, masks, {},
                         [&](const StepArgs& a, int blocks) {
      switch (g.dtype) {
        case c10::kFloat:
          sgd_kernel<float><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        case c10::kDouble:
          sgd_kernel<double><<<blocks, kThreads, 0, stream>>>(a, args, sd, d);
          break;
        case c10::kHalf:
          sgd_kernel<c10::Half><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        case c10::kBFloat16:
          sgd_kernel<c10::BFloat16><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        default:
          TORCH_CHECK(false, "torchstruct::sgd_step_: unsupported dtype ", g.dtype);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  bump_step_versions({params, momentum_buffers});  // also when found_inf skips on the device
}

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                     at::TensorList steps, const c10::List<std::optional<at::Tensor>>& masks,
                     double lr, double beta1, double beta2, double weight_decay, double eps,
                     bool amsgrad, bool maximize, const std::optional<at::Tensor>& clip_coef,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  check_adamw_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masks, lr,
                     beta1, beta2, weight_decay, eps, amsgrad, clip_coef, grad_scale,
                     found_inf);
  if (params.empty()) return;
  const c10::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "torchstruct::adamw_step_: CUDA kernel called with tensors on ",
              device);
  const c10::cuda::CUDAGuard guard(device);
  const std::vector<Group> groups = dtype_groups(params);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AdamArgs args{lr, beta1, beta2, amsgrad ? 1 : 0};
  const AdamScalars<float> sf = adam_scalars<float>(lr, beta1, beta2, weight_decay, eps, maximize);
  const AdamScalars<double> sd =
      adam_scalars<double>(lr, beta1, beta2, weight_decay, eps, maximize);
  const Device d = device_scalars(clip_coef, grad_scale, found_inf);
  for (const Group& g : groups) {
    for_each_step_launch(g, params, {grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs}, masks, steps,
                         [&](const StepArgs& a, int blocks) {
      switch (g.dtype) {
        case c10::kFloat:
          adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        case c10::kDouble:
          adamw_kernel<double><<<blocks, kThreads, 0, stream>>>(a, args, sd, d);
          break;
        case c10::kHalf:
          adamw_kernel<c10::Half><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        case c10::kBFloat16:
          adamw_kernel<c10::BFloat16><<<blocks, kThreads, 0, stream>>>(a, args, sf, d);
          break;
        default:
          TORCH_CHECK(false, "torchstruct::adamw_step_: unsupported dtype ", g.dtype);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  // Every step advances, empty tensors' included (as torch's step_t += 1); the counts are
  // distinct tensors (checked), so no two threads write one.
  StepPtrs ptrs;
  ptrs.n = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    ptrs.ptr[ptrs.n++] = steps[i].data_ptr<float>();
    if (ptrs.n == kMaxSteps || i + 1 == steps.size()) {
      advance_steps_kernel<<<(ptrs.n + 127) / 128, 128, 0, stream>>>(ptrs, d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      ptrs.n = 0;
    }
  }
  bump_step_versions({params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps});
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CUDA, m) {
  m.impl("sgd_step_", &torchstruct::sgd_step_cuda);
  m.impl("adamw_step_", &torchstruct::adamw_step_cuda);
}
