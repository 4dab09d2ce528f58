// attnserve: flags and config → Server (server/server.h), which runs until SIGTERM or SIGINT and
// drains. Parsing and the exit status only: everything the server starts lives in Server.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>

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
int EndProcess(int status) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return status;
#else
  spdlog::shutdown();
  std::cout.flush();
  std::fflush(nullptr);
  std::_Exit(status);
#endif
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
  ConfigureLogging(options);
  BlockShutdownSignals();  // before any thread exists: only the server's monitor receives them

  StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) {
    spdlog::critical("{}", server.status().message());
    return 1;
  }
  // Scripts read this line from stdout (logs go to stderr).
  std::cout << "listening on " << (*server)->listening_on() << std::endl;
  const Stopped stopped = (*server)->Run();
  if (stopped == Stopped::kLoadStillRunning) std::_Exit(0);  // destructors would wait for the load
  server->reset();  // the metrics endpoint, the layers, every thread: a slow stop shows between the log lines
  if (stopped == Stopped::kDeviceLost) {
    spdlog::critical("exiting with status {}: the device was lost (--exit-on-device-loss)", kExitDeviceLost);
  } else {
    spdlog::info("exiting");
  }
  return EndProcess(stopped == Stopped::kDeviceLost ? kExitDeviceLost : 0);
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
