// attnserve-cli's subcommands: a table of {name, usage, run}. A new subcommand (bench, route)
// lives in its own cmd_<name>.cc, declares its Run function here and adds one row to the table
// in commands.cc.
// Thread-safety: one command runs at a time on the calling thread; the Client it uses is
// itself thread-safe, so a command may fan out calls over threads.
#pragma once

#include <grpcpp/support/status.h>

#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "client/cli/args.h"
#include "client/client.h"

namespace attnserve::cli {

// What a command gets: its streams and a client built on first use (so --help and argument
// errors never open a channel).
class CommandContext {
 public:
  CommandContext(ClientOptions options, std::ostream& out, std::ostream& err)
      : options_(std::move(options)), out_(out), err_(err) {}

  Client& client();
  const ClientOptions& options() const { return options_; }
  std::ostream& out() { return out_; }
  std::ostream& err() { return err_; }

  // Prints "error: CODE: message" and returns kExitFailure.
  int Fail(const grpc::Status& status);
  // Prints "attnserve-cli <command>: <message>" and the command's usage line; returns kExitUsage.
  int UsageError(std::string_view command, const std::string& message);

 private:
  ClientOptions options_;
  std::ostream& out_;
  std::ostream& err_;
  std::unique_ptr<Client> client_;
};

struct Subcommand {
  std::string_view name;
  std::string_view summary;  // one line, for the top-level help
  std::string_view usage;    // arguments after the name, e.g. "NAME SOURCE"
  std::string (*details)();  // flag descriptions and notes for `<name> --help`; may be null
  // `args` are the arguments after the name. "-h"/"--help" are handled before run is called.
  int (*run)(CommandContext& ctx, const std::vector<std::string>& args);
};

std::span<const Subcommand> Subcommands();
const Subcommand* FindSubcommand(std::string_view name);

// The whole CLI: `args` excludes argv[0]; `env` holds the environment's defaults. Returns the
// exit status.
int RunCli(const std::vector<std::string>& args, const GlobalEnv& env, std::ostream& out,
           std::ostream& err);

// The subcommands (cmd_*.cc).
int RunHealth(CommandContext& ctx, const std::vector<std::string>& args);
int RunLayers(CommandContext& ctx, const std::vector<std::string>& args);
int RunLayer(CommandContext& ctx, const std::vector<std::string>& args);
int RunLoad(CommandContext& ctx, const std::vector<std::string>& args);
int RunUnload(CommandContext& ctx, const std::vector<std::string>& args);
int RunForward(CommandContext& ctx, const std::vector<std::string>& args);
// cmd_bench.cc: the load generator, and its `bench --help` text.
int RunBench(CommandContext& ctx, const std::vector<std::string>& args);
std::string BenchDetails();
int RunRoute(CommandContext& ctx, const std::vector<std::string>& args);  // cmd_route.cc
// cmd_ab.cc: the A/B verdict from the fleet's metrics (docs/ab.md).
int RunAb(CommandContext& ctx, const std::vector<std::string>& args);
std::string AbDetails();
// cmd_noop.cc: the bench's no-op server alone, for other clients to measure the floor with.
int RunNoopServer(CommandContext& ctx, const std::vector<std::string>& args);

}  // namespace attnserve::cli
