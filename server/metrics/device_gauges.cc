#include "server/metrics/device_gauges.h"

#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <array>
#include <optional>
#include <utility>

#include "server/core/thread_annotations.h"

namespace attnserve {
namespace {

// The gauges, in the order of Impl::gauges.
constexpr std::array<std::string_view, 8> kNames = {
    "attnserve_device_memory_held_bytes", "attnserve_device_memory_limit_bytes", "attnserve_device_lanes",
    "attnserve_gpu_utilization_ratio",    "attnserve_gpu_memory_used_bytes",     "attnserve_gpu_memory_total_bytes",
    "attnserve_gpu_temperature_celsius",  "attnserve_gpu_power_watts"};
enum Gauge { kHeld, kLimit, kLanes, kUtilization, kMemoryUsed, kMemoryTotal, kTemperature, kPower };

std::string HelpOf(std::string_view name) {
  for (const MetricFamilySpec& f : MetricFamilies()) {
    if (f.name == name) return std::string(f.help);
  }
  return std::string(name);
}

}  // namespace

struct DeviceGauges::Impl {
  std::string device;
  Mutex mu;
  std::array<prometheus::Family<prometheus::Gauge>*, kNames.size()> families = {};
  std::array<prometheus::Gauge*, kNames.size()> gauges ATTNSERVE_GUARDED_BY(mu) = {};

  void Set(Gauge g, std::optional<double> value) {
    if (!value) return;
    MutexLock lock(mu);
    if (gauges[g] == nullptr) gauges[g] = &families[g]->Add({{"device", device}});
    gauges[g]->Set(*value);
  }
};

DeviceGauges::DeviceGauges(Metrics& metrics, std::string device) : impl_(std::make_unique<Impl>()) {
  impl_->device = std::move(device);
  for (size_t i = 0; i < kNames.size(); ++i) {
    impl_->families[i] =
        &prometheus::BuildGauge().Name(std::string(kNames[i])).Help(HelpOf(kNames[i])).Register(*metrics.registry());
  }
}

DeviceGauges::~DeviceGauges() = default;

void DeviceGauges::SetDeviceMemory(int64_t held_bytes, int64_t limit_bytes, int lanes) {
  impl_->Set(kHeld, static_cast<double>(held_bytes));
  impl_->Set(kLimit, static_cast<double>(limit_bytes));
  impl_->Set(kLanes, lanes);
}

void DeviceGauges::SetGpuSample(const GpuSample& sample) {
  impl_->Set(kUtilization, sample.utilization);
  impl_->Set(kMemoryUsed, sample.memory_used);
  impl_->Set(kMemoryTotal, sample.memory_total);
  impl_->Set(kTemperature, sample.temperature_c);
  impl_->Set(kPower, sample.power_w);
}

}  // namespace attnserve
