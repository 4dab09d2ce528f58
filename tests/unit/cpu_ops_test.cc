// The CPU's device operations (server/backend/cpu/cpu_ops.h): a product by the form's weights
// finds their packed panels by the block's name (matrix, rows, columns), never by the address of
// the view it is given, checked against float64 on the weights as the panels round them.
#include "server/backend/cpu/cpu_ops.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "server/backend/compute_team.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

double AsBfloat16(float w) {
  const uint32_t bits = static_cast<uint32_t>(RoundToBfloat16(w)) << 16;
  float widened;
  std::memcpy(&widened, &bits, sizeof widened);
  return widened;
}

// The matrix a WeightBlock names, in the form's own storage.
const AlignedFloats& Matrix(const FormWeights& f, WeightMatrix m) { return m == WeightMatrix::kIn ? f.w_in : f.w_out; }
int64_t MatrixCols(const FormWeights& f, WeightMatrix m) {
  return m == WeightMatrix::kIn ? f.in_cols() : f.config.d_model;
}

// How far y = x · w + bias is from float64 over `f`'s weights of the block, each weight as
// `weight_as` reads it, in units of the bound of a float32 dot product in any order (k + 2
// roundings of 2^-24, relative to Σ|x·w| + |bias|): at most 1 when y is that product.
double WorstInBounds(const std::vector<float>& x, const std::vector<float>& y, const std::vector<float>& bias,
                     const FormWeights& f, const WeightBlock& w, double (*weight_as)(float)) {
  const AlignedFloats& m = Matrix(f, w.matrix);
  const int64_t ld = MatrixCols(f, w.matrix), k = w.view.rows, rows = static_cast<int64_t>(x.size()) / k;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < w.view.cols; ++c) {
      double sum = bias[c], magnitude = std::abs(bias[c]);
      for (int64_t t = 0; t < k; ++t) {
        const double p = double{x[r * k + t]} * weight_as(m[(w.row0 + t) * ld + w.col0 + c]);
        sum += p;
        magnitude += std::abs(p);
      }
      const double bound = static_cast<double>(k + 2) * std::ldexp(1.0, -24) * magnitude;
      worst = std::max(worst, std::abs(y[r * w.view.cols + c] - sum) / bound);
    }
  }
  return worst;
}

double AsLoaded(float w) { return w; }

struct TwoLayers {
  std::shared_ptr<const FormWeights> a, b;
  std::unique_ptr<CpuResidentForm> resident_a, resident_b;
};

TwoLayers PackedBf16(std::mt19937_64& rng) {
  // A panel's width of query columns, so that K and the value block start on panels too.
  const int64_t width = PanelWidth();
  const LayerConfig c = *CompleteConfig({.d_model = width, .heads = 4, .bias = true});
  TwoLayers l;
  l.a = std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(c, rng())));
  l.b = std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(c, rng())));
  l.resident_a = std::make_unique<CpuResidentForm>(l.a, width, PanelPrecision::kBfloat16);
  l.resident_b = std::make_unique<CpuResidentForm>(l.b, width, PanelPrecision::kBfloat16);
  return l;
}

// y = x · w + bias through CpuOps::GemmWeights on `resident`, with the block viewed in `copy`,
// split for 2 threads: on `team` (held for the call, as a forward holds it), or none, on this
// thread.
StatusOr<std::vector<float>> ProductOn(const CpuResidentForm& resident, const WeightBlock& w,
                                       const std::vector<float>& x, const std::vector<float>& bias,
                                       ComputeTeam* team = nullptr) {
  ForwardScratch scratch;
  CpuOps ops(Compute{.gemm = GemmLibrary::kEigen, .threads = 2, .summed_order = {}, .team = team}, &resident,
             int64_t{256} << 20, int64_t{64} << 20, scratch);
  const int64_t rows = static_cast<int64_t>(x.size()) / w.view.rows;
  std::vector<float> y(static_cast<size_t>(rows * w.view.cols));
  if (team != nullptr) team->Hold();
  const Status st = ops.GemmWeights(ConstMatrixView(x.data(), rows, w.view.rows), w, bias.data(),
                                    MatrixView(y.data(), rows, w.view.cols), /*accumulate=*/false);
  if (team != nullptr) team->Release();
  if (!st.ok()) return st;
  return y;
}

// Two layers of the same shape, each packed as bfloat16, and their weights copied elsewhere (as
// a device copy or a reloaded layer would be): every block the skeleton multiplies by (all of
// W_in, K's columns and the value block at whole-panel offsets, W_out) comes out as its own
// layer's rounded weights, whatever memory the block's view points into. A lookup by address
// misses the copy and multiplies the float32 weights (off by bfloat16's rounding, hundreds of
// bounds); one that mixes up the matrices, the layers or the offsets is off by whole products.
TEST(CpuOpsTest, WeightGemmsFindTheirPackedBlockByNameNotAddress) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  std::mt19937_64 rng(testing::TestSeed());
  const TwoLayers l = PackedBf16(rng);
  for (const auto& [form, resident, name] :
       {std::tuple{l.a.get(), l.resident_a.get(), "layer a"}, std::tuple{l.b.get(), l.resident_b.get(), "layer b"}}) {
    const FormWeights& f = *form;
    const FormWeights copy = f;  // the same weights at other addresses
    ASSERT_NE(copy.w_in.data(), f.w_in.data());
    const DeviceWeights at_copy = HostWeights(copy);
    const struct {
      WeightBlock w;
      const char* what;
    } blocks[] = {{at_copy.w_in, "W_in"},
                  {at_copy.w_in.ColBlock(f.q_cols, f.k_cols), "W_in's K columns"},
                  {at_copy.w_in.ColBlock(f.q_cols + f.k_cols, f.value_cols), "the value block"},
                  {at_copy.w_out, "W_out"}};
    for (const auto& [w, what] : blocks) {
      SCOPED_TRACE(std::string(name) + ", " + what);
      const std::vector<float> x = testing::RandomVector(rng, 5 * w.view.rows);
      const std::vector<float> bias = testing::RandomVector(rng, w.view.cols);
      const StatusOr<std::vector<float>> y = ProductOn(*resident, w, x, bias);
      ASSERT_TRUE(y.ok()) << y.status().message();
      EXPECT_LE(WorstInBounds(x, *y, bias, f, w, AsBfloat16), 1.0) << "not this layer's rounded weights";
      // The test can tell a miss: the float32 weights are far outside the bound.
      EXPECT_GT(WorstInBounds(x, *y, bias, f, w, AsLoaded), 10.0) << "the panels were not used";
    }
  }
}

// A block that starts inside a panel has no packed block: the library multiplies the view's
// float32 weights (docs/architecture.md, "The CPU backend"); and a block outside the matrix it
// names is an error that says which, not a silent miss.
TEST(CpuOpsTest, MidPanelBlocksUseTheViewAndBlocksOutsideTheirMatrixFail) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  std::mt19937_64 rng(testing::TestSeed());
  const TwoLayers l = PackedBf16(rng);
  const FormWeights& f = *l.b;
  const DeviceWeights w = HostWeights(f);
  const WeightBlock mid = w.w_in.ColBlock(8, 24);
  const std::vector<float> x = testing::RandomVector(rng, 3 * mid.view.rows);
  const std::vector<float> bias = testing::RandomVector(rng, mid.view.cols);
  const StatusOr<std::vector<float>> y = ProductOn(*l.resident_b, mid, x, bias);
  ASSERT_TRUE(y.ok()) << y.status().message();
  EXPECT_LE(WorstInBounds(x, *y, bias, f, mid, AsLoaded), 1.0);

  const int64_t d = f.config.d_model;
  WeightBlock outside = w.w_out.ColBlock(d / 2, d / 2);
  outside.col0 = d / 2 + 8;  // columns [d/2 + 8, d + 8) of a [d, d] W_out
  const StatusOr<std::vector<float>> refused = ProductOn(*l.resident_b, outside, x, bias);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInternal);
  const std::string want = "columns [" + std::to_string(d / 2 + 8) + ", " + std::to_string(d + 8) +
                           ") of W_out: " + "expected a block inside its [" + std::to_string(d) + ", " +
                           std::to_string(d) + "]";
  EXPECT_NE(refused.status().message().find(want), std::string::npos) << refused.status().message();
}

