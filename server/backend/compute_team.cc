#include "server/backend/compute_team.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

#include "server/core/spin.h"

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kOpen = uint64_t{1} << 31;
constexpr uint64_t kMembers = kOpen - 1;

uint32_t Epoch(uint64_t state) { return static_cast<uint32_t>(state >> 32); }
bool IsOpen(uint64_t state) { return (state & kOpen) != 0; }
uint64_t MembersIn(uint64_t state) { return state & kMembers; }

// While a forward holds the team, a helper spins this long at most without a step (a long
// serial part of a forward: copying a large batch) before it sleeps.
constexpr std::chrono::microseconds kHeldSpin{2000};

thread_local bool t_in_task = false;

}  // namespace

ComputeTeam::ComputeTeam(int size, std::chrono::microseconds idle_spin)
    : size_(std::max(1, size)), idle_spin_(idle_spin) {
  for (int member = 1; member < size_; ++member) {
    helpers_.emplace_back([this, member] { Helper(member); });
    // Named here, not by the thread as it starts: "compute" in ps, top and perf from the moment
    // the team exists.
    pthread_setname_np(helpers_.back().native_handle(), "compute");
  }
}

ComputeTeam::~ComputeTeam() {
  stop_.store(true, std::memory_order_seq_cst);
  { MutexLock lock(sleep_mu_); }  // a helper about to sleep sees stop_ or gets the notify
  wake_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

bool ComputeTeam::InTask() { return t_in_task; }

void ComputeTeam::Hold() {
  held_.store(true, std::memory_order_relaxed);
  holds_.fetch_add(1, std::memory_order_seq_cst);
  WakeSleepers();
}

void ComputeTeam::Release() { held_.store(false, std::memory_order_relaxed); }

void ComputeTeam::WakeSleepers() {
  // seq_cst on both sides (here after the store that wakes, there before the check that
  // sleeps): either this load sees the sleeper, or the sleeper's check sees the store.
  if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
  { MutexLock lock(sleep_mu_); }
  wake_.notify_all();
}

void ComputeTeam::RunTasks(int64_t tasks, Call call, void* body) {
  if (tasks <= 0) return;
  if (size_ == 1 || tasks == 1 || t_in_task) {
    struct InTaskScope {
      const bool before = t_in_task;
      InTaskScope() { t_in_task = true; }
      ~InTaskScope() { t_in_task = before; }
    } scope;
    for (int64_t t = 0; t < tasks; ++t) call(body, t, 0);
    return;
  }
  // No helper is in a step now (the last Run waited for them all to leave): the fields are ours.
  call_ = call;
  body_ = body;
  tasks_ = tasks;
  next_.store(0, std::memory_order_relaxed);
  const uint64_t epoch = Epoch(state_.load(std::memory_order_relaxed)) + uint64_t{1};
  state_.store(((epoch & 0xffffffffu) << 32) | kOpen, std::memory_order_seq_cst);
  WakeSleepers();
  Work(0);
  // Every task is taken: nobody joins any more; wait for those still running theirs.
  state_.fetch_and(~kOpen, std::memory_order_acq_rel);
  // Spin, never yield: a yield hands this core to whatever gRPC thread is ready, for its whole
  // slice, while the step waits only for a member finishing its last task.
  while (MembersIn(state_.load(std::memory_order_acquire)) != 0) CpuRelax();
  std::exception_ptr error;
  {
    MutexLock lock(error_mu_);
    error = std::exchange(error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void ComputeTeam::Work(int member) {
  t_in_task = true;
  try {
    for (int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < tasks_;) call_(body_, t, member);
  } catch (...) {
    // The step ends here: no task after it is started, and Run rethrows this once every
    // member has left (a body that throws, bad_alloc, must not unwind past a running step).
    next_.store(tasks_, std::memory_order_relaxed);
    MutexLock lock(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
  t_in_task = false;
}

void ComputeTeam::Helper(int member) {
  uint32_t seen = 0;
  for (;;) {
    WaitForStep(seen);
    if (stop_.load(std::memory_order_relaxed)) return;
    uint64_t state = state_.load(std::memory_order_acquire);
    seen = Epoch(state);
    bool joined = false;
    while (IsOpen(state) && Epoch(state) == seen) {
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        joined = true;
        break;
      }
    }
    if (!joined) continue;  // closed before this helper came: the caller ran it
    Work(member);
    state_.fetch_sub(1, std::memory_order_release);
  }
}

void ComputeTeam::WaitForStep(uint32_t seen) {
  auto stepped = [&] {
    return Epoch(state_.load(std::memory_order_seq_cst)) != seen || stop_.load(std::memory_order_seq_cst);
  };
  for (;;) {
    const uint32_t holds = holds_.load(std::memory_order_seq_cst);
    const Clock::time_point since = Clock::now();
    for (int spins = 1;; ++spins) {
      if (stepped()) return;
      CpuRelax();
      if (spins % kPollsPerTurn == 0) {
        // Between a forward's steps the next is this team's: spin on. Once it is over, give way
        // to gRPC's threads, which have its answer to send and the next request to take.
        const bool held = held_.load(std::memory_order_relaxed);
        if (!held) YieldToReadyThreads();
        if (Clock::now() - since >= (held ? kHeldSpin : idle_spin_)) break;
      }
    }
    MutexLock lock(sleep_mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lock.native(), [&] { return stepped() || holds_.load(std::memory_order_seq_cst) != holds; });
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    // A step returns at the spin's first check; a forward's Hold spins again.
  }
}

}  // namespace attnserve
