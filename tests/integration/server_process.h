// Runs the real attnserve binary as a child process on 127.0.0.1 with an ephemeral port, for
// the integration tests. The child dies with the test process (PR_SET_PDEATHSIG) and is
// stopped by the destructor, so no server outlives a test, even a failing or crashing one.
// Thread-safety: create and destroy on the test's main thread (the death signal follows the
// thread that forked); client() is thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/unit/temp_dir.h"

namespace attnserve::testing {

// The admin token the integration tests open the admin API with (`--admin-token`, at least
// 16 bytes). ServerProcess's client sends whatever token the server's args name.
inline constexpr char kTestAdminToken[] = "integration-test-admin-token";

class ServerProcess {
 public:
  // Starts `binary` with `args` plus --listen 127.0.0.1:0 and a --port-file, then waits until
  // the port is known and grpc.health.v1 answers SERVING, asked by a client made from `client`
  // (its target replaced; TLS settings kept for a TLS server). nullptr and `error` (with the
  // server's log) when it does not come up within `timeout`. `env` ("NAME=value") is added to
  // the child's environment only.
  static std::unique_ptr<ServerProcess> Start(const std::string& binary, const std::vector<std::string>& args,
                                              std::string* error,
                                              std::chrono::seconds timeout = std::chrono::seconds(60),
                                              const std::vector<std::string>& env = {},
                                              const ClientOptions& client = {});
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  // A client of this server (64 MiB messages, 60 s deadline).
  Client& client() { return *client_; }
  // Everything the server wrote to stdout and stderr so far.
  std::string Log() const;
  // Waits until the log holds `needle` (true) or `timeout` passes (false): synchronisation on
  // what the server wrote, not on a guess at how long writing it takes.
  bool WaitForLog(const std::string& needle, std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) const;

  // Sends `signal` and waits up to `timeout` for the exit; returns the exit status, 128 + the
  // signal that killed it, or -1 when it had to be killed after the timeout.
  int Stop(int signal, std::chrono::seconds timeout = std::chrono::seconds(15));

 private:
  ServerProcess() = default;

  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;  // temporary folder: port file and log
  std::unique_ptr<Client> client_;
};

// Spawns `binary args...` (dying with this process), waits at most `timeout` and returns its
// exit status (-1 when it had to be killed); `output` receives stdout and stderr.
int RunToExit(const std::string& binary, const std::vector<std::string>& args, std::string* output,
              std::chrono::seconds timeout = std::chrono::seconds(60));

// GET /metrics from a metrics port on 127.0.0.1: the body, or "" when nothing answers.
std::string ScrapeMetrics(int metrics_port);

// The value of the sample line `series` (name and labels exactly as exposed) in a scrape; -1
// when there is none.
double MetricSample(const std::string& scrape, const std::string& series);

// A server started with its metrics port known: `binary args... --metrics-port-file F`.
// `process` is null (and the test failed) when it did not come up.
struct MetricsServer {
  TempDir dir;
  std::unique_ptr<ServerProcess> process;
  int metrics_port = 0;

  MetricsServer(const std::string& binary, std::vector<std::string> args);
  Client& client() { return process->client(); }
  std::string Scrape() const { return ScrapeMetrics(metrics_port); }
  // The value of one sample line `series` (name and labels exactly as exposed); -1 if absent.
  double Sample(const std::string& series) const { return MetricSample(Scrape(), series); }
  // Waits until `series` reads `value`; its last value otherwise.
  double WaitForSample(const std::string& series, double value,
                       std::chrono::seconds timeout = std::chrono::seconds(10)) const;
};

// TempDir comes from tests/unit/temp_dir.h.

// "INVALID_ARGUMENT: message": a status as a failing test prints it.
inline std::string Describe(const grpc::Status& s) {
  return std::string(GrpcCodeName(s.error_code())) + ": " + s.error_message();
}

}  // namespace attnserve::testing
