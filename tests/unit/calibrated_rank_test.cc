// lowrank=divergence:EPS (server/core/calibrated_rank.h) against independent float64 oracles:
// the reference forward (server/core/reference.h) over the calibration sequences for the
// layer's and each head's divergence, a full SVD of the whitened d×d product for the optimal
// activation-aware error, and the weight-only truncation it must beat; then the calibration
// file's and the source options' refusals, and the store's load.
// Then calibration=live:ROWS: the rows served calls give, and the form built from them against the
// form a .npy of the same rows builds.
#include "server/core/calibrated_rank.h"
#include "server/core/live_calibration.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "server/store/calibration_file.h"
#include "server/store/layer_store.h"
#include "server/store/source.h"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using MatrixD = Eigen::MatrixXd;

// W_V_g(i) W_O_i by explicit sums, in float64.
MatrixD DirectOv(const LayerWeights& w, int64_t i) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, dh = c.d_head, kvc = c.kv_heads * dh, g = c.KvHeadOf(i);
  MatrixD m = MatrixD::Zero(d, d);
  for (int64_t r = 0; r < d; ++r)
    for (int64_t col = 0; col < d; ++col)
      for (int64_t t = 0; t < dh; ++t) m(r, col) += double{w.w_v[r * kvc + g * dh + t]} * w.w_o[(i * dh + t) * d + col];
  return m;
}

// Head i's P_i Q_i as the low-rank form holds it (its float32 weights), in float64.
MatrixD HeldOv(const FormWeights& f, int64_t i) {
  const int64_t d = f.config.d_model, r = f.value_width[i], col0 = f.q_cols + f.k_cols + f.value_offset[i];
  MatrixD p(d, r), q(r, d);
  for (int64_t a = 0; a < d; ++a)
    for (int64_t t = 0; t < r; ++t) p(a, t) = f.w_in[a * f.in_cols() + col0 + t];
  for (int64_t t = 0; t < r; ++t)
    for (int64_t b = 0; b < d; ++b) q(t, b) = f.w_out[(f.mix_offset[i] + t) * d + b];
  return p * q;
}

std::vector<double> Flat(const MatrixD& m) {
  std::vector<double> out(m.size());
  for (int64_t a = 0; a < m.rows(); ++a)
    for (int64_t b = 0; b < m.cols(); ++b) out[a * m.cols() + b] = m(a, b);
  return out;
}

// Rows drawn from an anisotropic Gaussian: N(0, I) · diag(0.85^j) · a random rotation, so that
// the calibration inputs' second moment is far from the identity and whitening matters.
std::vector<float> AnisotropicRows(int64_t rows, int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  MatrixD g(d, d);
  for (int64_t a = 0; a < d; ++a)
    for (int64_t b = 0; b < d; ++b) g(a, b) = normal(rng);
  const MatrixD rotation = Eigen::HouseholderQR<MatrixD>(g).householderQ();
  std::mt19937_64 draw(seed + 1);
  std::vector<float> x(rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    Eigen::RowVectorXd z(d);
    for (int64_t j = 0; j < d; ++j) z[j] = normal(draw) * std::pow(0.85, j);
    const Eigen::RowVectorXd row = z * rotation;
    for (int64_t j = 0; j < d; ++j) x[r * d + j] = static_cast<float>(row[j]);
  }
  return x;
}

// The calibration sequences as the selection cuts them: kCalibrationSequence rows each.
std::vector<Sequence> CalibrationSequences(const CalibrationSet& set, std::vector<std::vector<float>>& outputs) {
  std::vector<Sequence> seqs;
  for (int64_t start = 0; start < set.rows; start += kCalibrationSequence) {
    const int64_t n = std::min(kCalibrationSequence, set.rows - start);
    outputs.emplace_back(n * set.d_model);
    Sequence s;
    s.input = ConstMatrixView{set.x.data() + start * set.d_model, n, set.d_model};
    s.output = MatrixView{outputs.back().data(), n, set.d_model};
    seqs.push_back(s);
  }
  return seqs;
}

