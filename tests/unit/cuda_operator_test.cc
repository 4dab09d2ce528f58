// What an operator of the CUDA backend relies on, on the emulated device (tests/cuda_emulation):
// warmup readies every lane before the server reports ready, so the first concurrent requests
// make no stream, cuBLAS handle or allocation; the device budget and lanes as the gauges read
// them; each worker's own batch split (ThisThreadsDeviceTimes); the PCI bus id NVML is asked for.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using testing::RandomSequence;
using testing::RelativeL2;

class CudaOperatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda_emulation::Reset();
    cudaGetLastError();
  }
  void TearDown() override {
    cuda_emulation::SetStreamSyncHook(nullptr);
    cuda_emulation::Reset();
  }
  std::mt19937_64 rng_{testing::TestSeed()};
};

LayerWeights OperatorLayer(uint64_t seed) {
  return RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4, .kv_heads = 2, .d_head = 8, .bias = true}),
                            seed);
}

struct Served {
  std::unique_ptr<Backend> backend;
  std::vector<std::shared_ptr<const ResidentForm>> forms;  // factored, summed
};

Served Serve(const LayerWeights& w) {
  Served s;
  auto made = MakeCudaBackend({});
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return s;
  s.backend = std::move(made).value();
  for (auto form : {MaterializeFactored(w), MaterializeSummed(w)}) {
    auto resident = s.backend->Upload(std::make_shared<const FormWeights>(std::move(form)));
    EXPECT_TRUE(resident.ok()) << resident.status().ToString();
    if (resident.ok()) s.forms.push_back(*resident);
  }
  return s;
}

// kCallers callers at once, each one request (a random length up to the warmup's, self- or
// cross-attention, either form), each held at its stream's synchronisation until all have
// issued theirs, so that each runs on a lane of its own. Returns the worst relative error
// against float64 and what the device did meanwhile.
constexpr int kCallers = 3;
struct ConcurrentRun {
  double worst = 0;
  bool all_in_flight = true;
  cuda_emulation::Counters counters;
};
ConcurrentRun RunConcurrently(Served& s, const LayerWeights& w, uint64_t seed) {
  ConcurrentRun run;
  std::mutex mu;
  std::condition_variable all_in;
  int arrived = 0;
  cuda_emulation::ResetCounters();
  cuda_emulation::SetStreamSyncHook([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (arrived >= kCallers) return;
    ++arrived;
    all_in.notify_all();
    if (!all_in.wait_for(lock, std::chrono::seconds(10), [&] { return arrived >= kCallers; })) {
      run.all_in_flight = false;
    }
  });
  std::vector<double> worst(kCallers, 0.0);
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      const bool cross = t == 1;
      const int64_t n = std::uniform_int_distribution<int64_t>(8, cross ? 16 : 64)(rng);
      const int64_t m = cross ? std::uniform_int_distribution<int64_t>(8, 64)(rng) : n;
      testing::OwnedSequence seq = RandomSequence(rng, 32, n, m, cross, t == 2, -1);
      const Sequence batch[] = {seq.View()};
      const ResidentForm& form = *s.forms[t % s.forms.size()];
      if (!s.backend->Forward(form, batch).ok()) {
        worst[t] = INFINITY;
        return;
      }
      worst[t] = RelativeL2(seq.output.data(), ReferenceForward(w, seq.View()));
    });
  }
  for (auto& c : callers) c.join();
  cuda_emulation::SetStreamSyncHook(nullptr);
  run.counters = cuda_emulation::ReadCounters();
  for (double e : worst) run.worst = std::max(run.worst, e);
  return run;
}

std::vector<const ResidentForm*> Raw(const Served& s) {
  std::vector<const ResidentForm*> raw;
  for (const auto& f : s.forms) raw.push_back(f.get());
  return raw;
}

