#include "server/backend/cpu/skinny_gemm.h"

#include <string>

#include "server/backend/cpu/bf16_dot_gemm.h"
#include "server/backend/cpu/gemm.h"

// The kernels are compiled for their ISA (AVX-512, or AVX2 with FMA and F16C) whatever the build's own
// flags, and one is chosen once for the CPU running them: a portable build (ATTNSERVE_NATIVE=OFF,
// the container images) still gets them on the hosts that can run them.
#include "server/backend/cpu/avx512_sums.h"
#include "server/backend/cpu/isa_target.h"
#if defined(ATTNSERVE_X86_KERNELS)
#define ATTNSERVE_SKINNY_GEMM 1
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#endif

namespace attnserve {

#if defined(ATTNSERVE_SKINNY_GEMM)
namespace {

// The right operand as the kernels read it: float32 (any matrix), or bfloat16 or IEEE half
// (packed panels only, PackPanels: whole blocks of columns, zeros past the last, so the kernels
// read them without masks and widen them to float32 in registers). A half's bits are tagged by
// their own type, so that the loads below are chosen by overload.
struct HalfBits {
  uint16_t bits;
};
static_assert(sizeof(HalfBits) == 2);
template <class W>
struct WeightsView {
  const W* data;
  int64_t rows, cols, ld;
};
WeightsView<float> WeightsOf(ConstMatrixView w) { return {w.data, w.rows, w.cols, w.ld}; }

// y = x · w (y += x · w with kAccumulate) block by block for an ISA's kernel: each block of
// kCols columns of w against x's rows, kRows at a time, then the rows left over (fewer than
// kRows) in one smaller block. `RowBlocks<R, kAccumulate, W>::Run(x, w, y, bias, r0, r_end, c0, cols)`
// runs rows [r0, r_end) R at a time; without kAccumulate a block starts from `bias` (y's columns'
// own, when given: y = bias + x · w, no pass of its own over y) or from zero.
template <template <int, bool, class> class RowBlocks, int kRows, int kCols, bool kAccumulate, class W>
void EachBlockOf(ConstMatrixView x, WeightsView<W> w, MatrixView y, const float* bias) {
  static_assert(kRows == 6, "the leftover switch below is written for 6-row blocks");
  const int64_t full = x.rows / kRows * kRows;
  for (int64_t c0 = 0; c0 < w.cols; c0 += kCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kCols, w.cols - c0));
    RowBlocks<kRows, kAccumulate, W>::Run(x, w, y, bias, 0, full, c0, cols);
    switch (x.rows - full) {
      case 5: RowBlocks<5, kAccumulate, W>::Run(x, w, y, bias, full, x.rows, c0, cols); break;
      case 4: RowBlocks<4, kAccumulate, W>::Run(x, w, y, bias, full, x.rows, c0, cols); break;
      case 3: RowBlocks<3, kAccumulate, W>::Run(x, w, y, bias, full, x.rows, c0, cols); break;
      case 2: RowBlocks<2, kAccumulate, W>::Run(x, w, y, bias, full, x.rows, c0, cols); break;
      case 1: RowBlocks<1, kAccumulate, W>::Run(x, w, y, bias, full, x.rows, c0, cols); break;
      default: break;
    }
  }
}

// The run-time `accumulate` made a template argument once here, for both ISAs' kernels.
template <template <int, bool, class> class RowBlocks, int kRows, int kCols, class W>
void EachBlock(ConstMatrixView x, WeightsView<W> w, MatrixView y, bool accumulate, const float* bias) {
  if (accumulate) {
    EachBlockOf<RowBlocks, kRows, kCols, true>(x, w, y, nullptr);
  } else {
    EachBlockOf<RowBlocks, kRows, kCols, false>(x, w, y, bias);
  }
}

}  // namespace
ATTNSERVE_TARGET_AVX512_BEGIN
namespace avx512 {

constexpr int kBlockCols = 64;  // four 16-float registers per row
constexpr int kBlockRows = 6;   // 6 × 4 accumulators + 4 of w + 1 broadcast fit in 32 registers
constexpr int64_t kPrefetchRows = 12;

// 16 of w's columns from one of its rows, as float32: lanes past `mask` zero. bfloat16 comes
// from panels, whose blocks are whole (WeightsView): read unmasked, widened by a shift (a
// bfloat16 is a float32's top half).
[[gnu::always_inline]] inline __m512 LoadWeights(const float* w, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, w);
}
[[gnu::always_inline]] inline __m512 LoadWeights(const uint16_t* w, __mmask16) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
// IEEE halves widened by vcvtph2ps (AVX512F): exact, subnormals included.
[[gnu::always_inline]] inline __m512 LoadWeights(const HalfBits* w, __mmask16) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}

