// attnserve: flags and config → Server (server/server.h), which runs until SIGTERM or SIGINT and
// drains. Parsing and the exit status only: everything the server starts lives in Server.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <string>

#include "server/logging.h"
#include "server/server.h"
#include "server/server_options.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// After an orderly stop everything of ours is released; what is left is the libraries' static
// teardown, and the soak saw the process end 7 s after its "exiting" line there (likely gRPC's
// shutdown, which waits up to 10 s for its I/O objects: the sockets of clients that never read
// their answers, which already held the drain to its deadline). So the process ends here, its
// logs flushed. Sanitizer builds keep the normal exit: their leak check runs in it.
int EndProcess() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return 0;
#else
  spdlog::shutdown();
  std::cout.flush();
  std::fflush(nullptr);
  std::_Exit(0);
#endif
}

// libgomp reads GOMP_SPINCOUNT once, as it loads, before main: a process sets its own spin
// count only by starting again with the variable set, which this does (execv keeps the pid, so
// a supervisor or a test harness sees one process; the binary's own path, not /proc/self/exe,
// keeps its name "attnserve" for ps, pkill and /proc/PID/status). An idle OpenMP thread spins that many times
// before it sleeps: libgomp's 300000 kept the second compute thread spinning past a lone
// request's answer, on a core gRPC needed to send it and to receive the next; with 30000 a
// 1×16×768 request was served 27–53 µs sooner at concurrency 1 on 2 cores (docs/benchmarks.md,
// "Serving overhead"). An operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone.
// Returns only when no restart is wanted, or with why the restart failed.
std::string RestartWithOmpSpinCount(const ServerOptions& options, char** argv) {
  if (options.omp_spin_count == 0 || std::getenv("GOMP_SPINCOUNT") != nullptr ||
      std::getenv("OMP_WAIT_POLICY") != nullptr) {
    return "";
  }
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof path - 1);
  if (length <= 0 || length >= static_cast<ssize_t>(sizeof path) - 1) {
    return std::string("readlink /proc/self/exe: ") + (length < 0 ? std::strerror(errno) : "no usable path");
  }
  path[length] = '\0';
  const std::string count = std::to_string(options.omp_spin_count);
  if (setenv("GOMP_SPINCOUNT", count.c_str(), 1) != 0) return std::string("setenv: ") + std::strerror(errno);
  std::cout.flush();
  std::fflush(nullptr);
  execv(path, argv);
  const std::string why = std::string("exec ") + path + ": " + std::strerror(errno);
  unsetenv("GOMP_SPINCOUNT");  // not in effect in this process: the log line below must not claim it
  return why;
}

int Run(int argc, char** argv) {
  StatusOr<ServerOptions> parsed = ParseServerOptions(argc, argv);
  if (!parsed.ok()) {
    std::cerr << "attnserve: " << parsed.status().message() << "\n";
    return 2;
  }
  const ServerOptions& options = *parsed;
  if (options.help) {
    std::cout << UsageText();
    return 0;
  }
  if (options.version) {
    std::cout << "attnserve " << ATTNSERVE_VERSION << "\n";
    return 0;
  }
  const std::string restart_failed = RestartWithOmpSpinCount(options, argv);
  ConfigureLogging(options);
  if (!restart_failed.empty()) {
    spdlog::warn("--omp-spin-count {}: could not restart with GOMP_SPINCOUNT set ({}); libgomp's own spin count "
                 "is in effect",
                 options.omp_spin_count, restart_failed);
  }
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  spdlog::info("OpenMP idle threads: GOMP_SPINCOUNT={} OMP_WAIT_POLICY={}", spin ? spin : "(libgomp's default)",
               policy ? policy : "(unset)");
  BlockShutdownSignals();  // before any thread exists: only the server's monitor receives them

  StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) {
    spdlog::critical("{}", server.status().message());
    return 1;
  }
  // Scripts read this line from stdout (logs go to stderr).
  std::cout << "listening on " << (*server)->listening_on() << std::endl;
  if ((*server)->Run() == Stopped::kLoadStillRunning) std::_Exit(0);  // destructors would wait for the load
  server->reset();  // the metrics endpoint, the layers, every thread: a slow stop shows between the log lines
  spdlog::info("exiting");
  return EndProcess();
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  try {
    return attnserve::Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "attnserve: fatal: " << e.what() << "\n";
    return 1;
  }
}
