// The CUDA backend's own sources over the host emulation of CUDA and cuBLAS
// (tests/cuda_emulation): each kernel against a float64 computation, the emulation's checks
// themselves (each must be able to fail), and what the issue asks of the backend that only an
// emulated device can show — weights moved once, per batch only activations through pinned
// buffers, a device fault failing the batch with INTERNAL and marking the device unhealthy.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "cublas_v2.h"
#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/kernels.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "tests/unit/cuda_test_support.h"
#include "tests/unit/test_support.h"

#if defined(ATTNSERVE_ASAN)
#include <sanitizer/asan_interface.h>
#endif
// Last: the device-side shim defines CUDA's names (threadIdx, __syncthreads, min) for the
// test kernels below.
#include "simt.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::DeviceVector;
using testing::RandomSequence;
using testing::RelativeL2;

class CudaEmulationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda_emulation::Reset();
    cudaGetLastError();
  }
  void TearDown() override { cuda_emulation::Reset(); }
  std::mt19937_64 rng_{testing::TestSeed()};
};

// --- The kernels, each against float64 on the host ---------------------------------------

TEST_F(CudaEmulationTest, MaskedSoftmaxMatchesFloat64AtEveryBlockSize) {
  // Key counts on both sides of each of the launcher's choices: the warp kernel holding 1, 2, 4,
  // 8, 16 or 32 keys a lane (up to 1024 keys), the block kernel past it; blocks of query rows
  // starting at row 0 and further down, where the causal mask counts from.
  for (int64_t keys : {1, 7, 32, 33, 64, 65, 100, 128, 129, 256, 257, 300, 512, 513, 1000, 1024, 1025, 1500}) {
    for (bool causal : {false, true}) {
      for (int64_t first_row : {0, 17}) {
        const int64_t heads = 3, n = causal ? std::min<int64_t>(keys, 40) : 5;
        std::vector<float> host = testing::RandomVector(rng_, heads * n * keys, 4.0f);
        DeviceVector dev(host);
        // Finite scores never read Q and K: null operands would fault if they did.
        ASSERT_EQ(
            cuda::MaskedSoftmax(dev.data, heads, n, first_row, keys, causal, cuda::ScoreOperands{}, nullptr, nullptr),
            cudaSuccess);
        ASSERT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
        const std::vector<float> got = dev.Read();
        for (int64_t row = 0; row < heads * n; ++row) {
          const int64_t q = first_row + row % n, visible = causal ? std::min(q + 1, keys) : keys;
          const float* s = &host[row * keys];
          double top = -INFINITY, sum = 0;
          for (int64_t j = 0; j < visible; ++j) top = std::max<double>(top, s[j]);
          for (int64_t j = 0; j < visible; ++j) sum += std::exp(s[j] - top);
          std::vector<double> want(keys, 0.0);
          for (int64_t j = 0; j < visible; ++j) want[j] = std::exp(s[j] - top) / sum;
          EXPECT_LT(RelativeL2(&got[row * keys], want), 2e-6)
              << "keys=" << keys << " causal=" << causal << " first_row=" << first_row << " row " << row;
          for (int64_t j = visible; j < keys; ++j) ASSERT_EQ(got[row * keys + j], 0.0f) << "masked entry " << j;
        }
      }
    }
  }
}

// Scores past float32's range (q·k of inputs ~1e20 is ~1e41): such a row is recomputed from Q
// and K in float64 and must be the exact softmax, while rows of ordinary scores in the same call
// keep the float32 path; a Q that itself overflowed gives a NaN row (the service's OUT_OF_RANGE),
// never finite weights that look right.
TEST_F(CudaEmulationTest, MaskedSoftmaxRecomputesOverflowedRowsInFloat64) {
  for (int64_t keys : {7, 33, 300, 1100}) {  // the warp kernel at 1, 2 and 16 keys a lane; the block kernel
    for (bool causal : {false, true}) {
      const int64_t heads = 4, group = 2, dh = 8, n = 6, q_ld = heads * dh + 3, k_ld = heads / group * dh + 5;
      const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
      std::vector<float> q = testing::RandomVector(rng_, n * q_ld), k = testing::RandomVector(rng_, keys * k_ld);
      // Head 0 keeps unit-scale queries (finite scores); the others' are ~1e20, as are all keys.
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = dh; c < q_ld; ++c) q[r * q_ld + c] *= 1e20f;
      }
      for (float& v : k) v *= 1e20f;
      q[5 * q_ld + 3 * dh + 1] = INFINITY;  // row 5 of head 3: its projection overflowed
      std::vector<float> scores(heads * n * keys);
      std::vector<double> exact(heads * n * keys);
      for (int64_t i = 0; i < heads; ++i) {
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t j = 0; j < keys; ++j) {
            double dot = 0;
            for (int64_t t = 0; t < dh; ++t) {
              dot += static_cast<double>(q[r * q_ld + i * dh + t]) * k[j * k_ld + (i / group) * dh + t];
            }
            exact[(i * n + r) * keys + j] = scale * dot;
            scores[(i * n + r) * keys + j] = static_cast<float>(scale * dot);  // ±inf past FLT_MAX
          }
        }
      }
      DeviceVector dq(q), dk(k);
      const cuda::ScoreOperands operands{.q = dq.data, .q_ld = q_ld, .k = dk.data, .k_ld = k_ld, .d_head = dh,
                                         .group = group, .scale = scale};
      // A block of rows may start past the sequence's row 0: the mask counts from there, the
      // float64 fallback still reads the block's own rows of Q.
      for (int64_t first_row : {0, 2}) {
        DeviceVector dev(scores);
        ASSERT_EQ(cuda::MaskedSoftmax(dev.data, heads, n, first_row, keys, causal, operands, nullptr, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
        const std::vector<float> got = dev.Read();
        int overflowed = 0;
        for (int64_t row = 0; row < heads * n; ++row) {
          const int64_t r = row % n, visible = causal ? std::min(first_row + r + 1, keys) : keys;
          bool finite = true;
          for (int64_t j = 0; j < visible; ++j) finite = finite && std::isfinite(scores[row * keys + j]);
          overflowed += finite ? 0 : 1;
          if (row == 3 * n + 5) {
            for (int64_t j = 0; j < visible; ++j) {
              EXPECT_TRUE(std::isnan(got[row * keys + j])) << "keys=" << keys << " j " << j;
            }
            continue;
          }
          double top = -INFINITY, sum = 0;
          for (int64_t j = 0; j < visible; ++j) top = std::max(top, exact[row * keys + j]);
          for (int64_t j = 0; j < visible; ++j) sum += std::exp(exact[row * keys + j] - top);
          std::vector<double> want(keys, 0.0);
          for (int64_t j = 0; j < visible; ++j) want[j] = std::exp(exact[row * keys + j] - top) / sum;
          EXPECT_LT(RelativeL2(&got[row * keys], want), 2e-6)
              << "keys=" << keys << " causal=" << causal << " first_row=" << first_row << " row " << row
              << (finite ? "" : " (overflowed)");
          for (int64_t j = visible; j < keys; ++j) ASSERT_EQ(got[row * keys + j], 0.0f) << "masked entry " << j;
        }
        EXPECT_GT(overflowed, n) << "the draw should overflow most rows of heads 1-3";
      }
    }
  }
}

// The softmax written into A_cat (the summed form's [n, keys·heads] layout) is the in-place
// softmax, entry for entry, interleaved: A_cat[q, j·heads + i] = A_i[q, j], causal and not.
TEST_F(CudaEmulationTest, TheSoftmaxWritesTheSummedFormsLayout) {
  const int64_t heads = 5, n = 7, keys = 11;
  const std::vector<float> scores = testing::RandomVector(rng_, heads * n * keys);
  for (bool causal : {false, true}) {
    DeviceVector in_place(scores), scratch(scores), a_cat(std::vector<float>(heads * n * keys, NAN));
    ASSERT_EQ(cuda::MaskedSoftmax(in_place.data, heads, n, 2, keys, causal, {}, nullptr, nullptr), cudaSuccess);
    ASSERT_EQ(cuda::MaskedSoftmax(scratch.data, heads, n, 2, keys, causal, {}, a_cat.data, nullptr), cudaSuccess);
    const std::vector<float> want = in_place.Read(), got = a_cat.Read();
    for (int64_t q = 0; q < n; ++q) {
      for (int64_t j = 0; j < keys; ++j) {
        for (int64_t i = 0; i < heads; ++i) {
          ASSERT_EQ(got[q * keys * heads + j * heads + i], want[(i * n + q) * keys + j]) << q << "," << j << "," << i;
        }
      }
    }
  }
}

// Rows narrower than a block's threads, and rows wider (each thread adds more than one entry).
TEST_F(CudaEmulationTest, AddRowBiasTouchesOnlyTheBlock) {
  struct Shape {
    int64_t rows, cols, ld;
  };
  for (const Shape shape : {Shape{9, 13, 20}, Shape{5, 600, 603}}) {
    const auto [rows, cols, ld] = shape;
    const std::vector<float> y = testing::RandomVector(rng_, rows * ld), bias = testing::RandomVector(rng_, cols);
    DeviceVector dy(y), db(bias);
    ASSERT_EQ(cuda::AddRowBias(dy.data, rows, cols, ld, db.data, nullptr), cudaSuccess);
    const std::vector<float> got = dy.Read();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < ld; ++c) {
        ASSERT_EQ(got[r * ld + c], c < cols ? y[r * ld + c] + bias[c] : y[r * ld + c]) << r << "," << c;
      }
    }
  }
}

// One launch, three runs (sequences) at their own positions, one of them past a million.
TEST_F(CudaEmulationTest, RopeMatchesFloat64AtLargePositions) {
  const int64_t rows = 9, heads = 3, d_head = 10, ld = heads * d_head + 4;
  const double theta = 10000.0;
  cuda::RopeRuns runs;
  runs.count = 3;
  const int64_t row0[] = {0, 4, 6}, position[] = {1'000'000, 7, 0};
  for (int i = 0; i < 3; ++i) {
    runs.row0[i] = row0[i];
    runs.position[i] = position[i];
  }
  runs.end = rows;
  const auto position_of = [&](int64_t r) { return r >= 6 ? r - 6 : r >= 4 ? 7 + r - 4 : 1'000'000 + r; };
  const std::vector<float> x = testing::RandomVector(rng_, rows * ld);
  DeviceVector dx(x);
  cuda_emulation::ResetCounters();
  ASSERT_EQ(cuda::ApplyRope(dx.data, heads, d_head, ld, theta, runs, nullptr), cudaSuccess);
  const std::vector<float> got = dx.Read();
  EXPECT_EQ(cuda_emulation::ReadCounters().kernel_launches, 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < d_head / 2; ++t) {
        const double angle = static_cast<double>(position_of(r)) * std::pow(theta, -2.0 * t / d_head);
        const int64_t a = r * ld + h * d_head + t, b = a + d_head / 2;
        EXPECT_NEAR(got[a], x[a] * std::cos(angle) - x[b] * std::sin(angle), 1e-5) << "row " << r;
        EXPECT_NEAR(got[b], x[b] * std::cos(angle) + x[a] * std::sin(angle), 1e-5) << "row " << r;
      }
    }
    for (int64_t c = heads * d_head; c < ld; ++c) ASSERT_EQ(got[r * ld + c], x[r * ld + c]) << "padding column";
  }
}

