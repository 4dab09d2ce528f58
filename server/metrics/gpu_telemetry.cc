#include "server/metrics/gpu_telemetry.h"

#include <dlfcn.h>

#include <string>
#include <utility>

// NVML's C ABI, declared here rather than taken from nvml.h (which the CUDA toolkit ships, and
// the server must build without): these are the declarations of nvml.h as NVIDIA documents them
// (NVML API Reference, "Device Queries" and "Initialization and Cleanup"), stable since NVML's
// _v2 entry points (driver 325). nvmlReturn_t is a C enum (int), NVML_SUCCESS = 0; a device is
// an opaque pointer; nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU = 0. The types are at global
// scope with nvml.h's struct tags, as a C library's are: a call through a pointer whose type
// names other types is undefined (UBSan's -fsanitize=function reports it against the test's
// stand-in, tests/cuda_emulation/fake_nvml.cc, which declares the same).
typedef struct nvmlDevice_st* nvmlDevice_t;
typedef struct nvmlUtilization_st {
  unsigned int gpu;     // percent of the last sample period a kernel ran
  unsigned int memory;  // percent of it device memory was read or written
} nvmlUtilization_t;
typedef struct nvmlMemory_st {
  unsigned long long total;  // bytes
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

namespace attnserve {
namespace {

using nvmlReturn_t = int;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlTemperatureGpu = 0;

template <typename Fn>
bool Bind(void* library, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(library, name));
  return *fn != nullptr;
}

}  // namespace

struct GpuTelemetry::Api {
  void* library = nullptr;
  nvmlDevice_t device = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*by_bus_id)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*temperature)(nvmlDevice_t, int, unsigned int*) = nullptr;
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned int*) = nullptr;  // milliwatts
  bool initialised = false;

  ~Api() {
    if (initialised) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

std::unique_ptr<GpuTelemetry> GpuTelemetry::Open(const std::string& library, const std::string& pci_bus_id,
                                                  std::string* why) {
  auto fail = [why](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return nullptr;
  };
  if (pci_bus_id.empty()) return fail("the device has no PCI bus id");
  auto api = std::make_unique<Api>();
  api->library = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api->library == nullptr) {
    const char* error = dlerror();
    return fail("cannot load " + library + (error != nullptr ? std::string(": ") + error : std::string()));
  }
  const bool bound = Bind(api->library, "nvmlInit_v2", &api->init) &&
                     Bind(api->library, "nvmlShutdown", &api->shutdown) &&
                     Bind(api->library, "nvmlDeviceGetHandleByPciBusId_v2", &api->by_bus_id) &&
                     Bind(api->library, "nvmlDeviceGetUtilizationRates", &api->utilization) &&
                     Bind(api->library, "nvmlDeviceGetMemoryInfo", &api->memory) &&
                     Bind(api->library, "nvmlDeviceGetTemperature", &api->temperature) &&
                     Bind(api->library, "nvmlDeviceGetPowerUsage", &api->power);
  if (!bound) return fail(library + " lacks an NVML function the server reads");
  if (const nvmlReturn_t r = api->init(); r != kNvmlSuccess) return fail("nvmlInit_v2 returned " + std::to_string(r));
  api->initialised = true;
  if (const nvmlReturn_t r = api->by_bus_id(pci_bus_id.c_str(), &api->device); r != kNvmlSuccess) {
    return fail("NVML does not know the device at PCI bus id " + pci_bus_id + " (" + std::to_string(r) + ")");
  }
  return std::unique_ptr<GpuTelemetry>(new GpuTelemetry(std::move(api)));
}

GpuTelemetry::GpuTelemetry(std::unique_ptr<Api> api) : api_(std::move(api)) {}
GpuTelemetry::~GpuTelemetry() = default;

GpuSample GpuTelemetry::Sample() const {
  GpuSample s;
  nvmlUtilization_t utilization{};
  if (api_->utilization(api_->device, &utilization) == kNvmlSuccess) s.utilization = utilization.gpu / 100.0;
  nvmlMemory_t memory{};
  if (api_->memory(api_->device, &memory) == kNvmlSuccess) {
    s.memory_used = static_cast<double>(memory.used);
    s.memory_total = static_cast<double>(memory.total);
  }
  unsigned int celsius = 0;
  if (api_->temperature(api_->device, kNvmlTemperatureGpu, &celsius) == kNvmlSuccess) s.temperature_c = celsius;
  unsigned int milliwatts = 0;
  if (api_->power(api_->device, &milliwatts) == kNvmlSuccess) s.power_w = milliwatts / 1000.0;
  return s;
}

}  // namespace attnserve
