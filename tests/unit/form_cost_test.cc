// The cost model of form auto (server/core/form_cost.h) and its calibration on the CPU backend
// (server/service/auto_form.h): the terms against a count by hand and against ForwardFlops, the
// fit against known coefficients, and the choice against forwards timed here.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/batching/memory_budget.h"
#include "server/core/form_cost.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/service/auto_form.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

LayerConfig Config(int64_t d, int64_t heads, int64_t kv_heads, int64_t d_head) {
  StatusOr<LayerConfig> c = CompleteConfig({.d_model = d, .heads = heads, .kv_heads = kv_heads, .d_head = d_head});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

// The terms of one sequence counted by hand from the formulas of docs/architecture.md, for a
// layer with GQA (h = 4, h_kv = 2, d_h = 8, d = 16): the factored form projects Q (h·d_h), K and
// V (h_kv·d_h each) and projects O back; the summed form projects Q, K and the value block h·d,
// over the m context rows when projecting first and over the n queries when mixing first.
TEST(FormCostTest, TermsMatchACountByHand) {
  const LayerWeights w = RandomLayerWeights(Config(16, 4, 2, 8), 7);
  const FormWeights factored = MaterializeFactored(w), summed = MaterializeSummed(w);
  const SequenceShape s{.n = 3, .m = 11};
  const double d = 16, q = 32, kv = 16, n = 3, m = 11;
  const CostTerms f = ForwardCostTerms(factored, std::span(&s, 1));
  EXPECT_DOUBLE_EQ(f.gemm_flops, 2 * d * (n * q + m * kv + m * kv) + 2 * n * q * d);
  EXPECT_DOUBLE_EQ(f.attention_flops, 2 * n * m * (q + q));  // every query head mixes d_h columns
  EXPECT_EQ(f.calls, 1);
  const CostTerms project_first = ForwardCostTerms(summed, std::span(&s, 1), SummedOrder{});
  EXPECT_DOUBLE_EQ(project_first.gemm_flops, 2 * d * (n * q + m * kv + m * 4 * d));
  EXPECT_DOUBLE_EQ(project_first.attention_flops, 2 * n * m * (q + 4 * d));
  const CostTerms mix_first = ForwardCostTerms(summed, std::span(&s, 1), SummedOrder{.mix_first_allowed = true});
  EXPECT_DOUBLE_EQ(mix_first.gemm_flops, 2 * d * (n * q + m * kv + n * 4 * d));
  EXPECT_DOUBLE_EQ(mix_first.attention_flops, project_first.attention_flops);
  EXPECT_LT(mix_first.bytes, project_first.bytes) << "mixing first writes n rows of the value block, not m";
  EXPECT_GT(f.bytes, static_cast<double>(factored.Bytes()));
}

TEST(FormCostTest, TermsSumToForwardFlopsForRandomBatches) {
  std::mt19937_64 rng(testing::TestSeed());
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t kv = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    const LayerWeights w = RandomLayerWeights(
        Config(std::uniform_int_distribution<int64_t>(4, 40)(rng), kv * std::uniform_int_distribution<int64_t>(1, 3)(rng),
               kv, std::uniform_int_distribution<int64_t>(1, 9)(rng)),
        rng());
    std::vector<SequenceShape> batch;
    for (int i = 0; i < 1 + trial % 4; ++i) {
      const int64_t m = std::uniform_int_distribution<int64_t>(1, 300)(rng);
      batch.push_back({.n = std::uniform_int_distribution<int64_t>(1, 300)(rng), .m = m,
                       .keys = trial % 2 ? -1 : std::uniform_int_distribution<int64_t>(1, m)(rng)});
    }
    const SummedOrder order{.mix_first_allowed = trial % 3 != 0, .max_a_cat_bytes = 4096};
    for (const FormWeights& f : {MaterializeFactored(w), MaterializeSummed(w)}) {
      const CostTerms t = ForwardCostTerms(f, batch, order);
      EXPECT_NEAR(t.gemm_flops + t.attention_flops, ForwardFlops(f, batch, order), 1e-9 * ForwardFlops(f, batch, order))
          << FormName(f.form) << " trial " << trial;
    }
  }
}

