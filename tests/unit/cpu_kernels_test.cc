// The CPU backend's own kernels against float64, at the edges of their blocking.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "server/backend/cpu/bf16_dot_gemm.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/backend/cpu/softmax_rows.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

// y = alpha · x · op(w) (y += with `accumulate`) by `product` on random strided views, checked element by element against
// float64 within the classic bound of a float32 dot product in any order, FMA or not: k + 1
// roundings of at most 2^-24 each, relative to Σ|x·w| (a relative error alone would fail a
// correct kernel whenever the sum cancels, as a random draw can make it). Also checks that
// nothing is written past the view. Returns false after the first failure (already reported).
using Product = std::function<void(ConstMatrixView x, ConstMatrixView w, MatrixView y)>;
// With `bias` ([cols]), y = bias + x · w is expected. `weight_as` is each weight as the product
// reads it (bfloat16 panels round them); float64 multiplies those.
using WeightAs = double (*)(float);
double AsLoaded(float w) { return w; }
// A bfloat16's value: the top half of a float32.
double Widened(uint16_t bfloat16) {
  const uint32_t bits = static_cast<uint32_t>(bfloat16) << 16;
  float widened;
  std::memcpy(&widened, &bits, sizeof widened);
  return widened;
}
double AsBfloat16(float w) { return Widened(RoundToBfloat16(w)); }
// An IEEE half's value by its definition: sign, 5 exponent bits (bias 15; 0: subnormal, 31:
// infinity or NaN), 10 mantissa bits.
double HalfValue(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double sign = (h & 0x8000) != 0 ? -1.0 : 1.0;
  if (exponent == 31) return mantissa == 0 ? sign * INFINITY : NAN;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}
// x rounded to the nearest half in float64, ties to even, from the definition (not RoundToHalf):
// the quantum of x's binade (2^-24 below 2^-14, where the subnormals keep it), x / quantum to the
// nearest integer (exact in float64: x has 24 bits), and an infinity past the largest half.
double NearestHalf(float x) {
  if (!std::isfinite(x)) return x;
  const int binade = x == 0 ? -14 : std::max(std::ilogb(x), -14);
  const double quantum = std::ldexp(1.0, binade - 10);
  const double rounded = std::nearbyint(static_cast<double>(x) / quantum) * quantum;
  return std::abs(rounded) > 65504.0 ? std::copysign(INFINITY, x) : rounded;
}
double AsHalf(float w) { return NearestHalf(w); }
bool ProductMatchesFloat64(std::mt19937_64& rng, int64_t rows, int64_t k, int64_t cols, bool transpose_w, float alpha,
                           const Product& product, bool accumulate = false, std::span<const float> bias = {},
                           WeightAs weight_as = AsLoaded, WeightAs x_as = AsLoaded) {
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
      double sum = accumulate ? before[r * ldy + c] : bias.empty() ? 0.0 : bias[c], magnitude = std::abs(sum);
      for (int64_t p = 0; p < k; ++p) {
        const double wv = weight_as(transpose_w ? w[c * ldw + p] : w[p * ldw + c]);
        const double term = static_cast<double>(alpha) * x_as(x[r * ldx + p]) * wv;
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
// both sides of its registers (8 floats in AVX2, 16 in AVX-512) and column blocks (16 and 64),
// and strided views. Under ATTNSERVE_CPU_ISA=avx2 (cpu_kernels_avx2) it is the AVX2 kernel.
TEST(SkinnyGemmTest, MatchesFloat64AtEveryBlockEdge) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX2 with FMA here: the general GEMM is used instead";
  std::printf("skinny GEMM kernel: %s\n", std::string(SkinnyGemmIsa()).c_str());  // for scripts/test-report
  std::mt19937_64 rng(testing::TestSeed());
  int checked = 0;
  constexpr int64_t kMaxRows = 32;  // beyond where it pays: the kernel itself takes any size
  const Product skinny = [](ConstMatrixView x, ConstMatrixView w, MatrixView y) { SkinnyGemm(x, w, y); };
  for (int64_t rows = 1; rows <= kMaxRows; ++rows) {
    for (int64_t cols : {1, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 130}) {
      for (int64_t k : {1, 7, 96}) {
        ASSERT_TRUE(ProductMatchesFloat64(rng, rows, k, cols, /*transpose_w=*/false, 1.0f, skinny));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kMaxRows * 13 * 3);
}

// y += x · w, as attention's tiles add each key tile's mix to the rows' output: the shapes of
// those tiles (rows of a query block, a key tile's depth, d_v columns) and every block edge.
TEST(SkinnyGemmTest, AccumulatesAtEveryBlockEdge) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX2 with FMA here: the general GEMM is used instead";
  std::mt19937_64 rng(testing::TestSeed());
  int checked = 0;
  const Product add = [](ConstMatrixView x, ConstMatrixView w, MatrixView y) { SkinnyGemm(x, w, y, true); };
  for (int64_t rows : {1, 5, 6, 7, 12, 40}) {
    for (int64_t cols : {1, 9, 16, 33, 64, 80}) {
      for (int64_t k : {1, 64, 130, 512}) {
        ASSERT_TRUE(ProductMatchesFloat64(rng, rows, k, cols, /*transpose_w=*/false, 1.0f, add, /*accumulate=*/true));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 6 * 4);
}

// y = x · w on weights packed once (PackPanels, PanelGemm) against float64: w lies inside a larger
// source at a row offset and at a column offset of whole panels, as the blocks of W_in the
// projections multiply do (the value block at q_cols + k_cols, a summed head's W_M_i), and the
// block is found as the backend finds it (PackedWeights::Block). Every row count of the kernel's
// blocks, column counts on both sides of a panel; written over y, added to it, and started from a
// bias (the projections' y = b + x · W, with no pass of its own over y). Panels of bfloat16 are
// checked against float64 on the weights rounded as PackPanels rounds them: the kernel adds no
// error of its own beyond float32's.
void PanelGemmMatchesFloat64AtEveryPanelEdgeAndOffset(PanelPrecision precision) {
  const int64_t width = PanelWidth();
  EXPECT_EQ(width, SkinnyGemmIsa() == "avx512" ? 64 : 16);
  const WeightAs weight_as = precision == PanelPrecision::kFloat32   ? AsLoaded
                             : precision == PanelPrecision::kFloat16 ? AsHalf
                                                                     : AsBfloat16;
  // vdpbf16ps rounds x's rows too: float64 multiplies them rounded alike.
  const WeightAs x_as = precision == PanelPrecision::kBfloat16Pairs ? AsBfloat16 : AsLoaded;
  std::mt19937_64 rng(testing::TestSeed());
  int checked = 0;
  enum class Start { kZero, kAccumulate, kBias };  // y = x·w, y += x·w, y = bias + x·w
  for (Start start : {Start::kZero, Start::kAccumulate, Start::kBias}) {
    const bool accumulate = start == Start::kAccumulate;
    for (int64_t rows = 1; rows <= 20; ++rows) {
      for (int64_t cols : {1, 15, 16, 17, 63, 64, 65, 130}) {
        for (int64_t k : {1, 7, 96}) {
          const std::vector<float> bias = start == Start::kBias ? testing::RandomVector(rng, cols) : std::vector<float>();
          // Offsets of 0 and 1 panel; in pairs, of whole pairs (a block starts on an even row).
          const int64_t row0 = precision == PanelPrecision::kBfloat16Pairs ? 2 * (rows % 2) : rows % 3;
          const int64_t col0 = (rows % 2) * width;
          const Product packed = [&](ConstMatrixView x, ConstMatrixView w, MatrixView y) {
            // The source: w at (row0, col0) of a larger matrix with more columns on the right.
            const int64_t src_rows = row0 + w.rows + 2, src_cols = col0 + w.cols + 3;
            std::vector<float> src = testing::RandomVector(rng, src_rows * src_cols);
            for (int64_t r = 0; r < w.rows; ++r) {
              std::copy_n(w.data + r * w.ld, w.cols, src.data() + (row0 + r) * src_cols + col0);
            }
            const PackedWeights pw = PackPanels(ConstMatrixView(src.data(), src_rows, src_cols), width, precision);
            EXPECT_EQ(pw.precision, precision);
            const auto block = pw.Block(row0, col0, w.rows, w.cols);
            ASSERT_TRUE(block.has_value());
            EXPECT_EQ(block->row0, row0);
            EXPECT_EQ(block->col0, col0);
            PanelGemm(x, *block, y, accumulate, bias.empty() ? nullptr : bias.data());
          };
          ASSERT_TRUE(ProductMatchesFloat64(rng, rows, k, cols, /*transpose_w=*/false, 1.0f, packed, accumulate, bias,
                                            weight_as, x_as));
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 20 * 8 * 3);
}

TEST(PanelGemmTest, MatchesFloat64AtEveryPanelEdgeAndOffset) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  PanelGemmMatchesFloat64AtEveryPanelEdgeAndOffset(PanelPrecision::kFloat32);
}

TEST(PanelGemmTest, Bfloat16PanelsMatchFloat64OnTheRoundedWeights) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  PanelGemmMatchesFloat64AtEveryPanelEdgeAndOffset(PanelPrecision::kBfloat16);
}

// --cpu-weight-layout packed-fp16: IEEE halves widened by vcvtph2ps, against float64 on the
// weights rounded to the nearest half by the definition (NearestHalf, not PackPanels' own code).
TEST(PanelGemmTest, HalfPanelsMatchFloat64OnTheRoundedWeights) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  PanelGemmMatchesFloat64AtEveryPanelEdgeAndOffset(PanelPrecision::kFloat16);
}

// --cpu-weight-layout packed-bf16-dot: vdpbf16ps on weights packed in row pairs and x's rows
// rounded to bfloat16 in the kernel, against float64 on both rounded alike: the kernel adds no
// error beyond float32's accumulation (odd k, blocks starting a pair in, every row remainder).
TEST(PanelGemmTest, Bfloat16PairsMatchFloat64OnTheRoundedInputsAndWeights) {
  if (!Bf16DotAvailable()) GTEST_SKIP() << "no AVX512_BF16 here: packed-bf16-dot is refused at start";
  PanelGemmMatchesFloat64AtEveryPanelEdgeAndOffset(PanelPrecision::kBfloat16Pairs);
  // More rows than the kernel converts at a time (192), with a bias: every chunk lands in its rows.
  std::mt19937_64 rng(testing::TestSeed() + 5);
  const std::vector<float> bias = testing::RandomVector(rng, 70);
  const Product chunked = [&](ConstMatrixView x, ConstMatrixView w, MatrixView y) {
    const PackedWeights pw = PackPanels(w, PanelWidth(), PanelPrecision::kBfloat16Pairs);
    PanelGemm(x, *pw.Block(0, 0, w.rows, w.cols), y, false, bias.data());
  };
  for (int64_t rows : {192, 193, 400}) {
    ASSERT_TRUE(ProductMatchesFloat64(rng, rows, 33, 70, /*transpose_w=*/false, 1.0f, chunked, false, bias, AsBfloat16,
                                      AsBfloat16));
  }
  // A block on an odd row is no whole pair: the backend multiplies it row-major instead.
  std::vector<float> w(8 * 70, 0.5f);
  const PackedWeights pairs = PackPanels(ConstMatrixView(w.data(), 8, 70), PanelWidth(), PanelPrecision::kBfloat16Pairs);
  EXPECT_TRUE(pairs.Block(2, 64, 5, 6).has_value());
  EXPECT_FALSE(pairs.Block(3, 0, 4, 6).has_value());
  EXPECT_EQ(pairs.Bytes(), 2 * 4 * 2 * 64 * 2) << "2 panels of 4 row pairs, 64 columns of 2 bfloat16 each";
}

// Round to nearest, ties to even, on the bit patterns where it is decided: exact values, the
// halfway points on both sides of an even and an odd last bit, the carry into the exponent, the
// largest finite values, subnormals, signed zeros, infinities and NaN. Then random floats of
// every magnitude against the definition: the nearer of the two bfloat16 around x, in float64.
TEST(PackedWeightsTest, RoundToBfloat16IsNearestTiesToEven) {
  const auto round_bits = [](uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return RoundToBfloat16(x);
  };
  EXPECT_EQ(round_bits(0x3f800000u), 0x3f80);  // 1
  EXPECT_EQ(round_bits(0x3f808000u), 0x3f80);  // halfway above an even last bit: down to it
  EXPECT_EQ(round_bits(0x3f818000u), 0x3f82);  // halfway above an odd one: up to the even
  EXPECT_EQ(round_bits(0x3f808001u), 0x3f81);  // just past halfway: up
  EXPECT_EQ(round_bits(0x3f807fffu), 0x3f80);  // just below: down
  EXPECT_EQ(round_bits(0x3fffffffu), 0x4000);  // the carry runs into the exponent: 2
  EXPECT_EQ(round_bits(0xbf818000u), 0xbf82);  // the sign does not change the rule
  EXPECT_EQ(round_bits(0x7f7f0000u), 0x7f7f);  // bfloat16's largest finite value, exactly
  EXPECT_EQ(round_bits(0x7f7fffffu), 0x7f80);  // float32's largest: past it, to infinity
  EXPECT_EQ(round_bits(0x00018000u), 0x0002);  // a subnormal's tie: to even
  EXPECT_EQ(round_bits(0x00000000u), 0x0000);
  EXPECT_EQ(round_bits(0x80000000u), 0x8000);
  EXPECT_EQ(round_bits(0x7f800000u), 0x7f80);
  EXPECT_EQ(round_bits(0xff800000u), 0xff80);
  const uint16_t nan = round_bits(0x7f800001u);  // a NaN whose payload lies in the dropped half
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x007f, 0) << "stays NaN, not infinity";

  std::mt19937_64 rng(testing::TestSeed());
  std::uniform_int_distribution<uint32_t> any_finite(0, 0x7f7effffu);  // below the top binade's last tie
  for (int i = 0; i < 100000; ++i) {
    const uint32_t bits = any_finite(rng) | (i % 2 == 0 ? 0u : 0x80000000u);
    float x;
    std::memcpy(&x, &bits, sizeof x);
    const uint16_t got = RoundToBfloat16(x), below = static_cast<uint16_t>(bits >> 16);
    const double d_below = std::abs(Widened(below) - x), d_above = std::abs(Widened(below + 1) - x);
    const uint16_t tie = below % 2 == 0 ? below : below + 1;
    const uint16_t want = d_below < d_above ? below : d_above < d_below ? below + 1 : tie;
    ASSERT_EQ(got, want) << "bits 0x" << std::hex << bits;
  }
}

// RoundToHalf against the definition (NearestHalf): every half's own value, the halfway points
// between neighbouring halves (ties to even) and a hair either side of them, the subnormals,
// the largest finite half and the rounding past it to infinity, signed zeros, NaN; then random
// floats of every magnitude. FirstBeyondHalf finds the first weight that would overflow.
TEST(PackedWeightsTest, RoundToHalfIsNearestTiesToEven) {
  const auto expect_rounds_to = [](float x, double want) {
    const uint16_t got = RoundToHalf(x);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(HalfValue(got))) << x;
    } else {
      EXPECT_EQ(HalfValue(got), want) << std::hexfloat << x << " gave 0x" << std::hex << got;
      EXPECT_EQ(std::signbit(HalfValue(got)), std::signbit(x)) << x;
    }
  };
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite half, both signs, and each tie above it
    const double v = HalfValue(static_cast<uint16_t>(h)), next = HalfValue(static_cast<uint16_t>(h + 1));
    for (const double sign : {1.0, -1.0}) {
      expect_rounds_to(static_cast<float>(sign * v), sign * v);
      const float tie = static_cast<float>(sign * (v + next) / 2);  // exact in float32
      if (h + 1 < 0x7c00) {
        expect_rounds_to(tie, sign * (h % 2 == 0 ? v : next));
        expect_rounds_to(std::nextafter(tie, 0.0f), sign * v);
        expect_rounds_to(std::nextafter(tie, static_cast<float>(sign * INFINITY)), sign * next);
      }
    }
  }
  expect_rounds_to(65519.996f, 65504.0);  // below the last tie: the largest half
  expect_rounds_to(65520.0f, INFINITY);   // the tie past 65504 (odd): up, to infinity
  expect_rounds_to(-1e9f, -INFINITY);
  expect_rounds_to(0x1p-25f, 0.0);  // half the smallest subnormal: a tie, to even zero
  expect_rounds_to(0x1.000002p-25f, 0x1p-24);
  expect_rounds_to(-0.0f, -0.0);
  expect_rounds_to(INFINITY, INFINITY);
  expect_rounds_to(NAN, NAN);

  std::mt19937_64 rng(testing::TestSeed());
  std::uniform_int_distribution<uint32_t> any_finite(0, 0x7f7fffffu);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = any_finite(rng) | (i % 2 == 0 ? 0u : 0x80000000u);
    float x;
    std::memcpy(&x, &bits, sizeof x);
    ASSERT_EQ(HalfValue(RoundToHalf(x)), NearestHalf(x)) << "bits 0x" << std::hex << bits;
  }

  std::vector<float> w = testing::RandomVector(rng, 100, 1000.0f);
  EXPECT_EQ(FirstBeyondHalf(w), w.size());
  w[70] = 65519.0f;  // rounds to 65504: held
  EXPECT_EQ(FirstBeyondHalf(w), w.size());
  w[40] = -65520.0f;
  w[90] = 1e6f;
  EXPECT_EQ(FirstBeyondHalf(w), 40u);
}

// Where the backend multiplies packed weights (PanelGemmPays), as measured: the AVX-512 kernel at
// any row count; the AVX2 one from 64 rows, or from 4 where the row-major rows lie a multiple of
// 4 KiB apart (gpt2-medium's 1024 floats, not bert-base's 768); both on whole 1024-token batches.
// cpu_kernels_avx2 runs it capped to AVX2.
TEST(PanelGemmTest, PaysWhereItWasMeasuredToWin) {
  const std::string_view isa = SkinnyGemmIsa();
  if (isa == "avx512") {
    for (int64_t rows : {1, 4, 16, 64, 256, 1024, 8192}) EXPECT_TRUE(PanelGemmPays(rows, 768)) << rows;
  } else if (isa == "avx2") {
    EXPECT_FALSE(PanelGemmPays(1, 1024));
    EXPECT_TRUE(PanelGemmPays(4, 1024));
    EXPECT_TRUE(PanelGemmPays(4, 3072));
    EXPECT_FALSE(PanelGemmPays(16, 768));
    EXPECT_FALSE(PanelGemmPays(63, 2304));
    EXPECT_TRUE(PanelGemmPays(64, 2304));
    for (int64_t rows : {256, 1024, 8192}) {
      EXPECT_TRUE(PanelGemmPays(rows, 768)) << rows;
      EXPECT_TRUE(PanelGemmPays(rows, 1024)) << rows;
    }
  } else {
    EXPECT_FALSE(PanelGemmPays(16, 1024));
  }
}

// Block names a block only inside the matrix packed, starting on a panel's first column: anything
// else (a column block starting mid-panel) is multiplied row-major by the library. The block is
// named by its place, never by an address (cpu_ops_test: copies of the weights elsewhere).
TEST(PackedWeightsTest, BlockNamesOnlyWholePanelBlocksOfTheSource) {
  std::mt19937_64 rng(testing::TestSeed());
  constexpr int64_t kRows = 10, kCols = 100, kWidth = 16;
  const std::vector<float> src = testing::RandomVector(rng, kRows * kCols);
  const ConstMatrixView w(src.data(), kRows, kCols);
  const PackedWeights pw = PackPanels(w, kWidth);
  ASSERT_EQ(pw.Bytes(), static_cast<int64_t>(7 * kRows * kWidth * sizeof(float)));  // 100 columns: 7 panels
  // The layout: each panel's rows one after another, zeros past the last column.
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < 7 * kWidth; ++c) {
      const float want = c < kCols ? src[r * kCols + c] : 0.0f;
      ASSERT_EQ(pw.PanelRow(c / kWidth, r)[c % kWidth], want) << r << ", " << c;
    }
  }
  const auto whole = pw.Block(0, 0, kRows, kCols);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->rows, kRows);
  EXPECT_EQ(whole->cols, kCols);
  const auto block = pw.Block(3, 32, 4, 50);
  ASSERT_TRUE(block.has_value());
  EXPECT_EQ(block->row0, 3);
  EXPECT_EQ(block->col0, 32);
  EXPECT_EQ(block->cols, 50);
  EXPECT_FALSE(pw.Block(0, 8, kRows, 16).has_value()) << "starts mid-panel";
  EXPECT_FALSE(pw.Block(1, 0, kRows, kCols).has_value()) << "past the last row";
  EXPECT_FALSE(pw.Block(0, 96, kRows, 5).has_value()) << "past the last column";
  EXPECT_FALSE(pw.Block(-1, 0, 2, 16).has_value()) << "before the first row";
  EXPECT_FALSE(PackedWeights().Block(0, 0, kRows, kCols).has_value()) << "nothing packed";
}

TEST(WeightLayoutTest, NamesParseAndBadNamesSayWhatIsAccepted) {
  EXPECT_EQ(*ParseWeightLayout("plain"), WeightLayout::kPlain);
  EXPECT_EQ(*ParseWeightLayout("auto"), PanelWidth() > 0 ? WeightLayout::kPacked : WeightLayout::kPlain);
  EXPECT_EQ(CpuBackend().weight_layout(), *ParseWeightLayout("auto"));
  for (const WeightLayout layout : {WeightLayout::kPacked, WeightLayout::kPackedBf16, WeightLayout::kPackedFp16}) {
    const std::string name(WeightLayoutName(layout));
    const auto parsed = ParseWeightLayout(name);
    if (PanelWidth() > 0) {
      EXPECT_EQ(*parsed, layout) << name;
    } else {
      ASSERT_FALSE(parsed.ok());
      EXPECT_NE(parsed.status().message().find(name + " asked, but the backend's own GEMM kernel cannot run here"),
                std::string::npos);
    }
  }
  EXPECT_EQ(WeightLayoutName(WeightLayout::kPlain), "plain");
  const auto bad = ParseWeightLayout("blocked");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "cpu weight layout: expected auto, packed, packed-bf16, packed-bf16-dot, packed-fp16 or plain, "
            "got 'blocked'");
}

