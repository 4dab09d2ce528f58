// Choosing the backend at start-up: `--device auto|cpu|cuda[:N]`.
// Thread-safety: call once, from main, before serving.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "server/backend/backend.h"

namespace attnserve {

struct DeviceChoice {
  std::string device = "auto";  // auto: a usable GPU when there is one, else the CPU
  int cpu_threads = 0;          // the CPU backend's threads (0: every core)
  int cpu_idle_spin_us = 500;   // how long its helper threads spin after a forward (ComputeTeam)
  std::string cpu_gemm = "auto";  // the CPU backend's GEMM library: auto, eigen or onednn
  // How the CPU backend holds the weights: auto, packed or plain (packed_weights.h).
  std::string cpu_weight_layout = "auto";
  bool tf32 = false;            // GPU GEMMs on TF32 tensor cores
  // Device memory the GPU backend may hold (weights and workspaces); 0: its default share of
  // the device (CudaBackendOptions::max_device_bytes).
  int64_t max_device_bytes = 0;
};

struct ChosenBackend {
  std::unique_ptr<Backend> backend;
  std::string why;   // one line for the log: what was chosen and why
  std::string blas;  // what computes its GEMMs: onednn, eigen, cublas or cublas-tf32
};

// Checks the device string without touching any device: "auto", "cpu", "cuda" or "cuda:N".
Status ValidateDevice(const std::string& device);

// Checks the CPU GEMM library's name: "auto", "eigen" or "onednn" (when this build has oneDNN).
Status ValidateCpuGemm(const std::string& gemm);

// Checks the CPU weight layout: "auto", "packed" (where the backend's own kernel runs) or "plain".
Status ValidateCpuWeightLayout(const std::string& layout);

// An explicit cuda with no usable GPU (or a build without CUDA) fails with UNAVAILABLE saying
// why; auto falls back to the CPU and says why in `why`.
StatusOr<ChosenBackend> ChooseBackend(const DeviceChoice& choice);

// True when this build has the CUDA backend.
bool BuiltWithCuda();

// Loads the CUDA backend plugin at `path` (dlopen; never unloaded) and makes a backend on
// device `index`. UNAVAILABLE with the reason when the file is not a plugin or no GPU is
// usable. ChooseBackend calls it with the plugin next to the executable; tests call it with
// the plugin they built, so that no test binary links cuBLAS (hundreds of MB mapped before
// main, which from a cold page cache outlasts CTest's test discovery).
StatusOr<std::unique_ptr<Backend>> LoadCudaPlugin(const std::string& path, int index, bool tf32,
                                                  int64_t max_device_bytes = 0);

}  // namespace attnserve
