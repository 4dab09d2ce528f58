#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "server/backend/cuda/kernels.h"
#include "server/backend/cuda/launch.h"

namespace attnserve::cuda {
namespace {

constexpr int kThreads = 256;
// The warp softmax's rows: up to 32 · kWarpRowMaxPerLane keys (registers per lane), 8 a block.
constexpr int kWarpRowMaxPerLane = 32;
constexpr int64_t kWarpRowMaxKeys = 32 * kWarpRowMaxPerLane;
constexpr int kWarpRowsPerBlock = kThreads / 32;
// The most blocks a grid-stride launch takes (the bias kernel's rows, RoPE's entries): past it
// each block loops.
constexpr int64_t kMaxGridBlocks = 65535 * 16;

// A block a row (rows past the grid's bound loop), its threads along the row: no division per
// element. The flat index over rows · cols that it replaced divided by cols twice per element in
// 64-bit integers, which the GPU does in software: 162 µs for 16384 × 2048 floats on an H200.
__global__ void AddRowBiasKernel(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = y + r * ld;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row[c] += bias[c];
  }
}

// A block a row, as AddRowBiasKernel: each float rounded once to the 16-bit format.
__global__ void ConvertToHalfKernel(const float* x, int64_t rows, int64_t cols, int64_t x_ld, uint16_t* dst,
                                    int64_t dst_ld, bool bf16) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* in = x + r * x_ld;
    uint16_t* out = dst + r * dst_ld;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      out[c] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(in[c])) : __half_as_ushort(__float2half_rn(in[c]));
    }
  }
}

// Warp-wide reduction of one value per lane (float or double); every lane gets the result.
template <bool kMax, class T>
__device__ T WarpReduce(T v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? static_cast<T>(fmax(v, other)) : v + other;
  }
  return v;
}

// Block-wide reduction of one value per thread; every thread gets the result.
template <bool kMax>
__device__ float BlockReduce(float v, float* shared) {
  v = WarpReduce<kMax>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : (kMax ? -FLT_MAX : 0.0f);
    v = WarpReduce<kMax>(v);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();  // shared[] is reused by the next reduction
  return v;
}

// Block-wide reduction of doubles through shared memory (blockDim.x of them, a power of two);
// every thread gets the result. Only the float64 fallback below uses it, so it is the plain
// tree rather than shuffles.
template <bool kMax>
__device__ double BlockReduceDouble(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const double other = shared[threadIdx.x + stride];
      shared[threadIdx.x] = kMax ? fmax(shared[threadIdx.x], other) : shared[threadIdx.x] + other;
    }
    __syncthreads();
  }
  v = shared[0];
  __syncthreads();  // shared[] is reused by the next reduction
  return v;
}

// q·k of query row q of `head` and key j in float64, unscaled: the products of float32 values
// are exact there (so fused or not, every evaluation rounds the same), and |q·k| < d_h · FLT_MAX²
// cannot overflow.
__device__ double ExactDot(const ScoreOperands& o, int64_t head, int64_t q, int64_t j) {
  const float* qr = o.q + q * o.q_ld + head * o.d_head;
  const float* kr = o.k + j * o.k_ld + (head / o.group) * o.d_head;
  double dot = 0;
  for (int64_t t = 0; t < o.d_head; ++t) dot += static_cast<double>(qr[t]) * static_cast<double>(kr[t]);
  return dot;
}

// The threads that share a row: a whole block (BlockTeam; rows of more than kWarpRowMaxKeys
// keys) or one warp (WarpTeam). Rank and Size stride the row; Reduce hands every one of them
// the team's max or sum of a double.
struct BlockTeam {
  double* shared;  // blockDim.x doubles
  __device__ int64_t Rank() const { return threadIdx.x; }
  __device__ int64_t Size() const { return blockDim.x; }
  template <bool kMax>
  __device__ double Reduce(double v) const {
    return BlockReduceDouble<kMax>(v, shared);
  }
};
struct WarpTeam {
  __device__ int64_t Rank() const { return threadIdx.x % 32; }
  __device__ int64_t Size() const { return 32; }
  template <bool kMax>
  __device__ double Reduce(double v) const {
    return WarpReduce<kMax>(v);
  }
};

// For a row whose float32 scores are not all finite: s[j] = exp(score_j - max) with the scores
// and the max in float64; returns 1 / the sum. The dot products are computed twice (a row of
// doubles does not fit in shared memory), so the max is taken over the unscaled dots and the
// scale applied after the subtraction (scale > 0): the key at the max then gets exp(0) = 1
// exactly, whereas scale · dot - max may be contracted into one fma that rounds differently
// from the max's own copy (seen in the emulation: the top key's weight came out 0). A non-finite
// dot (Q or K themselves overflowed in the projection: no float32 answer can be right) makes the
// max +inf and so every weight NaN, which the service reports as OUT_OF_RANGE. Each of the
// team's threads writes the entries j ≡ its rank (mod its size).
template <class Team>
__device__ float ExactExponentials(const Team& team, float* s, int64_t head, int64_t q, int64_t visible,
                                   const ScoreOperands& o) {
  double top = -DBL_MAX;
  for (int64_t j = team.Rank(); j < visible; j += team.Size()) {
    const double dot = ExactDot(o, head, q, j);
    top = fmax(top, fabs(dot) <= DBL_MAX ? dot : INFINITY);
  }
  top = team.template Reduce<true>(top);
  double sum = 0;
  for (int64_t j = team.Rank(); j < visible; j += team.Size()) {
    const double e = exp(static_cast<double>(o.scale) * (ExactDot(o, head, q, j) - top));
    s[j] = static_cast<float>(e);
    sum += e;
  }
  sum = team.template Reduce<false>(sum);
  return static_cast<float>(1.0 / sum);
}