// The packed copy is host memory the form holds (ResidentForm::HostBytes: the layer store's
// bound and attnserve_layer_bytes count it), and both layouts compute the same layer.
TEST(WeightLayoutTest, PackedWeightsCountInHostBytesAndAgreeWithPlain) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  const LayerConfig config = *CompleteConfig({.d_model = 96, .heads = 3});
  const LayerWeights weights = RandomLayerWeights(config, testing::TestSeed());
  auto f = std::make_shared<const FormWeights>(MaterializeFactored(weights));
  CpuBackend packed({.weight_layout = WeightLayout::kPacked}), plain({.weight_layout = WeightLayout::kPlain});
  auto on_packed = packed.Upload(f), on_plain = plain.Upload(f);
  ASSERT_TRUE(on_packed.ok() && on_plain.ok());
  EXPECT_EQ((*on_plain)->HostBytes(), f->Bytes());
  // W_in [96, 288] and W_out [96, 96] packed: whole panels, so at least the weights' bytes again.
  EXPECT_GE((*on_packed)->HostBytes(), 2 * f->Bytes() - static_cast<int64_t>(f->b_in.size() + f->b_out.size()) * 4);
  std::mt19937_64 rng(testing::TestSeed());
  for (int64_t n : {1, 5, 16, 40}) {
    const std::vector<float> input = testing::RandomVector(rng, n * 96);
    std::vector<float> out_packed(n * 96), out_plain(n * 96);
    Sequence s;
    s.input = ConstMatrixView(input.data(), n, 96);
    s.output = MatrixView(out_packed.data(), n, 96);
    ASSERT_TRUE(packed.Forward(**on_packed, std::span<const Sequence>(&s, 1)).ok());
    s.output = MatrixView(out_plain.data(), n, 96);
    ASSERT_TRUE(plain.Forward(**on_plain, std::span<const Sequence>(&s, 1)).ok());
    for (int64_t i = 0; i < n * 96; ++i) ASSERT_NEAR(out_packed[i], out_plain[i], 1e-4f * (1 + std::abs(out_plain[i]))) << n << " " << i;
  }
}

// --cpu-weight-layout packed-bf16: the panels hold half the bytes, and every projection of every
// form runs on them at every batch size: a whole forward is the float32 forward of the same layer
// with its W_in and W_out rounded to bfloat16 (biases as loaded), and within bfloat16's rounding
// of float64 on the weights as loaded. d_model and the head width are whole panels, as in every
// checkpoint layout we load, so each head's block of the summed form starts on a panel.
TEST(WeightLayoutTest, Bfloat16PanelsComputeTheLayerWithItsWeightsRounded) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  const LayerConfig config = *CompleteConfig({.d_model = 128, .heads = 2});
  const LayerWeights weights = RandomLayerWeights(config, testing::TestSeed());
  CpuBackend bf16({.threads = 2, .weight_layout = WeightLayout::kPackedBf16});
  CpuBackend packed({.threads = 2, .weight_layout = WeightLayout::kPacked});
  EXPECT_EQ(bf16.weight_layout(), WeightLayout::kPackedBf16);
  std::mt19937_64 rng(testing::TestSeed());
  double worst = 0;
  // The low-rank form at full rank (d_head per head) is the layer exactly: float64 holds it too.
  const StatusOr<FormWeights> lowrank = MaterializeLowRank(weights, {64, 64});
  ASSERT_TRUE(lowrank.ok()) << lowrank.status().ToString();
  for (const FormWeights& materialized : {MaterializeFactored(weights), MaterializeSummed(weights), *lowrank}) {
    const std::string form(FormName(materialized.form));
    auto f = std::make_shared<const FormWeights>(materialized);
    FormWeights rounded_weights = materialized;
    for (AlignedFloats* w : {&rounded_weights.w_in, &rounded_weights.w_out}) {
      std::transform(w->begin(), w->end(), w->begin(), [](float v) { return static_cast<float>(AsBfloat16(v)); });
    }
    auto rounded = std::make_shared<const FormWeights>(std::move(rounded_weights));
    auto on_bf16 = bf16.Upload(f), on_f32 = packed.Upload(f), on_rounded = packed.Upload(rounded);
    ASSERT_TRUE(on_bf16.ok() && on_f32.ok() && on_rounded.ok()) << form;
    // The panels in bfloat16: half the packed float32 copy's bytes.
    EXPECT_EQ(2 * ((*on_bf16)->HostBytes() - f->Bytes()), (*on_f32)->HostBytes() - f->Bytes()) << form;
    for (int64_t n : {1, 5, 16, 40, 300}) {
      const std::vector<float> input = testing::RandomVector(rng, n * config.d_model);
      std::vector<float> got(input.size()), want(input.size()), as_loaded(input.size());
      const auto run = [&](CpuBackend& backend, const ResidentForm& on, std::vector<float>& out) {
        Sequence s;
        s.input = ConstMatrixView(input.data(), n, config.d_model);
        s.output = MatrixView(out.data(), n, config.d_model);
        return backend.Forward(on, std::span<const Sequence>(&s, 1));
      };
      ASSERT_TRUE(run(bf16, **on_bf16, got).ok() && run(packed, **on_rounded, want).ok() &&
                  run(packed, **on_f32, as_loaded).ok());
      EXPECT_LT(testing::RelativeL2(got.data(), want.data(), got.size()), 1e-5) << form << " n=" << n;
      Sequence s;
      s.input = ConstMatrixView(input.data(), n, config.d_model);
      const std::vector<double> exact = ReferenceForward(weights, s);
      const double bf16_error = testing::RelativeL2(got.data(), exact);
      // bfloat16 keeps 8 bits of mantissa: each weight within 2^-9 of itself, and the sums of
      // d_model products of random signs well within that; float32 stays near 1e-6.
      EXPECT_LT(bf16_error, 1e-2) << form << " n=" << n;
      worst = std::max(worst, bf16_error);
      EXPECT_GT(bf16_error, 10 * testing::RelativeL2(as_loaded.data(), exact))
          << form << " n=" << n << ": not rounded?";
    }
  }
  std::printf("bfloat16 panels: worst relative L2 to float64 %.2e\n", worst);  // docs/architecture.md §3
}

