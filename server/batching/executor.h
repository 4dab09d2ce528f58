// Executor: where Forward work runs, off gRPC's threads. gRPC threads receive, validate and
// Submit; compute threads only compute. The implementation is the dynamic batcher
// (batching_executor.h); tests may supply their own.
// Thread-safety: Submit may be called from any thread; `done` runs exactly once, on a compute
// thread, or on the submitting thread when the job is refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

// Where a job's time went, as ForwardResponse reports it.
struct JobTimings {
  int64_t queue_us = 0;        // from `enqueued` until a compute thread took the job
  int64_t compute_us = 0;      // the backend call that computed it
  int32_t batch_requests = 0;  // requests in that backend call
  // When that backend call started and ended (unset when the job never reached one): the
  // service's stage timeline (attnserve_stage_seconds).
  std::chrono::steady_clock::time_point compute_start;
  std::chrono::steady_clock::time_point compute_end;
};

struct ForwardJob {
  // Held for the whole job: an unload or replace never frees weights in use.
  std::shared_ptr<const Layer> layer;
  Form form = Form::kFactored;
  // The math the form runs in; nullopt: the layer's default (Layer::default_math).
  std::optional<Math> math;
  // Views over memory the submitter keeps alive until `done` has run (the request's bytes,
  // the response's output buffer).
  std::vector<Sequence> sequences;
  std::function<void(Status, JobTimings)> done;
  // Set by the submitter when the request arrived; Submit fills it when left at its default.
  std::chrono::steady_clock::time_point enqueued;
  // The client's deadline (max: none) and a probe of its cancellation: a job whose deadline
  // passed or whose client went away is dropped before compute.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<bool()> cancelled;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Takes the job; calls job.done exactly once with the outcome. Never throws.
  virtual void Submit(ForwardJob job) = 0;
};

}  // namespace attnserve
