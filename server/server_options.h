// The attnserve binary's settings: command-line flags over an optional YAML file (flags win),
// checked before anything starts. `attnserve --help` prints UsageText().
// Thread-safety: plain values and pure functions; parse once in main.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/backend/select.h"
#include "server/batching/batcher.h"
#include "server/core/status.h"
#include "server/store/layer_store.h"

namespace attnserve {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";
  std::string port_file;  // when set, the bound port is written there once listening
  // NAME=SOURCE pairs in load order. Empty after parsing: serve the built-in demo layer.
  std::vector<std::pair<std::string, std::string>> layers;
  // The backend (docs/architecture.md): the device (auto takes a usable GPU when there is one,
  // else the CPU) and each kind's options, typed; the server passes them on as they are.
  BackendOptions backend;
  // The dynamic batcher (docs/architecture.md, "Batching"); defaults measured in
  // docs/journal/benchmarks-journal.md, "The dynamic batcher". max_queue_delay 0: greedy (a batch
  // is what queued while the device was busy); beyond max_queue_requests per (layer, form)
  // queue: RESOURCE_EXHAUSTED; a worker polls its queues idle_spin after a batch before it sleeps.
  BatchPolicy batching{.max_batch_requests = 32,
                       .max_batch_tokens = 8192,
                       .max_queue_delay = std::chrono::microseconds(0),
                       .max_queue_requests = 256,
                       .workers = 1,
                       .idle_spin = std::chrono::microseconds(500)};
  int drain_timeout_s = 30;       // on SIGTERM: how long accepted requests get to finish
  // A lost device (Backend::Healthy() false: a sticky CUDA error) drains the server as SIGTERM
  // would and ends the process with kExitDeviceLost, for an orchestrator to restart it; without
  // it the server stays up, NOT_SERVING, until a signal.
  bool exit_on_device_loss = false;
  // NVML, for the attnserve_gpu_* gauges: a library name the loader searches for, or a path;
  // empty: not read. Absent, the gauges are absent (one info line at start-up).
  std::string nvml_library = "libnvidia-ml.so.1";
  int max_message_mb = 64;   // receive and send limit
  // Attention scores one request may ask for, in millions: Σ over its sequences of n · m · heads.
  // A bound on its work (the scores and the mix grow with it), not on its memory: the backends
  // tile the attention, so memory grows linearly with the sequence length. 4096 admits one
  // 16384-token sequence of 12 heads (3221 M).
  int max_scores_m = 4096;
  // Form auto (server/service/auto_form.h): the wall time, ms, of a layer's calibration on its
  // first auto request; 0: the flop count decides, untimed.
  int auto_calibration_ms = 1000;
  // What admitted requests may hold at once (inputs, outputs, copies, backend scratch), MiB;
  // 0: half the container's memory limit, else half the machine's memory.
  int max_memory_mb = 0;
  std::string log_level = "info";
  bool log_json = false;
  // The admin API (LoadLayer, UnloadLayer, SetRouting; docs/security.md). Closed on --listen
  // unless a token is set; open without a token only on an admin listener bound to loopback.
  std::string admin_token;   // >= 16 bytes; callers send "authorization: Bearer TOKEN"
  std::string admin_listen;  // HOST:PORT of a second listener that also serves the admin API
  std::string admin_port_file;
  // The Open Inference Protocol over HTTP/REST on its own listener (server/service/http); empty: off.
  std::string http_listen;
  std::string http_port_file;
  int admin_queue = 8;             // admin calls waiting at most; beyond: RESOURCE_EXHAUSTED
  // The layers held (at most max_layers, weights of every layer and form together at most
  // max_total_bytes) and the directories LoadLayer over gRPC may read checkpoints from; none:
  // API loads of safetensors sources are refused (sources from flags and the config file are
  // not confined).
  LayerStoreOptions store{.max_layers = 32, .max_total_bytes = int64_t{16384} << 20};
  // TLS on every gRPC listener (PEM files); with tls_client_ca, clients must present a
  // certificate it signed (mTLS).
  std::string tls_cert, tls_key, tls_client_ca;
  // The metrics endpoint's TLS and basic auth, in the format of Prometheus's web.config.file.
  std::string metrics_web_config;
  // HTTP/2 defences (docs/security.md): the gRPC in use predates several of gRPC's own.
  int max_concurrent_streams = 128;        // per connection
  int keepalive_min_ping_interval_s = 10;  // pings closer than this count as strikes
  int keepalive_max_ping_strikes = 2;      // beyond: GOAWAY
  int max_connection_age_s = 1800;         // then GOAWAY (clients reconnect; rebalances too)
  int max_connection_age_grace_s = 60;     // for calls in flight at that point
  int max_metadata_kb = 16;                // request headers at most
  // Prometheus endpoint (docs/metrics.md): HOST:PORT serving /metrics; port 0 picks a free one.
  std::string metrics_listen = "0.0.0.0:9464";
  std::string metrics_port_file;  // when set, the metrics port is written there once listening
  // A/B routing: LAYER (or "*") → FORM:WEIGHT,... for requests that leave the form unspecified,
  // in the order given (a later route of the same layer replaces an earlier one).
  std::vector<std::pair<std::string, std::string>> routes;
  // A YAML file of routes (server/routing/routes_file.h) read at start and followed while the
  // server runs; excludes --route and the config's routes.
  std::string routes_file;
  double shadow_rate = 0;  // fraction of served requests mirrored to another held form
  int shadow_queue = 16;   // mirrors waiting at most; beyond: dropped and counted
  std::string config_file;
  bool help = false;
  bool version = false;
};

inline constexpr char kDemoLayerName[] = "demo";
inline constexpr char kDemoLayerSource[] = "random:d_model=768,heads=12,seed=1";

// Whether an admin listener on HOST (an address or name, IPv6 in brackets or not) is reachable
// from this machine only: a literal 127.0.0.0/8 or ::1 address, or "localhost" when every
// address the resolver gives for it is one. Any other name is refused, whatever it resolves to
// now: names move.
bool IsLoopbackHost(std::string_view host);

// Parses argv (flags as `--name value` or `--name=value`); reads --config first so that every
// other flag overrides the file. Layers from flags replace file layers of the same name. The
// admin token may also come from the environment variable ATTNSERVE_ADMIN_TOKEN (lowest
// precedence), which keeps it out of `ps`. INVALID_ARGUMENT naming the flag or key otherwise.
StatusOr<ServerOptions> ParseServerOptions(int argc, const char* const* argv);

// Applies a YAML document (the keys of docs/service.md) onto `options`; `origin` names it in errors.
Status ApplyYamlConfig(const std::string& yaml_text, const std::string& origin, ServerOptions* options);

// Splits "NAME=SOURCE"; INVALID_ARGUMENT when either side is missing.
StatusOr<std::pair<std::string, std::string>> ParseLayerFlag(const std::string& value);

std::string UsageText();

// One setting as docs/service.md's table shows it (a test holds the doc to this list).
struct SettingDoc {
  std::string flag, key, metavar, help, default_value;
};
std::vector<SettingDoc> SettingDocs();

}  // namespace attnserve
