// y = x · w for an x of few rows (a request of a handful of tokens), without packing w.
//
// A general GEMM (Eigen's) first copies w into panels that suit its micro-kernel; for a large x
// that copy is paid back many times, for a few rows it is most of the cost: the product reads w
// once while the packing reads and writes it again. This kernel streams w straight from its
// rows: blocks of 6 rows of x × 64 columns of w in 24 AVX-512 registers (× 16 columns in 12
// AVX2 registers on a CPU without AVX-512), with w's rows prefetched ahead (they lie a page or
// more apart). Where it pays was measured, not assumed
// (docs/journal/benchmarks-journal.md, "The skinny GEMM").
#pragma once

#include <cstdint>
#include <string_view>

#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/packed_weights.h"
#include "server/core/status.h"
#include "server/core/tensor.h"

namespace attnserve {

// Whether SkinnyGemm beats Eigen's general GEMM for an x of `rows` rows times `cols` columns of
// w: the kernel runs here (SkinnyGemmAvailable), 2 ≤ rows ≤ 16 and cols ≤ 4096, where it
// measured faster at BERT-base and GPT-2-medium weight blocks (bench/skinny_gemm_bench); at 1 row
// Eigen's matrix-vector product is as fast, at 32 rows it depends on the width. The column limit
// keeps out the summed form's value block (9216 and more columns): faster alone, it made whole
// summed forwards of few tokens slower (docs/journal/benchmarks-journal.md, "The skinny GEMM").
bool SkinnyGemmPays(int64_t rows, int64_t cols);
constexpr int64_t kSkinnyGemmMinRows = 2, kSkinnyGemmMaxRows = 16, kSkinnyGemmMaxCols = 4096;

// Whether the backend runs SkinnyGemm for a block of `rows` rows of x × `cols` columns of w when
// its GEMM library is `library`: where it pays against Eigen (SkinnyGemmPays), and against
// oneDNN only with the AVX-512 kernel, up to kSkinnyGemmMaxRowsAgainstOneDnn rows. The AVX2
// kernel was slower than oneDNN's AVX2 GEMM from 2 to 16 rows on a Zen 3, so with oneDNN it is
// not used there (docs/journal/benchmarks-journal.md, "The skinny GEMM").
bool UseSkinnyGemm(GemmLibrary library, int64_t rows, int64_t cols);
constexpr int64_t kSkinnyGemmMaxRowsAgainstOneDnn = 4;

// True when the kernel can run here: an x86-64 build with GCC, on a CPU with AVX-512 or with
// AVX2, FMA and F16C (whatever -march the rest of the build used). ATTNSERVE_CPU_ISA=avx2 keeps it to
// AVX2 (gemm.h).
bool SkinnyGemmAvailable();

// The kernel's ISA, chosen once: "avx512", "avx2" or "none".
std::string_view SkinnyGemmIsa();

// y = x · w (y += x · w with `accumulate`); x is [rows, k], w is [k, cols], y is [rows, cols],
// each with its own row stride. Requires SkinnyGemmAvailable(); any size works. SkinnyGemmPays
// says when it beats a packing GEMM on weights streamed from memory; attention's tiles, whose
// operands are already in cache, use it at any row count (AttendTiled, tiled_attention.cc).
void SkinnyGemm(ConstMatrixView x, ConstMatrixView w, MatrixView y, bool accumulate = false);

// Floats in one 64-byte cache line: the step of the CPU backend's software prefetches.
inline constexpr int64_t kCacheLineFloats = 16;

// The panel width this CPU's kernel reads packed weights in (PackPanels): one block of its
// columns, 64 (AVX-512) or 16 (AVX2); 0 where no kernel runs.
int64_t PanelWidth();

// How the CPU backend holds a form's weights: packed as well (kPacked, PackPanels at
// PanelWidth()), packed as bfloat16 (kPackedBf16: every projection on the packed weights runs
// on them, at half the bytes, each weight rounded to bfloat16), packed as bfloat16 pairs with
// the projections' inputs rounded too (kPackedBf16Dot: vdpbf16ps, bf16_dot_gemm.h), packed as
// IEEE halves (kPackedFp16: the same bytes as bfloat16, each weight 8 times closer, widened by
// vcvtph2ps) or row-major only.
enum class WeightLayout { kPacked, kPackedBf16, kPlain, kPackedBf16Dot, kPackedFp16 };

// "auto" (packed where the backend's own kernel runs: a CPU with AVX2, FMA and F16C, an x86-64
// GCC build), "packed", "packed-bf16" and "packed-fp16" (refused where the kernel cannot run),
// "packed-bf16-dot" (refused without AVX512_BF16) or "plain". INVALID_ARGUMENT names the value
// and what is accepted.
StatusOr<WeightLayout> ParseWeightLayout(std::string_view name);

// The name ParseWeightLayout takes for `layout` ("packed", "packed-bf16", "packed-bf16-dot",
// "packed-fp16", "plain").
std::string_view WeightLayoutName(WeightLayout layout);

// y = x · w (y += x · w with `accumulate`) for weights packed at PanelWidth(): the kernel runs
// panel by panel, each streamed from one contiguous run (packed_weights.h), of float32 or of
// bfloat16 or IEEE halves widened to float32 in registers (PackedWeights::precision). x is [rows, w.rows],
// y [rows, w.cols]. With `bias` ([w.cols]) and no `accumulate`, y = bias + x · w: the kernel's
// accumulators start from the bias, so no pass of its own writes y first. Requires
// SkinnyGemmAvailable().
void PanelGemm(ConstMatrixView x, const PackedBlock& w, MatrixView y, bool accumulate = false,
               const float* bias = nullptr);

// Whether PanelGemm on packed weights beats the GEMM library on the row-major ones (their rows
// `row_major_ld` floats apart) for an x of `rows` rows, where it measured faster (the figures
// in docs/journal/benchmarks-journal.md, "Weights packed once" and "The bias in the kernel's
// accumulators"):
//   - the AVX-512 kernel: at every row count, whole batches of 1024 tokens too, since the bias
//     starts the kernel's accumulators (PanelGemm's `bias`) where the library needs a pass of
//     its own over y;
//   - the AVX2 one from kPanelGemmMinRowsAvx2 rows, and from kPanelGemmMinRowsAliasedAvx2 rows
//     where the row-major rows lie a multiple of 4 KiB apart (gpt2-medium's 1024 floats: each
//     row the library's kernel walks down falls in the same cache sets), whole 1024-token
//     batches included (since the bias in the accumulators, 5–10 % faster than the library
//     there on 2 threads). At bert-base's 768 floats and few rows the library is faster: it
//     keeps those.
bool PanelGemmPays(int64_t rows, int64_t row_major_ld);
constexpr int64_t kPanelGemmMinRowsAvx2 = 64, kPanelGemmMinRowsAliasedAvx2 = 4;

// kt = scale · kᵀ, k [rows, cols] into kt [cols, rows]: attention's key tile as SkinnyGemm's
// right operand, with the softmax's scale folded in. Requires SkinnyGemmAvailable().
void TransposeScaled(ConstMatrixView k, float scale, MatrixView kt);

}  // namespace attnserve
