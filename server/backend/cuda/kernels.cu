#include <cfloat>
#include <cmath>

#include "server/backend/cuda/kernels.h"

// nvcc launches on the device. Compiled as C++, this file is the tests' host emulation of the
// kernels (tests/cuda_emulation), which runs the same bodies on the CPU.
#ifdef __CUDACC__
#define ATTNSERVE_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#else
#define ATTNSERVE_LAUNCH(kernel, grid, block, stream) ::cuda_emulation::Launch(kernel, (grid), (block), (stream))
#endif

namespace attnserve::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void AddRowBiasKernel(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias) {
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / cols, c = idx % cols;
    y[r * ld + c] += bias[c];
  }
}

// Block-wide reduction of one value per thread; every thread gets the result.
template <bool kMax>
__device__ float BlockReduce(float v, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : (kMax ? -FLT_MAX : 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v, offset);
      v = kMax ? fmaxf(v, other) : v + other;
    }
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

// For a row whose float32 scores are not all finite: s[j] = exp(score_j - max) with the scores
// and the max in float64; returns 1 / the sum. The dot products are computed twice (a row of
// doubles does not fit in shared memory), so the max is taken over the unscaled dots and the
// scale applied after the subtraction (scale > 0): the key at the max then gets exp(0) = 1
// exactly, whereas scale · dot - max may be contracted into one fma that rounds differently
// from the max's own copy (seen in the emulation: the top key's weight came out 0). A non-finite
// dot (Q or K themselves overflowed in the projection: no float32 answer can be right) makes the
// max +inf and so every weight NaN, which the service reports as OUT_OF_RANGE.
__device__ float ExactExponentials(float* s, int64_t head, int64_t q, int64_t visible, const ScoreOperands& o) {
  __shared__ double shared[kThreads];
  double top = -DBL_MAX;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    const double dot = ExactDot(o, head, q, j);
    top = fmax(top, fabs(dot) <= DBL_MAX ? dot : INFINITY);
  }
  top = BlockReduceDouble<true>(top, shared);
  double sum = 0;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    const double e = exp(static_cast<double>(o.scale) * (ExactDot(o, head, q, j) - top));
    s[j] = static_cast<float>(e);
    sum += e;
  }
  sum = BlockReduceDouble<false>(sum, shared);
  return static_cast<float>(1.0 / sum);
}

// One block per row of one head's scores of one entry of `blocks`. Row q of an entry is query
// first_row + q of its sequence: the causal mask counts from there, the float64 fallback reads
// Q's row q.
__global__ void MaskedSoftmaxKernel(SoftmaxBlocks blocks, int64_t heads, int64_t n, int64_t keys,
                                    ScoreOperands shared_operands) {
  __shared__ float shared[32];
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
    inv = ExactExponentials(s, row / n, q, visible, operands);
  }
  if (b.a_cat == nullptr) {
    for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) s[j] = j < visible ? s[j] * inv : 0.0f;
    return;
  }
  float* out = b.a_cat + q * keys * heads + row / n;  // A_cat[q, j·heads + head]
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) out[j * heads] = j < visible ? s[j] * inv : 0.0f;
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

unsigned GridFor(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
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
  ATTNSERVE_LAUNCH(AddRowBiasKernel, GridFor(rows * cols), kThreads, stream)(y, rows, cols, ld, bias);
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
  // Short rows get a small block: most threads of a 256-wide block would idle on 16 keys.
  const int threads = keys <= 32 ? 32 : keys <= 128 ? 128 : kThreads;
  ATTNSERVE_LAUNCH(MaskedSoftmaxKernel, static_cast<unsigned>(blocks.count * heads * rows), threads, stream)
  (blocks, heads, rows, keys, shared);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda
