#include "server/core/thread_annotations.h"
#include "server/metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

namespace attnserve {
namespace {

constexpr size_t kCodes = 17;  // gRPC's canonical codes 0..16
// Series index of a variant (form, math); kNoForm for calls refused before a form was known.
constexpr size_t kMaths = std::size(kAllMaths);
constexpr size_t kNoForm = std::size(kAllForms) * kMaths;
constexpr size_t kFormSlots = kNoForm + 1;

size_t FormSlot(std::optional<Variant> v) {
  return v ? static_cast<size_t>(v->form) * kMaths + static_cast<size_t>(v->math) : kNoForm;
}

std::string FormLabel(size_t slot) {
  return slot == kNoForm ? "none" : std::string(FormName(kAllForms[slot / kMaths]));
}
std::string MathLabel(size_t slot) {
  return slot == kNoForm ? "none" : std::string(MathName(kAllMaths[slot % kMaths]));
}

const MetricFamilySpec& Spec(std::string_view name) {
  for (const MetricFamilySpec& spec : MetricFamilies()) {
    if (spec.name == name) return spec;
  }
  // Only this file passes names, all of them from the table: a miss is a programming error.
  std::abort();
}

prometheus::Family<prometheus::Counter>& Counter(prometheus::Registry& r, std::string_view name) {
  const MetricFamilySpec& s = Spec(name);
  return prometheus::BuildCounter().Name(std::string(s.name)).Help(std::string(s.help)).Register(r);
}
prometheus::Family<prometheus::Gauge>& Gauge(prometheus::Registry& r, std::string_view name) {
  const MetricFamilySpec& s = Spec(name);
  return prometheus::BuildGauge().Name(std::string(s.name)).Help(std::string(s.help)).Register(r);
}
prometheus::Family<prometheus::Histogram>& Histogram(prometheus::Registry& r, std::string_view name) {
  const MetricFamilySpec& s = Spec(name);
  return prometheus::BuildHistogram().Name(std::string(s.name)).Help(std::string(s.help)).Register(r);
}

// A child created on first use. Family::Add is thread-safe and returns the same child for the
// same labels, so two threads racing here store the same pointer.
template <typename T, typename MakeLabels, typename... Args>
T& Lazy(std::atomic<T*>& slot, prometheus::Family<T>& family, MakeLabels&& labels, Args&&... args) {
  T* child = slot.load(std::memory_order_acquire);
  if (child == nullptr) {
    child = &family.Add(labels(), std::forward<Args>(args)...);
    slot.store(child, std::memory_order_release);
  }
  return *child;
}

}  // namespace

const std::vector<MetricFamilySpec>& MetricFamilies() {
  static const std::vector<MetricFamilySpec> families = {
      {"attnserve_requests_total", "counter", {"layer", "form", "math", "code"},
       "Forward calls answered, by layer, serving form and gRPC status code."},
      {"attnserve_request_duration_seconds", "histogram", {"layer", "form", "math", "code"},
       "Forward call latency in the server, from arrival to the answer, in seconds, by gRPC status code."},
      {"attnserve_queue_duration_seconds", "histogram", {"layer", "form", "math"},
       "Time a Forward job waited in the executor's queue before its batch started, in seconds."},
      {"attnserve_compute_duration_seconds", "histogram", {"layer", "form", "math", "device"},
       "Wall time of one backend call (a batch), in seconds."},
      {"attnserve_stage_seconds", "histogram", {"stage"},
       "Time a served Forward call spent in each stage in the server (route, decode, admit, queue, compute, "
       "encode, send), in seconds."},
      {"attnserve_device_time_seconds", "histogram", {"layer", "form", "math", "device", "part"},
       "One backend call's time on a GPU, by part: inputs (to the device, paced by packing pinned memory), "
       "compute, outputs (back to the host), in seconds, from events on its stream."},
      {"attnserve_batch_requests", "histogram", {"layer", "form", "math"}, "Jobs per backend call."},
      {"attnserve_batch_tokens", "histogram", {"layer", "form", "math"}, "Query tokens (rows) per backend call."},
      {"attnserve_flops_total", "counter", {"layer", "form", "math", "device"},
       "Floating-point operations the backend calls performed (multiply-add = 2); rate() is the achieved "
       "FLOP/s."},
      {"attnserve_queue_depth", "gauge", {"layer", "form", "math"}, "Forward jobs waiting in the executor's queue."},
      {"attnserve_computing_requests", "gauge", {"layer", "form", "math"},
       "Forward jobs in a backend call now; with attnserve_queue_depth, a layer's work in flight."},
      {"attnserve_inflight_requests", "gauge", {}, "Forward calls received and not yet answered."},
      {"attnserve_memory_reserved_bytes", "gauge", {},
       "Bytes admitted requests and shadow runs hold now under the memory budget (--max-memory-mb)."},
      {"attnserve_memory_budget_bytes", "gauge", {}, "The memory budget of admitted requests (--max-memory-mb)."},
      {"attnserve_backend_retained_bytes", "gauge", {},
       "Host memory the backend keeps between calls for reuse (the CPU backend's scratch), outside the budget."},
      {"attnserve_shadow_divergence", "histogram", {"layer", "form", "math"},
       "Relative L2 distance ||mirror - served|| / ||served|| of shadow runs, by the mirror's form and math."},
      {"attnserve_shadow_divergence_max_abs", "histogram", {"layer", "form", "math"},
       "Largest absolute difference |mirror - served| of shadow runs, by the mirror's form and math."},
      {"attnserve_shadow_dropped_total", "counter", {"layer"},
       "Shadow runs not done: the shadow queue was full, or the mirror failed."},
      {"attnserve_layer_parameters", "gauge", {"layer", "form", "math"}, "Parameters of a loaded layer's form."},
      {"attnserve_layer_bytes", "gauge", {"layer", "form", "math", "device"},
       "Bytes of host memory a loaded layer's form holds: its weights, and the CPU backend's packed copy of them; "
       "in a math beside the default, what its copy adds (the float32 weights are shared)."},
      {"attnserve_route_weight", "gauge", {"layer", "form", "math"},
       "Share of unspecified-form requests this process routes to a form (layer \"*\": the default route)."},
      {"attnserve_routes_generation", "gauge", {},
       "Hash of the routes this process applies (53 bits of FNV-1a 64 of their canonical text): equal on every "
       "replica that runs the same split."},
      {"attnserve_config_reload_total", "counter", {"result"},
       "Reads of the routes file (--routes-file) that changed it: result ok (applied) or error (refused whole, the "
       "routes kept)."},
      {"attnserve_build_info", "gauge", {"version", "device", "blas"}, "Always 1; the labels describe the build."},
      {"attnserve_device_errors_total", "counter", {"device"},
       "Backend calls that failed with a device error (the backend is then unhealthy)."},
      {"attnserve_device_memory_held_bytes", "gauge", {"device"},
       "Device memory the GPU backend holds under its budget: the weights and every lane's workspace."},
      {"attnserve_device_memory_limit_bytes", "gauge", {"device"},
       "The GPU backend's device memory budget (--max-device-memory-mb as resolved)."},
      {"attnserve_device_lanes", "gauge", {"device"},
       "GPU lanes made (a stream, a cuBLAS handle, a workspace each): one per worker once warmed."},
      {"attnserve_gpu_utilization_ratio", "gauge", {"device"},
       "NVML: share of the last sample period a kernel ran on the GPU, 0 to 1 (every process's)."},
      {"attnserve_gpu_memory_used_bytes", "gauge", {"device"}, "NVML: device memory in use by every process."},
      {"attnserve_gpu_memory_total_bytes", "gauge", {"device"}, "NVML: the GPU's device memory."},
      {"attnserve_gpu_temperature_celsius", "gauge", {"device"}, "NVML: the GPU die's temperature."},
      {"attnserve_gpu_power_watts", "gauge", {"device"}, "NVML: the board's power draw."},
      {"attnserve_nonfinite_outputs_total", "counter", {"layer", "form", "math"},
       "Outputs a form computed with a NaN or an infinity in them (float32 overflowed on finite inputs): served "
       "ones are answered OUT_OF_RANGE, compare and shadow ones show as infinite divergence."},
      {"attnserve_auto_choice_total", "counter", {"layer", "form", "math"},
       "Requests with form auto, by the exact form the cost model chose for them (counted once decoded)."},
  };
  return families;
}

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> b = {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                                        50e-3, 100e-3, 250e-3, 500e-3, 1,    2.5,    5,    10};
  return b;
}
const std::vector<double>& RequestLatencyBuckets() {
  // 100 µs · 1.25^k, k = 0 … 56 (26.7 s): neighbouring bounds 25 % apart, so two forms 10 %
  // apart fall in different buckets at every latency in the range.
  static const std::vector<double> b = [] {
    std::vector<double> bounds;
    for (int k = 0; k < kRequestLatencyBuckets; ++k) bounds.push_back(100e-6 * std::pow(1.25, k));
    return bounds;
  }();
  return b;
}
const std::vector<double>& BatchRequestBuckets() {
  static const std::vector<double> b = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  return b;
}
const std::vector<double>& BatchTokenBuckets() {
  static const std::vector<double> b = {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144};
  return b;
}
const std::vector<double>& DivergenceBuckets() {
  static const std::vector<double> b = {1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1};
  return b;
}

