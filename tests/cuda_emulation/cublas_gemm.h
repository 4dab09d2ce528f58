// What the emulated cuBLAS (cublas.cc) and cuBLASLt (cublas_lt.cc) share: the handle, one GEMM
// call as cuBLAS's column-major API describes it, and the checked, queued product.
#pragma once

#include <string>

#include "cublas_v2.h"
#include "cuda_runtime_api.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace cuda_emulation {

// One GEMM (or strided batch of them) as cuBLAS's column-major calls describe it.
struct GemmCall {
  const char* name = "";
  cublasHandle_t handle = nullptr;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  int m = 0, n = 0, k = 0;
  const float *alpha = nullptr, *beta = nullptr;
  const void* a = nullptr;
  cudaDataType a_type = CUDA_R_32F;
  int lda = 0;
  long long stride_a = 0;
  const void* b = nullptr;
  cudaDataType b_type = CUDA_R_32F;
  int ldb = 0;
  long long stride_b = 0;
  float* c = nullptr;
  int ldc = 0;
  long long stride_c = 0;
  int batch = 1;
  bool tf32 = false;
  const float* bias = nullptr;  // cuBLASLt's CUBLASLT_EPILOGUE_BIAS: m floats, added to D's rows
};

// The emulated operand and compute types (cublasGemmEx's table): NOT_SUPPORTED, diagnosed, when
// not; SUCCESS when they are.
cublasStatus_t CheckTypes(const char* name, cudaDataType at, cudaDataType bt, cudaDataType ct,
                          cublasComputeType_t compute);

// The documented argument checks, the operands (and bias) checked to lie in device memory, and
// the product queued on the handle's stream (or recorded into its capture).
cublasStatus_t Gemm(const GemmCall& g);

}  // namespace cuda_emulation
