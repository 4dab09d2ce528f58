// Rotary position embedding (RoPE), as the LLaMA family's Hugging Face checkpoints use it:
// within each head, the pair (t, t + d_head/2) at position p is rotated by p · θ^(−2t/d_head).
// Thread-safety: pure functions.
#pragma once

#include <cmath>
#include <cstdint>

#include "server/core/tensor.h"

namespace attnserve {

// Rotates every head of `rows` ([count, heads·d_head] row-major, row r at position first + r)
// in place.
void ApplyRope(MatrixView rows, int64_t heads, int64_t d_head, double theta, int64_t first_position);

// The same rotation in float64 from its definition, for the float64 computations (the
// reference forward, the calibrated ranks): `at(r, col)` is the double at row r (position
// first_position + r) and column col of a [count, heads·d_head] matrix, in any layout.
template <class At>
void ApplyRopeFloat64(At at, int64_t count, int64_t heads, int64_t d_head, double theta, int64_t first_position) {
  const int64_t half = d_head / 2;
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t t = 0; t < half; ++t) {
      const double angle = static_cast<double>(first_position + r) *
                           std::pow(theta, -2.0 * static_cast<double>(t) / static_cast<double>(d_head));
      const double c = std::cos(angle), s = std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        double& a = at(r, h * d_head + t);
        double& b = at(r, h * d_head + t + half);
        const double a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = b0 * c + a0 * s;
      }
    }
  }
}

}  // namespace attnserve
