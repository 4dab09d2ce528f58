#include "bench/accuracy_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/reference.h"

namespace attnserve {
namespace {

// One sequence's buffers: its queries, its context (empty: self-attention) and its answer.
struct CheckSequence {
  std::vector<float> input, context, output;
  int64_t n = 0, m = 0, key_length = -1;
  bool causal = false;
  Sequence View(int64_t d) {
    Sequence s;
    s.input = ConstMatrixView(input.data(), n, d);
    if (!context.empty()) s.context = ConstMatrixView(context.data(), m, d);
    s.output = MatrixView(output.data(), n, d);
    s.causal = causal;
    s.key_length = key_length;
    return s;
  }
};

CheckSequence Draw(std::mt19937_64& rng, int64_t d, int64_t n, int64_t m, bool cross, bool causal,
                   int64_t key_length) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  CheckSequence s;
  s.n = n, s.m = m, s.causal = causal, s.key_length = key_length;
  s.input.resize(n * d);
  for (float& v : s.input) v = normal(rng);
  if (cross) {
    s.context.resize(m * d);
    for (float& v : s.context) v = normal(rng);
  }
  s.output.assign(n * d, NAN);
  return s;
}

double RelativeL2(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);  // NaN anywhere in `got` gives NaN, which fails the bound
}

}  // namespace

double AccuracyBound(Math math) {
  const double u = math == Math::kBf16 ? 0x1p-8 : (math == Math::kTf32 || math == Math::kFp16) ? 0x1p-11 : 0x1p-24;
  return 10 * u + 1e-4;
}

AccuracyCheck CheckAgainstFloat64(Backend& backend, Math math, double bound) {
  constexpr int64_t kD = 256;
  std::mt19937_64 rng(20261207);
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = kD, .heads = 4, .kv_heads = 2, .bias = true}),
                                            rng());
  // A causal sequence past one key tile of either fused kernel (64), and 7 queries over 150
  // context rows of which 130 are seen.
  std::vector<CheckSequence> seqs = {Draw(rng, kD, 96, 96, false, true, -1), Draw(rng, kD, 7, 150, true, false, 130)};
  AccuracyCheck check{.passed = true};
  if (!(bound > 0)) bound = AccuracyBound(math);
  for (const Form form : {Form::kFactored, Form::kSummed}) {
    auto resident = backend.Upload(std::make_shared<const FormWeights>(
        form == Form::kFactored ? MaterializeFactored(w) : MaterializeSummed(w)));
    if (!resident.ok()) {
      check.passed = false;
      check.report += std::string(FormName(form)) + ": upload failed: " + resident.status().ToString() + "\n";
      continue;
    }
    std::vector<Sequence> batch;
    for (CheckSequence& s : seqs) batch.push_back(s.View(kD));
    const Status st = backend.Forward(**resident, batch);
    double worst = 0;
    for (size_t i = 0; st.ok() && i < seqs.size(); ++i) {
      const double e = RelativeL2(seqs[i].output, ReferenceForward(w, batch[i]));
      worst = std::isnan(e) ? e : std::max(worst, e);
      if (std::isnan(worst)) break;
    }
    const bool ok = st.ok() && worst <= bound;  // NaN fails
    check.passed = check.passed && ok;
    char line[200];
    std::snprintf(line, sizeof line, "%s in %s: relative L2 to float64 %.3g, bound %.3g: %s%s\n",
                  std::string(FormName(form)).c_str(), std::string(MathName(math)).c_str(), worst, bound,
                  ok ? "ok" : "FAILED", st.ok() ? "" : (" (" + st.ToString() + ")").c_str());
    check.report += line;
  }
  return check;
}

}  // namespace attnserve