// Samples made from known coefficients (with 1 % noise) give them back; a term the data do not
// need gets no negative weight.
TEST(FormCostTest, FitRecoversKnownCoefficients) {
  std::mt19937_64 rng(testing::TestSeed());
  std::normal_distribution<double> noise(0.0, 0.01);
  const std::array<double, CostTerms::kCount> truth = {2e-11, 5e-11, 1e-10, 3e-5};
  std::vector<CostSample> samples;
  for (int i = 0; i < 12; ++i) {
    CostTerms t{.gemm_flops = std::exp(std::uniform_real_distribution<double>(12, 22)(rng)),
                .attention_flops = std::exp(std::uniform_real_distribution<double>(10, 21)(rng)),
                .bytes = std::exp(std::uniform_real_distribution<double>(14, 20)(rng)),
                .calls = 1};
    const auto a = t.AsArray();
    double s = 0;
    for (size_t k = 0; k < a.size(); ++k) s += truth[k] * a[k];
    samples.push_back({.terms = t, .seconds = s * (1 + noise(rng))});
  }
  StatusOr<FormCostCoefficients> fit = FitFormCost(samples);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  double worst = 0;
  for (const CostSample& s : samples) worst = std::max(worst, std::abs(fit->Predict(s.terms) / s.seconds - 1));
  EXPECT_LT(worst, 0.05) << "the fit predicts its own samples within their noise";
  for (double c : fit->per_term) EXPECT_GE(c, 0);
  EXPECT_NEAR(fit->per_term[0] / truth[0], 1, 0.2);
  EXPECT_NEAR(fit->per_term[1] / truth[1], 1, 0.2);

  // Time that falls as the attention grows: the unconstrained fit's attention coefficient is
  // negative; the non-negative one leaves that term out.
  std::vector<CostSample> falling;
  for (int i = 1; i <= 6; ++i) {
    falling.push_back({.terms = {.gemm_flops = 1e9 * i, .attention_flops = 1e8 * (7 - i), .bytes = 0, .calls = 1},
                       .seconds = 0.01 * i - 0.001 * (7 - i) + 0.02});
  }
  fit = FitFormCost(falling);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  for (double c : fit->per_term) EXPECT_GE(c, 0);

  EXPECT_EQ(FitFormCost(std::span(samples.data(), 1)).status().code(), StatusCode::kInvalidArgument);
  std::vector<CostSample> bad = {samples[0], samples[1]};
  bad[1].seconds = 0;
  const Status refused = FitFormCost(bad).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("samples[1].seconds"), std::string::npos) << refused.message();
}

