// Input checks and host-side scalars shared by the CPU and CUDA kernels of the
// fused optimizer steps (torchstruct::sgd_step, torchstruct::adamw_step).
//
// Both ops mutate their inputs, so every check runs before anything is
// written: a refused call has no effect.
#pragma once

#include "common.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchstruct {

// Same memory order: equal strides in every dimension of size > 1 (strides of
// size-1 dimensions do not matter). Together with "non-overlapping and dense"
// this makes element k of the storage block the same logical element in both.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

inline void check_positive_strides(const char* op, const char* what, size_t i,
                                   const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) > 0, "torchstruct::", op, ": ", what, " ", i,
                " has a non-positive stride; call .contiguous() first");
  }
}

// A list that must match `params` one to one: same shape, dtype, device and
// memory layout.
inline void check_like_params(const char* op, const char* what, at::TensorList params,
                              at::TensorList list, bool same_dtype = true) {
  TORCH_CHECK(list.size() == params.size(), "torchstruct::", op, ": expected ", params.size(),
              " ", what, ", got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    const at::Tensor& p = params[i];
    TORCH_CHECK(t.defined(), "torchstruct::", op, ": ", what, " ", i, " is undefined");
    TORCH_CHECK(t.layout() == c10::kStrided, "torchstruct::", op, ": ", what, " ", i,
                " has layout ", t.layout(), "; sparse and other non-strided tensors are "
                "not supported");
    TORCH_CHECK(t.device() == p.device(), "torchstruct::", op, ": ", what, " ", i, " is on ",
                t.device(), " but parameter ", i, " is on ", p.device());
    TORCH_CHECK(!same_dtype || t.scalar_type() == p.scalar_type(), "torchstruct::", op, ": ",
                what, " ", i, " has dtype ", t.scalar_type(), " but parameter ", i, " has ",
                p.scalar_type());
    TORCH_CHECK(t.sizes() == p.sizes(), "torchstruct::", op, ": ", what, " ", i, " has shape ",
                t.sizes(), " but parameter ", i, " has shape ", p.sizes());
    TORCH_CHECK(same_layout(t, p), "torchstruct::", op, ": ", what, " ", i, " has strides ",
                t.strides(), " but parameter ", i, " has strides ", p.strides(),
                "; they must be laid out alike");
  }
}

inline void check_params(const char* op, at::TensorList params) {
  if (params.empty()) return;
  const c10::Device device = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "torchstruct::", op, ": parameter ", i, " is undefined");
    TORCH_CHECK(p.layout() == c10::kStrided, "torchstruct::", op, ": parameter ", i,
                " has layout ", p.layout(), "; only dense (strided) tensors are supported");
    TORCH_CHECK(p.device() == device, "torchstruct::", op,
                ": all tensors must be on one device, but parameter 0 is on ", device,
                " and parameter ", i, " is on ", p.device());
    TORCH_CHECK_TYPE(is_supported_float(p.scalar_type()), "torchstruct::", op, ": parameter ",
                     i, " has dtype ", p.scalar_type(),
                     "; supported dtypes are float32, float64, float16 and bfloat16");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "torchstruct::", op, ": parameter ", i,
                " is not dense (it overlaps itself or has gaps); call .contiguous() first");
    check_positive_strides(op, "parameter", i, p);
  }
}

// masks: empty (no masks), or one optional bool tensor per parameter.
inline void check_masks(const char* op, at::TensorList params,
                        const c10::List<std::optional<at::Tensor>>& masks) {
  if (masks.size() == 0) return;
  TORCH_CHECK(masks.size() == params.size(), "torchstruct::", op, ": expected no masks or ",
              params.size(), " (one per parameter, None for none), got ", masks.size());
  for (size_t i = 0; i < masks.size(); ++i) {
    const std::optional<at::Tensor> m = masks.get(i);
    if (!m.has_value() || !m->defined()) continue;
    const at::Tensor& p = params[i];
    TORCH_CHECK_TYPE(m->scalar_type() == c10::kBool, "torchstruct::", op, ": mask ", i,
                     " has dtype ", m->scalar_type(), "; masks must be bool");
    TORCH_CHECK(m->layout() == c10::kStrided, "torchstruct::", op, ": mask ", i,
                " must be a dense tensor");
    TORCH_CHECK(m->device() == p.device(), "torchstruct::", op, ": mask ", i, " is on ",
                m->device(), " but parameter ", i, " is on ", p.device());
    TORCH_CHECK(m->sizes() == p.sizes(), "torchstruct::", op, ": mask ", i, " has shape ",
                m->sizes(), " but parameter ", i, " has shape ", p.sizes());
    TORCH_CHECK(same_layout(*m, p), "torchstruct::", op, ": mask ", i, " has strides ",
                m->strides(), " but parameter ", i, " has strides ", p.strides(),
                "; they must be laid out alike");
  }
}

