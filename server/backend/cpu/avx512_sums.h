// The sums of an AVX-512 register-block kernel (R rows × 64 columns in 4R registers), started and
// stored alike by each kernel that keeps them: SkinnyGemm's and PanelGemm's (skinny_gemm.cc) and
// vdpbf16ps's (bf16_dot_gemm.cc). Each function is compiled for AVX-512F and inlined into the
// kernels, whose target regions (isa_target.h) include AVX-512F; x86-64 builds only.
#pragma once

#include "server/backend/cpu/isa_target.h"
#if defined(ATTNSERVE_X86_KERNELS)
#include <immintrin.h>

#include <cstdint>

#define ATTNSERVE_AVX512_INLINE [[gnu::always_inline]] inline __attribute__((target("avx512f")))

namespace attnserve {
namespace {

// The block's four column masks: its first `cols` of 64 columns (the rest masked off).
struct ColumnMasks {
  __mmask16 mask[4];
  ATTNSERVE_AVX512_INLINE explicit ColumnMasks(int cols) {
    for (int j = 0; j < 4; ++j) {
      const int left = cols - 16 * j;
      mask[j] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
  }
};

// Rows [0, R) of the block's sums at its start: y's own with kAccumulate, else `bias` (when
// given: y = bias + x · w with no pass of its own over y) or zero.
template <int R, bool kAccumulate>
ATTNSERVE_AVX512_INLINE void StartSums(__m512 (&acc)[R][4], const float* y, int64_t ldy, const float* bias,
                                             const ColumnMasks& m) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = kAccumulate        ? _mm512_maskz_loadu_ps(m.mask[j], y + r * ldy + 16 * j)
                  : bias != nullptr ? _mm512_maskz_loadu_ps(m.mask[j], bias + 16 * j)
                                    : _mm512_setzero_ps();
    }
  }
}

template <int R>
ATTNSERVE_AVX512_INLINE void StoreSums(const __m512 (&acc)[R][4], float* y, int64_t ldy, const ColumnMasks& m) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, m.mask[j], acc[r][j]);
  }
}

}  // namespace
}  // namespace attnserve
#endif
