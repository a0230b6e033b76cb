// CPU p-norm reduction shared by the torchstruct CPU kernels (see norm.h).
//
// Inside a chunk, elements are processed in blocks of kBlock with kLanes
// independent accumulators (float for float/half/bfloat16 input, double for
// double input), written so that g++ -O3 vectorizes them; every block is
// flushed into a double. The chunk functions are compiled for baseline x86-64
// and AVX2 (TS_TARGET_CLONES).
#include "norm.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace torchstruct {
namespace cpu {
namespace {

constexpr int64_t kBlock = 1024;  // elements per float accumulation block
constexpr int kLanes = 16;        // independent accumulators per block

// max that propagates NaN from either side (a NaN accumulator sticks).
template <typename T>
inline T nan_max(T acc, T a) {
  return (a > acc || a != a) ? a : acc;
}

inline double combine(double acc, double v, NormKind kind) {
  return kind == NormKind::kInf ? nan_max(acc, v) : acc + v;
}

template <NormKind K>
inline double fold(double acc, double v) {
  if constexpr (K == NormKind::kInf) {
    return nan_max(acc, v);
  } else {
    return acc + v;
  }
}

// Reduces n (<= kBlock) contiguous values of type T (float or double) into a
// double: the sum of |x| or x^2, or the max of |x| (NaN-propagating).
//
// For kInf (double) the lanes use the plain `a > m ? a : m` (one max
// instruction, which drops NaN) and a second set of lanes sums x * 0, which is
// NaN iff some x is NaN or inf; only then is the block rescanned for a NaN.
// float inf-norm: for |x| the IEEE bit patterns order like the values, and
// every NaN pattern is above inf's, so an integer max of the bits is a
// NaN-propagating max of |x| (vectorizes to integer max/compare instructions).
TS_ALWAYS_INLINE double max_abs_block(const float* __restrict x, int64_t n) {
  int32_t acc[kLanes];
  for (int k = 0; k < kLanes; ++k) acc[k] = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      int32_t bits;
      std::memcpy(&bits, x + i + k, sizeof(bits));
      bits &= 0x7fffffff;
      acc[k] = bits > acc[k] ? bits : acc[k];
    }
  }
  for (; i < n; ++i) {
    int32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits &= 0x7fffffff;
    acc[0] = bits > acc[0] ? bits : acc[0];
  }
  int32_t m = 0;
  for (int k = 0; k < kLanes; ++k) m = acc[k] > m ? acc[k] : m;
  if (m > 0x7f800000) return std::numeric_limits<double>::quiet_NaN();
  float f;
  std::memcpy(&f, &m, sizeof(f));
  return static_cast<double>(f);
}

template <typename T, NormKind K>
TS_ALWAYS_INLINE double reduce_block(const T* __restrict x, int64_t n) {
  if constexpr (K == NormKind::kInf && std::is_same_v<T, float>) {
    return max_abs_block(x, n);
  }
  T acc[kLanes];
  T nonfinite[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    acc[k] = T(0);
    nonfinite[k] = T(0);
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const T a = std::abs(x[i + k]);
      if constexpr (K == NormKind::kInf) {
        acc[k] = a > acc[k] ? a : acc[k];
        nonfinite[k] += a * T(0);
      } else if constexpr (K == NormKind::kOne) {
        acc[k] += a;
      } else if constexpr (K == NormKind::kTwo) {
        acc[k] += a * a;
      }
    }
  }
  for (; i < n; ++i) {
    const T a = std::abs(x[i]);
    if constexpr (K == NormKind::kInf) {
      acc[0] = nan_max(acc[0], a);
    } else if constexpr (K == NormKind::kOne) {
      acc[0] += a;
    } else if constexpr (K == NormKind::kTwo) {
      acc[0] += a * a;
    }
  }
  double out = 0.0;
  for (int k = 0; k < kLanes; ++k) {
    if constexpr (K == NormKind::kInf) {
      out = nan_max(out, static_cast<double>(acc[k]));
    } else {
      out += static_cast<double>(acc[k]);
    }
  }
  if constexpr (K == NormKind::kInf) {
    T bad = T(0);
    for (int k = 0; k < kLanes; ++k) bad += nonfinite[k];
    if (bad != bad) {  // some NaN or inf in the vectorized part: look for a NaN
      for (int64_t j = 0; j < n; ++j) {
        if (x[j] != x[j]) return std::numeric_limits<double>::quiet_NaN();
      }
    }
  }
  return out;
}


template <NormKind K>
TS_ALWAYS_INLINE double reduce_chunk(const Chunk& c) {
  double acc = 0.0;
  switch (c.dtype) {
    case c10::kFloat: {
      const float* x = static_cast<const float*>(c.data);
      for (int64_t b = 0; b < c.numel; b += kBlock) {
        acc = fold<K>(acc, reduce_block<float, K>(x + b, std::min(kBlock, c.numel - b)));
      }
      break;
    }
    case c10::kDouble: {
      const double* x = static_cast<const double*>(c.data);
      for (int64_t b = 0; b < c.numel; b += kBlock) {
        acc = fold<K>(acc, reduce_block<double, K>(x + b, std::min(kBlock, c.numel - b)));
      }
      break;
    }
    case c10::kHalf:
    case c10::kBFloat16: {
      float buf[kBlock];
      for (int64_t b = 0; b < c.numel; b += kBlock) {
        const int64_t n = std::min(kBlock, c.numel - b);
        if (c.dtype == c10::kHalf) {
          const c10::Half* x = static_cast<const c10::Half*>(c.data) + b;
          for (int64_t i = 0; i < n; ++i) buf[i] = load(x[i]);
        } else {
          const c10::BFloat16* x = static_cast<const c10::BFloat16*>(c.data) + b;
          for (int64_t i = 0; i < n; ++i) buf[i] = load(x[i]);
        }
        acc = fold<K>(acc, reduce_block<float, K>(buf, n));
      }
      break;
    }
    default:
      TORCH_CHECK(false, "torchstruct::global_norm: unsupported dtype ", c.dtype);
  }
  return acc;
}

TS_TARGET_CLONES double chunk_inf(const Chunk& c) { return reduce_chunk<NormKind::kInf>(c); }
TS_TARGET_CLONES double chunk_one(const Chunk& c) { return reduce_chunk<NormKind::kOne>(c); }
TS_TARGET_CLONES double chunk_two(const Chunk& c) { return reduce_chunk<NormKind::kTwo>(c); }

template <double (*ChunkFn)(const Chunk&)>
void reduce_all(const std::vector<Chunk>& chunks, std::vector<double>& partials, int64_t grain) {
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), grain,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       partials[i] = ChunkFn(chunks[i]);
                     }
                   });
}

}  // namespace

double reduce_chunks(const std::vector<Chunk>& chunks, NormKind kind, int64_t total_elems) {
  if (chunks.empty()) return 0.0;
  const int64_t grain = chunk_grain(static_cast<int64_t>(chunks.size()), total_elems);
  std::vector<double> partials(chunks.size(), 0.0);
  switch (kind) {
    case NormKind::kInf: reduce_all<chunk_inf>(chunks, partials, grain); break;
    case NormKind::kOne: reduce_all<chunk_one>(chunks, partials, grain); break;
    case NormKind::kTwo: reduce_all<chunk_two>(chunks, partials, grain); break;
  }
  double reduced = 0.0;
  for (double v : partials) reduced = combine(reduced, v, kind);
  return reduced;
}

}  // namespace cpu
}  // namespace torchstruct