// ‖Σ_seq (want − got)‖ / ‖want‖ over the calibration sequences, each output from the reference
// forward with the given head matrices (empty: the layer's own W_V, W_O).
struct Divergences {
  double layer = 0;
  std::vector<double> head;
};

Divergences OracleDivergences(const LayerWeights& w, const FormWeights& f, const CalibrationSet& set) {
  const LayerConfig& c = w.config;
  std::vector<std::vector<float>> outputs;
  const std::vector<Sequence> seqs = CalibrationSequences(set, outputs);
  std::vector<std::vector<double>> exact(c.heads), held(c.heads);
  for (int64_t i = 0; i < c.heads; ++i) {
    exact[i] = Flat(DirectOv(w, i));
    held[i] = Flat(HeldOv(f, i));
  }
  std::vector<double> b_eff(f.b_out.begin(), f.b_out.end());
  Divergences out;
  double err = 0, norm = 0;
  std::vector<double> head_err(c.heads, 0), head_norm(c.heads, 0);
  for (const Sequence& s : seqs) {
    const std::vector<double> want = ReferenceForward(w, s);
    const std::vector<double> got = ReferenceForwardWithHeadMatrices(w, held, b_eff, s);
    for (size_t j = 0; j < want.size(); ++j) {
      err += (want[j] - got[j]) * (want[j] - got[j]);
      norm += want[j] * want[j];
    }
    for (int64_t i = 0; i < c.heads; ++i) {
      std::vector<std::vector<double>> only_exact(c.heads, std::vector<double>(exact[i].size(), 0.0));
      std::vector<std::vector<double>> only_held = only_exact;
      only_exact[i] = exact[i];
      only_held[i] = held[i];
      const std::vector<double> a = ReferenceForwardWithHeadMatrices(w, only_exact, {}, s);
      const std::vector<double> b = ReferenceForwardWithHeadMatrices(w, only_held, {}, s);
      for (size_t j = 0; j < a.size(); ++j) {
        head_err[i] += (a[j] - b[j]) * (a[j] - b[j]);
        head_norm[i] += a[j] * a[j];
      }
    }
  }
  out.layer = std::sqrt(err / norm);
  for (int64_t i = 0; i < c.heads; ++i) out.head.push_back(std::sqrt(head_err[i] / head_norm[i]));
  return out;
}

struct Case {
  LayerConfig config;
  LayerWeights weights;
  CalibrationSet set;
};

Case MakeCase(double rope_theta, uint64_t seed) {
  Case k;
  k.config = *CompleteConfig({.d_model = 48, .heads = 4, .kv_heads = 2, .d_head = 16, .rope_theta = rope_theta});
  k.weights = RandomLayerWeights(k.config, seed);
  k.set.rows = 300;  // three sequences, the last one short
  k.set.d_model = 48;
  k.set.x = AnisotropicRows(k.set.rows, 48, seed + 10);
  return k;
}

TEST(CalibratedRankTest, DivergenceOnCalibrationMatchesAFloat64ForwardAndStaysUnderEps) {
  for (const double theta : {0.0, 10000.0}) {
    const Case k = MakeCase(theta, testing::TestSeed() + 3);
    int64_t previous_total = 0;
    for (const double eps : {0.3, 0.1, 0.03}) {
      SCOPED_TRACE("rope_theta " + std::to_string(theta) + ", eps " + std::to_string(eps));
      auto built = MaterializeCalibratedLowRank(k.weights, k.set, eps);
      ASSERT_TRUE(built.ok()) << built.status().ToString();
      const int64_t total = std::accumulate(built->ranks.begin(), built->ranks.end(), int64_t{0});
      EXPECT_LT(total, 4 * 16) << "an EPS this large keeps fewer than every direction";
      EXPECT_GE(total, previous_total) << "a smaller EPS never keeps fewer directions";
      previous_total = total;
      EXPECT_EQ(built->form.value_width, built->ranks);
      const Divergences oracle = OracleDivergences(k.weights, built->form, k.set);
      EXPECT_LE(oracle.layer, eps);
      EXPECT_NEAR(built->divergence, oracle.layer, 1e-5 + 1e-4 * oracle.layer);
      ASSERT_EQ(built->head_divergence.size(), 4u);
      for (int64_t i = 0; i < 4; ++i) {
        EXPECT_NEAR(built->head_divergence[i], oracle.head[i], 1e-5 + 1e-4 * oracle.head[i]) << "head " << i;
        EXPECT_NEAR(built->head_kept_energy[i], 1 - oracle.head[i] * oracle.head[i], 1e-4) << "head " << i;
      }
    }
  }
}

