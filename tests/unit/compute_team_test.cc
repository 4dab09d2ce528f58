// The CPU backend's compute team (server/backend/compute_team.h): every task runs once, on
// one member at a time, its writes visible to the caller; a throwing task ends its step and
// reaches the caller; an idle team sleeps.
#include "server/backend/compute_team.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/thread_stats.h"

namespace attnserve {
namespace {

using std::chrono::microseconds;

TEST(ComputeTeamTest, EveryTaskRunsOnceOnOneMemberAtATime) {
  std::mt19937 rng(7);
  for (int size : {1, 2, 3, 4}) {
    ComputeTeam team(size, microseconds(50));
    ASSERT_EQ(team.size(), size);
    for (int step = 0; step < 200; ++step) {
      const int64_t tasks = std::uniform_int_distribution<int64_t>(0, 300)(rng);
      std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
      std::vector<std::atomic<int>> busy(static_cast<size_t>(size));
      std::atomic<int> out_of_range{0}, overlapping{0};
      team.Run(tasks, [&](int64_t task, int member) {
        if (member < 0 || member >= size) {
          ++out_of_range;
          return;
        }
        if (busy[member].fetch_add(1) != 0) ++overlapping;
        runs[task].fetch_add(1);
        busy[member].fetch_sub(1);
      });
      ASSERT_EQ(out_of_range.load(), 0) << "size " << size;
      ASSERT_EQ(overlapping.load(), 0) << "size " << size;
      for (int64_t t = 0; t < tasks; ++t) ASSERT_EQ(runs[t].load(), 1) << "size " << size << " task " << t;
    }
  }
}

// Plain (non-atomic) writes by the members are the caller's to read once Run returns: the sums
// of random rows, against the same sums on this thread.
TEST(ComputeTeamTest, TheMembersWritesAreVisibleWhenRunReturns) {
  ComputeTeam team(3, microseconds(0));
  std::mt19937 rng(11);
  std::normal_distribution<double> normal;
  for (int step = 0; step < 500; ++step) {
    const int64_t rows = 1 + step % 97, cols = 33;
    std::vector<double> x(static_cast<size_t>(rows * cols));
    for (double& v : x) v = normal(rng);
    std::vector<double> sums(static_cast<size_t>(rows), 0.0);
    team.Run(rows, [&](int64_t r, int) {
      for (int64_t c = 0; c < cols; ++c) sums[r] += x[r * cols + c];
    });
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0;
      for (int64_t c = 0; c < cols; ++c) want += x[r * cols + c];
      ASSERT_EQ(sums[r], want) << "step " << step << " row " << r;
    }
  }
}

TEST(ComputeTeamTest, ANestedRunRunsOnTheCallingThread) {
  ComputeTeam team(2, microseconds(50));
  std::atomic<int> elsewhere{0}, wrong_member{0}, inner_runs{0};
  EXPECT_FALSE(ComputeTeam::InTask());
  team.Run(8, [&](int64_t, int) {
    EXPECT_TRUE(ComputeTeam::InTask());
    const std::thread::id outer = std::this_thread::get_id();
    team.Run(5, [&](int64_t, int member) {
      if (std::this_thread::get_id() != outer) ++elsewhere;
      if (member != 0) ++wrong_member;
      ++inner_runs;
    });
  });
  EXPECT_FALSE(ComputeTeam::InTask());
  EXPECT_EQ(inner_runs.load(), 40);
  EXPECT_EQ(elsewhere.load(), 0);
  EXPECT_EQ(wrong_member.load(), 0);
}

// A task that throws (bad_alloc, in the backend) ends its step: Run rethrows it after every
// member has left, and the team runs the next step whole.
TEST(ComputeTeamTest, AThrowingTaskReachesTheCallerAndTheTeamGoesOn) {
  ComputeTeam team(3, microseconds(50));
  for (int round = 0; round < 50; ++round) {
    const int64_t bad = round % 40;
    std::atomic<int> ran{0};
    try {
      team.Run(40, [&](int64_t task, int) {
        if (task == bad) throw std::runtime_error("task " + std::to_string(task));
        ++ran;
      });
      FAIL() << "round " << round << ": Run returned, the task threw";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "task " + std::to_string(bad));
    }
    EXPECT_LT(ran.load(), 40);
    std::atomic<int> whole{0};
    team.Run(40, [&](int64_t, int) { ++whole; });
    EXPECT_EQ(whole.load(), 40) << "round " << round;
  }
}

// This process's threads named "compute": the helpers of every live team.
std::vector<std::filesystem::path> Helpers() { return NamedThreads("self", "compute"); }

