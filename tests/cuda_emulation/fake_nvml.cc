// A stand-in for the NVIDIA driver's NVML (libnvidia-ml.so.1) with known readings, for the
// tests of the attnserve_gpu_* gauges: the server finds it through LD_LIBRARY_PATH or
// --nvml-library and reads it as it reads the real one (server/metrics/gpu_telemetry.cc). It
// knows one device, the emulated cuda:0's PCI bus id (cudaDeviceGetPCIBusId: "0000:10:00.0"),
// refuses queries before nvmlInit_v2, and answers as nvml.h documents: NVML_SUCCESS 0,
// NVML_ERROR_UNINITIALIZED 1, NVML_ERROR_INVALID_ARGUMENT 2, NVML_ERROR_NOT_FOUND 6.
#include <cstring>

// nvml.h's types, with its struct tags, as the server declares them (server/metrics/
// gpu_telemetry.cc): the server calls these functions through pointers of those types.
typedef struct nvmlDevice_st* nvmlDevice_t;
typedef struct nvmlUtilization_st {
  unsigned int gpu, memory;
} nvmlUtilization_t;
typedef struct nvmlMemory_st {
  unsigned long long total, free, used;
} nvmlMemory_t;
struct nvmlDevice_st {
  int unused;
};

namespace {
int initialised = 0;
nvmlDevice_st the_device{};  // its address is the handle
constexpr const char* kBusIds[] = {"0000:10:00.0", "00000000:10:00.0"};

int Check(nvmlDevice_t device) {
  if (initialised == 0) return 1;
  return device == &the_device ? 0 : 2;
}
}  // namespace

extern "C" {

// The readings the tests expect (tests/unit/gpu_telemetry_test.cc, cuda_emulated_server_test).
constexpr unsigned int kUtilizationPercent = 37;
constexpr unsigned long long kMemoryTotal = 80ull << 30, kMemoryUsed = (3ull << 30) + (5ull << 20);
constexpr unsigned int kTemperature = 61, kPowerMilliwatts = 212345;

__attribute__((visibility("default"))) int nvmlInit_v2() {
  ++initialised;
  return 0;
}
__attribute__((visibility("default"))) int nvmlShutdown() {
  if (initialised == 0) return 1;
  --initialised;
  return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, nvmlDevice_t* device) {
  if (initialised == 0) return 1;
  if (bus_id == nullptr || device == nullptr) return 2;
  for (const char* known : kBusIds) {
    if (std::strcmp(bus_id, known) == 0) {
      *device = &the_device;
      return 0;
    }
  }
  return 6;
}
__attribute__((visibility("default"))) int nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* u) {
  if (const int r = Check(device)) return r;
  u->gpu = kUtilizationPercent;
  u->memory = 12;
  return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* m) {
  if (const int r = Check(device)) return r;
  m->total = kMemoryTotal;
  m->used = kMemoryUsed;
  m->free = kMemoryTotal - kMemoryUsed;
  return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int* celsius) {
  if (const int r = Check(device)) return r;
  if (sensor != 0) return 2;
  *celsius = kTemperature;
  return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int* milliwatts) {
  if (const int r = Check(device)) return r;
  *milliwatts = kPowerMilliwatts;
  return 0;
}

}  // extern "C"
