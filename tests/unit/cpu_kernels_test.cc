// The CPU backend's own kernels against float64, at the edges of their blocking.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

// y = alpha · x · op(w) by `product` on random strided views, checked element by element against
// float64 within the classic bound of a float32 dot product in any order, FMA or not: k + 1
// roundings of at most 2^-24 each, relative to Σ|x·w| (a relative error alone would fail a
// correct kernel whenever the sum cancels, as a random draw can make it). Also checks that
// nothing is written past the view. Returns false after the first failure (already reported).
using Product = std::function<void(ConstMatrixView x, ConstMatrixView w, MatrixView y)>;
bool ProductMatchesFloat64(std::mt19937_64& rng, int64_t rows, int64_t k, int64_t cols, bool transpose_w, float alpha,
                           const Product& product) {
  const int64_t ldx = k + rows % 3, ldy = cols + 2;
  const int64_t w_rows = transpose_w ? cols : k, w_cols = transpose_w ? k : cols, ldw = w_cols + 5;
  const std::vector<float> x = testing::RandomVector(rng, rows * ldx), w = testing::RandomVector(rng, w_rows * ldw);
  std::vector<float> y = testing::RandomVector(rng, rows * ldy);
  const std::vector<float> before = y;
  product(ConstMatrixView(x.data(), rows, k, ldx), ConstMatrixView(w.data(), w_rows, w_cols, ldw),
          MatrixView(y.data(), rows, cols, ldy));
  const std::string shape = std::to_string(rows) + "x" + std::to_string(k) + " · " + std::to_string(k) + "x" +
                            std::to_string(cols) + (transpose_w ? " (w transposed)" : "");
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double sum = 0, magnitude = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double wv = transpose_w ? w[c * ldw + p] : w[p * ldw + c];
        const double term = static_cast<double>(alpha) * x[r * ldx + p] * wv;
        sum += term;
        magnitude += std::abs(term);
      }
      const double bound = static_cast<double>(k + 1) * std::ldexp(1.0, -24) * magnitude;
      if (!(std::abs(y[r * ldy + c] - sum) <= bound)) {
        ADD_FAILURE() << shape << " at [" << r << ", " << c << "]: got " << y[r * ldy + c] << ", float64 " << sum
                      << ", bound " << bound;
        return false;
      }
    }
    for (int64_t c = cols; c < ldy; ++c) {
      if (y[r * ldy + c] != before[r * ldy + c]) {
        ADD_FAILURE() << shape << ": wrote past the view: row " << r << " col " << c;
        return false;
      }
    }
  }
  return true;
}

// Every row count the kernel takes (its 6-row blocks and their remainders), column counts on
// both sides of its 16-float registers and 64-column blocks, and strided views.
TEST(SkinnyGemmTest, MatchesFloat64AtEveryBlockEdge) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX-512 here, or capped by ATTNSERVE_CPU_ISA=avx2: the general GEMM is used instead";
  std::mt19937_64 rng(testing::TestSeed());
  int checked = 0;
  constexpr int64_t kMaxRows = 32;  // beyond where it pays: the kernel itself takes any size
  const Product skinny = [](ConstMatrixView x, ConstMatrixView w, MatrixView y) { SkinnyGemm(x, w, y); };
  for (int64_t rows = 1; rows <= kMaxRows; ++rows) {
    for (int64_t cols : {1, 15, 16, 17, 63, 64, 65, 130}) {
      for (int64_t k : {1, 7, 96}) {
        ASSERT_TRUE(ProductMatchesFloat64(rng, rows, k, cols, /*transpose_w=*/false, 1.0f, skinny));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kMaxRows * 8 * 3);
}

// Every GEMM library of this build, through the one entry point the backend calls: both
// operand layouts (the scores multiply by Kᵀ), a scale (the scores' 1/√d_h), strided views, row
// counts from a single token to several register blocks, and inner sizes past a cache block.
TEST(GemmLibraryTest, EveryLibraryMatchesFloat64) {
  std::mt19937_64 rng(testing::TestSeed());
  std::vector<GemmLibrary> libraries = {GemmLibrary::kEigen};
  if (BuiltWithOneDnn()) libraries.push_back(GemmLibrary::kOneDnn);
  int checked = 0;
  for (GemmLibrary library : libraries) {
    SCOPED_TRACE(std::string(GemmLibraryName(library)));
    for (bool transpose_w : {false, true}) {
      for (float alpha : {1.0f, 0.125f}) {
        for (int64_t rows : {1, 2, 5, 16, 33}) {
          for (int64_t cols : {1, 17, 64, 130}) {
            for (int64_t k : {1, 7, 96, 300}) {
              const Product gemm = [&](ConstMatrixView x, ConstMatrixView w, MatrixView y) {
                GemmOnThisThread(library, x, w, transpose_w, alpha, y);
              };
              ASSERT_TRUE(ProductMatchesFloat64(rng, rows, k, cols, transpose_w, alpha, gemm));
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, static_cast<int>(libraries.size()) * 2 * 2 * 5 * 4 * 4);
}

TEST(GemmLibraryTest, OneDnnIsTheDefaultWhenTheBuildHasIt) {
  if (!BuiltWithOneDnn()) GTEST_SKIP() << "built without oneDNN: Eigen computes every GEMM";
  EXPECT_EQ(*ParseGemmLibrary("auto"), GemmLibrary::kOneDnn);
  EXPECT_EQ(CpuBackend().gemm(), GemmLibrary::kOneDnn);
  EXPECT_EQ(*ParseGemmLibrary("onednn"), GemmLibrary::kOneDnn);
}

TEST(GemmLibraryTest, NamesParseAndBadNamesSayWhatIsAccepted) {
  EXPECT_EQ(*ParseGemmLibrary("eigen"), GemmLibrary::kEigen);
  for (GemmLibrary library : {GemmLibrary::kEigen, GemmLibrary::kOneDnn}) {
    if (library == GemmLibrary::kOneDnn && !BuiltWithOneDnn()) continue;
    EXPECT_EQ(*ParseGemmLibrary(GemmLibraryName(library)), library);
  }
  const auto bad = ParseGemmLibrary("mkl");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "cpu gemm: expected auto, eigen or onednn, got 'mkl'");
  if (!BuiltWithOneDnn()) {
    EXPECT_NE(ParseGemmLibrary("onednn").status().message().find("this build has no oneDNN"), std::string::npos);
  }
}

// ATTNSERVE_CPU_ISA=avx2 holds every CPU kernel to its AVX2 path, so that both paths run on an
// AVX-512 machine (tests/CMakeLists.txt runs the backend suite again so, as cpu_avx2_paths).
TEST(CpuIsaTest, TheAvx2CapHoldsTheKernelsToAvx2) {
  const char* cap = std::getenv("ATTNSERVE_CPU_ISA");
  if (cap == nullptr || std::strcmp(cap, "avx2") != 0) {
    EXPECT_EQ(CpuIsaAllowsAvx512(), __builtin_cpu_supports("avx512f") != 0);
    GTEST_SKIP() << "runs capped under ATTNSERVE_CPU_ISA=avx2 (the cpu_kernels_avx2 test)";
  }
  EXPECT_FALSE(CpuIsaAllowsAvx512());
  EXPECT_FALSE(SkinnyGemmAvailable());
  EXPECT_EQ(CpuIsa(), __builtin_cpu_supports("avx2") ? "avx2" : "generic");
}

}  // namespace
}  // namespace attnserve
