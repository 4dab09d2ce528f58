// server/backend/cuda/plugin.cc over the emulated runtime: libattnserve_cuda_emulated.so.
#include "server/backend/cuda/plugin.cc"
