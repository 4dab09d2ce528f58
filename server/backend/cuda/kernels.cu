#include <cfloat>

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

// One block per row of one head's scores.
__global__ void MaskedSoftmaxKernel(float* scores, int64_t n, int64_t keys, bool causal) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;  // over heads * n
  const int64_t q = row % n;
  float* s = scores + row * keys;
  const int64_t visible = causal ? min(q + 1, keys) : keys;
  float top = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) top = fmaxf(top, s[j]);
  top = BlockReduce<true>(top, shared);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    const float e = __expf(s[j] - top);
    s[j] = e;
    sum += e;
  }
  sum = BlockReduce<false>(sum, shared);
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) s[j] = j < visible ? s[j] * inv : 0.0f;
}

__global__ void InterleaveHeadsKernel(const float* scores, int64_t heads, int64_t n, int64_t keys, float* a_cat) {
  const int64_t total = heads * n * keys;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t q = idx / (keys * heads), rest = idx % (keys * heads);
    const int64_t j = rest / heads, i = rest % heads;
    a_cat[idx] = scores[(i * n + q) * keys + j];
  }
}

__global__ void RopeKernel(float* x, int64_t rows, int64_t heads, int64_t d_head, int64_t ld, double theta,
                           int64_t first_position) {
  const int64_t half = d_head / 2, total = rows * heads * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / (heads * half), rest = idx % (heads * half);
    const int64_t h = rest / half, t = rest % half;
    // The angle in float64: positions reach millions, where float32 loses the low bits.
    const double angle = static_cast<double>(first_position + r) * pow(theta, -2.0 * t / d_head);
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

cudaError_t ApplyRope(float* x, int64_t rows, int64_t heads, int64_t d_head, int64_t ld, double theta,
                      int64_t first_position, cudaStream_t stream) {
  ATTNSERVE_LAUNCH(RopeKernel, GridFor(rows * heads * (d_head / 2)), kThreads, stream)
  (x, rows, heads, d_head, ld, theta, first_position);
  return cudaGetLastError();
}

cudaError_t AddRowBias(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream) {
  ATTNSERVE_LAUNCH(AddRowBiasKernel, GridFor(rows * cols), kThreads, stream)(y, rows, cols, ld, bias);
  return cudaGetLastError();
}

cudaError_t MaskedSoftmax(float* scores, int64_t heads, int64_t n, int64_t keys, bool causal, cudaStream_t stream) {
  // Short rows get a small block: most threads of a 256-wide block would idle on 16 keys.
  const int threads = keys <= 32 ? 32 : keys <= 128 ? 128 : kThreads;
  ATTNSERVE_LAUNCH(MaskedSoftmaxKernel, static_cast<unsigned>(heads * n), threads, stream)(scores, n, keys, causal);
  return cudaGetLastError();
}

cudaError_t InterleaveHeads(const float* scores, int64_t heads, int64_t n, int64_t keys, float* a_cat,
                            cudaStream_t stream) {
  ATTNSERVE_LAUNCH(InterleaveHeadsKernel, GridFor(heads * n * keys), kThreads, stream)(scores, heads, n, keys, a_cat);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda
