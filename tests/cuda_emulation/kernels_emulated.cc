// server/backend/cuda/kernels.cu compiled as C++ over the emulation's device-side shim.
// clang-format off
#include "simt.h"  // first: it defines __global__, threadIdx, __syncthreads, ... for kernels.cu
#include "server/backend/cuda/kernels.cu"
// clang-format on