// Whether `done()` holds within `limit`, polled every millisecond.
template <typename Done>
bool Within(std::chrono::milliseconds limit, Done&& done) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Whether every helper has left /proc within a second of its team's end. A joined thread's entry
// can outlive the join briefly (the kernel wakes the joiner before it reaps the thread), the
// longer when the thread was pinned to a busy CPU.
bool HelpersGone() {
  return Within(std::chrono::seconds(1), [] { return Helpers().empty(); });
}

// Between forwards the helpers sleep once their idle spin is over: they do not hold a core the
// server's other threads need. A forward's Hold wakes them to spin for its first step.
TEST(ComputeTeamTest, AnIdleTeamSleepsAndHoldWakesIt) {
  auto team = std::make_unique<ComputeTeam>(3, microseconds(200));
  std::atomic<int64_t> sum{0};
  for (int step = 0; step < 20; ++step) team->Run(64, [&](int64_t t, int) { sum += t; });
  team->Release();
  EXPECT_EQ(sum.load(), 20 * 64 * 63 / 2);
  const std::vector<std::filesystem::path> helpers = Helpers();
  ASSERT_EQ(helpers.size(), 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the idle spin is long over
  const int64_t before = ThreadsCpuNs(helpers);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t idle_ns = ThreadsCpuNs(helpers) - before;
  EXPECT_LT(idle_ns, 5'000'000) << "2 idle helpers ran " << idle_ns << " ns in 0.5 s";

  // Held, a helper spins for up to 2 ms: seen running in one of a few tries (a try whose
  // polling thread was itself descheduled that long may miss it).
  bool woke = false;
  for (int attempt = 0; attempt < 5 && !woke; ++attempt) {
    // 200 µs of idle spin, then asleep: on a loaded machine a helper may wait to run that long.
    ASSERT_TRUE(Within(std::chrono::milliseconds(500), [&] { return !SomeThreadRuns(helpers); }))
        << "attempt " << attempt << ": a helper never slept";
    team->Hold();
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    while (!woke && std::chrono::steady_clock::now() < until) woke = SomeThreadRuns(helpers);
    team->Run(2, [](int64_t, int) {});
    team->Release();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  EXPECT_TRUE(woke) << "no helper was seen awake after Hold";
  team->Hold();  // torn down while held: neither hangs nor leaves a thread
  team.reset();
  EXPECT_TRUE(HelpersGone()) << "a helper outlived its team";
}

// A helper's idle spin gives way (YieldToReadyThreads): a thread busy on the helper's core keeps
// nearly all of it, where a spin that did not yield would take half. A 10 s idle spin, so that
// the helper spins throughout; the team's end stops it.
TEST(ComputeTeamTest, AnIdleSpinGivesItsCoreToABusyThread) {
  auto team = std::make_unique<ComputeTeam>(2, std::chrono::seconds(10));
  std::atomic<int64_t> sum{0};
  team->Hold();
  team->Run(64, [&](int64_t t, int) { sum += t; });
  team->Release();
  EXPECT_EQ(sum.load(), 64 * 63 / 2);
  const std::vector<std::filesystem::path> helpers = Helpers();
  ASSERT_EQ(helpers.size(), 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(SomeThreadRuns(helpers)) << "the helper is not spinning";
  const double share = BusyShareBesideSpinner(helpers[0]);
  EXPECT_GT(share, 0.8) << "a busy thread kept " << share << " of the core it shares with a helper in its idle spin";
  team.reset();
  EXPECT_TRUE(HelpersGone()) << "a helper outlived its team";
}

// Callers on many threads, each with its own team held as a forward holds it, and steps of
// every size back to back: the hand-off's races are for ThreadSanitizer (this suite runs under
// it) to find. Each task does some work, so that the helpers do join steps.
TEST(ComputeTeamTest, ManyTeamsOnManyThreadsRunTheirStepsWhole) {
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  std::atomic<int64_t> on_helpers{0};
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&, c] {
      ComputeTeam team(2 + c % 2, microseconds(c * 20));
      team.Hold();
      for (int step = 0; step < 2000; ++step) {
        const int64_t tasks = 1 + (step * 7 + c) % 13;
        std::vector<int> hit(static_cast<size_t>(tasks), 0);
        std::vector<double> work(static_cast<size_t>(tasks), 0.0);
        team.Run(tasks, [&](int64_t t, int member) {
          ++hit[t];
          for (int i = 1; i < 500; ++i) work[t] += 1.0 / i;
          if (member != 0) ++on_helpers;
        });
        for (int h : hit) wrong += h != 1;
        for (double w : work) wrong += w < 6.0;  // the harmonic sum to 499 is 6.79
      }
      team.Release();
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(on_helpers.load(), 0) << "no task ran on a helper: the hand-off was not exercised";
}

}  // namespace
}  // namespace attnserve