const std::vector<double>& StageBuckets() {
  // Down to a microsecond: most stages of a small request take a few.
  static const std::vector<double> b = {1e-6,   2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3,
                                        2.5e-3, 5e-3,   10e-3, 25e-3, 100e-3, 1,    10};
  return b;
}

std::string_view ServingStageName(ServingStage stage) {
  switch (stage) {
    case ServingStage::kRoute: return "route";
    case ServingStage::kDecode: return "decode";
    case ServingStage::kAdmit: return "admit";
    case ServingStage::kQueue: return "queue";
    case ServingStage::kCompute: return "compute";
    case ServingStage::kEncode: return "encode";
    case ServingStage::kSend: return "send";
  }
  return "unknown";
}

struct Metrics::Impl {
  // The series of one device for one (layer, form).
  struct DeviceSeries {
    std::string device;
    prometheus::Histogram* compute = nullptr;
    prometheus::Counter* flops = nullptr;
    std::array<prometheus::Histogram*, 3> parts = {};  // device_time_seconds: inputs, compute, outputs
  };
  // The series of one (layer, form).
  struct FormSeries {
    std::atomic<prometheus::Counter*> requests[kCodes] = {};
    std::atomic<prometheus::Histogram*> request_duration[kCodes] = {};
    std::atomic<prometheus::Histogram*> queue_duration{nullptr};
    std::atomic<prometheus::Histogram*> batch_requests{nullptr};
    std::atomic<prometheus::Histogram*> batch_tokens{nullptr};
    std::atomic<prometheus::Gauge*> queue_depth{nullptr};
    std::atomic<prometheus::Gauge*> computing{nullptr};
    std::atomic<prometheus::Histogram*> shadow_divergence{nullptr};
    std::atomic<prometheus::Histogram*> shadow_max_abs{nullptr};
    std::atomic<prometheus::Counter*> nonfinite_outputs{nullptr};
    std::atomic<prometheus::Counter*> auto_choices{nullptr};
    Mutex device_mu;  // per batch, not per request: a plain lock is cheap enough
    std::vector<DeviceSeries> devices ATTNSERVE_GUARDED_BY(device_mu);
  };
  struct LayerSeries {
    std::array<FormSeries, kFormSlots> forms;
    std::atomic<prometheus::Counter*> shadow_dropped{nullptr};
  };

  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Counter>& requests_total = Counter(*registry, "attnserve_requests_total");
  prometheus::Family<prometheus::Histogram>& request_duration =
      Histogram(*registry, "attnserve_request_duration_seconds");
  prometheus::Family<prometheus::Histogram>& queue_duration = Histogram(*registry, "attnserve_queue_duration_seconds");
  prometheus::Family<prometheus::Histogram>& compute_duration =
      Histogram(*registry, "attnserve_compute_duration_seconds");
  prometheus::Family<prometheus::Histogram>& device_time = Histogram(*registry, "attnserve_device_time_seconds");
  prometheus::Family<prometheus::Histogram>& batch_requests = Histogram(*registry, "attnserve_batch_requests");
  prometheus::Family<prometheus::Histogram>& batch_tokens = Histogram(*registry, "attnserve_batch_tokens");
  prometheus::Family<prometheus::Counter>& flops_total = Counter(*registry, "attnserve_flops_total");
  prometheus::Family<prometheus::Gauge>& queue_depth = Gauge(*registry, "attnserve_queue_depth");
  prometheus::Family<prometheus::Gauge>& computing = Gauge(*registry, "attnserve_computing_requests");
  prometheus::Family<prometheus::Gauge>& inflight_family = Gauge(*registry, "attnserve_inflight_requests");
  prometheus::Family<prometheus::Histogram>& shadow_divergence = Histogram(*registry, "attnserve_shadow_divergence");
  prometheus::Family<prometheus::Histogram>& shadow_max_abs =
      Histogram(*registry, "attnserve_shadow_divergence_max_abs");
  prometheus::Family<prometheus::Counter>& shadow_dropped = Counter(*registry, "attnserve_shadow_dropped_total");
  prometheus::Family<prometheus::Gauge>& layer_parameters = Gauge(*registry, "attnserve_layer_parameters");
  prometheus::Family<prometheus::Gauge>& layer_bytes = Gauge(*registry, "attnserve_layer_bytes");
  prometheus::Family<prometheus::Gauge>& route_weight = Gauge(*registry, "attnserve_route_weight");
  prometheus::Gauge& routes_generation = Gauge(*registry, "attnserve_routes_generation").Add({});
  prometheus::Family<prometheus::Counter>& config_reload = Counter(*registry, "attnserve_config_reload_total");
  prometheus::Counter& reload_ok = config_reload.Add({{"result", "ok"}});
  prometheus::Counter& reload_error = config_reload.Add({{"result", "error"}});
  prometheus::Family<prometheus::Gauge>& build_info = Gauge(*registry, "attnserve_build_info");
  prometheus::Family<prometheus::Counter>& device_errors = Counter(*registry, "attnserve_device_errors_total");
  prometheus::Family<prometheus::Counter>& nonfinite_outputs = Counter(*registry, "attnserve_nonfinite_outputs_total");
  prometheus::Family<prometheus::Counter>& auto_choices = Counter(*registry, "attnserve_auto_choice_total");
  prometheus::Gauge& inflight = inflight_family.Add({});
  prometheus::Family<prometheus::Histogram>& stage_family = Histogram(*registry, "attnserve_stage_seconds");
  std::array<prometheus::Histogram*, std::size(kAllServingStages)> stages = [this] {
    std::array<prometheus::Histogram*, std::size(kAllServingStages)> made{};
    for (size_t i = 0; i < made.size(); ++i) {
      made[i] = &stage_family.Add({{"stage", std::string(ServingStageName(kAllServingStages[i]))}}, StageBuckets());
    }
    return made;
  }();
  prometheus::Gauge& memory_reserved = Gauge(*registry, "attnserve_memory_reserved_bytes").Add({});
  prometheus::Gauge& memory_budget = Gauge(*registry, "attnserve_memory_budget_bytes").Add({});
  prometheus::Gauge& backend_retained = Gauge(*registry, "attnserve_backend_retained_bytes").Add({});

