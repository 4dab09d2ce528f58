// The live check of lowrank=divergence:EPS (docs/spectra.md): the real attnserve binary serves a
// low-rank form whose ranks were chosen for EPS on a calibration file, mirrors every request to
// the factored form (--shadow-rate 1), and the shadow divergence histogram of its traffic —
// fresh inputs drawn like the calibration rows — lies under EPS. The same traffic on a crude
// low-rank form (budget:4) lands above EPS: the histogram check can fail. Then
// calibration=live:ROWS: the rows of the first calls build the form a file of the same rows
// builds, off the serving threads, and its traffic's shadow divergence lies under EPS too.
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
  return "attnserve_shadow_divergence_bucket{form=\"factored\",layer=\"" + layer + "\",math=\"fp32\",le=\"" + le + "\"}";
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
    const std::string count = "attnserve_shadow_divergence_count{form=\"factored\",layer=\"" + name + "\",math=\"fp32\"}";
    EXPECT_EQ(server.WaitForSample(count, kRequests, std::chrono::seconds(30)), kRequests) << name;
  }
  const double cal_mean = server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"cal\",math=\"fp32\"}") / kRequests;
  const double crude_mean =
      server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"crude\",math=\"fp32\"}") / kRequests;
  std::cout << "total rank " << total << " of 32, calibration divergence " << lowrank->calibration_divergence()
            << ", shadow divergence mean: calibrated " << cal_mean << ", budget:4 " << crude_mean << "\n";
  // Every mirror of the calibrated form within EPS; the crude form's are not.
  EXPECT_EQ(server.Sample(Bucket("cal", "0.1")), kRequests)
      << "mean " << server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"cal\",math=\"fp32\"}") / kRequests;
  EXPECT_LT(server.Sample(Bucket("crude", "0.1")), kRequests)
      << "mean " << server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"crude\",math=\"fp32\"}") / kRequests;
}

const v1::FormInfo* FormOf(const v1::LayerInfo& info, v1::Form form) {
  for (const v1::FormInfo& f : info.forms()) {
    if (f.form() == form) return &f;
  }
  return nullptr;
}

TEST(LowRankShadowTest, ALiveCalibrationBuildsTheFileFormFromTheFirstCallsAndStaysUnderEps) {
  testing::TempDir files;
  constexpr uint64_t kMix = 13;
  constexpr int64_t kRows = 512, kCall = 128;
  const std::vector<float> rows = Rows(kRows, kMix, 1);
  ASSERT_TRUE(WriteNpy(files.File("calib.npy"), NpyArray{{kRows, kDModel}, rows}).ok());
  const std::string layer = "random:d_model=32,heads=4,seed=5,summed=false,lowrank=divergence:0.1,calibration=";
  testing::MetricsServer server(ATTNSERVE_BINARY, {"--layer", "file=" + layer + files.File("calib.npy"), "--layer",
                                                   "live=" + layer + "live:512", "--shadow-rate", "1"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();

  v1::LayerInfo info;
  ASSERT_TRUE(client.GetLayer("live", &info).ok());
  EXPECT_EQ(FormOf(info, v1::FORM_LOWRANK), nullptr);
  ASSERT_TRUE(info.has_live_calibration());
  EXPECT_EQ(info.live_calibration().rows_wanted(), kRows);
  EXPECT_EQ(info.live_calibration().rows_seen(), 0);
  EXPECT_EQ(info.live_calibration().rank_selection(), "divergence:0.1");
  v1::ForwardRequest req;
  req.set_layer("live");
  req.set_form(v1::FORM_LOWRANK);
  *req.mutable_input() = MakeTensor(std::vector<float>(rows.begin(), rows.begin() + kCall * kDModel), {1, kCall, kDModel});
  v1::ForwardResponse resp;
  const grpc::Status early = client.Forward(req, &resp);
  EXPECT_EQ(early.error_code(), grpc::UNAVAILABLE) << early.error_message();
  EXPECT_THAT(early.error_message(), ::testing::HasSubstr("0 of 512 rows so far"));

  // The calibration rows, as four served calls of the factored form, one after another.
  for (int64_t first = 0; first < kRows; first += kCall) {
    req.set_form(v1::FORM_FACTORED);
    *req.mutable_input() = MakeTensor(
        std::vector<float>(rows.begin() + first * kDModel, rows.begin() + (first + kCall) * kDModel), {1, kCall, kDModel});
    ASSERT_TRUE(client.Forward(req, &resp).ok());
  }
  const v1::FormInfo* lowrank = nullptr;
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
       lowrank == nullptr && std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(20))) {
    ASSERT_TRUE(client.GetLayer("live", &info).ok());
    lowrank = FormOf(info, v1::FORM_LOWRANK);
  }
  ASSERT_NE(lowrank, nullptr) << "the low-rank form was not built within 30 s";
  EXPECT_FALSE(info.has_live_calibration());
  v1::LayerInfo file_info;
  ASSERT_TRUE(client.GetLayer("file", &file_info).ok());
  const v1::FormInfo* from_file = FormOf(file_info, v1::FORM_LOWRANK);
  ASSERT_NE(from_file, nullptr);
  EXPECT_THAT(lowrank->ranks(), ::testing::ElementsAreArray(from_file->ranks()));
  EXPECT_THAT(lowrank->head_divergence(), ::testing::ElementsAreArray(from_file->head_divergence()));
  EXPECT_EQ(lowrank->calibration_divergence(), from_file->calibration_divergence());
  EXPECT_EQ(lowrank->calibration_rows(), kRows);
  int64_t total = 0;
  for (int64_t r : lowrank->ranks()) total += r;
  EXPECT_LT(total, 4 * 8) << "the form must actually drop directions for the check to mean anything";

  // Its traffic: fresh rows from the same distribution, every call mirrored to the factored form.
  constexpr int kRequests = 8;
  for (int i = 0; i < kRequests; ++i) {
    req.set_form(v1::FORM_LOWRANK);
    *req.mutable_input() = MakeTensor(Rows(kCall, kMix, 200 + i), {1, kCall, kDModel});
    ASSERT_TRUE(client.Forward(req, &resp).ok());
  }
  const std::string count = "attnserve_shadow_divergence_count{form=\"factored\",layer=\"live\",math=\"fp32\"}";
  ASSERT_EQ(server.WaitForSample(count, kRequests, std::chrono::seconds(30)), kRequests);
  EXPECT_EQ(server.Sample(Bucket("live", "0.1")), kRequests)
      << "mean " << server.Sample("attnserve_shadow_divergence_sum{form=\"factored\",layer=\"live\",math=\"fp32\"}") / kRequests;
}

}  // namespace
}  // namespace attnserve
