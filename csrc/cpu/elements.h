// What every CPU kernel shares: work-chunk sizes, and reading / writing one element of a
// float32, float64, float16 or bfloat16 tensor in its compute type (float, or double).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__GNUC__)
#define TS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define TS_ALWAYS_INLINE inline
#endif

namespace torchstruct {
namespace cpu {

constexpr int64_t kChunk = 64 * 1024;       // elements per parallel work item
constexpr int64_t kGrainElems = 32 * 1024;  // minimum elements per thread

// bfloat16 is the upper half of a float32.
TS_ALWAYS_INLINE float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as c10::BFloat16(float) does; NaN becomes the canonical quiet NaN.
TS_ALWAYS_INLINE uint16_t float_to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return f != f ? static_cast<uint16_t>(0x7fc0)
                : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

TS_ALWAYS_INLINE float load(float x) { return x; }
TS_ALWAYS_INLINE double load(double x) { return x; }
TS_ALWAYS_INLINE float load(c10::Half x) { return static_cast<float>(x); }
TS_ALWAYS_INLINE float load(c10::BFloat16 x) { return bf16_bits_to_float(x.x); }

template <typename T, typename C>
TS_ALWAYS_INLINE T store(C x) {
  return static_cast<T>(x);
}
template <>
TS_ALWAYS_INLINE c10::BFloat16 store<c10::BFloat16, float>(float x) {
  return c10::BFloat16(float_to_bf16_bits(x), c10::BFloat16::from_bits());
}

}  // namespace cpu
}  // namespace torchstruct
