#include "server/core/rope.h"

#include <cmath>
#include <vector>

namespace attnserve {

void ApplyRope(MatrixView rows, int64_t heads, int64_t d_head, double theta, int64_t first_position) {
  const int64_t half = d_head / 2;
  std::vector<double> inv_freq(half);
  for (int64_t t = 0; t < half; ++t) inv_freq[t] = std::pow(theta, -2.0 * static_cast<double>(t) / d_head);
  std::vector<float> cos_p(half), sin_p(half);
  for (int64_t r = 0; r < rows.rows; ++r) {
    // Angles in float64: positions reach millions, where a float32 angle loses its low bits.
    const double position = static_cast<double>(first_position + r);
    for (int64_t t = 0; t < half; ++t) {
      cos_p[t] = static_cast<float>(std::cos(position * inv_freq[t]));
      sin_p[t] = static_cast<float>(std::sin(position * inv_freq[t]));
    }
    float* row = rows.row(r);
    for (int64_t h = 0; h < heads; ++h) {
      float* x = row + h * d_head;
      for (int64_t t = 0; t < half; ++t) {
        const float a = x[t], b = x[t + half];
        x[t] = a * cos_p[t] - b * sin_p[t];
        x[t + half] = b * cos_p[t] + a * sin_p[t];
      }
    }
  }
}

}  // namespace attnserve
