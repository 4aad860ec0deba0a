// Portable scalar conversions between float32 and the 16-bit float types (no ISA extensions), used
// for element-wise paths: KV cache writes, row gathers, tails.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mgx {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// Round to nearest even, as torch and mgx.kernels.reference.f32_to_bf16 do; NaN stays a quiet NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x0040);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = float(man) * 5.9604644775390625e-08f;
    return bits_to_f32(f32_to_bits(v) | sign);
  }
  if (exp == 31) return bits_to_f32(sign | 0x7F800000u | (man << 13));  // inf / NaN
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even (what numpy's astype(float16) does).
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return uint16_t(sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520: overflow to inf
  if (a < 0x38800000u) {  // below the smallest normal: round to a multiple of 2^-24
    const float v = bits_to_f32(a) * 16777216.0f;  // exact scaling by 2^24
    return uint16_t(sign | uint16_t(std::nearbyint(v)));
  }
  const uint32_t rounded = a + 0x0FFFu + ((a >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

template <class T> inline float to_f32(T v);
template <> inline float to_f32<float>(float v) { return v; }

// 16-bit storage is passed around as these tags so templates can tell bf16 from f16.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
template <> inline float to_f32<bf16_t>(bf16_t v) { return bf16_to_f32(v.bits); }
template <> inline float to_f32<f16_t>(f16_t v) { return f16_to_f32(v.bits); }

template <class T> inline T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline bf16_t from_f32<bf16_t>(float v) { return bf16_t{f32_to_bf16(v)}; }
template <> inline f16_t from_f32<f16_t>(float v) { return f16_t{f32_to_f16(v)}; }

}  // namespace mgx
