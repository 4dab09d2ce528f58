#include "server/backend/cuda/device_memory.h"

#include <cuda_runtime.h>  // cudaMalloc of a float**

#include <algorithm>

#include "server/backend/cuda/errors.h"

namespace attnserve::cuda {

std::string BudgetText(const DeviceBudget& b) {
  return "the device memory budget of " + Mib(b.limit()) + " (--max-device-memory-mb; " + Mib(b.held()) + " held)";
}

Status DeviceArray::Reserve(size_t count) {
  if (count <= capacity_) return OkStatus();
  Release();
  const int64_t bytes = static_cast<int64_t>(count * sizeof(float));
  if (budget_ && !budget_->TryTake(bytes)) {
    return ResourceExhaustedError("device memory: " + Mib(bytes) + " more would pass " + BudgetText(*budget_) +
                                  "; retry later or send less at once");
  }
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    ptr_ = nullptr;
    if (budget_) budget_->Give(bytes);
    return CudaCheck(e, "cudaMalloc");
  }
  capacity_ = count;
  cudaGetDevice(&device_);
  return OkStatus();
}

void DeviceArray::Release() {
  if (ptr_ != nullptr) {
    int current = device_;
    cudaGetDevice(&current);
    if (current != device_) cudaSetDevice(device_);
    cudaFree(ptr_);
    if (current != device_) cudaSetDevice(current);
  }
  if (budget_) budget_->Give(static_cast<int64_t>(capacity_ * sizeof(float)));
  ptr_ = nullptr;
  capacity_ = 0;
}

Status DeviceArray::Upload(std::span<const float> host, cudaStream_t stream) {
  if (host.empty()) return OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(Reserve(host.size()));
  CUDA_TRY(cudaMemcpyAsync(ptr_, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  return OkStatus();
}

Status DeviceArray::Upload(std::span<const uint16_t> host, cudaStream_t stream) {
  if (host.empty()) return OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(Reserve((host.size() + 1) / 2));
  CUDA_TRY(cudaMemcpyAsync(ptr_, host.data(), host.size() * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
  return OkStatus();
}

Status GuardZones::Add(const char* piece, float* start, int64_t floats, cudaStream_t stream) {
  zones_.push_back({piece, start, floats});
  CUDA_TRY(cudaMemsetAsync(start, kByte, floats * sizeof(float), stream));
  return OkStatus();
}

Status GuardZones::Check() const {
  for (const Zone& zone : zones_) {
    std::vector<unsigned char> seen(zone.floats * sizeof(float));
    CUDA_TRY(cudaMemcpy(seen.data(), zone.start, seen.size(), cudaMemcpyDeviceToHost));
    const auto hit = std::find_if(seen.begin(), seen.end(), [](unsigned char c) { return c != kByte; });
    if (hit != seen.end()) {
      return InternalError(std::string("workspace guard zone after the ") + zone.piece + " piece overwritten at byte " +
                           std::to_string(hit - seen.begin()) + ": a write ran past its piece");
    }
  }
  return OkStatus();
}

}  // namespace attnserve::cuda