// The residuals: a timed shape's own ratio there, the nearer shape's more between two, none
// without residuals; a fit of shaped samples predicts each of them exactly.
TEST(FormCostTest, ResidualsMakeTheModelExactWhereTimedAndSmoothBetween) {
  FormCostCoefficients c{.per_term = {1e-11, 1e-11, 0, 0}};
  const SequenceShape at16{.n = 1, .m = 16}, at32{.n = 1, .m = 32}, at128{.n = 1, .m = 128};
  EXPECT_EQ(c.ResidualFactor(std::span(&at16, 1)), 1) << "no residuals: the terms alone";
  c.residuals = {{.log_n = 0, .log_m = 4, .ratio = 2}, {.log_n = 0, .log_m = 7, .ratio = 0.5}};
  EXPECT_DOUBLE_EQ(c.ResidualFactor(std::span(&at16, 1)), 2);
  EXPECT_DOUBLE_EQ(c.ResidualFactor(std::span(&at128, 1)), 0.5);
  const double between = c.ResidualFactor(std::span(&at32, 1));
  EXPECT_GT(between, 1) << "m = 32 lies nearer m = 16 (ratio 2) than m = 128 (0.5)";
  EXPECT_LT(between, 2);
  const SequenceShape far{.n = 1024, .m = 1 << 20};
  EXPECT_NEAR(c.ResidualFactor(std::span(&far, 1)), 1, 0.01) << "octaves from every timed shape: the terms' trend";
  // A batch is placed by its stacked rows: two sequences of 1 × 8 sit at (2, 16).
  const SequenceShape pair[] = {{.n = 1, .m = 8}, {.n = 1, .m = 8}};
  const SequenceShape stacked{.n = 2, .m = 16};
  EXPECT_DOUBLE_EQ(c.ResidualFactor(pair), c.ResidualFactor(std::span(&stacked, 1)));

  std::mt19937_64 rng(testing::TestSeed());
  std::normal_distribution<double> noise(0.0, 0.05);
  std::vector<CostSample> samples;
  for (const auto& [n, m] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {1, 128}, {4, 128}, {16, 16}, {16, 1024}}) {
    const CostTerms t{.gemm_flops = 1e6 * static_cast<double>(n + m), .attention_flops = 1e4 * static_cast<double>(n * m),
                      .bytes = 1e6, .calls = 1};
    samples.push_back({.terms = t, .seconds = (1e-9 * t.gemm_flops + 1e-9 * t.attention_flops) * std::exp(noise(rng)),
                       .shape = {.n = n, .m = m}});
  }
  StatusOr<FormCostCoefficients> fit = FitFormCost(samples);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  ASSERT_EQ(fit->residuals.size(), samples.size());
  for (const CostSample& sample : samples) {
    EXPECT_NEAR(fit->Predict(sample.terms, std::span(&sample.shape, 1)) / sample.seconds, 1, 1e-12)
        << "n " << sample.shape.n << " m " << sample.shape.m;
  }
}

TEST(FormCostTest, FlopCountModelPicksTheFormWithFewerFlops) {
  const LayerWeights w = RandomLayerWeights(Config(64, 8, 8, 8), 3);
  const FormWeights factored = MaterializeFactored(w), summed = MaterializeSummed(w);
  const SummedOrder mix_first{.mix_first_allowed = true};
  for (const SequenceShape s : {SequenceShape{.n = 1, .m = 512}, SequenceShape{.n = 64, .m = 64},
                                SequenceShape{.n = 8, .m = 16}, SequenceShape{.n = 200, .m = 300}}) {
    const std::span<const SequenceShape> batch(&s, 1);
    const Form want = ForwardFlops(summed, batch, mix_first) < ForwardFlops(factored, batch, mix_first) ? Form::kSummed
                                                                                                        : Form::kFactored;
    EXPECT_EQ(ChooseExactForm(FlopCountModel(), factored, &summed, batch, mix_first).form, want)
        << "n " << s.n << " m " << s.m;
    EXPECT_EQ(ChooseExactForm(FlopCountModel(), factored, nullptr, batch, mix_first).form, Form::kFactored)
        << "a layer without the summed form";
  }
}

// A layer on the CPU backend, its exact forms resident.
std::shared_ptr<Layer> ResidentLayer(Backend& backend, const LayerConfig& config, uint64_t serial) {
  auto layer = std::make_shared<Layer>();
  layer->name = "calibrated";
  layer->serial = serial;
  layer->config = config;
  const LayerWeights w = RandomLayerWeights(config, serial);
  for (FormWeights f : {MaterializeFactored(w), MaterializeSummed(w)}) {
    const Form form = f.form;
    StatusOr<std::shared_ptr<const ResidentForm>> r = backend.Upload(std::make_shared<const FormWeights>(std::move(f)));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    layer->forms.emplace(form, *r);
  }
  return layer;
}

