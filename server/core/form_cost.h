// The cost model behind `auto` (docs/architecture.md, "Choosing a form by cost"): the time a
// forward of a batch takes in a form, predicted as a sum of per-form constants times the work
// terms of that batch, and the choice between the exact forms (factored and summed; never the
// low-rank form, which is not exact) that it predicts to be cheaper.
//
//   time ≈ c_gemm · GEMM flops + c_attention · attention flops + c_bytes · bytes + c_call
//
// The calibration's residuals (measured over predicted, per timed shape) then correct a
// prediction by what the terms missed at the timed shapes nearest the batch (CostResidual).
//
// The terms are counted from the form's weights and the batch's shapes (n, m, key length per
// sequence; d_model, heads, d_head and the kv group come with the weights), in the order the
// backend runs the summed form (SummedOrder: mixing first moves its value projection from the
// m context rows to the n queries). The constants are per form: the summed form's mix over d_model
// columns and the factored form's over d_head run different kernels at different rates. They
// come from FitFormCost over timed synthetic forwards (the server's calibration at load) or, with
// none, FlopCountModel, which prices every flop alike.
// Thread-safety: pure functions and plain values.
#pragma once

#include <array>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "server/core/forms.h"
#include "server/core/status.h"

namespace attnserve {

// The work of one forward of a batch in one form.
struct CostTerms {
  double gemm_flops = 0;       // the projections: Q, K, the value block, the output projection
  double attention_flops = 0;  // the scores and the mix A_i · Val_i, every head
  double bytes = 0;            // the weights read once, and the activations written and read
  double calls = 0;            // 1 per forward: the fixed cost of a call

  static constexpr size_t kCount = 4;
  std::array<double, kCount> AsArray() const { return {gemm_flops, attention_flops, bytes, calls}; }
};

// The terms of a forward of `batch` in `form` under `order`. Their flops sum to ForwardFlops.
CostTerms ForwardCostTerms(const FormWeights& form, std::span<const SequenceShape> batch,
                           const SummedOrder& order = {});

// What the terms miss at one timed shape: its measured seconds over the terms' prediction. The
// four terms are linear in the work; a real backend is not (cache fits, kernel choices, threads
// woken per call), and near the crossover of two forms a few percent decide. The residuals of the
// calibration's shapes correct the prediction of a shape near them (ResidualFactor), so the
// model is exact where it was timed and smooth in between.
struct CostResidual {
  double log_n = 0, log_m = 0;  // log2 of the shape's queries and context rows
  double ratio = 1;             // measured / predicted, within [kMinResidual, kMaxResidual]
};
inline constexpr double kMinResidual = 0.25, kMaxResidual = 4;
inline constexpr double kTermsWeight = 0.25;  // 1 / (2 octaves)²

// Seconds per unit of each term, for one form on one backend. Every coefficient >= 0.
struct FormCostCoefficients {
  std::array<double, CostTerms::kCount> per_term{};
  std::vector<CostResidual> residuals = {};  // empty: the terms alone
  // The terms' prediction.
  double Predict(const CostTerms& t) const;
  // The same, times ResidualFactor at `batch`'s point.
  double Predict(const CostTerms& t, std::span<const SequenceShape> batch) const;
  // The geometric mean of the residuals' ratios weighted by 1 / distance² in (log2 n, log2 m)
  // (Shepard's interpolation), with ratio 1 (the terms alone) weighted kTermsWeight, a batch's
  // point being (log2 Σn, log2 Σm) (its GEMMs run over the stacked rows): a timed shape's own
  // ratio at that shape, mostly the nearest shapes' between, tending to 1 (the terms' trend)
  // octaves away from every timed shape, and 1 with no residuals.
  double ResidualFactor(std::span<const SequenceShape> batch) const;
};

// The forms `auto` chooses between: the exact ones.
inline constexpr Form kExactForms[] = {Form::kFactored, Form::kSummed};
bool IsExactForm(Form form);

// A layer's model on one backend: coefficients per exact form.
struct FormCostModel {
  std::array<FormCostCoefficients, std::size(kAllForms)> by_form{};
  bool measured = false;  // false: FlopCountModel's (equal price per flop, nothing else)
  const FormCostCoefficients& Of(Form form) const { return by_form[static_cast<size_t>(form)]; }
};

// Every flop priced alike and nothing else: the choice of the form with fewer flops. The model
// of a layer not (yet) calibrated.
FormCostModel FlopCountModel();

// One timed forward: its terms, its measured seconds, and the shape it ran (n = 0: none given).
struct CostSample {
  CostTerms terms;
  double seconds = 0;
  SequenceShape shape{};
};

// The non-negative coefficients that fit `samples` best in relative error (each sample weighted
// by 1 / its seconds, so that a short forward counts as much as a long one): least squares over
// every subset of the terms, keeping the best fit whose coefficients are all >= 0; and a
// residual per sample that names its shape (the best fit's prediction against its seconds).
// INVALID_ARGUMENT when there are fewer samples than 2 or a sample's seconds is not > 0.
StatusOr<FormCostCoefficients> FitFormCost(std::span<const CostSample> samples);

// The exact form `model` predicts to be cheaper for `batch`, among those held (`factored`
// always; `summed` may be null when the layer does not hold it). Ties go to the factored form.
struct ExactChoice {
  Form form = Form::kFactored;
  double predicted_seconds[std::size(kAllForms)] = {};  // per form; 0 for forms not considered
};
ExactChoice ChooseExactForm(const FormCostModel& model, const FormWeights& factored, const FormWeights* summed,
                            std::span<const SequenceShape> batch, const SummedOrder& order = {});

// The calibration's synthetic shapes for a layer: (n, m) pairs that spread the terms apart (one
// query against short and long contexts, a few queries, n = m) within `max_context` rows.
std::vector<SequenceShape> CalibrationShapes(int64_t max_context);

}  // namespace attnserve
