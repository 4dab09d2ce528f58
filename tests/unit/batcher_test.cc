// The generic batcher alone: size, token and delay triggers, order, failures, deadlines,
// cancellation, overload and drain. No attention here; a batch is a list of numbered items.
#include "server/batching/batcher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "tests/unit/thread_stats.h"

namespace attnserve {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// Records what happens to numbered items: the batches they ran in, or how they failed.
struct Log {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int>> batches;
  std::vector<std::pair<int, Status>> failures;
  int ended = 0;
  int started = 0;  // batches the batch function has entered (before its gate)

  // Waits until `count` batches have reached the batch function: the condition the tests
  // need ("the worker holds item 0"), not a guessed sleep.
  void WaitStarted(int count) {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return started >= count; })) << "only " << started << " batches began";
  }

  void WaitEnded(int count) {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return ended >= count; })) << "only " << ended << " of " << count;
  }
};

class TestItem : public BatchItem {
 public:
  TestItem(int id, Log* log, int64_t item_tokens = 1) : id(id), log_(log) { tokens = item_tokens; }
  bool Cancelled() const override { return cancelled.load(); }
  void Fail(Status status) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->failures.emplace_back(id, std::move(status));
    ++log_->ended;
    log_->cv.notify_all();
  }
  int id;
  std::atomic<bool> cancelled{false};

 private:
  Log* log_;
};

using TestBatcher = Batcher<std::string, TestItem>;
using TestItems = TestBatcher::Items;

// A batch function that records the ids (optionally after a gate opens).
TestBatcher::RunBatch Recorder(Log* log, std::shared_future<void> gate = {}) {
  return [log, gate](const std::string&, TestItems batch) {
    {
      std::lock_guard<std::mutex> lock(log->mu);
      ++log->started;
      log->cv.notify_all();
    }
    if (gate.valid()) gate.wait();
    std::vector<int> ids;
    for (auto& item : batch) ids.push_back(item->id);
    std::lock_guard<std::mutex> lock(log->mu);
    log->batches.push_back(ids);
    log->ended += static_cast<int>(ids.size());
    log->cv.notify_all();
  };
}

TEST(BatcherTest, FullBatchGoesAtOnce) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 10s}, Recorder(&log));
  const auto start = Clock::now();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(i, &log)).ok());
  log.WaitEnded(4);
  EXPECT_LT(Clock::now() - start, 5s) << "a full batch must not wait for the 10 s delay";
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0, 1, 2, 3}}));
}

TEST(BatcherTest, TokenBudgetSplitsBatches) {
  Log log;
  std::promise<void> open;
  TestBatcher batcher({.max_batch_requests = 100, .max_batch_tokens = 10, .max_queue_delay = 10s},
                      Recorder(&log, open.get_future().share()));
  // 4 + 4 fit in 10 tokens, the third does not: the first batch is full and goes.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(i, &log, 4)).ok());
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(3, &log, 50)).ok());  // bigger than a batch: alone
  open.set_value();
  log.WaitEnded(2);
  {
    std::lock_guard<std::mutex> lock(log.mu);
    EXPECT_EQ(log.batches.front(), (std::vector<int>{0, 1}));
  }
  batcher.Drain(5s);  // the rest run at once on drain
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0, 1}, {2}, {3}}));
}

TEST(BatcherTest, DelayTriggerAndFifoOrder) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 100, .max_batch_tokens = 1000, .max_queue_delay = 30ms}, Recorder(&log));
  const auto start = Clock::now();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(i, &log)).ok());
  log.WaitEnded(5);
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, 30ms);
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0, 1, 2, 3, 4}}));
}

TEST(BatcherTest, QueuesAreSeparate) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 2, .max_batch_tokens = 1000, .max_queue_delay = 20ms}, Recorder(&log));
  ASSERT_TRUE(batcher.Enqueue("a", std::make_unique<TestItem>(1, &log)).ok());
  ASSERT_TRUE(batcher.Enqueue("b", std::make_unique<TestItem>(2, &log)).ok());
  log.WaitEnded(2);
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches.size(), 2u) << "items of different queues never share a batch";
}