// Seconds of the best of `rounds` forwards of each exact form on one synthetic sequence of this
// shape, the two forms interleaved (the order swapped every round) after one untimed forward of
// each: what drifts on a shared machine (a neighbour, the clock) falls on both alike.
//
// How far a timed pair may be from the truth: at a few queries against a long context the summed
// form takes 0.7–0.8 of the factored form's time here, but that is a mean over layers; one layer's
// weights, placed by the allocator, timed at n 4, m 4096 from 0.64 to 1.05 of it (AMD EPYC Zen 3,
// 2026-12-07, 30 runs of this test; timed apart, best of 3 each, the summed form came out the
// slower in 2 to 6 of 40 runs). The slower form takes, on average, about 1.3× the other's time
// at these long contexts and 3× where queries and keys are alike: a flipped pick is past this
// (and the check on the choice above catches it first).
constexpr double kTimingNoise = 1.15;

struct FormTimes {
  double factored = INFINITY, summed = INFINITY;
};
FormTimes TimeExactForms(Backend& backend, const Layer& layer, const SequenceShape& s, std::mt19937_64& rng,
                         int rounds) {
  const int64_t d = layer.config.d_model;
  testing::OwnedSequence seq = testing::RandomSequence(rng, d, s.n, s.m, s.m != s.n, false, -1);
  const Sequence view = seq.View();
  const ResidentForm& factored = *layer.Find(Form::kFactored);
  const ResidentForm& summed = *layer.Find(Form::kSummed);
  const auto seconds = [&](const ResidentForm& form) {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(backend.Forward(form, std::span(&view, 1)).ok());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  seconds(factored);
  seconds(summed);
  FormTimes best;
  for (int round = 0; round < rounds; ++round) {
    const bool factored_first = round % 2 == 0;
    const double first = seconds(factored_first ? factored : summed);
    const double second = seconds(factored_first ? summed : factored);
    best.factored = std::min(best.factored, factored_first ? first : second);
    best.summed = std::min(best.summed, factored_first ? second : first);
  }
  return best;
}

// The constants measured here (the server's calibration, AutoFormChooser) pick the summed form
// for a few queries against a long context, which it mixes first, and the factored form when
// queries and keys are alike in number; each pick is the faster form as timed here (within
// kTimingNoise), and the measured model was used (not the flop count).
TEST(FormCostTest, CalibratedModelPicksTheFasterFormOnThisCpu) {
  CpuBackend backend;
  ASSERT_TRUE(backend.summed_order().mix_first_allowed) << "the CPU backend mixes first by default";
  std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(256, 8, 8, 32), 11);
  AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(2000)});
  const FormCostModel& model = chooser.Calibrate(*layer);
  EXPECT_TRUE(model.measured) << "the calibration fitted both forms within its budget";
  for (Form f : kExactForms) {
    for (double c : model.Of(f).per_term) EXPECT_GE(c, 0) << FormName(f);
  }
  std::mt19937_64 rng(testing::TestSeed());
  struct Cell {
    SequenceShape shape;
    Form want;
  };
  for (const Cell& cell : {Cell{{.n = 1, .m = 2048}, Form::kSummed}, Cell{{.n = 4, .m = 4096}, Form::kSummed},
                           Cell{{.n = 128, .m = 128}, Form::kFactored}, Cell{{.n = 256, .m = 256}, Form::kFactored}}) {
    const ExactChoice choice = chooser.Choose(layer, std::span(&cell.shape, 1));
    const auto [factored, summed] = TimeExactForms(backend, *layer, cell.shape, rng, 7);
    EXPECT_EQ(choice.form, cell.want) << "n " << cell.shape.n << " m " << cell.shape.m << ": predicted factored "
                                      << choice.predicted_seconds[0] << " s, summed " << choice.predicted_seconds[1]
                                      << " s; timed factored " << factored << " s, summed " << summed << " s";
    const double wanted = cell.want == Form::kSummed ? summed : factored;
    const double other = cell.want == Form::kSummed ? factored : summed;
    EXPECT_LE(wanted, kTimingNoise * other)
        << "the cell's faster form as timed here (n " << cell.shape.n << " m " << cell.shape.m << "): timed factored "
        << factored << " s, summed " << summed << " s";
  }
}

