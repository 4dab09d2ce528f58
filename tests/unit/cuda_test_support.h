// What the CUDA backend's tests share (on the emulated or a real device): device memory freed
// at the end of a scope, and the batch whose launch counts are pinned.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "tests/unit/test_support.h"

namespace attnserve::testing {

// Device memory for a test, filled from the host at construction, read back with Read().
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

// The batch the launch counts are pinned on (docs/architecture.md, "The CUDA backend"): 70
// short GQA sequences (h 4, h_kv 2) of 5 shapes with RoPE, every other one causal, on a factored
// layer without biases. Runs it once on a backend made with `options`, the emulation's counters
// reset right before the forward, checks every answer against float64 and returns the counters.
inline constexpr int64_t kPinnedBatchSequences = 70, kPinnedBatchShapes = 5;
inline cuda_emulation::Counters RunPinnedLaunchBatch(const CudaBackendOptions& options, std::mt19937_64& rng) {
  auto made = MakeCudaBackend(options);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return {};
  const LayerWeights w = RandomLayerWeights(
      *CompleteConfig({.d_model = 32, .heads = 4, .kv_heads = 2, .bias = false, .rope_theta = 10000.0}), rng());
  auto resident = (*made)->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  EXPECT_TRUE(resident.ok()) << resident.status().ToString();
  if (!resident.ok()) return {};
  std::vector<OwnedSequence> seqs;
  std::vector<Sequence> batch;
  for (int64_t i = 0; i < kPinnedBatchSequences; ++i) {
    const int64_t n = 1 + i % kPinnedBatchShapes;
    seqs.push_back(RandomSequence(rng, 32, n, n, false, i % 2 == 0, -1));
    seqs.back().position_offset = 100 * i;
  }
  for (auto& s : seqs) batch.push_back(s.View());
  cuda_emulation::ResetCounters();
  EXPECT_TRUE((*made)->Forward(**resident, batch).ok());
  const cuda_emulation::Counters counters = cuda_emulation::ReadCounters();
  for (size_t r = 0; r < seqs.size(); ++r) {
    EXPECT_LT(RelativeL2(seqs[r].output.data(), ReferenceForward(w, batch[r])), 1e-5) << "sequence " << r;
  }
  return counters;
}

}  // namespace attnserve::testing
