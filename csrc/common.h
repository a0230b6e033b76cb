// Shared helpers for the torchstruct kernels (CPU and CUDA).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <vector>

namespace torchstruct {

// Which reduction a p-norm needs. kInf: max |x|; kOne: sum |x|; kTwo: sum x^2;
// kPow: sum |x|^p.
enum class NormKind : int { kInf = 0, kOne = 1, kTwo = 2, kPow = 3 };

inline NormKind norm_kind(double p) {
  if (std::isinf(p)) return NormKind::kInf;
  if (p == 1.0) return NormKind::kOne;
  if (p == 2.0) return NormKind::kTwo;
  return NormKind::kPow;
}

inline void check_norm_type(double p) {
  TORCH_CHECK_VALUE(!std::isnan(p) && p > 0.0,
                    "torchstruct::global_norm: norm_type must be > 0 (or inf), got ", p);
}

inline bool is_supported_float(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kDouble || t == c10::kHalf || t == c10::kBFloat16;
}

// Checks the tensor list (non-empty, one device, dense, supported dtypes) and
// returns the result dtype: float64 if any input is float64, else float32.
inline c10::ScalarType check_global_norm_inputs(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "torchstruct::global_norm: expected at least one tensor");
  const c10::Device device = tensors[0].device();
  c10::ScalarType out = c10::kFloat;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "torchstruct::global_norm: tensor ", i, " is undefined");
    TORCH_CHECK(t.layout() == c10::kStrided,
                "torchstruct::global_norm: tensor ", i, " has layout ", t.layout(),
                "; only dense (strided) tensors are supported");
    TORCH_CHECK(t.device() == device,
                "torchstruct::global_norm: all tensors must be on one device, but tensor 0 is on ",
                device, " and tensor ", i, " is on ", t.device());
    TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()),
                     "torchstruct::global_norm: tensor ", i, " has dtype ", t.scalar_type(),
                     "; supported dtypes are float32, float64, float16 and bfloat16");
    if (t.scalar_type() == c10::kDouble) out = c10::kDouble;
  }
  return out;
}

// Applies the root of a p-norm to the reduced value (sum or max).
inline double finish_norm(double reduced, double p, NormKind kind) {
  switch (kind) {
    case NormKind::kInf:
    case NormKind::kOne:
      return reduced;
    case NormKind::kTwo:
      return std::sqrt(reduced);
    default:
      return std::pow(reduced, 1.0 / p);
  }
}

}  // namespace torchstruct
