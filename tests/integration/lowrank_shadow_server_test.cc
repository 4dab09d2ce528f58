// The live check of lowrank=divergence:EPS (docs/spectra.md): the real attnserve binary serves a
// low-rank form whose ranks were chosen for EPS on a calibration file, mirrors every request to
// the factored form (--shadow-rate 1), and the shadow divergence histogram of its traffic —
// fresh inputs drawn like the calibration rows — lies under EPS. The same traffic on a crude
// low-rank form (budget:4) lands above EPS: the histogram check can fail.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/npy.h"
#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

constexpr int64_t kDModel = 32;
constexpr double kEps = 0.1;  // a bucket bound of attnserve_shadow_divergence

// Rows like the calibration's: z · diag(0.85^j) · M for z ~ N(0, I) and one fixed random
// mixing M (seed `mix`), so the inputs' second moment is far from the identity.
std::vector<float> Rows(int64_t rows, uint64_t mix, uint64_t draw) {
  std::mt19937_64 mix_rng(mix), draw_rng(draw);
  std::normal_distribution<double> normal;
  std::vector<double> m(kDModel * kDModel);
  for (double& v : m) v = normal(mix_rng) / std::sqrt(double{kDModel});
  std::vector<float> x(rows * kDModel);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> z(kDModel);
    for (int64_t j = 0; j < kDModel; ++j) z[j] = normal(draw_rng) * std::pow(0.85, j);
    for (int64_t c = 0; c < kDModel; ++c) {
      double v = 0;
      for (int64_t j = 0; j < kDModel; ++j) v += z[j] * m[j * kDModel + c];
      x[r * kDModel + c] = static_cast<float>(v);
    }
  }
  return x;
}

std::string Bucket(const std::string& layer, const std::string& le) {
  return "attnserve_shadow_divergence_bucket{form=\"factored\",layer=\"" + layer + "\",le=\"" + le + "\"}";
}

TEST(LowRankShadowTest, TheShadowDivergenceOfTrafficLikeTheCalibrationStaysUnderEps) {
  testing::TempDir files;
  constexpr uint64_t kMix = 11;
  NpyArray calibration{{512, kDModel}, Rows(512, kMix, 1)};
  ASSERT_TRUE(WriteNpy(files.File("calib.npy"), calibration).ok());
  const std::string layer = "random:d_model=32,heads=4,seed=5,summed=false,lowrank=";
  testing::MetricsServer server(
      ATTNSERVE_BINARY, {"--layer", "cal=" + layer + "divergence:0.1,calibration=" + files.File("calib.npy"), "--layer",
                         "crude=" + layer + "budget:4", "--shadow-rate", "1"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();

  v1::LayerInfo info;
  ASSERT_TRUE(client.GetLayer("cal", &info).ok());
  const v1::FormInfo* lowrank = nullptr;
  for (const v1::FormInfo& f : info.forms()) {
    if (f.form() == v1::FORM_LOWRANK) lowrank = &f;
  }
  ASSERT_NE(lowrank, nullptr);
  EXPECT_EQ(lowrank->rank_selection(), "divergence:0.1");
  EXPECT_EQ(lowrank->calibration_rows(), 512);
  EXPECT_GT(lowrank->calibration_divergence(), 0);
  EXPECT_LE(lowrank->calibration_divergence(), kEps);
  EXPECT_EQ(lowrank->head_divergence_size(), 4);
  EXPECT_EQ(lowrank->head_kept_energy_size(), 4);
  int64_t total = 0;
  for (int64_t r : lowrank->ranks()) total += r;
  EXPECT_LT(total, 4 * 8) << "the form must actually drop directions for the check to mean anything";
  EXPECT_THAT(info.source(), ::testing::HasSubstr("calibration=calib.npy"));

  // Traffic: fresh rows from the same distribution, in sequences as long as the calibration's.
  constexpr int kRequests = 12;
  for (const std::string name : {"cal", "crude"}) {
    for (int i = 0; i < kRequests; ++i) {
      v1::ForwardRequest req;
      req.set_layer(name);
      req.set_form(v1::FORM_LOWRANK);
      *req.mutable_input() = MakeTensor(Rows(128, kMix, 100 + i), {1, 128, kDModel});
      v1::ForwardResponse resp;
      ASSERT_TRUE(client.Forward(req, &resp).ok());
      EXPECT_EQ(resp.form(), v1::FORM_LOWRANK);
    }
  }
  for (const std::string name : {"cal", "crude"}) {
    const std::string count = "attnserve_shadow_divergence_count{form=\"factored\",layer=\"" + name + "\"}";
    EXPECT_EQ(server.WaitForSample(count, kRequests, std::chrono::seconds(30)), kRequests) << name;
  }
  const double cal_mean = server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"cal\"}") / kRequests;
  const double crude_mean =
      server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"crude\"}") / kRequests;
  std::cout << "total rank " << total << " of 32, calibration divergence " << lowrank->calibration_divergence()
            << ", shadow divergence mean: calibrated " << cal_mean << ", budget:4 " << crude_mean << "\n";
  // Every mirror of the calibrated form within EPS; the crude form's are not.
  EXPECT_EQ(server.Sample(Bucket("cal", "0.1")), kRequests)
      << "mean " << server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"cal\"}") / kRequests;
  EXPECT_LT(server.Sample(Bucket("crude", "0.1")), kRequests)
      << "mean " << server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"crude\"}") / kRequests;
}

}  // namespace
}  // namespace attnserve
