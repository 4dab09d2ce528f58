// Metrics: the one place that declares attnserve's Prometheus metric families (the design's §5
// plus device errors and the shadow's max-abs divergence) and records into them. The rest of
// the server calls these typed methods and never names a metric; batching and routing reach
// it through their observer interfaces, so neither depends on Prometheus.
//
// Labels: `layer` is a loaded layer's name ("" for requests that named no loaded layer, "*" for
// the default route), `form` is factored, summed or lowrank and `math` fp32, tf32, bf16 or fp16
// (a served variant, server/core/math.h; both "none" for requests refused before a form was
// chosen), `device` is cpu or cuda:N, `code` is the gRPC status name.
// Hot-path calls find their series in a per-(layer, variant) cache under a shared lock and touch
// only prometheus-cpp's own atomics after the first call for a label set.
// Thread-safety: every method may be called from any thread at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/batching/batch_observer.h"
#include "server/core/forms.h"
#include "server/core/math.h"
#include "server/core/status.h"
#include "server/routing/routing_observer.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace attnserve {

// What a family is, for documentation checks and for the dashboard test.
struct MetricFamilySpec {
  std::string_view name;  // with the attnserve_ prefix
  std::string_view type;  // "counter", "gauge" or "histogram"
  std::vector<std::string_view> labels;
  std::string_view help;
};
// Every family Metrics registers, in the order of docs/metrics.md.
const std::vector<MetricFamilySpec>& MetricFamilies();

// Bucket upper bounds. Latencies: 50 µs … 10 s, about three per decade (queue and compute).
const std::vector<double>& LatencyBuckets();
// request_duration_seconds: 100 µs · 1.25^k, k = 0 … 56 (about 26.7 s); fine enough to tell
// two forms 10 % apart (docs/metrics.md).
inline constexpr int kRequestLatencyBuckets = 57;
const std::vector<double>& RequestLatencyBuckets();
const std::vector<double>& BatchRequestBuckets();  // 1 … 512, powers of 2
const std::vector<double>& BatchTokenBuckets();    // 1 … 262144, powers of 4
const std::vector<double>& DivergenceBuckets();    // 1e-9 … 1, one per decade
const std::vector<double>& StageBuckets();         // 1 µs … 10 s, about three per decade

// The stages of one served inference call, in the order they run (docs/metrics.md,
// "Where a request's time goes"). Each is the time between two moments the server records:
//   route    arrival → the form chosen (drain gate, layer lookup, router)
//   decode   → the request decoded and validated into sequences
//   admit    → its job submitted (response-size and memory admission, output buffers)
//   queue    → its batch started on the backend (0 when it ran at once on the receiving thread)
//   compute  → the backend call ended
//   encode   → the answer handed to gRPC (output checks, divergences, timing fields)
//   send     → gRPC reported the call done (the response written to the transport)
// gRPC's own receive and parse of the request happen before arrival: the no-op server's floor.
enum class ServingStage { kRoute, kDecode, kAdmit, kQueue, kCompute, kEncode, kSend };
inline constexpr ServingStage kAllServingStages[] = {ServingStage::kRoute,  ServingStage::kDecode,
                                                      ServingStage::kAdmit,  ServingStage::kQueue,
                                                      ServingStage::kCompute, ServingStage::kEncode,
                                                      ServingStage::kSend};
std::string_view ServingStageName(ServingStage stage);

class Metrics final : public BatchObserver, public RoutingObserver {
 public:
  Metrics();
  ~Metrics() override;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The registry the exposer serves.
  std::shared_ptr<prometheus::Registry> registry() const;
  // The registry in the text exposition format 0.0.4 (what /metrics answers).
  std::string Scrape() const;

  // build_info{version,device,blas} = 1. Call once at start-up.
  void SetBuildInfo(std::string_view version, std::string_view device, std::string_view blas);

  // The memory budget's state (memory_reserved_bytes, memory_budget_bytes).
  void SetMemory(int64_t reserved_bytes, int64_t budget_bytes);
  // A Forward call arrived (inflight_requests + 1).
  void RequestStarted();
  // A Forward call ended with `code` after `seconds` (inflight_requests - 1, requests_total,
  // request_duration_seconds, both by code). `form` is the form that served it or was asked for; nullopt
  // when the call was refused before one was known.
  void RequestFinished(std::string_view layer, std::optional<Variant> variant, StatusCode code, double seconds);

  // One served call's stages (stage_seconds), in seconds, indexed like kAllServingStages.
  // Lock-free: one series per stage, made at construction.
  void StagesServed(std::span<const double, std::size(kAllServingStages)> seconds);

  // layer_parameters and layer_bytes of one held form of a loaded layer.
  void SetLayerForm(std::string_view layer, Variant variant, std::string_view device, int64_t parameters,
                    int64_t bytes);
  // Removes every layer_parameters / layer_bytes series of `layer` (unloaded or replaced).
  // Counters and histograms stay: a rate over the unload must not see them vanish.
  void RemoveLayer(std::string_view layer);

  // A device failed a batch (the backend is now unhealthy).
  void CountDeviceError(std::string_view device);

  // An output `form` computed for a request to `layer` held a NaN or an infinity (float32
  // overflowed on finite inputs): nonfinite_outputs_total. The service counts served outputs
  // (answered OUT_OF_RANGE) and compare outputs; ShadowCompared counts mirrors.
  void CountNonFiniteOutput(std::string_view layer, Variant variant);

  // A request to `layer` with form auto is served by `form`, the cost model's choice:
  // auto_choice_total.
  void CountAutoChoice(std::string_view layer, Variant variant);

  // BatchObserver: queue_depth, queue_duration_seconds, compute_duration_seconds,
  // batch_requests, batch_tokens, flops_total; a batch failing with INTERNAL also counts a
  // device error.
  void JobQueued(std::string_view layer, Variant variant) override;
  void JobDequeued(std::string_view layer, Variant variant, double queue_seconds) override;
  void BatchStarted(std::string_view layer, Variant variant, int32_t requests) override;
  void BatchDone(const BatchReport& report) override;

  // RoutingObserver: route_weight, routes_generation, config_reload_total, shadow_divergence (rel_l2),
  // shadow_divergence_max_abs, shadow_dropped_total; a mirror with a non-finite output (an
  // infinite divergence) also counts in nonfinite_outputs_total.
  void RouteChanged(std::string_view layer, const RouteSplit& split) override;
  void RoutesApplied(uint64_t generation) override;
  void RoutesFileLoaded(bool ok) override;
  void ShadowCompared(std::string_view layer, Variant mirror, const DivergenceStats& divergence) override;
  void ShadowDropped(std::string_view layer) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve
