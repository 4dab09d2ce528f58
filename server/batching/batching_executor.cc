#include "server/batching/batching_executor.h"

#include <cstdio>
#include <exception>
#include <new>
#include <utility>
#include <vector>

namespace attnserve {
namespace {

int64_t Micros(Clock::duration d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); }

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

ForwardItem::ForwardItem(ForwardJob job, BatchObserver* observer) : job_(std::move(job)), observer_(observer) {
  enqueued = job_.enqueued;
  deadline = job_.deadline;
  tokens = 0;
  for (const Sequence& s : job_.sequences) tokens += s.n() + (s.self_attention() ? 0 : s.m());
}

bool ForwardItem::Cancelled() const { return job_.cancelled && job_.cancelled(); }

void ForwardItem::OnQueued() {
  queued_ = true;
  if (observer_ != nullptr) observer_->JobQueued(job_.layer->name, variant());
}

void ForwardItem::Dequeue(Clock::time_point when) {
  if (queued_ && observer_ != nullptr) observer_->JobDequeued(job_.layer->name, variant(), Seconds(when - enqueued));
  queued_ = false;
}

void ForwardItem::Fail(Status status) {
  const Clock::time_point now = Clock::now();
  Dequeue(now);
  JobTimings timings;
  timings.queue_us = Micros(now - enqueued);
  job_.done(std::move(status), timings);
}

BatchingExecutor::BatchingExecutor(Backend* backend, BatchPolicy policy, BatchObserver* observer)
    : backend_(backend),
      observer_(observer),
      batcher_(
          policy,
          [this](const ForwardQueue& queue, std::vector<std::unique_ptr<ForwardItem>> batch) {
            RunBatch(queue, std::move(batch));
          },
          [this](const ForwardQueue& queue) { return QueueName(queue); }) {}

std::string BatchingExecutor::QueueName(const ForwardQueue& queue) const {
  // Queue names reach error messages: the load's serial number tells a replaced layer's queue
  // from its successor's, where an address would say nothing.
  return queue.layer->name + "/" + std::string(FormName(queue.variant.form)) + "@" +
         std::string(MathName(queue.variant.math)) + "/" + backend_->DeviceName() + "#" +
         std::to_string(queue.layer->serial);
}

void BatchingExecutor::Submit(ForwardJob job) {
  if (job.enqueued == Clock::time_point()) job.enqueued = Clock::now();
  if (job.layer && !job.math) job.math = job.layer->default_math();
  if (!job.layer || job.layer->Find(Variant{job.form, *job.math}) == nullptr) {
    job.done(FailedPreconditionError("layer does not hold the " + std::string(FormName(job.form)) + " form" +
                                     (job.math ? " in " + std::string(MathName(*job.math)) : std::string())),
             JobTimings{});
    return;
  }
  const ForwardQueue queue{job.layer.get(), {job.form, *job.math}};
  // Enqueue ends the item itself when it refuses (full queue, draining): nothing more to do.
  (void)batcher_.Enqueue(queue, std::make_unique<ForwardItem>(std::move(job), observer_));
}

void BatchingExecutor::RunBatch(const ForwardQueue& queue, std::vector<std::unique_ptr<ForwardItem>> batch) {
  std::vector<Sequence> sequences;
  std::vector<SequenceShape> shapes;
  for (auto& item : batch) {
    for (const Sequence& s : item->job().sequences) {
      sequences.push_back(s);
      shapes.push_back({.n = s.n(), .m = s.m(), .keys = s.visible_keys()});
    }
  }
  const Layer& layer = *queue.layer;
  const ResidentForm& form = *layer.Find(queue.variant);
  const Clock::time_point start = Clock::now();
  for (auto& item : batch) item->Dequeue(start);
  if (observer_ != nullptr) observer_->BatchStarted(layer.name, queue.variant, static_cast<int32_t>(batch.size()));
  Status status;
  // No exception may escape a worker thread; the backend's only expected one is bad_alloc.
  try {
    status = backend_->Forward(form, sequences);
  } catch (const std::bad_alloc&) {
    status = ResourceExhaustedError("out of memory while computing a batch of " + std::to_string(batch.size()) +
                                    " requests");
  } catch (const std::exception& e) {
    status = InternalError(std::string("backend failed: ") + e.what());
  }
  const Clock::time_point end = Clock::now();
  if (!status.ok() && batch.size() > 1) {
    status = Status(status.code(), "batch of " + std::to_string(batch.size()) + " requests failed: " + status.message());
  }
  if (observer_ != nullptr) {
    const std::string device = backend_->DeviceName();
    BatchReport report;
    report.layer = layer.name;
    report.variant = queue.variant;
    report.device = device;
    report.requests = static_cast<int32_t>(batch.size());
    for (const SequenceShape& s : shapes) report.tokens += s.n;
    report.flops = status.ok() ? backend_->Flops(form.weights(), shapes) : 0.0;
    report.compute_seconds = Seconds(end - start);
    report.code = status.code();
    report.backend_retained_bytes = backend_->RetainedScratchBytes();
    if (const auto times = status.ok() ? backend_->ThisThreadsDeviceTimes() : std::nullopt) {
      report.device_seconds = BatchReport::DeviceSeconds{
          .inputs = times->inputs_ms / 1e3, .compute = times->compute_ms / 1e3, .outputs = times->outputs_ms / 1e3};
    }
    observer_->BatchDone(report);
  }
  for (auto& item : batch) {
    ForwardJob& job = item->job();
    JobTimings timings;
    timings.queue_us = Micros(start - job.enqueued);
    timings.compute_us = Micros(end - start);
    timings.batch_requests = static_cast<int32_t>(batch.size());
    timings.compute_start = start;
    timings.compute_end = end;
    job.done(status, timings);
  }
}

}  // namespace attnserve