// --cpu-weight-layout packed-bf16-dot: every form's whole forward within bfloat16's rounding of
// float64 (the weights and the projections' inputs each off by up to 2^-9), half the packed
// float32 copy's bytes, and further from float64 than packed-bf16, which rounds the weights alone.
TEST(WeightLayoutTest, Bfloat16DotRoundsTheProjectionsInputsToo) {
  if (!Bf16DotAvailable()) GTEST_SKIP() << "no AVX512_BF16 here: packed-bf16-dot is refused at start";
  const LayerConfig config = *CompleteConfig({.d_model = 128, .heads = 2});
  const LayerWeights weights = RandomLayerWeights(config, testing::TestSeed() + 1);
  CpuBackend dot({.threads = 2, .weight_layout = WeightLayout::kPackedBf16Dot});
  CpuBackend bf16({.threads = 2, .weight_layout = WeightLayout::kPackedBf16});
  std::mt19937_64 rng(testing::TestSeed());
  double worst = 0, worst_weights_only = 0;
  for (const FormWeights& materialized : {MaterializeFactored(weights), MaterializeSummed(weights)}) {
    const std::string form(FormName(materialized.form));
    auto f = std::make_shared<const FormWeights>(materialized);
    auto on_dot = dot.Upload(f), on_bf16 = bf16.Upload(f);
    ASSERT_TRUE(on_dot.ok() && on_bf16.ok()) << form;
    EXPECT_EQ((*on_dot)->HostBytes(), (*on_bf16)->HostBytes()) << form << ": pairs hold what rows hold";
    for (int64_t n : {1, 7, 64, 300}) {
      const std::vector<float> input = testing::RandomVector(rng, n * config.d_model);
      Sequence s;
      s.input = ConstMatrixView(input.data(), n, config.d_model);
      const std::vector<double> exact = ReferenceForward(weights, s);
      std::vector<float> got(input.size()), weights_only(input.size());
      s.output = MatrixView(got.data(), n, config.d_model);
      ASSERT_TRUE(dot.Forward(**on_dot, std::span<const Sequence>(&s, 1)).ok());
      s.output = MatrixView(weights_only.data(), n, config.d_model);
      ASSERT_TRUE(bf16.Forward(**on_bf16, std::span<const Sequence>(&s, 1)).ok());
      const double error = testing::RelativeL2(got.data(), exact);
      EXPECT_LT(error, 2e-2) << form << " n=" << n;
      worst = std::max(worst, error);
      worst_weights_only = std::max(worst_weights_only, testing::RelativeL2(weights_only.data(), exact));
    }
  }
  EXPECT_GT(worst, 1.2 * worst_weights_only) << "the inputs were not rounded as well?";
  std::printf("bfloat16 dot: worst relative L2 to float64 %.2e (weights alone %.2e)\n", worst, worst_weights_only);
}

// kt = scale · kᵀ from strided key tiles: row and column counts on both sides of its 8 × 8
// blocks, each element the scaled one exactly (one rounding, as float32 scale · k is), and no
// write outside kt's view.
TEST(TransposeScaledTest, EveryElementScaledAndNothingPastTheView) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX2 with FMA here: the general GEMM is used instead";
  std::mt19937_64 rng(testing::TestSeed());
  const float scale = 0.125f * 1.1f;
  int checked = 0;
  for (int64_t rows : {1, 7, 8, 9, 16, 17, 130}) {
    for (int64_t cols : {1, 7, 8, 9, 64, 70}) {
      const int64_t ldk = cols + 3, ldt = rows + 5;
      const std::vector<float> k = testing::RandomVector(rng, rows * ldk);
      std::vector<float> kt = testing::RandomVector(rng, cols * ldt);
      const std::vector<float> before = kt;
      TransposeScaled(ConstMatrixView(k.data(), rows, cols, ldk), scale, MatrixView(kt.data(), cols, rows, ldt));
      for (int64_t t = 0; t < cols; ++t) {
        for (int64_t j = 0; j < ldt; ++j) {
          const float want = j < rows ? scale * k[j * ldk + t] : before[t * ldt + j];
          ASSERT_EQ(kt[t * ldt + j], want) << rows << "x" << cols << " at kt[" << t << ", " << j << "]";
        }
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 7 * 6);
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
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(SkinnyGemmIsa(), avx2 ? "avx2" : "none");
  // With oneDNN the AVX2 kernel is never chosen (it measured slower); against Eigen it is.
  EXPECT_FALSE(UseSkinnyGemm(GemmLibrary::kOneDnn, 4, 768));
  EXPECT_EQ(UseSkinnyGemm(GemmLibrary::kEigen, 4, 768), avx2);
  EXPECT_EQ(CpuIsa(), __builtin_cpu_supports("avx2") ? "avx2" : "generic");
  EXPECT_NE(SoftmaxRowsIsa(), "avx512");
}

// The softmax's row kernels (softmax_rows.h) run on the widest ISA allowed: this test runs under
// both (cpu_kernels_avx2 caps it), so each path meets the same checks.
TEST(SoftmaxRowsTest, TheKernelsRunOnTheWidestAllowedIsa) {
  if (CpuIsaAllowsAvx512()) {
    EXPECT_EQ(SoftmaxRowsIsa(), "avx512");
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_EQ(SoftmaxRowsIsa(), "avx2");
  }
}

// Row lengths at and around every vector width and unrolling (8, 16, 32 lanes), and long rows.
std::vector<int64_t> SoftmaxRowLengths() {
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 70; ++n) lengths.push_back(n);
  for (int64_t n : {127, 128, 129, 511, 512, 513, 1000}) lengths.push_back(n);
  return lengths;
}

