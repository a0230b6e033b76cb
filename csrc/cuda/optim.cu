// CUDA kernels of torchstruct::sgd_step_ and torchstruct::adamw_step_.
//
// Multi-tensor and chunked, without host synchronization:
//  1. The host builds one int64 metadata buffer: per dtype group, for each
//     tensor its pointers (param, grad, state..., mask, step) and size, and a
//     chunk table (tensor index, start element) with kChunk elements per
//     chunk; it is copied to the device from pinned memory, asynchronously on
//     the current stream.
//  2. One launch per dtype group: one block per chunk; each thread updates
//     elements begin + threadIdx.x, + blockDim.x, ... in one pass (read param,
//     grad, state, mask; write param and state). clip_coef, grad_scale and
//     found_inf are read on the device; with found_inf != 0 every block returns
//     before writing.
//  3. AdamW: a last small launch advances the step counts (not when
//     found_inf != 0). The main launch reads each count and uses count + 1, so
//     no block sees a half-updated one.
// The arithmetic is torch.optim's, with explicit rounding intrinsics (no
// contraction by the compiler) and fma where PyTorch's CPU kernels fuse;
// float16/bfloat16 compute in float32.
#include "../optim_common.h"

#include <ATen/ops/empty.h>
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

constexpr int64_t kChunk = 64 * 1024;  // elements per block
constexpr int kThreads = 512;
constexpr int kFields = 8;  // per tensor: param, grad, s0, s1, s2, mask, step, numel

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
__global__ void sgd_kernel(const int64_t* __restrict__ meta, int64_t num_tensors,
                           int64_t num_chunks, SgdArgs a,
                           SgdScalars<typename Acc<T>::type> s, Device d) {
  using C = typename Acc<T>::type;
  if (skipped(d)) return;
  const int64_t chunk = blockIdx.x;
  const int64_t* chunk_tensor = meta + kFields * num_tensors;
  const int64_t* chunk_start = chunk_tensor + num_chunks;
  const int64_t* f = meta + kFields * chunk_tensor[chunk];
  T* p = reinterpret_cast<T*>(f[0]);
  const T* g = reinterpret_cast<const T*>(f[1]);
  T* buf = reinterpret_cast<T*>(f[2]);
  const bool* mask = reinterpret_cast<const bool*>(f[5]);
  const int64_t begin = chunk_start[chunk];
  const int64_t end = min(begin + kChunk, f[7]);

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
__global__ void adamw_kernel(const int64_t* __restrict__ meta, int64_t num_tensors,
                             int64_t num_chunks, AdamArgs a,
                             AdamScalars<typename Acc<T>::type> s, Device d) {
  using C = typename Acc<T>::type;
  if (skipped(d)) return;
  const int64_t chunk = blockIdx.x;
  const int64_t* chunk_tensor = meta + kFields * num_tensors;
  const int64_t* chunk_start = chunk_tensor + num_chunks;
  const int64_t* f = meta + kFields * chunk_tensor[chunk];
  T* p = reinterpret_cast<T*>(f[0]);
  const T* g = reinterpret_cast<const T*>(f[1]);
  T* m = reinterpret_cast<T*>(f[2]);
  T* v = reinterpret_cast<T*>(f[3]);
  T* vmax = reinterpret_cast<T*>(f[4]);
  const bool* mask = reinterpret_cast<const bool*>(f[5]);
  const float* step_ptr = reinterpret_cast<const float*>(f[6]);
  const int64_t begin = chunk_start[chunk];
  const int64_t end = min(begin + kChunk, f[7]);

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

__global__ void advance_steps_kernel(const int64_t* __restrict__ step_ptrs, int64_t n, Device d) {
  if (skipped(d)) return;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float* s = reinterpret_cast<float*>(step_ptrs[i]);
    *s = __fadd_rn(*s, 1.0f);
  }
}

// ---------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------

struct Group {
  c10::ScalarType dtype;
  std::vector<int64_t> index;  // into the op's lists
  int64_t meta_offset = 0;
  int64_t num_chunks = 0;
};

int64_t ptr_of(at::TensorList list, int64_t i) {
  return list.empty() ? 0 : reinterpret_cast<int64_t>(list[i].data_ptr());
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

// Builds the metadata (on the device) of the non-empty tensors, grouped by dtype.
// `lists` are the per-tensor pointer sources, in field order 0..4 (s0..s2 may be
// empty); masks and steps fill fields 5 and 6. The returned tensor keeps the
// device copy alive until the launches are queued (the caching allocator
// orders its reuse after them on this stream).
at::Tensor build_meta(at::TensorList params, const std::vector<at::TensorList>& lists,
                      const c10::List<std::optional<at::Tensor>>& masks, at::TensorList steps,
                      std::vector<Group>* groups, int64_t* step_offset) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    Group* g = nullptr;
    for (Group& existing : *groups) {
      if (existing.dtype == params[i].scalar_type()) g = &existing;
    }
    if (g == nullptr) {
      groups->push_back(Group{params[i].scalar_type(), {}});
      g = &groups->back();
    }
    g->index.push_back(static_cast<int64_t>(i));
  }
  int64_t size = 0;
  for (Group& g : *groups) {
    g.meta_offset = size;
    for (int64_t i : g.index) g.num_chunks += (params[i].numel() + kChunk - 1) / kChunk;
    size += kFields * static_cast<int64_t>(g.index.size()) + 2 * g.num_chunks;
  }
  *step_offset = size;
  size += static_cast<int64_t>(steps.size());
  at::Tensor host = at::empty(
      {std::max<int64_t>(size, 1)},
      at::TensorOptions().dtype(c10::kLong).device(c10::kCPU).pinned_memory(true));
  int64_t* m = host.data_ptr<int64_t>();
  for (const Group& g : *groups) {
    const int64_t n = static_cast<int64_t>(g.index.size());
    int64_t* fields = m + g.meta_offset;
    int64_t* chunk_tensor = fields + kFields * n;
    int64_t* chunk_start = chunk_tensor + g.num_chunks;
    int64_t c = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = g.index[k];
      int64_t* f = fields + kFields * k;
      f[0] = reinterpret_cast<int64_t>(params[i].data_ptr());
      for (size_t l = 0; l < lists.size(); ++l) f[1 + l] = ptr_of(lists[l], i);
      for (size_t l = lists.size(); l < 4; ++l) f[1 + l] = 0;
      f[5] = 0;
      if (masks.size() > 0) {
        const std::optional<at::Tensor> mk = masks.get(i);
        if (mk.has_value() && mk->defined()) {
          f[5] = reinterpret_cast<int64_t>(mk->const_data_ptr());
        }
      }
      f[6] = steps.empty() ? 0 : reinterpret_cast<int64_t>(steps[i].data_ptr());
      f[7] = params[i].numel();
      for (int64_t s = 0; s < params[i].numel(); s += kChunk, ++c) {
        chunk_tensor[c] = k;
        chunk_start[c] = s;
      }
    }
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    m[*step_offset + static_cast<int64_t>(i)] = reinterpret_cast<int64_t>(steps[i].data_ptr());
  }
  return host.to(params[0].device(), /*non_blocking=*/true);
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
  std::vector<Group> groups;
  int64_t step_offset = 0;
  const at::Tensor meta = build_meta(params, {grads, momentum_buffers}, masks, {}, &groups,
                                     &step_offset);
  const int64_t* meta_dev = meta.const_data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SgdArgs args{momentum == 0.0 ? 0 : (first_step ? 1 : 2), nesterov ? 1 : 0};
  const SgdScalars<float> sf = sgd_scalars<float>(lr, momentum, dampening, weight_decay, maximize);
  const SgdScalars<double> sd =
      sgd_scalars<double>(lr, momentum, dampening, weight_decay, maximize);
  const Device d = device_scalars(clip_coef, grad_scale, found_inf);
  for (const Group& g : groups) {
    const int64_t n = static_cast<int64_t>(g.index.size());
    const dim3 grid(static_cast<unsigned int>(g.num_chunks));
    const int64_t* gm = meta_dev + g.meta_offset;
    switch (g.dtype) {
      case c10::kFloat:
        sgd_kernel<float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sf, d);
        break;
      case c10::kDouble:
        sgd_kernel<double><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sd, d);
        break;
      case c10::kHalf:
        sgd_kernel<c10::Half><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sf, d);
        break;
      case c10::kBFloat16:
        sgd_kernel<c10::BFloat16><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sf,
                                                                 d);
        break;
      default:
        TORCH_CHECK(false, "torchstruct::sgd_step_: unsupported dtype ", g.dtype);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
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
  std::vector<Group> groups;
  int64_t step_offset = 0;
  const at::Tensor meta = build_meta(params, {grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs},
                                     masks, steps, &groups, &step_offset);
  const int64_t* meta_dev = meta.const_data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AdamArgs args{lr, beta1, beta2, amsgrad ? 1 : 0};
  const AdamScalars<float> sf = adam_scalars<float>(lr, beta1, beta2, weight_decay, eps, maximize);
  const AdamScalars<double> sd =
      adam_scalars<double>(lr, beta1, beta2, weight_decay, eps, maximize);
  const Device d = device_scalars(clip_coef, grad_scale, found_inf);
  for (const Group& g : groups) {
    const int64_t n = static_cast<int64_t>(g.index.size());
    const dim3 grid(static_cast<unsigned int>(g.num_chunks));
    const int64_t* gm = meta_dev + g.meta_offset;
    switch (g.dtype) {
      case c10::kFloat:
        adamw_kernel<float><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sf, d);
        break;
      case c10::kDouble:
        adamw_kernel<double><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sd, d);
        break;
      case c10::kHalf:
        adamw_kernel<c10::Half><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args, sf,
                                                               d);
        break;
      case c10::kBFloat16:
        adamw_kernel<c10::BFloat16><<<grid, kThreads, 0, stream>>>(gm, n, g.num_chunks, args,
                                                                   sf, d);
        break;
      default:
        TORCH_CHECK(false, "torchstruct::adamw_step_: unsupported dtype ", g.dtype);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // Every step advances, empty tensors' included (as torch's step_t += 1).
  const int64_t nsteps = static_cast<int64_t>(steps.size());
  if (nsteps == 0) return;
  const unsigned int blocks = static_cast<unsigned int>(std::min<int64_t>((nsteps + 255) / 256, 64));
  advance_steps_kernel<<<blocks, 256, 0, stream>>>(meta_dev + step_offset, nsteps, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CUDA, m) {
  m.impl("sgd_step_", &torchstruct::sgd_step_cuda);
  m.impl("adamw_step_", &torchstruct::adamw_step_cuda);
}