// --- The emulation's own checks: each can fail --------------------------------------------

__global__ void DivergentBarrierKernel(int* count) {
  if (threadIdx.x < 16) __syncthreads();
  if (threadIdx.x == 0) ++*count;
}

__global__ void BlockSumKernel(const float* in, float* out) {
  __shared__ float partial[64];
  partial[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  float v = partial[threadIdx.x];
  v += __shfl_xor_sync(0xffffffffu, v, 1);  // lanes pairwise: lane 0 and 1 both get p0 + p1
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

TEST_F(CudaEmulationTest, BarriersAndShufflesReallyWait) {
  // A tree sum over shared memory needs every __syncthreads to hold: run out of order it is wrong.
  const std::vector<float> in = testing::RandomVector(rng_, 3 * 64);
  DeviceVector din(in), dout(std::vector<float>(3, NAN));
  cuda_emulation::Launch(BlockSumKernel, dim3(3), dim3(64), nullptr)(din.data, dout.data);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
  const std::vector<float> got = dout.Read();
  for (int b = 0; b < 3; ++b) {
    double sum = 0;
    for (int t = 0; t < 64; ++t) sum += in[b * 64 + t];
    // Thread 0 adds lane 1's partial[1] to the full sum: after the tree, the odd threads' sum.
    double lane1 = 0;
    for (int t = 1; t < 64; t += 2) lane1 += in[b * 64 + t];
    EXPECT_NEAR(got[b], sum + lane1, 1e-4) << "block " << b;
  }
}

TEST_F(CudaEmulationTest, ABarrierNotAllThreadsReachIsReported) {
  int count = 0;
  cuda_emulation::Launch(DivergentBarrierKernel, dim3(2), dim3(32), nullptr)(&count);
  // The launch itself is fine; the kernel fails when it runs, which a synchronisation reports.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("__syncthreads reached by 16 of 32 threads"));
}

// Two rounds through one shared slot, as BlockReduce uses its shared[0]: every thread reads
// the first round's value, the warps shuffle, thread 0 writes the second. `barrier` puts the
// __syncthreads between the read and the write that BlockReduce ends with.
__global__ void SharedSlotReuseKernel(const float* in, float* out, bool barrier) {
  __shared__ float slot;
  if (threadIdx.x == 0) slot = in[2 * blockIdx.x];
  __syncthreads();
  float v = slot;
  if (barrier) __syncthreads();
  v += __shfl_xor_sync(0xffffffffu, v, 1);  // twice the first round's value, in every lane
  if (threadIdx.x == 0) slot = in[2 * blockIdx.x + 1];
  __syncthreads();
  if (threadIdx.x % 32 == 0) out[2 * blockIdx.x + threadIdx.x / 32] = v;
}

TEST_F(CudaEmulationTest, AWarpMayOvertakeTheOthersUpToTheNextBarrier) {
  // Without the barrier, a warp scheduled first and run on past its shuffle overwrites the
  // slot before a later warp has read it: the emulation draws such orders (one block in four
  // here), as a device may run them. With the barrier every order gives the first round.
  constexpr int kBlocks = 64;
  const std::vector<float> in = testing::RandomVector(rng_, 2 * kBlocks);
  for (const bool barrier : {true, false}) {
    DeviceVector din(in), dout(std::vector<float>(2 * kBlocks, NAN));
    cuda_emulation::Launch(SharedSlotReuseKernel, dim3(kBlocks), dim3(64), nullptr)(din.data, dout.data, barrier);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
    const std::vector<float> got = dout.Read();
    int overtaken = 0;
    for (int b = 0; b < kBlocks; ++b) {
      for (int warp = 0; warp < 2; ++warp) {
        if (barrier) {
          EXPECT_EQ(got[2 * b + warp], 2 * in[2 * b]) << "block " << b << " warp " << warp;
        }
        overtaken += got[2 * b + warp] == 2 * in[2 * b + 1];
      }
    }
    if (!barrier) {
      EXPECT_GT(overtaken, 0) << "no warp ran ahead of another in " << kBlocks << " blocks";
    }
  }
}

// Block 0 alone writes the slot; every block reads it.
__global__ void ReadsSharedOnlyBlockZeroWroteKernel(float value, float* out) {
  __shared__ float slot;
  if (blockIdx.x == 0) slot = value;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = slot;
}

TEST_F(CudaEmulationTest, SharedMemoryABlockDidNotWriteReadsAsNaN) {
  // Each block of a device has its own shared memory, uninitialised: whichever order the
  // blocks run in, only block 0 finds the value (a copy kept from block to block would hand it
  // to every block).
  const float value = testing::RandomVector(rng_, 1)[0];
  DeviceVector dout(std::vector<float>(4, 0.0f));
  cuda_emulation::Launch(ReadsSharedOnlyBlockZeroWroteKernel, dim3(4), dim3(64), nullptr)(value, dout.data);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
  const std::vector<float> got = dout.Read();
  EXPECT_EQ(got[0], value);
  for (int b = 1; b < 4; ++b) EXPECT_TRUE(std::isnan(got[b])) << "block " << b << " read " << got[b];
}

TEST_F(CudaEmulationTest, AnInjectedBadLaunchIsReportedOnceAndTheNextLaunchRuns) {
  // As a launch with a bad configuration: nothing runs, cudaGetLastError reports it once, and
  // the error is not sticky.
  const std::vector<float> in = testing::RandomVector(rng_, 2);
  DeviceVector din(in), dout(std::vector<float>(2, NAN));
  cuda_emulation::InjectFault(cuda_emulation::Fault::kLaunchInvalid);
  cuda_emulation::Launch(SharedSlotReuseKernel, dim3(1), dim3(64), nullptr)(din.data, dout.data, true);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(std::isnan(dout.Read()[0])) << "a refused launch ran";
  cuda_emulation::Launch(SharedSlotReuseKernel, dim3(1), dim3(64), nullptr)(din.data, dout.data, true);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << cuda_emulation::LastDiagnostic();
  EXPECT_EQ(dout.Read()[1], 2 * in[0]);
}

TEST_F(CudaEmulationTest, GemmArgumentsAreCheckedAsCublasDocumentsThem) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  DeviceVector a(testing::RandomVector(rng_, 6 * 4)), b(testing::RandomVector(rng_, 4 * 5)),
      c(std::vector<float>(6 * 5, NAN));
  const float one = 1, zero = 0;
  // C[6x5] = A[6x4] B[4x5], column-major: lda 6, ldb 4, ldc 6; beta = 0 ignores C's NaNs.
  EXPECT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 6, 5, 4, &one, a.data, 6, b.data, 4, &zero, c.data, 6),
            CUBLAS_STATUS_SUCCESS);
  const std::vector<float> ha = a.Read(), hb = b.Read(), hc = c.Read();
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 5; ++j) {
      double want = 0;
      for (int p = 0; p < 4; ++p) want += static_cast<double>(ha[i + p * 6]) * hb[p + j * 4];
      EXPECT_NEAR(hc[i + j * 6], want, 1e-5);
    }
  }
  EXPECT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 6, 5, 4, &one, a.data, 5, b.data, 4, &zero, c.data, 6),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("lda=5 < 6"));
  // In bounds by its arguments, but B's last column runs past its allocation: a device faults.
  EXPECT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 6, 5, 4, &one, a.data, 6, b.data, 5, &zero, c.data, 6),
            CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("operand B"));
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaErrorIllegalAddress) << "a fault is sticky";
  cublasDestroy(handle);
}

// Batch entries whose outputs share elements would race on a device: refused, while entries
// interleaved column by column without sharing one (the backend's mix) are not.
TEST_F(CudaEmulationTest, BatchedGemmOutputsMustNotOverlap) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  DeviceVector a(testing::RandomVector(rng_, 4 * 4)), b(testing::RandomVector(rng_, 4 * 4)),
      c(std::vector<float>(64, NAN));
  const float one = 1, zero = 0;
  auto batch = [&](int ldc, long long stride_c) {
    return cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 4, 4, &one, a.data, CUDA_R_32F, 2, 0,
                                      b.data, CUDA_R_32F, 4, 0, &zero, c.data, CUDA_R_32F, ldc, stride_c, 2,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  EXPECT_EQ(batch(2, 8), CUBLAS_STATUS_SUCCESS) << "one block after the other";
  EXPECT_EQ(batch(4, 2), CUBLAS_STATUS_SUCCESS) << "side by side in the rows of ldc 4";
  EXPECT_EQ(batch(2, 4), CUBLAS_STATUS_INVALID_VALUE) << "the second entry's first columns are the first's last";
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("outputs of the batch entries overlap"));
  EXPECT_EQ(batch(3, 2), CUBLAS_STATUS_INVALID_VALUE) << "ldc 3 puts entry 1's row 0 on entry 0's next column";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cublasDestroy(handle);
}

// The pointer-array batch reads its arrays from device memory when the stream runs it, as cuBLAS
// does: arrays on the host are refused at the call, entries are checked when they run, two
// entries writing one element are reported (a race on a device), and the products are right.
TEST_F(CudaEmulationTest, PointerArrayGemmsReadTheirArraysFromTheDevice) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const std::vector<float> ha = testing::RandomVector(rng_, 2 * 3), hb = testing::RandomVector(rng_, 3 * 4);
  DeviceVector a(ha), b(hb), c(std::vector<float>(16, NAN));
  const float one = 1, zero = 0;
  // Entries 0 and 1: C_e = A · B (2x3 by 3x4, column-major), at c and c + 8.
  auto run = [&](const std::vector<const void*>& pointers) {
    void* arrays = nullptr;
    EXPECT_EQ(cudaMalloc(&arrays, pointers.size() * sizeof(void*)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(arrays, pointers.data(), pointers.size() * sizeof(void*), cudaMemcpyHostToDevice),
              cudaSuccess);
    const auto* device = static_cast<const void* const*>(arrays);
    const cublasStatus_t st = cublasGemmBatchedEx(
        handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 4, 3, &one, device, CUDA_R_32F, 2, device + 2, CUDA_R_32F, 3, &zero,
        const_cast<void* const*>(device + 4), CUDA_R_32F, 2, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    const cudaError_t synced = cudaDeviceSynchronize();
    cudaFree(arrays);
    return std::make_pair(st, synced);
  };
  auto [ok, ok_sync] = run({a.data, a.data, b.data, b.data, c.data, c.data + 8});
  ASSERT_EQ(ok, CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(ok_sync, cudaSuccess);
  const std::vector<float> got = c.Read();
  for (int e = 0; e < 2; ++e) {
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 2; ++i) {
        double want = 0;
        for (int p = 0; p < 3; ++p) want += static_cast<double>(ha[i + 2 * p]) * hb[p + 3 * j];
        EXPECT_NEAR(got[e * 8 + i + 2 * j], want, 1e-5) << "entry " << e << " C(" << i << ", " << j << ")";
      }
    }
  }
  const void* const on_host[] = {a.data, a.data};
  EXPECT_EQ(cublasGemmBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 4, 3, &one, on_host, CUDA_R_32F, 2, on_host,
                                CUDA_R_32F, 3, &zero, const_cast<void* const*>(on_host), CUDA_R_32F, 2, 2,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("pointer array"));
  cuda_emulation::Reset();
  auto [overlap, overlap_sync] = run({a.data, a.data, b.data, b.data, c.data, c.data + 2});
  EXPECT_EQ(overlap, CUBLAS_STATUS_SUCCESS) << "checked when it runs, not at the call";
  EXPECT_NE(overlap_sync, cudaSuccess);
  EXPECT_THAT(cuda_emulation::LastDiagnostic(), HasSubstr("write the same element"));
  cuda_emulation::Reset();
  cudaGetLastError();
  cublasDestroy(handle);
}

// Work is queued on its stream and runs at a synchronisation: a host that reads pinned memory a
// copy has yet to fill sees NaN, another stream's synchronisation does not run it, its own does;
// and a cuBLAS handle's GEMMs go on the stream it was given.
TEST_F(CudaEmulationTest, DeviceMemoryIsPoisonedForTheHost) {
#if !defined(ATTNSERVE_ASAN)
  GTEST_SKIP() << "device memory is poisoned for host code under AddressSanitizer only";
#else
  // On a device, host code that dereferences a device pointer faults. Here AddressSanitizer
  // reports it: device memory is poisoned except while the emulated device works on it (a
  // stream's work, a synchronous copy), which reads and writes it unreported.
  const std::vector<float> in = testing::RandomVector(rng_, 2 * 64);
  DeviceVector din(in), dout(std::vector<float>(2 * 2, NAN));
  EXPECT_TRUE(__asan_address_is_poisoned(din.data));
  EXPECT_TRUE(__asan_address_is_poisoned(din.data + in.size() - 1));
  cuda_emulation::Launch(SharedSlotReuseKernel, dim3(2), dim3(64), nullptr)(din.data, dout.data, true);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cuda_emulation::LastDiagnostic();
  EXPECT_EQ(din.Read(), in);
  EXPECT_EQ(dout.Read()[0], 2 * in[0]);
  EXPECT_TRUE(__asan_address_is_poisoned(dout.data)) << "poisoned again once the device is done";
#endif
}

TEST_F(CudaEmulationTest, StreamsRunTheirWorkAtSynchronisation) {
  cuda_emulation::ResetCounters();
  cudaStream_t mine, other;
  ASSERT_EQ(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(handle, mine), CUBLAS_STATUS_SUCCESS);
  const std::vector<float> ha = testing::RandomVector(rng_, 3 * 2), hb = testing::RandomVector(rng_, 2 * 2);
  DeviceVector a(ha), b(hb), c(std::vector<float>(3 * 2, 0.0f));
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 6 * sizeof(float)), cudaSuccess);
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 3, 2, 2, &one, a.data, 3, b.data, 2, &zero, c.data, 3),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaMemcpyAsync(pinned, c.data, 6 * sizeof(float), cudaMemcpyDeviceToHost, mine), cudaSuccess);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(std::isnan(pinned[i])) << "read before the synchronisation, element " << i;
  ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_TRUE(std::isnan(pinned[0])) << "another stream's synchronisation ran this stream's work";
  ASSERT_EQ(cudaStreamSynchronize(mine), cudaSuccess);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 2; ++j) {
      const double want = static_cast<double>(ha[i]) * hb[2 * j] + static_cast<double>(ha[i + 3]) * hb[1 + 2 * j];
      EXPECT_NEAR(pinned[i + 3 * j], want, 1e-5) << i << "," << j;
    }
  }
  EXPECT_EQ(cuda_emulation::ReadCounters().legacy_stream_work, 0);
  cublasDestroy(handle);
  cudaFreeHost(pinned);
  cudaStreamDestroy(mine);
  cudaStreamDestroy(other);
}

TEST_F(CudaEmulationTest, CopiesMustNameTheRightMemorySpaces) {
  std::vector<float> host(8, 1.0f), other(8);
  EXPECT_EQ(cudaMemcpy(other.data(), host.data(), 32, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  DeviceVector dev(host);
  EXPECT_EQ(cudaMemcpy(dev.data, host.data(), 36, cudaMemcpyHostToDevice), cudaErrorInvalidValue)
      << "one float past the allocation";
  EXPECT_EQ(cudaMemcpy(host.data(), dev.data, 32, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
}

// --- The backend on the emulated device ---------------------------------------------------

LayerWeights SmallLayer() {
  return RandomLayerWeights(*CompleteConfig({.d_model = 48, .heads = 4, .kv_heads = 2, .d_head = 12, .bias = true}), 7);
}

std::unique_ptr<Backend> MakeEmulatedBackend() {
  auto backend = MakeCudaBackend({});
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// What one batch costs in launches and GEMM calls, pinned: 70 small GQA requests with RoPE
// (factored, no bias, one block each) of 5 shapes, interleaved, causal and not. Per batch: [Q | K]
// and the value block (2 GEMMs), Q and K rotated in one launch each per 64 sequences (2 · 2);
// per shape, one pointer-array GEMM for every sequence's and head's scores, one masked softmax,
// one pointer-array GEMM for the mixes (5 · 3); the output projection (1 GEMM). Per sequence
// this was 2 · group GEMMs and a softmax: 74 launches and 283 GEMM calls.
TEST_F(CudaEmulationTest, LaunchesPerBatchArePinned) {
  // The fused kernel's counts: cuda_fused_attention_test.cc.
  const cuda_emulation::Counters counters = testing::RunPinnedLaunchBatch({.gemm_attention = true}, rng_);
  constexpr int64_t kShapes = testing::kPinnedBatchShapes;
  EXPECT_EQ(counters.kernel_launches, 2 * 2 + kShapes);
  EXPECT_EQ(counters.gemm_calls, 2 + kShapes * 2 + 1);
}

std::vector<std::pair<std::string, FormWeights>> EveryForm(const LayerWeights& w);  // below

// Short sequences that share a shape share their calls in every form and path: the factored
// form, the summed form projecting first (its A_cat blocks and head sums batched too) and mixing
// first (the context as every head's values), the low-rank form at full rank and at ragged
// ranks (one mix call per distinct rank) — over MHA with biases and GQA with RoPE, with causal
// and plain sequences, padded keys and cross-attention of several shapes in one batch, in an
// order that interleaves the shapes, against float64. Fewer softmax launches and GEMM calls
// than sequences show the groups ran. (The groups are the GEMM path's,
// CudaBackendOptions::gemm_attention; the fused kernel takes up to 48 ranges a launch.)
// Its own suite: nothing here is concurrent, so the ThreadSanitizer run of CudaEmulationTest
// (scripts/test) would only pay for its many forwards (28 s there).
class CudaGroupedBatchTest : public CudaEmulationTest {};

TEST_F(CudaGroupedBatchTest, ShortSequencesOfOneShapeShareTheirCalls) {
  const LayerWeights mha = RandomLayerWeights(*CompleteConfig({.d_model = 40, .heads = 4, .d_head = 10}), rng_());
  const LayerWeights gqa = RandomLayerWeights(
      *CompleteConfig({.d_model = 48, .heads = 6, .kv_heads = 2, .d_head = 8, .bias = false, .rope_theta = 10000.0}),
      rng_());
  for (const LayerWeights* w : {&mha, &gqa}) {
    const int64_t d = w->config.d_model;
    std::vector<testing::OwnedSequence> seqs;
    for (int i = 0; i < 24; ++i) {
      switch (i % 4) {
        case 0:
          seqs.push_back(RandomSequence(rng_, d, 7, 7, false, true, -1));
          break;  // causal
        case 1:
          seqs.push_back(RandomSequence(rng_, d, 5, 5, false, false, 3));
          break;  // padded keys
        case 2:
          seqs.push_back(RandomSequence(rng_, d, 4, 11, true, false, -1));
          break;  // cross, n < m
        default:
          seqs.push_back(RandomSequence(rng_, d, 7, 7, false, i % 8 == 3, -1));
          break;
      }
      seqs.back().position_offset = 37 * i;
    }
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    std::vector<std::vector<double>> want;
    for (const Sequence& s : batch) want.push_back(ReferenceForward(*w, s));

    auto forms = EveryForm(*w);
    std::vector<int64_t> ragged;
    for (int64_t i = 0; i < w->config.heads; ++i) ragged.push_back(1 + i % 3);
    auto low = MaterializeLowRank(*w, ragged);
    ASSERT_TRUE(low.ok());
    forms.emplace_back("low-rank ragged", std::move(low).value());
    for (const bool mix_first : {false, true}) {
      auto made = MakeCudaBackend({.summed_mix_first = mix_first, .gemm_attention = true});
      ASSERT_TRUE(made.ok());
      for (const auto& [name, form] : forms) {
        if (mix_first && name != "summed") continue;
        auto resident = (*made)->Upload(std::make_shared<const FormWeights>(form));
        ASSERT_TRUE(resident.ok()) << resident.status().ToString();
        for (auto& s : seqs) std::fill(s.output.begin(), s.output.end(), std::nanf(""));
        cuda_emulation::ResetCounters();
        const Status st = (*made)->Forward(**resident, batch);
        ASSERT_TRUE(st.ok()) << name << ": " << st.ToString();
        const auto counters = cuda_emulation::ReadCounters();
        const std::string label = name + (mix_first ? " mixing first" : "") + " " + w->config.ToString();
        // (Mixing first, each part's h head products are the skeleton's own GEMMs, one each.)
        if (!mix_first) {
          EXPECT_LT(counters.gemm_calls, static_cast<int64_t>(seqs.size())) << label;
        }
        EXPECT_LT(counters.kernel_launches, static_cast<int64_t>(seqs.size())) << label;
        for (size_t r = 0; r < seqs.size(); ++r) {
          if (name == "low-rank ragged") {
            // Truncated heads: checked against the float64 forward of the truncated matrices.
            continue;
          }
          EXPECT_LT(RelativeL2(seqs[r].output.data(), want[r]), 1e-5) << label << " sequence " << r;
        }
        if (name == "low-rank ragged") {
          // The same form on the per-sequence path (each sequence alone) is the oracle here.
          for (size_t r = 0; r < seqs.size(); ++r) {
            testing::OwnedSequence alone = seqs[r];
            std::fill(alone.output.begin(), alone.output.end(), std::nanf(""));
            const Sequence one[] = {alone.View()};
            ASSERT_TRUE((*made)->Forward(**resident, one).ok());
            EXPECT_LT(RelativeL2(seqs[r].output.data(), alone.output.data(), alone.output.size()), 1e-6)
                << label << " sequence " << r;
          }
        }
      }
    }
  }
}

// A group of short sequences keeps its scores within the score bound: with room for two
// sequences' scores, ten of one shape run in groups of at most two, every answer against
// float64. A grouping that ignored the bound would write ten sequences' scores into a piece
// sized for two (over the next pieces, and past the guard zone).
TEST_F(CudaGroupedBatchTest, AGroupKeepsToTheScoreBound) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4}), rng_());
  constexpr int64_t kTokens = 8, kSequences = 10;
  const int64_t one_sequence_bytes = w.config.heads * kTokens * kTokens * static_cast<int64_t>(sizeof(float));
  for (const auto& [name, form] : EveryForm(w)) {
    const int64_t copies = form.concat_then_project() ? 1 : 2;  // the summed form keeps A_cat too
    auto made = MakeCudaBackend({.max_score_workspace_bytes = 2 * copies * one_sequence_bytes, .gemm_attention = true});
    ASSERT_TRUE(made.ok());
    auto resident = (*made)->Upload(std::make_shared<const FormWeights>(form));
    ASSERT_TRUE(resident.ok()) << resident.status().ToString();
    std::vector<testing::OwnedSequence> seqs;
    std::vector<Sequence> batch;
    for (int64_t i = 0; i < kSequences; ++i) seqs.push_back(RandomSequence(rng_, 32, kTokens, kTokens, false, i % 2 == 0, -1));
    for (auto& s : seqs) batch.push_back(s.View());
    cuda_emulation::ResetCounters();
    const Status st = (*made)->Forward(**resident, batch);
    ASSERT_TRUE(st.ok()) << name << ": " << st.ToString();
    for (size_t r = 0; r < seqs.size(); ++r) {
      EXPECT_LT(RelativeL2(seqs[r].output.data(), ReferenceForward(w, batch[r])), 1e-5) << name << " sequence " << r;
    }
  }
}

TEST_F(CudaEmulationTest, NoDeviceRefusesWithTheReason) {
  cuda_emulation::SetDeviceCount(0);
  auto none = MakeCudaBackend({});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(none.status().message(), HasSubstr("no usable GPU: cudaGetDeviceCount: no CUDA-capable device"));
  cuda_emulation::SetDeviceCount(1);
  auto second = MakeCudaBackend({.device = 1});
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("cuda:1 requested, but only 1 device(s) present"));
  auto first = MakeCudaBackend({.device = 0});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)->DeviceName(), "cuda:0");
}

