// AutoFormChooser: what `auto` (FORM_AUTO, a route's "auto") resolves to for one request: the
// exact form the cost model (server/core/form_cost.h) predicts cheaper on this backend for the
// request's shapes. Each layer's model is fitted once per load from a short calibration: timed
// synthetic forwards of its factored and summed forms on the backend that serves it, within a
// time budget (docs/architecture.md, "Choosing a form by cost"). A layer calibrated with no
// budget, or whose calibration failed, uses the flop count (FlopCountModel).
// Thread-safety: every method may be called from any thread at once. A layer's calibration runs
// once: a second caller for the same layer waits for it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>

#include "server/backend/backend.h"
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
};

class AutoFormChooser {
 public:
  // `backend` (not owned) outlives the chooser; it is the one that serves the layers.
  AutoFormChooser(Backend* backend, AutoFormOptions options);

  // Fits `layer`'s model now unless it has one. The server calls it through Choose, so a layer
  // is calibrated by its first `auto` request, on that request's thread (docs/service.md, "Form
  // auto"), whether it was loaded at start or later.
  const FormCostModel& Calibrate(const Layer& layer);

  // The exact held form for `batch` (the request's sequences), with the model's predictions.
  ExactChoice Choose(const Layer& layer, std::span<const SequenceShape> batch);

 private:
  FormCostModel Fit(const Layer& layer) const;

  Backend* const backend_;
  const AutoFormOptions options_;
  Mutex mu_;
  std::condition_variable fitted_;
  // By Layer::serial: a reloaded layer is a new entry. A model is never moved once made (it is
  // on the heap), so a reference to it stays valid.
  std::map<uint64_t, std::unique_ptr<const FormCostModel>> models_ ATTNSERVE_GUARDED_BY(mu_);  // null: being fitted
};

}  // namespace attnserve
