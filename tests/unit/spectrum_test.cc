// Spectra of the per-head OV and QK products, rank selection and the low-rank form, against a
// direct float64 SVD of the materialised d×d matrices.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// W_M_i = W_V_g(i) W_O_i by explicit sums, in float64.
Eigen::MatrixXd DirectOv(const LayerWeights& w, int64_t i) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, dh = c.d_head, kvc = c.kv_heads * dh, g = c.KvHeadOf(i);
  Eigen::MatrixXd m = Eigen::MatrixXd::Zero(d, d);
  for (int64_t r = 0; r < d; ++r)
    for (int64_t col = 0; col < d; ++col)
      for (int64_t t = 0; t < dh; ++t) m(r, col) += double{w.w_v[r * kvc + g * dh + t]} * w.w_o[(i * dh + t) * d + col];
  return m;
}

// W_Q_i W_K_g(i)^T by explicit sums, in float64.
Eigen::MatrixXd DirectQk(const LayerWeights& w, int64_t i) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, dh = c.d_head, qc = c.heads * dh, kvc = c.kv_heads * dh, g = c.KvHeadOf(i);
  Eigen::MatrixXd m = Eigen::MatrixXd::Zero(d, d);
  for (int64_t r = 0; r < d; ++r)
    for (int64_t col = 0; col < d; ++col)
      for (int64_t t = 0; t < dh; ++t) m(r, col) += double{w.w_q[r * qc + i * dh + t]} * w.w_k[col * kvc + g * dh + t];
  return m;
}

void ExpectSameSpectrum(const HeadSpectrum& got, const Eigen::MatrixXd& direct) {
  const Eigen::VectorXd want = Eigen::JacobiSVD<Eigen::MatrixXd>(direct).singularValues();
  ASSERT_LE(static_cast<int64_t>(got.singular_values.size()), want.size());
  for (size_t r = 0; r < got.singular_values.size(); ++r) {
    EXPECT_NEAR(got.singular_values[r], want[r], 1e-10 * want[0]) << "sigma " << r;
  }
  // The directions not reported are zero: rank ≤ d_head.
  for (int64_t r = got.singular_values.size(); r < want.size(); ++r) EXPECT_LT(want[r], 1e-10 * want[0]);
  EXPECT_NEAR(got.frobenius, direct.norm(), 1e-10 * direct.norm());
}

TEST(SpectrumTest, MatchesDirectSvdOnRandomLayers) {
  for (LayerConfig config : {LayerConfig{.d_model = 40, .heads = 4, .kv_heads = 2, .d_head = 12},
                             LayerConfig{.d_model = 6, .heads = 3, .d_head = 10},  // d < d_h
                             LayerConfig{.d_model = 33, .heads = 1, .d_head = 33, .bias = false}}) {
    const LayerWeights w = RandomLayerWeights(*CompleteConfig(config), 21);
    const LayerSpectrum s = ComputeSpectrum(w);
    ASSERT_EQ(s.ov.size(), static_cast<size_t>(w.config.heads));
    for (int64_t i = 0; i < w.config.heads; ++i) {
      SCOPED_TRACE(w.config.ToString() + " head " + std::to_string(i));
      EXPECT_EQ(s.ov[i].singular_values.size(), static_cast<size_t>(std::min(w.config.d_model, w.config.d_head)));
      ExpectSameSpectrum(s.ov[i], DirectOv(w, i));
      ExpectSameSpectrum(s.qk[i], DirectQk(w, i));
    }
  }
}

