#include "server/device_watch.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <vector>

namespace attnserve {

DeviceWatch::DeviceWatch(Backend* backend, Metrics* metrics, const std::string& nvml_library) : backend_(backend) {
  if (!backend_->DeviceMemory().has_value()) return;  // the CPU: no device of its own to watch
  gauges_ = std::make_unique<DeviceGauges>(*metrics, backend_->DeviceName());
  if (nvml_library.empty()) return;
  std::string why;
  telemetry_ = GpuTelemetry::Open(nvml_library, backend_->PciBusId(), &why);
  if (telemetry_ == nullptr) {
    spdlog::info("no GPU telemetry for {} (the attnserve_gpu_* gauges are absent): {}", backend_->DeviceName(), why);
  }
}

Status DeviceWatch::Warm(const LayerStore& store, int workers) {
  const std::vector<std::shared_ptr<const Layer>> layers = store.List();  // held while they warm
  std::vector<const ResidentForm*> forms;
  for (const auto& layer : layers) {
    for (const ResidentForm* resident : layer->AllResident()) forms.push_back(resident);
  }
  const auto start = std::chrono::steady_clock::now();
  const Status st = backend_->Warmup(workers, forms);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!st.ok()) {
    if (!backend_->Healthy()) return Status(st.code(), "cannot warm " + backend_->DeviceName() + ": " + st.message());
    spdlog::warn("{}: warmup failed, serving cold: {}", backend_->DeviceName(), st.message());
  } else if (gauges_ != nullptr) {
    spdlog::info("{} warmed: {} lanes over {} forms in {:.1f} ms", backend_->DeviceName(), workers, forms.size(), ms);
  }
  Refresh();
  return OkStatus();
}

void DeviceWatch::Refresh() {
  if (gauges_ == nullptr) return;
  if (const auto memory = backend_->DeviceMemory()) {
    gauges_->SetDeviceMemory(memory->held_bytes, memory->limit_bytes, memory->lanes);
  }
  if (telemetry_ != nullptr) gauges_->SetGpuSample(telemetry_->Sample());
}

}  // namespace attnserve
