// CPU kernels of torchstruct::sgd_step and torchstruct::adamw_step.
//
// One call walks every tensor once: the tensors are cut into work chunks (at
// most kChunk elements, never spanning two tensors), at::parallel_for runs over
// the chunks, and each chunk reads param, grad, state (and mask) and writes
// param and state in one loop written so that g++ -O3 vectorizes it. The
// arithmetic follows torch.optim's single-tensor implementations operation by
// operation, with each Python-float hyper-parameter rounded to the compute type
// as PyTorch rounds it, and a * b + c fused where PyTorch's vectorized kernels
// fuse it. float16/bfloat16 tensors are computed in float32 and rounded once
// when stored; float64 in double.
//
// Masks: a masked-out element is written back with its old bits (a select, not
// a branch), so it stays bitwise unchanged, state included.
// found_inf != 0: nothing is written (checked on the host: the tensor is on the
// CPU). Step counts advance after the loop, so no chunk sees a half-updated one.
// Every tensor written has its version counter advanced (not after a skipped step).
#include "../optim_common.h"
#include "elements.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#endif

// The chunk functions are compiled three times on x86-64 with GCC or clang:
// for AVX-512, for AVX2 + FMA and for the baseline; the first call picks by the
// running CPU's features. (target_clones("arch=...") would test the CPU model,
// not its features.)
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define TS_DISPATCH 1
#define TS_TARGET_FMA __attribute__((target("avx2,fma")))
#define TS_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#else
#define TS_DISPATCH 0
#define TS_TARGET_FMA
#endif

namespace torchstruct {
namespace {

using cpu::kChunk;
using cpu::kGrainElems;
using cpu::load;
using cpu::store;

// ---------------------------------------------------------------------------
// element access in the compute type
// ---------------------------------------------------------------------------

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};


// a * b + c rounded once, where PyTorch's CPU kernels fuse (add with alpha,
// lerp, addcmul): an instruction in the AVX2 + FMA variant, a libm call in the
// x86-64 baseline one (CPUs without FMA are rare).
TS_ALWAYS_INLINE float fmadd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
TS_ALWAYS_INLINE double fmadd(double a, double b, double c) { return __builtin_fma(a, b, c); }

// torch.maximum: NaN in either argument gives NaN.
template <typename C>
TS_ALWAYS_INLINE C nan_maximum(C a, C b) {
  const bool pick_a = (a > b) | (a != a);  // no short circuit: no branch
  return pick_a ? a : b;
}

// ---------------------------------------------------------------------------
// work list
// ---------------------------------------------------------------------------

struct Item {
  char* param;
  const char* grad;
  char* s0;  // SGD: momentum buffer; AdamW: exp_avg
  char* s1;  // AdamW: exp_avg_sq
  char* s2;  // AdamW: max_exp_avg_sq
  const uint8_t* mask;
  c10::ScalarType dtype;
  int64_t itemsize;
  // AdamW, per tensor: -lr / bias_correction1 and sqrt(bias_correction2)
  double neg_step_size;
  double bc2_sqrt;
};

#if TS_DISPATCH
bool cpu_has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
bool cpu_has_avx512() {
  static const bool yes = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq");
  return yes;
}
#endif

struct Work {
  int64_t item;
  int64_t start;
  int64_t n;
};

char* ptr_or_null(at::TensorList list, size_t i) {
  return list.empty() ? nullptr : static_cast<char*>(list[i].data_ptr());
}

// The fields of parameter i that every step fills the same way (state pointers left null).
Item make_item(at::TensorList params, at::TensorList grads,
               const c10::List<std::optional<at::Tensor>>& masks, size_t i) {
  Item it{};
  it.param = static_cast<char*>(params[i].data_ptr());
  it.grad = static_cast<const char*>(grads[i].const_data_ptr());
  if (masks.size() > 0) {
    const std::optional<at::Tensor> m = masks.get(i);
    if (m.has_value() && m->defined()) {
      it.mask = reinterpret_cast<const uint8_t*>(m->const_data_ptr<bool>());
    }
  }
  it.dtype = params[i].scalar_type();
  it.itemsize = static_cast<int64_t>(params[i].element_size());
  return it;
}

double read_scalar(const std::optional<at::Tensor>& t, double absent) {
  if (!has(t)) return absent;
  return t->scalar_type() == c10::kDouble ? *t->const_data_ptr<double>()
                                          : static_cast<double>(*t->const_data_ptr<float>());
}

// GradScaler unscales with inv_scale = float32(1 / float64(scale)).
double inverse_scale(const std::optional<at::Tensor>& grad_scale) {
  if (!has(grad_scale)) return 1.0;
  return static_cast<double>(static_cast<float>(1.0 / read_scalar(grad_scale, 1.0)));
}

std::vector<Work> make_work(const std::vector<Item>& items, at::TensorList params,
                            int64_t* total) {
  std::vector<Work> work;
  *total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t n = params[i].numel();
    for (int64_t s = 0; s < n; s += kChunk) {
      work.push_back(Work{static_cast<int64_t>(i), s, std::min(kChunk, n - s)});
    }
    *total += n;
  }
  return work;
}