TEST(CalibratedRankTest, ActivationAwareTruncationIsOptimalOnTheCalibrationRowsAndBeatsWeightOnly) {
  const Case k = MakeCase(0.0, testing::TestSeed() + 4);
  auto built = MaterializeCalibratedLowRank(k.weights, k.set, 0.1);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  const int64_t d = 48;
  MatrixD x(k.set.rows, d);
  for (int64_t r = 0; r < k.set.rows; ++r)
    for (int64_t j = 0; j < d; ++j) x(r, j) = k.set.x[r * d + j];
  // ‖X W‖_F = ‖R W‖_F with X = Q R: the best rank-r error is the tail of R W_M_i's spectrum.
  const MatrixD rx = Eigen::HouseholderQR<MatrixD>(x).matrixQR().topRows(d).triangularView<Eigen::Upper>();
  auto weight_only = MaterializeLowRank(k.weights, built->ranks);
  ASSERT_TRUE(weight_only.ok());
  int strictly_better = 0;
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t r = built->ranks[i];
    const MatrixD w_m = DirectOv(k.weights, i);
    const Eigen::VectorXd sigma = Eigen::JacobiSVD<MatrixD>(rx * w_m).singularValues();
    const double optimal = std::sqrt(sigma.tail(d - r).squaredNorm());
    const double aware = (x * (w_m - HeldOv(built->form, i))).norm();
    const double weight = (x * (w_m - HeldOv(*weight_only, i))).norm();
    EXPECT_LE(aware, optimal * 1.001 + 1e-5 * (x * w_m).norm()) << "head " << i << " rank " << r;
    EXPECT_LE(aware, weight * (1 + 1e-6)) << "head " << i << " rank " << r;
    if (aware < 0.9 * weight) ++strictly_better;
  }
  EXPECT_GE(strictly_better, 3) << "on anisotropic inputs whitening should cut the error markedly";
  // And so, at the same ranks, the weight-only form's layer divergence is larger.
  EXPECT_GT(OracleDivergences(k.weights, *weight_only, k.set).layer, built->divergence);
}

// Two heads that attend alike (one key/value head, the same W_Q) and whose outputs nearly cancel:
// W_O_2 = −W_O_1 V Vᵀ with V the top 14 right singular vectors of W_M_1, so the layer's output is
// head 1's last two directions alone. Each head within EPS of its own output is far more than
// EPS of that small sum: the target must shrink until the layer's divergence is within EPS.
TEST(CalibratedRankTest, HeadsThatCancelStillKeepTheLayerUnderEps) {
  // Three draws: in a few % of them head 1 at EPS already keeps what the sum is made of (the
  // activation-aware directions are not W_M_1's own), and nothing needs to shrink; three such
  // draws in a row would leave a search that never shrinks unseen (1 in 50 000).
  for (const uint64_t draw : {0u, 100u, 200u}) {
    SCOPED_TRACE("draw " + std::to_string(draw));
    const LayerConfig c = *CompleteConfig({.d_model = 48, .heads = 2, .kv_heads = 1, .d_head = 16, .bias = false});
    LayerWeights w = RandomLayerWeights(c, testing::TestSeed() + 8 + draw);
    for (int64_t r = 0; r < 48; ++r)
      for (int64_t t = 0; t < 16; ++t) w.w_q[r * 32 + 16 + t] = w.w_q[r * 32 + t];
    const MatrixD v = Eigen::JacobiSVD<MatrixD>(DirectOv(w, 0), Eigen::ComputeThinV).matrixV().leftCols(14);
    MatrixD w_o1(16, 48);
    for (int64_t t = 0; t < 16; ++t)
      for (int64_t col = 0; col < 48; ++col) w_o1(t, col) = w.w_o[t * 48 + col];
    const MatrixD w_o2 = -w_o1 * v * v.transpose();
    for (int64_t t = 0; t < 16; ++t)
      for (int64_t col = 0; col < 48; ++col) w.w_o[(16 + t) * 48 + col] = static_cast<float>(w_o2(t, col));
    CalibrationSet set{.rows = 256, .d_model = 48, .x = AnisotropicRows(256, 48, testing::TestSeed() + 10 + draw)};
    constexpr double kEps = 0.1;
    auto built = MaterializeCalibratedLowRank(w, set, kEps);
    ASSERT_TRUE(built.ok()) << built.status().ToString();
    const Divergences oracle = OracleDivergences(w, built->form, set);
    EXPECT_LE(oracle.layer, kEps);
    EXPECT_NEAR(built->divergence, oracle.layer, 1e-5 + 1e-4 * oracle.layer);
  }
}

TEST(CalibratedRankTest, ATinyEpsKeepsEveryDirectionExactly) {
  const Case k = MakeCase(0.0, testing::TestSeed() + 5);
  auto built = MaterializeCalibratedLowRank(k.weights, k.set, 1e-9);
  ASSERT_TRUE(built.ok());
  EXPECT_EQ(built->ranks, std::vector<int64_t>(4, 16));
  EXPECT_LT(OracleDivergences(k.weights, built->form, k.set).layer, 1e-5);
}

TEST(CalibratedRankTest, RefusalsNameTheFieldExpectedAndGot) {
  const Case k = MakeCase(0.0, testing::TestSeed() + 6);
  EXPECT_THAT(MaterializeCalibratedLowRank(k.weights, k.set, 1.0).status().message(),
              HasSubstr("divergence: expected a relative L2 in (0, 1), got 1"));
  CalibrationSet narrow = k.set;
  narrow.d_model = 40;
  EXPECT_THAT(ValidateCalibration(narrow, k.config, "calibration 'c.npy'").message(),
              HasSubstr("calibration 'c.npy': expected rows of d_model = 48 values (shape [rows, 48]), got 40"));
  CalibrationSet few = k.set;
  few.rows = 47;
  few.x.resize(47 * 48);
  EXPECT_THAT(
      ValidateCalibration(few, k.config, "calibration").message(),
      HasSubstr(
          "expected between d_model = 48 and 65536 rows (fewer leave the inputs' second moment singular), got 47"));
  CalibrationSet nan = k.set;
  nan.x[5 * 48 + 7] = NAN;
  EXPECT_THAT(ValidateCalibration(nan, k.config, "calibration").message(),
              HasSubstr("expected finite values, got nan at row 5, column 7"));
  EXPECT_TRUE(ValidateCalibration(k.set, k.config, "calibration").ok());
}

// A .npy image: version 1.0, the given descr and shape text, the values' bytes as they lie.
template <typename T>
std::string Npy(const std::string& descr, const std::string& shape, const std::vector<T>& data) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(T));
  return out;
}

