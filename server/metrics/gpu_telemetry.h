// GPU telemetry through NVML, loaded at run time: dlopen("libnvidia-ml.so.1"), the library the
// NVIDIA driver installs, so that the server neither links against it nor needs its headers
// (the few functions and structs used are declared in gpu_telemetry.cc from NVML's ABI). On a
// machine without the driver (the CPU, tests, a container without the NVIDIA runtime) Open
// finds nothing and the gauges are simply absent: not an error.
// Thread-safety: Sample may be called from one thread at a time (the server's monitor).
#pragma once

#include <memory>
#include <optional>
#include <string>

namespace attnserve {

// One reading of a device (gauges attnserve_gpu_*, docs/metrics.md); a quantity NVML did not
// report (power on some boards, anything after the device fell off the bus) is nullopt.
// (The `{}`s let a designated initializer leave a quantity out without GCC's
// -Wmissing-field-initializers.)
struct GpuSample {
  std::optional<double> utilization{};    // share of the last sample period a kernel ran, 0 … 1
  std::optional<double> memory_used{};    // bytes, every process's
  std::optional<double> memory_total{};   // bytes
  std::optional<double> temperature_c{};  // the GPU die, degrees Celsius
  std::optional<double> power_w{};        // board power draw, watts
};

class GpuTelemetry {
 public:
  // The device with PCI bus id `pci_bus_id` (Backend::PciBusId) through the NVML library
  // `library` (a name the dynamic loader searches for, or a path). nullptr with the reason in
  // `why` when the library is absent, NVML does not initialise or does not know the device.
  static std::unique_ptr<GpuTelemetry> Open(const std::string& library, const std::string& pci_bus_id,
                                            std::string* why);
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  GpuSample Sample() const;

 private:
  struct Api;
  explicit GpuTelemetry(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

// The NVML library's name the server opens: "libnvidia-ml.so.1" (found through the loader's
// search path, LD_LIBRARY_PATH included).
inline constexpr const char* kNvmlLibrary = "libnvidia-ml.so.1";

}  // namespace attnserve
