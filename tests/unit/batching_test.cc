// The batching executor (server/batching/batching_executor.h) with the real CPU backend against
// the float64 reference, its bounded queue, its timings and its drain; the divergence measure against hand-computed values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/batching/divergence.h"
#include "server/batching/batching_executor.h"
#include "server/core/reference.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  CpuBackend backend{CpuBackendOptions{.threads = 1}};
  LayerWeights weights;
  std::shared_ptr<const Layer> layer;

  explicit Fixture(bool summed = true) {
    LayerConfig c;
    c.d_model = 16;
    c.heads = 4;
    weights = RandomLayerWeights(*CompleteConfig(c), 7);
    auto l = std::make_shared<Layer>();
    l->name = "t";
    l->config = weights.config;
    l->device = "cpu";
    l->forms[Form::kFactored] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(weights)));
    if (summed) {
      l->forms[Form::kSummed] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeSummed(weights)));
    }
    layer = std::move(l);
  }
};

// Submits one job over `seq` and waits for its completion.
std::pair<Status, JobTimings> RunOne(Executor& executor, std::shared_ptr<const Layer> layer, Form form,
                                     testing::OwnedSequence& seq) {
  std::promise<std::pair<Status, JobTimings>> done;
  ForwardJob job;
  job.layer = std::move(layer);
  job.form = form;
  job.sequences = {seq.View()};
  job.done = [&done](Status s, JobTimings t) { done.set_value({std::move(s), t}); };
  executor.Submit(std::move(job));
  return done.get_future().get();
}

TEST(ExecutorTest, RunsEachFormAgainstTheReference) {
  Fixture f;
  BatchingExecutor executor(&f.backend, {.max_batch_requests = 8, .max_queue_requests = 8});
  std::mt19937_64 rng(testing::TestSeed());
  for (Form form : {Form::kFactored, Form::kSummed}) {
    testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 5, 7, /*cross=*/true, /*causal=*/false, 6);
    auto [status, timings] = RunOne(executor, f.layer, form, seq);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_LT(testing::RelativeL2(seq.output.data(), ReferenceForward(f.weights, seq.View())), 1e-5) << FormName(form);
    EXPECT_EQ(timings.batch_requests, 1);
    EXPECT_GE(timings.queue_us, 0);
    EXPECT_GE(timings.compute_us, 0);
  }
}

TEST(ExecutorTest, FormNotHeldIsAFailedPrecondition) {
  Fixture f(/*summed=*/false);
  BatchingExecutor executor(&f.backend, {});
  std::mt19937_64 rng(1);
  testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 3, 3, false, false, -1);
  auto [status, timings] = RunOne(executor, f.layer, Form::kSummed, seq);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("summed"));
}

TEST(ExecutorTest, BadSequenceIsTheBackendsError) {
  Fixture f;
  BatchingExecutor executor(&f.backend, {});
  std::mt19937_64 rng(1);
  testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 3, 3, false, false, -1);
  seq.key_length = 9;
  auto [status, timings] = RunOne(executor, f.layer, Form::kFactored, seq);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
}

TEST(ExecutorTest, FullQueueAnswersResourceExhaustedAtOnce) {
  Fixture f;
  BatchingExecutor executor(&f.backend, {.max_batch_requests = 1, .max_queue_requests = 2});
  std::mt19937_64 rng(1);
  std::vector<testing::OwnedSequence> seqs;
  for (int i = 0; i < 4; ++i) seqs.push_back(testing::RandomSequence(rng, 16, 3, 3, false, false, -1));

  // The first job's completion blocks the only compute thread until released.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, first_running = false;
  std::atomic<int> ok_count{0};
  std::vector<Status> refused;
  auto submit = [&](size_t i, bool blocker) {
    ForwardJob job;
    job.layer = f.layer;
    job.sequences = {seqs[i].View()};
    job.done = [&, blocker](Status s, JobTimings) {
      if (s.ok()) ++ok_count;
      if (!s.ok()) refused.push_back(s);
      if (blocker) {
        std::unique_lock<std::mutex> lock(mu);
        first_running = true;
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
      }
    };
    executor.Submit(std::move(job));
  };
  submit(0, true);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return first_running; });
  }
  submit(1, false);
  submit(2, false);
  EXPECT_EQ(executor.QueueDepth(), 2);
  submit(3, false);  // refused synchronously: done ran on this thread
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused[0].message(), HasSubstr("is full (2 requests waiting, limit --max-queue-requests=2)"));
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  executor.Drain(std::chrono::seconds(10));  // runs what is queued, then joins
  EXPECT_EQ(ok_count.load(), 3);
}