// SplitColumns: one block per thread from the library; three per thread on the panels where
// each has work enough; whole 64-column blocks that cover the columns, none empty.
TEST(ColumnSplitTest, ThreeBlocksAThreadOnPanelsOneFromTheLibrary) {
  // bert-base's W_in at 1024 tokens on 2 threads: 6 blocks of 384 on panels, 2 of 1152 without.
  EXPECT_EQ(SplitColumns(1024, 768, 2304, 2, true).blocks, 6);
  EXPECT_EQ(SplitColumns(1024, 768, 2304, 2, true).width, 384);
  EXPECT_EQ(SplitColumns(1024, 768, 2304, 2, false).blocks, 2);
  EXPECT_EQ(SplitColumns(1024, 768, 2304, 2, false).width, 1152);
  // gpt2-medium's W_O: 1024 / 6 rounds up to 192, five of them and one of 64.
  EXPECT_EQ(SplitColumns(1024, 1024, 1024, 2, true).blocks, 6);
  EXPECT_EQ(SplitColumns(1024, 1024, 1024, 2, true).width, 192);
  // One token's product is under the blocks' minimum work: one block per thread, as before.
  EXPECT_EQ(SplitColumns(1, 768, 2304, 2, true).blocks, 2);
  // Few columns: no block under 64 of them; one thread: one block.
  EXPECT_EQ(SplitColumns(1024, 768, 100, 2, true).blocks, 2);
  EXPECT_EQ(SplitColumns(1024, 768, 64, 4, true).blocks, 1);
  EXPECT_EQ(SplitColumns(1024, 768, 2304, 1, true).blocks, 1);
  EXPECT_EQ(SplitColumns(1024, 768, 0, 2, true).blocks, 0);

  std::mt19937_64 rng(testing::TestSeed());
  std::uniform_int_distribution<int64_t> dim(1, 4096);
  std::uniform_int_distribution<int> thread_count(1, 8);
  for (int i = 0; i < 2000; ++i) {
    const int64_t rows = dim(rng), depth = dim(rng), cols = dim(rng);
    const int threads = thread_count(rng);
    for (const bool on_panels : {false, true}) {
      const ColumnSplit s = SplitColumns(rows, depth, cols, threads, on_panels);
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(depth) + "x" + std::to_string(cols) + " on " +
                   std::to_string(threads) + (on_panels ? ", panels" : ", library"));
      ASSERT_EQ(s.width % 64, 0);
      ASSERT_GE(s.blocks * s.width, cols) << "columns left out";
      ASSERT_LT((s.blocks - 1) * s.width, cols) << "an empty block";
      const int64_t most = on_panels ? int64_t{threads} * kPanelBlocksPerThread : threads;
      ASSERT_LE(s.blocks, most);
      // At least a block per thread, as far as whole 64-column blocks allow (817 columns on 8
      // threads are 7 blocks of 128).
      const int64_t least = std::min<int64_t>(threads, (cols + 63) / 64), even = (cols + least - 1) / least;
      ASSERT_LE(s.width, (even + 63) / 64 * 64) << "fewer blocks than threads";
      if (on_panels && s.blocks > threads) {
        ASSERT_GE(rows * depth * s.width, kMinColumnBlockMultiplyAdds) << "blocks below the minimum work";
      }
    }
  }
}

// Float32 panels cut into more blocks than threads (SplitColumns), ragged last block included,
// on a real team of two and on this thread alone: the product of every block is the float64
// one, the bias in each block's own columns.
TEST(CpuOpsTest, PanelProductsSplitAcrossATeamMatchFloat64) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: the weights stay row-major";
  std::mt19937_64 rng(testing::TestSeed());
  const LayerConfig c = *CompleteConfig({.d_model = 320, .heads = 4, .bias = true});
  const auto f = std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(c, rng())));
  const CpuResidentForm resident(f, PanelWidth(), PanelPrecision::kFloat32);
  const DeviceWeights w = HostWeights(*f);
  const int64_t rows = 96;  // the AVX2 kernel's panels from 64 rows
  ASSERT_TRUE(PanelGemmPays(rows, w.w_in.view.ld));
  ComputeTeam team(2, std::chrono::microseconds(100));
  for (ComputeTeam* on : {&team, static_cast<ComputeTeam*>(nullptr)}) {
    for (const WeightBlock& block : {w.w_in, w.w_out}) {
      SCOPED_TRACE(std::string(on != nullptr ? "team" : "alone") + ", " + std::string(WeightMatrixName(block.matrix)));
      ASSERT_GT(SplitColumns(rows, block.view.rows, block.view.cols, 2, true).blocks, 2);
      const std::vector<float> x = testing::RandomVector(rng, rows * block.view.rows);
      const std::vector<float> bias = testing::RandomVector(rng, block.view.cols);
      const StatusOr<std::vector<float>> y = ProductOn(resident, block, x, bias, on);
      ASSERT_TRUE(y.ok()) << y.status().message();
      EXPECT_LE(WorstInBounds(x, *y, bias, *f, block, AsLoaded), 1.0);
    }
  }
}

}  // namespace
}  // namespace attnserve
