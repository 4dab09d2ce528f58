#include "server/settings_table.h"

#include <algorithm>
#include <optional>

#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/backend/select.h"
#include "server/routing/router.h"     // ParseRouteSpec, kDefaultRoute
#include "server/store/layer_store.h"  // ValidateLayerName

namespace attnserve {
namespace {

constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};

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
  o->store.model_dirs.push_back(dir);
  return OkStatus();
}

// The enums, parsed once: the typed value travels on (server.cc passes BackendOptions as it is).
Status SetCpuGemm(const std::string& what, const std::string& text, ServerOptions* o) {
  StatusOr<GemmLibrary> gemm = ParseGemmLibrary(text);
  if (!gemm.ok()) return InvalidArgumentError(what + ": " + gemm.status().message());
  o->backend.cpu.gemm = *gemm;
  return OkStatus();
}

Status SetCpuWeightLayout(const std::string& what, const std::string& text, ServerOptions* o) {
  StatusOr<WeightLayout> layout = ParseWeightLayout(text);
  if (!layout.ok()) return InvalidArgumentError(what + ": " + layout.status().message());
  o->backend.cpu.weight_layout = *layout;
  return OkStatus();
}

Status SetGpuMath(const std::string& what, const std::string& text, ServerOptions* o) {
  const std::optional<Math> math = ParseMath(text);
  if (!math) return InvalidArgumentError(what + ": expected " + std::string(kMathChoices) + ", got '" + text + "'");
  o->backend.cuda.math = *math;
  return OkStatus();
}

// "bf16,fp32": each a math, once; "" or "none": none.
Status SetExtraMaths(const std::string& what, const std::string& text, ServerOptions* o) {
  o->store.extra_maths.clear();
  if (text.empty() || text == "none") return OkStatus();
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, comma - start);
    const std::optional<Math> math = ParseMath(name);
    if (!math) {
      return InvalidArgumentError(what + ": expected a comma-separated list of " + std::string(kMathChoices) + ", got '" +
                                  name + "' in '" + text + "'");
    }
    if (std::find(o->store.extra_maths.begin(), o->store.extra_maths.end(), *math) != o->store.extra_maths.end()) {
      return InvalidArgumentError(what + ": expected each math once, got " + name + " twice in '" + text + "'");
    }
    o->store.extra_maths.push_back(*math);
    start = comma + 1;
  }
  return OkStatus();
}