void Write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(CalibratedRankTest, CalibrationFilesAreCheckedBeforeUse) {
  const std::vector<float> six(6, 0.5f);
  auto ok = ParseCalibrationNpy(Npy("<f4", "(2, 3)", six), "c");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->rows, 2);
  EXPECT_EQ(ok->d_model, 3);
  EXPECT_EQ(ok->x, six);
  // An empty array parses (UBSan once caught a memcpy to its null data); its rows are refused
  // against the layer.
  auto empty = ParseCalibrationNpy(Npy("<f4", "(0, 3)", std::vector<float>{}), "c");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(empty->rows, 0);
  EXPECT_TRUE(empty->x.empty());
  // numpy's default dtype, float64, is converted as it is read (format/npy.h).
  const std::vector<double> wide = {0.25, -1.5, 3.0e38, 1.0e39, 1.0 / 3.0, -0.0};
  auto converted = ParseCalibrationNpy(Npy("<f8", "(3, 2)", wide), "c");
  ASSERT_TRUE(converted.ok()) << converted.status().ToString();
  EXPECT_EQ(converted->rows, 3);
  EXPECT_EQ(converted->d_model, 2);
  ASSERT_EQ(converted->x.size(), wide.size());
  for (size_t i = 0; i < wide.size(); ++i) EXPECT_EQ(converted->x[i], static_cast<float>(wide[i])) << i;
  EXPECT_TRUE(std::isinf(converted->x[3]));  // beyond float32's range
  const std::pair<std::string, std::string> bad[] = {
      {Npy("<i4", "(2, 3)", std::vector<int32_t>(6, 1)),
       "c: dtype: expected '<f4' (float32) or '<f8' (float64, converted), got '<i4'"},
      {Npy("<f4", "(6,)", six), "c: expected shape [rows, d_model] (2 dimensions), got (6,)"},
      {Npy("<f4", "(1, 2, 3)", six), "c: expected shape [rows, d_model] (2 dimensions), got (1, 2, 3)"},
      {Npy("<f4", "(2, 4)", six), "c: size: expected 160 bytes (header 128 + shape (2, 4) x 4), got 152 (truncated)"},
      {Npy("<f4", "(65537, 0)", std::vector<float>{}),
       "c: expected at most 65536 rows of at most 65536 values, got shape (65537, 0)"},
      {"PK\x03\x04 not numpy", "c: not a .npy file: expected magic '\\x93NUMPY', got 'PK\\x03\\x04 n'"},
  };
  for (const auto& [bytes, want] : bad)
    EXPECT_THAT(ParseCalibrationNpy(bytes, "c").status().message(), HasSubstr(want));
}

TEST(CalibratedRankTest, SourceOptionsGoTogether) {
  EXPECT_THAT(ParseSource("random:d_model=48,heads=4,lowrank=divergence:0.05").status().message(),
              HasSubstr("needs calibration inputs: add calibration=PATH"));
  EXPECT_THAT(ParseSource("random:d_model=48,heads=4,lowrank=energy:0.9,calibration=c.npy").status().message(),
              HasSubstr("option 'calibration' is read only by lowrank=divergence:EPS"));
  EXPECT_THAT(
      ParseSource("random:d_model=48,heads=4,lowrank=divergence:1.5,calibration=c.npy").status().message(),
      HasSubstr("divergence:EPS (the output's relative L2 on calibration= inputs, 0 < EPS < 1), got 'divergence:1.5'"));
  auto spec = ParseSource("random:d_model=48,heads=4,lowrank=divergence:0.05,calibration=c.npy");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->lowrank->text, "divergence:0.05");
  EXPECT_EQ(spec->calibration, "c.npy");
}

