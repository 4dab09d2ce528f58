// A process's threads seen from /proc, by name: how long they have run on a CPU and whether one
// is running now. The tests that check a thread sleeps when idle (the batcher's workers, the
// compute team's helpers, a real server's) read them here.
// Thread-safety: reads /proc only; no state.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
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

// Nanoseconds the threads have run on a CPU (schedstat's first field).
inline int64_t ThreadsCpuNs(const std::vector<std::filesystem::path>& threads) {
  int64_t ns = 0;
  for (const auto& thread : threads) {
    std::ifstream schedstat(thread / "schedstat");
    int64_t on_cpu = 0;
    schedstat >> on_cpu;
    ns += on_cpu;
  }
  return ns;
}

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

}  // namespace attnserve
