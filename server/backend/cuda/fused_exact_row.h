// What the fused attention kernels share (fused_attention.cu in float32, fused_attention_bf16.cu
// on the tensor cores): their launch over a table of ranges, which range a block serves, the
// warp's reductions, and the float64 recomputation of a row whose scores left float32's range.
// Included by those .cu files only (it needs nvcc, or the emulation's simt.h, before it).
#pragma once

#include <cfloat>
#include <cmath>

#include "server/backend/cuda/fused_attention.h"
#include "server/backend/cuda/launch.h"

namespace attnserve::cuda::fused {

// The block's range in the launch: the last whose first block is at or before it (a binary
// search over the table's tile0s).
__device__ inline int RangeOfBlock(const FusedRanges& ranges) {
  int lo = 0, hi = ranges.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ranges.range[mid].tile0 <= static_cast<int>(blockIdx.x)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The keys row `row` of a block's tile (tile row0 of range r) sees: causal, those up to its query.
__device__ inline int KeysSeenBy(const FusedRange& r, int row0, int row) {
  return r.causal ? static_cast<int>(min(static_cast<int64_t>(r.keys), r.first_row + row0 + row + 1)) : r.keys;
}

template <bool kMax, class T>
__device__ inline T WarpAll(T v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? static_cast<T>(fmax(v, other)) : v + other;
  }
  return v;
}

// q·k in float64 (kernels.cu's ExactDot: the products of floats are exact there).
__device__ inline double ExactDot(const float* q, const float* k, int d_head) {
  double dot = 0;
  for (int t = 0; t < d_head; ++t) dot += static_cast<double>(q[t]) * static_cast<double>(k[t]);
  return dot;
}

// A row one of whose visible scores was not finite in float32, again in float64 by its warp
// from the float32 Q, K and values: weights exp(scale · (dot − max)) with the dots and the max
// in float64 (the max over the unscaled dots, the scale after the subtraction, as kernels.cu's
// ExactExponentials and for its reason), the mix accumulated in float64. A non-finite dot makes
// the max +inf and the row NaN, which the service reports as OUT_OF_RANGE. Warp-uniform:
// shuffles only.
__device__ inline void ExactRow(const float* q, const float* k, const float* values, float* out, int visible,
                                const FusedLayout& l) {
  constexpr int kColsPerLane = static_cast<int>(kFusedMaxWidth / 32);
  const int lane = threadIdx.x % 32;
  double top = -DBL_MAX;
  for (int j = lane; j < visible; j += 32) {
    const double dot = ExactDot(q, k + j * l.k_ld, l.d_head);
    top = fmax(top, fabs(dot) <= DBL_MAX ? dot : INFINITY);
  }
  top = WarpAll<true>(top);
  double sum = 0, acc[kColsPerLane] = {};
  for (int j0 = 0; j0 < visible; j0 += 32) {
    const int j = j0 + lane;
    const double e =
        j < visible ? exp(static_cast<double>(l.scale) * (ExactDot(q, k + j * l.k_ld, l.d_head) - top)) : 0.0;
    sum += e;
    for (int b = 0; b < 32 && j0 + b < visible; ++b) {
      const double weight = WarpAll<false>(lane == b ? e : 0.0);  // lane b's, to every lane
      const float* v = values + (j0 + b) * l.values_ld;
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) {
        if (lane + 32 * c < l.width) acc[c] += weight * static_cast<double>(v[lane + 32 * c]);
      }
    }
  }
  sum = WarpAll<false>(sum);
#pragma unroll
  for (int c = 0; c < kColsPerLane; ++c) {
    if (lane + 32 * c < l.width) out[lane + 32 * c] = static_cast<float>(acc[c] / sum);
  }
}

// The launch both kernels make: the table and the bounds checked, each range's first block
// numbered (`tile0`), and `kernel` run over every (range, head, tile of `tile_rows` queries)
// with `threads` a block.
inline cudaError_t LaunchOverTiles(void (*kernel)(FusedRanges, FusedLayout), int tile_rows, int threads,
                                   FusedRanges ranges, const FusedLayout& layout, cudaStream_t stream) {
  if (ranges.count <= 0 || ranges.count > kFusedMaxRanges || layout.d_head > kFusedMaxDHead ||
      layout.width > kFusedMaxWidth) {
    return cudaErrorInvalidValue;
  }
  int tiles = 0;
  for (int i = 0; i < ranges.count; ++i) {
    ranges.range[i].tile0 = tiles;
    tiles += layout.heads * ((ranges.range[i].rows + tile_rows - 1) / tile_rows);
  }
  if (tiles == 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(kernel, static_cast<unsigned>(tiles), threads, stream)(ranges, layout);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda::fused
