#include "server/core/calibrated_rank.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "server/core/rope.h"
#include "server/core/spectrum_internal.h"

namespace attnserve {
namespace {

using namespace spectrum_internal;  // NOLINT: the core's shared spectrum helpers

// A relative ridge on XᵀX: the whitening never divides by a direction the calibration rows
// barely visit by more than ~1e3 (sqrt(1/1e-6)), so inputs off the calibration subspace are
// not amplified. It affects which directions are kept, never the divergence measured.
constexpr double kRidge = 1e-6;
// The target shrinks by this factor until the layer's divergence is within EPS.
constexpr double kTargetStep = 0.7;
constexpr int kMaxSteps = 80;  // 0.7^80 ≈ 4e-13: every rank is full long before

// One head in the whitened basis: W_M_i = u · diag(s) · rightᵀ, and its calibration outputs
// Z_i W_M_i = t · diag(s) · rightᵀ with t = Z_i u (right has orthonormal columns, so column j
// carries energy s_j² ‖t_j‖² and the tail after r is the head's error at rank r).
struct WhitenedHead {
  Eigen::VectorXd s;
  MatrixD u, right, t;
  std::vector<double> tail;  // tail[r] = Σ_{j ≥ r} s_j² ‖t_j‖², tail[k] = 0
};

MatrixD Projected(const MatrixD& x, const std::vector<float>& w, int64_t cols, const std::vector<float>& bias) {
  MatrixD out = x * Eigen::Map<const RowMatrixF>(w.data(), x.cols(), cols).cast<double>();
  if (!bias.empty()) out.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(bias.data(), cols).cast<double>();
  return out;
}

// Fills every head's t with Z_i u_i over the calibration sequences.
void MixCalibrationRows(const LayerWeights& w, const MatrixD& x, std::vector<WhitenedHead>& heads) {
  const LayerConfig& c = w.config;
  const int64_t dh = c.d_head;
  const MatrixD q = Projected(x, w.w_q, c.heads * dh, w.b_q);
  const MatrixD k = Projected(x, w.w_k, c.kv_heads * dh, w.b_k);
  const double scale = c.SoftmaxScale();
  for (int64_t start = 0; start < x.rows(); start += kCalibrationSequence) {
    const int64_t n = std::min(kCalibrationSequence, x.rows() - start);
    MatrixD qs = q.middleRows(start, n), ks = k.middleRows(start, n);
    if (c.rope_theta > 0) {
      ApplyRopeFloat64([&](int64_t r, int64_t col) -> double& { return qs(r, col); }, n, c.heads, dh, c.rope_theta, 0);
      ApplyRopeFloat64([&](int64_t r, int64_t col) -> double& { return ks(r, col); }, n, c.kv_heads, dh, c.rope_theta,
                       0);
    }
    for (int64_t i = 0; i < c.heads; ++i) {
      MatrixD a = scale * qs.middleCols(i * dh, dh) * ks.middleCols(c.KvHeadOf(i) * dh, dh).transpose();
      for (int64_t r = 0; r < n; ++r) {
        a.row(r).array() = (a.row(r).array() - a.row(r).maxCoeff()).exp();
        a.row(r) /= a.row(r).sum();
      }
      heads[i].t.middleRows(start, n) = (a * x.middleRows(start, n)) * heads[i].u;
    }
  }
}

// The fewest directions whose tail is at most target² of the head's output energy.
int64_t RankFor(const WhitenedHead& h, double target) {
  const double total = h.tail[0];
  const int64_t k = static_cast<int64_t>(h.tail.size()) - 1;
  for (int64_t r = 0; r < k; ++r) {
    if (h.tail[r] <= target * target * total) return r;
  }
  return k;
}

// ‖Σ_i Z_i (W_M_i − W̃_i)‖_F for the ranks: each head's dropped directions, summed.
double LayerError(const std::vector<WhitenedHead>& heads, const std::vector<int64_t>& ranks, int64_t rows, int64_t d) {
  MatrixD e = MatrixD::Zero(rows, d);
  for (size_t i = 0; i < heads.size(); ++i) {
    const WhitenedHead& h = heads[i];
    const int64_t drop = h.s.size() - ranks[i];
    if (drop > 0) e += h.t.rightCols(drop) * h.s.tail(drop).asDiagonal() * h.right.rightCols(drop).transpose();
  }
  return e.norm();
}

}  // namespace

Status ValidateCalibration(const CalibrationSet& set, const LayerConfig& config, const std::string& field) {
  if (set.d_model != config.d_model) {
    return InvalidArgumentError(field + ": expected rows of d_model = " + std::to_string(config.d_model) +
                                " values (shape [rows, " + std::to_string(config.d_model) + "]), got " +
                                std::to_string(set.d_model));
  }
  if (set.rows < config.d_model || set.rows > kMaxCalibrationRows) {
    return InvalidArgumentError(field + ": expected between d_model = " + std::to_string(config.d_model) + " and " +
                                std::to_string(kMaxCalibrationRows) +
                                " rows (fewer leave the inputs' second moment singular), got " +
                                std::to_string(set.rows));
  }
  if (static_cast<int64_t>(set.x.size()) != set.rows * set.d_model) {
    return InvalidArgumentError(field + ": expected " + std::to_string(set.rows * set.d_model) + " values, got " +
                                std::to_string(set.x.size()));
  }
  for (size_t j = 0; j < set.x.size(); ++j) {
    if (!std::isfinite(set.x[j])) {
      return InvalidArgumentError(field + ": expected finite values, got " + std::to_string(set.x[j]) + " at row " +
                                  std::to_string(j / set.d_model) + ", column " + std::to_string(j % set.d_model));
    }
  }
  return OkStatus();
}

StatusOr<CalibratedLowRank> MaterializeCalibratedLowRank(const LayerWeights& w, const CalibrationSet& set, double eps) {
  if (!(eps > 0 && eps < 1)) {
    return InvalidArgumentError("divergence: expected a relative L2 in (0, 1), got " + std::to_string(eps));
  }
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, rows = set.rows;
  const MatrixD x = Eigen::Map<const RowMatrixF>(set.x.data(), rows, d).cast<double>();
  MatrixD g = MatrixD::Zero(d, d);
  g.selfadjointView<Eigen::Lower>().rankUpdate(x.transpose());
  g = g.selfadjointView<Eigen::Lower>();
  const double mean_eigenvalue = g.trace() / static_cast<double>(d);
  if (!(mean_eigenvalue > 0)) return InvalidArgumentError("calibration: the inputs are all zero");
  g.diagonal().array() += kRidge * mean_eigenvalue;
  const Eigen::LLT<MatrixD> llt(g);
  if (llt.info() != Eigen::Success)
    return InvalidArgumentError("calibration: the inputs' second moment is not positive definite");
  const MatrixD s_factor = llt.matrixU();  // Sᵀ S = XᵀX + ridge

  std::vector<WhitenedHead> heads(c.heads);
  for (int64_t i = 0; i < c.heads; ++i) {
    auto [a, b] = OvFactors(w, i);
    Factorization fac = FactorProduct(s_factor * a, b);
    heads[i].s = fac.s;
    heads[i].u = llt.matrixU().solve(fac.left);
    heads[i].right = std::move(fac.right);
    heads[i].t = MatrixD::Zero(rows, fac.s.size());
  }
  MixCalibrationRows(w, x, heads);

  // The factored output on the calibration rows: b_eff + Σ_i Z_i W_M_i.
  MatrixD y = MatrixD::Zero(rows, d);
  const std::vector<float> b_eff = FoldedOutputBias(w);
  if (!b_eff.empty()) y.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(b_eff.data(), d).cast<double>();
  double total_energy = 0;
  for (WhitenedHead& h : heads) {
    y += h.t * h.s.asDiagonal() * h.right.transpose();
    const int64_t k = h.s.size();
    h.tail.assign(k + 1, 0.0);
    for (int64_t j = k - 1; j >= 0; --j) h.tail[j] = h.tail[j + 1] + h.s[j] * h.s[j] * h.t.col(j).squaredNorm();
    total_energy += h.tail[0];
  }
  const double y_norm = y.norm();

  CalibratedLowRank out;
  out.ranks.assign(c.heads, 0);
  double target = eps;
  for (int step = 0;; ++step) {
    for (int64_t i = 0; i < c.heads; ++i) out.ranks[i] = RankFor(heads[i], target);
    const double error = LayerError(heads, out.ranks, rows, d);
    out.divergence = y_norm > 0 ? error / y_norm : (error > 0 ? INFINITY : 0.0);
    if (out.divergence <= eps) break;
    if (step == kMaxSteps) {
      for (int64_t i = 0; i < c.heads; ++i) out.ranks[i] = heads[i].s.size();
      out.divergence = 0;
      break;
    }
    target *= kTargetStep;
  }

  std::vector<HeadFactors> factors(c.heads);
  double kept = 0;
  for (int64_t i = 0; i < c.heads; ++i) {
    const WhitenedHead& h = heads[i];
    const int64_t r = out.ranks[i];
    const Eigen::VectorXd root = h.s.head(r).cwiseSqrt();
    factors[i].p = h.u.leftCols(r) * root.asDiagonal();
    factors[i].q = root.asDiagonal() * h.right.leftCols(r).transpose();
    const double share = h.tail[0] > 0 ? h.tail[r] / h.tail[0] : 0.0;
    out.head_divergence.push_back(std::sqrt(share));
    out.head_kept_energy.push_back(1 - share);
    kept += h.tail[0] - h.tail[r];
  }
  out.kept_energy = total_energy > 0 ? kept / total_energy : 1.0;
  out.form = AssembleLowRank(w, factors);
  return out;
}

}  // namespace attnserve
