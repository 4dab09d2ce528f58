// The softmax's two passes over a row of scores, vectorised for AVX-512 and AVX2.
//
// Tiled attention (tiled_attention.cc) spends what its two GEMMs do not on these passes: per score,
// the row's max (with the check that every score is finite) and exp(s − max) with the row's sum.
// Written with Eigen's expressions they were a large share of the tiled loop (the figures in
// docs/journal/benchmarks-journal.md, "The softmax's row kernels"): its NaN-propagating max and
// min reductions ran scalar, and the exp and the sum were two passes. Here each is one pass of vector code,
// chosen once at run time like the skinny GEMM (an AVX-512 kernel whatever the build's -march,
// AVX2 with FMA when the CPU has it, or ATTNSERVE_CPU_ISA=avx2 caps it; Eigen's code below that).
//
// Accuracy: exp is Cephes' polynomial on r ∈ [−ln2/2, ln2/2] after n = round(x·log2 e), the
// polynomial Eigen's own float exp uses, within 2 ulp of the float64 exp over the range the
// softmax feeds it (x ≤ 0). Below −87.3 the AVX2 kernel gives 0 (exp there is under float32's
// smallest normal, 2^-126); the AVX-512 one gives denormals down to −104 and 0 below, where exp
// rounds to 0 anyway. Sums run in 8 or 16 lanes, then across.
// Thread-safety: pure functions; the kernel choice is made once, at first use.
#pragma once

#include <cstdint>
#include <string_view>

namespace attnserve {

// The largest of p[0, n) (n ≥ 1), or NaN when any of them is ±inf or NaN: a dot product that
// overflowed float32 on its way, whose true value may be the row's max, so the caller recomputes
// the row in float64.
float RowMaxOrNaN(const float* p, int64_t n);

// p[j] = exp(p[j] − top) for j in [0, n), in place, the difference rounded to float32 first (as
// any float32 softmax does); returns the sum of the new values. Callers pass the row's finite
// max as `top` (every argument ≤ 0).
float ExpShiftedAndSum(float* p, int64_t n, float top);

// "avx512", "avx2" or "generic": the kernels the two functions above run on this CPU.
std::string_view SoftmaxRowsIsa();

}  // namespace attnserve
