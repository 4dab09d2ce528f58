// Device memory for a CUDA test (on the emulated or a real device), freed at the end of the
// scope: filled from the host at construction, read back with Read().
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "cuda_runtime_api.h"

namespace attnserve::testing {

struct DeviceVector {
  explicit DeviceVector(const std::vector<float>& host) : size(host.size()) {
    EXPECT_EQ(cudaMalloc(&data, size * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), size * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(data); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  std::vector<float> Read() const {
    std::vector<float> host(size);
    EXPECT_EQ(cudaMemcpy(host.data(), data, size * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  float* data = nullptr;
  size_t size;
};

}  // namespace attnserve::testing