TEST_F(CudaEmulationTest, WeightsMoveOnceAndBatchesMoveOnlyActivationsThroughPinnedMemory) {
  const int64_t baseline = cuda_emulation::LiveDeviceAllocations();
  {
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    const LayerWeights w = SmallLayer();
    auto form = std::make_shared<const FormWeights>(MaterializeFactored(w));
    cuda_emulation::ResetCounters();
    auto resident = backend->Upload(form);
    ASSERT_TRUE(resident.ok());
    EXPECT_EQ(cuda_emulation::ReadCounters().host_to_device_bytes, form->Bytes()) << "every weight, once";

    std::vector<testing::OwnedSequence> seqs;
    seqs.push_back(RandomSequence(rng_, 48, 10, 10, false, true, -1));
    seqs.push_back(RandomSequence(rng_, 48, 3, 17, true, false, 9));
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    const int64_t tokens = 10 + 3, context_tokens = 10 + 17;  // a cross sequence stages every context
    for (int round = 0; round < 2; ++round) {
      cuda_emulation::ResetCounters();
      ASSERT_TRUE(backend->Forward(**resident, batch).ok());
      const cuda_emulation::Counters moved = cuda_emulation::ReadCounters();
      EXPECT_EQ(moved.host_to_device_bytes, (tokens + context_tokens) * 48 * 4) << "round " << round;
      EXPECT_EQ(moved.device_to_host_bytes, tokens * 48 * 4);
      EXPECT_EQ(moved.pageable_async_copies, 0);
      if (round == 1) {
        EXPECT_EQ(moved.device_allocations + moved.pinned_allocations, 0) << "buffers are reused";
      }
    }
    for (auto& s : seqs) EXPECT_LT(RelativeL2(s.output.data(), ReferenceForward(w, s.View())), 1e-5);
  }
  EXPECT_EQ(cuda_emulation::LiveDeviceAllocations(), baseline) << "device memory returned";
}

// Inputs go to the device, and outputs come back, in slices of staging_slice_bytes (whole rows):
// here 5 rows, so the sequences and the staged contexts cut across slice edges, and every row
// still lands in its own sequence. One copy a slice each way; the bytes are those of one copy.
// The three shapes differ, so no group of sequences adds a copy of GEMM pointer arrays.
TEST_F(CudaEmulationTest, InputsAndOutputsMoveInSlicesAndEveryRowLandsInItsSequence) {
  const LayerWeights w = SmallLayer();
  auto made = MakeCudaBackend({.staging_slice_bytes = 5 * 48 * 4});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Backend& backend = **made;
  auto resident = backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  std::vector<testing::OwnedSequence> seqs;
  seqs.push_back(RandomSequence(rng_, 48, 7, 7, false, true, -1));
  seqs.push_back(RandomSequence(rng_, 48, 3, 11, true, false, 9));
  seqs.push_back(RandomSequence(rng_, 48, 4, 4, false, false, -1));
  std::vector<Sequence> batch;
  for (auto& s : seqs) batch.push_back(s.View());
  const int64_t tokens = 7 + 3 + 4, staged = tokens + 7 + 11 + 4;  // a cross sequence stages every context
  cuda_emulation::ResetCounters();
  ASSERT_TRUE(backend.Forward(**resident, batch).ok());
  const cuda_emulation::Counters moved = cuda_emulation::ReadCounters();
  EXPECT_EQ(moved.host_to_device_bytes, staged * 48 * 4);
  EXPECT_EQ(moved.host_to_device_copies, (staged + 4) / 5);
  EXPECT_EQ(moved.device_to_host_bytes, tokens * 48 * 4);
  EXPECT_EQ(moved.device_to_host_copies, (tokens + 4) / 5);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_LT(RelativeL2(seqs[i].output.data(), ReferenceForward(w, batch[i])), 1e-5) << "sequence " << i;
  }
}

// Slices of at least 256 KiB are packed and unpacked by the staging team (staging_threads): 96
// sequences of 32 tokens at d = 48, 576 KiB each way in two slices of 300 KiB and the rest, three
// threads sharing each. Every row lands in its own sequence, and the copies are the slices'.
TEST_F(CudaEmulationTest, TheStagingTeamPacksAndUnpacksWholeSlices) {
  const LayerWeights w = SmallLayer();
  auto made = MakeCudaBackend({.staging_slice_bytes = 300 << 10, .staging_threads = 3});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Backend& backend = **made;
  auto resident = backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  std::vector<testing::OwnedSequence> seqs;
  for (int i = 0; i < 96; ++i) seqs.push_back(RandomSequence(rng_, 48, 32, 32, false, i % 2 == 0, -1));
  std::vector<Sequence> batch;
  for (auto& s : seqs) batch.push_back(s.View());
  const int64_t rows = 96 * 32, slice_rows = (300 << 10) / (48 * 4);
  cuda_emulation::ResetCounters();
  ASSERT_TRUE(backend.Forward(**resident, batch).ok());
  const cuda_emulation::Counters moved = cuda_emulation::ReadCounters();
  EXPECT_EQ(moved.device_to_host_bytes, rows * 48 * 4);
  EXPECT_EQ(moved.device_to_host_copies, (rows + slice_rows - 1) / slice_rows);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_LT(RelativeL2(seqs[i].output.data(), ReferenceForward(w, batch[i])), 1e-5) << "sequence " << i;
  }
}

// Where a batch's time went (Backend::LastDeviceTimes): nothing before the first batch; after one,
// three finite, non-negative parts that together fit inside the Forward call that ran them. The
// CPU backend, whose data never leaves host memory, reports none.
TEST_F(CudaEmulationTest, TheLastBatchsTimeIsSplitIntoCopiesAndCompute) {
  auto backend = MakeEmulatedBackend();
  ASSERT_NE(backend, nullptr);
  EXPECT_FALSE(backend->LastDeviceTimes().has_value());
  const LayerWeights w = SmallLayer();
  auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeSummed(w)));
  ASSERT_TRUE(resident.ok());
  testing::OwnedSequence seq = RandomSequence(rng_, 48, 9, 9, false, true, -1);
  const Sequence batch[] = {seq.View()};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(backend->Forward(**resident, batch).ok());
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const std::optional<DeviceTimes> t = backend->LastDeviceTimes();
  ASSERT_TRUE(t.has_value());
  for (const double part : {t->inputs_ms, t->compute_ms, t->outputs_ms}) {
    EXPECT_TRUE(std::isfinite(part));
    EXPECT_GE(part, 0.0);
  }
  EXPECT_LE(t->inputs_ms + t->compute_ms + t->outputs_ms, wall_ms);
  EXPECT_GT(t->compute_ms, 0.0) << "the emulated compute runs on the host and takes time";

  EXPECT_FALSE(CpuBackend().LastDeviceTimes().has_value());
}

// Every kernel, GEMM and async copy of an upload and of a batch is issued on the lane's own
// stream: work on the legacy default stream would race the batch on a device (the backend's
// stream is non-blocking), which the emulation, running each call at once, cannot show.
TEST_F(CudaEmulationTest, EveryCallRunsOnTheLanesOwnStream) {
  const LayerWeights w = RandomLayerWeights(
      *CompleteConfig({.d_model = 48, .heads = 4, .kv_heads = 2, .d_head = 12, .rope_theta = 10000.0}), 31);
  // The fused attention and the GEMM path's score GEMMs and softmax (the summed form projecting
  // first takes the latter either way).
  for (const bool gemm_attention : {false, true}) {
    auto made = MakeCudaBackend({.gemm_attention = gemm_attention});
    ASSERT_TRUE(made.ok());
    std::unique_ptr<Backend> backend = std::move(made).value();
    for (Form form : {Form::kFactored, Form::kSummed}) {
      cuda_emulation::ResetCounters();
      auto resident = backend->Upload(
          std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(w) : MaterializeSummed(w)));
      ASSERT_TRUE(resident.ok());
      std::vector<testing::OwnedSequence> seqs;
      seqs.push_back(RandomSequence(rng_, 48, 9, 9, false, true, -1));
      seqs.push_back(RandomSequence(rng_, 48, 4, 13, true, false, 7));
      seqs.back().position_offset = 21;
      std::vector<Sequence> batch;
      for (auto& s : seqs) batch.push_back(s.View());
      ASSERT_TRUE(backend->Forward(**resident, batch).ok());
      const cuda_emulation::Counters c = cuda_emulation::ReadCounters();
      EXPECT_GT(c.kernel_launches, 0) << FormName(form);
      EXPECT_GT(c.gemm_calls, 0) << FormName(form);
      EXPECT_EQ(c.legacy_stream_work, 0) << FormName(form) << (gemm_attention ? " (GEMM attention)" : "")
                                         << ": work issued on the legacy default stream";
      for (auto& s : seqs) EXPECT_LT(RelativeL2(s.output.data(), ReferenceForward(w, s.View())), 1e-5);
    }
  }
}