// A lone item waiting out its queue delay holds up no other queue: a full batch queued after
// it, in another queue, runs at once (it once waited the whole 10 s behind the older item), and
// a drain then runs the waiting one at once too.
TEST(BatcherTest, AQueueWaitingForCompanyDoesNotHoldUpAnotherQueuesFullBatch) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 2, .max_batch_tokens = 1000, .max_queue_delay = 10s}, Recorder(&log));
  ASSERT_TRUE(batcher.Enqueue("waiting", std::make_unique<TestItem>(1, &log)).ok());
  ASSERT_TRUE(batcher.Enqueue("full", std::make_unique<TestItem>(2, &log)).ok());
  ASSERT_TRUE(batcher.Enqueue("full", std::make_unique<TestItem>(3, &log)).ok());
  const auto queued = Clock::now();
  log.WaitEnded(2);
  EXPECT_LT(Clock::now() - queued, 5s) << "the full batch waited behind the older queue's delay";
  {
    std::lock_guard<std::mutex> lock(log.mu);
    EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{2, 3}}));
  }
  const auto drained = Clock::now();
  EXPECT_EQ(batcher.Drain(30s), 0);
  EXPECT_LT(Clock::now() - drained, 5s) << "the drain waited for the queue delay";
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{2, 3}, {1}}));
}

// Once told to stop waiting for company (the server's drain, before it waits for its accepted
// calls), a lone item runs at once instead of after its 10 s delay, and later items too.
TEST(BatcherTest, StopWaitingForCompanyRunsALoneItemAtOnce) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 10s}, Recorder(&log));
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(1, &log)).ok());
  const auto stopped = Clock::now();
  batcher.StopWaitingForCompany();
  log.WaitEnded(1);
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(2, &log)).ok()) << "items are still taken";
  log.WaitEnded(2);
  EXPECT_LT(Clock::now() - stopped, 5s) << "a lone item waited for its queue delay";
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{1}, {2}}));
}

TEST(BatcherTest, FailingBatchFailsItsItemsAndWorkerGoesOn) {
  Log log;
  std::atomic<int> calls{0};
  std::vector<int> first_batch;  // written by the worker's first call, read after WaitEnded
  TestBatcher batcher({.max_batch_requests = 2, .max_batch_tokens = 1000, .max_queue_delay = 1ms},
                      [&](const std::string&, TestItems batch) {
                        if (calls++ == 0) {
                          for (auto& item : batch) first_batch.push_back(item->id);
                          for (auto& item : batch) item->Fail(InternalError("device fault in batch"));
                          return;
                        }
                        Recorder(&log)("q", std::move(batch));
                      });
  // Items 0 and 1 share the first batch or not (a 1 ms delay on a loaded machine): either way
  // the first batch's items fail with its reason, and every later item runs.
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(1, &log)).ok());
  log.WaitEnded(2);
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(2, &log)).ok());
  log.WaitEnded(3);
  std::lock_guard<std::mutex> lock(log.mu);
  ASSERT_FALSE(first_batch.empty());
  ASSERT_EQ(log.failures.size(), first_batch.size());
  for (size_t i = 0; i < first_batch.size(); ++i) {
    EXPECT_EQ(log.failures[i].first, first_batch[i]);
    EXPECT_EQ(log.failures[i].second.code(), StatusCode::kInternal);
    EXPECT_THAT(log.failures[i].second.message(), HasSubstr("device fault in batch"));
  }
  std::vector<int> ran;
  for (const auto& b : log.batches) ran.insert(ran.end(), b.begin(), b.end());
  EXPECT_EQ(ran.size() + first_batch.size(), 3u) << "every item ended exactly once";
  EXPECT_NE(std::find(ran.begin(), ran.end(), 2), ran.end()) << "the worker went on after the failed batch";
}