  SharedMutex mu;
  std::map<std::string, std::unique_ptr<LayerSeries>, std::less<>> layers ATTNSERVE_GUARDED_BY(mu);  // never erased

  // Serialises the cold paths that add and remove gauge children (layers, routes), so that a
  // remove never races an add of the same series.
  Mutex gauge_mu;
  // The gauges set per layer, with their family, to remove them with the layer.
  using FamilyGauge = std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>;
  std::map<std::string, std::vector<FamilyGauge>, std::less<>> layer_gauges ATTNSERVE_GUARDED_BY(gauge_mu);
  std::map<std::string, std::vector<prometheus::Gauge*>, std::less<>> route_gauges ATTNSERVE_GUARDED_BY(gauge_mu);

  LayerSeries& Layer(std::string_view layer) {
    {
      ReaderLock lock(mu);
      auto it = layers.find(layer);
      if (it != layers.end()) return *it->second;
    }
    WriterLock lock(mu);
    auto [it, inserted] = layers.try_emplace(std::string(layer));
    if (inserted) it->second = std::make_unique<LayerSeries>();
    return *it->second;
  }

  FormSeries& Series(std::string_view layer, size_t slot) { return Layer(layer).forms[slot]; }

  static prometheus::Labels LayerForm(std::string_view layer, size_t slot) {
    return {{"layer", std::string(layer)}, {"form", FormLabel(slot)}, {"math", MathLabel(slot)}};
  }

