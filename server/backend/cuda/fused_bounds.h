// The fused attention kernel's bounds (fused_attention.cu), in a header of their own: the kernel
// (compiled by nvcc as C++17) and the workspace plan (C++20, no CUDA) both read them.
#pragma once

#include <cstdint>

namespace attnserve::cuda {

// A head's d_head, and the width of the values it mixes, at most: a block holds a tile of
// queries and keys of d_head columns and of values of the width in shared memory, and each
// lane kFusedMaxWidth / 32 columns of four rows' partial mixes in registers.
inline constexpr int64_t kFusedMaxDHead = 128, kFusedMaxWidth = 128;

}  // namespace attnserve::cuda
