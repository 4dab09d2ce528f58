// CUDA kernels for what cuBLAS does not do. Each launcher returns the launch error; all run on
// the given stream. Matrices are row-major float32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnserve::cuda {

// y[r, c] += bias[c] for the [rows, cols] block of y with row stride ld.
cudaError_t AddRowBias(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream);

// In place over `heads` score matrices [n, keys] stored back to back: each row becomes the
// softmax of its visible entries (j < q + 1 when causal, all `keys` otherwise) and 0 elsewhere.
// The scale is already applied by the score GEMM.
cudaError_t MaskedSoftmax(float* scores, int64_t heads, int64_t n, int64_t keys, bool causal, cudaStream_t stream);

// a_cat[q, j·heads + i] = scores[i, q, j]: the summed form's [n, keys·heads] score layout.
cudaError_t InterleaveHeads(const float* scores, int64_t heads, int64_t n, int64_t keys, float* a_cat,
                            cudaStream_t stream);

// Rotary embedding in place on the [rows, heads·d_head] block of x (row stride ld), row r at
// position first_position + r; pairs (t, t + d_head/2), angle p · theta^(−2t/d_head).
cudaError_t ApplyRope(float* x, int64_t rows, int64_t heads, int64_t d_head, int64_t ld, double theta,
                      int64_t first_position, cudaStream_t stream);

}  // namespace attnserve::cuda
