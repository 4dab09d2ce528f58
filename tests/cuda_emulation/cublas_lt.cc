// The emulated cuBLASLt (include/cublasLt.h): descriptors that hold what they are set to, a
// heuristic that offers one algorithm for what the emulation runs, and a matmul that checks its
// layouts against each other and runs as the emulated cublasGemmEx, with the epilogue's bias.
#include <cstring>
#include <string>

#include "cublasLt.h"
#include "cublas_gemm.h"
#include "state.h"

struct cublasLtContext {
  cublasContext gemm;  // the GEMM path's handle, its stream set to each matmul's
};

struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const float* bias = nullptr;
};

struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type = CUDA_R_32F;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
};

struct cublasLtMatmulPreferenceOpaque_t {
  uint32_t alignment[4] = {256, 256, 256, 256};  // A, B, C, D: the documented defaults
};

namespace cuda_emulation {
namespace {

// The algorithm the heuristic hands out; a matmul refuses any other.
constexpr uint64_t kAlgoTag = 0x61747473657276ull;

cublasStatus_t Refuse(const std::string& why, cublasStatus_t status = CUBLAS_STATUS_INVALID_VALUE) {
  internal::Diagnose("cublasLtMatmul: " + why);
  return status;
}

template <class T>
cublasStatus_t SetFrom(T* field, const void* buf, size_t size) {
  if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

// m, n and k from D and A, and whether every layout agrees with them and the operation is one
// the emulation runs (else the reason).
std::string Mismatch(const cublasLtMatmulDescOpaque_t& op, const cublasLtMatrixLayoutOpaque_t& a,
                     const cublasLtMatrixLayoutOpaque_t& b, const cublasLtMatrixLayoutOpaque_t& c,
                     const cublasLtMatrixLayoutOpaque_t& d) {
  const uint64_t m = d.rows, n = d.cols, k = op.transa == CUBLAS_OP_N ? a.cols : a.rows;
  const bool a_fits = op.transa == CUBLAS_OP_N ? a.rows == m : a.cols == m;
  const bool b_fits = op.transb == CUBLAS_OP_N ? b.rows == k && b.cols == n : b.cols == k && b.rows == n;
  if (!a_fits || !b_fits) return "A, B and D's layouts do not make one product";
  if (c.rows != d.rows || c.cols != d.cols || c.ld != d.ld || c.type != d.type) return "C's layout is not D's";
  if (op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F) {
    return "CUBLAS_COMPUTE_32F with CUDA_R_32F scales is emulated";
  }
  if (op.epilogue != CUBLASLT_EPILOGUE_DEFAULT && op.epilogue != CUBLASLT_EPILOGUE_BIAS) {
    return "the epilogues DEFAULT and BIAS are emulated";
  }
  return "";
}

}  // namespace
}  // namespace cuda_emulation

using cuda_emulation::SetFrom;

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (cuda_emulation::internal::StickyError() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute_type,
                                        cudaDataType_t scale_type) {
  *desc = new cublasLtMatmulDescOpaque_t{.compute = compute_type, .scale = scale_type};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return SetFrom(&desc->transa, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return SetFrom(&desc->transb, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return SetFrom(&desc->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return SetFrom(&desc->bias, buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  // The documented rule for a column-major layout: ld ≥ rows (rows > 0).
  if (ld < static_cast<int64_t>(rows) || ld <= 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (cuda_emulation::internal::TakeFault(cuda_emulation::Fault::kLtLayoutAllocFailed)) {
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  *layout = new cublasLtMatrixLayoutOpaque_t{.type = type, .rows = rows, .cols = cols, .ld = ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    uint64_t bytes = 0;
    return SetFrom(&bytes, buf, size);  // the emulation needs none
  }
  const int i = static_cast<int>(attr) - static_cast<int>(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
  if (i < 0 || i >= 4) return CUBLAS_STATUS_INVALID_VALUE;
  return SetFrom(&pref->alignment[i], buf, size);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (requested < 1 || results == nullptr || returned == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  if (!cuda_emulation::Mismatch(*desc, *a, *b, *c, *d).empty()) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (uint32_t alignment : pref->alignment) {
    if (alignment < 4) return CUBLAS_STATUS_SUCCESS;  // none: an operand below a float's alignment
  }
  results[0] = {};
  results[0].algo.data[0] = cuda_emulation::kAlgoTag;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void*, size_t, cudaStream_t stream) {
  using cuda_emulation::Refuse;
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (const std::string why = cuda_emulation::Mismatch(*desc, *a, *b, *c, *d); !why.empty()) {
    return Refuse(why, CUBLAS_STATUS_NOT_SUPPORTED);
  }
  if (algo == nullptr || algo->data[0] != cuda_emulation::kAlgoTag) {
    return Refuse("an algorithm from cublasLtMatmulAlgoGetHeuristic is emulated", CUBLAS_STATUS_NOT_SUPPORTED);
  }
  if (C != D) return Refuse("C and D the same matrix is emulated", CUBLAS_STATUS_NOT_SUPPORTED);
  if (const cublasStatus_t s = cuda_emulation::CheckTypes("cublasLtMatmul", a->type, b->type, d->type, desc->compute)) {
    return s;
  }
  if (desc->epilogue == CUBLASLT_EPILOGUE_BIAS && desc->bias == nullptr) return Refuse("the bias epilogue without a bias");
  handle->gemm.stream = stream;
  return cuda_emulation::Gemm({.name = "cublasLtMatmul",
                               .handle = &handle->gemm,
                               .transa = desc->transa,
                               .transb = desc->transb,
                               .m = static_cast<int>(d->rows),
                               .n = static_cast<int>(d->cols),
                               .k = static_cast<int>(desc->transa == CUBLAS_OP_N ? a->cols : a->rows),
                               .alpha = static_cast<const float*>(alpha),
                               .beta = static_cast<const float*>(beta),
                               .a = A,
                               .a_type = a->type,
                               .lda = static_cast<int>(a->ld),
                               .b = B,
                               .b_type = b->type,
                               .ldb = static_cast<int>(b->ld),
                               .c = static_cast<float*>(D),
                               .ldc = static_cast<int>(d->ld),
                               .bias = desc->epilogue == CUBLASLT_EPILOGUE_BIAS ? desc->bias : nullptr});
}