TEST_F(CudaEmulationTest, ConcurrentCallersEachGetTheirOwnStream) {
  auto backend = MakeEmulatedBackend();
  ASSERT_NE(backend, nullptr);
  const LayerWeights w = SmallLayer();
  auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  cuda_emulation::ResetCounters();
  constexpr int kCallers = 3, kRounds = 8;
  // Each caller's first batch is held at its stream's synchronisation until all of them have
  // issued theirs: three batches in flight at once, so three lanes. A pool that made callers
  // wait for one lane would never fill this (10 s, then it gives up and the test fails).
  std::mutex mu;
  std::condition_variable all_in;
  int arrived = 0;
  bool gave_up = false;
  cuda_emulation::SetStreamSyncHook([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (arrived >= kCallers) return;
    ++arrived;
    all_in.notify_all();
    if (!all_in.wait_for(lock, std::chrono::seconds(10), [&] { return arrived >= kCallers; })) gave_up = true;
  });
  std::vector<double> worst(kCallers, 0.0);
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int round = 0; round < kRounds; ++round) {
        testing::OwnedSequence seq = RandomSequence(rng, 48, 20 + t, 20 + t, false, round % 2 == 0, -1);
        const Sequence batch[] = {seq.View()};
        if (!backend->Forward(**resident, batch).ok()) {
          worst[t] = INFINITY;
          return;
        }
        worst[t] = std::max(worst[t], RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())));
      }
    });
  }
  for (auto& c : callers) c.join();
  cuda_emulation::SetStreamSyncHook(nullptr);
  for (int t = 0; t < kCallers; ++t) EXPECT_LT(worst[t], 1e-5) << "caller " << t;
  EXPECT_FALSE(gave_up) << "the callers' first batches were not in flight at once";
  // A lane per caller at once: the one made at start-up and two more, never more; and no
  // stream took work from two callers at once.
  const cuda_emulation::Counters counters = cuda_emulation::ReadCounters();
  EXPECT_EQ(counters.streams_created, kCallers - 1) << "one lane existed already";
  EXPECT_EQ(counters.threads_sharing_a_stream, 0) << "two callers issued work on one stream at once";
}

TEST_F(CudaEmulationTest, ADeviceFaultFailsTheBatchAndMarksTheDeviceUnhealthy) {
  for (cuda_emulation::Fault fault :
       {cuda_emulation::Fault::kGemm, cuda_emulation::Fault::kKernel, cuda_emulation::Fault::kCopy}) {
    cuda_emulation::Reset();
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    const LayerWeights w = SmallLayer();
    auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeSummed(w)));
    ASSERT_TRUE(resident.ok());
    testing::OwnedSequence seq = RandomSequence(rng_, 48, 8, 8, false, false, -1);
    const Sequence batch[] = {seq.View()};
    ASSERT_TRUE(backend->Forward(**resident, batch).ok());
    EXPECT_TRUE(backend->Healthy());

    cuda_emulation::InjectFault(fault);
    const Status failed = backend->Forward(**resident, batch);
    EXPECT_EQ(failed.code(), StatusCode::kInternal) << failed.ToString();
    EXPECT_THAT(failed.message(), ::testing::AnyOf(HasSubstr("CUDA error"), HasSubstr("cuBLAS error")));
    EXPECT_FALSE(backend->Healthy());

    cuda_emulation::ResetCounters();
    const Status after = backend->Forward(**resident, batch);
    EXPECT_EQ(after.code(), StatusCode::kInternal);
    EXPECT_THAT(after.message(), HasSubstr("cuda:0 is unhealthy"));
    EXPECT_EQ(cuda_emulation::ReadCounters().gemm_calls, 0) << "an unhealthy device is not touched";
  }
}

// Every error after which the CUDA runtime API says the process must be relaunched takes the
// device out of service, not only the ones the emulation raises itself: a backend that missed one
// would stay healthy (the server SERVING) and fail every later batch with it.
TEST_F(CudaEmulationTest, EveryProcessFatalErrorTakesTheDeviceOutOfService) {
  for (cudaError_t fatal : {cudaErrorContained, cudaErrorTensorMemoryLeak, cudaErrorExternalDevice,
                            cudaErrorLaunchTimeout, cudaErrorECCUncorrectable}) {
    SCOPED_TRACE(cudaGetErrorName(fatal));
    cuda_emulation::Reset();
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    const LayerWeights w = SmallLayer();
    auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
    ASSERT_TRUE(resident.ok());
    testing::OwnedSequence seq = RandomSequence(rng_, 48, 8, 8, false, false, -1);
    const Sequence batch[] = {seq.View()};
    cuda_emulation::SetInjectedFaultError(fatal);
    cuda_emulation::InjectFault(cuda_emulation::Fault::kGemm);
    const Status failed = backend->Forward(**resident, batch);
    EXPECT_EQ(failed.code(), StatusCode::kInternal) << failed.ToString();
    EXPECT_THAT(failed.message(), HasSubstr(std::string("the device is lost: ") + cudaGetErrorString(fatal)));
    EXPECT_FALSE(backend->Healthy()) << "a process-fatal error left the device in service";
  }
}

// Errors a real device reports and keeps serving after: out of device memory (cudaMalloc), of
// pinned host memory (cudaMallocHost) or of cuBLAS's own workspace (CUBLAS_STATUS_ALLOC_FAILED)
// fails the batch with RESOURCE_EXHAUSTED (the client may retry); an invalid cuBLAS argument or
// a kernel launch's bad configuration with INTERNAL. The device stays healthy, the error's
// leftover (a failed launch's stays for cudaGetLastError) does not reach the next call, and the
// next batch is computed right. Only a lost context (the test above) takes the device out of
// service.
TEST_F(CudaEmulationTest, ARecoverableErrorFailsTheBatchAndTheDeviceKeepsServing) {
  struct Case {
    cuda_emulation::Fault fault;
    StatusCode code;
    const char* says;
  };
  for (const Case& c :
       {Case{cuda_emulation::Fault::kOutOfMemory, StatusCode::kResourceExhausted, "cudaMalloc"},
        Case{cuda_emulation::Fault::kGemmInvalid, StatusCode::kInternal, "CUBLAS_STATUS_INVALID_VALUE"},
        Case{cuda_emulation::Fault::kLaunchInvalid, StatusCode::kInternal, "invalid configuration argument"},
        Case{cuda_emulation::Fault::kGemmAllocFailed, StatusCode::kResourceExhausted, "CUBLAS_STATUS_ALLOC_FAILED"},
        Case{cuda_emulation::Fault::kPinnedOutOfMemory, StatusCode::kResourceExhausted, "cudaMallocHost"}}) {
    SCOPED_TRACE(c.says);
    cuda_emulation::Reset();
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    const LayerWeights w = SmallLayer();
    auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeSummed(w)));
    ASSERT_TRUE(resident.ok());
    // The first batch of this backend: its workspace is allocated now.
    testing::OwnedSequence seq = RandomSequence(rng_, 48, 24, 24, false, true, -1);
    const Sequence batch[] = {seq.View()};
    // Out of memory twice: the backend tries again once, after taking idle lanes' workspaces back.
    cuda_emulation::InjectFault(c.fault, c.fault == cuda_emulation::Fault::kOutOfMemory ? 2 : 1);
    const Status failed = backend->Forward(**resident, batch);
    EXPECT_EQ(failed.code(), c.code) << failed.ToString();
    EXPECT_THAT(failed.message(), HasSubstr(c.says));
    EXPECT_THAT(failed.message(), ::testing::Not(HasSubstr("device is lost")));
    EXPECT_TRUE(backend->Healthy()) << "a recoverable error must not take the device out of service";
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "the failed call's error was left for the next one";

    std::fill(seq.output.begin(), seq.output.end(), std::nanf(""));
    const Status again = backend->Forward(**resident, batch);
    ASSERT_TRUE(again.ok()) << again.ToString();
    EXPECT_LT(testing::RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())), 1e-5);
  }
}

// A batch that fails mid-way (its inputs' copies queued, a GEMM refused) leaves work on its lane's
// stream that still reads the lane's pinned staging. The lane must not serve another caller
// before that work has run: a second caller, started the moment the failed one first turns to
// the device again (the emulation's after-fault hook), must not queue work on that stream while
// the failed batch's is still there, and its answer must be right.
TEST_F(CudaEmulationTest, AFailedBatchsLaneIsReusedOnlyOnceItsStreamHasDrained) {
  auto backend = MakeEmulatedBackend();
  ASSERT_NE(backend, nullptr);
  const LayerWeights w = SmallLayer();
  auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  testing::OwnedSequence seq = RandomSequence(rng_, 48, 24, 24, false, true, -1);
  const Sequence batch[] = {seq.View()};
  ASSERT_TRUE(backend->Forward(**resident, batch).ok());  // warm: the one lane holds its buffers

  testing::OwnedSequence other = RandomSequence(rng_, 48, 17, 17, false, false, -1);
  std::fill(other.output.begin(), other.output.end(), std::nanf(""));
  Status second = InternalError("the second caller never ran");
  bool hook_ran = false;
  cuda_emulation::SetAfterFaultHook([&] {
    hook_ran = true;
    std::thread caller([&] {
      const Sequence theirs[] = {other.View()};
      second = backend->Forward(**resident, theirs);
    });
    caller.join();
  });
  cuda_emulation::ResetCounters();
  cuda_emulation::InjectFault(cuda_emulation::Fault::kGemmInvalid);
  const Status failed = backend->Forward(**resident, batch);
  EXPECT_EQ(failed.code(), StatusCode::kInternal) << failed.ToString();
  ASSERT_TRUE(hook_ran) << "the failed caller never turned to the device again";
  ASSERT_TRUE(second.ok()) << second.ToString();
  EXPECT_EQ(cuda_emulation::ReadCounters().threads_sharing_a_stream, 0)
      << "the failed batch's lane was handed to the next caller before its stream drained";
  EXPECT_LT(RelativeL2(other.output.data(), ReferenceForward(w, other.View())), 1e-5);
  EXPECT_TRUE(backend->Healthy());
}

