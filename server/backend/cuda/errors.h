// CUDA and cuBLAS results as attnserve Status, and which CUDA errors lose the device: the one
// place the CUDA backend's files (server/backend/cuda) turn a runtime or library code into the
// status a batch fails with (docs/architecture.md, "The CUDA backend").
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "server/core/status.h"

namespace attnserve::cuda {

// "CUBLAS_STATUS_ALLOC_FAILED", or "cuBLAS status N" for a code this build does not name.
std::string CublasName(cublasStatus_t s);

// Errors after which the CUDA context is lost: every later call on the device fails with the
// same error until the process restarts (CUDA runtime API, "sticky" errors). Only these take
// the device out of service; anything else fails the batch and the device keeps serving.
bool IsStickyError(cudaError_t e);

// OK, or the error naming `what` failed: RESOURCE_EXHAUSTED when the device ran out of memory
// (the client's to retry, smaller or later), INTERNAL for anything else.
Status CudaCheck(cudaError_t e, const char* what);
Status CublasCheck(cublasStatus_t s, const char* what);

// "12.0 MiB": the figures of the device memory messages.
std::string Mib(int64_t bytes);

}  // namespace attnserve::cuda

// Returns the call's error from the enclosing function, naming the call.
#define CUDA_TRY(call) ATTNSERVE_RETURN_IF_ERROR(::attnserve::cuda::CudaCheck((call), #call))
#define CUBLAS_TRY(call) ATTNSERVE_RETURN_IF_ERROR(::attnserve::cuda::CublasCheck((call), #call))
