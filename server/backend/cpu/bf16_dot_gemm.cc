#include "server/backend/cpu/bf16_dot_gemm.h"

#include <algorithm>
#include <vector>

#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/avx512_sums.h"
#include "server/backend/cpu/isa_target.h"
#if defined(ATTNSERVE_X86_KERNELS)
#include <immintrin.h>
#endif

namespace attnserve {

#if defined(ATTNSERVE_X86_KERNELS)
ATTNSERVE_TARGET_AVX512_BF16_BEGIN
namespace {

constexpr int kBlockCols = 64;  // a panel: 64 columns, four registers of 16 sums
constexpr int kBlockRows = 6;   // 6 × 4 sums + 4 of w + 1 broadcast fit in 32 registers
constexpr int64_t kPrefetchPairs = 8;

// Row r of x as bfloat16 pairs: out[kp] holds x[r][2kp] in its low half and x[r][2kp + 1] in its
// high half (zero past the row's end), rounded to nearest even by vcvtne2ps2bf16.
void RowAsPairs(const float* x, int64_t k, uint32_t* out) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t kp = 0; kp < pairs; kp += 16) {
    const int64_t first = 2 * kp, left = k - first;  // 32 values from `first`, masked past k
    const __mmask16 lo = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __mmask16 hi = left >= 32 ? __mmask16(0xffff) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(lo, x + first), b = _mm512_maskz_loadu_ps(hi, x + first + 16);
    // Words 0..15 from its second operand, 16..31 from its first: x[first + j] in word j.
    const __m512bh packed = _mm512_cvtne2ps_pbh(b, a);
    const int64_t count = std::min<int64_t>(16, pairs - kp);
    _mm512_mask_storeu_epi32(out + kp, __mmask16((1u << count) - 1), (__m512i)packed);
  }
}

// Rows [0, R) of x (as pairs, `pairs` apart) times a panel's `cols` columns (≤ 64, the rest of the
// panel zeros): y's block written over (from `bias` or zero) or, with kAccumulate, added to.
template <int R, bool kAccumulate>
[[gnu::always_inline]] inline void Block(const uint32_t* xp, int64_t pairs, const uint16_t* w, float* y, int64_t ldy,
                                         const float* bias, int cols) {
  const ColumnMasks masks(cols);
  __m512 acc[R][4];
  StartSums<R, kAccumulate>(acc, y, ldy, bias, masks);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = w + kp * 2 * kBlockCols;  // 64 columns × 2 rows: 256 bytes, 4 lines
    const char* ahead = reinterpret_cast<const char*>(wk + kPrefetchPairs * 2 * kBlockCols);
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * pairs + kp]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  StoreSums<R>(acc, y, ldy, masks);
}

// Rows [r0, r_end) of x, R at a time, against one panel.
template <int R, bool kAccumulate>
void Rows(const uint32_t* xp, int64_t pairs, const uint16_t* w, MatrixView y, const float* bias, int64_t r0,
          int64_t r_end, int cols) {
  for (; r0 + R <= r_end; r0 += R) Block<R, kAccumulate>(xp + r0 * pairs, pairs, w, y.row(r0), y.ld, bias, cols);
}

template <bool kAccumulate>
void Panel(const uint32_t* xp, int64_t pairs, int64_t rows, const uint16_t* w, MatrixView y, const float* bias,
           int cols) {
  const int64_t full = rows / kBlockRows * kBlockRows;
  Rows<kBlockRows, kAccumulate>(xp, pairs, w, y, bias, 0, full, cols);
  switch (rows - full) {
    case 5: Rows<5, kAccumulate>(xp, pairs, w, y, bias, full, rows, cols); break;
    case 4: Rows<4, kAccumulate>(xp, pairs, w, y, bias, full, rows, cols); break;
    case 3: Rows<3, kAccumulate>(xp, pairs, w, y, bias, full, rows, cols); break;
    case 2: Rows<2, kAccumulate>(xp, pairs, w, y, bias, full, rows, cols); break;
    case 1: Rows<1, kAccumulate>(xp, pairs, w, y, bias, full, rows, cols); break;
    default: break;
  }
}

// Rows of x converted at a time: the pairs buffer stays at most kRowChunk · pairs words (768 KiB
// at d_model 2048) whatever the batch (a long sequence's projection has thousands of rows), and
// each panel is still streamed once for 192 rows.
constexpr int64_t kRowChunk = 32 * kBlockRows;

void GemmBf16Dot(ConstMatrixView x, const PackedBlock& w, MatrixView y, bool accumulate, const float* bias) {
  const PackedWeights& packed = *w.weights;
  const int64_t pairs = (w.rows + 1) / 2;
  // x's rows as pairs, a chunk at a time: every panel reads them. The last pair of an odd block
  // reads the next row's weights against a zero here, so a block may end mid-pair.
  thread_local std::vector<uint32_t> xp;
  xp.resize(static_cast<size_t>(std::min(x.rows, kRowChunk) * pairs));
  for (int64_t r0 = 0; r0 < x.rows; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, x.rows - r0);
    for (int64_t r = 0; r < rows; ++r) RowAsPairs(x.row(r0 + r), w.rows, xp.data() + r * pairs);
    for (int64_t c = 0; c < w.cols; c += packed.width) {
      const int cols = static_cast<int>(std::min<int64_t>(packed.width, w.cols - c));
      const int64_t panel = (w.col0 + c) / packed.width;
      const uint16_t* panel_w = packed.panels16.data() + packed.PanelOffset(panel, w.row0);
      const float* panel_bias = bias != nullptr ? bias + c : nullptr;
      const MatrixView block = y.RowBlock(r0, rows).ColBlock(c, cols);
      if (accumulate) {
        Panel<true>(xp.data(), pairs, rows, panel_w, block, nullptr, cols);
      } else {
        Panel<false>(xp.data(), pairs, rows, panel_w, block, panel_bias, cols);
      }
    }
  }
}

}  // namespace
ATTNSERVE_TARGET_END

bool Bf16DotAvailable() {
  static const bool available = CpuIsaAllowsAvx512() && __builtin_cpu_supports("avx512bf16");
  return available;
}

void PanelGemmBf16Dot(ConstMatrixView x, const PackedBlock& w, MatrixView y, bool accumulate, const float* bias) {
  GemmBf16Dot(x, w, y, accumulate, bias);
}

#else

bool Bf16DotAvailable() { return false; }

void PanelGemmBf16Dot(ConstMatrixView, const PackedBlock&, MatrixView, bool, const float*) {}

#endif

}  // namespace attnserve