template <typename F>
void run_parallel(const std::vector<Work>& work, int64_t total, const F& fn) {
  if (work.empty()) return;
  const int64_t nwork = static_cast<int64_t>(work.size());
  const int64_t grain = std::max<int64_t>(1, (kGrainElems * nwork + total - 1) / total);
  at::parallel_for(0, nwork, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) fn(work[w]);
  });
}

template <typename T>
TS_ALWAYS_INLINE T* at_elem(char* base, int64_t start) {
  return base == nullptr ? nullptr : reinterpret_cast<T*>(base) + start;
}
template <typename T>
TS_ALWAYS_INLINE const T* at_elem(const char* base, int64_t start) {
  return base == nullptr ? nullptr : reinterpret_cast<const T*>(base) + start;
}

// ---------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------

enum MomentumMode : int { kNoMomentum = 0, kFirstStep = 1, kMomentum = 2 };

template <typename C>
struct SgdCall {
  SgdScalars<C> s;
  C inv_scale;
  C clip;
};

template <typename T, typename C, bool kMask, int kMode, bool kNesterov>
TS_ALWAYS_INLINE void sgd_loop(T* __restrict p, const T* __restrict g, T* __restrict buf,
                               const uint8_t* __restrict mask, int64_t n,
                               const SgdCall<C>& c) {
  const SgdScalars<C> s = c.s;
  const C inv_scale = c.inv_scale;
  const C clip = c.clip;
  for (int64_t i = 0; i < n; ++i) {
    const C p0 = load(p[i]);
    C gi = load(g[i]) * inv_scale;
    gi = gi * clip;
    gi = gi * s.sign;
    const C decayed = fmadd(p0, s.weight_decay, gi);  // grad.add(param, alpha=wd)
    gi = s.has_wd ? decayed : gi;
    C b = C(0);
    if constexpr (kMode == kFirstStep) {
      b = gi;
    } else if constexpr (kMode == kMomentum) {
      b = fmadd(gi, s.one_minus_damp, load(buf[i]) * s.momentum);
    }
    if constexpr (kMode != kNoMomentum) {
      if constexpr (kNesterov) {
        gi = fmadd(b, s.momentum, gi);
      } else {
        gi = b;
      }
    }
    const C p1 = fmadd(gi, s.neg_lr, p0);
    if constexpr (kMask) {
      const bool keep = mask[i] == 0;
      p[i] = keep ? p[i] : store<T>(p1);
      if constexpr (kMode != kNoMomentum) buf[i] = keep ? buf[i] : store<T>(b);
    } else {
      p[i] = store<T>(p1);
      if constexpr (kMode != kNoMomentum) buf[i] = store<T>(b);
    }
  }
}

