// BatchObserver: what an executor reports about its queue and its backend calls, so that
// metrics (server/metrics) can record queue time, compute time, batch sizes and FLOPs without
// batching depending on Prometheus. Header-only; an executor without an observer reports
// nothing.
// Thread-safety: an implementation must accept calls from any thread at once (Submit threads
// and compute threads); calls must be cheap and must not block, since JobQueued may run under
// the executor's queue lock.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "server/core/forms.h"
#include "server/core/math.h"
#include "server/core/status.h"

namespace attnserve {

// One backend call (a batch of one or more jobs of the same layer and variant).
struct BatchReport {
  std::string_view layer;
  Variant variant;             // the form and the math it ran in
  std::string_view device;     // the layer's device ("cpu", "cuda:0")
  int32_t requests = 0;        // jobs in the call
  int64_t tokens = 0;          // query rows over all sequences of the call
  double flops = 0;            // ForwardFlops of the call's sequences
  double compute_seconds = 0;  // the backend call's wall time
  StatusCode code = StatusCode::kOk;
  int64_t backend_retained_bytes = 0;  // Backend::RetainedScratchBytes after the call
  // The call's inputs / compute / outputs split on a device with memory of its own (this
  // worker's call, Backend::ThisThreadsDeviceTimes, in seconds); nullopt on the CPU or when it failed.
  struct DeviceSeconds {
    double inputs = 0, compute = 0, outputs = 0;
  };
  std::optional<DeviceSeconds> device_seconds{};  // `{}`: designated initializers may leave it out
};

class BatchObserver {
 public:
  virtual ~BatchObserver() = default;
  // A job entered the queue of (layer, variant).
  virtual void JobQueued(std::string_view layer, Variant variant) = 0;
  // A job left that queue (taken into a batch, or dropped) after `queue_seconds` there.
  virtual void JobDequeued(std::string_view layer, Variant variant, double queue_seconds) = 0;
  // A backend call of `requests` jobs of (layer, variant) started; its BatchDone follows,
  // whatever the call does. Queued (JobQueued − JobDequeued) plus computing is the layer's
  // in-flight work.
  virtual void BatchStarted(std::string_view layer, Variant variant, int32_t requests) = 0;
  // A backend call ended, well or not. FLOPs count only when code is kOk.
  virtual void BatchDone(const BatchReport& report) = 0;
};

}  // namespace attnserve