// A failed batch waits for its own lane's stream, not the device: a client's RESOURCE_EXHAUSTED
// (or an invalid argument) must not stall every other caller's lane with a cudaDeviceSynchronize.
// A sticky error is still seen (ADeviceFaultFailsTheBatchAndMarksTheDeviceUnhealthy, which
// counts nothing).
TEST_F(CudaEmulationTest, AFailedBatchSynchronisesItsLaneNotTheDevice) {
  for (cuda_emulation::Fault fault : {cuda_emulation::Fault::kGemmAllocFailed, cuda_emulation::Fault::kGemmInvalid,
                                      cuda_emulation::Fault::kLaunchInvalid}) {
    cuda_emulation::Reset();
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    const LayerWeights w = SmallLayer();
    auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeSummed(w)));
    ASSERT_TRUE(resident.ok());
    testing::OwnedSequence seq = RandomSequence(rng_, 48, 24, 24, false, true, -1);
    const Sequence batch[] = {seq.View()};
    ASSERT_TRUE(backend->Forward(**resident, batch).ok());
    cuda_emulation::ResetCounters();
    cuda_emulation::InjectFault(fault);
    const Status failed = backend->Forward(**resident, batch);
    EXPECT_FALSE(failed.ok());
    EXPECT_TRUE(backend->Healthy()) << failed.ToString();
    EXPECT_EQ(cuda_emulation::ReadCounters().device_synchronizations, 0)
        << failed.ToString() << ": a failed batch synchronised the whole device";
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  }
}

// With two devices and the backend on cuda:1, every device allocation is freed on device 1, also
// when the last reference to a form and the backend go on a thread that never chose a device
// (an unload on a gRPC thread): a free there would create a context on GPU 0.
TEST_F(CudaEmulationTest, MemoryIsFreedOnTheDeviceItCameFrom) {
  cuda_emulation::SetDeviceCount(2);
  auto made = MakeCudaBackend({.device = 1});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<Backend> backend = std::move(made).value();
  const LayerWeights w = SmallLayer();
  auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  testing::OwnedSequence seq = RandomSequence(rng_, 48, 24, 24, false, true, -1);
  const Sequence batch[] = {seq.View()};
  ASSERT_TRUE(backend->Forward(**resident, batch).ok());
  EXPECT_LT(RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())), 1e-5);
  EXPECT_EQ(backend->DeviceName(), "cuda:1");
  const int64_t live_before = cuda_emulation::LiveDeviceAllocations();
  cuda_emulation::ResetCounters();
  std::shared_ptr<const ResidentForm> form = std::move(resident).value();
  std::thread unload([&] {
    form.reset();  // the weights
    backend.reset();  // the lanes' workspaces
  });
  unload.join();
  EXPECT_LT(cuda_emulation::LiveDeviceAllocations(), live_before) << "nothing was freed";
  EXPECT_EQ(cuda_emulation::ReadCounters().frees_on_another_device, 0)
      << "device memory of cuda:1 freed while the thread's current device was another";
}

// The host memory the server's budget charges a CUDA batch (Backend::ScratchBytes) is what its
// lane pins for it: the inputs, the contexts when they differ from the queries, the outputs and
// the batched GEMMs' pointer arrays. The oracle is measured, not computed: a fresh backend's
// retained staging after running that one batch. And it is well below the CPU formula the
// default charged (scores and projections, which live on the device here).
TEST_F(CudaEmulationTest, TheHostFootprintChargedIsWhatTheLanePins) {
  const LayerWeights w = SmallLayer();
  struct Case {
    bool summed, cross;
    std::vector<std::pair<int64_t, int64_t>> shapes;  // n, m
  };
  for (const Case& c : {Case{false, false, {{24, 24}, {7, 7}, {40, 40}}}, Case{true, true, {{30, 12}, {9, 5}}},
                        Case{true, false, {{16, 16}}}, Case{false, true, {{5, 33}, {12, 12}}}}) {
    SCOPED_TRACE(std::string(c.summed ? "summed" : "factored") + (c.cross ? ", cross-attention" : ""));
    auto backend = MakeEmulatedBackend();
    ASSERT_NE(backend, nullptr);
    auto form = std::make_shared<const FormWeights>(c.summed ? MaterializeSummed(w) : MaterializeFactored(w));
    auto resident = backend->Upload(form);
    ASSERT_TRUE(resident.ok());
    std::vector<testing::OwnedSequence> seqs;
    std::vector<SequenceShape> shapes;
    for (const auto& [n, m] : c.shapes) {
      seqs.push_back(RandomSequence(rng_, 48, n, m, c.cross, false, -1));
      shapes.push_back({.n = n, .m = m});
    }
    std::vector<Sequence> batch;
    for (auto& seq : seqs) batch.push_back(seq.View());
    const int64_t charged = backend->ScratchBytes(*form, shapes, !c.cross);
    ASSERT_EQ(backend->RetainedScratchBytes(), 0);
    ASSERT_TRUE(backend->Forward(**resident, batch).ok());
    EXPECT_EQ(charged, backend->RetainedScratchBytes()) << "charged a batch other than what its lane pinned";
    EXPECT_LT(charged, ForwardScratchBytes(*form, shapes, !c.cross, 1, INT64_MAX));
    for (auto& seq : seqs) EXPECT_LT(RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())), 1e-5);
  }
}

// --- Attention in blocks of query rows ----------------------------------------------------

// Its own suite, not CudaEmulationTest's: nothing here is concurrent, so the ThreadSanitizer run
// of that suite (scripts/test) would only pay for these longer sequences.
class CudaQueryRowBlockTest : public CudaEmulationTest {};

// A backend whose score workspace (scores, and the summed form's A_cat beside them) is bounded
// by `bytes`: each sequence's queries then run in blocks of rows.
std::unique_ptr<Backend> MakeBackendWithScoreBound(int64_t bytes) {
  // The GEMM path: the blocks of query rows cut under the bound are its (the fused kernel's
  // workspace holds no scores).
  auto backend = MakeCudaBackend({.max_score_workspace_bytes = bytes, .gemm_attention = true});
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// The block height CudaBackendOptions::max_score_workspace_bytes documents: as many query rows
// as keep heads · rows · keys floats (twice that for the summed form) within the bound, at
// least one.
int64_t BlockRowsUnder(int64_t bound, const LayerConfig& c, bool summed, const testing::OwnedSequence& s) {
  const int64_t keys = s.key_length < 0 ? s.m : s.key_length;
  const int64_t row_bytes = (summed ? 2 : 1) * c.heads * keys * static_cast<int64_t>(sizeof(float));
  return std::clamp<int64_t>(bound / row_bytes, 1, s.n);
}

// Each form a layer serves: factored, summed, and low rank at full rank (its own value block
// per query head, so under GQA its heads take the head-by-head mix), which is the layer exactly.
std::vector<std::pair<std::string, FormWeights>> EveryForm(const LayerWeights& w) {
  std::vector<std::pair<std::string, FormWeights>> forms;
  forms.emplace_back("factored", MaterializeFactored(w));
  forms.emplace_back("summed", MaterializeSummed(w));
  auto low_rank = MaterializeLowRank(w, std::vector<int64_t>(w.config.heads, w.config.d_head));
  EXPECT_TRUE(low_rank.ok()) << low_rank.status().ToString();
  if (low_rank.ok()) forms.emplace_back("low-rank", std::move(low_rank).value());
  return forms;
}

// A bound small enough that every sequence runs in several blocks of query rows, the last one
// partial: each form, over causal self-attention (at a position offset), key padding (with and
// without the causal mask), cross-attention to a longer and to a shorter context, for multi-head
// and grouped-query layers with RoPE, against the float64 reference. One masked-softmax launch
// per block shows the blocks ran.
TEST_F(CudaQueryRowBlockTest, EveryFormMatchesFloat64Reference) {
  const LayerWeights mha = RandomLayerWeights(*CompleteConfig({.d_model = 40, .heads = 4, .d_head = 10}), rng_());
  const LayerWeights gqa_rope = RandomLayerWeights(
      *CompleteConfig({.d_model = 48, .heads = 6, .kv_heads = 2, .d_head = 8, .bias = false, .rope_theta = 10000.0}),
      rng_());
  constexpr int64_t kBound = 20 << 10;  // 2 to 44 rows a block here
  for (const LayerWeights* w : {&mha, &gqa_rope}) {
    const LayerConfig& c = w->config;
    const int64_t d = c.d_model;
    // Prime query counts: no block height divides them, so every sequence ends in a partial block.
    std::vector<testing::OwnedSequence> seqs;
    seqs.push_back(RandomSequence(rng_, d, 151, 151, false, true, -1));  // causal self-attention
    seqs.back().position_offset = 1000;
    seqs.push_back(RandomSequence(rng_, d, 131, 131, false, false, 97));  // key padding
    seqs.push_back(RandomSequence(rng_, d, 127, 127, false, true, 61));   // causal and padded
    seqs.back().position_offset = 7;
    seqs.push_back(RandomSequence(rng_, d, 71, 190, true, false, -1));  // a longer context
    seqs.back().position_offset = 33;
    seqs.push_back(RandomSequence(rng_, d, 89, 40, true, true, 29));  // a shorter one, causal, padded
    std::vector<std::vector<double>> want;
    for (auto& s : seqs) want.push_back(ReferenceForward(*w, s.View()));

    auto blocked = MakeBackendWithScoreBound(kBound);
    auto whole = MakeBackendWithScoreBound(CudaBackendOptions{}.max_score_workspace_bytes);
    ASSERT_NE(blocked, nullptr);
    ASSERT_NE(whole, nullptr);
    for (auto& [name, form] : EveryForm(*w)) {
      const bool summed = form.head_combine() == HeadCombine::kSumOfMixes;
      int64_t extra_blocks = 0;
      for (const auto& s : seqs) {
        const int64_t rows = BlockRowsUnder(kBound, c, summed, s);
        ASSERT_GE(s.n / rows, 2) << name << ": n=" << s.n << " must take several blocks of " << rows;
        ASSERT_NE(s.n % rows, 0) << name << ": n=" << s.n << " must end in a partial block of " << rows;
        extra_blocks += (s.n + rows - 1) / rows - 1;
      }
      auto shared_form = std::make_shared<const FormWeights>(std::move(form));
      int64_t launches[2] = {0, 0};
      for (int run = 0; run < 2; ++run) {
        Backend& backend = run == 0 ? *whole : *blocked;
        auto resident = backend.Upload(shared_form);
        ASSERT_TRUE(resident.ok()) << resident.status().ToString();
        std::vector<Sequence> batch;
        for (auto& s : seqs) {
          std::fill(s.output.begin(), s.output.end(), std::nanf(""));
          batch.push_back(s.View());
        }
        cuda_emulation::ResetCounters();
        const Status st = backend.Forward(**resident, batch);
        ASSERT_TRUE(st.ok()) << st.ToString();
        launches[run] = cuda_emulation::ReadCounters().kernel_launches;
        for (size_t r = 0; r < seqs.size(); ++r) {
          EXPECT_LT(RelativeL2(seqs[r].output.data(), want[r]), 1e-5)
              << name << (run == 0 ? " in one block" : " in blocks") << ", sequence " << r << " n=" << seqs[r].n
              << " m=" << seqs[r].m << " causal=" << seqs[r].causal << " key_length=" << seqs[r].key_length
              << ", config " << c.ToString();
        }
      }
      // Per block a masked softmax (for the summed form writing A_cat itself).
      EXPECT_EQ(launches[1] - launches[0], extra_blocks) << name << ", config " << c.ToString();
    }
  }
}

// CudaBackendOptions::summed_mix_first: a summed sequence with fewer queries than keys mixes its
// keys first (the skeleton's Attend with the context as every head's values, then one GEMM per
// head), the others project first, in one batch; each against float64, for multi-head, grouped
// and multi-query layers, whole and in blocks of rows; and the FLOPs counted are the order's.
TEST_F(CudaQueryRowBlockTest, SummedMixingFirstMatchesFloat64Reference) {
  const LayerWeights mha = RandomLayerWeights(*CompleteConfig({.d_model = 40, .heads = 4, .d_head = 10}), rng_());
  const LayerWeights gqa = RandomLayerWeights(
      *CompleteConfig({.d_model = 48, .heads = 6, .kv_heads = 2, .d_head = 8, .bias = false, .rope_theta = 10000.0}),
      rng_());
  const LayerWeights mqa = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4, .kv_heads = 1}), rng_());
  for (const LayerWeights* w : {&mha, &gqa, &mqa}) {
    const int64_t d = w->config.d_model;
    std::vector<testing::OwnedSequence> seqs;
    seqs.push_back(RandomSequence(rng_, d, 23, 97, true, false, -1));  // n < m: mixes first
    seqs.push_back(RandomSequence(rng_, d, 31, 31, false, true, -1));  // n = m: projects first
    seqs.push_back(RandomSequence(rng_, d, 5, 64, true, false, 41));   // mixes first, padded keys
    std::vector<std::vector<double>> want;
    for (auto& s : seqs) want.push_back(ReferenceForward(*w, s.View()));
    auto form = std::make_shared<const FormWeights>(MaterializeSummed(*w));
    for (int64_t bound : {int64_t{256} << 20, int64_t{4} << 10}) {
      auto backend = MakeCudaBackend({.max_score_workspace_bytes = bound, .summed_mix_first = true});
      ASSERT_TRUE(backend.ok()) << backend.status().ToString();
      auto resident = (*backend)->Upload(form);
      ASSERT_TRUE(resident.ok()) << resident.status().ToString();
      std::vector<Sequence> batch;
      std::vector<SequenceShape> shapes;
      for (auto& s : seqs) {
        std::fill(s.output.begin(), s.output.end(), std::nanf(""));
        batch.push_back(s.View());
        shapes.push_back({.n = s.n, .m = s.m, .keys = s.key_length < 0 ? s.m : s.key_length});
      }
      const Status st = (*backend)->Forward(**resident, batch);
      ASSERT_TRUE(st.ok()) << st.ToString();
      for (size_t r = 0; r < seqs.size(); ++r) {
        EXPECT_LT(RelativeL2(seqs[r].output.data(), want[r]), 1e-5)
            << "sequence " << r << ", bound " << bound << ", config " << w->config.ToString();
      }
      const SummedOrder by_shape{.mix_first_allowed = true};
      EXPECT_EQ((*backend)->Flops(*form, shapes), ForwardFlops(*form, shapes, by_shape));
      EXPECT_LT((*backend)->Flops(*form, shapes), ForwardFlops(*form, shapes)) << "mixing first saves FLOPs here";
    }
  }
}

// A long-ish sequence under a 1 MiB bound: the device workspace a batch reserves is the bound
// plus terms linear in the tokens (inputs, Q, K, values, O, Y), far below the heads · n · L
// scores of the whole sequence at once; and the answer is still the float64 one.
TEST_F(CudaQueryRowBlockTest, WorkspaceStaysLinearInSequenceLength) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 16, .heads = 2, .d_head = 8}), rng_());
  const LayerConfig& c = w.config;
  constexpr int64_t kBound = 1 << 20, kTokens = 2048;
  testing::OwnedSequence seq = RandomSequence(rng_, c.d_model, kTokens, kTokens, false, true, -1);
  const std::vector<double> want = ReferenceForward(w, seq.View());
  for (Form form : {Form::kFactored, Form::kSummed}) {
    auto backend = MakeBackendWithScoreBound(kBound);
    ASSERT_NE(backend, nullptr);
    auto weights =
        std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(w) : MaterializeSummed(w));
    auto resident = backend->Upload(weights);
    ASSERT_TRUE(resident.ok()) << resident.status().ToString();
    const int64_t before = cuda_emulation::LiveDeviceBytes();
    const Sequence batch[] = {seq.View()};
    ASSERT_TRUE(backend->Forward(**resident, batch).ok());
    const int64_t workspace = cuda_emulation::LiveDeviceBytes() - before;

    const FormWeights& f = *weights;
    const int64_t per_token = 2 * c.d_model + f.q_cols + f.k_cols + f.value_cols + f.out_rows;
    const int64_t linear = kTokens * per_token * static_cast<int64_t>(sizeof(float)) + 8 * 256;  // + alignment
    const int64_t whole_scores = c.heads * kTokens * kTokens * static_cast<int64_t>(sizeof(float));
    EXPECT_GT(workspace, 0) << FormName(form);
    EXPECT_LE(workspace, kBound + linear) << FormName(form) << ": bound " << kBound << " + linear " << linear;
    EXPECT_LT(workspace, whole_scores / 8) << FormName(form) << ": the whole sequence's scores are " << whole_scores;
    EXPECT_LT(RelativeL2(seq.output.data(), want), 1e-5) << FormName(form);
    std::cout << "[ info     ] " << FormName(form) << ": device workspace " << workspace
              << " bytes for n = L = " << kTokens << " (scores of the whole sequence: " << whole_scores << ")\n";
  }
}

// --- Device memory under --max-device-memory-mb -------------------------------------------

// Not concurrent either: its own suite, out of the ThreadSanitizer run.
class CudaDeviceMemoryTest : public CudaEmulationTest {
 protected:
  void TearDown() override {
    cuda_emulation::SetDeviceMemoryBytes(cuda_emulation::kDefaultDeviceMemoryBytes);
    CudaEmulationTest::TearDown();
  }
};

// On the GEMM path, whose score pieces are what a budget cuts into blocks (the fused kernel's
// workspace is linear in the tokens: cuda_fused_attention_test.cc).
std::unique_ptr<Backend> MakeBackendWithDeviceBudget(int64_t bytes) {
  auto backend = MakeCudaBackend({.max_device_bytes = bytes, .gemm_attention = true});
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// The device bytes a form's weights take as the backend uploads them (one allocation each).
int64_t WeightBytes(const FormWeights& f) {
  return static_cast<int64_t>(f.w_in.size() + f.b_in.size() + f.w_out.size() + f.b_out.size()) *
         static_cast<int64_t>(sizeof(float));
}

// What a self-attention batch of `tokens` rows holds on the device apart from its scores: the
// inputs, Q and K, the value block, O and Y, with every piece's 256-byte alignment.
int64_t LinearWorkspaceBytes(const FormWeights& f, int64_t tokens) {
  const int64_t per_token = 2 * f.config.d_model + f.q_cols + f.k_cols + f.value_cols + f.out_rows;
  return tokens * per_token * static_cast<int64_t>(sizeof(float)) + 7 * 256;
}

// A sequence whose whole scores (8 MiB, 16 with the summed form's A_cat) are far past a budget
// that holds the weights, the linear pieces and 256 KiB: it runs in smaller blocks of query
// rows than max_score_workspace_bytes (256 MiB) alone would cut, the device never holds more
// than the budget, and the answer is the float64 one.
TEST_F(CudaDeviceMemoryTest, ABatchPastTheBudgetRunsInSmallerBlocks) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 16, .heads = 2, .d_head = 8}), rng_());
  constexpr int64_t kTokens = 1024;
  testing::OwnedSequence seq = RandomSequence(rng_, w.config.d_model, kTokens, kTokens, false, false, -1);
  const std::vector<double> want = ReferenceForward(w, seq.View());
  for (Form form : {Form::kFactored, Form::kSummed}) {
    auto weights =
        std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(w) : MaterializeSummed(w));
    const int64_t budget = WeightBytes(*weights) + LinearWorkspaceBytes(*weights, kTokens) + (256 << 10);
    int64_t launches[2] = {0, 0};
    for (int run = 0; run < 2; ++run) {
      const int64_t base = cuda_emulation::LiveDeviceBytes();
      auto backend = run == 0 ? MakeEmulatedBackend() : MakeBackendWithDeviceBudget(budget);
      ASSERT_NE(backend, nullptr);
      auto resident = backend->Upload(weights);
      ASSERT_TRUE(resident.ok()) << resident.status().ToString();
      std::fill(seq.output.begin(), seq.output.end(), std::nanf(""));
      const Sequence batch[] = {seq.View()};
      cuda_emulation::ResetCounters();
      const Status st = backend->Forward(**resident, batch);
      ASSERT_TRUE(st.ok()) << FormName(form) << ": " << st.ToString();
      launches[run] = cuda_emulation::ReadCounters().kernel_launches;
      EXPECT_LT(RelativeL2(seq.output.data(), want), 1e-5) << FormName(form) << (run ? " under the budget" : "");
      const int64_t held = cuda_emulation::LiveDeviceBytes() - base;
      if (run == 1) {
        EXPECT_LE(held, budget) << FormName(form) << ": the device holds more than --max-device-memory-mb allows";
        std::cout << "[ info     ] " << FormName(form) << ": " << held << " device bytes under a budget of " << budget
                  << ", " << launches[1] << " kernel launches (" << launches[0] << " unbounded)\n";
      }
    }
    EXPECT_GT(launches[1], launches[0] + 2) << FormName(form) << ": the budget did not cut the sequence into blocks";
  }
}

// A batch whose linear pieces alone pass the budget cannot run even in blocks of one query row:
// it fails with RESOURCE_EXHAUSTED naming the figures and the flag, nothing is left behind on the
// device or in the thread's error, and the device goes on serving smaller batches.
TEST_F(CudaDeviceMemoryTest, ABatchThatCannotFitFailsAndTheDeviceKeepsServing) {
  const LayerWeights w = SmallLayer();
  auto weights = std::make_shared<const FormWeights>(MaterializeSummed(w));
  const int64_t budget = WeightBytes(*weights) + (48 << 10);
  const int64_t base = cuda_emulation::LiveDeviceBytes();
  auto backend = MakeBackendWithDeviceBudget(budget);
  ASSERT_NE(backend, nullptr);
  auto resident = backend->Upload(weights);
  ASSERT_TRUE(resident.ok()) << resident.status().ToString();

  testing::OwnedSequence big = RandomSequence(rng_, w.config.d_model, 600, 600, false, true, -1);
  ASSERT_GT(LinearWorkspaceBytes(*weights, 600), 48 << 10);
  const Sequence too_big[] = {big.View()};
  const Status failed = backend->Forward(**resident, too_big);
  EXPECT_EQ(failed.code(), StatusCode::kResourceExhausted) << failed.ToString();
  EXPECT_THAT(failed.message(), HasSubstr("--max-device-memory-mb"));
  EXPECT_THAT(failed.message(), HasSubstr("even in blocks of one query row"));
  EXPECT_THAT(failed.message(), HasSubstr(" MiB"));
  EXPECT_TRUE(backend->Healthy());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_LE(cuda_emulation::LiveDeviceBytes() - base, budget);

  testing::OwnedSequence small = RandomSequence(rng_, w.config.d_model, 9, 9, false, true, -1);
  const Sequence fits[] = {small.View()};
  const Status ok = backend->Forward(**resident, fits);
  ASSERT_TRUE(ok.ok()) << ok.ToString();
  EXPECT_LT(RelativeL2(small.output.data(), ReferenceForward(w, small.View())), 1e-5);
  EXPECT_LE(cuda_emulation::LiveDeviceBytes() - base, budget);
}