TEST(CalibratedRankTest, TheStoreHoldsTheFormAndWhatItMeasured) {
  testing::TempDir dir;
  const std::vector<float> x = AnisotropicRows(256, 32, testing::TestSeed() + 7);
  Write(dir.File("calib.npy"), Npy("<f4", "(256, 32)", x));
  Write(dir.File("narrow.npy"), Npy("<f4", "(8, 4)", std::vector<float>(32, 1.0f)));
  CpuBackend backend;
  LayerStore store(&backend);
  const std::string base = "random:d_model=32,heads=4,seed=9,summed=false,lowrank=divergence:0.1,calibration=";
  auto layer = store.Load("cal", base + dir.File("calib.npy"));
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  const Layer& l = **layer;
  EXPECT_EQ(l.lowrank_selection, "divergence:0.1");
  EXPECT_EQ(l.lowrank_calibration_rows, 256);
  EXPECT_GT(l.lowrank_calibration_divergence, 0);
  EXPECT_LE(l.lowrank_calibration_divergence, 0.1);
  EXPECT_EQ(l.lowrank_head_divergence.size(), 4u);
  EXPECT_EQ(l.lowrank_head_kept_energy.size(), 4u);
  EXPECT_EQ(l.lowrank_ranks.size(), 4u);
  ASSERT_NE(l.Find(Form::kLowRank), nullptr);
  EXPECT_THAT(l.source, HasSubstr("calibration=calib.npy")) << "no server path leaves the server";
  EXPECT_THAT(l.source, ::testing::Not(HasSubstr(dir.path())));
  // The served form's divergence on the calibration rows, through the CPU backend in float32.
  const LayerWeights w = RandomLayerWeights(l.config, 9);
  double err = 0, norm = 0;
  for (int64_t start = 0; start < 256; start += kCalibrationSequence) {
    std::vector<float> out(kCalibrationSequence * 32);
    Sequence s;
    s.input = ConstMatrixView{x.data() + start * 32, kCalibrationSequence, 32};
    s.output = MatrixView{out.data(), kCalibrationSequence, 32};
    const std::vector<double> want = ReferenceForward(w, s);
    const Sequence batch[] = {s};
    ASSERT_TRUE(backend.Forward(*l.Find(Form::kLowRank), batch).ok());
    for (size_t j = 0; j < want.size(); ++j) {
      err += (want[j] - out[j]) * (want[j] - out[j]);
      norm += want[j] * want[j];
    }
  }
  EXPECT_NEAR(std::sqrt(err / norm), l.lowrank_calibration_divergence, 1e-4);
  // energy: selections report each head's kept share too, and no calibration.
  auto energy = store.Load("e", "random:d_model=32,heads=4,seed=9,lowrank=energy:0.9");
  ASSERT_TRUE(energy.ok());
  EXPECT_EQ((*energy)->lowrank_head_kept_energy.size(), 4u);
  for (double kept : (*energy)->lowrank_head_kept_energy) EXPECT_GE(kept, 0.9 - 1e-12);
  EXPECT_EQ((*energy)->lowrank_calibration_rows, 0);
  // A file of the wrong width is refused, naming the option and the file.
  EXPECT_THAT(store.Load("bad", base + dir.File("narrow.npy")).status().message(),
              HasSubstr("narrow.npy': expected rows of d_model = 32 values (shape [rows, 32]), got 4"));
}

