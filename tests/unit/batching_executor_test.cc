// The batching executor over a fake backend (no math, no OpenMP, so it runs under
// ThreadSanitizer): jobs share batches, keep their own outputs, honour deadlines and
// cancellation, fail cleanly with the batch, and never mix two layers' weights.
#include "server/batching/batching_executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

namespace attnserve {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

class FakeResident final : public ResidentForm {
 public:
  explicit FakeResident(std::shared_ptr<const FormWeights> w) : w_(std::move(w)) {}
  const FormWeights& weights() const override { return *w_; }

 private:
  std::shared_ptr<const FormWeights> w_;
};

// Writes output = input · scale (the scale identifies the weights), records batch sizes.
class FakeBackend final : public Backend {
 public:
  std::string DeviceName() const override { return "cpu"; }
  StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> f) override {
    return std::shared_ptr<const ResidentForm>(std::make_shared<FakeResident>(std::move(f)));
  }
  Status Forward(const ResidentForm& form, std::span<const Sequence> batch) override {
    ++entered;
    std::this_thread::sleep_for(delay);
    {
      std::lock_guard<std::mutex> lock(mu);
      batch_sizes.push_back(static_cast<int>(batch.size()));
      int64_t rows = 0;  // what the batch holds: queries, and the rows of every separate context
      for (const Sequence& s : batch) rows += s.n() + (s.self_attention() ? 0 : s.m());
      batch_rows.push_back(rows);
      scales_seen.push_back(form.weights().config.scale);
    }
    if (fail) return InternalError("device fault");
    for (const Sequence& s : batch) {
      for (int64_t r = 0; r < s.n(); ++r)
        for (int64_t c = 0; c < s.input.cols; ++c) s.output.at(r, c) = s.input.at(r, c) * form.weights().config.scale;
    }
    return OkStatus();
  }
  std::atomic<int> entered{0};  // Forward calls begun: a test waits on this, not on a sleep
  std::mutex mu;
  std::vector<int> batch_sizes;
  std::vector<int64_t> batch_rows;
  std::vector<float> scales_seen;
  std::atomic<bool> fail{false};
  std::chrono::milliseconds delay{2};
};

std::shared_ptr<const Layer> MakeLayer(Backend& backend, float scale) {
  static uint64_t serial = 0;
  auto layer = std::make_shared<Layer>();
  layer->name = "demo";
  layer->serial = ++serial;  // as LayerStore numbers its loads
  layer->config = *CompleteConfig({.d_model = 4, .heads = 2, .scale = scale});
  FormWeights f;
  f.config = layer->config;
  layer->forms[Form::kFactored] = *backend.Upload(std::make_shared<const FormWeights>(f));
  return layer;
}

// A job over its own buffers; `result` gets the outcome.
struct OwnedJob {
  std::vector<float> input, output;
  std::promise<std::pair<Status, JobTimings>> result;

  std::vector<float> context;

  // Cross-attention: `rows` queries over `context_rows` rows of a context of their own.
  ForwardJob MakeCross(std::shared_ptr<const Layer> layer, int rows, int context_rows, float first) {
    context.resize(context_rows * 4);
    for (size_t i = 0; i < context.size(); ++i) context[i] = first - static_cast<float>(i);
    ForwardJob job = Make(std::move(layer), rows, first);
    job.sequences[0].context = ConstMatrixView(context.data(), context_rows, 4);
    return job;
  }

  ForwardJob Make(std::shared_ptr<const Layer> layer, int rows, float first) {
    input.resize(rows * 4);
    for (size_t i = 0; i < input.size(); ++i) input[i] = first + static_cast<float>(i);
    output.assign(rows * 4, -1.0f);
    ForwardJob job;
    job.layer = std::move(layer);
    Sequence s;
    s.input = ConstMatrixView(input.data(), rows, 4);
    s.output = MatrixView(output.data(), rows, 4);
    job.sequences = {s};
    job.done = [this](Status st, JobTimings t) { result.set_value({std::move(st), t}); };
    return job;
  }
};

