// The projections with both operands in bfloat16 (--cpu-weight-layout packed-bf16-dot), on
// AVX512_BF16's vdpbf16ps: each instruction multiplies 16 pairs of bfloat16 from x by 16 pairs
// from w and adds both products to 16 float32 sums, twice the multiply-adds of a float32 FMA.
//
// packed-bf16 rounds only the weights and widens them back in registers: half the bytes, the
// float32 FMA's rate. Here the rows of x are rounded to bfloat16 too (once per call, into pairs
// of consecutive k), and the weights are packed two rows interleaved (PanelPrecision::
// kBfloat16Pairs), so a product of a bfloat16 pair with a pair is what the instruction takes. The
// products are exact in float32 (8-bit by 8-bit mantissas), the sums float32: the answer is the
// float32 product of x and w rounded to bfloat16, within float32's accumulation (what
// cpu_kernels_test checks), and each projection's inputs lose what bfloat16 loses (u = 2^-8).
// Thread-safety: reentrant; the rows of x are converted, 192 at a time, into a buffer of the
// calling thread's (at most 192 · d_model / 2 words, kept for its next call).
#pragma once

#include "server/backend/cpu/packed_weights.h"
#include "server/core/tensor.h"

namespace attnserve {

// True where the kernel runs: an x86-64 build with GCC or clang, a CPU with AVX512_BF16 (and
// AVX-512 not capped by ATTNSERVE_CPU_ISA=avx2: gemm.h).
bool Bf16DotAvailable();

// y = x · w (y += x · w with `accumulate`; y = bias + x · w with `bias`), w packed as
// kBfloat16Pairs at 64 columns a panel; x is [rows, w.rows], y [rows, w.cols]. Requires
// Bf16DotAvailable().
void PanelGemmBf16Dot(ConstMatrixView x, const PackedBlock& w, MatrixView y, bool accumulate, const float* bias);

}  // namespace attnserve
