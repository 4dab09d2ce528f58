// The GPU ceiling forward_bench reports its ratios against: a cuBLAS SGEMM on the device
// (docs/benchmarks.md; the runs are in docs/journal/benchmarks-journal.md).
// Thread-safety: one call at a time per device (it times the device, which it assumes idle).
#pragma once

#include <cstdint>

#include "server/backend/cuda/cuda_backend.h"

namespace attnserve {

// GFLOP/s of a size×size×size cuBLAS SGEMM on options.device (in TF32 when options.math is kTf32), over
// random operands; UNAVAILABLE when the device cannot be used, as MakeCudaBackend says.
StatusOr<double> CudaSgemmGflops(const CudaBackendOptions& options, int64_t size);

}  // namespace attnserve
