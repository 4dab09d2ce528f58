// The attnserve binary's settings table (settings_table.cc): one row per flag and YAML key,
// which server_options.cc's flag parser, YAML reader, range checks, usage text and docs list all
// read, so a setting is added in one place (and in docs/service.md, which a test holds to it).
// A row's value lands in a member of ServerOptions or in a field of a component's options struct
// it holds (At<...>), typed: enums are parsed here, once.
// Internal to the server_options target; everyone else calls server_options.h.
// Thread-safety: an immutable table.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>

#include "server/core/status.h"
#include "server/server_options.h"

namespace attnserve {

// The field at a path of members from ServerOptions down, e.g.
// &At<&ServerOptions::backend, &BackendOptions::cuda, &CudaBackendOptions::staging_threads>.
// clang-format off (it would write the fold as `.*....*`)
template <auto... kPath>
auto* At(ServerOptions* o) {
  return &((*o) .* ... .* kPath);
}
// clang-format on

// A 64-bit count given in units of 2^shift (bytes given in MiB: 20; a plain count: 0); the row's
// range is in those units.
struct Scaled {
  int64_t* (*at)(ServerOptions*);
  int shift;
};
// A duration given in microseconds.
struct Micros {
  std::chrono::microseconds* (*at)(ServerOptions*);
};
// An enum, parsed into its typed field by `set` (whose errors name `what`); the usage text and
// the docs show `shown_default` as its default (what the field's default means, e.g. "auto").
struct Choice {
  Status (*set)(const std::string& what, const std::string& text, ServerOptions* o);
  std::string_view shown_default;
};

// One row: the flag, the YAML key, where it lands, its range and its help.
struct Setting {
  std::string_view flag;     // "--listen"; empty: YAML only
  std::string_view key;      // "listen"; empty: flag only
  std::string_view metavar;  // what the value is; empty: a boolean flag
  std::variant<std::monostate, std::string ServerOptions::*, int ServerOptions::*, bool ServerOptions::*,
               double ServerOptions::*, std::string* (*)(ServerOptions*), int* (*)(ServerOptions*),
               bool* (*)(ServerOptions*), Scaled, Micros, Choice>
      member;
  int64_t min = 0, max = 0;  // integers, scaled counts (in their unit) and durations
  // Checks a string value (strings), or takes one entry of a repeatable setting (member empty).
  Status (*check)(const std::string& what, const std::string& value) = nullptr;
  Status (*add)(const std::string& what, const std::string& value, ServerOptions* o) = nullptr;
  std::string_view help;
  bool secret = false;  // its value never appears in an error or the log
};

std::span<const Setting> Settings();

}  // namespace attnserve
