// AutoFormChooser: what `auto` (FORM_AUTO, a route's "auto") resolves to for one request: the
// exact form the cost model (server/core/form_cost.h) predicts cheaper on this backend for the
// request's shapes. Each layer's model is fitted once per load from a short calibration: timed
// synthetic forwards of its factored and summed forms on the backend that serves it, within a
// time budget (docs/architecture.md, "Choosing a form by cost"). A layer calibrated with no
// budget, or whose calibration failed, uses the flop count (FlopCountModel).
// In the server the fit runs on a background worker (AutoFormOptions::schedule): the request that
// finds its layer unfitted is answered by the flop count and never waits for the timing, and the
// fit holds its forwards' memory in the server's budget (AutoFormOptions::memory).
// Thread-safety: every method may be called from any thread at once. A layer's calibration runs
// once: a second caller of Calibrate for the same layer waits for it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>

#include "server/backend/backend.h"
#include "server/batching/memory_budget.h"
#include "server/core/form_cost.h"
#include "server/core/forms.h"
#include "server/core/thread_annotations.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

struct AutoFormOptions {
  // Wall time one layer's calibration may take (--auto-calibration-ms); 0: none, the flop count
  // decides.
  std::chrono::milliseconds calibration_budget{1000};
  // The longest synthetic context the calibration times (CalibrationShapes).
  int64_t max_context = 1024;
  // The clock the calibration times its forwards and keeps its budget by: the steady clock; a
  // test's own clock makes a calibration deterministic.
  std::function<std::chrono::steady_clock::time_point()> now = [] { return std::chrono::steady_clock::now(); };
  // Runs a layer's fit off the calling thread (the server's background worker); false when it
  // cannot take it now (a later request schedules it again). Null: Choose fits on its caller's
  // thread, waiting up to the budget (the tests' and the sweep's way).
  std::function<bool(std::function<void()>)> schedule = nullptr;
  // The budget a fit reserves its synthetic inputs and its largest forward's scratch from
  // (not owned). Refused: the flop count goes on deciding, and the fit is tried again after
  // kRefitAfterRefusal. Null: nothing is reserved.
  MemoryBudget* memory = nullptr;
};

class AutoFormChooser {
 public:
  // `backend` (not owned) outlives the chooser; it is the one that serves the layers.
  AutoFormChooser(Backend* backend, AutoFormOptions options);

  // Fits `layer`'s model now unless it has one, on the calling thread.
  const FormCostModel& Calibrate(const Layer& layer);

  // The exact held form for `batch` (the request's sequences), with the model's predictions. A
  // layer is fitted on its first `auto` request (docs/service.md, "Form auto"), whether it was
  // loaded at start or later: with `schedule`, in the background while the flop count answers;
  // without, on this thread before it answers.
  ExactChoice Choose(const std::shared_ptr<const Layer>& layer, std::span<const SequenceShape> batch);

  // How long after a fit the memory budget refused the next one may be tried.
  static constexpr std::chrono::seconds kRefitAfterRefusal{10};

 private:
  struct Entry {
    std::unique_ptr<const FormCostModel> model;  // null until fitted
    bool fitting = false;                        // a fit is queued or running
    std::chrono::steady_clock::time_point retry_after{};  // its memory was refused: not before then
  };
  // The model if fitted; else schedules its fit (at most one per layer at a time) and answers null.
  const FormCostModel* FittedOrScheduled(const std::shared_ptr<const Layer>& layer);
  // Fits and stores the model, or (its memory refused) forgets the entry until retry_after.
  const FormCostModel* FitAndStore(const Layer& layer);
  // The fitted model; nothing when its memory was refused.
  std::optional<FormCostModel> Fit(const Layer& layer) const;

  Backend* const backend_;
  const AutoFormOptions options_;
  Mutex mu_;
  std::condition_variable fitted_;
  // By Layer::serial: a reloaded layer is a new entry. A model is never moved once made (it is
  // on the heap), and an entry never erased, so a reference to either stays valid.
  std::map<uint64_t, Entry> models_ ATTNSERVE_GUARDED_BY(mu_);
  const FormCostModel flop_count_ = FlopCountModel();
};

}  // namespace attnserve
