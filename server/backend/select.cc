#include "server/backend/select.h"

#include <dlfcn.h>
#include <unistd.h>

#include <charconv>
#include <climits>
#include <cstdlib>

#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/plugin_abi.h"

namespace attnserve {
namespace {

// The N of "cuda:N" (0 for "cuda"); -1 when the string is not a cuda device.
int CudaIndex(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5) return -1;
  int index = -1;
  const char* end = device.data() + device.size();
  auto [p, ec] = std::from_chars(device.data() + 5, end, index);
  return ec == std::errc() && p == end && index >= 0 ? index : -1;
}

StatusOr<ChosenBackend> Cpu(const DeviceChoice& choice, std::string why) {
  ATTNSERVE_ASSIGN_OR_RETURN(const GemmLibrary gemm, ParseGemmLibrary(choice.cpu_gemm));
  ATTNSERVE_ASSIGN_OR_RETURN(const WeightLayout layout, ParseWeightLayout(choice.cpu_weight_layout));
  auto cpu = std::make_unique<CpuBackend>(
      CpuBackendOptions{.threads = choice.cpu_threads,
                        .gemm = gemm,
                        .weight_layout = layout,
                        .idle_spin = std::chrono::microseconds(choice.cpu_idle_spin_us)});
  const std::string blas(GemmLibraryName(gemm));
  why += " (" + std::to_string(cpu->threads()) + " threads, " + blas + " GEMMs, " +
         (layout == WeightLayout::kPacked       ? "weights packed, "
          : layout == WeightLayout::kPackedBf16 ? "weights packed as bfloat16, "
                                                : "weights row-major, ") +
         "idle spin " + std::to_string(choice.cpu_idle_spin_us) + " µs, " + std::string(CpuIsa()) + ")";
  return ChosenBackend{std::move(cpu), std::move(why), blas};
}

#ifdef ATTNSERVE_CUDA_PLUGIN
// The CUDA plugin next to this executable, or where ATTNSERVE_CUDA_PLUGIN_PATH says.
std::string PluginPath() {
  if (const char* path = std::getenv("ATTNSERVE_CUDA_PLUGIN_PATH")) return path;
  char exe[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) return ATTNSERVE_CUDA_PLUGIN;
  std::string dir(exe, len);
  return dir.substr(0, dir.rfind('/') + 1) + ATTNSERVE_CUDA_PLUGIN;
}
#endif

}  // namespace

StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, int index, bool tf32,
                                                  int64_t max_device_bytes) {
  // Never unloaded: the backend's code lives there for the life of the process.
  void* plugin = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (plugin == nullptr) return UnavailableError(std::string("cannot load the CUDA backend: ") + dlerror());
  auto entry = reinterpret_cast<AttnserveBackendPluginFn>(dlsym(plugin, "AttnserveBackendPlugin"));
  const AttnservePluginApi* api = entry == nullptr ? nullptr : entry();
  if (api == nullptr) {
    return UnavailableError(path + ": not an attnserve backend plugin (no AttnserveBackendPlugin table; a plugin "
                            "from before the versioned ABI?)");
  }
  // Checked before anything of the plugin runs: what crosses the boundary is C++.
  if (api->abi_version != ATTNSERVE_PLUGIN_ABI_VERSION) {
    return UnavailableError(path + ": plugin ABI version " + std::to_string(api->abi_version) +
                            ", this server speaks version " + std::to_string(ATTNSERVE_PLUGIN_ABI_VERSION) +
                            "; use the plugin built with this server");
  }
  const std::string plugin_build = api->build_id == nullptr ? "" : api->build_id;
  if (plugin_build != ATTNSERVE_BUILD_ID) {
    return UnavailableError(path + ": plugin from build '" + plugin_build + "', this server is build '" +
                            ATTNSERVE_BUILD_ID + "'; use the plugin built with this server");
  }
  char why[512] = "";
  if (api->device_count(why, sizeof why) == 0) return UnavailableError(std::string("no usable GPU: ") + why);
  Backend* backend = api->make_backend(index, tf32, max_device_bytes, why, sizeof why);
  if (backend == nullptr) return UnavailableError(why);
  return std::unique_ptr<Backend>(backend);
}

bool BuiltWithCuda() {
#ifdef ATTNSERVE_CUDA_PLUGIN
  return true;
#else
  return false;
#endif
}

Status ValidateDevice(const std::string& device) {
  if (device == "auto" || device == "cpu" || CudaIndex(device) >= 0) return OkStatus();
  return InvalidArgumentError("device: expected auto, cpu, cuda or cuda:N, got '" + device + "'");
}

Status ValidateCpuGemm(const std::string& gemm) { return ParseGemmLibrary(gemm).status(); }

Status ValidateCpuWeightLayout(const std::string& layout) { return ParseWeightLayout(layout).status(); }

StatusOr<ChosenBackend> ChooseBackend(const DeviceChoice& choice) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateDevice(choice.device));
  if (choice.device == "cpu") return Cpu(choice, "cpu: asked for");
  const int index = choice.device == "auto" ? 0 : CudaIndex(choice.device);
#ifdef ATTNSERVE_CUDA_PLUGIN
  auto gpu = LoadCudaPlugin(PluginPath(), index, choice.tf32, choice.max_device_bytes);
  if (gpu.ok()) {
    return ChosenBackend{std::move(gpu).value(),
                         "cuda:" + std::to_string(index) + ": " +
                             (choice.device == "auto" ? "a usable GPU is present" : "asked for") +
                             (choice.tf32 ? ", TF32 GEMMs" : ", fp32 GEMMs"),
                         choice.tf32 ? "cublas-tf32" : "cublas"};
  }
  if (choice.device != "auto") return UnavailableError("--device " + choice.device + ": " + gpu.status().message());
  return Cpu(choice, "cpu: " + gpu.status().message());
#else
  if (choice.device != "auto") {
    return UnavailableError("--device " + choice.device +
                            ": this build has no CUDA backend (built without the CUDA toolkit)");
  }
  (void)index;
  return Cpu(choice, "cpu: this build has no CUDA backend");
#endif
}

}  // namespace attnserve
