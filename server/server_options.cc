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

#include "server/backend/select.h"
#include "server/routing/router.h"     // ParseRouteSpec, kDefaultRoute
#include "server/store/layer_store.h"  // ValidateLayerName

namespace attnserve {
namespace {

constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
constexpr size_t kMinAdminTokenBytes = 16;

Status CheckInt(const std::string& what, const std::string& text, int64_t min, int64_t max, int* out) {
  int v = 0;
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

Status CheckLogLevel(const std::string& what, const std::string& level) {
  for (const char* l : kLogLevels) {
    if (level == l) return OkStatus();
  }
  return InvalidArgumentError(what + ": expected one of trace, debug, info, warn, error, critical, off, got '" + level +
                              "'");
}

Status CheckDevice(const std::string& what, const std::string& device) {
  Status st = ValidateDevice(device);
  return st.ok() ? st : InvalidArgumentError(what + ": " + st.message());
}

Status CheckCpuGemm(const std::string& what, const std::string& gemm) {
  Status st = ValidateCpuGemm(gemm);
  return st.ok() ? st : InvalidArgumentError(what + ": " + st.message());
}

Status CheckCpuWeightLayout(const std::string& what, const std::string& layout) {
  Status st = ValidateCpuWeightLayout(layout);
  return st.ok() ? st : InvalidArgumentError(what + ": " + st.message());
}

Status CheckGpuMath(const std::string& what, const std::string& mode) {
  if (mode == "fp32" || mode == "tf32") return OkStatus();
  return InvalidArgumentError(what + ": expected fp32 or tf32, got '" + mode + "'");
}

Status CheckAddress(const std::string& what, const std::string& address) {
  if (!address.empty()) return OkStatus();
  return InvalidArgumentError(what + ": expected HOST:PORT (e.g. 0.0.0.0:50051), got an empty string");
}

// A route LAYER → SPEC, checked where it is given so the error names the flag or key.
Status AddRoute(const std::string& what, const std::string& value, ServerOptions* o) {
  const size_t eq = value.find('=');
  if (eq == std::string::npos || eq == 0) {
    return InvalidArgumentError(what + ": expected LAYER=FORM:WEIGHT,... (LAYER may be '*'), e.g. "
                                "'*=factored:90,summed:10', got '" + value + "'");
  }
  const std::string layer = value.substr(0, eq), spec = value.substr(eq + 1);
  if (layer != kDefaultRoute) {
    Status name = ValidateLayerName(layer);
    if (!name.ok()) return InvalidArgumentError(what + ": " + name.message());
  }
  ATTNSERVE_ASSIGN_OR_RETURN(RouteSplit split, ParseRouteSpec(spec, what + " " + layer));
  for (auto& r : o->routes) {
    if (r.first == layer) {
      r.second = spec;
      return OkStatus();
    }
  }
  o->routes.emplace_back(layer, spec);
  return OkStatus();
}

Status AddLayer(const std::string& what, const std::string& value, ServerOptions* o) {
  StatusOr<std::pair<std::string, std::string>> layer = ParseLayerFlag(value);
  if (!layer.ok()) return InvalidArgumentError(what + ": " + layer.status().message());
  Status name = ValidateLayerName(layer->first);
  if (!name.ok()) return InvalidArgumentError(what + ": " + name.message());
  for (auto& l : o->layers) {
    if (l.first == layer->first) {
      l.second = std::move(layer->second);
      return OkStatus();
    }
  }
  o->layers.push_back(std::move(layer).value());
  return OkStatus();
}

Status AddModelDir(const std::string& what, const std::string& dir, ServerOptions* o) {
  if (dir.empty() || dir[0] != '/') {
    return InvalidArgumentError(what + ": expected an absolute directory path, got '" + dir + "'");
  }
  o->model_dirs.push_back(dir);
  return OkStatus();
}

// One row per setting: the flag, the YAML key, where it lands, its range and its help. The
// flag parser, the YAML reader, the range checks and the usage text all read this table, so a
// setting is added in one place (and in docs/service.md, which a test holds to this table).
struct Setting {
  std::string_view flag;     // "--listen"; empty: YAML only
  std::string_view key;      // "listen"; empty: flag only
  std::string_view metavar;  // what the value is; empty: a boolean flag
  std::variant<std::monostate, std::string ServerOptions::*, int ServerOptions::*, bool ServerOptions::*,
               double ServerOptions::*>
      member;
  int64_t min = 0, max = 0;  // integers
  // Checks a string value (strings), or takes one entry of a repeatable setting (member empty).
  Status (*check)(const std::string& what, const std::string& value) = nullptr;
  Status (*add)(const std::string& what, const std::string& value, ServerOptions* o) = nullptr;
  std::string_view help;
  bool secret = false;  // its value never appears in an error or the log
};

using O = ServerOptions;
const Setting kSettings[] = {
    {"--config", "", "FILE", &O::config_file, 0, 0, nullptr, nullptr,
     "YAML file of these settings (keys: the flag names with '_' for '-'); flags override it"},
    {"--listen", "listen", "ADDR", &O::listen, 0, 0, CheckAddress, nullptr,
     "gRPC address; port 0 picks a free port, printed as 'listening on HOST:PORT'"},
    {"--port-file", "port_file", "FILE", &O::port_file, 0, 0, nullptr, nullptr,
     "also write the bound port to FILE once listening"},
    {"--layer", "layers", "NAME=SOURCE", {}, 0, 0, nullptr, AddLayer,
     "load a layer at start-up (repeatable; YAML: a mapping NAME: SOURCE); SOURCE is random:... or "
     "safetensors:... (docs/sources.md); without any, the built-in 'demo' layer"},
    {"--device", "device", "DEV", &O::device, 0, 0, CheckDevice, nullptr,
     "auto, cpu, cuda or cuda:N (auto: a usable GPU when there is one, else the CPU); an explicit "
     "cuda without a usable GPU refuses to start"},
    {"--gpu-math", "gpu_math", "MODE", &O::gpu_math, 0, 0, CheckGpuMath, nullptr,
     "fp32 or tf32 (TF32 tensor-core GEMMs on the GPU)"},
    {"--threads", "threads", "N", &O::threads, 0, 1024, nullptr, nullptr, "CPU backend threads per Forward (0: every core)"},
    {"--cpu-idle-spin-us", "cpu_idle_spin_us", "US", &O::cpu_idle_spin_us, 0, 1000000, nullptr, nullptr,
     "microseconds the CPU backend's helper threads spin after a forward, for the next, before they sleep "
     "(0: at once; a forward wakes them as it starts)"},
    {"--cpu-gemm", "cpu_gemm", "LIB", &O::cpu_gemm, 0, 0, CheckCpuGemm, nullptr,
     "auto, eigen or onednn: the CPU backend's GEMM library (auto: oneDNN when the build has it, else Eigen)"},
    {"--cpu-weight-layout", "cpu_weight_layout", "LAYOUT", &O::cpu_weight_layout, 0, 0, CheckCpuWeightLayout, nullptr,
     "auto, packed, packed-bf16 or plain: packed keeps a copy of each layer's projection weights in panels for "
     "the CPU backend's own kernel (as many bytes again; auto: where the CPU has AVX2 and FMA), packed-bf16 the "
     "same copy rounded to bfloat16 (half the bytes, a few 1e-3 relative error), plain the row-major weights only"},
    {"--workers", "workers", "N", &O::workers, 1, 256, nullptr, nullptr, "batches computed side by side"},
    {"--worker-idle-spin-us", "worker_idle_spin_us", "US", &O::worker_idle_spin_us, 0, 1000000, nullptr, nullptr,
     "microseconds a batcher thread polls its queues after a batch, for the next request, before it sleeps "
     "(0: at once)"},
    {"--max-batch-requests", "max_batch_requests", "N", &O::max_batch_requests, 1, 4096, nullptr, nullptr,
     "requests in one batch at most (1: no batching)"},
    {"--max-batch-tokens", "max_batch_tokens", "N", &O::max_batch_tokens, 1, 1 << 24, nullptr, nullptr,
     "query + context rows in one batch at most"},
    {"--max-queue-delay-us", "max_queue_delay_us", "N", &O::max_queue_delay_us, 0, 10000000, nullptr, nullptr,
     "how long the oldest queued request waits for others (0: take what queued while the device was busy)"},
    {"--max-queue-requests", "max_queue_requests", "N", &O::max_queue_requests, 1, 1000000, nullptr, nullptr,
     "requests waiting per (layer, form) queue; beyond: RESOURCE_EXHAUSTED at once"},
    {"--drain-timeout-s", "drain_timeout_s", "N", &O::drain_timeout_s, 0, 3600, nullptr, nullptr,
     "on SIGTERM/SIGINT: NOT_SERVING, refuse new calls, give accepted ones N seconds, then exit 0"},
    {"--max-message-mb", "max_message_mb", "N", &O::max_message_mb, 1, 2047, nullptr, nullptr,
     "largest request and response in MiB"},
    {"--max-scores-m", "max_scores_m", "N", &O::max_scores_m, 1, 1 << 30, nullptr, nullptr,
     "attention scores one request may ask for, in millions: the sum over its sequences of n*m*heads (its work; "
     "memory is linear in the sequence length); beyond: RESOURCE_EXHAUSTED"},
    {"--max-memory-mb", "max_memory_mb", "N", &O::max_memory_mb, 0, 1 << 30, nullptr, nullptr,
     "memory every admitted request may hold at once (input, output, compare and shadow copies, backend scratch), "
     "in MiB; 0: half the container's memory limit, else half the machine's; beyond: RESOURCE_EXHAUSTED, or "
     "INVALID_ARGUMENT for a request that can never fit"},
    {"--max-device-memory-mb", "max_device_memory_mb", "N", &O::max_device_memory_mb, 0, 1 << 30, nullptr, nullptr,
     "device memory the GPU backend may hold (weights and workspaces), in MiB; 0: 90% of the card's; a batch "
     "beyond runs in smaller query-row blocks, or fails with RESOURCE_EXHAUSTED"},
    {"--log-level", "log_level", "LEVEL", &O::log_level, 0, 0, CheckLogLevel, nullptr,
     "trace, debug, info, warn, error, critical or off"},
    {"--log-json", "log_json", "", &O::log_json, 0, 0, nullptr, nullptr, "log one JSON object per line"},
    {"--admin-token", "admin_token", "TOKEN", &O::admin_token, 0, 0, nullptr, nullptr,
     "opens the admin API (LoadLayer, UnloadLayer, SetRouting) to callers sending 'authorization: Bearer "
     "TOKEN'; at least 16 bytes (or set ATTNSERVE_ADMIN_TOKEN, which keeps it out of ps)",
     /*secret=*/true},
    {"--admin-listen", "admin_listen", "ADDR", &O::admin_listen, 0, 0, nullptr, nullptr,
     "a second gRPC listener that also serves the admin API; without a token only on a loopback address "
     "(e.g. 127.0.0.1:50052)"},
    {"--admin-port-file", "admin_port_file", "FILE", &O::admin_port_file, 0, 0, nullptr, nullptr,
     "also write the admin listener's port to FILE"},
    {"--http-listen", "http_listen", "ADDR", &O::http_listen, 0, 0, CheckAddress, nullptr,
     "also serve the Open Inference Protocol over HTTP/REST (KServe v2) on ADDR; TLS with --tls-cert, "
     "bodies up to --max-message-mb (empty: off; docs/service.md, \"HTTP/REST\")"},
    {"--http-port-file", "http_port_file", "FILE", &O::http_port_file, 0, 0, nullptr, nullptr,
     "also write the HTTP listener's port to FILE"},
    {"--admin-queue", "admin_queue", "N", &O::admin_queue, 1, 1024, nullptr, nullptr,
     "admin calls waiting at most; beyond: RESOURCE_EXHAUSTED"},
    {"--max-layers", "max_layers", "N", &O::max_layers, 1, 100000, nullptr, nullptr,
     "layers held at most; a load beyond: RESOURCE_EXHAUSTED"},
    {"--max-layer-mb", "max_layer_mb", "N", &O::max_layer_mb, 1, 1 << 30, nullptr, nullptr,
     "weights of every held layer and form together, in MiB; a load beyond: RESOURCE_EXHAUSTED"},
    {"--model-dir", "model_dirs", "DIR", {}, 0, 0, nullptr, AddModelDir,
     "where LoadLayer over gRPC may read checkpoints (repeatable; YAML: a list); none: API loads of "
     "safetensors sources are refused"},
    {"--tls-cert", "tls_cert", "FILE", &O::tls_cert, 0, 0, nullptr, nullptr,
     "PEM certificate chain: every gRPC listener speaks TLS (with --tls-key; read at start-up)"},
    {"--tls-key", "tls_key", "FILE", &O::tls_key, 0, 0, nullptr, nullptr, "PEM private key of --tls-cert"},
    {"--tls-client-ca", "tls_client_ca", "FILE", &O::tls_client_ca, 0, 0, nullptr, nullptr,
     "PEM CA bundle: clients must present a certificate it signed (mTLS)"},
    {"--max-concurrent-streams", "max_concurrent_streams", "N", &O::max_concurrent_streams, 1, 100000, nullptr,
     nullptr, "concurrent calls per HTTP/2 connection"},
    {"--keepalive-min-ping-interval-s", "keepalive_min_ping_interval_s", "N", &O::keepalive_min_ping_interval_s, 1,
     86400, nullptr, nullptr, "client pings closer together than this are strikes"},
    {"--keepalive-max-ping-strikes", "keepalive_max_ping_strikes", "N", &O::keepalive_max_ping_strikes, 0, 1000,
     nullptr, nullptr, "strikes before the connection is closed (0: no limit)"},
    {"--max-connection-age-s", "max_connection_age_s", "N", &O::max_connection_age_s, 0, 2000000, nullptr, nullptr,
     "close connections after this long, gracefully (0: never)"},
    {"--max-connection-age-grace-s", "max_connection_age_grace_s", "N", &O::max_connection_age_grace_s, 0, 86400,
     nullptr, nullptr, "calls in flight on an aged connection get this long"},
    {"--max-metadata-kb", "max_metadata_kb", "N", &O::max_metadata_kb, 1, 1024, nullptr, nullptr,
     "request metadata (headers) at most, in KiB"},
    {"--metrics-listen", "metrics_listen", "ADDR", &O::metrics_listen, 0, 0, CheckAddress, nullptr,
     "serve Prometheus metrics at http(s)://ADDR/metrics; port 0 picks a free port (docs/metrics.md)"},
    {"--metrics-port-file", "metrics_port_file", "FILE", &O::metrics_port_file, 0, 0, nullptr, nullptr,
     "also write the metrics port to FILE once listening"},
    {"--metrics-web-config", "metrics_web_config", "FILE", &O::metrics_web_config, 0, 0, nullptr, nullptr,
     "TLS and basic auth of the metrics endpoint, in Prometheus's web.config.file format (docs/security.md)"},
    {"--route", "routes", "LAYER=SPEC", {}, 0, 0, nullptr, AddRoute,
     "split requests to LAYER that leave the form unspecified, SPEC = FORM:WEIGHT,... e.g. "
     "factored:90,summed:10; LAYER '*' = every layer without its own (repeatable; YAML: a mapping)"},
    {"--routes-file", "routes_file", "FILE", &O::routes_file, 0, 0, nullptr, nullptr,
     "YAML file 'routes: {LAYER: SPEC}' read at start and followed (inotify; reloaded on change, a bad file refused "
     "whole); the fleet's one split: excludes --route, and SetRouting may not change routes"},
    {"--shadow-rate", "shadow_rate", "R", &O::shadow_rate, 0, 0, nullptr, nullptr,
     "also run this fraction of requests by another held form, off the request path, and record the divergence"},
    {"--shadow-queue", "shadow_queue", "N", &O::shadow_queue, 1, 100000, nullptr, nullptr,
     "shadow runs waiting at most; beyond: dropped and counted"},
    {"--help", "", "", &O::help, 0, 0, nullptr, nullptr, "print this help and exit"},
    {"--version", "", "", &O::version, 0, 0, nullptr, nullptr, "print the version and exit"},
};

const Setting* FindFlag(std::string_view flag) {
  if (flag == "-h") flag = "--help";
  for (const Setting& s : kSettings) {
    if (s.flag == flag) return &s;
  }
  return nullptr;
}

const Setting* FindKey(std::string_view key) {
  for (const Setting& s : kSettings) {
    if (!s.key.empty() && s.key == key) return &s;
  }
  return nullptr;
}

// Sets one value of `setting` from text; `what` names the flag or key in errors.
Status Apply(const Setting& setting, const std::string& what, const std::string& text, ServerOptions* o) {
  if (setting.add != nullptr) return setting.add(what, text, o);
  if (auto* s = std::get_if<std::string ServerOptions::*>(&setting.member)) {
    if (setting.check != nullptr) ATTNSERVE_RETURN_IF_ERROR(setting.check(what, text));
    o->**s = text;
    return OkStatus();
  }
  if (auto* i = std::get_if<int ServerOptions::*>(&setting.member)) {
    return CheckInt(what, text, setting.min, setting.max, &(o->**i));
  }
  if (auto* b = std::get_if<bool ServerOptions::*>(&setting.member)) return CheckBool(what, text, &(o->**b));
  if (auto* d = std::get_if<double ServerOptions::*>(&setting.member)) return CheckFraction(what, text, &(o->**d));
  return InternalError(what + ": setting has no destination");
}

std::string KnownKeys() {
  std::string keys;
  for (const Setting& s : kSettings) {
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
std::string UsageLine(const Setting& s, const ServerOptions& defaults) {
  std::string head = "  " + std::string(s.flag) + (s.metavar.empty() ? "" : " " + std::string(s.metavar));
  std::string help(s.help);
  std::string def;
  if (auto* str = std::get_if<std::string ServerOptions::*>(&s.member)) {
    def = defaults.**str;
  } else if (auto* i = std::get_if<int ServerOptions::*>(&s.member)) {
    def = std::to_string(defaults.**i);
  } else if (auto* d = std::get_if<double ServerOptions::*>(&s.member)) {
    def = std::to_string(defaults.**d);
    def.erase(def.find_last_not_of('0') + 1);
    if (def.back() == '.') def.pop_back();
  }
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
  const ServerOptions defaults;
  std::string text =
      "Usage: attnserve [flags]\n"
      "Serves multi-head attention layers over gRPC (attnserve.v1.AttentionService, grpc.health.v1,\n"
      "server reflection). Flags override the --config file; docs/service.md has each setting.\n"
      "Without --layer the server serves '" +
      std::string(kDemoLayerName) + "' = " + kDemoLayerSource + ".\n\n";
  for (const Setting& s : kSettings) {
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
  const ServerOptions defaults;
  std::vector<SettingDoc> docs;
  for (const Setting& s : kSettings) {
    SettingDoc d{std::string(s.flag), std::string(s.key), std::string(s.metavar), std::string(s.help), ""};
    if (auto* str = std::get_if<std::string ServerOptions::*>(&s.member)) d.default_value = defaults.**str;
    if (auto* i = std::get_if<int ServerOptions::*>(&s.member)) d.default_value = std::to_string(defaults.**i);
    if (auto* b = std::get_if<bool ServerOptions::*>(&s.member)) d.default_value = defaults.**b ? "true" : "false";
    if (auto* f = std::get_if<double ServerOptions::*>(&s.member)) d.default_value = std::to_string(defaults.**f);
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace attnserve