// One block per row of one head's scores of one entry of `blocks`, for rows of more than
// kWarpRowMaxKeys keys (MaskedSoftmaxWarpKernel takes the shorter ones). Row q of an entry is
// query first_row + q of its sequence: the causal mask counts from there, the float64 fallback
// reads Q's row q.
__global__ void MaskedSoftmaxKernel(SoftmaxBlocks blocks, int64_t heads, int64_t n, int64_t keys,
                                    ScoreOperands shared_operands) {
  __shared__ float shared[32];
  __shared__ double shared64[kThreads];
  // The block's entry copied out of the launch's arguments (48 bytes into registers): a
  // reference into them could make the compiler copy the whole 2.3 KiB table to local memory.
  const SoftmaxBlock b = blocks.block[blockIdx.x / (heads * n)];
  const int64_t row = blockIdx.x % (heads * n);  // over heads * n
  const int64_t q = row % n;
  float* s = b.scores + row * keys;
  const int64_t visible = b.causal ? min(b.first_row + q + 1, keys) : keys;
  // A non-finite score counts as +inf, so the max also tells whether q·k overflowed float32
  // (inputs from ~1e19 on): inf - inf in the max subtraction would make the row NaN.
  float top = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    top = fmaxf(top, fabsf(s[j]) <= FLT_MAX ? s[j] : INFINITY);
  }
  top = BlockReduce<true>(top, shared);
  float inv;
  if (top <= FLT_MAX) {  // the same in every thread of the block: the barriers below are uniform
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
      const float e = __expf(s[j] - top);
      s[j] = e;
      sum += e;
    }
    sum = BlockReduce<false>(sum, shared);
    inv = 1.0f / sum;
  } else {
    ScoreOperands operands = shared_operands;
    operands.q = b.q;
    operands.k = b.k;
    inv = ExactExponentials(BlockTeam{shared64}, s, row / n, q, visible, operands);
  }
  if (b.a_cat == nullptr) {
    for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) s[j] = j < visible ? s[j] * inv : 0.0f;
    return;
  }
  float* out = b.a_cat + q * keys * heads + row / n;  // A_cat[q, j·heads + head]
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) out[j * heads] = j < visible ? s[j] * inv : 0.0f;
}

// What MaskedSoftmaxKernel does, for rows of up to 32 · kPerLane keys: a warp a row,
// kWarpRowsPerBlock rows a block. The row stays in registers from its one read to its one
// write, and the reductions are shuffles with no barrier. The block kernel reads a row three
// times and waits at six barriers: on an H200 it took 578 µs to read and write 256 MiB of
// 512-key rows, ~0.9 TB/s of the device's 4.8; this kernel, 283 µs (docs/journal/benchmarks-journal.md, "The
// second run on a GPU").
template <int kPerLane>
__global__ void MaskedSoftmaxWarpKernel(SoftmaxBlocks blocks, int64_t heads, int64_t n, int64_t keys,
                                        ScoreOperands shared_operands) {
  const int64_t all = blocks.count * heads * n;
  const int64_t global = blockIdx.x * int64_t{kWarpRowsPerBlock} + threadIdx.x / 32;
  if (global >= all) return;  // the warp's lanes leave together: its shuffles stay whole
  const int64_t lane = threadIdx.x % 32;
  const SoftmaxBlock b = blocks.block[global / (heads * n)];  // copied, as in the block kernel
  const int64_t row = global % (heads * n), q = row % n;
  float* s = b.scores + row * keys;
  const int64_t visible = b.causal ? min(b.first_row + q + 1, keys) : keys;
  float v[kPerLane];  // entry lane + 32·i of the row
  float top = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    v[i] = j < visible ? s[j] : 0.0f;
    if (j < visible) top = fmaxf(top, fabsf(v[i]) <= FLT_MAX ? v[i] : INFINITY);
  }
  top = WarpReduce<true>(top);
  float inv;
  if (top <= FLT_MAX) {  // the same in every lane: the shuffles below are uniform
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      v[i] = lane + 32 * i < visible ? __expf(v[i] - top) : 0.0f;
      sum += v[i];
    }
    inv = 1.0f / WarpReduce<false>(sum);
  } else {
    ScoreOperands operands = shared_operands;
    operands.q = b.q;
    operands.k = b.k;
    inv = ExactExponentials(WarpTeam{}, s, row / n, q, visible, operands);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] = lane + 32 * i < visible ? s[lane + 32 * i] : 0.0f;  // its own writes
  }
  float* out = b.a_cat == nullptr ? s : b.a_cat + q * keys * heads + row / n;  // A_cat[q, j·heads + head]
  const int64_t stride = b.a_cat == nullptr ? 1 : heads;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    if (j < keys) out[j * stride] = j < visible ? v[i] * inv : 0.0f;
  }
}