TEST(BatcherTest, ExpiredAndCancelledItemsNeverRun) {
  Log log;
  std::promise<void> open;
  TestBatcher batcher({.max_batch_requests = 10, .max_batch_tokens = 1000, .max_queue_delay = 1ms},
                      Recorder(&log, open.get_future().share()));
  // A first batch holds the worker while the others wait in the queue.
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitStarted(1);  // the worker holds item 0
  auto expired = std::make_unique<TestItem>(1, &log);
  expired->deadline = Clock::now() + 5ms;
  const Clock::time_point expiry = expired->deadline;
  auto cancelled = std::make_unique<TestItem>(2, &log);
  TestItem* cancel_me = cancelled.get();
  ASSERT_TRUE(batcher.Enqueue("q", std::move(expired)).ok());
  ASSERT_TRUE(batcher.Enqueue("q", std::move(cancelled)).ok());
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(3, &log)).ok());
  cancel_me->cancelled = true;
  std::this_thread::sleep_until(expiry + 1ms);  // item 1's deadline has passed: a clock condition
  open.set_value();
  log.WaitEnded(4);
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0}, {3}}));
  ASSERT_EQ(log.failures.size(), 2u);
  for (const auto& [id, status] : log.failures) {
    EXPECT_EQ(status.code(), id == 1 ? StatusCode::kDeadlineExceeded : StatusCode::kCancelled) << id;
  }
}

// gRPC's cancellation probe turns true when a call's deadline passes too: such an item ended
// by its deadline is DEADLINE_EXCEEDED, not CANCELLED (the metrics count them apart).
TEST(BatcherTest, AnExpiredItemThatAlsoReadsCancelledIsADeadline) {
  Log log;
  std::promise<void> open;
  TestBatcher batcher({.max_batch_requests = 10, .max_batch_tokens = 1000, .max_queue_delay = 1ms},
                      Recorder(&log, open.get_future().share()));
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitStarted(1);  // the worker holds item 0
  auto expired = std::make_unique<TestItem>(1, &log);
  expired->deadline = Clock::now() + 5ms;
  const Clock::time_point expiry = expired->deadline;
  TestItem* expire_me = expired.get();
  ASSERT_TRUE(batcher.Enqueue("q", std::move(expired)).ok());
  std::this_thread::sleep_until(expiry + 1ms);  // its deadline has passed: a clock condition
  expire_me->cancelled = true;  // as IsCancelled() reads once the deadline passed
  open.set_value();
  log.WaitEnded(2);
  std::lock_guard<std::mutex> lock(log.mu);
  ASSERT_EQ(log.failures.size(), 1u);
  EXPECT_EQ(log.failures[0].second.code(), StatusCode::kDeadlineExceeded) << log.failures[0].second.message();
}

// gRPC's timer may fire a little before our steady-clock copy of the deadline: a call found
// cancelled when its deadline is still a moment away (within the 2 ms slack) expired, and is
// counted so; further away, or not cancelled, it is a client's cancel or alive. The worker's
// "now" is given here, so the moment is exact, not a race with the worker.
TEST(BatcherTest, ACancelJustBeforeTheDeadlineIsTheDeadline) {
  Log log;
  TestItem item(0, &log);
  item.deadline = Clock::now() + 1h;
  item.cancelled = true;
  const Status near = DeadItemStatus(item, item.deadline - std::chrono::microseconds(1500));
  EXPECT_EQ(near.code(), StatusCode::kDeadlineExceeded) << near.message();
  const Status far = DeadItemStatus(item, item.deadline - 3ms);
  EXPECT_EQ(far.code(), StatusCode::kCancelled) << far.message();
  EXPECT_EQ(DeadItemStatus(item, item.deadline).code(), StatusCode::kDeadlineExceeded);
  item.cancelled = false;
  EXPECT_TRUE(DeadItemStatus(item, item.deadline - std::chrono::microseconds(1500)).ok());
  EXPECT_EQ(DeadItemStatus(item, item.deadline + 1ms).code(), StatusCode::kDeadlineExceeded);
}