  DeviceSeries& Device(FormSeries& series, std::string_view layer, size_t slot, std::string_view device)
      ATTNSERVE_REQUIRES(series.device_mu) {
    for (DeviceSeries& d : series.devices) {
      if (d.device == device) return d;
    }
    prometheus::Labels labels = LayerForm(layer, slot);
    labels.emplace("device", std::string(device));
    DeviceSeries d;
    d.device = std::string(device);
    d.compute = &compute_duration.Add(labels, LatencyBuckets());
    d.flops = &flops_total.Add(labels);
    series.devices.push_back(std::move(d));
    return series.devices.back();
  }
};

Metrics::Metrics() : impl_(std::make_unique<Impl>()) {}
Metrics::~Metrics() = default;

std::shared_ptr<prometheus::Registry> Metrics::registry() const { return impl_->registry; }

std::string Metrics::Scrape() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, impl_->registry->Collect());
  return out.str();
}

void Metrics::SetBuildInfo(std::string_view version, std::string_view device, std::string_view blas) {
  MutexLock lock(impl_->gauge_mu);
  impl_->build_info
      .Add({{"version", std::string(version)}, {"device", std::string(device)}, {"blas", std::string(blas)}})
      .Set(1);
}

void Metrics::RequestStarted() { impl_->inflight.Increment(); }

