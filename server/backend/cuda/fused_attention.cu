#include <cfloat>
#include <cmath>

#include "server/backend/cuda/fused_attention.h"
#include "server/backend/cuda/fused_exact_row.h"

namespace attnserve::cuda {
namespace {

using fused::ExactRow;
using fused::KeysSeenBy;
using fused::WarpAll;

// A block: 4 warps, each 4 query rows of the tile; a lane a key of the key tile while scoring,
// the columns lane + 32·c of the row while mixing.
constexpr int kWarps = 4, kRowsPerWarp = 4;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 16
constexpr int kTileKeys = 32;
constexpr int kColsPerLane = static_cast<int>(kFusedMaxWidth / 32);  // 4
constexpr int kMaxDHead = static_cast<int>(kFusedMaxDHead);

__global__ void FusedAttentionKernel(FusedRanges ranges, FusedLayout l) {
  __shared__ float q_tile[kTileRows][kMaxDHead];
  __shared__ float k_tile[kTileKeys][kMaxDHead + 1];  // + 1: lane j reads row j without bank conflicts
  __shared__ float v_tile[kTileKeys][kFusedMaxWidth];
  __shared__ float p_tile[kTileRows][kTileKeys];

  const FusedRange r = ranges.range[fused::RangeOfBlock(ranges)];  // copied out of the arguments, as kernels.cu does
  const int local = static_cast<int>(blockIdx.x) - r.tile0;
  const int head = local % l.heads, row0 = local / l.heads * kTileRows;
  const int tile_rows = min(kTileRows, r.rows - row0);
  const int kv = head / l.group;
  const float* q = r.q + row0 * l.q_ld + head * l.d_head;
  const float* k = r.k + kv * l.d_head;
  const float* values = r.values + head / l.value_group * l.value_stride;
  float* out = r.out + row0 * l.out_ld + head * l.width;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int e = threadIdx.x; e < kTileRows * l.d_head; e += blockDim.x) {
    const int row = e / l.d_head, t = e % l.d_head;
    q_tile[row][t] = row < tile_rows ? q[row * l.q_ld + t] : 0.0f;
  }
  // The keys any row of the tile sees (causal: none past its last row's), and each of the
  // warp's rows' own (0 for a row past the range's end).
  const auto seen_by = [&](int row) { return KeysSeenBy(r, row0, row); };
  const int keys = seen_by(tile_rows - 1);
  int visible[kRowsPerWarp];
  float top[kRowsPerWarp], sum[kRowsPerWarp], acc[kRowsPerWarp][kColsPerLane];
  bool exact[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = warp * kRowsPerWarp + i;
    visible[i] = row < tile_rows ? seen_by(row) : 0;
    top[i] = -INFINITY;
    sum[i] = 0.0f;
    exact[i] = false;
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) acc[i][c] = 0.0f;
  }

  for (int key0 = 0; key0 < keys; key0 += kTileKeys) {
    __syncthreads();  // the last tile's reads of k_tile, v_tile and p_tile are done (and q_tile written)
    const int tile_keys = min(kTileKeys, keys - key0);
    for (int e = threadIdx.x; e < kTileKeys * l.d_head; e += blockDim.x) {
      const int j = e / l.d_head, t = e % l.d_head;
      k_tile[j][t] = j < tile_keys ? k[(key0 + j) * l.k_ld + t] : 0.0f;
    }
    for (int e = threadIdx.x; e < tile_keys * l.width; e += blockDim.x) {
      const int j = e / l.width, c = e % l.width;
      v_tile[j][c] = values[(key0 + j) * l.values_ld + c];
    }
    __syncthreads();
    // Scores of the lane's key against the warp's rows, then each row's online softmax: the
    // new max, the old sum and partial mix rescaled by exp(old max − new max).
    float s[kRowsPerWarp] = {};
    for (int t = 0; t < l.d_head; ++t) {
      const float kt = k_tile[lane][t];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) s[i] += q_tile[warp * kRowsPerWarp + i][t] * kt;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const float score = l.scale * s[i];
      const bool seen = key0 + lane < visible[i];
      // A non-finite score sends the row to the float64 path at the end; it is left out here.
      if (seen && !(fabsf(score) <= FLT_MAX)) exact[i] = true;
      const float x = seen && fabsf(score) <= FLT_MAX ? score : -INFINITY;
      const float new_top = fmaxf(top[i], WarpAll<true>(x));
      const float p = x == -INFINITY ? 0.0f : __expf(x - new_top);
      const float rescale = top[i] == -INFINITY ? 0.0f : __expf(top[i] - new_top);
      sum[i] = sum[i] * rescale + WarpAll<false>(p);
      top[i] = new_top;
      p_tile[warp * kRowsPerWarp + i][lane] = p;
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) acc[i][c] *= rescale;
    }
    __syncthreads();  // the warp's weights, for every lane's columns (the emulation has no __syncwarp)
    for (int j = 0; j < tile_keys; ++j) {
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) {
        if (lane + 32 * c >= l.width) continue;
        const float v = v_tile[j][lane + 32 * c];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) acc[i][c] += p_tile[warp * kRowsPerWarp + i][j] * v;
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = warp * kRowsPerWarp + i;
    if (row >= tile_rows) continue;  // the same in every lane of the warp
    if (WarpAll<true>(exact[i] ? 1.0f : 0.0f) > 0.0f) {
      ExactRow(q + row * l.q_ld, k, values, out + row * l.out_ld, visible[i], l);
      continue;
    }
    const float inv = 1.0f / sum[i];
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) {
      if (lane + 32 * c < l.width) out[row * l.out_ld + lane + 32 * c] = acc[i][c] * inv;
    }
  }
}

}  // namespace

cudaError_t FusedAttention(FusedRanges ranges, const FusedLayout& layout, cudaStream_t stream) {
  return fused::LaunchOverTiles(FusedAttentionKernel, kTileRows, kWarps * 32, ranges, layout, stream);
}

}  // namespace attnserve::cuda
