// The fused attention kernel on the tensor cores, for --gpu-math bf16 (fused_attention.h,
// FusedAttentionBf16): the float32 kernel's algorithm (fused_attention.cu) with its two
// products as mma.sync.m16n8k16 over bfloat16 operands accumulating in float32. Q, K and the
// values are rounded to bfloat16 as they are loaded, the softmax's weights after their
// exponential; the scores, the running max and sum and the partial mix stay float32.
#include <cuda_bf16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "server/backend/cuda/fused_attention.h"
#include "server/backend/cuda/fused_exact_row.h"

namespace attnserve::cuda {
namespace {

using fused::ExactRow;
using fused::KeysSeenBy;
using fused::WarpAll;

// A block: 4 warps, each 16 query rows of the tile (one mma's M). A lane holds two rows of its
// warp's (groupID and groupID + 8, the mma's fragment rows): their scores for the key tile, their
// running max and sum, and their partial answers, in registers.
constexpr int kWarps = 4, kRowsPerWarp = 16;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 64
constexpr int kTileKeys = 64;
constexpr int kDSteps = static_cast<int>(kFusedMaxDHead) / 16;   // Q·Kᵀ's K steps: 8
constexpr int kKeyTiles = kTileKeys / 8;                          // the scores' N tiles: 8
constexpr int kKeySteps = kTileKeys / 16;                         // the mix's K steps: 4
constexpr int kWidthTiles = static_cast<int>(kFusedMaxWidth) / 8;  // the answer's N tiles: 16
// A shared row's bfloat16s past its data: rows 272 bytes apart put the 8 rows one fragment load
// reads in different banks.
constexpr int kPad = 8;

__device__ inline uint16_t ToBf16(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ inline float FromBf16(uint16_t h) { return __bfloat162float(__ushort_as_bfloat16(h)); }
// A register of two bfloat16s, `lo` the element of the lower index.
__device__ inline uint32_t Pack(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// d += a · b for the warp's 16×16 A and 16×8 B fragments (the PTX ISA's layout, which the
// emulation implements too: tests/cuda_emulation/simt.cc).
__device__ inline void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDACC__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const uint32_t b[2] = {b0, b1};
  ::cuda_emulation::MmaM16N8K16(d, a, b, ::cuda_emulation::MmaType::kBf16);
#endif
}

__global__ void FusedAttentionBf16Kernel(FusedRanges ranges, FusedLayout l) {
  __shared__ uint16_t k_tile[kTileKeys][kFusedMaxDHead + kPad];
  __shared__ uint16_t v_tile[kTileKeys][kFusedMaxWidth + kPad];

  const FusedRange r = ranges.range[fused::RangeOfBlock(ranges)];  // copied out of the arguments
  const int local = static_cast<int>(blockIdx.x) - r.tile0;
  const int head = local % l.heads, row0 = local / l.heads * kTileRows;
  const int tile_rows = min(kTileRows, r.rows - row0);
  const int kv = head / l.group;
  const float* q = r.q + row0 * l.q_ld + head * l.d_head;
  const float* k = r.k + kv * l.d_head;
  const float* values = r.values + head / l.value_group * l.value_stride;
  float* out = r.out + row0 * l.out_ld + head * l.width;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane >> 2, in_group = lane & 3;
  // d_head and the width in whole fragments; the columns past them are zeros.
  const int d_steps = (l.d_head + 15) / 16, d_cols = 16 * d_steps;
  const int width_tiles = (l.width + 7) / 8, v_cols = 8 * width_tiles;

  const auto seen_by = [&](int row) { return KeysSeenBy(r, row0, row); };
  const int keys = seen_by(tile_rows - 1);
  const int my_row[2] = {warp * kRowsPerWarp + group, warp * kRowsPerWarp + group + 8};
  int visible[2];
  float top[2], sum[2];
  bool exact[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    visible[h] = my_row[h] < tile_rows ? seen_by(my_row[h]) : 0;
    top[h] = -INFINITY;
    sum[h] = 0.0f;
    exact[h] = false;
  }

  // The warp's queries as A fragments, rounded once: rows past the tile and columns past
  // d_head are zeros.
  const auto q_at = [&](int row, int col) -> uint16_t {
    return row < tile_rows && col < l.d_head ? ToBf16(q[row * l.q_ld + col]) : uint16_t{0};
  };
  uint32_t qa[kDSteps][4];
#pragma unroll
  for (int s = 0; s < kDSteps; ++s) {
    const int c = 16 * s + 2 * in_group;
    qa[s][0] = Pack(q_at(my_row[0], c), q_at(my_row[0], c + 1));
    qa[s][1] = Pack(q_at(my_row[1], c), q_at(my_row[1], c + 1));
    qa[s][2] = Pack(q_at(my_row[0], c + 8), q_at(my_row[0], c + 9));
    qa[s][3] = Pack(q_at(my_row[1], c + 8), q_at(my_row[1], c + 9));
  }
  float o[kWidthTiles][4];
#pragma unroll
  for (int c = 0; c < kWidthTiles; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;

  for (int key0 = 0; key0 < keys; key0 += kTileKeys) {
    __syncthreads();  // the last tile's reads of k_tile and v_tile are done
    const int tile_keys = min(kTileKeys, keys - key0);
    for (int e = threadIdx.x; e < kTileKeys * d_cols; e += blockDim.x) {
      const int j = e / d_cols, t = e % d_cols;
      k_tile[j][t] = j < tile_keys && t < l.d_head ? ToBf16(k[(key0 + j) * l.k_ld + t]) : uint16_t{0};
    }
    for (int e = threadIdx.x; e < kTileKeys * v_cols; e += blockDim.x) {
      const int j = e / v_cols, c = e % v_cols;
      v_tile[j][c] = j < tile_keys && c < l.width ? ToBf16(values[(key0 + j) * l.values_ld + c]) : uint16_t{0};
    }
    __syncthreads();

    // The scores: S = Q Kᵀ, an N tile of 8 keys at a time (B's column n is key 8·tile + n).
    const int key_tiles = (tile_keys + 7) / 8;
    float s[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      if (n >= key_tiles) continue;  // the same in the whole block: the mma's warp stays converged
#pragma unroll
      for (int st = 0; st < kDSteps; ++st) {
        if (st >= d_steps) break;
        const uint16_t* kr = &k_tile[8 * n + group][16 * st + 2 * in_group];
        Mma(s[n], qa[st], Pack(kr[0], kr[1]), Pack(kr[8], kr[9]));
      }
    }

    // Each of the lane's rows (h: groupID, groupID + 8): masked and scaled scores, the online
    // softmax over the row's four lanes, the weights rounded to bfloat16 in place of the scores.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_top = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float& x = s[n][2 * h + i];
          const float score = l.scale * x;
          const bool seen = key0 + 8 * n + 2 * in_group + i < visible[h];
          // A non-finite score sends the row to the float64 path at the end; it is left out here.
          if (seen && !(fabsf(score) <= FLT_MAX)) exact[h] = true;
          x = seen && fabsf(score) <= FLT_MAX ? score : -INFINITY;
          tile_top = fmaxf(tile_top, x);
        }
      }
      tile_top = fmaxf(tile_top, __shfl_xor_sync(0xffffffffu, tile_top, 1));
      tile_top = fmaxf(tile_top, __shfl_xor_sync(0xffffffffu, tile_top, 2));
      const float new_top = fmaxf(top[h], tile_top);
      const float rescale = top[h] == -INFINITY ? 0.0f : __expf(top[h] - new_top);
      top[h] = new_top;
      sum[h] *= rescale;
#pragma unroll
      for (int c = 0; c < kWidthTiles; ++c) {
        o[c][2 * h] *= rescale;
        o[c][2 * h + 1] *= rescale;
      }
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float& x = s[n][2 * h + i];
          // The sum counts the weights as the mix uses them, rounded: the row's weights sum to 1.
          x = x == -INFINITY ? 0.0f : FromBf16(ToBf16(__expf(x - new_top)));
          sum[h] += x;
        }
      }
    }

