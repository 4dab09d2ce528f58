// The device gauges an operator of a GPU reads (docs/metrics.md, "The device"): the GPU
// backend's budget and lanes (attnserve_device_memory_*_bytes, attnserve_device_lanes) and
// NVML's readings (attnserve_gpu_*), each labelled with the device ("cuda:0"). A gauge is
// added the first time it has a value, so on the CPU, or without NVML, the series are absent
// rather than zero. Families are declared in metrics.cc's MetricFamilies.
// Thread-safety: every method may be called from any thread at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "server/metrics/gpu_telemetry.h"
#include "server/metrics/metrics.h"

namespace attnserve {

class DeviceGauges {
 public:
  DeviceGauges(Metrics& metrics, std::string device);
  ~DeviceGauges();
  DeviceGauges(const DeviceGauges&) = delete;
  DeviceGauges& operator=(const DeviceGauges&) = delete;

  // The backend's DeviceMemory().
  void SetDeviceMemory(int64_t held_bytes, int64_t limit_bytes, int lanes);
  // One NVML reading; its absent quantities leave their gauges as they were (or absent).
  void SetGpuSample(const GpuSample& sample);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve
