#include "server/core/form_cost.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

namespace attnserve {

CostTerms ForwardCostTerms(const FormWeights& f, std::span<const SequenceShape> batch, const SummedOrder& order) {
  const double d = static_cast<double>(f.config.d_model);
  double mix_width = 0;
  for (int64_t w : f.value_width) mix_width += static_cast<double>(w);
  const double score_width = static_cast<double>(f.config.heads * f.config.d_head);
  CostTerms t;
  if (batch.empty()) return t;
  t.calls = 1;
  t.bytes = static_cast<double>(f.Bytes());
  for (const SequenceShape& s : batch) {
    const double n = static_cast<double>(s.n), m = static_cast<double>(s.m);
    const double keys = static_cast<double>(s.keys < 0 ? s.m : s.keys);
    const double value_rows = SummedMixesFirst(f, s, order) ? n : m;  // as ForwardFlops counts
    t.gemm_flops += 2 * d * (n * static_cast<double>(f.q_cols) + m * static_cast<double>(f.k_cols) +
                             value_rows * static_cast<double>(f.value_cols));
    t.gemm_flops += 2 * n * static_cast<double>(f.out_rows) * d;
    t.attention_flops += 2 * n * keys * (score_width + mix_width);
    // Activations: X and C read, Q, K and the value block written and read, O, Y written.
    const double floats = (n + m) * d + n * static_cast<double>(f.q_cols) + m * static_cast<double>(f.k_cols) +
                          value_rows * static_cast<double>(f.value_cols) + n * static_cast<double>(f.out_rows) + n * d;
    t.bytes += floats * sizeof(float);
  }
  return t;
}

double FormCostCoefficients::Predict(const CostTerms& t) const {
  const auto terms = t.AsArray();
  double seconds = 0;
  for (size_t i = 0; i < terms.size(); ++i) seconds += per_term[i] * terms[i];
  return seconds;
}

double FormCostCoefficients::Predict(const CostTerms& t, std::span<const SequenceShape> batch) const {
  return Predict(t) * ResidualFactor(batch);
}

double FormCostCoefficients::ResidualFactor(std::span<const SequenceShape> batch) const {
  if (residuals.empty() || batch.empty()) return 1;
  double n = 0, m = 0;
  for (const SequenceShape& s : batch) {
    n += static_cast<double>(s.n);
    m += static_cast<double>(s.m);
  }
  const double log_n = std::log2(std::max(n, 1.0)), log_m = std::log2(std::max(m, 1.0));
  // Shepard's inverse-distance weighting (power 2), in the logs: exact at a timed shape. The
  // terms' own prediction (ratio 1) weighs as a residual two octaves away, so a point far from
  // every timed shape keeps the terms' trend instead of the average of distant corrections.
  double weights = kTermsWeight, log_ratio = 0;
  for (const CostResidual& r : residuals) {
    const double dn = log_n - r.log_n, dm = log_m - r.log_m;
    const double d2 = dn * dn + dm * dm;
    if (d2 < 1e-12) return r.ratio;
    weights += 1 / d2;
    log_ratio += std::log(r.ratio) / d2;
  }
  return std::exp(log_ratio / weights);
}

bool IsExactForm(Form form) {
  return std::find(std::begin(kExactForms), std::end(kExactForms), form) != std::end(kExactForms);
}

FormCostModel FlopCountModel() {
  FormCostModel model;
  for (FormCostCoefficients& c : model.by_form) c.per_term = {1e-11, 1e-11, 0, 0};  // 100 GFLOP/s, any rate will do
  return model;
}

StatusOr<FormCostCoefficients> FitFormCost(std::span<const CostSample> samples) {
  constexpr size_t k = CostTerms::kCount;
  if (samples.size() < 2) {
    return InvalidArgumentError("samples: expected at least 2 timed forwards, got " + std::to_string(samples.size()));
  }
  const Eigen::Index rows = static_cast<Eigen::Index>(samples.size());
  Eigen::MatrixXd a(rows, k);
  Eigen::VectorXd b = Eigen::VectorXd::Ones(rows);  // each row divided by its own seconds
  for (Eigen::Index r = 0; r < rows; ++r) {
    const CostSample& s = samples[static_cast<size_t>(r)];
    if (!(s.seconds > 0) || !std::isfinite(s.seconds)) {
      return InvalidArgumentError("samples[" + std::to_string(r) + "].seconds: expected > 0, got " +
                                  std::to_string(s.seconds));
    }
    const auto terms = s.terms.AsArray();
    for (size_t c = 0; c < k; ++c) a(r, static_cast<Eigen::Index>(c)) = terms[c] / s.seconds;
  }
  // Columns scaled to a unit maximum: the terms differ by twelve orders of magnitude.
  Eigen::VectorXd scale(k);
  for (Eigen::Index c = 0; c < static_cast<Eigen::Index>(k); ++c) {
    const double top = a.col(c).cwiseAbs().maxCoeff();
    scale(c) = top > 0 ? top : 1;
    a.col(c) /= scale(c);
  }
  // Non-negative least squares by enumeration: with 4 terms, 15 subsets; the best feasible one
  // is the NNLS optimum (a term left out has coefficient 0).
  double best_residual = INFINITY;
  Eigen::VectorXd best = Eigen::VectorXd::Zero(k);
  for (unsigned mask = 1; mask < (1u << k); ++mask) {
    std::vector<Eigen::Index> cols;
    for (size_t c = 0; c < k; ++c) {
      if (mask & (1u << c)) cols.push_back(static_cast<Eigen::Index>(c));
    }
    if (static_cast<Eigen::Index>(cols.size()) > rows) continue;
    Eigen::MatrixXd sub(rows, static_cast<Eigen::Index>(cols.size()));
    for (size_t j = 0; j < cols.size(); ++j) sub.col(static_cast<Eigen::Index>(j)) = a.col(cols[j]);
    if (sub.colPivHouseholderQr().rank() < static_cast<Eigen::Index>(cols.size())) continue;
    const Eigen::VectorXd x = sub.colPivHouseholderQr().solve(b);
    if ((x.array() < 0).any() || !x.allFinite()) continue;
    const double residual = (sub * x - b).squaredNorm();
    if (residual < best_residual) {
      best_residual = residual;
      best.setZero();
      for (size_t j = 0; j < cols.size(); ++j) best(cols[j]) = x(static_cast<Eigen::Index>(j));
    }
  }
  if (!std::isfinite(best_residual)) {
    return InvalidArgumentError("samples: no non-negative fit of the cost terms to " + std::to_string(samples.size()) +
                                " timed forwards");
  }
  FormCostCoefficients fit;
  for (size_t c = 0; c < k; ++c) fit.per_term[c] = best(static_cast<Eigen::Index>(c)) / scale(static_cast<Eigen::Index>(c));
  for (const CostSample& sample : samples) {
    const double predicted = fit.Predict(sample.terms);
    if (sample.shape.n <= 0 || !(predicted > 0)) continue;
    fit.residuals.push_back({.log_n = std::log2(static_cast<double>(sample.shape.n)),
                             .log_m = std::log2(static_cast<double>(std::max<int64_t>(sample.shape.m, 1))),
                             .ratio = std::clamp(sample.seconds / predicted, kMinResidual, kMaxResidual)});
  }
  return fit;
}

ExactChoice ChooseExactForm(const FormCostModel& model, const FormWeights& factored, const FormWeights* summed,
                            std::span<const SequenceShape> batch, const SummedOrder& order) {
  ExactChoice choice;
  const double f = model.Of(Form::kFactored).Predict(ForwardCostTerms(factored, batch, order), batch);
  choice.predicted_seconds[static_cast<size_t>(Form::kFactored)] = f;
  if (summed != nullptr) {
    const double s = model.Of(Form::kSummed).Predict(ForwardCostTerms(*summed, batch, order), batch);
    choice.predicted_seconds[static_cast<size_t>(Form::kSummed)] = s;
    if (s < f) choice.form = Form::kSummed;
  }
  return choice;
}

std::vector<SequenceShape> CalibrationShapes(int64_t max_context) {
  const int64_t top = std::max<int64_t>(64, max_context);
  const int64_t mid = std::max<int64_t>(16, top / 8);
  // (n, m): one query against a short, a middling and a long context; a few queries against the
  // long one; queries as many as keys, short and middling.
  const std::pair<int64_t, int64_t> nm[] = {{1, 16}, {1, mid}, {1, top}, {16, top}, {4, mid}, {16, 16}, {mid, mid}};
  std::vector<SequenceShape> shapes;
  for (const auto& [n, m] : nm) shapes.push_back({.n = n, .m = m});
  return shapes;
}

}  // namespace attnserve
