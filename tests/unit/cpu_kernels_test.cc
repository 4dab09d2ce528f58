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
#include "server/core/forms.h"
#include "server/core/reference.h"
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
