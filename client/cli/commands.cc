#include "client/cli/commands.h"

#include <algorithm>
#include <array>
#include <exception>
#include <ostream>
#include <string>

#include "client/cli/args.h"
#include "client/cli/cmd_route.h"

namespace attnserve::cli {
namespace {

constexpr std::string_view kProgram = "attnserve-cli";

std::string ForwardDetails() {
  return ForwardFlagsHelp() +
         "\nExactly one of --input and --random. Prints 'key: value' lines: form, queue_us,\n"
         "decode_us, compute_us, encode_us, batch_requests, client_ms, output_shape, mean, std,\n"
         "min, max, first, and\n"
         "one 'divergence: form=F max_abs=X rel_l2=Y' line per other form with --compare.\n";
}

// The table; --help lists the commands in this order.
const std::array<Subcommand, 10>& Table() {
  static const std::array<Subcommand, 10> table = {{
      {"health", "check the server's health (grpc.health.v1)", "[SERVICE]",
       [] {
         return std::string(
             "Prints SERVING, NOT_SERVING, SERVICE_UNKNOWN (the server does not know SERVICE)\n"
             "or UNKNOWN, and exits 0 only when SERVING. SERVICE defaults to \"\", the whole\n"
             "server; e.g. attnserve.v1.AttentionService.\n");
       },
       &RunHealth},
      {"layers", "list the loaded layers", "",
       [] {
         return std::string(
             "One row per layer: NAME D_MODEL HEADS KV_HEADS D_HEAD BIAS FORMS, where FORMS lists\n"
             "form:params=P,bytes=B,device=D for each held form.\n");
       },
       &RunLayers},
      {"layer", "describe one layer", "NAME [--spectrum] [--plot FILE.svg]",
       [] {
         return LayerFlagsHelp() +
                "\nPrints 'key: value' lines, one 'form F:' line per held form and, when the layer\n"
                "holds the low-rank form, a 'lowrank:' line (selection, ranks, energy kept, parameters\n"
                "and FLOPs per token against the factored form). --spectrum adds the per-head\n"
                "spectrum tables (docs/spectra.md); --plot writes them as an SVG file.\n";
       },
       &RunLayer},
      {"load", "load a layer from a source", "NAME SOURCE",
       [] {
         return std::string(
             "SOURCE follows the grammar of docs/sources.md. Prints the loaded layer as `layer`\n"
             "does.\n");
       },
       &RunLoad},
      {"unload", "unload a layer", "NAME", nullptr, &RunUnload},
      {"forward", "run a forward pass",
       "--layer L [--form F] (--input X.npy | --random B,N[,M]) [--context C.npy] [--causal]\n"
       "       [--key-lengths L1,L2,..] [--output Y.npy] [--compare] [--seed S] [--request-key K]",
       &ForwardDetails, &RunForward},
      {"bench", "load-test a layer's forms against each other",
       "--layer L --shape B,N[,M] [--forms F1,F2] [--concurrency C1,C2,..]\n"
       "       [--duration T | --requests K] [--warmup T] [--causal] [--target ADDR]\n"
       "       [--json FILE] [--csv FILE] [--plot FILE.svg] [--interleave slice|request] [--noop-server]",
       &BenchDetails, &RunBench},
      {"noop-server", "serve the bench's no-op Forward on 127.0.0.1 (the floor, for any client)",
       "[--port-file FILE] [--duration T]",
       [] {
         return std::string(
             "Forward answers at once with the input as output (a response of the real size, no\n"
             "compute). Prints 'listening on 127.0.0.1:PORT'; exits 0 after --duration (60s).\n");
       },
       &RunNoopServer},
      {"route", "show or change the A/B split and the shadow rate",
       "[LAYER (SPEC | --clear)] [--shadow-rate R]", &RouteDetails, &RunRoute},
      {"ab", "the A/B verdict: compare a layer's forms on the fleet's metrics",
       "(--prometheus URL [--window W] | --metrics URL[,URL...] [--interval T])\n"
       "       [--layer L] [--baseline F] [--alpha A] [--power P] [--mde R] [--error-margin D]\n"
       "       [--min-requests N] [--timeout T] [--json]",
       &AbDetails, &RunAb},
  }};
  return table;
}

std::string UsageLine(const Subcommand& c) {
  std::string s = "usage: " + std::string(kProgram) + " [global flags] " + std::string(c.name);
  if (!c.usage.empty()) s += " " + std::string(c.usage);
  return s;
}

void PrintTopHelp(std::ostream& out) {
  out << "usage: " << kProgram << " [global flags] COMMAND [args]\n\n"
      << "Client of an attnserve server.\n\nGlobal flags:\n"
      << GlobalFlagsHelp() << "\nCommands:\n";
  size_t width = 0;  // the longest name, so the summaries line up
  for (const Subcommand& c : Subcommands()) width = std::max(width, c.name.size());
  for (const Subcommand& c : Subcommands()) {
    std::string name = "  " + std::string(c.name);
    name.resize(width + 4, ' ');
    out << name << c.summary << "\n";
  }
  out << "\nRun '" << kProgram << " COMMAND --help' for a command's arguments.\n"
      << "Exit status: 0 success, 1 failure (the server's status is printed), 2 usage error;\n"
      << "ab also 3 (a significant difference) and 4 (not enough data yet).\n";
}

void PrintCommandHelp(const Subcommand& c, std::ostream& out) {
  out << UsageLine(c) << "\n\n" << c.summary << "\n";
  if (c.details != nullptr) out << "\n" << c.details();
}

}  // namespace

std::span<const Subcommand> Subcommands() { return Table(); }

const Subcommand* FindSubcommand(std::string_view name) {
  for (const Subcommand& c : Subcommands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

Client& CommandContext::client() {
  if (!client_) client_ = std::make_unique<Client>(options_);
  return *client_;
}

int CommandContext::Fail(const grpc::Status& status) {
  err_ << "error: " << GrpcCodeName(status.error_code()) << ": " << status.error_message() << "\n";
  return kExitFailure;
}

int CommandContext::UsageError(std::string_view command, const std::string& message) {
  err_ << kProgram << " " << command << ": " << message << "\n";
  if (const Subcommand* c = FindSubcommand(command)) err_ << UsageLine(*c) << "\n";
  return kExitUsage;
}

int RunCli(const std::vector<std::string>& args, const GlobalEnv& env, std::ostream& out,
           std::ostream& err) {
  try {
    GlobalArgs global;
    std::string error;
    if (!ParseGlobalArgs(args, env, &global, &error)) {
      err << kProgram << ": " << error << "\n"
          << "usage: " << kProgram << " [global flags] COMMAND [args]  (see --help)\n";
      return kExitUsage;
    }
    if (global.version) {
      out << kProgram << " " << ATTNSERVE_VERSION << "\n";
      return kExitOk;
    }
    if (global.command == "help") {
      // `help COMMAND` is the same as `COMMAND --help`.
      if (global.command_args.empty()) {
        PrintTopHelp(out);
        return kExitOk;
      }
      global.command = global.command_args[0];
      global.command_args = {"--help"};
    }
    if (global.command.empty()) {
      if (global.help) {
        PrintTopHelp(out);
        return kExitOk;
      }
      err << kProgram << ": missing COMMAND\n"
          << "usage: " << kProgram << " [global flags] COMMAND [args]  (see --help)\n";
      return kExitUsage;
    }
    const Subcommand* cmd = FindSubcommand(global.command);
    if (cmd == nullptr) {
      err << kProgram << ": unknown command '" << global.command << "'\n"
          << "usage: " << kProgram << " [global flags] COMMAND [args]  (see --help)\n";
      return kExitUsage;
    }
    for (const std::string& a : global.command_args) {
      if (a == "--") break;
      if (a == "-h" || a == "--help") {
        PrintCommandHelp(*cmd, out);
        return kExitOk;
      }
    }
    if (global.help) {
      PrintCommandHelp(*cmd, out);
      return kExitOk;
    }
    CommandContext ctx(global.client, out, err);
    return cmd->run(ctx, global.command_args);
  } catch (const std::exception& e) {
    err << "error: INTERNAL: " << e.what() << "\n";
    return kExitFailure;
  }
}

}  // namespace attnserve::cli
