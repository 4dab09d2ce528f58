// The emulated cuBLAS GEMMs: argument checks as cuBLAS documents them, every operand checked to
// lie inside device memory, batch entries whose outputs overlap refused, then a plain
// column-major product in float32 (TF32-rounded inputs when asked for; bfloat16 or half A and B
// widened exactly), queued on the stream the handle was given (cublasSetStream; the legacy
// default stream until then).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cublas_gemm.h"
#include "cublas_v2.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "state.h"

namespace cuda_emulation {
namespace {

// A float rounded to TF32 (10 explicit mantissa bits), to nearest, ties to even: what the
// tensor cores multiply.
float RoundToTf32(float v) {
  if (!std::isfinite(v)) return v;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t dropped = 13;
  const uint32_t half = 1u << (dropped - 1), lsb = (bits >> dropped) & 1u;
  bits = (bits + half - 1 + lsb) & ~((1u << dropped) - 1);
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

size_t ElementBytes(cudaDataType t) { return t == CUDA_R_32F ? sizeof(float) : sizeof(uint16_t); }

// Element i of an A or B operand of type t, as the float it holds: bfloat16 and half widen
// exactly, as the tensor cores read them.
float Load(const void* data, cudaDataType t, int64_t i) {
  if (t == CUDA_R_16BF) return __bfloat162float(__ushort_as_bfloat16(static_cast<const unsigned short*>(data)[i]));
  if (t == CUDA_R_16F) return __half2float(__ushort_as_half(static_cast<const unsigned short*>(data)[i]));
  return static_cast<const float*>(data)[i];
}

// One operand as cuBLAS sees it: `rows` × `cols` stored column-major with leading dimension ld.
struct Operand {
  const char* name;
  const void* data;
  cudaDataType type;
  int64_t rows, cols, ld;
  int64_t Extent() const { return rows == 0 || cols == 0 ? 0 : (cols - 1) * ld + rows; }
};

cublasStatus_t Invalid(const std::string& call, const std::string& why) {
  internal::Diagnose(call + ": " + why + " (CUBLAS_STATUS_INVALID_VALUE)");
  return CUBLAS_STATUS_INVALID_VALUE;
}

// The documented checks of cublas<t>gemm / cublasGemmEx / cublasGemmStridedBatchedEx.
cublasStatus_t Validate(const GemmCall& g) {
  const std::string call = g.name;
  if (g.handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  for (cublasOperation_t op : {g.transa, g.transb}) {
    if (op != CUBLAS_OP_N && op != CUBLAS_OP_T && op != CUBLAS_OP_C) return Invalid(call, "bad operation");
  }
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) {
    return Invalid(call, "negative size: m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                             " k=" + std::to_string(g.k) + " batchCount=" + std::to_string(g.batch));
  }
  const int need_lda = std::max(1, g.transa == CUBLAS_OP_N ? g.m : g.k);
  const int need_ldb = std::max(1, g.transb == CUBLAS_OP_N ? g.k : g.n);
  const int need_ldc = std::max(1, g.m);
  if (g.lda < need_lda) return Invalid(call, "lda=" + std::to_string(g.lda) + " < " + std::to_string(need_lda));
  if (g.ldb < need_ldb) return Invalid(call, "ldb=" + std::to_string(g.ldb) + " < " + std::to_string(need_ldb));
  if (g.ldc < need_ldc) return Invalid(call, "ldc=" + std::to_string(g.ldc) + " < " + std::to_string(need_ldc));
  if (g.alpha == nullptr || g.beta == nullptr || internal::IsDevicePointer(g.alpha) ||
      internal::IsDevicePointer(g.beta)) {
    return Invalid(call, "alpha and beta must be host pointers (CUBLAS_POINTER_MODE_HOST)");
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Every element a batch entry touches must be device memory; a device would fault otherwise.
bool InDeviceMemory(const GemmCall& g, const Operand& op, long long stride) {
  if (op.Extent() == 0) return true;
  const size_t bytes = ElementBytes(op.type);
  for (int i = 0; i < g.batch; ++i) {
    const void* base = static_cast<const char*>(op.data) + i * stride * static_cast<long long>(bytes);
    if (!internal::IsDeviceRange(base, static_cast<size_t>(op.Extent()) * bytes)) {
      internal::RaiseFault(cudaErrorIllegalAddress, std::string(g.name) + ": operand " + op.name + " of batch entry " +
                                                        std::to_string(i) + " (" + std::to_string(op.rows) + "x" +
                                                        std::to_string(op.cols) + ", ld=" + std::to_string(op.ld) +
                                                        ") is not inside one device allocation");
      return false;
    }
  }
  return true;
}

// A, B and C of every entry of the call inside device memory (a fault raised for the first that
// is not); a matrix of depth k = 0 reads no A or B.
bool OperandsInDeviceMemory(const GemmCall& g) {
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  const Operand a{"A", g.a, g.a_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda};
  const Operand b{"B", g.b, g.b_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb};
  const Operand c{"C", g.c, CUDA_R_32F, g.m, g.n, g.ldc};
  return (g.k == 0 || (InDeviceMemory(g, a, g.stride_a) && InDeviceMemory(g, b, g.stride_b))) &&
         InDeviceMemory(g, c, g.stride_c);
}

// The outputs of a strided batch's entries must not share an element: on a device the entries
// run side by side and such an element's value would be a race (cuBLAS does not check; the
// emulation refuses it).
bool OutputsOverlap(const GemmCall& g) {
  if (g.batch <= 1 || g.m == 0 || g.n == 0) return false;
  const int64_t extent = int64_t{g.n - 1} * g.ldc + g.m;
  const int64_t stride = std::llabs(g.stride_c);
  if (stride >= extent) return false;  // each entry's block lies past the one before
  if (stride == 0) return true;
  std::vector<bool> written(static_cast<size_t>(stride * (g.batch - 1) + extent), false);
  for (int64_t e = 0; e < g.batch; ++e) {
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.m; ++i) {
        auto&& at = written[static_cast<size_t>(e * stride + j * g.ldc + i)];
        if (at) return true;
        at = true;
      }
    }
  }
  return false;
}

// The product itself, when the handle's stream reaches it. alpha and beta are the values read
// at the call (host pointer mode).
void RunGemm(const GemmCall& g, float alpha, float beta) {
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  auto in = [&](float v) { return g.tf32 && g.a_type == CUDA_R_32F ? RoundToTf32(v) : v; };
  for (int batch = 0; batch < g.batch; ++batch) {
    const int64_t a0 = batch * g.stride_a, b0 = batch * g.stride_b;
    float* pc = g.c + batch * g.stride_c;
    for (int j = 0; j < g.n; ++j) {
      for (int i = 0; i < g.m; ++i) {
        float acc = 0.0f;
        for (int p = 0; p < g.k; ++p) {
          const float av = Load(g.a, g.a_type, a0 + (ta ? p + int64_t{i} * g.lda : i + int64_t{p} * g.lda));
          const float bv = Load(g.b, g.b_type, b0 + (tb ? j + int64_t{p} * g.ldb : p + int64_t{j} * g.ldb));
          acc = std::fma(in(av), in(bv), acc);
        }
        float& out = pc[i + int64_t{j} * g.ldc];
        // With beta == 0, C is not read (it may hold NaN), as cuBLAS documents.
        out = beta == 0.0f ? alpha * acc : alpha * acc + beta * out;
        if (g.bias != nullptr) out += g.bias[i];  // cuBLASLt's epilogue: D's row i, every column
      }
    }
  }
}

// What every GEMM entry point does first: a lost device, the documented argument checks, the
// counters, and an injected fault.
cublasStatus_t Admit(const GemmCall& g) {
  if (internal::StickyError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (const cublasStatus_t s = Validate(g); s != CUBLAS_STATUS_SUCCESS) return s;
  internal::CountGemm();
  if (g.handle->stream == nullptr) internal::CountLegacyStreamWork();
  if (internal::TakeFault(Fault::kGemmInvalid)) {
    internal::Diagnose(std::string("injected CUBLAS_STATUS_INVALID_VALUE in ") + g.name);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (internal::TakeFault(Fault::kGemmAllocFailed)) {
    internal::Diagnose(std::string("injected CUBLAS_STATUS_ALLOC_FAILED in ") + g.name);
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  if (internal::TakeFault(Fault::kGemm)) {
    internal::RaiseFault(internal::InjectedError(cudaErrorLaunchFailure), std::string("injected fault in ") + g.name);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t Gemm(const GemmCall& g) {
  if (const cublasStatus_t s = Admit(g); s != CUBLAS_STATUS_SUCCESS) return s;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  if (!OperandsInDeviceMemory(g)) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (g.bias != nullptr && !internal::IsDeviceRange(g.bias, static_cast<size_t>(g.m) * sizeof(float))) {
    internal::RaiseFault(cudaErrorIllegalAddress,
                         std::string(g.name) + ": the bias (" + std::to_string(g.m) + " floats) is not in device memory");
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  if (OutputsOverlap(g)) {
    return Invalid(g.name, "the outputs of the batch entries overlap (ldc=" + std::to_string(g.ldc) +
                               ", strideC=" + std::to_string(g.stride_c) + ", m=" + std::to_string(g.m) +
                               ", n=" + std::to_string(g.n) + ")");
  }
  GemmCall queued = g;
  queued.alpha = queued.beta = nullptr;
  // Recorded into the stream's capture, if it is capturing: an invalidated one takes nothing.
  if (internal::Enqueue(g.handle->stream,
                        [queued, alpha = *g.alpha, beta = *g.beta] { RunGemm(queued, alpha, beta); }) != cudaSuccess) {
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// A pointer-array batch: `g` holds the sizes, leading dimensions, scalars and the arrays' device
// addresses in a, b and c (read as pointer arrays). The arrays are checked to be device memory
// now; their entries only when the stream runs the call, since until then an async copy may
// still be filling them. An entry outside device memory is then an illegal address (a fault),
// and two entries writing one element are reported as the race they would be on a device.
cublasStatus_t GemmPointerArrays(const GemmCall& g) {
  if (const cublasStatus_t s = Admit(g); s != CUBLAS_STATUS_SUCCESS) return s;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  const size_t array_bytes = static_cast<size_t>(g.batch) * sizeof(void*);
  for (const void* array :
       {static_cast<const void*>(g.a), static_cast<const void*>(g.b), static_cast<const void*>(g.c)}) {
    if (!internal::IsDeviceRange(array, array_bytes)) {
      internal::RaiseFault(cudaErrorIllegalAddress, std::string(g.name) + ": a pointer array of " +
                                                        std::to_string(g.batch) + " entries is not in device memory");
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
  }
  GemmCall queued = g;
  queued.alpha = queued.beta = nullptr;
  const cudaError_t queued_status = internal::Enqueue(g.handle->stream, [queued, alpha = *g.alpha, beta = *g.beta] {
    const auto* as = static_cast<const void* const*>(queued.a);
    const auto* bs = static_cast<const void* const*>(queued.b);
    auto* const* cs = reinterpret_cast<float* const*>(queued.c);
    auto entry = [&](int e) {
      GemmCall one = queued;
      one.a = as[e];
      one.b = bs[e];
      one.c = cs[e];
      one.batch = 1;
      return one;
    };
    std::vector<const float*> written;
    for (int e = 0; e < queued.batch; ++e) {
      const GemmCall one = entry(e);
      if (!OperandsInDeviceMemory(one)) return;
      for (int j = 0; j < one.n; ++j) {
        for (int i = 0; i < one.m; ++i) written.push_back(one.c + i + int64_t{j} * one.ldc);
      }
    }
    std::sort(written.begin(), written.end());
    if (std::adjacent_find(written.begin(), written.end()) != written.end()) {
      internal::RaiseFault(cudaErrorIllegalAddress,
                           std::string(queued.name) + ": two entries of the batch write the same element of C");
      return;
    }
    for (int e = 0; e < queued.batch; ++e) RunGemm(entry(e), alpha, beta);
  });
  return queued_status == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

bool UsesTf32(cublasHandle_t handle, cublasComputeType_t compute) {
  return compute == CUBLAS_COMPUTE_32F_FAST_TF32 ||
         (compute == CUBLAS_COMPUTE_32F && handle != nullptr && handle->math == CUBLAS_TF32_TENSOR_OP_MATH);
}

}  // namespace

// The combinations emulated, as cuBLAS's table of cublasGemmEx types has them: A and B both
// CUDA_R_32F, both CUDA_R_16BF or both CUDA_R_16F, C CUDA_R_32F; the 16-bit inputs with
// CUBLAS_COMPUTE_32F (or _PEDANTIC) only, since TF32 applies to float inputs.
cublasStatus_t CheckTypes(const char* name, cudaDataType at, cudaDataType bt, cudaDataType ct,
                          cublasComputeType_t compute) {
  const bool known = at == CUDA_R_32F || at == CUDA_R_16BF || at == CUDA_R_16F;
  if (!known || at != bt || ct != CUDA_R_32F) {
    internal::Diagnose(std::string(name) + ": A and B both CUDA_R_32F, CUDA_R_16BF or CUDA_R_16F and C CUDA_R_32F " +
                       "are emulated, got A " + std::to_string(at) + ", B " + std::to_string(bt) + ", C " +
                       std::to_string(ct));
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (at != CUDA_R_32F && compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
    internal::Diagnose(std::string(name) + ": 16-bit inputs with CUBLAS_COMPUTE_32F_FAST_TF32 are not emulated");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32 &&
      compute != CUBLAS_COMPUTE_32F_PEDANTIC) {
    internal::Diagnose(std::string(name) + ": compute type not emulated");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// The Ex entry points: 32-bit float operands only, then the common GEMM; with `pointer_arrays`,
// a, b and c are the device addresses of arrays of pointers (cublasGemmBatchedEx).
cublasStatus_t GemmEx(const char* name, cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                      int m, int n, int k, const void* alpha, const void* a, cudaDataType a_type, int lda,
                      long long stride_a, const void* b, cudaDataType b_type, int ldb, long long stride_b,
                      const void* beta, void* c, cudaDataType c_type, int ldc, long long stride_c, int batch,
                      cublasComputeType_t compute, cublasGemmAlgo_t, bool pointer_arrays = false) {
  if (auto s = CheckTypes(name, a_type, b_type, c_type, compute)) return s;
  return (pointer_arrays ? GemmPointerArrays : Gemm)({.name = name,
                                                      .handle = handle,
                                                      .transa = transa,
                                                      .transb = transb,
                                                      .m = m,
                                                      .n = n,
                                                      .k = k,
                                                      .alpha = static_cast<const float*>(alpha),
                                                      .beta = static_cast<const float*>(beta),
                                                      .a = a,
                                                      .a_type = a_type,
                                                      .lda = lda,
                                                      .stride_a = stride_a,
                                                      .b = b,
                                                      .b_type = b_type,
                                                      .ldb = ldb,
                                                      .stride_b = stride_b,
                                                      .c = static_cast<float*>(c),
                                                      .ldc = ldc,
                                                      .stride_c = stride_c,
                                                      .batch = batch,
                                                      .tf32 = UsesTf32(handle, compute)});
}

}  // namespace
}  // namespace cuda_emulation

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (cuda_emulation::internal::StickyError() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new cublasContext;
  cuda_emulation::internal::CountBlasHandle();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                           const float* beta, float* C, int ldc) {
  return cuda_emulation::GemmEx("cublasSgemm", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B,
                                CUDA_R_32F, ldb, 0, beta, C, CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT);
}

// As cuBLAS defines it: cublasGemmEx is the strided batch of one.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  return cuda_emulation::GemmEx("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb,
                                0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo) {
  return cuda_emulation::GemmEx("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda,
                                strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType,
                                algo);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                   int n, int k, const void* alpha, const void* const Aarray[], cudaDataType Atype,
                                   int lda, const void* const Barray[], cudaDataType Btype, int ldb, const void* beta,
                                   void* const Carray[], cudaDataType Ctype, int ldc, int batchCount,
                                   cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  // The arrays' addresses travel in the operand fields; GemmPointerArrays reads them as arrays.
  return cuda_emulation::GemmEx("cublasGemmBatchedEx", handle, transa, transb, m, n, k, alpha, Aarray, Atype, lda, 0,
                                Barray, Btype, ldb, 0, beta, const_cast<void**>(Carray), Ctype, ldc, 0, batchCount,
                                computeType, algo, /*pointer_arrays=*/true);
}
