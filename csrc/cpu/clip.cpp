// CPU kernels of torchstruct::scale_ and torchstruct::clip_by_global_norm_.
//
// clip_by_global_norm_ is one call: every input is checked first (nothing is
// written when a check fails), then the chunked parallel reduction of norm.h
// gives the global norm, the coefficient min(max_norm / (norm + 1e-6), 1) is
// evaluated exactly as torch.nn.utils.clip_grad_norm_ evaluates it, and one
// at::parallel_for over the chunks of all tensors multiplies them in place.
//
// When the coefficient is exactly 1 (no clipping needed) the scale pass is
// skipped: PyTorch always multiplies, and x * 1 == x for every value, so the
// result is identical while the gradients are read once instead of read,
// read and written.
//
// A tensor whose memory is a dense span (contiguous, or a permutation of dims)
// is scaled in place through its span; any other strided tensor (e.g. a slice
// with gaps) is read from a contiguous copy for the norm and scaled with
// Tensor::mul_. A tensor that overlaps itself (e.g. expanded) is rejected. When
// two entries of the list share memory (the same gradient listed twice, as
// torch allows), the scale runs entry by entry in list order, so a duplicate
// is multiplied twice, exactly as torch does.
#include "norm.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace torchstruct {
namespace {

using cpu::Chunk;

// ---------------------------------------------------------------------------
// In-place scale of one chunk (vectorized by g++ -O3; baseline and AVX2 clones)
// ---------------------------------------------------------------------------

using cpu::bf16_bits_to_float;
using cpu::float_to_bf16_bits;

TS_TARGET_CLONES void scale_chunk(const Chunk& c, double s) {
  const int64_t n = c.numel;
  switch (c.dtype) {
    case c10::kFloat: {
      float* __restrict x = static_cast<float*>(c.data);
      const float f = static_cast<float>(s);
      for (int64_t i = 0; i < n; ++i) x[i] *= f;
      break;
    }
    case c10::kDouble: {
      double* __restrict x = static_cast<double*>(c.data);
      for (int64_t i = 0; i < n; ++i) x[i] *= s;
      break;
    }
    case c10::kBFloat16: {
      uint16_t* __restrict x = static_cast<uint16_t*>(c.data);
      const float f = static_cast<float>(s);
      for (int64_t i = 0; i < n; ++i) x[i] = float_to_bf16_bits(bf16_bits_to_float(x[i]) * f);
      break;
    }
    case c10::kHalf: {
      c10::Half* __restrict x = static_cast<c10::Half*>(c.data);
      const float f = static_cast<float>(s);
      for (int64_t i = 0; i < n; ++i) x[i] = static_cast<c10::Half>(static_cast<float>(x[i]) * f);
      break;
    }
    default:
      break;  // excluded by the input checks
  }
}

void scale_chunks_parallel(const std::vector<Chunk>& chunks, double s, int64_t total) {
  if (chunks.empty()) return;
  const int64_t n = static_cast<int64_t>(chunks.size());
  at::parallel_for(0, n, cpu::chunk_grain(n, total), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) scale_chunk(chunks[i], s);
  });
}

// ---------------------------------------------------------------------------
// Plan: the checked tensors cut into chunks
// ---------------------------------------------------------------------------

struct Plan {
  std::vector<Chunk> chunks;          // every non-empty tensor (copies for non-span ones)
  std::vector<at::Tensor> owned;      // contiguous copies, alive for the call
  std::vector<int64_t> first_chunk;   // per tensor, index of its first chunk (size n + 1)
  std::vector<char> direct;           // per tensor: its chunks are its own memory
  int64_t total = 0;                  // elements
  bool all_direct = true;
};

// Checks everything that could make the scale fail (before anything is written).
void check_writable(at::TensorList tensors, const char* op) {
  check_inplace_allowed(tensors, op);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 1 && !cpu::is_dense_span(t)) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensor ", i,
                  " has elements that share memory (e.g. an expanded tensor) and cannot be "
                  "written in place");
    }
  }
}

Plan make_plan(at::TensorList tensors) {
  Plan plan;
  const size_t n = tensors.size();
  plan.chunks.reserve(n);
  plan.first_chunk.resize(n + 1);
  plan.direct.assign(n, 1);
  for (size_t i = 0; i < n; ++i) {
    plan.first_chunk[i] = static_cast<int64_t>(plan.chunks.size());
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    if (!cpu::append_tensor(t, plan.chunks, plan.owned)) {
      plan.direct[i] = 0;
      plan.all_direct = false;
    }
    plan.total += t.numel();
  }
  plan.first_chunk[n] = static_cast<int64_t>(plan.chunks.size());
  return plan;
}