class CountingObserver final : public BatchObserver {
 public:
  void JobQueued(std::string_view layer, Variant) override {
    EXPECT_EQ(layer, "demo");
    ++depth;
  }
  void JobDequeued(std::string_view, Variant, double queue_seconds) override {
    EXPECT_GE(queue_seconds, 0.0);
    --depth;
  }
  void BatchStarted(std::string_view layer, Variant, int32_t n) override {
    EXPECT_EQ(layer, "demo");
    EXPECT_GT(n, 0);
    computing += n;
    started += n;
  }
  void BatchDone(const BatchReport& report) override {
    computing -= report.requests;
    EXPECT_EQ(report.device, "cpu");
    EXPECT_EQ(report.code, StatusCode::kOk);
    EXPECT_GT(report.compute_seconds, 0.0);
    batches += 1;
    requests += report.requests;
    tokens += report.tokens;
  }
  std::atomic<int> depth{0}, batches{0}, requests{0}, computing{0}, started{0};
  std::atomic<int64_t> tokens{0};
};

TEST(BatchingExecutorTest, ConcurrentJobsShareBatchesAndKeepTheirOutputs) {
  FakeBackend backend;
  CountingObserver observer;
  auto layer = MakeLayer(backend, 2.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 8, .max_batch_tokens = 1000, .max_queue_delay = 5ms},
                            &observer);
  constexpr int kJobs = 40;
  std::vector<OwnedJob> jobs(kJobs);
  std::vector<std::thread> senders;
  for (int t = 0; t < 4; ++t) {
    senders.emplace_back([&, t] {
      for (int j = t; j < kJobs; j += 4) executor.Submit(jobs[j].Make(layer, 1 + j % 3, 100.0f * j));
    });
  }
  for (auto& s : senders) s.join();
  int max_batch = 0;
  for (int j = 0; j < kJobs; ++j) {
    auto [status, timings] = jobs[j].result.get_future().get();
    ASSERT_TRUE(status.ok()) << status.ToString();
    for (size_t i = 0; i < jobs[j].input.size(); ++i) ASSERT_EQ(jobs[j].output[i], 2.0f * jobs[j].input[i]);
    EXPECT_GE(timings.queue_us, 0);
    EXPECT_GE(timings.compute_us, 2000) << "the fake backend takes 2 ms per batch";
    // The backend call's own moments, which the service's stage timeline reads.
    EXPECT_EQ(std::chrono::duration_cast<std::chrono::microseconds>(timings.compute_end - timings.compute_start).count(),
              timings.compute_us);
    EXPECT_GT(timings.compute_start.time_since_epoch().count(), 0);
    max_batch = std::max(max_batch, timings.batch_requests);
  }
  EXPECT_GT(max_batch, 1) << "40 jobs from 4 threads against a 2 ms backend must share batches";
  EXPECT_EQ(observer.requests.load(), kJobs);
  int64_t want_tokens = 0;
  for (int j = 0; j < kJobs; ++j) want_tokens += 1 + j % 3;
  EXPECT_EQ(observer.tokens.load(), want_tokens);
  EXPECT_EQ(observer.depth.load(), 0) << "every queued job left the queue once";
  EXPECT_EQ(observer.started.load(), kJobs) << "every job was in exactly one backend call";
  EXPECT_EQ(observer.computing.load(), 0) << "every call that started ended";
}

// Waits until the backend has begun `n` Forward calls.
bool WaitEntered(const FakeBackend& backend, int n) {
  const auto give_up = Clock::now() + 10s;
  while (backend.entered.load() < n && Clock::now() < give_up) std::this_thread::yield();
  return backend.entered.load() >= n;
}

