// Shared helpers for the torchstruct kernels (CPU and CUDA).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <vector>

namespace torchstruct {

// Which reduction a p-norm needs. kInf: max |x|; kOne: sum |x|; kTwo: sum x^2. The kernels
// compute these three; a general p runs on PyTorch's ops in Python, where each tensor is
// scaled by its largest element first (|x|^p leaves even double's range for ordinary values
// once p is large: 100^200 overflows, 0.001^120 underflows).
enum class NormKind : int { kInf = 0, kOne = 1, kTwo = 2 };

// The norm type checked (> 0, or inf; then one of the kernels' three).
inline NormKind check_norm_type(double p, const char* op = "torchstruct::global_norm") {
  TORCH_CHECK_VALUE(!std::isnan(p) && p > 0.0, op, ": norm_type must be > 0 (or inf), got ", p);
  if (std::isinf(p)) return NormKind::kInf;
  TORCH_CHECK_VALUE(p == 1.0 || p == 2.0, op, ": the kernels compute norm types 1, 2 and inf, ",
                    "got ", p, "; torchstruct.global_norm and torchstruct.clip_by_global_norm ",
                    "compute any p > 0 (on PyTorch's ops)");
  return p == 1.0 ? NormKind::kOne : NormKind::kTwo;
}

inline bool is_supported_float(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kDouble || t == c10::kHalf || t == c10::kBFloat16;
}

// Checks the tensor list (non-empty, one device, dense, supported dtypes) and
// returns the result dtype: float64 if any input is float64, else float32.
// `op` names the op in the messages.
inline c10::ScalarType check_float_tensors(at::TensorList tensors, const char* op) {
  TORCH_CHECK(!tensors.empty(), op, ": expected at least one tensor");
  const c10::Device device = tensors[0].device();
  c10::ScalarType out = c10::kFloat;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensor ", i, " is undefined");
    TORCH_CHECK(t.layout() == c10::kStrided, op, ": tensor ", i, " has layout ", t.layout(),
                "; only dense (strided) tensors are supported");
    TORCH_CHECK(t.device() == device, op, ": all tensors must be on one device, but tensor 0 is on ",
                device, " and tensor ", i, " is on ", t.device());
    TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op, ": tensor ", i, " has dtype ",
                     t.scalar_type(), "; supported dtypes are float32, float64, float16 and bfloat16");
    if (t.scalar_type() == c10::kDouble) out = c10::kDouble;
  }
  return out;
}

inline c10::ScalarType check_global_norm_inputs(at::TensorList tensors) {
  return check_float_tensors(tensors, "torchstruct::global_norm");
}

// The dtype torch.nn.utils.clip_grad_norm_ returns its total norm in: the
// promotion of all input dtypes (float16 alone stays float16, float16 with
// bfloat16 gives float32).
inline c10::ScalarType promoted_dtype(at::TensorList tensors) {
  c10::ScalarType out = tensors[0].scalar_type();
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].scalar_type() != out) out = c10::promoteTypes(out, tensors[i].scalar_type());
  }
  return out;
}

inline void check_max_norm(double max_norm, const char* op) {
  TORCH_CHECK_VALUE(!std::isnan(max_norm) && max_norm >= 0.0, op,
                    ": max_norm must be >= 0, got ", max_norm);
}

// In-place writes: an inference tensor may only be written inside inference
// mode (as for any in-place op); checked before anything is written.
inline void check_inplace_allowed(at::TensorList tensors, const char* op) {
  if (c10::InferenceMode::is_enabled()) return;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(!tensors[i].is_inference(), op, ": tensor ", i,
                " is an inference tensor; in-place updates to inference tensors outside "
                "InferenceMode are not allowed");
  }
}

// Bumps the version counters of tensors an op writes in place, as every in-place
// op does (autograd then refuses a backward through a value that was saved
// before the write).
inline void bump_versions(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) t.unsafeGetTensorImpl()->bump_version();
}

// torch.nn.utils.clip_grad_norm_'s coefficient, min(max_norm / (norm + 1e-6), 1),
// evaluated as torch evaluates it on a 0-dim tensor of dtype acc_t (float or
// double): (norm + 1e-6), its reciprocal, times max_norm, clamped at 1 with
// NaN propagated.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t clip_coefficient(acc_t norm, double max_norm) {
  const acc_t denom = norm + static_cast<acc_t>(1e-6);
  const acc_t coef = (acc_t(1) / denom) * static_cast<acc_t>(max_norm);
  return coef != coef ? coef : (coef < acc_t(1) ? coef : acc_t(1));
}

// Applies the root of a p-norm to the reduced value (sum or max).
inline double finish_norm(double reduced, NormKind kind) {
  return kind == NormKind::kTwo ? std::sqrt(reduced) : reduced;
}

}  // namespace torchstruct