    // The mix: O += P V, K steps of 16 keys. The scores' accumulator fragments of two N tiles are
    // the A fragment of P over their 16 keys (rows groupID and + 8, columns 2·threadID_in_group
    // and + 1, then + 8), so the weights never leave the registers.
#pragma unroll
    for (int st = 0; st < kKeySteps; ++st) {
      if (16 * st >= tile_keys) break;
      const uint32_t pa[4] = {Pack(ToBf16(s[2 * st][0]), ToBf16(s[2 * st][1])),
                              Pack(ToBf16(s[2 * st][2]), ToBf16(s[2 * st][3])),
                              Pack(ToBf16(s[2 * st + 1][0]), ToBf16(s[2 * st + 1][1])),
                              Pack(ToBf16(s[2 * st + 1][2]), ToBf16(s[2 * st + 1][3]))};
      const int key = 16 * st + 2 * in_group;
#pragma unroll
      for (int c = 0; c < kWidthTiles; ++c) {
        if (c >= width_tiles) break;
        const int col = 8 * c + group;
        Mma(o[c], pa, Pack(v_tile[key][col], v_tile[key + 1][col]), Pack(v_tile[key + 8][col], v_tile[key + 9][col]));
      }
    }
  }

  // Each row's sum, and whether it needs the float64 path, over its four lanes.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
    float flag = exact[h] ? 1.0f : 0.0f;
    flag = fmaxf(flag, __shfl_xor_sync(0xffffffffu, flag, 1));
    flag = fmaxf(flag, __shfl_xor_sync(0xffffffffu, flag, 2));
    exact[h] = flag > 0.0f;
    if (my_row[h] >= tile_rows || exact[h]) continue;
    const float inv = 1.0f / sum[h];
    float* row_out = out + my_row[h] * l.out_ld;
#pragma unroll
    for (int c = 0; c < kWidthTiles; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int col = 8 * c + 2 * in_group + i;
        if (c < width_tiles && col < l.width) row_out[col] = o[c][2 * h + i] * inv;
      }
    }
  }
  // The rows with a non-finite score, one at a time by the whole warp. (h unrolled, so that
  // exact[h] stays in a register: indexed at run time the array would live in local memory.)
  if (WarpAll<true>(exact[0] || exact[1] ? 1.0f : 0.0f) > 0.0f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      for (int g = 0; g < 8; ++g) {
        const bool mine = group == g && exact[h];
        if (WarpAll<true>(mine ? 1.0f : 0.0f) == 0.0f) continue;
        const int row = warp * kRowsPerWarp + 8 * h + g;
        ExactRow(q + row * l.q_ld, k, values, out + row * l.out_ld, seen_by(row), l);
      }
    }
  }
}

}  // namespace

cudaError_t FusedAttentionBf16(FusedRanges ranges, const FusedLayout& layout, cudaStream_t stream) {
  return fused::LaunchOverTiles(FusedAttentionBf16Kernel, kTileRows, kWarps * 32, ranges, layout, stream);
}

}  // namespace attnserve::cuda