// A cross-attention request costs its context's rows too (their keys and values are projected
// and attended): a batch of them keeps to max_batch_tokens counting n + m each. Counting only
// the queries would pack six requests of 2 + 40 rows into one "12-token" batch of 252 rows.
TEST(BatchingExecutorTest, CrossAttentionBatchesCountTheirContextRows) {
  FakeBackend backend;
  backend.delay = 30ms;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 16, .max_batch_tokens = 100, .max_queue_delay = 0ms});
  OwnedJob blocker;
  executor.Submit(blocker.Make(layer, 1, 0));  // holds the worker while the others queue
  ASSERT_TRUE(WaitEntered(backend, 1)) << "the worker never took the blocker";
  std::vector<OwnedJob> jobs(6);
  for (int j = 0; j < 6; ++j) executor.Submit(jobs[j].MakeCross(layer, 2, 40, 10.0f * j));
  for (auto& j : jobs) {
    auto [status, timings] = j.result.get_future().get();
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_LE(timings.batch_requests, 2) << "2 requests of 42 rows fill a 100-token batch";
    EXPECT_EQ(j.output[0], j.input[0]);
  }
  std::lock_guard<std::mutex> lock(backend.mu);
  ASSERT_EQ(backend.batch_rows.size(), 4u) << "the blocker, then three batches of two";
  for (size_t b = 1; b < backend.batch_rows.size(); ++b) {
    EXPECT_LE(backend.batch_rows[b], 100) << "batch " << b << " holds " << backend.batch_rows[b] << " rows";
    EXPECT_EQ(backend.batch_sizes[b], 2);
  }
}

// While the backend computes a job, the observer counts it as computing (attnserve_computing_requests),
// and not once the call has ended.
TEST(BatchingExecutorTest, AJobInABackendCallCountsAsComputingUntilItEnds) {
  FakeBackend backend;
  backend.delay = 300ms;
  CountingObserver observer;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 0ms},
                            &observer);
  OwnedJob job;
  executor.Submit(job.Make(layer, 2, 1.0f));
  ASSERT_TRUE(WaitEntered(backend, 1));
  EXPECT_EQ(observer.computing.load(), 1) << "the call is under way for another 300 ms";
  EXPECT_EQ(observer.depth.load(), 0) << "a job in a call has left the queue";
  auto future = job.result.get_future();
  ASSERT_EQ(future.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(future.get().first.ok());
  EXPECT_EQ(observer.computing.load(), 0);
}

// The queue time reported (the job's queue_us and the observer's seconds, which feed
// attnserve_queue_duration_seconds) covers the time the job was held behind a busy worker: here
// at least the 60 ms the blocker still had when the job came, measured by this test's clock.
TEST(BatchingExecutorTest, QueueTimeCoversAKnownHold) {
  struct QueueObserver final : public BatchObserver {
    void JobQueued(std::string_view, Variant) override {}
    void JobDequeued(std::string_view, Variant, double queue_seconds) override {
      std::lock_guard<std::mutex> lock(mu);
      seconds.push_back(queue_seconds);
    }
    void BatchStarted(std::string_view, Variant, int32_t) override {}
    void BatchDone(const BatchReport&) override {}
    std::mutex mu;
    std::vector<double> seconds;
  } observer;
  FakeBackend backend;
  backend.delay = 60ms;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 1, .max_batch_tokens = 1000, .max_queue_delay = 0ms},
                            &observer);
  OwnedJob blocker, held;
  const Clock::time_point blocker_sent = Clock::now();
  executor.Submit(blocker.Make(layer, 1, 0));
  ASSERT_TRUE(WaitEntered(backend, 1)) << "the worker never took the blocker";
  ForwardJob job = held.Make(layer, 1, 5);
  const Clock::time_point sent = Clock::now();
  job.enqueued = sent;
  executor.Submit(std::move(job));
  auto [status, timings] = held.result.get_future().get();
  ASSERT_TRUE(status.ok()) << status.ToString();
  // The hold, by this test's clock: from the job's submission to the worker taking it, which
  // cannot come before the blocker's 60 ms ended.
  const double hold = std::chrono::duration<double>(timings.compute_start - sent).count();
  const double blocker_left = 0.060 - std::chrono::duration<double>(sent - blocker_sent).count();
  EXPECT_GE(hold, blocker_left);
  EXPECT_NEAR(timings.queue_us * 1e-6, hold, 1e-3);
  std::lock_guard<std::mutex> lock(observer.mu);
  ASSERT_EQ(observer.seconds.size(), 2u) << "the blocker and the held job each left the queue once";
  EXPECT_NEAR(observer.seconds[1], hold, 1e-3) << "attnserve_queue_duration_seconds' observation";
  EXPECT_GE(observer.seconds[1], blocker_left - 1e-3);
}