// Whether the memory of two non-empty entries overlaps (the same tensor listed
// twice, or overlapping views).
bool entries_overlap(at::TensorList tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) in bytes
  spans.reserve(tensors.size());
  bool sorted = true;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    uintptr_t begin;
    uintptr_t end;
    if (cpu::is_dense_span(t)) {
      begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      end = begin + static_cast<uintptr_t>(t.numel()) * t.element_size();
    } else {  // strides are >= 0: the elements lie between the first and the last
      begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
      end = begin + static_cast<uintptr_t>(last + 1) * t.element_size();
    }
    if (!spans.empty() && begin < spans.back().second) sorted = false;
    spans.emplace_back(begin, end);
  }
  if (sorted) return false;  // ascending and disjoint in list order
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

// A tensor that is not a dense span: Tensor::mul_ by a 0-dim tensor, whose value
// is used in float (double for float64 tensors) exactly as scale_chunk does.
void scale_strided(const at::Tensor& t, double s) {
  const c10::ScalarType st = t.scalar_type() == c10::kDouble ? c10::kDouble : c10::kFloat;
  t.mul_(at::scalar_tensor(s, at::TensorOptions().dtype(st).device(t.device())));
}

// Multiplies every tensor of the plan by s in place (s == 1: nothing to do).
void apply_scale(at::TensorList tensors, const Plan& plan, double s) {
  if (s == 1.0 || plan.chunks.empty()) return;
  if (!entries_overlap(tensors)) {
    if (plan.all_direct) {
      scale_chunks_parallel(plan.chunks, s, plan.total);
      return;
    }
    std::vector<Chunk> direct;
    int64_t total = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!plan.direct[i]) continue;
      direct.insert(direct.end(), plan.chunks.begin() + plan.first_chunk[i],
                    plan.chunks.begin() + plan.first_chunk[i + 1]);
      total += tensors[i].numel();
    }
    scale_chunks_parallel(direct, s, total);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!plan.direct[i] && tensors[i].numel() > 0) scale_strided(tensors[i], s);
    }
    return;
  }
  // Shared memory between entries: entry by entry, in list order.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    if (plan.direct[i]) {
      std::vector<Chunk> own(plan.chunks.begin() + plan.first_chunk[i],
                             plan.chunks.begin() + plan.first_chunk[i + 1]);
      scale_chunks_parallel(own, s, tensors[i].numel());
    } else {
      scale_strided(tensors[i], s);
    }
  }
}

void check_cpu(at::TensorList tensors, const char* op) {
  TORCH_CHECK(tensors[0].device().is_cpu(), op, ": CPU kernel called with tensors on ",
              tensors[0].device());
}

// ---------------------------------------------------------------------------
// ops
// ---------------------------------------------------------------------------

void scale_cpu(at::TensorList tensors, const at::Tensor& scale) {
  constexpr const char* op = "torchstruct::scale_";
  check_float_tensors(tensors, op);
  check_cpu(tensors, op);
  TORCH_CHECK(scale.defined() && scale.dim() == 0, op, ": scale must be a 0-dim tensor, got ",
              scale.defined() ? scale.sizes() : at::IntArrayRef{});
  TORCH_CHECK(scale.device().is_cpu(), op, ": scale must be on cpu, got ", scale.device());
  TORCH_CHECK_TYPE(is_supported_float(scale.scalar_type()), op, ": scale has dtype ",
                   scale.scalar_type(), "; expected a floating-point dtype");
  check_writable(tensors, op);
  const double s = scale.item<double>();
  bump_versions(tensors);
  apply_scale(tensors, make_plan(tensors), s);
}

at::Tensor clip_by_global_norm_cpu(at::TensorList grads, double max_norm, double norm_type) {
  constexpr const char* op = "torchstruct::clip_by_global_norm_";
  const NormKind kind = check_norm_type(norm_type, op);
  check_max_norm(max_norm, op);
  const c10::ScalarType acc_dtype = check_float_tensors(grads, op);
  check_cpu(grads, op);
  check_writable(grads, op);
  bump_versions(grads);  // every grad is written, as torch always multiplies

  const Plan plan = make_plan(grads);
  const double norm = cpu::norm_of_chunks(plan.chunks, kind, plan.total);
  const double coef = acc_dtype == c10::kDouble
                          ? clip_coefficient<double>(norm, max_norm)
                          : static_cast<double>(
                                clip_coefficient<float>(static_cast<float>(norm), max_norm));
  at::Tensor out = cpu::cpu_scalar(norm, promoted_dtype(grads));  // before any write
  apply_scale(grads, plan, coef);
  return out;
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CPU, m) {
  m.impl("scale_", &torchstruct::scale_cpu);
  m.impl("clip_by_global_norm_", &torchstruct::clip_by_global_norm_cpu);
}