// Rows [0, R) of x times columns [0, cols) of w (cols ≤ 64; the rest masked off), added to y's
// block with kAccumulate, else written over it starting from `bias` (when given) or zero.
// `x_next`, where not null, is the next block's first row (kBlockRows rows, ldx apart): asked
// for while this one computes.
// Inlined into its caller: only there does GCC keep the 24 accumulators in registers (called
// out of line, it spilled them to the stack on every step of k, at half the speed).
template <int R, bool kAccumulate, class W>
[[gnu::always_inline]] inline void Block(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
                                         const float* bias, int64_t k_total, int cols, const float* x_next) {
  const ColumnMasks masks(cols);
  __m512 acc[R][4];
  StartSums<R, kAccumulate>(acc, y, ldy, bias, masks);
  constexpr int kLinesPerRow = kBlockCols * sizeof(W) / 64;  // of a block's row of w: 4 float32, 2 bfloat16
  for (int64_t k = 0; k < k_total; ++k) {
    const W* wk = w + k * ldw;
    // w's rows lie a whole row of the weights apart (9–43 KB here), each on its own page, where
    // the hardware prefetchers do not follow: ask for the block's row kPrefetchRows ahead.
    const char* ahead = reinterpret_cast<const char*>(wk + kPrefetchRows * ldw);
    for (int line = 0; line < kLinesPerRow; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    // The next block's rows of x, a line of each per line of this block's: attention's x (a
    // head's queries) are 256 bytes of rows 9 KB apart in the Q|K|V buffer, which the hardware
    // prefetchers do not follow either (attention's time 18 % shorter in a bert-base forward).
    if (x_next != nullptr && k % kCacheLineFloats == 0) {
      for (int r = 0; r < kBlockRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(x_next + r * ldx + k), _MM_HINT_T0);
      }
    }
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = LoadWeights(wk + 16 * j, masks.mask[j]);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  StoreSums<R>(acc, y, ldy, masks);
}

// x's rows [r0, r_end) against columns [c0, c0 + cols) of w, R rows at a time (EachBlock),
// each block asking for the next whole block's rows of x (the leftover rows are not asked for).
template <int R, bool kAccumulate, class W>
struct RowBlocks {
  static void Run(ConstMatrixView x, WeightsView<W> w, MatrixView y, const float* bias, int64_t r0, int64_t r_end,
                  int64_t c0, int cols) {
    for (; r0 + R <= r_end; r0 += R) {
      const float* x_next = r0 + R + kBlockRows <= x.rows ? x.data + (r0 + R) * x.ld : nullptr;
      Block<R, kAccumulate>(x.data + r0 * x.ld, x.ld, w.data + c0, w.ld, y.data + r0 * y.ld + c0, y.ld,
                            bias != nullptr ? bias + c0 : nullptr, x.cols, cols, x_next);
    }
  }
};

void SkinnyGemm(ConstMatrixView x, ConstMatrixView w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, WeightsOf(w), y, accumulate, bias);
}

void SkinnyGemmBf16(ConstMatrixView x, WeightsView<uint16_t> w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, w, y, accumulate, bias);
}

void SkinnyGemmFp16(ConstMatrixView x, WeightsView<HalfBits> w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, w, y, accumulate, bias);
}

}  // namespace avx512

ATTNSERVE_TARGET_END