// With no calibration budget the flop count decides, and a layer is fitted once per load.
TEST(FormCostTest, NoBudgetMeansTheFlopCountAndOneModelPerLoad) {
  CpuBackend backend;
  std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(64, 4, 4, 16), 5);
  AutoFormChooser untimed(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(0)});
  EXPECT_FALSE(untimed.Calibrate(*layer).measured);
  AutoFormChooser timed(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(500),
                                                  .max_context = 256});
  const FormCostModel* first = &timed.Calibrate(*layer);
  EXPECT_TRUE(first->measured);
  EXPECT_EQ(&timed.Calibrate(*layer), first) << "the same load is not timed again";
  std::shared_ptr<Layer> reloaded = ResidentLayer(backend, layer->config, 6);
  EXPECT_NE(&timed.Calibrate(*reloaded), first) << "a new load (serial) is timed anew";
}

// A backend that computes nothing and whose forwards take, on a clock of its own, a fixed price
// per flop counted in the summed order it declares: a calibration timed by that clock is
// deterministic, and the model fitted from it must price every shape as the backend does.
class MeteredBackend final : public Backend {
 public:
  static constexpr double kSecondsPerFlop = 1e-12;  // 1 TFLOP/s

  // `long_context_penalty`: a forward over more than 256 context rows costs that much more per
  // flop (the operands leave a cache): a rate no linear term has.
  // `cold_penalty`: a forward that follows one of another form or shape costs that much more
  // (its weights were evicted), as the calibration's interleaved passes would find them.
  explicit MeteredBackend(SummedOrder order, double long_context_penalty = 0, double cold_penalty = 0)
      : order_(order), long_context_penalty_(long_context_penalty), cold_penalty_(cold_penalty) {}
  std::string DeviceName() const override { return "metered"; }
  StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> form) override {
    return cpu_.Upload(std::move(form));
  }
  Status Forward(const ResidentForm& form, std::span<const Sequence> batch) override {
    std::vector<SequenceShape> shapes;
    int64_t longest = 0;
    for (const Sequence& s : batch) {
      shapes.push_back({.n = s.n(), .m = s.m(), .keys = s.key_length});
      longest = std::max(longest, s.m());
    }
    const bool warm = last_form_ == &form && last_shapes_.size() == shapes.size() &&
                      std::equal(shapes.begin(), shapes.end(), last_shapes_.begin(), [](auto& a, auto& b) {
                        return a.n == b.n && a.m == b.m && a.keys == b.keys;
                      });
    last_form_ = &form;
    last_shapes_ = shapes;
    elapsed_ += ForwardFlops(form.weights(), shapes, order_) * kSecondsPerFlop *
                (1 + (longest > 256 ? long_context_penalty_ : 0)) * (warm ? 1 : 1 + cold_penalty_);
    return OkStatus();
  }
  SummedOrder summed_order() const override { return order_; }
  std::chrono::steady_clock::time_point Now() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(elapsed_)));
  }

 private:
  CpuBackend cpu_{CpuBackendOptions{.threads = 1}};
  const ResidentForm* last_form_ = nullptr;
  std::vector<SequenceShape> last_shapes_;
  const SummedOrder order_;
  const double long_context_penalty_, cold_penalty_;
  double elapsed_ = 0;
};

// The calibration counts the summed form's work in the order the backend runs it: against a
// backend that mixes first, the fitted model prices a few queries over a long context (where
// mixing first saves the context's value projection) at the backend's own time, within 1 %.
TEST(FormCostTest, CalibrationCountsTheBackendsSummedOrder) {
  for (const bool mix_first : {true, false}) {
    MeteredBackend backend(SummedOrder{.mix_first_allowed = mix_first});
    std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(256, 8, 8, 32), 21);
    AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(1000),
                                                      .now = [&backend] { return backend.Now(); }});
    ASSERT_TRUE(chooser.Calibrate(*layer).measured) << "mix first " << mix_first;
    for (const SequenceShape s : {SequenceShape{.n = 1, .m = 2048}, SequenceShape{.n = 4, .m = 4096},
                                  SequenceShape{.n = 16, .m = 600}, SequenceShape{.n = 300, .m = 300}}) {
      const std::span<const SequenceShape> batch(&s, 1);
      const ExactChoice choice = chooser.Choose(layer, batch);
      for (Form f : kExactForms) {
        const double truth = ForwardFlops(layer->Find(f)->weights(), batch, backend.summed_order()) *
                             MeteredBackend::kSecondsPerFlop;
        EXPECT_NEAR(choice.predicted_seconds[static_cast<size_t>(f)], truth, 0.01 * truth)
            << FormName(f) << ", mix first " << mix_first << ", n " << s.n << " m " << s.m;
      }
    }
  }
}

