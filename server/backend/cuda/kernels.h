// CUDA kernels for what cuBLAS does not do. Each launcher returns the launch error; all run on
// the given stream. Matrices are row-major float32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnserve::cuda {

// y[r, c] += bias[c] for the [rows, cols] block of y with row stride ld.
cudaError_t AddRowBias(float* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream);

// The 16-bit formats of --gpu-math bf16 and fp16, held as their raw bits.
enum class HalfFormat { kBf16, kFp16 };

// dst[r, c] = x[r, c] rounded to `format`, to nearest, ties to even (__float2bfloat16_rn,
// __float2half_rn), for the [rows, cols] block of x with row stride x_ld, into dst with row stride
// dst_ld: a GEMM's float32 activations as its 16-bit input.
cudaError_t ConvertToHalf(const float* x, int64_t rows, int64_t cols, int64_t x_ld, uint16_t* dst, int64_t dst_ld,
                          HalfFormat format, cudaStream_t stream);

// The Q and K the scores came from: head i's queries are columns [i·d_head, (i+1)·d_head) of q
// (row stride q_ld, row r = row r of the score block), its keys the same columns of kv head
// i / group in k (row stride k_ld). scale is the one the score GEMM applied.
struct ScoreOperands {
  const float* q = nullptr;
  int64_t q_ld = 0;
  const float* k = nullptr;
  int64_t k_ld = 0;
  int64_t d_head = 0, group = 1;
  float scale = 1.0f;
};

// Over `heads` score matrices [rows, keys] stored back to back, a block of one sequence's query
// rows: row r is query first_row + r, which the causal mask needs (`operands.q` points at the
// block's first row). Each row becomes the softmax of its visible entries (j ≤ first_row + r when
// causal, all `keys` otherwise) and 0 elsewhere: in place when `a_cat` is null, else written to
// a_cat[r, j·heads + i] (the summed form's [rows, keys·heads] layout; `scores` is then scratch),
// which saves the summed form a launch and a pass over the scores a block. The scale is already
// applied by the score GEMM. A row with a non-finite score (q·k past float32's range, inputs from
// ~1e19 on) is recomputed from `operands` in float64.
cudaError_t MaskedSoftmax(float* scores, int64_t heads, int64_t rows, int64_t first_row, int64_t keys, bool causal,
                          const ScoreOperands& operands, float* a_cat, cudaStream_t stream);

// Blocks of several sequences' query rows, all of one shape ([heads, rows, keys] scores each),
// in one launch: what MaskedSoftmax does to one block, for up to kSoftmaxMaxBlocks of them. The
// table travels in the launch's arguments (2.3 KiB of the 4 KiB a launch may carry), so a batch
// of short sequences costs one softmax launch, not one a sequence.
inline constexpr int kSoftmaxMaxBlocks = 48;
struct SoftmaxBlock {
  float* scores = nullptr;   // [heads, rows, keys], back to back
  float* a_cat = nullptr;    // [rows, keys·heads], or null: the softmax in place
  const float* q = nullptr;  // the block's first query row, for the float64 fallback
  const float* k = nullptr;  // its sequence's first key row
  int64_t first_row = 0;     // the block's first row's query index (the causal mask)
  bool causal = false;
};
struct SoftmaxBlocks {
  int count = 0;
  SoftmaxBlock block[kSoftmaxMaxBlocks] = {};
};
// `shared`: q_ld, k_ld, d_head, group and scale of every block (its q and k are ignored).
cudaError_t MaskedSoftmaxBlocks(const SoftmaxBlocks& blocks, int64_t heads, int64_t rows, int64_t keys,
                                const ScoreOperands& shared, cudaStream_t stream);

// Rows of a matrix in consecutive runs, one a sequence: run s is rows [row0[s], row0[s + 1])
// (the last run ends at `end`) and its first row is at position[s]. One launch rotates a whole
// batch's Q (or K), however many sequences it has, up to kRopeMaxRuns of them; the runs travel in
// the launch's arguments (1 KiB of the 4 KiB a launch may carry), so nothing is copied first.
inline constexpr int kRopeMaxRuns = 64;
struct RopeRuns {
  int count = 0;
  int64_t row0[kRopeMaxRuns] = {};
  int64_t position[kRopeMaxRuns] = {};
  int64_t end = 0;
};

// Rotary embedding in place on rows [runs.row0[0], runs.end) of x, heads · d_head columns (row
// stride ld), each row at its run's position plus its offset in the run; pairs (t, t + d_head/2),
// angle p · theta^(−2t/d_head).
cudaError_t ApplyRope(float* x, int64_t heads, int64_t d_head, int64_t ld, double theta, const RopeRuns& runs,
                      cudaStream_t stream);

}  // namespace attnserve::cuda
