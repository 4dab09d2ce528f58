// server/backend/cuda/cuda_backend.cc, unchanged, over the emulated runtime and cuBLAS headers
// (include/ comes before any CUDA toolkit on this target's include path).
#include "server/backend/cuda/cuda_backend.cc"