TEST_F(CudaOperatorTest, WarmupReadiesEveryLaneSoTheFirstConcurrentRequestsInitialiseNothing) {
  const LayerWeights w = OperatorLayer(rng_());
  Served warm = Serve(w);
  ASSERT_NE(warm.backend, nullptr);
  const std::vector<const ResidentForm*> forms = Raw(warm);
  cuda_emulation::ResetCounters();
  ASSERT_TRUE(warm.backend->Warmup(kCallers, forms).ok());
  const cuda_emulation::Counters warming = cuda_emulation::ReadCounters();
  EXPECT_EQ(warming.streams_created, kCallers - 1) << "one lane existed since Init";
  EXPECT_EQ(warming.blas_handles_created, kCallers - 1);
  // Every lane ran every form: 2 forms · kCallers lanes, each at least one GEMM and a launch.
  EXPECT_GE(warming.gemm_calls, 2 * kCallers * 2);
  EXPECT_GE(warming.kernel_launches, 2 * kCallers);
  ASSERT_TRUE(warm.backend->DeviceMemory().has_value());
  EXPECT_EQ(warm.backend->DeviceMemory()->lanes, kCallers);

  const ConcurrentRun after = RunConcurrently(warm, w, rng_());
  EXPECT_TRUE(after.all_in_flight);
  EXPECT_LT(after.worst, 1e-5);
  EXPECT_EQ(after.counters.streams_created, 0) << "a lane was made for a request";
  EXPECT_EQ(after.counters.blas_handles_created, 0) << "a cuBLAS handle was made for a request";
  EXPECT_EQ(after.counters.device_allocations, 0) << "a request allocated device memory";
  EXPECT_EQ(after.counters.pinned_allocations, 0) << "a request allocated pinned memory";
  EXPECT_EQ(warm.backend->DeviceMemory()->lanes, kCallers);

  // The same requests on a backend that was not warmed do all of that: what the counts above
  // would show if Warmup readied fewer lanes, or none.
  Served cold = Serve(w);
  ASSERT_NE(cold.backend, nullptr);
  const ConcurrentRun first = RunConcurrently(cold, w, rng_());
  EXPECT_LT(first.worst, 1e-5);
  EXPECT_EQ(first.counters.streams_created, kCallers - 1);
  EXPECT_EQ(first.counters.blas_handles_created, kCallers - 1);
  EXPECT_GT(first.counters.device_allocations, 0);
  EXPECT_GT(first.counters.pinned_allocations, 0);
}

TEST_F(CudaOperatorTest, WarmupOnALostDeviceFailsAndMarksItUnhealthy) {
  const LayerWeights w = OperatorLayer(rng_());
  Served s = Serve(w);
  ASSERT_NE(s.backend, nullptr);
  cuda_emulation::InjectFault(cuda_emulation::Fault::kGemm);
  const Status st = s.backend->Warmup(2, Raw(s));
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  EXPECT_FALSE(s.backend->Healthy());
}

TEST_F(CudaOperatorTest, TheBudgetTheLanesAndTheBusIdAsTheGaugesReadThem) {
  const LayerWeights w = OperatorLayer(rng_());
  const int64_t live = cuda_emulation::LiveDeviceBytes();  // what earlier tests left, if anything
  Served s = Serve(w);
  ASSERT_NE(s.backend, nullptr);
  const DeviceMemoryState before = *s.backend->DeviceMemory();
  int64_t weights = 0;
  for (const auto& f : s.forms) weights += f->weights().Bytes();
  EXPECT_GE(before.held_bytes, weights) << "the uploaded weights count";
  EXPECT_EQ(before.limit_bytes, static_cast<int64_t>(kDefaultDeviceMemoryFraction *
                                                     static_cast<double>(cuda_emulation::kDefaultDeviceMemoryBytes - live)))
      << "the default limit: a share of what was free at start";
  EXPECT_GT(before.limit_bytes, before.held_bytes);
  EXPECT_EQ(before.lanes, 1);
  ASSERT_TRUE(s.backend->Warmup(2, Raw(s)).ok());
  const DeviceMemoryState warmed = *s.backend->DeviceMemory();
  EXPECT_EQ(warmed.lanes, 2);
  EXPECT_GT(warmed.held_bytes, before.held_bytes) << "the warmed lanes' workspaces count";
  EXPECT_EQ(warmed.held_bytes, cuda_emulation::LiveDeviceBytes() - live) << "held is what the device holds";
  EXPECT_EQ(s.backend->PciBusId(), "0000:10:00.0");

  auto second = MakeCudaBackend({.device = 0, .max_device_bytes = int64_t{3} << 20});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ((*second)->DeviceMemory()->limit_bytes, int64_t{3} << 20);
}

// Each worker reads the split of its own batch, never another thread's.
TEST_F(CudaOperatorTest, EachThreadReadsTheSplitOfItsOwnBatch) {
  const LayerWeights w = OperatorLayer(rng_());
  Served s = Serve(w);
  ASSERT_NE(s.backend, nullptr);
  EXPECT_FALSE(s.backend->ThisThreadsDeviceTimes().has_value()) << "no batch on this thread yet";
  testing::OwnedSequence seq = RandomSequence(rng_, 32, 12, 12, false, false, -1);
  const Sequence batch[] = {seq.View()};
  ASSERT_TRUE(s.backend->Forward(*s.forms[0], batch).ok());
  const auto mine = s.backend->ThisThreadsDeviceTimes();
  ASSERT_TRUE(mine.has_value());
  EXPECT_GE(mine->inputs_ms, 0);
  EXPECT_GT(mine->compute_ms + mine->inputs_ms + mine->outputs_ms, 0);
  std::optional<DeviceTimes> other_thread;
  std::thread([&] { other_thread = s.backend->ThisThreadsDeviceTimes(); }).join();
  EXPECT_FALSE(other_thread.has_value()) << "another thread's batch";
}

}  // namespace
}  // namespace attnserve