TEST(SoftmaxRowsTest, TheRowMaxIsTheMaxAndAnyNonFiniteScoreMakesItNaN) {
  std::mt19937_64 rng(testing::TestSeed());
  const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (int64_t n : SoftmaxRowLengths()) {
    std::vector<float> row = testing::RandomVector(rng, n, std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20));
    if (rng() % 2) std::transform(row.begin(), row.end(), row.begin(), [](float v) { return -std::abs(v) - 1; });
    ASSERT_EQ(RowMaxOrNaN(row.data(), n), *std::max_element(row.begin(), row.end())) << "n = " << n;
    for (float special : specials) {
      // Every position of short rows (the tails), drawn ones of long rows.
      for (int64_t at = 0; at < n; at += n <= 70 ? 1 : 1 + static_cast<int64_t>(rng() % 37)) {
        std::vector<float> bad = row;
        bad[at] = special;
        ASSERT_TRUE(std::isnan(RowMaxOrNaN(bad.data(), n))) << "n = " << n << ", " << special << " at " << at;
      }
    }
  }
}

// exp(s − top) against float64's exp of the same float32 difference: each value within 2 ulp
// (relative 2^-22), or within float32's smallest normal where the result is below it (a lane may
// flush a denormal to 0); the sum within the bound of n float32 additions in any order; nothing
// written past the row.
TEST(SoftmaxRowsTest, ExpAndSumMatchFloat64AtEveryLengthAndRange) {
  std::mt19937_64 rng(testing::TestSeed());
  double worst_ulps = 0;
  for (int64_t n : SoftmaxRowLengths()) {
    for (float spread : {1.0f, 20.0f, 90.0f, 200.0f}) {  // the scores' range below the max
      std::uniform_real_distribution<float> below(-spread, 0.0f);
      const float top = std::uniform_real_distribution<float>(-50.0f, 50.0f)(rng);
      std::vector<float> row(static_cast<size_t>(n) + 8, 12345.0f);  // 8 guards past the row
      for (int64_t j = 0; j < n; ++j) row[j] = top + below(rng);
      row[rng() % n] = top;
      const std::vector<float> scores = row;
      const float sum = ExpShiftedAndSum(row.data(), n, top);
      double exact_sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double exact = std::exp(static_cast<double>(scores[j] - top));
        exact_sum += exact;
        const double error = std::abs(row[j] - exact);
        if (exact >= std::numeric_limits<float>::min()) {
          worst_ulps = std::max(worst_ulps, error / (exact * std::ldexp(1.0, -23)));
          ASSERT_LE(error, exact * std::ldexp(1.0, -22)) << "n = " << n << ", exp(" << scores[j] - top << ")";
        } else {
          ASSERT_LE(error, std::numeric_limits<float>::min()) << "n = " << n << ", exp(" << scores[j] - top << ")";
        }
      }
      EXPECT_LE(std::abs(sum - exact_sum), (n + 2) * std::ldexp(1.0, -23) * exact_sum) << "n = " << n;
      for (size_t g = n; g < row.size(); ++g) ASSERT_EQ(row[g], 12345.0f) << "wrote past a row of " << n;
    }
  }
  RecordProperty("worst_ulps", std::to_string(worst_ulps));
}

// The backend keeps a forward's scratch for the next call, without zeroing it. A reused scratch
// holds the previous batch's values: a larger non-causal batch first, then causal ones that see
// fewer keys per row block (the summed form must zero what its blocks skip). Each answer must
// match float64 and be bit-identical to a fresh backend's.
TEST(CpuScratchTest, AReusedScratchGivesTheAnswersOfAFreshOne) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerConfig config = *CompleteConfig({.d_model = 48, .heads = 4});
  const LayerWeights w = RandomLayerWeights(config, rng());
  for (const FormWeights& form : {MaterializeFactored(w), MaterializeSummed(w)}) {
    SCOPED_TRACE(std::string(FormName(form.form)));
    auto shared = std::make_shared<const FormWeights>(form);
    CpuBackend reused(CpuBackendOptions{.threads = 2});
    auto resident = *reused.Upload(shared);
    std::vector<testing::OwnedSequence> big = {testing::RandomSequence(rng, 48, 70, 70, false, false, 70),
                                                 testing::RandomSequence(rng, 48, 50, 90, true, false, 90)};
    std::vector<Sequence> big_batch;
    for (auto& s : big) big_batch.push_back(s.View());
    ASSERT_TRUE(reused.Forward(*resident, big_batch).ok());
    EXPECT_GT(reused.RetainedScratchBytes(), 0);

    std::vector<testing::OwnedSequence> causal = {testing::RandomSequence(rng, 48, 37, 37, false, true, 37),
                                                    testing::RandomSequence(rng, 48, 21, 45, true, true, 30)};
    std::vector<Sequence> causal_batch;
    for (auto& s : causal) causal_batch.push_back(s.View());
    ASSERT_TRUE(reused.Forward(*resident, causal_batch).ok());

    std::vector<testing::OwnedSequence> fresh_copy = causal;
    std::vector<Sequence> fresh_batch;
    for (auto& s : fresh_copy) fresh_batch.push_back(s.View());
    CpuBackend fresh(CpuBackendOptions{.threads = 2});
    ASSERT_TRUE(fresh.Forward(**fresh.Upload(shared), fresh_batch).ok());
    for (size_t r = 0; r < causal.size(); ++r) {
      EXPECT_LT(testing::RelativeL2(causal[r].output.data(), ReferenceForward(w, causal[r].View())), 1e-5) << r;
      EXPECT_EQ(causal[r].output, fresh_copy[r].output) << "sequence " << r << ": the reused scratch changed the answer";
    }
  }
}

