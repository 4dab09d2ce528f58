// ShadowRunner: mirrors served requests to another form off the request path, and measures how
// far the mirror's output lies from the one the client got (docs/architecture.md, "Metrics and routing").
//
// The service offers a mirror after the served form has computed, just before it answers. The
// runner keeps a bounded queue (requests and bytes) served by one low-priority worker that
// submits one mirror at a time to the Executor, so shadows never fill the executor's queue
// and never delay or fail a primary; when the queue is full the mirror is dropped and counted.
// The mirror's queue and compute time land in the executor's metrics under the mirror's form;
// its divergence (max_abs, rel_l2) goes to the RoutingObserver.
// Thread-safety: Offer may be called from any thread; Shutdown from one owner thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "server/batching/executor.h"
#include "server/batching/memory_budget.h"
#include "server/core/forms.h"
#include "server/core/request.h"
#include "server/core/thread_annotations.h"
#include "server/layer/loaded_layer.h"
#include "server/routing/routing_observer.h"

namespace attnserve {

// An owned copy of one request and of its served output: the request's own bytes are gone
// once the client has its answer. `request` is a copy of the decoded request (a copy owns every
// value and keeps every field), so the mirror computes exactly what the client asked.
struct ShadowRequest {
  std::shared_ptr<const Layer> layer;
  Variant served{Form::kFactored, Math::kFp32};
  Variant mirror{Form::kSummed, Math::kFp32};  // another form, or the served form in another math
  AttentionRequest request;
  std::vector<float> served_output;  // [batch, n, d_model]

  // What a copy of `request` and its two outputs (served and mirrored) hold, in bytes.
  static int64_t BytesFor(const AttentionRequest& request);
};

struct ShadowOptions {
  int queue_capacity = 16;                    // mirrors waiting at most
  int64_t max_queue_bytes = int64_t{256} << 20;  // their copies' bytes at most (in flight included)
  // The server-wide budget each mirror also reserves its bytes from (not owned; may be null):
  // a mirror that does not fit is dropped and counted, never queued.
  MemoryBudget* budget = nullptr;
};

class ShadowRunner {
 public:
  // `executor` and `observer` (may be null) outlive the runner; call Shutdown before the
  // executor's own.
  ShadowRunner(Executor* executor, ShadowOptions options, RoutingObserver* observer);
  ~ShadowRunner();  // Shutdown()
  ShadowRunner(const ShadowRunner&) = delete;
  ShadowRunner& operator=(const ShadowRunner&) = delete;

  // Queues a mirror of a request to `layer` whose copy takes `bytes`. `make` builds the copy
  // and is called at most once, on the calling thread, only when the mirror is accepted, so a
  // dropped mirror costs no copy. Returns false when dropped (counted with the observer).
  // Never blocks on the executor; never throws.
  bool Offer(std::string_view layer, int64_t bytes, const std::function<ShadowRequest()>& make);

  // Drops what waits (counting each), lets the running mirror finish, joins the worker.
  // Later offers are dropped. Calling it again does nothing.
  void Shutdown();

  // Mirrors waiting or running now.
  int Pending() const;

 private:
  struct Task {
    ShadowRequest request;
    int64_t bytes = 0;
    MemoryBudget::Reservation reservation;  // given back when the task is done or dropped
  };
  void Work();
  void Run(Task& task);

  Executor* const executor_;
  const ShadowOptions options_;
  RoutingObserver* const observer_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_ ATTNSERVE_GUARDED_BY(mu_);
  int reserved_ ATTNSERVE_GUARDED_BY(mu_) = 0;   // accepted, still being copied, or running
  int64_t bytes_ ATTNSERVE_GUARDED_BY(mu_) = 0;  // bytes of every accepted mirror not yet finished
  bool stopping_ ATTNSERVE_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace attnserve