TEST(BatcherTest, FullQueueRefusesAtOnceAndAcceptedStillComplete) {
  Log log;
  std::promise<void> open;
  TestBatcher batcher(
      {.max_batch_requests = 1, .max_batch_tokens = 1000, .max_queue_delay = 1ms, .max_queue_requests = 2},
      Recorder(&log, open.get_future().share()));
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitStarted(1);  // the worker holds item 0
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(1, &log)).ok());
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(2, &log)).ok());
  Status refused = batcher.Enqueue("q", std::make_unique<TestItem>(3, &log));
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("queue q is full (2 requests waiting, limit --max-queue-requests=2)"));
  EXPECT_EQ(batcher.QueueDepth("q"), 2);
  open.set_value();
  log.WaitEnded(4);
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0}, {1}, {2}}));
  ASSERT_EQ(log.failures.size(), 1u);
  EXPECT_EQ(log.failures[0].first, 3);
}

// Everything sent ends as run or as an explicit error; after a drain nothing is accepted.
TEST(BatcherTest, DrainRunsWhatWasAcceptedThenRefuses) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 3, .max_batch_tokens = 1000, .max_queue_delay = 10s, .workers = 2},
                      [&](const std::string& q, TestItems batch) {
                        std::this_thread::sleep_for(2ms);
                        Recorder(&log)(q, std::move(batch));
                      });
  constexpr int kSent = 50;
  std::vector<std::thread> senders;
  std::atomic<int> refused{0};
  for (int t = 0; t < 4; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kSent / 5; ++i) {
        if (!batcher.Enqueue(t % 2 ? "a" : "b", std::make_unique<TestItem>(t * 100 + i, &log)).ok()) ++refused;
      }
    });
  }
  for (auto& s : senders) s.join();
  EXPECT_EQ(batcher.Drain(10s), 0);
  Status after = batcher.Enqueue("a", std::make_unique<TestItem>(999, &log));
  EXPECT_EQ(after.code(), StatusCode::kUnavailable);
  std::lock_guard<std::mutex> lock(log.mu);
  int ran = 0;
  for (const auto& b : log.batches) ran += static_cast<int>(b.size());
  EXPECT_EQ(ran, 40 - refused.load());
  EXPECT_EQ(log.ended, 41) << "every item ended exactly once (40 sent before the drain, 1 after)";
}

TEST(BatcherTest, DrainTimeoutFailsWhatCouldNotRun) {
  Log log;
  std::promise<void> open;
  TestBatcher batcher({.max_batch_requests = 1, .max_batch_tokens = 1000, .max_queue_delay = 1ms},
                      Recorder(&log, open.get_future().share()));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(i, &log)).ok());
  log.WaitStarted(1);  // item 0 is running (held by the gate)
  // The gate opens once the drain has failed the two it could not run, never before.
  std::thread opener([&] {
    {
      std::unique_lock<std::mutex> lock(log.mu);
      log.cv.wait_for(lock, 10s, [&] { return log.failures.size() >= 2; });
    }
    open.set_value();
  });
  EXPECT_EQ(batcher.Drain(30ms), 2);
  opener.join();
  std::lock_guard<std::mutex> lock(log.mu);
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0}}));
  ASSERT_EQ(log.failures.size(), 2u);
  EXPECT_EQ(log.failures[0].second.code(), StatusCode::kUnavailable);
  EXPECT_THAT(log.failures[0].second.message(), HasSubstr("drain timeout 30 ms"));
}

