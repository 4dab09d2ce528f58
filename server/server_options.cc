#include "server/server_options.h"

#include <yaml-cpp/yaml.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string_view>
#include <variant>

#include "server/settings_table.h"

namespace attnserve {
namespace {

constexpr size_t kMinAdminTokenBytes = 16;

template <typename Int>
Status CheckInt(const std::string& what, const std::string& text, int64_t min, int64_t max, Int* out) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || p != end || v < min || v > max) {
    return InvalidArgumentError(what + ": expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                                "], got '" + text + "'");
  }
  *out = v;
  return OkStatus();
}

Status CheckBool(const std::string& what, const std::string& text, bool* out) {
  if (text == "true" || text == "1" || text == "yes") {
    *out = true;
  } else if (text == "false" || text == "0" || text == "no") {
    *out = false;
  } else {
    return InvalidArgumentError(what + ": expected true or false, got '" + text + "'");
  }
  return OkStatus();
}

Status CheckFraction(const std::string& what, const std::string& text, double* out) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || !(v >= 0 && v <= 1)) {
    return InvalidArgumentError(what + ": expected a fraction in [0, 1], got '" + text + "'");
  }
  *out = v;
  return OkStatus();
}


const Setting* FindFlag(std::string_view flag) {
  if (flag == "-h") flag = "--help";
  for (const Setting& s : Settings()) {
    if (s.flag == flag) return &s;
  }
  return nullptr;
}

const Setting* FindKey(std::string_view key) {
  for (const Setting& s : Settings()) {
    if (!s.key.empty() && s.key == key) return &s;
  }
  return nullptr;
}

// Sets one value of `setting` from text; `what` names the flag or key in errors.
Status Apply(const Setting& setting, const std::string& what, const std::string& text, ServerOptions* o) {
  if (setting.add != nullptr) return setting.add(what, text, o);
  if (setting.check != nullptr) ATTNSERVE_RETURN_IF_ERROR(setting.check(what, text));
  const auto& m = setting.member;
  if (auto* s = std::get_if<std::string ServerOptions::*>(&m)) {
    o->**s = text;
    return OkStatus();
  }
  if (auto* s = std::get_if<std::string* (*)(ServerOptions*)>(&m)) {
    *(*s)(o) = text;
    return OkStatus();
  }
  if (auto* i = std::get_if<int ServerOptions::*>(&m)) return CheckInt(what, text, setting.min, setting.max, &(o->**i));
  if (auto* i = std::get_if<int* (*)(ServerOptions*)>(&m)) return CheckInt(what, text, setting.min, setting.max, (*i)(o));
  if (auto* b = std::get_if<bool ServerOptions::*>(&m)) return CheckBool(what, text, &(o->**b));
  if (auto* b = std::get_if<bool* (*)(ServerOptions*)>(&m)) return CheckBool(what, text, (*b)(o));
  if (auto* d = std::get_if<double ServerOptions::*>(&m)) return CheckFraction(what, text, &(o->**d));
  if (auto* bytes = std::get_if<Scaled>(&m)) {
    int64_t units = 0;
    ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, text, setting.min, setting.max, &units));
    *bytes->at(o) = units << bytes->shift;
    return OkStatus();
  }
  if (auto* us = std::get_if<Micros>(&m)) {
    int64_t micros = 0;
    ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, text, setting.min, setting.max, &micros));
    *us->at(o) = std::chrono::microseconds(micros);
    return OkStatus();
  }
  if (auto* choice = std::get_if<Choice>(&m)) return choice->set(what, text, o);
  return InternalError(what + ": setting has no destination");
}

// A setting's value in `o` as its flag takes it ("" for repeatable settings).
std::string ValueText(const Setting& s, ServerOptions& o) {
  const auto& m = s.member;
  if (auto* str = std::get_if<std::string ServerOptions::*>(&m)) return o.**str;
  if (auto* str = std::get_if<std::string* (*)(ServerOptions*)>(&m)) return *(*str)(&o);
  if (auto* i = std::get_if<int ServerOptions::*>(&m)) return std::to_string(o.**i);
  if (auto* i = std::get_if<int* (*)(ServerOptions*)>(&m)) return std::to_string(*(*i)(&o));
  if (auto* b = std::get_if<bool ServerOptions::*>(&m)) return o.**b ? "true" : "false";
  if (auto* b = std::get_if<bool* (*)(ServerOptions*)>(&m)) return *(*b)(&o) ? "true" : "false";
  if (auto* bytes = std::get_if<Scaled>(&m)) return std::to_string(*bytes->at(&o) >> bytes->shift);
  if (auto* us = std::get_if<Micros>(&m)) return std::to_string(us->at(&o)->count());
  if (auto* choice = std::get_if<Choice>(&m)) return std::string(choice->shown_default);
  if (auto* d = std::get_if<double ServerOptions::*>(&m)) {
    std::string text = std::to_string(o.**d);
    text.erase(text.find_last_not_of('0') + 1);
    if (text.back() == '.') text.pop_back();
    return text;
  }
  return "";
}

