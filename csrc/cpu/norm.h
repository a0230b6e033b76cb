// CPU p-norm reduction over many tensors, shared by the torchstruct CPU
// kernels (global_norm, clip_by_global_norm_, ...).
//
// The inputs are cut into work chunks (at most kChunk elements, never spanning
// two tensors); reduce_chunks runs at::parallel_for over the chunks, each chunk
// writes its partial (a double) into its own slot, and a serial pass combines
// the partials. The root is applied by finish_norm (common.h).
#pragma once

#include "../common.h"
#include "elements.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>

#include <cstdint>
#include <vector>

// The inner loops are compiled twice on x86-64 Linux with GCC (baseline SSE2 and
// AVX2), and the loader picks the best for the running CPU (ifunc).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TS_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TS_TARGET_CLONES
#endif

namespace torchstruct {
namespace cpu {


// A contiguous run of elements of one tensor.
struct Chunk {
  void* data;
  int64_t numel;
  c10::ScalarType dtype;
};

// The elements of `t` as one contiguous run, when its memory is exactly its
// elements in some order (contiguous, or a permutation of dims such as a
// transpose): then order does not matter for a reduction or an elementwise
// scale, and no copy is needed.
inline bool is_dense_span(const at::Tensor& t) {
  return t.is_contiguous() || t.is_non_overlapping_and_dense();
}

// Appends the chunks of the `n` elements starting at `data`.
inline void append_span(void* data, int64_t n, c10::ScalarType dtype, int64_t itemsize,
                        std::vector<Chunk>& chunks) {
  char* base = static_cast<char*>(data);
  for (int64_t start = 0; start < n; start += kChunk) {
    chunks.push_back(Chunk{base + start * itemsize, n - start < kChunk ? n - start : kChunk, dtype});
  }
}

// Appends the chunks of `t` (non-empty). A tensor that is not a dense span is
// read from a contiguous copy kept alive in `owned`; returns false then (its
// chunks do not alias `t`).
inline bool append_tensor(const at::Tensor& t, std::vector<Chunk>& chunks,
                          std::vector<at::Tensor>& owned) {
  const int64_t itemsize = static_cast<int64_t>(t.element_size());
  if (is_dense_span(t)) {
    append_span(const_cast<void*>(t.const_data_ptr()), t.numel(), t.scalar_type(), itemsize, chunks);
    return true;
  }
  owned.push_back(t.contiguous());
  append_span(const_cast<void*>(owned.back().const_data_ptr()), t.numel(), t.scalar_type(),
              itemsize, chunks);
  return false;
}

// Parallel grain (in chunks) so that each thread gets at least ~kGrainElems elements.
inline int64_t chunk_grain(int64_t nchunks, int64_t total_elems) {
  if (total_elems <= 0) return 1;
  const int64_t g = (kGrainElems * nchunks + total_elems - 1) / total_elems;
  return g < 1 ? 1 : g;
}

// The reduced value of all chunks (sum of |x| or x^2, or max |x|,
// NaN-propagating), before the root; 0 for no chunks. `total_elems`: the
// number of elements in `chunks`, for the parallel grain.
double reduce_chunks(const std::vector<Chunk>& chunks, NormKind kind, int64_t total_elems);

// A 0-dim CPU tensor of `dtype` holding `value`, rounded as a tensor cast rounds: a value beyond
// the dtype's range becomes inf, as torch's own norms return it (at::scalar_tensor refuses such a
// value in older torch, 2.4 among them).
inline at::Tensor cpu_scalar(double value, c10::ScalarType dtype) {
  return at::scalar_tensor(value, at::TensorOptions().dtype(c10::kDouble)).to(dtype);
}

// The p-norm of all chunks (reduce_chunks then finish_norm).
inline double norm_of_chunks(const std::vector<Chunk>& chunks, NormKind kind,
                             int64_t total_elems) {
  return finish_norm(reduce_chunks(chunks, kind, total_elems), kind);
}

}  // namespace cpu
}  // namespace torchstruct