void Metrics::SetMemory(int64_t reserved_bytes, int64_t budget_bytes) {
  impl_->memory_reserved.Set(static_cast<double>(reserved_bytes));
  impl_->memory_budget.Set(static_cast<double>(budget_bytes));
}

void Metrics::RequestFinished(std::string_view layer, std::optional<Variant> variant, StatusCode code,
                              double seconds) {
  impl_->inflight.Decrement();
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  size_t c = static_cast<size_t>(code);
  if (c >= kCodes) c = static_cast<size_t>(StatusCode::kUnknown);
  auto labels = [&] {
    prometheus::Labels labels = Impl::LayerForm(layer, slot);
    labels.emplace("code", std::string(StatusCodeName(static_cast<StatusCode>(c))));
    return labels;
  };
  Lazy(s.requests[c], impl_->requests_total, labels).Increment();
  Lazy(s.request_duration[c], impl_->request_duration, labels, RequestLatencyBuckets()).Observe(seconds);
}

void Metrics::StagesServed(std::span<const double, std::size(kAllServingStages)> seconds) {
  for (size_t i = 0; i < seconds.size(); ++i) impl_->stages[i]->Observe(seconds[i]);
}

void Metrics::SetLayerForm(std::string_view layer, Variant variant, std::string_view device, int64_t parameters,
                           int64_t bytes) {
  const size_t slot = FormSlot(variant);
  MutexLock lock(impl_->gauge_mu);
  prometheus::Gauge& p = impl_->layer_parameters.Add(Impl::LayerForm(layer, slot));
  prometheus::Labels labels = Impl::LayerForm(layer, slot);
  labels.emplace("device", std::string(device));
  prometheus::Gauge& b = impl_->layer_bytes.Add(labels);
  p.Set(static_cast<double>(parameters));
  b.Set(static_cast<double>(bytes));
  auto& gauges = impl_->layer_gauges[std::string(layer)];
  for (Impl::FamilyGauge g : {Impl::FamilyGauge{&impl_->layer_parameters, &p}, {&impl_->layer_bytes, &b}}) {
    if (std::find(gauges.begin(), gauges.end(), g) == gauges.end()) gauges.push_back(g);
  }
}

void Metrics::RemoveLayer(std::string_view layer) {
  MutexLock lock(impl_->gauge_mu);
  auto it = impl_->layer_gauges.find(layer);
  if (it == impl_->layer_gauges.end()) return;
  for (const auto& [family, gauge] : it->second) family->Remove(gauge);
  impl_->layer_gauges.erase(it);
}

void Metrics::CountDeviceError(std::string_view device) {
  impl_->device_errors.Add({{"device", std::string(device)}}).Increment();
}

void Metrics::CountNonFiniteOutput(std::string_view layer, Variant variant) {
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  Lazy(s.nonfinite_outputs, impl_->nonfinite_outputs, [&] { return Impl::LayerForm(layer, slot); }).Increment();
}

void Metrics::CountAutoChoice(std::string_view layer, Variant variant) {
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  Lazy(s.auto_choices, impl_->auto_choices, [&] { return Impl::LayerForm(layer, slot); }).Increment();
}

void Metrics::JobQueued(std::string_view layer, Variant variant) {
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  Lazy(s.queue_depth, impl_->queue_depth, [&] { return Impl::LayerForm(layer, slot); }).Increment();
}

void Metrics::JobDequeued(std::string_view layer, Variant variant, double queue_seconds) {
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  Lazy(s.queue_depth, impl_->queue_depth, [&] { return Impl::LayerForm(layer, slot); }).Decrement();
  Lazy(s.queue_duration, impl_->queue_duration, [&] { return Impl::LayerForm(layer, slot); }, LatencyBuckets())
      .Observe(queue_seconds);
}

