// server/backend/cuda/fused_attention.cu compiled as C++ over the emulation's device-side shim
// (its own translation unit: its helpers share names with kernels.cu's).
// clang-format off
#include "simt.h"  // first: it defines __global__, threadIdx, __syncthreads, ... for the .cu file
#include "server/backend/cuda/fused_attention.cu"
// clang-format on
