#include "server/backend/cuda/errors.h"

#include <cstdio>

namespace attnserve::cuda {

std::string CublasName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS status " + std::to_string(static_cast<int>(s));
  }
}

// Every error the CUDA runtime API documents as needing the process relaunched.
bool IsStickyError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorContained:         // a contained hardware or peer-memory error
    case cudaErrorTensorMemoryLeak:  // a kernel exited with tensor memory still allocated
    case cudaErrorExternalDevice:    // an external device signalled its data invalid
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return OkStatus();
  const std::string message = std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e);
  if (e == cudaErrorMemoryAllocation) return ResourceExhaustedError(message + "; retry later or send less at once");
  return InternalError(message);
}

Status CublasCheck(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return OkStatus();
  const std::string message = std::string("cuBLAS error in ") + what + ": " + CublasName(s);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return ResourceExhaustedError(message + "; retry later or send less at once");
  return InternalError(message);
}

std::string Mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

}  // namespace attnserve::cuda