// A head whose value projection has rank 2 has an OV spectrum of rank 2, whatever d_h is.
TEST(SpectrumTest, ConstructedLowRankHead) {
  const LayerConfig c = *CompleteConfig({.d_model = 24, .heads = 2, .d_head = 8});
  std::mt19937_64 rng(testing::TestSeed() + 3);
  LayerWeights w = RandomLayerWeights(c, rng());
  const auto u1 = testing::RandomVector(rng, 24), u2 = testing::RandomVector(rng, 24);
  const auto v1 = testing::RandomVector(rng, 8), v2 = testing::RandomVector(rng, 8);
  for (int64_t r = 0; r < 24; ++r)
    for (int64_t t = 0; t < 8; ++t) w.w_v[r * 16 + 8 + t] = u1[r] * v1[t] + 0.1f * u2[r] * v2[t];  // head 1
  const LayerSpectrum s = ComputeSpectrum(w);
  const HeadSpectrum& h = s.ov[1];
  EXPECT_GT(h.singular_values[1], 1e-6 * h.singular_values[0]);
  // Beyond rank 2 only the float32 rounding of the stored weights remains (~1e-7 relative).
  for (size_t r = 2; r < h.singular_values.size(); ++r) EXPECT_LT(h.singular_values[r], 1e-6 * h.singular_values[0]);
  EXPECT_LE(h.rank_999, 2);
  EXPECT_LT(h.effective_rank, 2.0);
  EXPECT_GE(h.effective_rank, 1.0);
  EXPECT_NEAR(h.stable_rank, 1 + std::pow(h.singular_values[1] / h.singular_values[0], 2), 1e-9);
  EXPECT_GT(s.ov[0].rank_999, 2);  // the random head uses most of its directions
}

TEST(SpectrumTest, RankForEnergy) {
  const std::vector<double> s = {3, 2, 1};  // energies 9, 4, 1 of 14
  EXPECT_EQ(RankForEnergy(s, 0.5), 1);
  EXPECT_EQ(RankForEnergy(s, 9.0 / 14), 1);
  EXPECT_EQ(RankForEnergy(s, 0.9), 2);
  EXPECT_EQ(RankForEnergy(s, 1.0), 3);
  EXPECT_EQ(RankForEnergy({0, 0}, 0.9), 0);
}

// Spectra known by construction (testing::KnownSpectra: orthonormal bases times chosen σ):
// the singular values, the energy ranks and every rank selection against the values worked
// out by hand, on both the OV and the QK side (the QK side reads the heads in another order).
TEST(SpectrumTest, KnownSpectraGiveTheirEnergyRanks) {
  const testing::KnownSpectra known;
  std::vector<std::vector<double>> qk_sigma;
  std::vector<int64_t> qk_rank_90, qk_rank_99, qk_rank_999;
  for (size_t i = 0; i < 6; ++i) {
    const size_t j = (i + 2) % 6;
    qk_sigma.push_back(known.sigma[j]);
    qk_rank_90.push_back(known.rank_90[j]);
    qk_rank_99.push_back(known.rank_99[j]);
    qk_rank_999.push_back(known.rank_999[j]);
  }
  std::mt19937_64 rng(testing::TestSeed() + 4);
  for (LayerConfig config : {LayerConfig{.d_model = 24, .heads = 6, .kv_heads = 3, .d_head = 8},
                             LayerConfig{.d_model = 8, .heads = 6, .d_head = 8, .bias = false}}) {
    SCOPED_TRACE(config.ToString());
    const LayerWeights w = testing::LayerWithSpectra(*CompleteConfig(config), known.sigma, qk_sigma, rng);
    const LayerSpectrum s = ComputeSpectrum(w);
    ASSERT_EQ(s.ov.size(), 6u);
    ASSERT_EQ(s.qk.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      SCOPED_TRACE("head " + std::to_string(i));
      ASSERT_EQ(s.ov[i].singular_values.size(), 8u);
      ASSERT_EQ(s.qk[i].singular_values.size(), 8u);
      double energy = 0;
      for (size_t t = 0; t < 8; ++t) {
        EXPECT_NEAR(s.ov[i].singular_values[t], known.sigma[i][t], 1e-6 * known.sigma[i][0]) << "ov sigma " << t;
        EXPECT_NEAR(s.qk[i].singular_values[t], qk_sigma[i][t], 1e-6 * qk_sigma[i][0]) << "qk sigma " << t;
        energy += known.sigma[i][t] * known.sigma[i][t];
      }
      EXPECT_NEAR(s.ov[i].frobenius, std::sqrt(energy), 1e-6 * std::sqrt(energy));
      EXPECT_NEAR(s.ov[i].stable_rank, energy / (known.sigma[i][0] * known.sigma[i][0]), 1e-5);
      EXPECT_EQ(s.ov[i].rank_90, known.rank_90[i]);
      EXPECT_EQ(s.ov[i].rank_99, known.rank_99[i]);
      EXPECT_EQ(s.ov[i].rank_999, known.rank_999[i]);
      EXPECT_EQ(s.qk[i].rank_90, qk_rank_90[i]);
      EXPECT_EQ(s.qk[i].rank_99, qk_rank_99[i]);
      EXPECT_EQ(s.qk[i].rank_999, qk_rank_999[i]);
    }
    auto select = [&](RankSelection::Kind kind, double energy, int64_t budget) {
      auto ranks = SelectRanks(s, {.kind = kind, .energy = energy, .budget = budget, .ranks = {}});
      EXPECT_TRUE(ranks.ok()) << ranks.status().ToString();
      return ranks.ok() ? *ranks : std::vector<int64_t>{};
    };
    EXPECT_EQ(select(RankSelection::Kind::kEnergy, 0.9, 0), known.rank_90);
    EXPECT_EQ(select(RankSelection::Kind::kEnergy, 0.99, 0), known.rank_99);
    EXPECT_EQ(select(RankSelection::Kind::kEnergy, 0.999, 0), known.rank_999);
    EXPECT_EQ(select(RankSelection::Kind::kEnergy, 1.0, 0), std::vector<int64_t>(6, 8));
    EXPECT_EQ(select(RankSelection::Kind::kBudget, 0, 13), known.budget_13);
    EXPECT_EQ(select(RankSelection::Kind::kBudget, 0, 20), known.budget_20);
    EXPECT_EQ(select(RankSelection::Kind::kBudget, 0, 48), std::vector<int64_t>(6, 8));
  }
}

