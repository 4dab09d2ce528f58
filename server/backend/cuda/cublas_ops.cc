#include "server/backend/cuda/cublas_ops.h"

#include <algorithm>
#include <string>

#include "server/backend/cuda/errors.h"

namespace attnserve::cuda {

Status CublasOps::Init(cudaStream_t stream, GpuMath math) {
  stream_ = stream;
  math_ = math;
  tf32_ = math == GpuMath::kTf32;
  CUBLAS_TRY(cublasCreate(&handle_));
  CUBLAS_TRY(cublasSetStream(handle_, stream_));
  CUBLAS_TRY(cublasSetMathMode(handle_, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return OkStatus();
}

Status CublasOps::SetMath(GpuMath math) {
  if (math == math_) return OkStatus();
  math_ = math;
  tf32_ = math == GpuMath::kTf32;
  CUBLAS_TRY(cublasSetMathMode(handle_, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return OkStatus();
}

void CublasOps::Destroy() {
  if (handle_ != nullptr) cublasDestroy(handle_);
  handle_ = nullptr;
}

Status CublasOps::Gemm(DeviceBlock x, DeviceBlock w, DeviceBlock y, float alpha, float beta) {
  CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(w.cols), static_cast<int>(x.rows),
                          static_cast<int>(x.cols), &alpha, w.data, CUDA_R_32F, static_cast<int>(w.ld), x.data,
                          CUDA_R_32F, static_cast<int>(x.ld), &beta, y.data, CUDA_R_32F, static_cast<int>(y.ld),
                          ComputeType(), CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

Status CublasOps::GemmHalf(HalfBlock x, HalfBlock w, DeviceBlock y, float beta) {
  if (!HalfWeights(math_)) {
    return InternalError("GemmHalf: expected a handle of math bf16 or fp16, got " +
                         std::string(GpuMathName(math_)));
  }
  const cudaDataType type = math_ == GpuMath::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(w.cols), static_cast<int>(x.rows),
                          static_cast<int>(x.cols), &alpha, w.data, type, static_cast<int>(w.ld), x.data, type,
                          static_cast<int>(x.ld), &beta, y.data, CUDA_R_32F, static_cast<int>(y.ld),
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

Status CublasOps::GemmStridedBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha,
                                     const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                                     int64_t stride_b, float* c, int64_t ldc, int64_t stride_c, int64_t count) {
  const float beta = 0.0f;
  CUBLAS_TRY(cublasGemmStridedBatchedEx(
      handle_, op_a, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a, CUDA_R_32F,
      static_cast<int>(lda), stride_a, b, CUDA_R_32F, static_cast<int>(ldb), stride_b, &beta, c, CUDA_R_32F,
      static_cast<int>(ldc), stride_c, static_cast<int>(count), ComputeType(), CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

Status CublasOps::StartBatch(const void** device, int64_t slots) {
  pointer_slots_ = slots;
  ATTNSERVE_RETURN_IF_ERROR(pointers_host_.Reserve(pointer_slots_));
  pointers_device_ = device;
  pointers_used_ = 0;
  return OkStatus();
}

std::vector<const void*> CublasOps::StagedPointers() const {
  return std::vector<const void*>(pointers_host_.get(), pointers_host_.get() + pointers_used_);
}

Status CublasOps::CopyPointers(std::span<const void* const> pointers) {
  const int64_t count = static_cast<int64_t>(pointers.size());
  if (count == 0) return OkStatus();
  if (count > pointer_slots_) {
    return InternalError("batched GEMM pointers: " + std::to_string(count) + " past the batch's arena of " +
                         std::to_string(pointer_slots_));
  }
  ATTNSERVE_RETURN_IF_ERROR(pointers_host_.Reserve(pointer_slots_));
  std::copy(pointers.begin(), pointers.end(), pointers_host_.get());
  CUDA_TRY(
      cudaMemcpyAsync(pointers_device_, pointers_host_.get(), count * sizeof(void*), cudaMemcpyHostToDevice, stream_));
  return OkStatus();
}

Status CublasOps::GemmPointerBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha,
                                     std::span<const float* const> a, int64_t lda, std::span<const float* const> b,
                                     int64_t ldb, std::span<float* const> c, int64_t ldc) {
  const int64_t count = static_cast<int64_t>(c.size());
  if (pointers_used_ + 3 * count > pointer_slots_) {
    return InternalError("batched GEMM: " + std::to_string(3 * count) + " pointers past the batch's arena of " +
                         std::to_string(pointer_slots_) + " (" + std::to_string(pointers_used_) + " used)");
  }
  const void** host = pointers_host_.get() + pointers_used_;
  const void** device = pointers_device_ + pointers_used_;
  pointers_used_ += 3 * count;
  std::copy(a.begin(), a.end(), host);
  std::copy(b.begin(), b.end(), host + count);
  std::copy(c.begin(), c.end(), host + 2 * count);
  if (!defer_copies_) {
    CUDA_TRY(cudaMemcpyAsync(device, host, 3 * count * sizeof(void*), cudaMemcpyHostToDevice, stream_));
  }
  const float beta = 0.0f;
  CUBLAS_TRY(cublasGemmBatchedEx(handle_, op_a, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                                 static_cast<int>(k), &alpha, device, CUDA_R_32F, static_cast<int>(lda), device + count,
                                 CUDA_R_32F, static_cast<int>(ldb), &beta, const_cast<void**>(device + 2 * count),
                                 CUDA_R_32F, static_cast<int>(ldc), static_cast<int>(count), ComputeType(),
                                 CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

}  // namespace attnserve::cuda