template <typename T, bool kMask, int kMode>
TS_ALWAYS_INLINE void sgd_typed(const Item& it, const Work& w, bool nesterov,
                                const SgdCall<typename Acc<T>::type>& c) {
  T* p = at_elem<T>(it.param, w.start);
  const T* g = at_elem<T>(it.grad, w.start);
  T* b = at_elem<T>(it.s0, w.start);
  const uint8_t* m = it.mask == nullptr ? nullptr : it.mask + w.start;
  if (nesterov) {
    sgd_loop<T, typename Acc<T>::type, kMask, kMode, true>(p, g, b, m, w.n, c);
  } else {
    sgd_loop<T, typename Acc<T>::type, kMask, kMode, false>(p, g, b, m, w.n, c);
  }
}

template <bool kMask, int kMode>
TS_ALWAYS_INLINE void sgd_dtype(const Item& it, const Work& w, bool nesterov,
                                const SgdCall<float>& cf, const SgdCall<double>& cd) {
  switch (it.dtype) {
    case c10::kFloat: sgd_typed<float, kMask, kMode>(it, w, nesterov, cf); break;
    case c10::kDouble: sgd_typed<double, kMask, kMode>(it, w, nesterov, cd); break;
    case c10::kHalf: sgd_typed<c10::Half, kMask, kMode>(it, w, nesterov, cf); break;
    case c10::kBFloat16: sgd_typed<c10::BFloat16, kMask, kMode>(it, w, nesterov, cf); break;
    default: break;  // rejected by the checks
  }
}

TS_ALWAYS_INLINE void sgd_chunk_impl(const Item& it, const Work& w, int mode, bool nesterov,
                                     const SgdCall<float>& cf, const SgdCall<double>& cd) {
  const bool masked = it.mask != nullptr;
  switch (mode) {
    case kNoMomentum:
      masked ? sgd_dtype<true, kNoMomentum>(it, w, nesterov, cf, cd)
             : sgd_dtype<false, kNoMomentum>(it, w, nesterov, cf, cd);
      break;
    case kFirstStep:
      masked ? sgd_dtype<true, kFirstStep>(it, w, nesterov, cf, cd)
             : sgd_dtype<false, kFirstStep>(it, w, nesterov, cf, cd);
      break;
    default:
      masked ? sgd_dtype<true, kMomentum>(it, w, nesterov, cf, cd)
             : sgd_dtype<false, kMomentum>(it, w, nesterov, cf, cd);
  }
}

void sgd_chunk_base(const Item& it, const Work& w, int mode, bool nesterov,
                    const SgdCall<float>& cf, const SgdCall<double>& cd) {
  sgd_chunk_impl(it, w, mode, nesterov, cf, cd);
}
#if TS_DISPATCH
TS_TARGET_FMA void sgd_chunk_fma(const Item& it, const Work& w, int mode, bool nesterov,
                                 const SgdCall<float>& cf, const SgdCall<double>& cd) {
  sgd_chunk_impl(it, w, mode, nesterov, cf, cd);
}
TS_TARGET_AVX512 void sgd_chunk_avx512(const Item& it, const Work& w, int mode, bool nesterov,
                                       const SgdCall<float>& cf, const SgdCall<double>& cd) {
  sgd_chunk_impl(it, w, mode, nesterov, cf, cd);
}
#endif

