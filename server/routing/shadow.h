// ShadowRunner: mirrors served requests to another form off the request path, and measures how
// far the mirror's output lies from the one the client got (docs/architecture.md §3, step 6).
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
#include "server/core/forms.h"
#include "server/core/sequence.h"
#include "server/routing/routing_observer.h"
#include "server/store/layer_store.h"

namespace attnserve {

// An owned copy of one request and of its served output: the request's own bytes are gone
// once the client has its answer.
struct ShadowRequest {
  std::shared_ptr<const Layer> layer;
  Form served = Form::kFactored;
  Form mirror = Form::kSummed;
  int64_t batch = 0, n = 0, d_model = 0;
  int64_t m = 0;               // context rows; 0: self-attention
  std::vector<float> input;    // [batch, n, d_model]
  std::vector<float> context;  // [batch, m, d_model] or empty
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty or one per batch row
  std::vector<float> served_output;  // [batch, n, d_model]

  // What a copy of a request of this size holds: input, context and two outputs.
  static int64_t BytesFor(int64_t batch, int64_t n, int64_t m, int64_t d_model);
  // One sequence per batch row, viewing this object's memory and writing into `output`.
  std::vector<Sequence> Sequences(float* output) const;
};

struct ShadowOptions {
  int queue_capacity = 16;                    // mirrors waiting at most
  int64_t max_queue_bytes = int64_t{256} << 20;  // their copies' bytes at most (in flight included)
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
  };
  void Work();
  void Run(Task& task);

  Executor* const executor_;
  const ShadowOptions options_;
  RoutingObserver* const observer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;  // guarded by mu_
  int reserved_ = 0;        // guarded by mu_: accepted, still being copied, or running
  int64_t bytes_ = 0;       // guarded by mu_: bytes of every accepted mirror not yet finished
  bool stopping_ = false;   // guarded by mu_
  std::thread worker_;
};

}  // namespace attnserve