std::string KnownKeys() {
  std::string keys;
  for (const Setting& s : Settings()) {
    if (!s.key.empty()) keys += (keys.empty() ? "" : ", ") + std::string(s.key);
  }
  return keys;
}

// A literal loopback address: 127.0.0.0/8 or ::1, parsed as an address. A name that only starts
// like one ("127.example.com") resolves wherever its owner points it.
bool IsLoopbackLiteral(const std::string& host) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

// "localhost" binds wherever the resolver says: loopback only when every address it gives is.
bool ResolvesToLoopbackOnly(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      loopback &= (ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      loopback &= IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr) != 0;
    } else {
      loopback = false;
    }
  }
  freeaddrinfo(found);
  return loopback;
}

}  // namespace

bool IsLoopbackHost(std::string_view host_view) {
  const std::string host(host_view);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {  // brackets hold IPv6 only
    in6_addr v6{};
    return inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
  }
  if (IsLoopbackLiteral(host)) return true;
  return host == "localhost" && ResolvesToLoopbackOnly(host);
}

namespace {

// What must hold across settings, wherever they came from.
Status CheckCombinations(const ServerOptions& o) {
  if (!o.admin_token.empty() && o.admin_token.size() < kMinAdminTokenBytes) {
    // The token itself is never echoed.
    return InvalidArgumentError("admin_token: expected at least " + std::to_string(kMinAdminTokenBytes) +
                                " bytes, got " + std::to_string(o.admin_token.size()) +
                                " (e.g. openssl rand -hex 32)");
  }
  if (!o.admin_listen.empty() && o.admin_token.empty()) {
    const std::string_view host = std::string_view(o.admin_listen).substr(0, o.admin_listen.rfind(':'));
    if (!IsLoopbackHost(host)) {
      return InvalidArgumentError("admin_listen: without an admin token the admin listener must bind a loopback "
                                  "address (127.0.0.1:PORT or [::1]:PORT), got '" + o.admin_listen +
                                  "'; set --admin-token to open it to the network");
    }
  }
  if (!o.routes_file.empty() && !o.routes.empty()) {
    return InvalidArgumentError("routes_file, routes: expected one or the other, got both (--routes-file '" +
                                o.routes_file + "' and " + std::to_string(o.routes.size()) +
                                " route(s) from --route or the config's routes:); put every route in the file");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return InvalidArgumentError("tls_cert, tls_key: expected both or neither, got only " +
                                std::string(o.tls_cert.empty() ? "tls_key" : "tls_cert"));
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return InvalidArgumentError("tls_client_ca: mTLS needs the server's own certificate too (--tls-cert, --tls-key)");
  }
  return OkStatus();
}

// "  --flag METAVAR   help (default X)", wrapped at 100 columns.
std::string UsageLine(const Setting& s, ServerOptions& defaults) {
  std::string head = "  " + std::string(s.flag) + (s.metavar.empty() ? "" : " " + std::string(s.metavar));
  std::string help(s.help);
  // Booleans are off unless given; their default goes without saying.
  const std::string def = s.metavar.empty() ? "" : ValueText(s, defaults);
  if (!def.empty() && !s.secret) help += " (default " + def + ")";
  constexpr size_t kHelpColumn = 34, kWidth = 100;
  std::string out = head;
  out += head.size() + 1 < kHelpColumn ? std::string(kHelpColumn - head.size(), ' ') : "\n" + std::string(kHelpColumn, ' ');
  size_t column = kHelpColumn;
  std::istringstream words(help);
  std::string word;
  bool first = true;
  while (words >> word) {
    if (!first && column + 1 + word.size() > kWidth) {
      out += "\n" + std::string(kHelpColumn, ' ');
      column = kHelpColumn;
    } else if (!first) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
    first = false;
  }
  return out + "\n";
}

}  // namespace

StatusOr<std::pair<std::string, std::string>> ParseLayerFlag(const std::string& value) {
  const size_t eq = value.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == value.size()) {
    return InvalidArgumentError("--layer: expected NAME=SOURCE (e.g. demo=random:d_model=64,heads=4), got '" + value +
                                "'");
  }
  return std::make_pair(value.substr(0, eq), value.substr(eq + 1));
}

// Settings that existed once, with what replaces them: a deployment that still sets one learns
// why it went rather than that it is unknown.
struct RemovedSetting {
  std::string_view flag, key, why;
};
constexpr RemovedSetting kRemovedSettings[] = {
    {"--max-scores-mb", "max_scores_mb",
     "removed: attention no longer holds a sequence's n*m scores (memory is linear in the sequence length); bound "
     "a request's work with --max-scores-m (max_scores_m), in millions of scores"},
    {"--omp-spin-count", "omp_spin_count",
     "removed: the CPU backend no longer runs on OpenMP's threads but on its own, which sleep after a forward once "
     "--cpu-idle-spin-us (cpu_idle_spin_us) is over"},
};

std::string UnknownSetting(const std::string& flag) {
  for (const RemovedSetting& r : kRemovedSettings) {
    if (r.flag == flag) return flag + ": " + std::string(r.why);
  }
  return "unknown flag '" + flag + "' (see --help)";
}