void sgd_chunk(const Item& it, const Work& w, int mode, bool nesterov, const SgdCall<float>& cf,
               const SgdCall<double>& cd) {
#if TS_DISPATCH
  if (cpu_has_avx512()) return sgd_chunk_avx512(it, w, mode, nesterov, cf, cd);
  if (cpu_has_avx2_fma()) return sgd_chunk_fma(it, w, mode, nesterov, cf, cd);
#endif
  sgd_chunk_base(it, w, mode, nesterov, cf, cd);
}

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  const c10::List<std::optional<at::Tensor>>& masks, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool maximize,
                  bool first_step, const std::optional<at::Tensor>& clip_coef,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) {
  check_sgd_inputs(params, grads, momentum_buffers, masks, lr, momentum, dampening,
                   weight_decay, clip_coef, grad_scale, found_inf);
  if (params.empty()) return;
  TORCH_CHECK(params[0].device().is_cpu(), "torchstruct::sgd_step: CPU kernel called with "
              "tensors on ", params[0].device());
  if (read_scalar(found_inf, 0.0) != 0.0) return;  // skipped step: nothing changes

  std::vector<Item> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    Item& it = items[i] = make_item(params, grads, masks, i);
    it.s0 = ptr_or_null(momentum_buffers, i);
  }
  const double inv = inverse_scale(grad_scale);
  const double clip = read_scalar(clip_coef, 1.0);
  SgdCall<float> cf{sgd_scalars<float>(lr, momentum, dampening, weight_decay, maximize),
                    static_cast<float>(inv), static_cast<float>(clip)};
  SgdCall<double> cd{sgd_scalars<double>(lr, momentum, dampening, weight_decay, maximize),
                     inv, clip};
  const int mode = momentum == 0.0 ? kNoMomentum : (first_step ? kFirstStep : kMomentum);
  int64_t total = 0;
  const std::vector<Work> work = make_work(items, params, &total);
  run_parallel(work, total, [&](const Work& w) {
    sgd_chunk(items[w.item], w, mode, nesterov, cf, cd);
  });
  bump_step_versions({params, momentum_buffers});
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

template <typename C>
struct AdamCall {
  AdamScalars<C> s;
  C inv_scale;
  C clip;
};

constexpr int64_t kBlock = 256;  // elements per AdamW block (its buffers stay in L1)

