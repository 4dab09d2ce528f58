// The fused attention kernels (fused_attention.cu, fused_attention_bf16.cu): per (range, head,
// tile of query rows), the scores of a tile of keys at a time in shared memory and registers,
// the masked online softmax (a running max and sum per row, the partial mix rescaled when the
// max grows) and the mix with the values, in one launch; the scores are never written to device
// memory. FusedAttention runs in FP32 on the SIMT cores, FusedAttentionBf16 on the tensor cores
// over bfloat16 operands. docs/architecture.md, "The CUDA backend", says when a lane runs which.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "server/backend/cuda/fused_bounds.h"

namespace attnserve::cuda {

// One sequence's query rows for every head: row r of q (row stride FusedLayout::q_ld) is query
// first_row + r of the sequence (the causal mask counts from there), keys [0, keys) of k and
// values are visible (its key_length; causal rows see j ≤ first_row + r too), out's row r gets
// the answer.
struct FusedRange {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* values = nullptr;
  float* out = nullptr;
  int64_t first_row = 0;
  int32_t rows = 0, keys = 0;
  int32_t tile0 = 0;  // its first block in the launch (set by FusedAttention)
  bool causal = false;
};

// What every range of a launch shares: head i reads q's columns [i·d_head, +d_head), k's
// [(i / group)·d_head, +d_head) and the values' [(i / value_group)·value_stride, +width), and
// writes out's [i·width, +width) (workspace_plan.h's FusedShape).
struct FusedLayout {
  int64_t q_ld = 0, k_ld = 0, values_ld = 0, out_ld = 0;
  int32_t heads = 0, group = 1, d_head = 0, width = 0, value_stride = 0, value_group = 1;
  float scale = 1.0f;
};

// Up to kFusedMaxRanges ranges a launch; the table travels in the launch's arguments (2.7 KiB of
// the 4 KiB a launch may carry), so a batch of short sequences costs one launch.
inline constexpr int kFusedMaxRanges = 48;
struct FusedRanges {
  int count = 0;
  FusedRange range[kFusedMaxRanges] = {};
};

// out = softmax(scale · q kᵀ + mask) · values for every range and head of `ranges` (count ≥ 1;
// d_head ≤ kFusedMaxDHead, width ≤ kFusedMaxWidth). A row with a non-finite score (q·k past
// float32's range, inputs from ~1e19 on) is computed again in float64, as MaskedSoftmax does.
cudaError_t FusedAttention(FusedRanges ranges, const FusedLayout& layout, cudaStream_t stream);

// The same on the tensor cores (mma.sync.m16n8k16, sm_80 on), a tile of 64 query rows a block:
// Q, K and the values rounded to bfloat16 as they are read, the weights exp(score − max) rounded
// to bfloat16 before the mix (the row's sum counts them rounded), every product accumulated in
// float32, and the answer written in float32. A row with a non-finite score takes the same
// float64 path, from the float32 inputs. The lane runs it under --gpu-math bf16.
cudaError_t FusedAttentionBf16(FusedRanges ranges, const FusedLayout& layout, cudaStream_t stream);

}  // namespace attnserve::cuda