TEST(BatchingExecutorTest, DeadlineAndCancelDropBeforeCompute) {
  FakeBackend backend;
  backend.delay = 50ms;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 1, .max_batch_tokens = 1000, .max_queue_delay = 1ms});
  OwnedJob blocker, late, cancelled;
  executor.Submit(blocker.Make(layer, 1, 0));  // occupies the worker for 50 ms
  const auto give_up = Clock::now() + 10s;
  while (backend.entered.load() == 0 && Clock::now() < give_up) std::this_thread::yield();
  ASSERT_EQ(backend.entered.load(), 1) << "the worker never took the blocker";
  ForwardJob late_job = late.Make(layer, 1, 0);
  late_job.deadline = Clock::now() + 5ms;
  executor.Submit(std::move(late_job));
  ForwardJob cancelled_job = cancelled.Make(layer, 1, 0);
  cancelled_job.cancelled = [] { return true; };
  executor.Submit(std::move(cancelled_job));
  EXPECT_TRUE(blocker.result.get_future().get().first.ok());
  EXPECT_EQ(late.result.get_future().get().first.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.result.get_future().get().first.code(), StatusCode::kCancelled);
  std::lock_guard<std::mutex> lock(backend.mu);
  EXPECT_EQ(backend.batch_sizes, std::vector<int>{1}) << "dropped jobs never reach the backend";
}

TEST(BatchingExecutorTest, FailedBatchFailsEachJobWithTheReason) {
  FakeBackend backend;
  backend.fail = true;
  backend.delay = 20ms;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 10ms});
  std::vector<OwnedJob> jobs(4);
  for (auto& j : jobs) executor.Submit(j.Make(layer, 1, 0));
  for (auto& j : jobs) {
    Status st = j.result.get_future().get().first;
    EXPECT_EQ(st.code(), StatusCode::kInternal);
    EXPECT_THAT(st.message(), HasSubstr("device fault"));
  }
  backend.fail = false;
  OwnedJob after;
  executor.Submit(after.Make(layer, 1, 0));
  EXPECT_TRUE(after.result.get_future().get().first.ok()) << "the worker goes on after a failed batch";
}

TEST(BatchingExecutorTest, ReplacedLayerNeverSharesABatchWithItsSuccessor) {
  FakeBackend backend;
  backend.delay = 20ms;
  auto old_layer = MakeLayer(backend, 2.0f), new_layer = MakeLayer(backend, 3.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 16, .max_batch_tokens = 1000, .max_queue_delay = 20ms});
  std::vector<OwnedJob> jobs(8);
  for (int j = 0; j < 8; ++j) executor.Submit(jobs[j].Make(j % 2 ? new_layer : old_layer, 1, 1.0f));
  for (int j = 0; j < 8; ++j) {
    ASSERT_TRUE(jobs[j].result.get_future().get().first.ok());
    EXPECT_EQ(jobs[j].output[0], j % 2 ? 3.0f : 2.0f) << "job " << j << " ran on the wrong weights";
  }
}

TEST(BatchingExecutorTest, MissingFormAndDrain) {
  FakeBackend backend;
  auto layer = MakeLayer(backend, 1.0f);
  BatchingExecutor executor(&backend, {.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 1ms});
  OwnedJob summed;
  ForwardJob job = summed.Make(layer, 1, 0);
  job.form = Form::kSummed;
  executor.Submit(std::move(job));
  EXPECT_EQ(summed.result.get_future().get().first.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(executor.Drain(1s), 0);
  OwnedJob refused;
  executor.Submit(refused.Make(layer, 1, 0));
  EXPECT_EQ(refused.result.get_future().get().first.code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