std::string UnknownKey(const std::string& key) {
  for (const RemovedSetting& r : kRemovedSettings) {
    if (r.key == key) return std::string(r.why);
  }
  return "unknown key (expected " + KnownKeys() + ")";
}

Status ApplyYamlConfig(const std::string& yaml_text, const std::string& origin, ServerOptions* o) {
  try {
    const YAML::Node root = YAML::Load(yaml_text);
    if (root.IsNull()) return OkStatus();
    if (!root.IsMap()) return InvalidArgumentError(origin + ": expected a mapping of settings at the top level");
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const YAML::Node& v = kv.second;
      const std::string what = origin + ": " + key;
      const Setting* setting = FindKey(key);
      // A misspelt key silently ignored would leave a setting at its default.
      if (setting == nullptr) return InvalidArgumentError(what + ": " + UnknownKey(key));
      if (setting->add != nullptr && v.IsMap()) {
        // layers {NAME: SOURCE}, routes {LAYER: SPEC}
        for (const auto& entry : v) {
          ATTNSERVE_RETURN_IF_ERROR(
              setting->add(what, entry.first.as<std::string>() + "=" + entry.second.as<std::string>(), o));
        }
        continue;
      }
      if (setting->add != nullptr && setting->metavar.find('=') != std::string_view::npos) {
        return InvalidArgumentError(what + ": expected a mapping " +
                                    (key == "layers" ? std::string("NAME: SOURCE") : std::string("LAYER: FORM:WEIGHT,... (LAYER may be '*')")));
      }
      if (setting->add != nullptr && v.IsSequence()) {
        for (const auto& entry : v) ATTNSERVE_RETURN_IF_ERROR(setting->add(what, entry.as<std::string>(), o));
        continue;
      }
      if (!v.IsScalar()) return InvalidArgumentError(what + ": expected a single value");
      ATTNSERVE_RETURN_IF_ERROR(Apply(*setting, what, v.as<std::string>(), o));
    }
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(origin + ": not valid YAML: " + e.what());
  }
  return OkStatus();
}

StatusOr<ServerOptions> ParseServerOptions(int argc, const char* const* argv) {
  struct Flag {
    const Setting* setting;
    std::string value;
    bool has_value;
  };
  std::vector<Flag> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    Flag f{FindFlag(name), eq == std::string::npos ? "" : arg.substr(eq + 1), eq != std::string::npos};
    // Only the name: a misspelt --admin-token=SECRET must not print the secret.
    if (f.setting == nullptr) return InvalidArgumentError(UnknownSetting(name));
    const bool is_bool = f.setting->metavar.empty();
    if (!is_bool && !f.has_value) {
      if (i + 1 >= argc) return InvalidArgumentError(name + ": expected a value after it");
      f.value = argv[++i];
      f.has_value = true;
    }
    if (is_bool && !f.has_value) f.value = "true";
    flags.push_back(std::move(f));
  }

  ServerOptions o;
  if (const char* token = std::getenv("ATTNSERVE_ADMIN_TOKEN")) o.admin_token = token;
  for (const Flag& f : flags) {
    if (f.setting->flag != "--config") continue;
    o.config_file = f.value;
    std::ifstream in(f.value);
    if (!in) return InvalidArgumentError("--config: cannot read '" + f.value + "'");
    std::stringstream text;
    text << in.rdbuf();
    ATTNSERVE_RETURN_IF_ERROR(ApplyYamlConfig(text.str(), f.value, &o));
  }
  for (const Flag& f : flags) {
    if (f.setting->flag == "--config") continue;
    ATTNSERVE_RETURN_IF_ERROR(Apply(*f.setting, std::string(f.setting->flag), f.value, &o));
  }
  if (o.help || o.version) return o;
  ATTNSERVE_RETURN_IF_ERROR(CheckCombinations(o));
  if (o.layers.empty()) o.layers.emplace_back(kDemoLayerName, kDemoLayerSource);
  return o;
}

std::string UsageText() {
  ServerOptions defaults;  // not const: the accessors take a pointer
  std::string text =
      "Usage: attnserve [flags]\n"
      "Serves multi-head attention layers over gRPC (attnserve.v1.AttentionService, grpc.health.v1,\n"
      "server reflection). Flags override the --config file; docs/service.md has each setting.\n"
      "Without --layer the server serves '" +
      std::string(kDemoLayerName) + "' = " + kDemoLayerSource + ".\n\n";
  for (const Setting& s : Settings()) {
    if (!s.flag.empty()) text += UsageLine(s, defaults);
  }
  text +=
      "  -h                              the same as --help\n"
      "\n"
      "Exit status: 0 after a clean shutdown on SIGTERM or SIGINT; 1 when start-up fails (bad layer,\n"
      "address in use); 2 for bad flags or configuration.\n";
  return text;
}

std::vector<SettingDoc> SettingDocs() {
  ServerOptions defaults;  // not const: the accessors take a pointer
  std::vector<SettingDoc> docs;
  for (const Setting& s : Settings()) {
    docs.push_back({std::string(s.flag), std::string(s.key), std::string(s.metavar), std::string(s.help),
                    ValueText(s, defaults)});
  }
  return docs;
}

}  // namespace attnserve