// In-place sqrt of n values. GCC does not vectorize sqrt while errno handling
// is on (the default for this build), so the lanes are written out with SSE2,
// the x86-64 baseline (IEEE sqrt: the same bits as std::sqrt).
TS_ALWAYS_INLINE void sqrt_block(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}
TS_ALWAYS_INLINE void sqrt_block(double* x, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  for (; i + 2 <= n; i += 2) _mm_storeu_pd(x + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

// One block of at most kBlock elements, in three passes over L1 buffers:
// moments, decayed parameter and the sqrt argument; the sqrt; then the
// parameter update and the stores. A product that PyTorch rounds before an
// add always crosses a buffer, so -ffp-contract cannot fuse the two.
template <typename T, typename C, bool kMask, bool kAms, bool kSmallW1>
TS_ALWAYS_INLINE void adamw_block(T* __restrict p, const T* __restrict g, T* __restrict m,
                                  T* __restrict v, T* __restrict vmax,
                                  const uint8_t* __restrict mask, int64_t n,
                                  const AdamCall<C>& c, C neg_step_size, C bc2_sqrt) {
  const AdamScalars<C> s = c.s;
  const C inv_scale = c.inv_scale;
  const C clip = c.clip;
  alignas(64) C mb[kBlock];
  alignas(64) C vb[kBlock];
  alignas(64) C vmb[kAms ? kBlock : 1];
  alignas(64) C db[kBlock];
  alignas(64) C pb[kBlock];
  for (int64_t i = 0; i < n; ++i) {
    // param.mul_(1 - lr * wd) is rounded on its own: kept in a buffer so that the
    // compiler cannot fuse it with the later add (exact x * 1 without decay).
    pb[i] = load(p[i]) * s.decay;
    C gi = load(g[i]) * inv_scale;
    gi = gi * clip;
    gi = gi * s.sign;
    const C m0 = load(m[i]);
    C m1;
    if constexpr (kSmallW1) {
      m1 = fmadd(s.w1, gi - m0, m0);
    } else {
      m1 = fmadd(s.w1_minus_1, gi - m0, gi);
    }
    const C v1 = fmadd(s.one_minus_b2 * gi, gi, load(v[i]) * s.beta2);
    mb[i] = m1;
    vb[i] = v1;
    if constexpr (kAms) {
      const C vm1 = nan_maximum(load(vmax[i]), v1);
      vmb[i] = vm1;
      db[i] = vm1;
    } else {
      db[i] = v1;
    }
  }
  sqrt_block(db, n);
  for (int64_t i = 0; i < n; ++i) {
    const C denom = db[i] / bc2_sqrt + s.eps;
    const C p2 = pb[i] + neg_step_size * mb[i] / denom;
    if constexpr (kMask) {
      const bool keep = mask[i] == 0;
      p[i] = keep ? p[i] : store<T>(p2);
      m[i] = keep ? m[i] : store<T>(mb[i]);
      v[i] = keep ? v[i] : store<T>(vb[i]);
      if constexpr (kAms) vmax[i] = keep ? vmax[i] : store<T>(vmb[i]);
    } else {
      p[i] = store<T>(p2);
      m[i] = store<T>(mb[i]);
      v[i] = store<T>(vb[i]);
      if constexpr (kAms) vmax[i] = store<T>(vmb[i]);
    }
  }
}

template <typename T, typename C, bool kMask, bool kAms, bool kSmallW1>
TS_ALWAYS_INLINE void adamw_loop(T* p, const T* g, T* m, T* v, T* vmax, const uint8_t* mask,
                                 int64_t n, const AdamCall<C>& c, C neg_step_size,
                                 C bc2_sqrt) {
  for (int64_t b = 0; b < n; b += kBlock) {
    adamw_block<T, C, kMask, kAms, kSmallW1>(
        p + b, g + b, m + b, v + b, kAms ? vmax + b : nullptr,
        kMask ? mask + b : nullptr, std::min(kBlock, n - b), c, neg_step_size, bc2_sqrt);
  }
}

template <typename T, bool kMask, bool kAms>
TS_ALWAYS_INLINE void adamw_typed(const Item& it, const Work& w,
                                  const AdamCall<typename Acc<T>::type>& c) {
  using C = typename Acc<T>::type;
  T* p = at_elem<T>(it.param, w.start);
  const T* g = at_elem<T>(it.grad, w.start);
  T* m = at_elem<T>(it.s0, w.start);
  T* v = at_elem<T>(it.s1, w.start);
  T* vm = at_elem<T>(it.s2, w.start);
  const uint8_t* mk = it.mask == nullptr ? nullptr : it.mask + w.start;
  const C nss = static_cast<C>(it.neg_step_size);
  const C bc2 = static_cast<C>(it.bc2_sqrt);
  if (c.s.small_w1) {
    adamw_loop<T, C, kMask, kAms, true>(p, g, m, v, vm, mk, w.n, c, nss, bc2);
  } else {
    adamw_loop<T, C, kMask, kAms, false>(p, g, m, v, vm, mk, w.n, c, nss, bc2);
  }
}

template <bool kMask, bool kAms>
TS_ALWAYS_INLINE void adamw_dtype(const Item& it, const Work& w, const AdamCall<float>& cf,
                                  const AdamCall<double>& cd) {
  switch (it.dtype) {
    case c10::kFloat: adamw_typed<float, kMask, kAms>(it, w, cf); break;
    case c10::kDouble: adamw_typed<double, kMask, kAms>(it, w, cd); break;
    case c10::kHalf: adamw_typed<c10::Half, kMask, kAms>(it, w, cf); break;
    case c10::kBFloat16: adamw_typed<c10::BFloat16, kMask, kAms>(it, w, cf); break;
    default: break;  // rejected by the checks
  }
}

TS_ALWAYS_INLINE void adamw_chunk_impl(const Item& it, const Work& w, bool amsgrad,
                                       const AdamCall<float>& cf, const AdamCall<double>& cd) {
  const bool masked = it.mask != nullptr;
  if (masked) {
    amsgrad ? adamw_dtype<true, true>(it, w, cf, cd) : adamw_dtype<true, false>(it, w, cf, cd);
  } else {
    amsgrad ? adamw_dtype<false, true>(it, w, cf, cd) : adamw_dtype<false, false>(it, w, cf, cd);
  }
}

#if TS_DISPATCH
// The float32, unmasked AdamW update in one pass with AVX2 + FMA intrinsics:
// the same IEEE operations in the same order as adamw_block (so the same
// bits), but with a vector sqrt (the compiler only vectorizes sqrt without
// errno handling), which keeps the loop at memory speed. The tail goes through
// adamw_block.
template <bool kAms, bool kSmallW1>
TS_TARGET_FMA void adamw_float_avx2(float* __restrict p, const float* __restrict g,
                                    float* __restrict m, float* __restrict v,
                                    float* __restrict vmax, int64_t n,
                                    const AdamCall<float>& c, float neg_step_size,
                                    float bc2_sqrt) {
  const AdamScalars<float> s = c.s;
  const __m256 inv = _mm256_set1_ps(c.inv_scale), clip = _mm256_set1_ps(c.clip);
  const __m256 sign = _mm256_set1_ps(s.sign), decay = _mm256_set1_ps(s.decay);
  const __m256 w = _mm256_set1_ps(kSmallW1 ? s.w1 : s.w1_minus_1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 eps = _mm256_set1_ps(s.eps), bc2 = _mm256_set1_ps(bc2_sqrt);
  const __m256 nss = _mm256_set1_ps(neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), inv);
    gi = _mm256_mul_ps(_mm256_mul_ps(gi, clip), sign);
    __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    asm("" : "+x"(p1));  // rounded on its own, as param.mul_() is: no fusing below
    const __m256 m0 = _mm256_loadu_ps(m + i);
    const __m256 diff = _mm256_sub_ps(gi, m0);
    const __m256 m1 = _mm256_fmadd_ps(w, diff, kSmallW1 ? m0 : gi);
    const __m256 v1 =
        _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    __m256 vv = v1;
    if constexpr (kAms) {
      const __m256 vm0 = _mm256_loadu_ps(vmax + i);
      // torch.maximum: NaN in either wins (max_ps returns its second operand then)
      vv = _mm256_max_ps(v1, vm0);
      vv = _mm256_blendv_ps(vv, v1, _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
      _mm256_storeu_ps(vmax + i, vv);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), bc2), eps);
    const __m256 p2 = _mm256_add_ps(p1, _mm256_div_ps(_mm256_mul_ps(nss, m1), denom));
    _mm256_storeu_ps(p + i, p2);
    _mm256_storeu_ps(m + i, m1);
    _mm256_storeu_ps(v + i, v1);
  }
  if (i < n) {
    adamw_block<float, float, false, kAms, kSmallW1>(p + i, g + i, m + i, v + i,
                                                     kAms ? vmax + i : nullptr, nullptr, n - i,
                                                     c, neg_step_size, bc2_sqrt);
  }
}

