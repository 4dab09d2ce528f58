#include "server/backend/cuda/cublas_ops.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "server/backend/cuda/errors.h"

namespace attnserve::cuda {

Status CublasOps::Init(cudaStream_t stream, Math math) {
  stream_ = stream;
  math_ = math;
  tf32_ = math == Math::kTf32;
  CUBLAS_TRY(cublasCreate(&handle_));
  CUBLAS_TRY(cublasSetStream(handle_, stream_));
  CUBLAS_TRY(cublasSetMathMode(handle_, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return OkStatus();
}

Status CublasOps::SetMath(Math math) {
  if (math == math_) return OkStatus();
  math_ = math;
  tf32_ = math == Math::kTf32;
  CUBLAS_TRY(cublasSetMathMode(handle_, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return OkStatus();
}

void CublasOps::Destroy() {
  DestroyPlans();
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  lt_ = nullptr;
  if (handle_ != nullptr) cublasDestroy(handle_);
  handle_ = nullptr;
}

void CublasOps::DestroyPlan(LtPlan& plan) {
  for (cublasLtMatrixLayout_t* layout : {&plan.a, &plan.b, &plan.c}) {
    if (*layout != nullptr) cublasLtMatrixLayoutDestroy(*layout);
    *layout = nullptr;
  }
  if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
  plan.desc = nullptr;
}

void CublasOps::DestroyPlans() {
  for (LtPlan& p : lt_plans_) DestroyPlan(p);
  lt_plans_.clear();
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
                         std::string(MathName(math_)));
  }
  const cudaDataType type = math_ == Math::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(w.cols), static_cast<int>(x.rows),
                          static_cast<int>(x.cols), &alpha, w.data, type, static_cast<int>(w.ld), x.data, type,
                          static_cast<int>(x.ld), &beta, y.data, CUDA_R_32F, static_cast<int>(y.ld),
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

namespace {

// The largest power of two up to 256 that divides the address: the alignment cuBLASLt's
// heuristic is told an operand has (its default, 256, would let it pick an algorithm that
// faults on an operand that starts inside a block of weights).
uint32_t AlignmentOf(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

}  // namespace

StatusOr<const CublasOps::LtPlan*> CublasOps::PlanFor(const LtKey& key) {
  for (const LtPlan& p : lt_plans_) {
    if (p.key == key) return &p;
  }
  if (lt_ == nullptr) CUBLAS_TRY(cublasLtCreate(&lt_));
  LtPlan plan{.key = key};
  if (Status made = MakePlan(plan); !made.ok()) {
    DestroyPlan(plan);
    return made;
  }
  if (lt_plans_.size() == kMaxLtPlans) DestroyPlans();  // shapes past the cap: start again
  lt_plans_.push_back(plan);
  return &lt_plans_.back();
}

Status CublasOps::MakePlan(LtPlan& p) {
  const LtKey& key = p.key;
  // Column-major, as cuBLAS sees the row-major blocks: y^T [m = w.cols, n = x.rows] =
  // w^T [m, k] · x^T [k, n]; the bias is one value per row of y^T.
  CUBLAS_TRY(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.a, key.type, key.m, key.k, key.lda));
  CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.b, key.type, key.k, key.n, key.ldb));
  CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, key.m, key.n, key.ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t no_workspace = 0;
  const uint32_t alignments[] = {key.align_a, key.align_b, key.align_c, key.align_c};
  const cublasLtMatmulPreferenceAttributes_t which[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &no_workspace, sizeof(no_workspace));
  for (int i = 0; i < 4 && status == CUBLAS_STATUS_SUCCESS; ++i) {
    status = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &alignments[i], sizeof(alignments[i]));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED: no algorithm for this operation here, as much an answer as none found.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_TRY(status);
  p.found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  p.algo = result.algo;
  return OkStatus();
}

StatusOr<bool> CublasOps::GemmHalfBias(HalfBlock x, HalfBlock w, const float* bias, DeviceBlock y, float beta) {
  if (!HalfWeights(math_)) {
    return InternalError("GemmHalfBias: expected a handle of math bf16 or fp16, got " +
                         std::string(MathName(math_)));
  }
  // The epilogue reads the bias in vectors: a bias that starts inside one takes the bias kernel.
  if (reinterpret_cast<uintptr_t>(bias) % 16 != 0) return false;
  ATTNSERVE_ASSIGN_OR_RETURN(const LtPlan* plan,
                             PlanFor({.m = w.cols,
                                      .n = x.rows,
                                      .k = x.cols,
                                      .lda = w.ld,
                                      .ldb = x.ld,
                                      .ldc = y.ld,
                                      .type = math_ == Math::kBf16 ? CUDA_R_16BF : CUDA_R_16F,
                                      .align_a = AlignmentOf(w.data),
                                      .align_b = AlignmentOf(x.data),
                                      .align_c = AlignmentOf(y.data)}));
  if (!plan->found) return false;
  CUBLAS_TRY(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  const float alpha = 1.0f;
  CUBLAS_TRY(cublasLtMatmul(lt_, plan->desc, &alpha, w.data, plan->a, x.data, plan->b, &beta, y.data, plan->c,
                            y.data, plan->c, &plan->algo, nullptr, 0, stream_));
  return true;
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
