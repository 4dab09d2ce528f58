// Device-side half of the CUDA emulation: what a .cu file needs to compile as C++ and run on
// the CPU. Each block's threads run as fibers on the launching thread, so __syncthreads and
// warp shuffles really wait for every thread they name (an unreached barrier is reported, not
// hung on); blocks run one after another, in an order drawn per launch, and a block's threads
// in an order drawn per block (simt.cc). Included before the .cu file by its test wrapper.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// One copy in the process, in its own section: blocks run one at a time (RunBlocks holds a
// process-wide lock), so it is the block's, and before each block the section is filled with
// NaN (0xff bytes), so a block that reads shared memory it has not written reads poison, as a
// device's uninitialised shared memory may hold anything.
#define __shared__ [[gnu::section("cuda_emulation_shared")]] static

namespace cuda_emulation {

struct ThreadCoords {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};

// The coordinates of the emulated thread now running.
const ThreadCoords& Coords();
void SyncThreads();
// Both of the device's shuffles of a float and of a double: a float travels as a double, exactly.
double ShuffleXor(unsigned mask, double value, int lane_mask, int width);

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, d: a warp-wide
// collective like a shuffle (every lane of a full warp waits for the others), each lane giving
// its fragments of A (4 registers of two 16-bit values) and B (2), and getting its 4 floats of
// D = A·B + D, by the PTX ISA's fragment layout (simt.cc), so a kernel that loads a fragment
// into the wrong lane or register computes a wrong product here as on a device.
enum class MmaType { kBf16, kFp16 };
void MmaM16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2], MmaType type);

// What a launch checks when it is issued: the configuration (an error for cudaGetLastError) and
// an injected fault. False: nothing is queued.
bool CheckLaunch(dim3 grid, dim3 block);
// Runs `body` once per thread of every block, as a launch of grid × block threads would, when
// the launch's stream reaches it; an unreached barrier is a fault (sticky, as on a device).
void RunBlocks(dim3 grid, dim3 block, const std::function<void()>& body);

namespace internal {
void CountLegacyStreamWork();                                          // state.h
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work);  // state.h
void SetLastError(cudaError_t error);                                  // state.h
}  // namespace internal

// kernel<<<grid, block, 0, stream>>>(args...) is Launch(kernel, grid, block, stream)(args...):
// checked now, queued on the stream with its arguments copied (or recorded into the stream's
// capture, arguments and all, as a graph's kernel node), run at a synchronisation.
template <class... Params>
auto Launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream) {
  if (stream == nullptr) internal::CountLegacyStreamWork();
  return [=](auto... args) {
    if (!CheckLaunch(grid, block)) return;
    // A capture that was invalidated records nothing: the launch reports it, as a device's does.
    const cudaError_t e = internal::Enqueue(stream, [=] { RunBlocks(grid, block, [&] { kernel(args...); }); });
    if (e != cudaSuccess) internal::SetLastError(e);
  };
}

}  // namespace cuda_emulation

#define threadIdx (::cuda_emulation::Coords().thread_idx)
#define blockIdx (::cuda_emulation::Coords().block_idx)
#define blockDim (::cuda_emulation::Coords().block_dim)
#define gridDim (::cuda_emulation::Coords().grid_dim)

inline void __syncthreads() { cuda_emulation::SyncThreads(); }

inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width = 32) {
  return static_cast<float>(cuda_emulation::ShuffleXor(mask, value, lane_mask, width));
}
inline double __shfl_xor_sync(unsigned mask, double value, int lane_mask, int width = 32) {
  return cuda_emulation::ShuffleXor(mask, value, lane_mask, width);
}

// The fast intrinsic computes 2^(x·log2 e) with x·log2 e rounded to float: its error grows
// with |x| as on the device, which the plain expf would hide.
inline float __expf(float x) { return std::exp2(x * 1.44269504f); }

template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}