// True when the chunk took the intrinsic path (float32, no mask).
TS_TARGET_FMA bool adamw_chunk_float_avx2(const Item& it, const Work& w, bool amsgrad,
                                          const AdamCall<float>& cf) {
  if (it.dtype != c10::kFloat || it.mask != nullptr) return false;
  float* p = at_elem<float>(it.param, w.start);
  const float* g = at_elem<float>(it.grad, w.start);
  float* m = at_elem<float>(it.s0, w.start);
  float* v = at_elem<float>(it.s1, w.start);
  float* vm = at_elem<float>(it.s2, w.start);
  const float nss = static_cast<float>(it.neg_step_size);
  const float bc2 = static_cast<float>(it.bc2_sqrt);
  if (cf.s.small_w1) {
    amsgrad ? adamw_float_avx2<true, true>(p, g, m, v, vm, w.n, cf, nss, bc2)
            : adamw_float_avx2<false, true>(p, g, m, v, vm, w.n, cf, nss, bc2);
  } else {
    amsgrad ? adamw_float_avx2<true, false>(p, g, m, v, vm, w.n, cf, nss, bc2)
            : adamw_float_avx2<false, false>(p, g, m, v, vm, w.n, cf, nss, bc2);
  }
  return true;
}
#endif

void adamw_chunk_base(const Item& it, const Work& w, bool amsgrad, const AdamCall<float>& cf,
                      const AdamCall<double>& cd) {
  adamw_chunk_impl(it, w, amsgrad, cf, cd);
}
#if TS_DISPATCH
TS_TARGET_FMA void adamw_chunk_fma(const Item& it, const Work& w, bool amsgrad,
                                   const AdamCall<float>& cf, const AdamCall<double>& cd) {
  adamw_chunk_impl(it, w, amsgrad, cf, cd);
}
TS_TARGET_AVX512 void adamw_chunk_avx512(const Item& it, const Work& w, bool amsgrad,
                                         const AdamCall<float>& cf, const AdamCall<double>& cd) {
  adamw_chunk_impl(it, w, amsgrad, cf, cd);
}
#endif