ATTNSERVE_TARGET_AVX2_FMA_BEGIN
namespace avx2 {

// The same kernel in 16 AVX2 registers: blocks of 6 rows of x × 16 columns of w (6 × 2
// accumulators + 2 of w + 1 broadcast), so that a request of up to 6 rows still reads each of
// w's rows once. A 16-column block is one 64-byte line of each of w's rows.
constexpr int kBlockCols = 16;
constexpr int kBlockRows = 6;
constexpr int64_t kPrefetchRows = 12;

// Lanes [0, left) of 8 on, as _mm256_maskload_ps/_mm256_maskstore_ps take them.
__m256i LaneMask(int left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 of w's columns from one of its rows, as float32 (lanes past `mask` zero, where given).
// bfloat16 comes from whole panel blocks (WeightsView): read unmasked, widened by a shift.
[[gnu::always_inline]] inline __m256 LoadWeights(const float* w) { return _mm256_loadu_ps(w); }
[[gnu::always_inline]] inline __m256 LoadWeights(const float* w, __m256i mask) { return _mm256_maskload_ps(w, mask); }
[[gnu::always_inline]] inline __m256 LoadWeights(const uint16_t* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
[[gnu::always_inline]] inline __m256 LoadWeights(const uint16_t* w, __m256i) { return LoadWeights(w); }
// IEEE halves widened by vcvtph2ps (F16C, which every CPU with AVX2 and FMA has).
[[gnu::always_inline]] inline __m256 LoadWeights(const HalfBits* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
[[gnu::always_inline]] inline __m256 LoadWeights(const HalfBits* w, __m256i) { return LoadWeights(w); }

// A whole block (cols == 16) uses no masks: with both lane masks live across its loop, 12
// accumulators, 2 rows of w, a broadcast and 2 masks want 17 of the 16 registers, and GCC's
// spills there ran the kernel at 0.62–0.86 of oneDNN's AVX2 GEMM at attention's tiles.
template <int R, bool kAccumulate, class W>
[[gnu::always_inline]] inline void WholeBlock(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                              int64_t ldy, const float* bias, int64_t k_total) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 2; ++j) {
      acc[r][j] = kAccumulate        ? _mm256_loadu_ps(y + r * ldy + 8 * j)
                  : bias != nullptr ? _mm256_loadu_ps(bias + 8 * j)
                                    : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_total; ++k) {
    const W* wk = w + k * ldw;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * ldw), _MM_HINT_T0);
    const __m256 w0 = LoadWeights(wk), w1 = LoadWeights(wk + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, acc[r][j]);
  }
}

// The last, partial block of a row of blocks (cols < 16): masked loads and stores.
template <int R, bool kAccumulate, class W>
[[gnu::always_inline]] inline void PartialBlock(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                                int64_t ldy, const float* bias, int64_t k_total, int cols) {
  const __m256i mask[2] = {LaneMask(cols), LaneMask(cols - 8)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 2; ++j) {
      acc[r][j] = kAccumulate        ? _mm256_maskload_ps(y + r * ldy + 8 * j, mask[j])
                  : bias != nullptr ? _mm256_maskload_ps(bias + 8 * j, mask[j])
                                    : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_total; ++k) {
    const W* wk = w + k * ldw;
    const __m256 w0 = LoadWeights(wk, mask[0]), w1 = LoadWeights(wk + 8, mask[1]);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(y + r * ldy, mask[0], acc[r][0]);
    _mm256_maskstore_ps(y + r * ldy + 8, mask[1], acc[r][1]);
  }
}

template <int R, bool kAccumulate, class W>
[[gnu::always_inline]] inline void Block(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                         int64_t ldy, const float* bias, int64_t k_total, int cols) {
  if (cols == kBlockCols) {
    WholeBlock<R, kAccumulate>(x, ldx, w, ldw, y, ldy, bias, k_total);
  } else {
    PartialBlock<R, kAccumulate>(x, ldx, w, ldw, y, ldy, bias, k_total, cols);
  }
}

// x's rows [r0, r_end) against columns [c0, c0 + cols) of w, R rows at a time (EachBlock).
// The same loop as the AVX-512 one, written again on purpose: GCC inlines an always_inline
// Block only into a caller compiled for the same target, so the loop must live in each ISA's
// region (a shared template outside them fails to build).
template <int R, bool kAccumulate, class W>
struct RowBlocks {
  static void Run(ConstMatrixView x, WeightsView<W> w, MatrixView y, const float* bias, int64_t r0, int64_t r_end,
                  int64_t c0, int cols) {
    for (; r0 + R <= r_end; r0 += R) {
      Block<R, kAccumulate>(x.data + r0 * x.ld, x.ld, w.data + c0, w.ld, y.data + r0 * y.ld + c0, y.ld,
                            bias != nullptr ? bias + c0 : nullptr, x.cols, cols);
    }
  }
};

void SkinnyGemm(ConstMatrixView x, ConstMatrixView w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, WeightsOf(w), y, accumulate, bias);
}