// Calibrates a layer on `backend` and expects the model to predict every timed shape at
// `seconds` (the backend's time for it), to the clock's nanosecond (the metered time is cut to
// it: 1e-3 of the shortest forward). Answers, per exact form, the worst relative error of the
// terms alone at those shapes.
std::vector<double> ExpectTimedShapesPredicted(MeteredBackend& backend, uint64_t serial,
                                               const std::function<double(const SequenceShape&)>& factor) {
  std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(256, 8, 8, 32), serial);
  AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(1000),
                                                    .now = [&backend] { return backend.Now(); }});
  const FormCostModel& model = chooser.Calibrate(*layer);
  EXPECT_TRUE(model.measured);
  std::vector<double> worst_terms_alone;
  for (Form f : kExactForms) {
    const FormWeights& w = layer->Find(f)->weights();
    double worst = 0;
    for (const SequenceShape& shape : CalibrationShapes(1024)) {
      const std::span<const SequenceShape> one(&shape, 1);
      const double truth = ForwardFlops(w, one, backend.summed_order()) * MeteredBackend::kSecondsPerFlop * factor(shape);
      const CostTerms terms = ForwardCostTerms(w, one, backend.summed_order());
      EXPECT_NEAR(model.Of(f).Predict(terms, one) / truth, 1, 2e-3) << FormName(f) << " n " << shape.n << " m " << shape.m;
      worst = std::max(worst, std::abs(model.Of(f).Predict(terms) / truth - 1));
    }
    worst_terms_alone.push_back(worst);
  }
  return worst_terms_alone;
}

// A backend whose rate changes with the context (no linear term can say so): the terms alone miss
// some timed shape by far more than the 5 % that decide near a crossover; with the residuals the
// model predicts every timed shape as the backend times it.
TEST(FormCostTest, TheResidualsCatchWhatTheTermsMissAtTheTimedShapes) {
  MeteredBackend backend(SummedOrder{.mix_first_allowed = true}, /*long_context_penalty=*/0.6);
  const std::vector<double> worst =
      ExpectTimedShapesPredicted(backend, 27, [](const SequenceShape& s) { return s.m > 256 ? 1.6 : 1.0; });
  for (double w : worst) EXPECT_GT(w, 0.05) << "the check needs a rate the terms cannot fit";
}

// A short forward is timed right after a repeat of itself, as a stream of requests to one form
// would run it: a backend that charges a forward after another form or shape 50 % more is still
// predicted at its warm time at every timed shape (all shorter than 2 ms here).
TEST(FormCostTest, ShortForwardsAreTimedWarm) {
  MeteredBackend backend(SummedOrder{.mix_first_allowed = true}, 0, /*cold_penalty=*/0.5);
  ExpectTimedShapesPredicted(backend, 31, [](const SequenceShape&) { return 1.0; });
}