TEST(SpectrumTest, BudgetTakesTheLargestSingularValuesAcrossHeads) {
  std::mt19937_64 rng(testing::TestSeed() + 5);
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4, .d_head = 8}), rng());
  const LayerSpectrum s = ComputeSpectrum(w);
  auto ranks = SelectRanks(s, {.kind = RankSelection::Kind::kBudget, .energy = 0, .budget = 13, .ranks = {}});
  ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
  EXPECT_EQ(std::accumulate(ranks->begin(), ranks->end(), int64_t{0}), 13);
  std::vector<double> all;
  for (const auto& h : s.ov) all.insert(all.end(), h.singular_values.begin(), h.singular_values.end());
  std::sort(all.begin(), all.end(), std::greater<>());
  for (size_t i = 0; i < 4; ++i) {
    // Every kept σ is at least the 13th largest overall, every dropped one at most.
    if ((*ranks)[i] > 0) {
      EXPECT_GE(s.ov[i].singular_values[(*ranks)[i] - 1], all[12]);
    }
    if ((*ranks)[i] < 8) {
      EXPECT_LE(s.ov[i].singular_values[(*ranks)[i]], all[12]);
    }
  }
  EXPECT_THAT(SelectRanks(s, {.kind = RankSelection::Kind::kBudget, .energy = 0, .budget = 33, .ranks = {}}).status().message(),
              HasSubstr("lowrank budget: expected a total rank in [1, 32], got 33"));
  EXPECT_THAT(SelectRanks(s, {.kind = RankSelection::Kind::kEnergy, .energy = 1.5, .budget = 0, .ranks = {}}).status().message(),
              HasSubstr("lowrank energy"));
  EXPECT_THAT(MaterializeLowRank(w, {1, 2, 9, 1}).status().message(),
              HasSubstr("lowrank ranks[2]: expected a value in [0, 8], got 9"));
}