void SkinnyGemmBf16(ConstMatrixView x, WeightsView<uint16_t> w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, w, y, accumulate, bias);
}

void SkinnyGemmFp16(ConstMatrixView x, WeightsView<HalfBits> w, MatrixView y, bool accumulate, const float* bias) {
  EachBlock<RowBlocks, kBlockRows, kBlockCols>(x, w, y, accumulate, bias);
}

// kt = scale · kᵀ in 8 × 8 blocks transposed in registers: each of k's rows is read along its
// length and each of kt's rows written along its length (an element-wise transpose read k's
// columns across rows a page apart: 3 % of a bert-base forward). AVX-512 machines run it too.
void TransposeScaled(ConstMatrixView k, float scale, MatrixView kt) {
  const __m256 s = _mm256_set1_ps(scale);
  const int64_t rows8 = k.rows / 8 * 8, cols8 = k.cols / 8 * 8;
  for (int64_t j0 = 0; j0 < rows8; j0 += 8) {
    for (int64_t t0 = 0; t0 < cols8; t0 += 8) {
      __m256 r[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(k.data + (j0 + i) * k.ld + t0);
      for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {  // then quads, each 128-bit lane on its own
        r[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // then the lanes: column i from the low halves, i + 4 the high
        u[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        u[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt.data + (t0 + i) * kt.ld + j0, _mm256_mul_ps(s, u[i]));
    }
  }
  // The edges: the rows past the last whole block of 8, and the columns past it in every row.
  for (int64_t j = 0; j < k.rows; ++j) {
    for (int64_t t = j < rows8 ? cols8 : 0; t < k.cols; ++t) kt.data[t * kt.ld + j] = scale * k.data[j * k.ld + t];
  }
}

}  // namespace avx2
ATTNSERVE_TARGET_END

namespace {

using Kernel = void (*)(ConstMatrixView, ConstMatrixView, MatrixView, bool, const float*);
using KernelBf16 = void (*)(ConstMatrixView, WeightsView<uint16_t>, MatrixView, bool, const float*);
using KernelFp16 = void (*)(ConstMatrixView, WeightsView<HalfBits>, MatrixView, bool, const float*);
struct Chosen {
  Kernel kernel;
  KernelBf16 kernel_bf16;
  KernelFp16 kernel_fp16;
  std::string_view isa;
};

// F16C (the half conversions) from CPUID leaf 1, ECX bit 29: clang's __builtin_cpu_supports
// does not know the name.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

// Once: AVX-512 where the CPU has it and ATTNSERVE_CPU_ISA does not cap it (CpuIsaAllowsAvx512,
// gemm.h), else AVX2 with FMA and F16C, else none (the general GEMM is used).
const Chosen& Choose() {
  static const Chosen chosen = []() -> Chosen {
    if (CpuIsaAllowsAvx512()) return {avx512::SkinnyGemm, avx512::SkinnyGemmBf16, avx512::SkinnyGemmFp16, "avx512"};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c()) {
      return {avx2::SkinnyGemm, avx2::SkinnyGemmBf16, avx2::SkinnyGemmFp16, "avx2"};
    }
    return {nullptr, nullptr, nullptr, "none"};
  }();
  return chosen;
}

}  // namespace

void SkinnyGemm(ConstMatrixView x, ConstMatrixView w, MatrixView y, bool accumulate) {
  Choose().kernel(x, w, y, accumulate, nullptr);
}

void TransposeScaled(ConstMatrixView k, float scale, MatrixView kt) { avx2::TransposeScaled(k, scale, kt); }

int64_t PanelWidth() {
  const std::string_view isa = Choose().isa;
  return isa == "avx512" ? avx512::kBlockCols : isa == "avx2" ? avx2::kBlockCols : 0;
}

void PanelGemm(ConstMatrixView x, const PackedBlock& w, MatrixView y, bool accumulate, const float* bias) {
  const PackedWeights& packed = *w.weights;
  if (packed.precision == PanelPrecision::kBfloat16Pairs) return PanelGemmBf16Dot(x, w, y, accumulate, bias);
  const int64_t width = packed.width;
  for (int64_t c = 0; c < w.cols; c += width) {
    const int64_t count = std::min(width, w.cols - c), panel = (w.col0 + c) / width;
    const float* panel_bias = bias != nullptr ? bias + c : nullptr;
    if (packed.precision == PanelPrecision::kBfloat16) {
      const WeightsView<uint16_t> view{packed.PanelRow16(panel, w.row0), w.rows, count, width};
      Choose().kernel_bf16(x, view, y.ColBlock(c, count), accumulate, panel_bias);
    } else if (packed.precision == PanelPrecision::kFloat16) {
      const auto* halves = reinterpret_cast<const HalfBits*>(packed.PanelRow16(panel, w.row0));
      Choose().kernel_fp16(x, WeightsView<HalfBits>{halves, w.rows, count, width}, y.ColBlock(c, count), accumulate,
                           panel_bias);
    } else {
      const ConstMatrixView view(packed.PanelRow(panel, w.row0), w.rows, count, width);
      Choose().kernel(x, view, y.ColBlock(c, count), accumulate, panel_bias);
    }
  }
}

bool SkinnyGemmAvailable() { return Choose().kernel != nullptr; }

std::string_view SkinnyGemmIsa() { return Choose().isa; }

#else

bool SkinnyGemmAvailable() { return false; }

std::string_view SkinnyGemmIsa() { return "none"; }

void SkinnyGemm(ConstMatrixView, ConstMatrixView, MatrixView, bool) {}

void TransposeScaled(ConstMatrixView, float, MatrixView) {}

int64_t PanelWidth() { return 0; }

void PanelGemm(ConstMatrixView, const PackedBlock&, MatrixView, bool, const float*) {}

#endif

StatusOr<WeightLayout> ParseWeightLayout(std::string_view name) {
  if (name == "auto") return PanelWidth() > 0 ? WeightLayout::kPacked : WeightLayout::kPlain;
  if (name == "plain") return WeightLayout::kPlain;
  if (name == "packed" || name == "packed-bf16" || name == "packed-fp16") {
    if (PanelWidth() > 0) {
      return name == "packed" ? WeightLayout::kPacked
             : name == "packed-bf16" ? WeightLayout::kPackedBf16
                                     : WeightLayout::kPackedFp16;
    }
    return InvalidArgumentError("cpu weight layout: " + std::string(name) +
                                " asked, but the backend's own GEMM kernel cannot run here "
                                "(it needs an x86-64 GCC build and a CPU with AVX2, FMA and F16C); use auto or plain");
  }
  if (name == "packed-bf16-dot") {
    if (Bf16DotAvailable()) return WeightLayout::kPackedBf16Dot;
    return InvalidArgumentError("cpu weight layout: packed-bf16-dot asked, but this CPU has no AVX512_BF16 (or "
                                "ATTNSERVE_CPU_ISA caps AVX-512); use packed-bf16, which rounds the weights alone");
  }
  return InvalidArgumentError(
      "cpu weight layout: expected auto, packed, packed-bf16, packed-bf16-dot, packed-fp16 or plain, got '" +
      std::string(name) + "'");
}

std::string_view WeightLayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kPacked: return "packed";
    case WeightLayout::kPackedBf16: return "packed-bf16";
    case WeightLayout::kPackedBf16Dot: return "packed-bf16-dot";
    case WeightLayout::kPackedFp16: return "packed-fp16";
    case WeightLayout::kPlain: return "plain";
  }
  return "plain";
}

bool UseSkinnyGemm(GemmLibrary library, int64_t rows, int64_t cols) {
  if (!SkinnyGemmPays(rows, cols)) return false;
  return library == GemmLibrary::kEigen || (SkinnyGemmIsa() == "avx512" && rows <= kSkinnyGemmMaxRowsAgainstOneDnn);
}

bool PanelGemmPays(int64_t rows, int64_t row_major_ld) {
  const std::string_view isa = SkinnyGemmIsa();
  if (isa == "avx512") return true;
  if (isa != "avx2") return false;
  constexpr int64_t kPageFloats = 4096 / sizeof(float);
  const bool aliased = row_major_ld % kPageFloats == 0;
  return rows >= kPanelGemmMinRowsAvx2 || (aliased && rows >= kPanelGemmMinRowsAliasedAvx2);
}

bool SkinnyGemmPays(int64_t rows, int64_t cols) {
  return SkinnyGemmAvailable() && rows >= kSkinnyGemmMinRows && rows <= kSkinnyGemmMaxRows &&
         cols <= kSkinnyGemmMaxCols;
}

}  // namespace attnserve
