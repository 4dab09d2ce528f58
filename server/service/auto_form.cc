#include "server/service/auto_form.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <random>
#include <vector>

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

// One synthetic sequence's buffers: random inputs (the backend's time does not depend on the
// values, but zeros could take a denormal-free shortcut somewhere), self-attention when n = m.
struct SyntheticSequence {
  std::vector<float> input, context, output;
  Sequence sequence;

  SyntheticSequence(const SequenceShape& shape, int64_t d, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    input.resize(static_cast<size_t>(shape.n * d));
    for (float& v : input) v = u(rng);
    output.resize(input.size());
    sequence.input = ConstMatrixView{input.data(), shape.n, d};
    if (shape.m != shape.n) {
      context.resize(static_cast<size_t>(shape.m * d));
      for (float& v : context) v = u(rng);
      sequence.context = ConstMatrixView{context.data(), shape.m, d};
    }
    sequence.output = MatrixView{output.data(), shape.n, d};
  }
};

}  // namespace

AutoFormChooser::AutoFormChooser(Backend* backend, AutoFormOptions options)
    : backend_(backend), options_(options) {}

std::optional<FormCostModel> AutoFormChooser::Fit(const Layer& layer) const {
  FormCostModel model = FlopCountModel();
  const ResidentForm* summed = layer.Find(Form::kSummed);
  if (options_.calibration_budget.count() <= 0 || summed == nullptr) return model;  // one form: nothing to choose
  const SummedOrder order = backend_->summed_order();
  const std::vector<SequenceShape> shapes = CalibrationShapes(options_.max_context);
  // The synthetic inputs and outputs, and the largest forward's scratch, held like a request's.
  MemoryBudget::Reservation reservation;
  if (options_.memory != nullptr) {
    int64_t buffers = 0, scratch = 0;
    for (const SequenceShape& shape : shapes) {
      buffers += (2 * shape.n + (shape.m != shape.n ? shape.m : 0)) * layer.config.d_model *
                 static_cast<int64_t>(sizeof(float));
      for (Form form : kExactForms) {
        scratch = std::max(scratch, backend_->ScratchBytes(layer.Find(form)->weights(), std::span(&shape, 1),
                                                           shape.m == shape.n));
      }
    }
    auto reserved = options_.memory->Reserve(buffers + scratch, "auto's calibration of layer '" + layer.name + "'");
    if (!reserved.ok()) {
      spdlog::warn("layer '{}': auto's calibration waits for memory ({}); the flop count decides meanwhile",
                   layer.name, reserved.status().ToString());
      return std::nullopt;
    }
    reservation = std::move(*reserved);
  }
  const Clock::time_point start = options_.now();
  const Clock::time_point until = start + options_.calibration_budget;
  std::mt19937 rng(static_cast<uint32_t>(layer.serial));
  // Every (shape, form) once per pass, the cheapest shapes first; passes repeat until the budget
  // or kPasses: a burst of the machine's other load then costs one pass's run of a probe, not
  // its only sample. Each probe keeps its best time: the others' load only ever adds.
  constexpr int kPasses = 8;
  struct Probe {
    size_t shape;
    const ResidentForm* resident;
    double best = INFINITY;
  };
  std::vector<std::unique_ptr<SyntheticSequence>> sequences;
  std::vector<Probe> probes;
  for (size_t i = 0; i < shapes.size(); ++i) {
    sequences.push_back(std::make_unique<SyntheticSequence>(shapes[i], layer.config.d_model, rng));
    for (Form form : kExactForms) probes.push_back({.shape = i, .resident = layer.Find(form)});
  }
  // Pass 0 warms up (first touch of the buffers and the backend's scratch) and is not timed. A
  // forward cannot be cut short, so one the fastest rate seen so far says would overrun the
  // budget is not started (a wide layer's summed form at n = m takes seconds).
  //
  // A short forward is timed right after an untimed repeat of itself. The passes interleave the
  // shapes and forms, so each probe would find its weights evicted by the one before (28 MB of
  // summed weights at d_model 768); a server's stream of requests to one form finds them in cache.
  // Timed cold, the small shapes measured up to 2x their warm time, the summed form (more weights)
  // more than the factored one: a bias at exactly the small crossovers.
  constexpr double kRepeatBelowSeconds = 2e-3;
  auto forward = [&](const Probe& p) {
    Status st = backend_->Forward(*p.resident, std::span<const Sequence>(&sequences[p.shape]->sequence, 1));
    if (!st.ok()) {
      spdlog::warn("layer '{}': auto's calibration of the {} form failed ({}); the flop count decides", layer.name,
                   FormName(p.resident->weights().form), st.ToString());
    }
    return st.ok();
  };
  double flops_per_second = 0;
  int timed = 0;  // forwards whose time a probe kept a candidate of (the warm-up pass's are not)
  for (int pass = 0; pass <= kPasses && options_.now() < until; ++pass) {
    for (Probe& p : probes) {
      if (options_.now() >= until) break;
      const double flops = ForwardFlops(p.resident->weights(), std::span(&shapes[p.shape], 1), order);
      const bool repeat = pass > 0 && p.best < kRepeatBelowSeconds;
      const double expected = flops_per_second > 0 ? (repeat ? 2 : 1) * flops / flops_per_second : 0;
      if (expected > std::chrono::duration<double>(until - options_.now()).count()) continue;
      if (repeat && !forward(p)) return model;
      const Clock::time_point t0 = options_.now();
      if (!forward(p)) return model;
      const double seconds = std::chrono::duration<double>(options_.now() - t0).count();
      if (seconds > 0) flops_per_second = std::max(flops_per_second, flops / seconds);
      if (pass > 0) {
        p.best = std::min(p.best, seconds);
        ++timed;
      }
    }
  }
  std::vector<CostSample> samples[std::size(kAllForms)];
  for (const Probe& p : probes) {
    if (!std::isfinite(p.best)) continue;
    const FormWeights& w = p.resident->weights();
    samples[static_cast<size_t>(w.form)].push_back(
        {.terms = ForwardCostTerms(w, std::span<const SequenceShape>(&shapes[p.shape], 1), order),
         .seconds = p.best,
         .shape = shapes[p.shape]});
  }
  FormCostModel fitted;
  for (Form form : kExactForms) {
    StatusOr<FormCostCoefficients> c = FitFormCost(samples[static_cast<size_t>(form)]);
    if (!c.ok()) {
      spdlog::warn("layer '{}': auto's calibration of the {} form has too few samples within --auto-calibration-ms "
                   "({}); the flop count decides",
                   layer.name, FormName(form), c.status().ToString());
      return model;
    }
    fitted.by_form[static_cast<size_t>(form)] = *c;
  }
  fitted.measured = true;
  spdlog::info("layer '{}': auto's cost model fitted from {} timed forwards ({} shape and form pairs, the best of "
               "each kept) in {:.0f} ms",
               layer.name, timed, samples[0].size() + samples[1].size(),
               std::chrono::duration<double, std::milli>(options_.now() - start).count());
  return fitted;
}

const FormCostModel* AutoFormChooser::FitAndStore(const Layer& layer) {
  std::optional<FormCostModel> fitted;
  try {
    fitted = Fit(layer);
  } catch (const std::exception& e) {  // the waiters must not wait forever
    spdlog::warn("layer '{}': auto's calibration failed ({}); the flop count decides", layer.name, e.what());
    fitted = FlopCountModel();
  }
  const FormCostModel* stored = nullptr;
  {
    MutexLock lock(mu_);
    Entry& entry = models_[layer.serial];
    entry.fitting = false;
    if (fitted) {
      entry.model = std::make_unique<const FormCostModel>(*fitted);
      stored = entry.model.get();
    } else {
      entry.retry_after = options_.now() + kRefitAfterRefusal;
    }
  }
  fitted_.notify_all();
  return stored;
}

const FormCostModel& AutoFormChooser::Calibrate(const Layer& layer) {
  {
    MutexLock lock(mu_);
    Entry& entry = models_[layer.serial];
    fitted_.wait(lock.native(), [&] {
      mu_.AssertHeld();  // the wait runs its predicate under the lock
      return !entry.fitting;
    });
    if (entry.model != nullptr) return *entry.model;
    entry.fitting = true;
  }
  // This caller fits it, outside the lock (it takes up to the budget); others wait above.
  const FormCostModel* model = FitAndStore(layer);
  return model != nullptr ? *model : flop_count_;  // null: its memory was refused
}

const FormCostModel* AutoFormChooser::FittedOrScheduled(const std::shared_ptr<const Layer>& layer) {
  {
    MutexLock lock(mu_);
    Entry& entry = models_[layer->serial];
    if (entry.model != nullptr) return entry.model.get();
    // A fit queued or running, or one whose memory was refused and is not to be tried yet.
    if (entry.fitting || options_.now() < entry.retry_after) return nullptr;
    entry.fitting = true;  // one fit per layer at a time
  }
  if (!options_.schedule([this, layer] { FitAndStore(*layer); })) {
    {
      MutexLock lock(mu_);
      models_[layer->serial].fitting = false;  // the next request schedules it again
    }
    fitted_.notify_all();
  }
  return nullptr;
}

ExactChoice AutoFormChooser::Choose(const std::shared_ptr<const Layer>& layer, std::span<const SequenceShape> batch) {
  const FormCostModel* model = options_.schedule ? FittedOrScheduled(layer) : &Calibrate(*layer);
  const ResidentForm* summed = layer->Find(Form::kSummed);
  return ChooseExactForm(model != nullptr ? *model : flop_count_, layer->Find(Form::kFactored)->weights(),
                         summed ? &summed->weights() : nullptr, batch, backend_->summed_order());
}

}  // namespace attnserve
