// Host emulation of the part of the toolkit's cuda_fp16.h that attnserve uses (tests only):
// IEEE binary16 as its raw 16 bits, float → half rounded to nearest, ties to even, as
// __float2half_rn does (past 65504 to infinity, small values to subnormals or zero, NaN to a
// quiet NaN), and the exact widening back.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct __half {
  unsigned short x;
};

inline __half __float2half_rn(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const auto sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return {static_cast<unsigned short>(sign | 0x7e00u)};  // NaN
  if (magnitude >= 0x477ff000u) return {static_cast<unsigned short>(sign | 0x7c00u)};  // ≥ 65520: ∞
  // The value as a multiple of half's smallest subnormal 2^-24, rounded to nearest even
  // (nearbyint in the default rounding mode; the scaling is exact). Below 2^-13 (the subnormals
  // and the first binade of normals, whose spacing is that unit too) that multiple is the
  // half's bit pattern.
  float magnitude_value;
  std::memcpy(&magnitude_value, &magnitude, sizeof magnitude_value);
  if (magnitude < 0x39000000u) {  // below 2^-13
    const auto units = static_cast<uint32_t>(std::nearbyint(std::ldexp(magnitude_value, 24)));
    return {static_cast<unsigned short>(sign | units)};
  }
  // A normal: exponent e with 2^e ≤ |v| < 2^(e+1); 10 mantissa bits of it, rounded to even.
  int e;
  std::frexp(magnitude_value, &e);  // |v| = f·2^e, f in [0.5, 1)
  const auto mantissa = static_cast<uint32_t>(std::nearbyint(std::ldexp(magnitude_value, 11 - e)));  // in [1024, 2048]
  const uint32_t half_bits = (static_cast<uint32_t>(e - 1 + 15) << 10) + (mantissa - 0x400u);  // 2048 carries
  return {static_cast<unsigned short>(sign | half_bits)};
}

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t{h.x & 0x8000u} << 16, exponent = (h.x >> 10) & 0x1fu, mantissa = h.x & 0x3ffu;
  float v;
  if (exponent == 0x1f) {
    const uint32_t bits = sign | 0x7f800000u | (mantissa << 13);
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  v = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                    : std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  return sign != 0 ? -v : v;
}

inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short x) { return {x}; }
