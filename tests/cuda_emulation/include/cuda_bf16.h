// Host emulation of the part of the toolkit's cuda_bf16.h that attnserve uses (tests only):
// bfloat16 as its raw 16 bits, float → bfloat16 rounded to nearest, ties to even, as
// __float2bfloat16_rn does (NaN stays a quiet NaN of its sign), and the exact widening back.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  unsigned short x;
};

inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<unsigned short>((bits >> 16) | 0x0040u)};  // NaN
  const uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7fffu + lsb;  // past the halfway point, or at it with an odd last bit: up
  return {static_cast<unsigned short>(bits >> 16)};
}

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t bits = uint32_t{h.x} << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return {x}; }