// clip_coef, grad_scale, found_inf: optional one-element float32/float64
// tensors on the parameters' device.
inline void check_scalar_tensor(const char* op, const char* name,
                                const std::optional<at::Tensor>& t, c10::Device device) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->numel() == 1, "torchstruct::", op, ": ", name,
              " must have one element, got shape ", t->sizes());
  TORCH_CHECK_TYPE(t->scalar_type() == c10::kFloat || t->scalar_type() == c10::kDouble,
                   "torchstruct::", op, ": ", name, " must be float32 or float64, got ",
                   t->scalar_type());
  TORCH_CHECK(t->device() == device, "torchstruct::", op, ": ", name, " is on ", t->device(),
              " but the parameters are on ", device);
}

inline void check_hyper(const char* op, const char* name, double v, bool allow_negative = false) {
  TORCH_CHECK_VALUE(!std::isnan(v) && (allow_negative || v >= 0.0), "torchstruct::", op, ": ",
                    name, " must be ", allow_negative ? "a number" : ">= 0", ", got ", v);
}

// The first tensor (in list order) whose data pointer an earlier one has, as (earlier index,
// its index); empty tensors are skipped when `skip_empty`. Sorting, not hashing: no allocation
// per tensor.
inline std::optional<std::pair<size_t, size_t>> first_repeat(at::TensorList tensors,
                                                             bool skip_empty) {
  std::vector<std::pair<const void*, size_t>> at;
  at.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!skip_empty || tensors[i].numel() != 0) at.emplace_back(tensors[i].const_data_ptr(), i);
  }
  std::sort(at.begin(), at.end());
  std::optional<std::pair<size_t, size_t>> found;
  for (size_t k = 1; k < at.size(); ++k) {
    if (at[k].first == at[k - 1].first &&
        (!found || at[k].second < found->second)) {  // the repeat that comes first in the list
      found = std::make_pair(at[k - 1].second, at[k].second);
    }
  }
  return found;
}

// Adam step counts: one float32 one-element tensor per parameter, on its device.
inline void check_steps(const char* op, at::TensorList params, at::TensorList steps) {
  TORCH_CHECK(steps.size() == params.size(), "torchstruct::", op, ": expected ", params.size(),
              " step tensors, got ", steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1, "torchstruct::", op, ": step ", i,
                " must be a one-element tensor");
    TORCH_CHECK_TYPE(s.scalar_type() == c10::kFloat, "torchstruct::", op, ": step ", i,
                     " must be float32, got ", s.scalar_type());
    TORCH_CHECK(s.device() == params[i].device(), "torchstruct::", op, ": step ", i,
                " is on ", s.device(), " but parameter ", i, " is on ", params[i].device());
  }
  // One count per parameter: a shared one would advance several times in one call (and on
  // CUDA, several blocks would race on it).
  const auto same = first_repeat(steps, false);
  TORCH_CHECK(!same.has_value(), "torchstruct::", op, ": step ", same ? same->second : 0,
              " and step ", same ? same->first : 0, " are the same tensor; each parameter "
              "needs its own step count");
}

// Each parameter once per call: two entries with the same memory would be updated twice
// (and on CUDA, two blocks would race on the same elements).
inline void check_distinct(const char* op, at::TensorList params) {
  const auto same = first_repeat(params, true);
  TORCH_CHECK(!same.has_value(), "torchstruct::", op, ": parameter ", same ? same->second : 0,
              " shares its memory with an earlier parameter; each tensor may be stepped once "
              "per call");
}

inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The optional clip_coef, grad_scale and found_inf of a step, checked as check_scalar_tensor.
inline void check_step_scalars(const char* op, at::TensorList params,
                               const std::optional<at::Tensor>& clip_coef,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const c10::Device device = params[0].device();
  check_scalar_tensor(op, "clip_coef", clip_coef, device);
  check_scalar_tensor(op, "grad_scale", grad_scale, device);
  check_scalar_tensor(op, "found_inf", found_inf, device);
}

// All checks of sgd_step_ (CPU and CUDA), before anything is written. With
// positive strides and no gaps (checked), data_ptr() starts a parameter's
// block of numel elements, laid out alike in every matching tensor.
inline void check_sgd_inputs(at::TensorList params, at::TensorList grads,
                             at::TensorList momentum_buffers,
                             const c10::List<std::optional<at::Tensor>>& masks, double lr,
                             double momentum, double dampening, double weight_decay,
                             const std::optional<at::Tensor>& clip_coef,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf) {
  const char* op = "sgd_step";
  check_hyper(op, "lr", lr);
  check_hyper(op, "momentum", momentum);
  check_hyper(op, "dampening", dampening, true);
  check_hyper(op, "weight_decay", weight_decay);
  check_params(op, params);
  check_distinct(op, params);
  check_like_params(op, "gradients", params, grads);
  if (momentum != 0.0) {
    check_like_params(op, "momentum buffers", params, momentum_buffers);
  } else {
    TORCH_CHECK(momentum_buffers.empty(), "torchstruct::", op,
                ": momentum is 0, so no momentum buffers are expected, got ",
                momentum_buffers.size());
  }
  check_masks(op, params, masks);
  check_step_scalars(op, params, clip_coef, grad_scale, found_inf);
  check_inplace_allowed(params, "torchstruct::sgd_step: parameters");
  check_inplace_allowed(momentum_buffers, "torchstruct::sgd_step: momentum buffers");
}

