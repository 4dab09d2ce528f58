// How the CUDA sources launch a kernel. nvcc launches on the device; compiled as C++, a .cu file
// is the tests' host emulation of its kernels (tests/cuda_emulation), which runs the same bodies
// on the CPU through cuda_emulation::Launch.
#pragma once

#ifdef __CUDACC__
#define ATTNSERVE_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#else
#define ATTNSERVE_LAUNCH(kernel, grid, block, stream) ::cuda_emulation::Launch(kernel, (grid), (block), (stream))
#endif