void Metrics::BatchStarted(std::string_view layer, Variant variant, int32_t requests) {
  const size_t slot = FormSlot(variant);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  Lazy(s.computing, impl_->computing, [&] { return Impl::LayerForm(layer, slot); }).Increment(requests);
}

void Metrics::BatchDone(const BatchReport& report) {
  {
    const size_t slot = FormSlot(report.variant);
    Impl::FormSeries& s = impl_->Series(report.layer, slot);
    Lazy(s.computing, impl_->computing, [&] { return Impl::LayerForm(report.layer, slot); })
        .Decrement(report.requests);
  }
  impl_->backend_retained.Set(static_cast<double>(report.backend_retained_bytes));
  if (report.code == StatusCode::kInternal) CountDeviceError(report.device);
  if (report.code != StatusCode::kOk) return;  // nothing was computed, or not all of it
  const size_t slot = FormSlot(report.variant);
  Impl::FormSeries& s = impl_->Series(report.layer, slot);
  auto labels = [&] { return Impl::LayerForm(report.layer, slot); };
  Lazy(s.batch_requests, impl_->batch_requests, labels, BatchRequestBuckets()).Observe(report.requests);
  Lazy(s.batch_tokens, impl_->batch_tokens, labels, BatchTokenBuckets()).Observe(static_cast<double>(report.tokens));
  MutexLock lock(s.device_mu);
  Impl::DeviceSeries& d = impl_->Device(s, report.layer, slot, report.device);
  d.compute->Observe(report.compute_seconds);
  d.flops->Increment(report.flops);
  if (const auto& t = report.device_seconds) {
    if (d.parts[0] == nullptr) {  // made on a device's first split: the CPU has none
      const char* parts[] = {"inputs", "compute", "outputs"};
      for (size_t i = 0; i < d.parts.size(); ++i) {
        prometheus::Labels labels = Impl::LayerForm(report.layer, slot);
        labels.emplace("device", std::string(report.device));
        labels.emplace("part", parts[i]);
        d.parts[i] = &impl_->device_time.Add(labels, StageBuckets());
      }
    }
    d.parts[0]->Observe(t->inputs);
    d.parts[1]->Observe(t->compute);
    d.parts[2]->Observe(t->outputs);
  }
}

void Metrics::RouteChanged(std::string_view layer, const RouteSplit& split) {
  MutexLock lock(impl_->gauge_mu);
  auto& gauges = impl_->route_gauges[std::string(layer)];
  for (prometheus::Gauge* g : gauges) impl_->route_weight.Remove(g);
  gauges.clear();
  for (const auto& [target, share] : split) {
    prometheus::Gauge& g =
        impl_->route_weight.Add({{"layer", std::string(layer)},
                                 {"form", std::string(target.name())},
                                 {"math", std::string(MathName(target.math.value_or(Math::kFp32)))}});
    g.Set(share);
    gauges.push_back(&g);
  }
  if (gauges.empty()) impl_->route_gauges.erase(std::string(layer));
}

void Metrics::RoutesApplied(uint64_t generation) {
  impl_->routes_generation.Set(static_cast<double>(generation));  // 53 bits: exact
}

void Metrics::RoutesFileLoaded(bool ok) { (ok ? impl_->reload_ok : impl_->reload_error).Increment(); }

void Metrics::ShadowCompared(std::string_view layer, Variant mirror, const DivergenceStats& divergence) {
  const size_t slot = FormSlot(mirror);
  Impl::FormSeries& s = impl_->Series(layer, slot);
  auto labels = [&] { return Impl::LayerForm(layer, slot); };
  Lazy(s.shadow_divergence, impl_->shadow_divergence, labels, DivergenceBuckets()).Observe(divergence.rel_l2);
  Lazy(s.shadow_max_abs, impl_->shadow_max_abs, labels, DivergenceBuckets()).Observe(divergence.max_abs);
  // The served output was finite (the service answered it), so an infinite divergence is the
  // mirror's own NaN or infinity.
  if (std::isinf(divergence.max_abs)) CountNonFiniteOutput(layer, mirror);
}

void Metrics::ShadowDropped(std::string_view layer) {
  Lazy(impl_->Layer(layer).shadow_dropped, impl_->shadow_dropped, [&] {
    return prometheus::Labels{{"layer", std::string(layer)}};
  }).Increment();
}

}  // namespace attnserve