// Workspaces are released on pressure: after a long batch has filled the budget with its
// workspace, a second form's weights still load (the lane gives its workspace back), and both
// forms then serve within the budget.
TEST_F(CudaDeviceMemoryTest, WeightsTakeAWorkspaceBackUnderPressure) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4, .d_head = 8}), rng_());
  auto factored = std::make_shared<const FormWeights>(MaterializeFactored(w));
  auto summed = std::make_shared<const FormWeights>(MaterializeSummed(w));
  const int64_t budget = WeightBytes(*factored) + WeightBytes(*summed) + (600 << 10);
  const int64_t base = cuda_emulation::LiveDeviceBytes();
  auto backend = MakeBackendWithDeviceBudget(budget);
  ASSERT_NE(backend, nullptr);
  auto first = backend->Upload(factored);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  testing::OwnedSequence seq = RandomSequence(rng_, w.config.d_model, 400, 400, false, false, -1);
  const std::vector<double> want = ReferenceForward(w, seq.View());
  const Sequence batch[] = {seq.View()};
  ASSERT_TRUE(backend->Forward(**first, batch).ok());
  EXPECT_LT(RelativeL2(seq.output.data(), want), 1e-5);
  ASSERT_GT(cuda_emulation::LiveDeviceBytes() - base + WeightBytes(*summed), budget)
      << "the workspace must leave too little room for the second form, or this tests nothing";

  auto second = backend->Upload(summed);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_LE(cuda_emulation::LiveDeviceBytes() - base, budget);
  for (auto* resident : {&*second, &*first}) {
    std::fill(seq.output.begin(), seq.output.end(), std::nanf(""));
    const Status st = backend->Forward(**resident, batch);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_LT(RelativeL2(seq.output.data(), want), 1e-5);
    EXPECT_LE(cuda_emulation::LiveDeviceBytes() - base, budget);
  }
}

// A cudaMalloc the device refuses inside the budget (another process holds the memory) is tried
// again once, after the idle lanes' workspaces are taken back: one refusal costs nothing.
TEST_F(CudaDeviceMemoryTest, ARefusedAllocationIsTriedAgainOnce) {
  auto backend = MakeEmulatedBackend();
  ASSERT_NE(backend, nullptr);
  const LayerWeights w = SmallLayer();
  auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  testing::OwnedSequence seq = RandomSequence(rng_, w.config.d_model, 30, 30, false, true, -1);
  const Sequence batch[] = {seq.View()};
  cuda_emulation::InjectFault(cuda_emulation::Fault::kOutOfMemory);
  const Status st = backend->Forward(**resident, batch);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_LT(RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())), 1e-5);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

// Without --max-device-memory-mb the budget is 90 % of the device memory free at start-up
// (cudaMemGetInfo): on an emulated 16 MiB device of which another user holds 8 MiB, a sequence
// whose scores alone would take all of it runs in blocks, and the backend holds at most 7.2 MiB.
TEST_F(CudaDeviceMemoryTest, TheDefaultBudgetIsNinetyPercentOfTheFreeMemory) {
  constexpr int64_t kDevice = 16 << 20, kHeldByOthers = 8 << 20;
  cuda_emulation::SetDeviceMemoryBytes(kDevice);
  ASSERT_EQ(cuda_emulation::LiveDeviceBytes(), 0) << "an earlier test left device memory behind";
  void* others = nullptr;
  ASSERT_EQ(cudaMalloc(&others, kHeldByOthers), cudaSuccess);
  {
    const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 16, .heads = 2, .d_head = 8}), rng_());
    auto made = MakeCudaBackend({.gemm_attention = true});  // the path whose scores fill the budget
    ASSERT_TRUE(made.ok());
    std::unique_ptr<Backend> backend = std::move(made).value();
    auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
    ASSERT_TRUE(resident.ok()) << resident.status().ToString();
    testing::OwnedSequence seq = RandomSequence(rng_, w.config.d_model, 1024, 1024, false, false, -1);
    const Sequence batch[] = {seq.View()};
    const Status st = backend->Forward(**resident, batch);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_LT(RelativeL2(seq.output.data(), ReferenceForward(w, seq.View())), 1e-5);
    const int64_t ours = cuda_emulation::LiveDeviceBytes() - kHeldByOthers;
    EXPECT_LE(ours, static_cast<int64_t>(kDefaultDeviceMemoryFraction * (kDevice - kHeldByOthers)));
    EXPECT_GT(ours, static_cast<int64_t>(0.5 * (kDevice - kHeldByOthers))) << "the budget was not used";
  }
  cudaFree(others);
}

// A batch whose workspace does not fit the budget even in blocks of one query row, when half of
// it would, runs in halves (each a forward of its own: two output projections, not one) instead
// of failing; every answer is the float64 one and the device never holds more than the budget.
TEST_F(CudaDeviceMemoryTest, ABatchThatFitsOnlyInPartsRunsInHalves) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4, .d_head = 8}), rng_());
  auto weights = std::make_shared<const FormWeights>(MaterializeFactored(w));
  constexpr int64_t kSequences = 8, kTokens = 64;
  const int64_t budget = WeightBytes(*weights) + LinearWorkspaceBytes(*weights, kSequences * kTokens) * 6 / 10;
  const int64_t base = cuda_emulation::LiveDeviceBytes();
  auto backend = MakeBackendWithDeviceBudget(budget);
  ASSERT_NE(backend, nullptr);
  auto resident = backend->Upload(weights);
  ASSERT_TRUE(resident.ok()) << resident.status().ToString();
  std::vector<testing::OwnedSequence> seqs;
  std::vector<Sequence> batch;
  for (int64_t i = 0; i < kSequences; ++i) {
    seqs.push_back(RandomSequence(rng_, w.config.d_model, kTokens, kTokens, false, i % 2 == 1, -1));
  }
  for (auto& s : seqs) batch.push_back(s.View());
  cuda_emulation::ResetCounters();
  const Status st = backend->Forward(**resident, batch);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_GE(cuda_emulation::ReadCounters().gemm_calls, 2 * 3) << "the batch did not run in parts";
  for (size_t r = 0; r < seqs.size(); ++r) {
    EXPECT_LT(RelativeL2(seqs[r].output.data(), ReferenceForward(w, batch[r])), 1e-5) << "sequence " << r;
  }
  EXPECT_LE(cuda_emulation::LiveDeviceBytes() - base, budget);
  EXPECT_TRUE(backend->Healthy());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

// A lane keeps its workspace and pinned staging for the next batch only up to
// retain_workspace_bytes: after a small batch both stay (the next batch allocates nothing, and
// the pinned bytes are reported as retained scratch); after a lone large one the device holds
// the weights alone again and nothing pinned is retained. A run of large batches keeps them
// from its second batch on, until a batch under the bound ends the run.
TEST_F(CudaDeviceMemoryTest, ALargeBatchsMemoryIsReleasedWhenItEnds) {
  const LayerWeights w = SmallLayer();
  auto weights = std::make_shared<const FormWeights>(MaterializeSummed(w));
  const int64_t base = cuda_emulation::LiveDeviceBytes();
  auto made = MakeCudaBackend({.retain_workspace_bytes = 128 << 10});
  ASSERT_TRUE(made.ok());
  Backend& backend = **made;
  auto resident = backend.Upload(weights);
  ASSERT_TRUE(resident.ok());
  testing::OwnedSequence small = RandomSequence(rng_, w.config.d_model, 6, 6, false, true, -1);
  testing::OwnedSequence large = RandomSequence(rng_, w.config.d_model, 700, 700, false, true, -1);
  const Sequence small_batch[] = {small.View()}, large_batch[] = {large.View()};

  ASSERT_TRUE(backend.Forward(**resident, small_batch).ok());
  EXPECT_GT(cuda_emulation::LiveDeviceBytes() - base, WeightBytes(*weights)) << "a small workspace is kept";
  EXPECT_GT(backend.RetainedScratchBytes(), 0);
  cuda_emulation::ResetCounters();
  ASSERT_TRUE(backend.Forward(**resident, small_batch).ok());
  EXPECT_EQ(cuda_emulation::ReadCounters().device_allocations, 0);
  EXPECT_EQ(cuda_emulation::ReadCounters().pinned_allocations, 0);

  ASSERT_TRUE(backend.Forward(**resident, large_batch).ok());
  EXPECT_LT(RelativeL2(large.output.data(), ReferenceForward(w, large.View())), 1e-5);
  EXPECT_EQ(cuda_emulation::LiveDeviceBytes() - base, WeightBytes(*weights)) << "the large workspace was kept";
  EXPECT_EQ(backend.RetainedScratchBytes(), 0) << "the large batch's pinned staging was kept";

  // A second large batch in a row keeps its memory, so a third allocates nothing.
  ASSERT_TRUE(backend.Forward(**resident, large_batch).ok());
  EXPECT_GT(cuda_emulation::LiveDeviceBytes() - base, WeightBytes(*weights)) << "a run of large batches";
  EXPECT_GT(backend.RetainedScratchBytes(), 0);
  cuda_emulation::ResetCounters();
  std::fill(large.output.begin(), large.output.end(), std::nanf(""));
  ASSERT_TRUE(backend.Forward(**resident, large_batch).ok());
  EXPECT_EQ(cuda_emulation::ReadCounters().device_allocations, 0);
  EXPECT_EQ(cuda_emulation::ReadCounters().pinned_allocations, 0);
  EXPECT_LT(RelativeL2(large.output.data(), ReferenceForward(w, large.View())), 1e-5);

  // The first batch under the bound again ends the run: it runs in the memory it finds, then
  // gives it back.
  std::fill(small.output.begin(), small.output.end(), std::nanf(""));
  ASSERT_TRUE(backend.Forward(**resident, small_batch).ok());
  EXPECT_LT(RelativeL2(small.output.data(), ReferenceForward(w, small.View())), 1e-5);
  EXPECT_EQ(cuda_emulation::LiveDeviceBytes() - base, WeightBytes(*weights)) << "the run's workspace was kept";
  EXPECT_EQ(backend.RetainedScratchBytes(), 0) << "the run's pinned staging was kept";
  std::fill(small.output.begin(), small.output.end(), std::nanf(""));
  ASSERT_TRUE(backend.Forward(**resident, small_batch).ok());
  EXPECT_LT(RelativeL2(small.output.data(), ReferenceForward(w, small.View())), 1e-5);
}

}  // namespace
}  // namespace attnserve
