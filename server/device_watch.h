// What the server does for its device around serving (docs/service.md, "The device"): warms it
// before the listeners report ready (Backend::Warmup, a lane per worker over every held form),
// and keeps the device gauges fresh — the backend's budget and lanes, and NVML's readings when
// the NVIDIA driver's library is there (server/metrics/gpu_telemetry.h).
// Thread-safety: Warm runs once at start-up; Refresh from one thread (the server's monitor).
#pragma once

#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/core/status.h"
#include "server/metrics/device_gauges.h"
#include "server/metrics/gpu_telemetry.h"
#include "server/metrics/metrics.h"
#include "server/store/layer_store.h"

namespace attnserve {

class DeviceWatch {
 public:
  // `nvml_library`: ServerOptions::nvml_library (empty: none). On the CPU nothing is watched.
  DeviceWatch(Backend* backend, Metrics* metrics, const std::string& nvml_library);

  // A lane per worker, each run over every form `store` holds, before the server is ready. A
  // lost device fails the start; another failure (a budget too small for the warmup batch) is
  // logged and the server starts cold.
  Status Warm(const LayerStore& store, int workers);

  // Reads the budget and NVML into the gauges.
  void Refresh();

 private:
  Backend* backend_;
  std::unique_ptr<DeviceGauges> gauges_;     // null on the CPU
  std::unique_ptr<GpuTelemetry> telemetry_;  // null without NVML
};

}  // namespace attnserve
