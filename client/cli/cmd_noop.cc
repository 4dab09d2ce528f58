// attnserve-cli noop-server [--port-file FILE] [--duration T]: the bench's no-op server on its
// own, for another client to measure the same floor (gRPC, loopback, the client) that
// `bench --noop-server` measures for this one (bench/serving_overhead.sh).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <ostream>
#include <thread>

#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/commands.h"

namespace attnserve::cli {

int RunNoopServer(CommandContext& ctx, const std::vector<std::string>& args) {
  FlagParser flags;
  std::string port_file, duration_text = "60s";
  flags.AddString("port-file", &port_file, "FILE", "also write the bound port to FILE once listening");
  flags.AddString("duration", &duration_text, "T", "serve this long, then exit 0 (default 60s; e.g. 500ms, 10m)");
  std::vector<std::string> positionals;
  bool help = false;
  std::string error;
  if (!flags.Parse(args, &positionals, &help, &error)) return ctx.UsageError("noop-server", error);
  if (!positionals.empty()) return ctx.UsageError("noop-server", "unexpected argument '" + positionals[0] + "'");
  std::chrono::nanoseconds duration{};
  if (!ParseDuration(duration_text, "--duration", &duration, &error)) return ctx.UsageError("noop-server", error);

  std::unique_ptr<NoopServer> server = NoopServer::Start(/*d_model=*/0, &error);
  if (!server) {
    ctx.err() << "error: " << error << "\n";
    return kExitFailure;
  }
  const std::string target = server->target();
  if (!port_file.empty()) {
    // Written whole, then renamed: a reader never sees half a number.
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << target.substr(target.rfind(':') + 1) << "\n";
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      ctx.err() << "error: cannot write the port file '" << port_file << "'\n";
      return kExitFailure;
    }
  }
  ctx.out() << "listening on " << target << "\n" << std::flush;
  std::this_thread::sleep_for(duration);
  return kExitOk;
}

}  // namespace attnserve::cli
