#include "server/backend/cpu/skinny_gemm.h"

#include "server/backend/cpu/gemm.h"

// The kernel is compiled for AVX-512 whatever the build's own flags, and used only when the CPU
// running it has AVX-512 (checked once): a portable build (ATTNSERVE_NATIVE=OFF, the container
// images) still gets it on the hosts that can run it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ATTNSERVE_SKINNY_GEMM 1
#include <immintrin.h>

#include <algorithm>
#endif

namespace attnserve {

#if defined(ATTNSERVE_SKINNY_GEMM)
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace {

constexpr int kBlockCols = 64;  // four 16-float registers per row
constexpr int kBlockRows = 6;   // 6 × 4 accumulators + 4 of w + 1 broadcast fit in 32 registers
constexpr int64_t kPrefetchRows = 12;

// Rows [0, R) of x times columns [0, cols) of w (cols ≤ 64; the rest masked off). Inlined into
// its caller: only there does GCC keep the 24 accumulators in registers (called out of line,
// it spilled them to the stack on every step of k, at half the speed).
template <int R>
[[gnu::always_inline]] inline void Block(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t k_total,
           int cols) {
  __mmask16 mask[4];
  for (int j = 0; j < 4; ++j) {
    const int left = cols - 16 * j;
    mask[j] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  }
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_total; ++k) {
    const float* wk = w + k * ldw;
    // w's rows lie a whole row of the weights apart (9–43 KB here), each on its own page, where
    // the hardware prefetchers do not follow: ask for the block's row kPrefetchRows ahead.
    const float* ahead = wk + kPrefetchRows * ldw;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * j), _MM_HINT_T0);
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_ps(mask[j], wk + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask[j], acc[r][j]);
  }
}

// All of x's rows against columns [c0, c0 + cols) of w, R rows at a time.
template <int R>
void RowBlocks(ConstMatrixView x, ConstMatrixView w, MatrixView y, int64_t r0, int64_t r_end, int64_t c0,
               int cols) {
  for (; r0 + R <= r_end; r0 += R) {
    Block<R>(x.data + r0 * x.ld, x.ld, w.data + c0, w.ld, y.data + r0 * y.ld + c0, y.ld, x.cols, cols);
  }
}

}  // namespace


void SkinnyGemm(ConstMatrixView x, ConstMatrixView w, MatrixView y) {
  const int64_t full = x.rows / kBlockRows * kBlockRows;
  for (int64_t c0 = 0; c0 < w.cols; c0 += kBlockCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockCols, w.cols - c0));
    RowBlocks<kBlockRows>(x, w, y, 0, full, c0, cols);
    switch (x.rows - full) {  // the last rows, fewer than a block
      case 5: RowBlocks<5>(x, w, y, full, x.rows, c0, cols); break;
      case 4: RowBlocks<4>(x, w, y, full, x.rows, c0, cols); break;
      case 3: RowBlocks<3>(x, w, y, full, x.rows, c0, cols); break;
      case 2: RowBlocks<2>(x, w, y, full, x.rows, c0, cols); break;
      case 1: RowBlocks<1>(x, w, y, full, x.rows, c0, cols); break;
      default: break;
    }
  }
}

#pragma GCC pop_options

bool SkinnyGemmAvailable() {
  // CpuIsaAllowsAvx512: the CPU has AVX-512 and ATTNSERVE_CPU_ISA does not cap it (gemm.h).
  static const bool available = CpuIsaAllowsAvx512();
  return available;
}

#else

bool SkinnyGemmAvailable() { return false; }

void SkinnyGemm(ConstMatrixView, ConstMatrixView, MatrixView) {}

#endif

bool UseSkinnyGemm(GemmLibrary library, int64_t rows, int64_t cols) {
  return SkinnyGemmPays(rows, cols) && (library == GemmLibrary::kEigen || rows <= kSkinnyGemmMaxRowsAgainstOneDnn);
}

bool SkinnyGemmPays(int64_t rows, int64_t cols) {
  return SkinnyGemmAvailable() && rows >= kSkinnyGemmMinRows && rows <= kSkinnyGemmMaxRows &&
         cols <= kSkinnyGemmMaxCols;
}

}  // namespace attnserve