TEST(ExecutorTest, QueueTimeIsMeasuredFromEnqueued) {
  Fixture f;
  BatchingExecutor executor(&f.backend, {});
  std::mt19937_64 rng(1);
  testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 3, 3, false, false, -1);
  std::promise<JobTimings> done;
  ForwardJob job;
  job.layer = f.layer;
  job.sequences = {seq.View()};
  job.enqueued = std::chrono::steady_clock::now() - std::chrono::milliseconds(50);
  job.done = [&done](Status, JobTimings t) { done.set_value(t); };
  executor.Submit(std::move(job));
  EXPECT_GE(done.get_future().get().queue_us, 50000);
}

TEST(ExecutorTest, AfterShutdownJobsAreRefusedAsUnavailable) {
  Fixture f;
  BatchingExecutor executor(&f.backend, {});
  executor.Drain(std::chrono::seconds(1));
  executor.Drain(std::chrono::seconds(1));  // a second call does nothing
  std::mt19937_64 rng(1);
  testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 3, 3, false, false, -1);
  auto [status, timings] = RunOne(executor, f.layer, Form::kFactored, seq);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
}

TEST(ExecutorTest, LayerOutlivesItsStoreEntry) {
  // A job holds the layer: dropping every other reference while it waits frees nothing.
  Fixture f;
  BatchingExecutor executor(&f.backend, {});
  std::weak_ptr<const Layer> weak = f.layer;
  std::mt19937_64 rng(1);
  testing::OwnedSequence seq = testing::RandomSequence(rng, 16, 4, 4, false, true, -1);
  std::promise<Status> done;
  ForwardJob job;
  job.layer = std::move(f.layer);
  job.sequences = {seq.View()};
  job.done = [&done](Status s, JobTimings) { done.set_value(std::move(s)); };
  executor.Submit(std::move(job));
  EXPECT_TRUE(done.get_future().get().ok());
  executor.Drain(std::chrono::seconds(1));
  EXPECT_TRUE(weak.expired()) << "the job must release the layer once done";
  EXPECT_LT(testing::RelativeL2(seq.output.data(), ReferenceForward(f.weights, seq.View())), 1e-5);
}

TEST(DivergenceTest, HandComputed) {
  const std::vector<float> served = {3, 4, 0};
  const std::vector<float> other = {3, 4.5f, -1};
  const DivergenceStats d = MeasureDivergence(served, other);
  EXPECT_DOUBLE_EQ(d.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(d.rel_l2, std::sqrt(0.25 + 1.0) / 5.0);
  const DivergenceStats same = MeasureDivergence(served, served);
  EXPECT_EQ(same.max_abs, 0);
  EXPECT_EQ(same.rel_l2, 0);
  const std::vector<float> zeros = {0, 0, 0};
  EXPECT_EQ(MeasureDivergence(zeros, zeros).rel_l2, 0);
  EXPECT_EQ(MeasureDivergence(zeros, served).rel_l2, std::numeric_limits<double>::infinity());
}

// A NaN or an infinity on either side lies infinitely far from anything, itself included:
// compare and shadows must never read it as agreement (a NaN difference compares false, so a
// plain max skips it and a NaN sum is no number to report).
TEST(DivergenceTest, NonFiniteValuesAreInfinitelyFar) {
  const double inf = std::numeric_limits<double>::infinity();
  const float bad_values[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  const std::vector<float> finite = {1, 2, 3, 4};
  for (float bad : bad_values) {
    std::vector<float> with_bad = finite;
    with_bad[2] = bad;
    for (const auto& [served, other] : {std::pair{finite, with_bad}, std::pair{with_bad, finite},
                                        std::pair{with_bad, with_bad}}) {
      const DivergenceStats d = MeasureDivergence(served, other);
      EXPECT_EQ(d.max_abs, inf) << "bad value " << bad << " served[2]=" << served[2] << " other[2]=" << other[2];
      EXPECT_EQ(d.rel_l2, inf) << "bad value " << bad << " served[2]=" << served[2] << " other[2]=" << other[2];
    }
  }
}

}  // namespace
}  // namespace attnserve