// Over the API the calibration file is confined like a checkpoint: beneath a model dir, shown
// relative to it, and anything else refused with the one answer that says nothing of outside.
TEST(CalibratedRankTest, OverTheApiTheCalibrationFileLiesBeneathAModelDir) {
  testing::TempDir models, outside;
  const std::vector<float> x = AnisotropicRows(64, 16, testing::TestSeed() + 11);
  std::filesystem::create_directories(models.File("cal"));
  Write(models.File("cal/rows.npy"), Npy("<f4", "(64, 16)", x));
  Write(outside.File("rows.npy"), Npy("<f4", "(64, 16)", x));
  CpuBackend backend;
  const std::string base = "random:d_model=16,heads=2,lowrank=divergence:0.2,calibration=";
  LayerStore closed(&backend);
  EXPECT_EQ(closed.Load("a", base + "cal/rows.npy", LoadOrigin::kApi).status().code(), StatusCode::kPermissionDenied);
  LayerStore store(&backend, {.model_dirs = {models.path()}});
  auto relative = store.Load("a", base + "cal/rows.npy", LoadOrigin::kApi);
  ASSERT_TRUE(relative.ok()) << relative.status().ToString();
  EXPECT_EQ((*relative)->source, base + "cal/rows.npy");
  auto absolute = store.Load("b", base + models.File("cal/rows.npy"), LoadOrigin::kApi);
  ASSERT_TRUE(absolute.ok()) << absolute.status().ToString();
  EXPECT_EQ((*absolute)->source, base + "cal/rows.npy");
  for (const std::string& path :
       {outside.File("rows.npy"), std::string("../") + "rows.npy", std::string("cal/none.npy")}) {
    const Status st = store.Load("c", base + path, LoadOrigin::kApi).status();
    EXPECT_FALSE(st.ok()) << path;
    EXPECT_THAT(st.message(), HasSubstr("calibration")) << path;
  }
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// Rows [first, first + count) of `x` (d columns) as a self-attention sequence's input.
Sequence RowsAsSequence(const std::vector<float>& x, int64_t d, int64_t first, int64_t count) {
  Sequence s;
  s.input = ConstMatrixView{x.data() + first * d, count, d};
  return s;
}

TEST(LiveCalibrationTest, GathersEachCallsKeyRowsInOrderUpToTheCount) {
  constexpr int64_t d = 4;
  const std::vector<float> x = AnisotropicRows(32, d, testing::TestSeed() + 21);
  LiveCalibration live(10, d, 0.1);
  EXPECT_TRUE(live.wants_offers());
  // Self-attention with a key length: only the visible keys are the layer's inputs.
  Sequence padded = RowsAsSequence(x, d, 0, 4);
  padded.key_length = 3;
  // Cross-attention: the context's rows (the values' source), not the queries.
  Sequence cross = RowsAsSequence(x, d, 20, 2);
  cross.context = ConstMatrixView{x.data() + 4 * d, 5, d};
  const Sequence first[] = {padded, cross};
  EXPECT_FALSE(live.Offer(first));
  EXPECT_EQ(live.rows_seen(), 8);
  const Sequence more[] = {RowsAsSequence(x, d, 9, 6)};
  EXPECT_TRUE(live.Offer(more)) << "the call that completes the set starts the build";
  EXPECT_FALSE(live.wants_offers());
  EXPECT_FALSE(live.Offer(more)) << "once";
  EXPECT_EQ(live.rows_seen(), 10);
  const CalibrationSet set = live.Rows();
  EXPECT_EQ(set.rows, 10);
  EXPECT_EQ(set.d_model, d);
  std::vector<float> want(x.begin(), x.begin() + 3 * d);             // padded: rows 0..2
  want.insert(want.end(), x.begin() + 4 * d, x.begin() + 9 * d);     // cross's context: rows 4..8
  want.insert(want.end(), x.begin() + 9 * d, x.begin() + 11 * d);    // the first 2 of rows 9..14
  EXPECT_EQ(set.x, want);
  // A build that could not start is claimed again by the next call; the rows stay as they were.
  live.Unclaim();
  EXPECT_TRUE(live.wants_offers());
  EXPECT_TRUE(live.Offer(more));
  EXPECT_EQ(live.Rows().x, want);
  live.Release();
  EXPECT_TRUE(live.Rows().x.empty());
}

TEST(LiveCalibrationTest, TheFactoredFormGivesBackTheLayersWeightsExactly) {
  const LayerConfig c = *CompleteConfig({.d_model = 24, .heads = 6, .kv_heads = 2, .d_head = 4, .bias = true});
  const LayerWeights w = RandomLayerWeights(c, testing::TestSeed() + 3);
  const LayerWeights back = LayerWeightsOfFactored(MaterializeFactored(w));
  EXPECT_EQ(back.w_q, w.w_q);
  EXPECT_EQ(back.w_k, w.w_k);
  EXPECT_EQ(back.w_v, w.w_v);
  EXPECT_EQ(back.w_o, w.w_o);
  EXPECT_EQ(back.b_q, w.b_q);
  EXPECT_EQ(back.b_k, w.b_k);
  EXPECT_EQ(back.b_v, w.b_v);
  EXPECT_EQ(back.b_o, w.b_o);
  EXPECT_TRUE(ValidateWeights(back).ok());
}

// The .npy path is the oracle: the same rows, gathered from calls, give the same form.
TEST(LiveCalibrationTest, RowsFromTrafficBuildTheFormAFileOfTheSameRowsBuilds) {
  testing::TempDir dir;
  constexpr int64_t d = 32, rows = 256;
  const std::vector<float> x = AnisotropicRows(rows, d, testing::TestSeed() + 31);
  Write(dir.File("calib.npy"), Npy("<f4", "(256, 32)", x));
  CpuBackend backend;
  LayerStore store(&backend);
  const std::string base = "random:d_model=32,heads=4,kv_heads=2,seed=9,lowrank=divergence:0.1,calibration=";
  auto file = store.Load("file", base + dir.File("calib.npy"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto live = store.Load("live", base + "live:256");
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  const Layer& gathering = **live;
  EXPECT_EQ(gathering.Find(Form::kLowRank), nullptr) << "the exact forms serve while the rows are gathered";
  ASSERT_NE(gathering.live_calibration, nullptr);
  EXPECT_EQ(gathering.lowrank_selection, "divergence:0.1");
  EXPECT_EQ(gathering.live_calibration->Bytes(), rows * d * 4);
  // Calls of uneven lengths; the last one's rows past 256 are not taken.
  bool claimed = false;
  for (int64_t first = 0; first < rows; first += 100) {
    const Sequence call[] = {RowsAsSequence(x, d, first, std::min<int64_t>(100, rows - first))};
    claimed = gathering.live_calibration->Offer(call);
  }
  ASSERT_TRUE(claimed);
  auto built = store.CompleteLiveCalibration(*live);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  const Layer& l = **built;
  const Layer& f = **file;
  EXPECT_EQ(store.Get("live"), *built);
  EXPECT_EQ(l.serial, gathering.serial) << "the same load, one more form";
  EXPECT_EQ(l.live_calibration, nullptr);
  EXPECT_EQ(l.Find(Form::kFactored), gathering.Find(Form::kFactored)) << "the exact forms are shared, not copied";
  ASSERT_NE(l.Find(Form::kLowRank), nullptr);
  EXPECT_EQ(l.lowrank_ranks, f.lowrank_ranks);
  EXPECT_EQ(l.lowrank_head_divergence, f.lowrank_head_divergence);
  EXPECT_EQ(l.lowrank_calibration_divergence, f.lowrank_calibration_divergence);
  EXPECT_EQ(l.lowrank_calibration_rows, 256);
  EXPECT_LE(l.lowrank_calibration_divergence, 0.1);
  EXPECT_EQ(l.Find(Form::kLowRank)->weights().w_in, f.Find(Form::kLowRank)->weights().w_in);
  EXPECT_EQ(l.Find(Form::kLowRank)->weights().w_out, f.Find(Form::kLowRank)->weights().w_out);
  EXPECT_TRUE(gathering.live_calibration->Rows().x.empty()) << "the rows are freed once built";

  // A layer reloaded meanwhile is not overwritten by the old load's build.
  auto stale = store.Load("stale", base + "live:64");
  ASSERT_TRUE(stale.ok());
  for (int64_t first = 0; first < 64; first += 32) {
    const Sequence call[] = {RowsAsSequence(x, d, first, 32)};
    (*stale)->live_calibration->Offer(call);
  }
  auto reloaded = store.Load("stale", base + "live:64");
  ASSERT_TRUE(reloaded.ok());
  const auto refused = store.CompleteLiveCalibration(*stale);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("replaced or unloaded meanwhile"));
  EXPECT_EQ(store.Get("stale"), *reloaded);
  EXPECT_EQ((*stale)->live_calibration->failure().code(), StatusCode::kFailedPrecondition);
}

TEST(LiveCalibrationTest, TheOptionIsCheckedAtLoad) {
  CpuBackend backend;
  LayerStore store(&backend);
  const std::string base = "random:d_model=32,heads=4,lowrank=divergence:0.1,calibration=";
  for (const std::string bad : {"live:0", "live:x", "live:", "live:65537", "live:-5"}) {
    EXPECT_THAT(ParseSource(base + bad).status().message(),
                HasSubstr("option 'calibration': expected PATH (a .npy) or live:ROWS (1 <= ROWS <= 65536, at least "
                          "d_model), got '" + bad + "'"));
  }
  EXPECT_THAT(store.Load("few", base + "live:31").status().message(),
              HasSubstr("option 'calibration=live:31': expected at least d_model = 32 rows, got 31"));
  EXPECT_THAT(ParseSource("random:d_model=32,heads=4,lowrank=energy:0.9,calibration=live:64").status().message(),
              HasSubstr("option 'calibration' is read only by lowrank=divergence:EPS"));
  auto spec = ParseSource(base + "live:64");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->live_calibration_rows, 64);
  EXPECT_TRUE(spec->calibration.empty());
  // Held rows count against --max-layer-mb with the forms.
  LayerStore tight(&backend, {.max_total_bytes = 64 * 1024});
  EXPECT_EQ(tight.Load("big", "random:d_model=32,heads=4,summed=false,lowrank=divergence:0.1,calibration=live:4096")
                .status()
                .code(),
            StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attnserve