// Waits until the batch worker is spinning: its thread burns 2 ms of CPU after the moment this
// is called, which only the idle spin does (a worker asleep on its condition burns none, and a
// batch's bookkeeping takes microseconds). False after 10 s.
bool WaitUntilSpinning(const std::vector<std::filesystem::path>& worker) {
  const int64_t start = ThreadsCpuNs(worker);
  for (const auto give_up = Clock::now() + 10s; Clock::now() < give_up;) {
    if (ThreadsCpuNs(worker) - start >= 2'000'000) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// A worker spinning after a batch (BatchPolicy::idle_spin) sees what it polls for: an item
// queued during the spin runs at once, and a drain ends the spin. A spin of 10 s makes either
// miss plain: the item or the drain would wait out the spin.
TEST(BatcherTest, ASpinningWorkerTakesTheNextItemAndSeesTheDrain) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 0ms, .idle_spin = 10s},
                      Recorder(&log));
  const std::vector<std::filesystem::path> worker = NamedThreads("self", "batch-worker");
  ASSERT_EQ(worker.size(), 1u) << "no thread named batch-worker, or another batcher's";
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitEnded(1);
  ASSERT_TRUE(WaitUntilSpinning(worker)) << "the worker did not spin after its batch";
  const auto queued = Clock::now();
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(1, &log)).ok());
  log.WaitEnded(2);
  EXPECT_LT(Clock::now() - queued, 2s) << "an item queued during the spin waited for the spin to end";
  // The worker back in its spin: a drain that came first would find it still under the lock,
  // where it sees draining_ without the news, and a drain that did not end a spin would pass.
  ASSERT_TRUE(WaitUntilSpinning(worker)) << "the worker did not spin after its second batch";
  const auto drained = Clock::now();
  EXPECT_EQ(batcher.Drain(10s), 0);
  EXPECT_LT(Clock::now() - drained, 2s) << "the drain waited for the spin to end";
  EXPECT_EQ(log.batches, (std::vector<std::vector<int>>{{0}, {1}}));
}

// The spin is bounded: the worker spins once after a batch, then sleeps. Its CPU time and runs
// (from /proc: the worker thread is named "batch-worker", and this test's batcher is the only one
// alive) over a 50 ms spin and the 400 ms after it show both.
TEST(BatcherTest, AnIdleWorkerSpinsOnceThenSleeps) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 0ms, .idle_spin = 50ms},
                      Recorder(&log));
  const std::vector<std::filesystem::path> worker = NamedThreads("self", "batch-worker");
  ASSERT_EQ(worker.size(), 1u) << "no thread named batch-worker, or another batcher's";
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitEnded(1);
  const int64_t start = ThreadsCpuNs(worker), start_runs = ThreadsRuns(worker);
  std::this_thread::sleep_for(450ms);
  const int64_t spent = ThreadsCpuNs(worker) - start, runs = ThreadsRuns(worker) - start_runs;
  // A spin shows as CPU time on a quiet machine, and on a busy one (where it yields its core to
  // whatever is ready, and gets little CPU) as many short runs; a worker asleep shows neither.
  EXPECT_TRUE(spent > 5'000'000 || runs >= 10)
      << "the worker did not spin after its batch: " << spent << " ns on the CPU in " << runs << " runs";
  EXPECT_LT(spent, 200'000'000) << "the worker spun past its 50 ms: " << spent << " ns on the CPU in 450 ms";
}

// The spin gives way (YieldToReadyThreads): a thread busy on the worker's core keeps nearly all
// of it while the worker spins, where a spin that did not yield would take half. In a server
// that thread is gRPC's, sending the answer and taking the next request.
TEST(BatcherTest, AnIdleWorkerGivesItsCoreToABusyThread) {
  Log log;
  TestBatcher batcher({.max_batch_requests = 4, .max_batch_tokens = 1000, .max_queue_delay = 0ms, .idle_spin = 10s},
                      Recorder(&log));
  const std::vector<std::filesystem::path> worker = NamedThreads("self", "batch-worker");
  ASSERT_EQ(worker.size(), 1u) << "no thread named batch-worker, or another batcher's";
  ASSERT_TRUE(batcher.Enqueue("q", std::make_unique<TestItem>(0, &log)).ok());
  log.WaitEnded(1);
  ASSERT_TRUE(WaitUntilSpinning(worker)) << "the worker did not spin after its batch";  // for 10 s
  const double share = BusyShareBesideSpinner(worker[0]);
  EXPECT_GT(share, 0.8) << "a busy thread kept " << share << " of the core it shares with a spinning worker";
  EXPECT_EQ(batcher.Drain(10s), 0);
}

}  // namespace
}  // namespace attnserve
