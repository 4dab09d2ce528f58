#include "bench/cuda_sgemm_ceiling.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "server/backend/cuda/device_memory.h"
#include "server/backend/cuda/errors.h"

namespace attnserve {

StatusOr<double> CudaSgemmGflops(const CudaBackendOptions& options, int64_t size) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto backend, MakeCudaBackend(options));
  cuda::DeviceArray a, b, c;
  const size_t count = size * size;
  ATTNSERVE_RETURN_IF_ERROR(a.Reserve(count));
  ATTNSERVE_RETURN_IF_ERROR(b.Reserve(count));
  ATTNSERVE_RETURN_IF_ERROR(c.Reserve(count));
  // Random values in [-1, 1), not zeros: a GPU multiplying zeros toggles fewer bits, draws less
  // power and clocks higher, which would flatter the ceiling every ratio is taken against.
  {
    std::vector<float> host(count);
    uint32_t state = 0x9e3779b9u;
    for (float& v : host) {
      state = state * 1664525u + 1013904223u;
      v = static_cast<float>(state >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
    CUDA_TRY(cudaMemcpy(a.get(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    std::reverse(host.begin(), host.end());
    CUDA_TRY(cudaMemcpy(b.get(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  }
  cublasHandle_t handle;
  CUBLAS_TRY(cublasCreate(&handle));
  cublasSetMathMode(handle, options.math == Math::kTf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
  const float one = 1.0f, zero = 0.0f;
  const int s = static_cast<int>(size);
  auto run = [&] {
    return cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, s, s, s, &one, a.get(), s, b.get(), s, &zero, c.get(), s);
  };
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kReps = 20;
  cudaEventRecord(start);
  for (int i = 0; i < kReps; ++i) run();
  cudaEventRecord(stop);
  const cudaError_t e = cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  ATTNSERVE_RETURN_IF_ERROR(cuda::CudaCheck(e, "SGEMM ceiling"));
  return 2.0 * size * size * size * kReps / (ms * 1e-3) * 1e-9;
}

}  // namespace attnserve
