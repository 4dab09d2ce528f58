// Choosing the backend at start-up: `--device auto|cpu|cuda[:N]`.
// Thread-safety: call once, from main, before serving.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"

namespace attnserve {

// What the server asks of its backend: the device, and each kind's own options (the kind chosen
// takes its own), typed: the settings parse every enum once (server/settings_table.cc).
struct BackendOptions {
  std::string device = "auto";  // auto: a usable GPU when there is one, else the CPU
  CpuBackendOptions cpu;
  CudaBackendOptions cuda;  // its `device` is set from `device`'s index
};

struct ChosenBackend {
  std::unique_ptr<Backend> backend;
  std::string why;   // one line for the log: what was chosen and why
  std::string blas;  // what computes its GEMMs: onednn, eigen, cublas or cublas-tf32
};

// Checks the device string without touching any device: "auto", "cpu", "cuda" or "cuda:N".
Status ValidateDevice(const std::string& device);

// An explicit cuda with no usable GPU (or a build without CUDA) fails with UNAVAILABLE saying
// why; auto falls back to the CPU and says why in `why`.
StatusOr<ChosenBackend> ChooseBackend(const BackendOptions& options);

// True when this build has the CUDA backend.
bool BuiltWithCuda();

// Loads the CUDA backend plugin at `path` (dlopen; never unloaded) and makes a backend with
// `options`, which cross as data (cuda_options.h). UNAVAILABLE with the reason when the file is
// not a plugin, no GPU is usable or the plugin refuses an option (the message names it).
// ChooseBackend calls it with the plugin next to the executable; tests call it with the plugin
// they built, so that no test binary links cuBLAS (hundreds of MB mapped before main, which
// from a cold page cache outlasts CTest's test discovery).
StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, const CudaBackendOptions& options);
// The same with the defaults but for the device, the GEMMs' math and the device memory bound.
StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, int index, Math math,
                                                  int64_t max_device_bytes = 0);

}  // namespace attnserve
