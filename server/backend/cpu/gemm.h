// The CPU backend's one GEMM primitive, on the calling thread: y = alpha · x · w (or · wᵀ).
//
// The CPU backend's projections go through here (split by columns across threads: SplitGemm,
// cpu_ops.cc), and attention's products where its own tile kernel does not run (a CPU
// without AVX2, values wider than the kernel takes, the summed form's per-head score blocks:
// AttendTiled and HeadScores). Which library computes it is a choice made
// once per backend, from measurement (the figures in docs/journal/benchmarks-journal.md, "The
// GEMM library"):
//   - oneDNN (Debian's libdnnl, JIT kernels dispatched at run time for AVX2 or AVX-512): faster
//     than Eigen at the projection shapes, most at few rows. The default when the build found it
//     (ATTNSERVE_ONEDNN=AUTO).
//   - Eigen: the portable fallback, compiled for the build's -march.
// Below 64K multiply-adds (a small request's per-head score blocks) Eigen computes the product
// whichever library was asked: oneDNN's fixed cost per call is larger than the product there.
// A request of 2–4 rows keeps the backend's own SkinnyGemm (AVX-512), which streams the
// weights without packing them and beats oneDNN there; from 8 rows oneDNN wins
// (docs/journal/benchmarks-journal.md, "The skinny GEMM").
// Thread-safety: the functions are reentrant; CpuIsaCap is read once, at first use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "server/core/status.h"
#include "server/core/tensor.h"

namespace attnserve {

enum class GemmLibrary { kEigen, kOneDnn };

std::string_view GemmLibraryName(GemmLibrary library);  // "eigen", "onednn"

// "auto" (oneDNN when this build has it, else Eigen), "eigen" or "onednn". INVALID_ARGUMENT
// names the value and what is accepted, and says so when oneDNN was asked of a build without it.
StatusOr<GemmLibrary> ParseGemmLibrary(std::string_view name);

bool BuiltWithOneDnn();

// The widest vector ISA the CPU kernels may use: the CPU's own, or AVX2 when the environment
// sets ATTNSERVE_CPU_ISA=avx2 (how the tests run the AVX2 paths on an AVX-512 machine; it also
// caps oneDNN's dispatch). "avx512" or "avx2" (or "generic" below AVX2). Eigen's code is chosen
// at compile time (-march) and is not capped.
std::string_view CpuIsa();
bool CpuIsaAllowsAvx512();

// The bytes one GemmOnThisThread call of x [rows, depth] · w [depth, cols] packs its operands
// into, as the library blocks them for this CPU's caches: Eigen's own blocking sizes
// (computeProductBlockingSizes; on a CPU with a large L3 a panel of a wide product runs to
// several MiB), oneDNN's 4 MiB measured by memory_footprint_test, its first call included.
int64_t GemmPackingBytes(GemmLibrary library, int64_t rows, int64_t depth, int64_t cols);

// y = alpha · x · w, with x [r, k], w [k, c] (or wᵀ when transpose_w: w is [c, k]), y [r, c];
// every view with its own row stride; with `accumulate`, y += alpha · x · w. Single-threaded:
// callers split the work themselves.
void GemmOnThisThread(GemmLibrary library, ConstMatrixView x, ConstMatrixView w, bool transpose_w, float alpha,
                      MatrixView y, bool accumulate = false);

}  // namespace attnserve