// Output of the low-rank form: exact with full ranks; with truncated ranks the weight error is
// the discarded energy (Eckart–Young) and the output error stays under the bound it implies. The
// layer's OV spectra are chosen (testing::LayerWithSpectra): head i has σ_t = a_i · 0.8^t, so
// the energy a rank-r head drops is Σ_{t≥r} σ_t², known without an SVD.
TEST(SpectrumTest, LowRankFormErrorFollowsDiscardedEnergy) {
  const LayerConfig c = *CompleteConfig({.d_model = 48, .heads = 4, .kv_heads = 2, .d_head = 16});
  const double scales[] = {3.0, 2.0, 1.5, 1.0};
  std::vector<std::vector<double>> sigma(4);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t t = 0; t < 16; ++t) sigma[i].push_back(scales[i] * std::pow(0.8, t));
  std::mt19937_64 rng(testing::TestSeed() + 6);
  const LayerWeights w = testing::LayerWithSpectra(c, sigma, sigma, rng);
  auto seq = testing::RandomSequence(rng, 48, 20, 20, false, true, -1);
  const std::vector<double> want = ReferenceForward(w, seq.View());
  CpuBackend backend;
  // FLOPs by hand (docs/architecture.md §1; n = m = 20, d = 48, h = 4, h_kv = 2, d_h = 16, value
  // block and output projection of width R = Σ r_i = 4r):
  //   QK = 2·n·d·h·d_h + 2·m·d·h_kv·d_h + 2·h·n·m·d_h = 122880 + 61440 + 51200 = 235520
  //   OV = 2·m·d·R + 2·n·m·R + 2·n·R·d = (1920 + 800 + 1920)·R = 4640·R
  // so r = 16 (R = 64): 235520 + 296960 = 532480; r = 12: 458240; r = 8: 384000; r = 4: 309760;
  // r = 1: 254080.
  const std::pair<int64_t, double> rank_and_flops[] = {
      {16, 532480}, {12, 458240}, {8, 384000}, {4, 309760}, {1, 254080}};
  double previous_error = INFINITY;
  for (const auto& [r, flops] : rank_and_flops) {
    const std::vector<int64_t> ranks(4, r);
    auto form = MaterializeLowRank(w, ranks);
    ASSERT_TRUE(form.ok()) << form.status().ToString();
    const SequenceShape shape{.n = 20, .m = 20};
    EXPECT_EQ(ForwardFlops(*form, {&shape, 1}), flops) << "rank " << r;
    // Weight error of head 0 = the energy its dropped directions carried.
    Eigen::MatrixXd approx = Eigen::MatrixXd::Zero(48, 48);
    for (int64_t a = 0; a < 48; ++a)
      for (int64_t b = 0; b < 48; ++b)
        for (int64_t t = 0; t < r; ++t) approx(a, b) += double{form->w_in[a * form->in_cols() + form->q_cols + form->k_cols + t]} * form->w_out[t * 48 + b];
    double dropped = 0, total = 0;
    for (int64_t t = 0; t < 16; ++t) {
      total += sigma[0][t] * sigma[0][t];
      if (t >= r) dropped += sigma[0][t] * sigma[0][t];
    }
    EXPECT_NEAR((approx - DirectOv(w, 0)).squaredNorm(), dropped, 1e-5 * total) << "rank " << r;

    auto resident = backend.Upload(std::make_shared<const FormWeights>(*std::move(form)));
    const Sequence batch[] = {seq.View()};
    ASSERT_TRUE(backend.Forward(**resident, batch).ok());
    const double err = testing::RelativeL2(seq.output.data(), want);
    if (r == 16) {
      EXPECT_LT(err, 1e-5) << "full rank is exact";
    } else {
      // ‖ΔY‖ ≤ Σ_i ‖A_i‖₂ ‖C‖_F σ_{r+1,i} with ‖A_i‖₂ ≤ sqrt(n) (rows sum to 1).
      double input_norm = 0, want_norm = 0, bound = 0;
      for (float x : seq.input) input_norm += double{x} * x;
      for (double y : want) want_norm += y * y;
      for (int64_t i = 0; i < 4; ++i) bound += std::sqrt(20.0) * std::sqrt(input_norm) * sigma[i][r];
      EXPECT_LT(err * std::sqrt(want_norm), bound) << "rank " << r;
      EXPECT_GT(err, 1e-5) << "a truncated form must differ, rank " << r;
      EXPECT_LT(previous_error, INFINITY);
      EXPECT_GT(err, previous_error) << "error grows as rank falls, rank " << r;
    }
    previous_error = r == 16 ? 0 : err;
  }
}

}  // namespace
}  // namespace attnserve