__global__ void RopeKernel(float* x, int64_t heads, int64_t d_head, int64_t ld, double theta, RopeRuns runs) {
  const int64_t half = d_head / 2, first = runs.row0[0], total = (runs.end - first) * heads * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = first + idx / (heads * half), rest = idx % (heads * half);
    const int64_t h = rest / half, t = rest % half;
    // The row's run: the last one starting at or before it (a binary search over ≤ 64 runs).
    int lo = 0, hi = runs.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (runs.row0[mid] <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    // The angle in float64: positions reach millions, where float32 loses the low bits.
    const double angle = static_cast<double>(runs.position[lo] + (r - runs.row0[lo])) * pow(theta, -2.0 * t / d_head);
    double s, c;
    sincos(angle, &s, &c);
    float* p = x + r * ld + h * d_head;
    const float a = p[t], b = p[t + half];
    p[t] = a * static_cast<float>(c) - b * static_cast<float>(s);
    p[t + half] = b * static_cast<float>(c) + a * static_cast<float>(s);
  }
}

template <int kPerLane>
cudaError_t LaunchWarpRows(const SoftmaxBlocks& blocks, int64_t heads, int64_t rows, int64_t keys,
                           const ScoreOperands& shared, cudaStream_t stream) {
  const int64_t all = blocks.count * heads * rows;
  ATTNSERVE_LAUNCH(MaskedSoftmaxWarpKernel<kPerLane>,
                   static_cast<unsigned>((all + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock), kThreads, stream)
  (blocks, heads, rows, keys, shared);
  return cudaGetLastError();
}

unsigned GridFor(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? (blocks > 0 ? blocks : 1) : kMaxGridBlocks);
}

}  // namespace

cudaError_t ApplyRope(float* x, int64_t heads, int64_t d_head, int64_t ld, double theta, const RopeRuns& runs,
                      cudaStream_t stream) {
  if (runs.count <= 0 || runs.end <= runs.row0[0]) return cudaSuccess;
  ATTNSERVE_LAUNCH(RopeKernel, GridFor((runs.end - runs.row0[0]) * heads * (d_head / 2)), kThreads, stream)
  (x, heads, d_head, ld, theta, runs);
  return cudaGetLastError();
}

cudaError_t AddRowBias(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxGridBlocks));
  ATTNSERVE_LAUNCH(AddRowBiasKernel, grid, kThreads, stream)(y, rows, cols, ld, bias);
  return cudaGetLastError();
}

cudaError_t ConvertToHalf(const float* x, int64_t rows, int64_t cols, int64_t x_ld, uint16_t* dst, int64_t dst_ld,
                          HalfFormat format, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxGridBlocks));
  ATTNSERVE_LAUNCH(ConvertToHalfKernel, grid, kThreads, stream)(x, rows, cols, x_ld, dst, dst_ld,
                                                                format == HalfFormat::kBf16);
  return cudaGetLastError();
}

cudaError_t MaskedSoftmax(float* scores, int64_t heads, int64_t rows, int64_t first_row, int64_t keys, bool causal,
                          const ScoreOperands& operands, float* a_cat, cudaStream_t stream) {
  SoftmaxBlocks one;
  one.count = 1;
  one.block[0] = {
      .scores = scores, .a_cat = a_cat, .q = operands.q, .k = operands.k, .first_row = first_row, .causal = causal};
  return MaskedSoftmaxBlocks(one, heads, rows, keys, operands, stream);
}

cudaError_t MaskedSoftmaxBlocks(const SoftmaxBlocks& blocks, int64_t heads, int64_t rows, int64_t keys,
                                const ScoreOperands& shared, cudaStream_t stream) {
  if (blocks.count <= 0 || blocks.count > kSoftmaxMaxBlocks) return cudaErrorInvalidValue;
  if (keys > kWarpRowMaxKeys) {
    ATTNSERVE_LAUNCH(MaskedSoftmaxKernel, static_cast<unsigned>(blocks.count * heads * rows), kThreads, stream)
    (blocks, heads, rows, keys, shared);
    return cudaGetLastError();
  }
  // The fewest registers a lane that hold the row: a power of two from 1 to 32.
  if (keys <= 32) return LaunchWarpRows<1>(blocks, heads, rows, keys, shared, stream);
  if (keys <= 64) return LaunchWarpRows<2>(blocks, heads, rows, keys, shared, stream);
  if (keys <= 128) return LaunchWarpRows<4>(blocks, heads, rows, keys, shared, stream);
  if (keys <= 256) return LaunchWarpRows<8>(blocks, heads, rows, keys, shared, stream);
  if (keys <= 512) return LaunchWarpRows<16>(blocks, heads, rows, keys, shared, stream);
  return LaunchWarpRows<kWarpRowMaxPerLane>(blocks, heads, rows, keys, shared, stream);
}

}  // namespace attnserve::cuda
