// The server-wide memory budget (server/batching/memory_budget.h): what it admits, how it
// refuses, that every reservation comes back, and that concurrent reservations never exceed it
// (also run under ThreadSanitizer by scripts/test).
#include "server/batching/memory_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <atomic>
#include <deque>
#include <thread>
#include <vector>

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(MemoryBudgetTest, AdmitsWhatFitsAndRefusesTheRestByKind) {
  std::vector<int64_t> seen;
  MemoryBudget budget(100 << 20, "--max-memory-mb", [&](int64_t reserved) { seen.push_back(reserved); });
  auto a = budget.Reserve(60 << 20, "request a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(budget.reserved(), 60 << 20);
  // Fits the budget but not beside `a`: retryable.
  auto b = budget.Reserve(50 << 20, "request b");
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), AllOf(HasSubstr("request b"), HasSubstr("--max-memory-mb"), HasSubstr("40 MiB")));
  // Larger than the whole budget: never fits, not retryable.
  auto huge = budget.Reserve((100 << 20) + 1, "request c");
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), AllOf(HasSubstr("--max-memory-mb"), HasSubstr("more than the whole budget")));
  {
    MemoryBudget::Reservation moved = std::move(a).value();
    EXPECT_EQ(moved.bytes(), 60 << 20);
    EXPECT_EQ(budget.reserved(), 60 << 20) << "a move keeps the bytes reserved once";
  }
  EXPECT_EQ(budget.reserved(), 0) << "destroying the reservation gives it back";
  EXPECT_TRUE(budget.Reserve(100 << 20, "all of it").ok());
  EXPECT_EQ(budget.reserved(), 0);
  EXPECT_EQ(seen.back(), 0) << "the observer saw the last release";
}

TEST(MemoryBudgetTest, ConcurrentReservationsNeverExceedTheBudget) {
  constexpr int64_t kBudget = 1000;
  std::atomic<int64_t> held{0}, peak{0}, refused{0};
  MemoryBudget budget(kBudget, "--max-memory-mb");
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      // Each thread holds up to 8 reservations at once, releasing its oldest as it goes.
      std::deque<std::pair<MemoryBudget::Reservation, int64_t>> live;
      for (int i = 0; i < 4000; ++i) {
        const int64_t bytes = 1 + (t * 37 + i * 11) % 300;
        auto r = budget.Reserve(bytes, "x");
        if (!r.ok()) {
          ++refused;
        } else {
          const int64_t now = held.fetch_add(bytes) + bytes;
          int64_t p = peak.load();
          while (now > p && !peak.compare_exchange_weak(p, now)) {
          }
          live.emplace_back(std::move(r).value(), bytes);
        }
        if (live.size() > 8 || (!live.empty() && !r.ok())) {
          held.fetch_sub(live.front().second);  // before the release, so `held` never undercounts
          live.pop_front();
        }
      }
      for (auto& [reservation, bytes] : live) held.fetch_sub(bytes);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(peak.load(), kBudget);
  EXPECT_GT(refused.load(), 0) << "the budget was contended";
  EXPECT_EQ(budget.reserved(), 0);
}

// The limit that applies, read here from the files the kernel documents, without the code
// under test: the cgroup v2 memory.max, else v1's memory.limit_in_bytes ("max", and a number
// past the machine's memory such as v1's "none", limit nothing), else the machine's memory
// (/proc/meminfo's MemTotal, the sysinfo total).
int64_t LimitThatApplies() {
  const int64_t total = [] {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kb = 0;
    while (meminfo >> key >> kb) {
      if (key == "MemTotal:") return kb * 1024;
      meminfo.ignore(1 << 10, '\n');
    }
    return int64_t{0};
  }();
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max") continue;
    const int64_t limit = std::stoll(text);
    if (limit > 0 && limit < total) return limit;
  }
  return total;
}

TEST(MemoryBudgetTest, DefaultIsHalfTheLimitThatApplies) {
  const int64_t limit = LimitThatApplies();
  ASSERT_GT(limit, 0);
  EXPECT_EQ(DefaultMemoryBudgetBytes(), limit / 2) << "limit " << limit;
}

}  // namespace
}  // namespace attnserve