using O = ServerOptions;
// The CPU and CUDA backends' own options, which ServerOptions holds in `backend`.
template <auto kField>
auto* InCpu(ServerOptions* o) {
  return At<&O::backend, &BackendOptions::cpu, kField>(o);
}
template <auto kField>
auto* InCuda(ServerOptions* o) {
  return At<&O::backend, &BackendOptions::cuda, kField>(o);
}
template <auto kField>
auto* InBatching(ServerOptions* o) {
  return At<&O::batching, kField>(o);
}
template <auto kField>
auto* InStore(ServerOptions* o) {
  return At<&O::store, kField>(o);
}

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
    {"--device", "device", "DEV", &At<&O::backend, &BackendOptions::device>, 0, 0, CheckDevice, nullptr,
     "auto, cpu, cuda or cuda:N (auto: a usable GPU when there is one, else the CPU); an explicit "
     "cuda without a usable GPU refuses to start"},
    {"--gpu-math", "gpu_math", "MODE", Choice{SetGpuMath, "fp32"}, 0, 0, nullptr, nullptr,
     "fp32, tf32 (TF32 tensor-core GEMMs), bf16 or fp16 (the projections' weights and inputs in 16 bits, "
     "float32 accumulation and attention)"},
    {"--extra-maths", "extra_maths", "LIST", Choice{SetExtraMaths, "none"}, 0, 0, nullptr, nullptr,
     "maths every layer is also held in, beside the device's own (--gpu-math; the CPU's fp32, or bf16 or fp16 "
     "under a packed-bf16 or packed-fp16 layout), e.g. bf16 or fp32,fp16: each form resident once more per math, "
     "a served variant that routes (factored@fp16:90,factored@fp32:10), requests and shadows name. The CPU runs "
     "fp32, bf16 and fp16; the GPU every math"},
    {"--threads", "threads", "N", &InCpu<&CpuBackendOptions::threads>, 0, 1024, nullptr, nullptr,
     "CPU backend threads per Forward (0: every core)"},
    {"--cpu-idle-spin-us", "cpu_idle_spin_us", "US", Micros{&InCpu<&CpuBackendOptions::idle_spin>},
     0, 1000000, nullptr, nullptr,
     "microseconds the CPU backend's helper threads spin after a forward, for the next, before they sleep "
     "(0: at once; a forward wakes them as it starts)"},
    {"--cpu-gemm", "cpu_gemm", "LIB", Choice{SetCpuGemm, "auto"}, 0, 0, nullptr, nullptr,
     "auto, eigen or onednn: the CPU backend's GEMM library (auto: oneDNN when the build has it, else Eigen)"},
    {"--cpu-weight-layout", "cpu_weight_layout", "LAYOUT", Choice{SetCpuWeightLayout, "auto"}, 0, 0, nullptr, nullptr,
     "auto, packed, packed-bf16, packed-bf16-dot, packed-fp16 or plain: packed keeps a copy of each layer's "
     "projection weights in panels for the CPU backend's own kernel (as many bytes again; auto: where the CPU has "
     "AVX2, FMA and F16C), packed-bf16 the same copy rounded to bfloat16 (half the bytes, a few 1e-3 relative "
     "error), packed-bf16-dot that and the projections' inputs rounded too, multiplied by vdpbf16ps (CPUs with "
     "AVX512_BF16), packed-fp16 the copy rounded to IEEE half (half the bytes, 8 times closer than bfloat16; "
     "weights past 65504 refused), plain the row-major weights only"},
    {"--workers", "workers", "N", &InBatching<&BatchPolicy::workers>, 1, 256, nullptr, nullptr,
     "batches computed side by side"},
    {"--worker-idle-spin-us", "worker_idle_spin_us", "US", Micros{&InBatching<&BatchPolicy::idle_spin>},
     0, 1000000, nullptr, nullptr,
     "microseconds a batcher thread polls its queues after a batch, for the next request, before it sleeps "
     "(0: at once)"},
    {"--max-batch-requests", "max_batch_requests", "N", &InBatching<&BatchPolicy::max_batch_requests>,
     1, 4096, nullptr, nullptr,
     "requests in one batch at most (1: no batching)"},
    {"--max-batch-tokens", "max_batch_tokens", "N", Scaled{&InBatching<&BatchPolicy::max_batch_tokens>, 0},
     1, 1 << 24, nullptr, nullptr,
     "query + context rows in one batch at most"},
    {"--max-queue-delay-us", "max_queue_delay_us", "N", Micros{&InBatching<&BatchPolicy::max_queue_delay>},
     0, 10000000, nullptr, nullptr,
     "how long the oldest queued request waits for others (0: take what queued while the device was busy)"},
    {"--max-queue-requests", "max_queue_requests", "N", &InBatching<&BatchPolicy::max_queue_requests>,
     1, 1000000, nullptr, nullptr,
     "requests waiting per (layer, form) queue; beyond: RESOURCE_EXHAUSTED at once"},
    {"--drain-timeout-s", "drain_timeout_s", "N", &O::drain_timeout_s, 0, 3600, nullptr, nullptr,
     "on SIGTERM/SIGINT: NOT_SERVING, refuse new calls, give accepted ones N seconds, then exit 0"},
    {"--exit-on-device-loss", "exit_on_device_loss", "", &O::exit_on_device_loss, 0, 0, nullptr, nullptr,
     "when the GPU is lost (a sticky device error), drain as on SIGTERM and exit with status 3, for an "
     "orchestrator to restart the process; without it the server stays up, NOT_SERVING, until a signal"},
    {"--nvml-library", "nvml_library", "PATH", &O::nvml_library, 0, 0, nullptr, nullptr,
     "the NVML library read for the attnserve_gpu_* gauges (a name the loader searches for, or a path; empty: "
     "none); absent, those gauges are absent"},
    {"--max-message-mb", "max_message_mb", "N", &O::max_message_mb, 1, 2047, nullptr, nullptr,
     "largest request and response in MiB"},
    {"--max-scores-m", "max_scores_m", "N", &O::max_scores_m, 1, 1 << 30, nullptr, nullptr,
     "attention scores one request may ask for, in millions: the sum over its sequences of n*m*heads (its work; "
     "memory is linear in the sequence length); beyond: RESOURCE_EXHAUSTED"},
    {"--auto-calibration-ms", "auto_calibration_ms", "N", &O::auto_calibration_ms, 0, 60000, nullptr, nullptr,
     "form auto: time each layer's exact forms for at most N ms, in the background from its first auto request, and "
     "choose by the fitted cost (by the flop count until then); 0: choose by the flop count"},
    {"--max-memory-mb", "max_memory_mb", "N", &O::max_memory_mb, 0, 1 << 30, nullptr, nullptr,
     "memory every admitted request may hold at once (input, output, compare and shadow copies, backend scratch), "
     "in MiB; 0: half the container's memory limit, else half the machine's; beyond: RESOURCE_EXHAUSTED, or "
     "INVALID_ARGUMENT for a request that can never fit"},
    {"--max-device-memory-mb", "max_device_memory_mb", "N", Scaled{&InCuda<&CudaBackendOptions::max_device_bytes>, 20},
     0, 1 << 30, nullptr, nullptr,
     "device memory the GPU backend may hold (weights and workspaces), in MiB; 0: 90% of the card's; a batch "
     "beyond runs in smaller query-row blocks, or fails with RESOURCE_EXHAUSTED"},
    {"--gpu-max-lane-workspace-mb", "gpu_max_lane_workspace_mb", "N",
     Scaled{&InCuda<&CudaBackendOptions::max_lane_workspace_bytes>, 20},
     0, 1 << 30, nullptr, nullptr,
     "one GPU lane's workspace at most, in MiB (0: --max-device-memory-mb as resolved); a batch beyond runs in "
     "smaller query-row blocks, then in halves of its sequences"},
    {"--gpu-max-score-workspace-mb", "gpu_max_score_workspace_mb", "N",
     Scaled{&InCuda<&CudaBackendOptions::max_score_workspace_bytes>, 20},
     1, 1 << 30, nullptr, nullptr,
     "device memory for one block of a sequence's attention scores on the GPU, in MiB: its queries run in blocks "
     "of as many rows as fit (at least one)"},
    {"--gpu-retain-workspace-mb", "gpu_retain_workspace_mb", "N",
     Scaled{&InCuda<&CudaBackendOptions::retain_workspace_bytes>, 20},
     0, 1 << 30, nullptr, nullptr,
     "what a GPU lane keeps after a batch for the next, in MiB: a larger workspace or pinned staging is released "
     "when its batch ends, unless the batch before needed more too"},
    {"--gpu-staging-slice-kb", "gpu_staging_slice_kb", "N",
     Scaled{&InCuda<&CudaBackendOptions::staging_slice_bytes>, 10},
     1, 1 << 30, nullptr, nullptr,
     "inputs go to the GPU, and outputs come back, in slices of about this many KiB (whole rows), packed on the "
     "host while the copy engine moves the one before"},
    {"--gpu-staging-threads", "gpu_staging_threads", "N", &InCuda<&CudaBackendOptions::staging_threads>,
     1, 1024, nullptr, nullptr,
     "host threads that pack a staging slice into pinned memory, and unpack one, together (capped at the host's "
     "hardware threads)"},
    {"--gpu-summed-mix-first", "gpu_summed_mix_first", "", &InCuda<&CudaBackendOptions::summed_mix_first>,
     0, 0, nullptr, nullptr,
     "on the GPU, a summed-form sequence with fewer queries than keys mixes them first (fewer projection FLOPs); "
     "without it every summed sequence projects first"},
    {"--gpu-gemm-attention", "gpu_gemm_attention", "", &InCuda<&CudaBackendOptions::gemm_attention>,
     0, 0, nullptr, nullptr,
     "on the GPU, attention as score GEMM, softmax kernel and mix GEMM with the scores in device memory, instead "
     "of the fused kernel (scores, online softmax and mix in one launch)"},
    {"--gpu-graphs", "gpu_graphs", "N", &InCuda<&CudaBackendOptions::graph_rows>, 0, 1 << 20, nullptr, nullptr,
     "on the GPU, a batch of at most N rows (queries plus separate contexts) whose shape was seen before replays "
     "a captured CUDA graph instead of its launches (0: off)"},
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
    {"--max-layers", "max_layers", "N", &InStore<&LayerStoreOptions::max_layers>, 1, 100000, nullptr, nullptr,
     "layers held at most; a load beyond: RESOURCE_EXHAUSTED"},
    {"--max-layer-mb", "max_layer_mb", "N", Scaled{&InStore<&LayerStoreOptions::max_total_bytes>, 20},
     1, 1 << 30, nullptr, nullptr,
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

}  // namespace

std::span<const Setting> Settings() { return kSettings; }

}  // namespace attnserve