void adamw_chunk(const Item& it, const Work& w, bool amsgrad, const AdamCall<float>& cf,
                 const AdamCall<double>& cd) {
#if TS_DISPATCH
  if (cpu_has_avx2_fma() && adamw_chunk_float_avx2(it, w, amsgrad, cf)) return;
  if (cpu_has_avx512()) return adamw_chunk_avx512(it, w, amsgrad, cf, cd);
  if (cpu_has_avx2_fma()) return adamw_chunk_fma(it, w, amsgrad, cf, cd);
#endif
  adamw_chunk_base(it, w, amsgrad, cf, cd);
}

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
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
  TORCH_CHECK(params[0].device().is_cpu(), "torchstruct::adamw_step: CPU kernel called with "
              "tensors on ", params[0].device());
  if (read_scalar(found_inf, 0.0) != 0.0) return;  // skipped step: nothing changes

  std::vector<Item> items(params.size());
  std::vector<float> new_steps(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    Item& it = items[i] = make_item(params, grads, masks, i);
    it.s0 = static_cast<char*>(exp_avgs[i].data_ptr());
    it.s1 = static_cast<char*>(exp_avg_sqs[i].data_ptr());
    it.s2 = ptr_or_null(max_exp_avg_sqs, i);
    // As torch.optim: step_t += 1 (float32), then the bias corrections in double.
    const float step = *steps[i].const_data_ptr<float>() + 1.0f;
    new_steps[i] = step;
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    it.neg_step_size = -(lr / bc1);
    it.bc2_sqrt = std::pow(bc2, 0.5);
  }
  const double inv = inverse_scale(grad_scale);
  const double clip = read_scalar(clip_coef, 1.0);
  AdamCall<float> cf{adam_scalars<float>(lr, beta1, beta2, weight_decay, eps, maximize),
                     static_cast<float>(inv), static_cast<float>(clip)};
  AdamCall<double> cd{adam_scalars<double>(lr, beta1, beta2, weight_decay, eps, maximize), inv,
                      clip};
  int64_t total = 0;
  const std::vector<Work> work = make_work(items, params, &total);
  run_parallel(work, total, [&](const Work& w) {
    adamw_chunk(items[w.item], w, amsgrad, cf, cd);
  });
  for (size_t i = 0; i < steps.size(); ++i) *steps[i].data_ptr<float>() = new_steps[i];
  bump_step_versions({params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps});
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CPU, m) {
  m.impl("sgd_step_", &torchstruct::sgd_step_cpu);
  m.impl("adamw_step_", &torchstruct::adamw_step_cpu);
}
