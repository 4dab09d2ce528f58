#include "server/backend/select.h"

#include <dlfcn.h>
#include <unistd.h>

#include <charconv>
#include <climits>
#include <cstdlib>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda_options.h"
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

StatusOr<ChosenBackend> Cpu(const CpuBackendOptions& options, std::string why) {
  const WeightLayout layout = options.weight_layout;
  auto cpu = std::make_unique<CpuBackend>(options);
  const std::string blas(GemmLibraryName(options.gemm));
  why += " (" + std::to_string(cpu->threads()) + " threads, " + blas + " GEMMs, " +
         (layout == WeightLayout::kPacked          ? "weights packed, "
          : layout == WeightLayout::kPackedBf16    ? "weights packed as bfloat16, "
          : layout == WeightLayout::kPackedBf16Dot ? "weights and projection inputs in bfloat16 (vdpbf16ps), "
          : layout == WeightLayout::kPackedFp16    ? "weights packed as IEEE half, "
                                                   : "weights row-major, ") +
         "idle spin " + std::to_string(options.idle_spin.count()) + " µs, " + std::string(CpuIsa()) + ")";
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

StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, int index, Math math,
                                                  int64_t max_device_bytes) {
  return LoadCudaPlugin(path, CudaBackendOptions{.device = index, .math = math, .max_device_bytes = max_device_bytes});
}

StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, const CudaBackendOptions& options) {
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
  const OptionPairs pairs = EncodeCudaOptions(options);
  std::vector<AttnserveOption> items;
  const AttnserveOptions data = CudaOptionsView(pairs, &items);
  Backend* backend = api->make_backend(&data, why, sizeof why);
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

StatusOr<ChosenBackend> ChooseBackend(const BackendOptions& options) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateDevice(options.device));
  if (options.device == "cpu") return Cpu(options.cpu, "cpu: asked for");
  CudaBackendOptions cuda = options.cuda;
  cuda.device = options.device == "auto" ? 0 : CudaIndex(options.device);
#ifdef ATTNSERVE_CUDA_PLUGIN
  auto gpu = LoadCudaPlugin(PluginPath(), cuda);
  if (gpu.ok()) {
    return ChosenBackend{std::move(gpu).value(),
                         "cuda:" + std::to_string(cuda.device) + ": " +
                             (options.device == "auto" ? "a usable GPU is present" : "asked for") +
                             ", " + std::string(MathName(cuda.math)) + " GEMMs, " +
                             std::to_string(cuda.staging_threads) + " staging threads" +
                             (cuda.summed_mix_first ? ", summed mix-first" : "") +
                             (cuda.gemm_attention ? ", GEMM attention" : ""),
                         cuda.math == Math::kFp32 ? "cublas" : "cublas-" + std::string(MathName(cuda.math))};
  }
  if (options.device != "auto") return UnavailableError("--device " + options.device + ": " + gpu.status().message());
  return Cpu(options.cpu, "cpu: " + gpu.status().message());
#else
  if (options.device != "auto") {
    return UnavailableError("--device " + options.device +
                            ": this build has no CUDA backend (built without the CUDA toolkit)");
  }
  return Cpu(options.cpu, "cpu: this build has no CUDA backend");
#endif
}

}  // namespace attnserve
