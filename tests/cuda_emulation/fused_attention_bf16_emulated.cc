// server/backend/cuda/fused_attention_bf16.cu compiled as C++ over the emulation's device-side
// shim, its mma.sync through cuda_emulation::MmaM16N8K16 (its own translation unit, as
// fused_attention_emulated.cc).
// clang-format off
#include "simt.h"  // first: it defines __global__, threadIdx, __syncthreads, ... for the .cu file
#include "server/backend/cuda/fused_attention_bf16.cu"
// clang-format on
