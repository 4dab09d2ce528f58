// The CPU backend's own kernels against float64, at the edges of their blocking.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "server/backend/cpu/skinny_gemm.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

// Every row count the kernel takes (its 6-row blocks and their remainders), column counts on
// both sides of its 16-float registers and 64-column blocks, and strided views.
TEST(SkinnyGemmTest, MatchesFloat64AtEveryBlockEdge) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "built without AVX-512: the general GEMM is used instead";
  std::mt19937_64 rng(testing::TestSeed());
  int checked = 0;
  constexpr int64_t kMaxRows = 32;  // beyond where it pays: the kernel itself takes any size
  for (int64_t rows = 1; rows <= kMaxRows; ++rows) {
    for (int64_t cols : {1, 15, 16, 17, 63, 64, 65, 130}) {
      for (int64_t k : {1, 7, 96}) {
        const int64_t ldx = k + rows % 3, ldw = cols + 5, ldy = cols + 2;
        const std::vector<float> x = testing::RandomVector(rng, rows * ldx), w = testing::RandomVector(rng, k * ldw);
        std::vector<float> y = testing::RandomVector(rng, rows * ldy);
        const std::vector<float> before = y;
        SkinnyGemm(ConstMatrixView(x.data(), rows, k, ldx), ConstMatrixView(w.data(), k, cols, ldw),
                   MatrixView(y.data(), rows, cols, ldy));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            double sum = 0, magnitude = 0;
            for (int64_t p = 0; p < k; ++p) {
              const double term = static_cast<double>(x[r * ldx + p]) * w[p * ldw + c];
              sum += term;
              magnitude += std::abs(term);
            }
            // The classic bound of a float32 dot product in any order, FMA or not: k + 1
            // roundings of at most 2^-24 each, relative to Σ|x·w| (a relative error alone
            // would fail a correct kernel whenever the sum cancels, as a random draw can make it).
            const double bound = static_cast<double>(k + 1) * std::ldexp(1.0, -24) * magnitude;
            ASSERT_LE(std::abs(y[r * ldy + c] - sum), bound)
                << rows << "x" << k << " · " << k << "x" << cols << " at [" << r << ", " << c << "]";
          }
          for (int64_t c = cols; c < ldy; ++c) {
            ASSERT_EQ(y[r * ldy + c], before[r * ldy + c]) << "wrote past the view: row " << r << " col " << c;
          }
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kMaxRows * 8 * 3);
}

}  // namespace
}  // namespace attnserve