// In the server the fit runs on a background worker: the request that finds its layer unfitted is
// answered by the flop count, the fit is scheduled once (again when the worker could not take
// it), it holds its memory in the budget while it runs, and the next request uses what it fitted.
TEST(FormCostTest, WithASchedulerNoRequestWaitsForTheFit) {
  MeteredBackend backend(SummedOrder{.mix_first_allowed = true});
  std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(256, 8, 8, 32), 23);
  std::vector<std::function<void()>> queued;
  bool accept = false;
  int64_t peak = 0;
  MemoryBudget memory(int64_t{1} << 40, "--max-memory-mb", [&peak](int64_t reserved) { peak = std::max(peak, reserved); });
  AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(1000),
                                                    .now = [&backend] { return backend.Now(); },
                                                    .schedule =
                                                        [&](std::function<void()> fit) {
                                                          if (accept) queued.push_back(std::move(fit));
                                                          return accept;
                                                        },
                                                    .memory = &memory});
  const SequenceShape s{.n = 4, .m = 4096};
  const std::span<const SequenceShape> batch(&s, 1);
  const FormWeights& factored = layer->Find(Form::kFactored)->weights();
  const FormWeights& summed = layer->Find(Form::kSummed)->weights();
  const ExactChoice by_flops = ChooseExactForm(FlopCountModel(), factored, &summed, batch, backend.summed_order());
  auto predicted = [](const ExactChoice& c) { return std::vector<double>(std::begin(c.predicted_seconds), std::end(c.predicted_seconds)); };

  EXPECT_EQ(predicted(chooser.Choose(layer, batch)), predicted(by_flops)) << "the worker refused: the flop count";
  EXPECT_TRUE(queued.empty());
  accept = true;
  EXPECT_EQ(predicted(chooser.Choose(layer, batch)), predicted(by_flops)) << "scheduled: the flop count meanwhile";
  EXPECT_EQ(predicted(chooser.Choose(layer, batch)), predicted(by_flops));
  ASSERT_EQ(queued.size(), 1u) << "one fit per layer at a time";
  EXPECT_EQ(backend.Now(), std::chrono::steady_clock::time_point{}) << "no forward ran on the requests' thread";
  queued[0]();  // the background worker's turn
  EXPECT_GT(peak, 0) << "the fit held its forwards' memory in the budget";
  EXPECT_EQ(memory.reserved(), 0) << "and gave it back";
  const ExactChoice fitted = chooser.Choose(layer, batch);
  for (Form f : kExactForms) {
    const double truth =
        ForwardFlops(layer->Find(f)->weights(), batch, backend.summed_order()) * MeteredBackend::kSecondsPerFlop;
    EXPECT_NEAR(fitted.predicted_seconds[static_cast<size_t>(f)], truth, 0.01 * truth) << FormName(f);
  }
  EXPECT_EQ(queued.size(), 1u) << "fitted once";
}

// A fit the memory budget refuses leaves the flop count deciding, and is tried again only after
// kRefitAfterRefusal.
TEST(FormCostTest, AFitTheBudgetRefusesIsRetriedLater) {
  MeteredBackend backend(SummedOrder{.mix_first_allowed = true});
  std::shared_ptr<Layer> layer = ResidentLayer(backend, Config(64, 4, 4, 16), 29);
  std::vector<std::function<void()>> queued;
  std::chrono::seconds skew{0};
  MemoryBudget memory(4096, "--max-memory-mb");
  AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(500),
                                                    .now = [&] { return backend.Now() + skew; },
                                                    .schedule =
                                                        [&](std::function<void()> fit) {
                                                          queued.push_back(std::move(fit));
                                                          return true;
                                                        },
                                                    .memory = &memory});
  const SequenceShape s{.n = 8, .m = 8};
  chooser.Choose(layer, std::span(&s, 1));
  ASSERT_EQ(queued.size(), 1u);
  queued[0]();
  EXPECT_EQ(backend.Now(), std::chrono::steady_clock::time_point{}) << "refused before any forward";
  EXPECT_FALSE(chooser.Calibrate(*layer).measured);
  chooser.Choose(layer, std::span(&s, 1));
  EXPECT_EQ(queued.size(), 1u) << "not before kRefitAfterRefusal";
  skew = AutoFormChooser::kRefitAfterRefusal + std::chrono::seconds(1);
  chooser.Choose(layer, std::span(&s, 1));
  EXPECT_EQ(queued.size(), 2u) << "tried again";
}

}  // namespace
}  // namespace attnserve