// The summed form's two association orders (SummedMixesFirst): a sequence with fewer queries
// than keys mixes its keys first, Y = Σ_i (A_i C) W_M_i; the others project first. Both against
// float64, alone and mixed in one batch, with grouped-query heads, biases, causal masks and key
// lengths; and the mixing-first sequence really skips its value projection: the flops the
// backend reports drop by exactly 2·(m − n)·d·h·d, and its scratch holds no value block.
TEST(SummedAssociationOrderTest, BothOrdersMatchFloat64AndTheCheaperOneRuns) {
  std::mt19937_64 rng(testing::TestSeed());
  const int64_t d = 40;
  const LayerConfig config = *CompleteConfig({.d_model = d, .heads = 4, .kv_heads = 2});
  const LayerWeights w = RandomLayerWeights(config, rng());
  auto form = std::make_shared<const FormWeights>(MaterializeSummed(w));
  std::vector<testing::OwnedSequence> seqs = {
      testing::RandomSequence(rng, d, 5, 37, true, true, 30),    // mixes first, causal, key length
      testing::RandomSequence(rng, d, 20, 12, true, false, 12),  // projects first (n > m)
      testing::RandomSequence(rng, d, 9, 9, false, true, 9),     // projects first (self)
      testing::RandomSequence(rng, d, 3, 64, true, false, 64),   // mixes first
  };
  for (int threads : {1, 2}) {
    CpuBackend cpu(CpuBackendOptions{.threads = threads});
    auto resident = *cpu.Upload(form);
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    ASSERT_TRUE(cpu.Forward(*resident, batch).ok());
    for (size_t r = 0; r < seqs.size(); ++r) {
      EXPECT_LT(testing::RelativeL2(seqs[r].output.data(), ReferenceForward(w, seqs[r].View())), 1e-5)
          << "sequence " << r << " (n " << seqs[r].n << ", m " << seqs[r].m << ") on " << threads << " threads";
    }
    for (size_t r : {size_t{0}, size_t{3}}) {  // alone: the head sum's GEMM split across the threads
      testing::OwnedSequence alone = seqs[r];
      const Sequence one[] = {alone.View()};
      ASSERT_TRUE(cpu.Forward(*resident, one).ok());
      EXPECT_LT(testing::RelativeL2(alone.output.data(), ReferenceForward(w, alone.View())), 1e-5) << r;
    }
  }
  // 2·(m − n)·d·(h·d) fewer FLOPs for a sequence of 5 queries over 37 keys: 2·32·40·160.
  const SequenceShape few_queries{.n = 5, .m = 37};
  EXPECT_DOUBLE_EQ(ForwardFlops(*form, {&few_queries, 1}) - CpuBackend().Flops(*form, {&few_queries, 1}),
                   2.0 * 32 * 40 * 160);
  const SequenceShape many_queries{.n = 20, .m = 12};
  EXPECT_DOUBLE_EQ(CpuBackend().Flops(*form, {&many_queries, 1}), ForwardFlops(*form, {&many_queries, 1}));
  // No value block in the scratch: Q [3, 40], K [64, 20], the mixes [3, 160] and a score block,
  // far below the value block alone, [64, 160] floats.
  testing::OwnedSequence wide = testing::RandomSequence(rng, d, 3, 64, true, false, 64);
  const Sequence one[] = {wide.View()};
  CpuBackend cpu(CpuBackendOptions{.threads = 1});
  ASSERT_TRUE(cpu.Forward(**cpu.Upload(form), one).ok());
  EXPECT_LT(cpu.RetainedScratchBytes(), 64 * 160 * 4);
}

// The scratch a backend retains is what its largest batch wrote, float for float: a scratch grown
// from 40 tokens to 41 holds what a fresh one holds for 41, not the twice-40 that geometric
// growth would leave (RetainedScratchBytes is then resident memory, which the soak's leak
// measure subtracts from the server's RSS).
TEST(CpuScratchTest, AGrownScratchHoldsExactlyWhatItsLargestBatchNeeds) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerConfig config = *CompleteConfig({.d_model = 32, .heads = 2});
  const LayerWeights w = RandomLayerWeights(config, rng());
  for (const FormWeights& form : {MaterializeFactored(w), MaterializeSummed(w)}) {
    SCOPED_TRACE(std::string(FormName(form.form)));
    auto shared = std::make_shared<const FormWeights>(form);
    testing::OwnedSequence small = testing::RandomSequence(rng, 32, 40, 40, false, false, 40);
    testing::OwnedSequence large = testing::RandomSequence(rng, 32, 41, 41, false, false, 41);
    const Sequence small_batch[] = {small.View()}, large_batch[] = {large.View()};
    CpuBackend grown(CpuBackendOptions{.threads = 1});
    auto resident = *grown.Upload(shared);
    ASSERT_TRUE(grown.Forward(*resident, small_batch).ok());
    const int64_t after_small = grown.RetainedScratchBytes();
    ASSERT_TRUE(grown.Forward(*resident, large_batch).ok());
    EXPECT_GT(grown.RetainedScratchBytes(), after_small);
    CpuBackend fresh(CpuBackendOptions{.threads = 1});
    ASSERT_TRUE(fresh.Forward(**fresh.Upload(shared), large_batch).ok());
    EXPECT_EQ(grown.RetainedScratchBytes(), fresh.RetainedScratchBytes());
  }
}

TEST(CpuScratchTest, AScratchAboveTheRetentionBoundIsFreed) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerConfig config = *CompleteConfig({.d_model = 32, .heads = 2});
  auto form = std::make_shared<const FormWeights>(MaterializeSummed(RandomLayerWeights(config, rng())));
  testing::OwnedSequence s = testing::RandomSequence(rng, 32, 40, 40, false, false, 40);
  const Sequence batch[] = {s.View()};
  CpuBackend keeps(CpuBackendOptions{.threads = 1});
  ASSERT_TRUE(keeps.Forward(**keeps.Upload(form), batch).ok());
  // At least Q, K and the value block: 40 tokens × (2·32 + 2·32) floats.
  EXPECT_GE(keeps.RetainedScratchBytes(), 40 * (2 * 32 + 2 * 32) * 4);
  CpuBackend frees(CpuBackendOptions{.threads = 1, .max_retained_scratch_bytes = 1024});
  ASSERT_TRUE(frees.Forward(**frees.Upload(form), batch).ok());
  EXPECT_EQ(frees.RetainedScratchBytes(), 0);
}

}  // namespace
}  // namespace attnserve
