// Argument parsing of attnserve-cli, kept free of I/O so the unit tests exercise it directly.
//
// Errors are returned as text naming the bad argument ("--seed: expected an unsigned integer,
// got 'x'"); the caller prints it with a usage line and exits 2.
// Thread-safety: FlagParser is a plain object (one thread at a time); the functions are pure.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "client/client.h"

namespace attnserve::cli {

// Exit statuses of the CLI.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // an RPC or I/O failed, or health is not SERVING
inline constexpr int kExitUsage = 2;    // the command line is wrong

// Parses "--name value", "--name=value" and boolean "--name" flags; everything else is
// positional. "--" ends the flags. "-h" and "--help" set *help.
class FlagParser {
 public:
  void AddString(std::string name, std::string* dst, std::string metavar, std::string help);
  void AddBool(std::string name, bool* dst, std::string help);

  // Returns false with *error set on an unknown flag or a missing value.
  bool Parse(const std::vector<std::string>& args, std::vector<std::string>* positionals,
             bool* help, std::string* error);
  // Whether Parse met flag `name` (even with an empty value).
  bool Seen(std::string_view name) const;
  // Whether `arg` is a known string flag written without "=", so the next argument is its value.
  bool TakesSeparateValue(std::string_view arg) const;
  // One line per flag, for --help.
  std::string Describe() const;

 private:
  struct Flag {
    std::string name;  // without the leading "--"
    std::string* str = nullptr;
    bool* boolean = nullptr;
    std::string metavar;
    std::string help;
  };
  const Flag* Find(std::string_view name) const;
  std::vector<Flag> flags_;
  std::vector<std::string> seen_;
};

// Value parsers. `what` names the argument in the error ("--seed").
bool ParseInt64(std::string_view text, std::string_view what, int64_t* out, std::string* error);
bool ParseUint64(std::string_view text, std::string_view what, uint64_t* out, std::string* error);
// "3,5,7": non-empty, comma-separated integers, each >= min_value.
bool ParseIntList(std::string_view text, std::string_view what, int64_t min_value,
                  std::vector<int64_t>* out, std::string* error);
// A form's short name ("summed", "auto": FormName) or "routed" (= FORM_UNSPECIFIED, the server's
// routes decide).
bool ParseForm(std::string_view text, v1::Form* out, std::string* error);
// The short name of a form ("summed" for FORM_SUMMED); "unspecified" for FORM_UNSPECIFIED.
std::string FormName(v1::Form form);
// Every attnserve.v1.Form but FORM_UNSPECIFIED, in the proto's order.
std::vector<v1::Form> KnownForms();

// The flags before the subcommand.
struct GlobalArgs {
  ClientOptions client;
  bool help = false;
  bool version = false;  // --version: print the client's version and exit
  std::string command;  // empty when none was given
  std::vector<std::string> command_args;
};
// Defaults the environment supplies; null when unset. The flags override them.
struct GlobalEnv {
  const char* target = nullptr;       // $ATTNSERVE_TARGET
  const char* admin_token = nullptr;  // $ATTNSERVE_ADMIN_TOKEN
};
bool ParseGlobalArgs(const std::vector<std::string>& args, const GlobalEnv& env, GlobalArgs* out,
                     std::string* error);
std::string GlobalFlagsHelp();

struct ForwardArgs {
  std::string layer;
  v1::Form form = v1::FORM_UNSPECIFIED;
  std::string input;            // --input x.npy
  std::vector<int64_t> random;  // --random B,N[,M]
  std::string context;          // --context c.npy
  bool causal = false;
  std::vector<int32_t> key_lengths;  // --key-lengths 3,5
  std::string output;                // --output y.npy
  bool compare = false;
  uint64_t seed = 1;
  std::string request_key;
  std::string math;  // --math bf16: one the layer is held in; empty: the route's or the default
  bool help = false;
};
bool ParseForwardArgs(const std::vector<std::string>& args, ForwardArgs* out, std::string* error);
std::string ForwardFlagsHelp();

// attnserve-cli layer NAME [--spectrum] [--plot FILE.svg] (cmd_layers.cc).
struct LayerArgs {
  std::string name;
  bool spectrum = false;  // print the per-head spectrum tables
  std::string plot;       // write the spectra as SVG to this file
  bool help = false;
};
bool ParseLayerArgs(const std::vector<std::string>& args, LayerArgs* out, std::string* error);
std::string LayerFlagsHelp();

}  // namespace attnserve::cli
