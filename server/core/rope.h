// Rotary position embedding (RoPE), as the LLaMA family's Hugging Face checkpoints use it:
// within each head, the pair (t, t + d_head/2) at position p is rotated by p · θ^(−2t/d_head).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "server/core/tensor.h"

namespace attnserve {

// Rotates every head of `rows` ([count, heads·d_head] row-major, row r at position first + r)
// in place.
void ApplyRope(MatrixView rows, int64_t heads, int64_t d_head, double theta, int64_t first_position);

}  // namespace attnserve