// All checks of adamw_step_ (CPU and CUDA), before anything is written.
inline void check_adamw_inputs(at::TensorList params, at::TensorList grads,
                               at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                               at::TensorList max_exp_avg_sqs, at::TensorList steps,
                               const c10::List<std::optional<at::Tensor>>& masks, double lr,
                               double beta1, double beta2, double weight_decay, double eps,
                               bool amsgrad, const std::optional<at::Tensor>& clip_coef,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf) {
  const char* op = "adamw_step";
  check_hyper(op, "lr", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "torchstruct::", op,
                    ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "torchstruct::", op,
                    ": beta2 must be in [0, 1), got ", beta2);
  check_hyper(op, "weight_decay", weight_decay);
  check_hyper(op, "eps", eps);
  check_params(op, params);
  check_distinct(op, params);
  check_like_params(op, "gradients", params, grads);
  check_like_params(op, "exp_avgs", params, exp_avgs);
  check_like_params(op, "exp_avg_sqs", params, exp_avg_sqs);
  if (amsgrad) {
    check_like_params(op, "max_exp_avg_sqs", params, max_exp_avg_sqs);
  } else {
    TORCH_CHECK(max_exp_avg_sqs.empty(), "torchstruct::", op,
                ": amsgrad is off, so no max_exp_avg_sqs are expected, got ",
                max_exp_avg_sqs.size());
  }
  check_steps(op, params, steps);
  check_masks(op, params, masks);
  check_step_scalars(op, params, clip_coef, grad_scale, found_inf);
  check_inplace_allowed(params, "torchstruct::adamw_step: parameters");
  check_inplace_allowed(exp_avgs, "torchstruct::adamw_step: exp_avgs");
  check_inplace_allowed(exp_avg_sqs, "torchstruct::adamw_step: exp_avg_sqs");
  check_inplace_allowed(max_exp_avg_sqs, "torchstruct::adamw_step: max_exp_avg_sqs");
  check_inplace_allowed(steps, "torchstruct::adamw_step: steps");
}

// After a step has written them: the version counter of every tensor it writes advances, as
// after torch.optim's in-place updates, so that a backward through a value saved before the
// step (a step between forward and backward) raises instead of using the new value.
inline void bump_step_versions(std::initializer_list<at::TensorList> written) {
  for (const at::TensorList& tensors : written) bump_versions(tensors);
}

// Per-call scalars of an SGD step, rounded as PyTorch rounds them when it
// applies a Python float to a tensor of the compute type C.
template <typename C>
struct SgdScalars {
  C neg_lr;          // param.add_(grad, alpha=-lr)
  C momentum;        // buf.mul_(momentum); grad.add(buf, alpha=momentum)
  C one_minus_damp;  // buf.add_(grad, alpha=1 - dampening)
  C weight_decay;    // grad.add(param, alpha=weight_decay)
  C sign;            // -1 with maximize
  bool has_wd;
};

template <typename C>
inline SgdScalars<C> sgd_scalars(double lr, double momentum, double dampening,
                                 double weight_decay, bool maximize) {
  SgdScalars<C> s;
  s.neg_lr = static_cast<C>(-lr);
  s.momentum = static_cast<C>(momentum);
  s.one_minus_damp = static_cast<C>(1.0 - dampening);
  s.weight_decay = static_cast<C>(weight_decay);
  s.sign = maximize ? C(-1) : C(1);
  s.has_wd = weight_decay != 0.0;
  return s;
}

// Per-call scalars of an AdamW step (the per-tensor bias corrections come from
// the step counts).
template <typename C>
struct AdamScalars {
  C decay;        // param.mul_(1 - lr * weight_decay)
  C w1;           // exp_avg.lerp_(grad, 1 - beta1)
  C w1_minus_1;   // lerp's large-weight form: end + (weight - 1) * (end - start)
  bool small_w1;  // lerp: |weight| < 0.5
  C beta2;        // exp_avg_sq.mul_(beta2)
  C one_minus_b2; // .addcmul_(grad, grad, value=1 - beta2)
  C eps;
  C sign;
};

template <typename C>
inline AdamScalars<C> adam_scalars(double lr, double beta1, double beta2, double weight_decay,
                                   double eps, bool maximize) {
  AdamScalars<C> s;
  s.decay = static_cast<C>(1.0 - lr * weight_decay);
  s.w1 = static_cast<C>(1.0 - beta1);
  s.w1_minus_1 = s.w1 - C(1);
  s.small_w1 = std::abs(s.w1) < C(0.5);
  s.beta2 = static_cast<C>(beta2);
  s.one_minus_b2 = static_cast<C>(1.0 - beta2);
  s.eps = static_cast<C>(eps);
  s.sign = maximize ? C(-1) : C(1);
  return s;
}

}  // namespace torchstruct
