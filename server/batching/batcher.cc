#include "server/batching/batcher.h"

#include <pthread.h>

namespace attnserve {
namespace {
constexpr std::chrono::milliseconds kDeadlineSlack(2);
}  // namespace

Status QueueFullError(const std::string& queue, size_t waiting, int limit) {
  return ResourceExhaustedError("queue " + queue + " is full (" + std::to_string(waiting) +
                                " requests waiting, limit --max-queue-requests=" + std::to_string(limit) +
                                "); retry with backoff");
}

Status DrainingError() { return UnavailableError("server is draining: no new requests are accepted"); }

Status DrainTimeoutError(std::chrono::milliseconds timeout) {
  return UnavailableError("server shut down before this request ran (drain timeout " + std::to_string(timeout.count()) +
                          " ms)");
}

Status DeadItemStatus(const BatchItem& item, Clock::time_point now) {
  // The deadline first: gRPC's IsCancelled (the server's probe) also turns true when the
  // call's deadline passes, and an expiry counted as a client's cancel misleads dashboards.
  // gRPC's timer and our steady-clock copy of the deadline differ by a little; a call found
  // cancelled within kDeadlineSlack of its deadline expired.
  if (now >= item.deadline || (item.deadline - now <= kDeadlineSlack && item.Cancelled())) {
    return Status(
        StatusCode::kDeadlineExceeded,
        "deadline passed while queued (" +
            std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(now - item.enqueued).count()) +
            " us in queue); the request was not run");
  }
  if (item.Cancelled()) return Status(StatusCode::kCancelled, "request cancelled by the client while queued");
  return OkStatus();
}

void NameWorker(std::thread& worker) { pthread_setname_np(worker.native_handle(), "batch-worker"); }

}  // namespace attnserve
