// Choosing the backend at start-up: `--device auto|cpu|cuda[:N]`.
// Thread-safety: call once, from main, before serving.
#pragma once

#include <memory>
#include <string>

#include "server/backend/backend.h"

namespace attnserve {

struct DeviceChoice {
  std::string device = "auto";  // auto: a usable GPU when there is one, else the CPU
  int cpu_threads = 0;          // the CPU backend's threads (0: every core)
  bool tf32 = false;            // GPU GEMMs on TF32 tensor cores
};

struct ChosenBackend {
  std::unique_ptr<Backend> backend;
  std::string why;  // one line for the log: what was chosen and why
};

// Checks the device string without touching any device: "auto", "cpu", "cuda" or "cuda:N".
Status ValidateDevice(const std::string& device);

// An explicit cuda with no usable GPU (or a build without CUDA) fails with UNAVAILABLE saying
// why; auto falls back to the CPU and says why in `why`.
StatusOr<ChosenBackend> ChooseBackend(const DeviceChoice& choice);

// True when this build has the CUDA backend.
bool BuiltWithCuda();

}  // namespace attnserve
