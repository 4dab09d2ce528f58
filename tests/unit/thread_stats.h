// A process's threads seen from /proc, by name: how long they have run on a CPU and whether one
// is running now. The tests that check a thread sleeps when idle (the batcher's workers, the
// compute team's helpers, a real server's), or gives way while it spins, read them here.
// Thread-safety: reads /proc only, and pins threads of this process; no state.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace attnserve {

// The /proc/PROCESS/task directories of PROCESS's threads named `name` (comm); PROCESS is a pid
// or "self".
inline std::vector<std::filesystem::path> NamedThreads(const std::string& process, const std::string& name) {
  std::vector<std::filesystem::path> threads;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + process + "/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string comm_name;
    std::getline(comm, comm_name);
    if (comm_name == name) threads.push_back(task.path());
  }
  return threads;
}

// The sum over the threads of field `field` (0-based) of their schedstat: nanoseconds on a CPU,
// nanoseconds waiting for one, times given one.
inline int64_t SchedstatSum(const std::vector<std::filesystem::path>& threads, int field) {
  int64_t sum = 0;
  for (const auto& thread : threads) {
    std::ifstream schedstat(thread / "schedstat");
    int64_t value = 0;
    for (int i = 0; i <= field; ++i) schedstat >> value;
    sum += value;
  }
  return sum;
}

// Nanoseconds the threads have run on a CPU (schedstat's first field).
inline int64_t ThreadsCpuNs(const std::vector<std::filesystem::path>& threads) { return SchedstatSum(threads, 0); }

// How many times the threads have been given a CPU (schedstat's third field): a sleeping thread
// woken once and run counts one.
inline int64_t ThreadsRuns(const std::vector<std::filesystem::path>& threads) { return SchedstatSum(threads, 2); }

// Whether one of the threads is running or runnable (state R), not asleep.
inline bool SomeThreadRuns(const std::vector<std::filesystem::path>& threads) {
  for (const auto& thread : threads) {
    std::ifstream stat(thread / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'R') return true;
  }
  return false;
}

// A busy thread's share of one core that it shares with `spinner`, a thread of this process
// (its /proc/self/task directory) spinning now: both pinned to one CPU this process may use,
// the busy thread computes for `busy_for` and the share is its CPU time over both threads'.
// About 0.5 beside a spinner that never yields (the scheduler shares a core fairly); near 1
// beside one that gives way to any thread ready to run. Other work on that CPU delays both
// alike and does not move the share. The spinner stays pinned: end it before reading anything
// timed from it.
inline double BusyShareBesideSpinner(const std::filesystem::path& spinner,
                                     std::chrono::milliseconds busy_for = std::chrono::milliseconds(300)) {
  cpu_set_t allowed, one;
  CPU_ZERO(&allowed);
  CPU_ZERO(&one);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
  int cpu = 0;
  while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed)) ++cpu;
  CPU_SET(cpu, &one);
  const pid_t spinner_tid = static_cast<pid_t>(std::stol(spinner.filename().string()));
  if (sched_setaffinity(spinner_tid, sizeof one, &one) != 0) return -1;
  std::atomic<int64_t> busy_ns{0};
  const int64_t spinner_before = ThreadsCpuNs({spinner});
  std::thread busy([&] {
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    timespec start, now;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    const auto until = std::chrono::steady_clock::now() + busy_for;
    while (std::chrono::steady_clock::now() < until) {
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
    busy_ns = (now.tv_sec - start.tv_sec) * int64_t{1'000'000'000} + (now.tv_nsec - start.tv_nsec);
  });
  busy.join();
  const int64_t spinner_ns = ThreadsCpuNs({spinner}) - spinner_before;
  return static_cast<double>(busy_ns) / static_cast<double>(busy_ns + spinner_ns);
}

}  // namespace attnserve
