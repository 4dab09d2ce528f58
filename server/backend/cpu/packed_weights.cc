#include "server/backend/cpu/packed_weights.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace attnserve {

uint16_t RoundToBfloat16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  // Adding 0x7fff and the kept part's lowest bit rounds to nearest, ties to even; a carry into
  // the exponent is the correct rounding up (to the next binade, or to infinity past the top).
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t RoundToHalf(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // a quiet NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and past (ties to even: up)
  if (magnitude < 0x38800000u) {                        // below 2^-14: a subnormal half
    // x · 2^24 counts units of the smallest subnormal; rounded to the nearest integer (even at
    // a tie, the default rounding mode), 1024 is the smallest normal's bits, as it should be.
    const float units = std::nearbyint(std::bit_cast<float>(magnitude) * 0x1p24f);
    return sign | static_cast<uint16_t>(units);
  }
  // Rebias the exponent (127 → 15) and keep 10 of the 23 mantissa bits; the 13 dropped round to
  // nearest, ties to even, a carry running into the exponent as it should.
  uint32_t half = (magnitude - 0x38000000u) >> 13;
  const uint32_t dropped = magnitude & 0x1fffu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (half & 1u) != 0)) ++half;
  return sign | static_cast<uint16_t>(half);
}

size_t FirstBeyondHalf(std::span<const float> w) {
  for (size_t i = 0; i < w.size(); ++i) {
    if (std::isfinite(w[i]) && (RoundToHalf(w[i]) & 0x7fffu) == 0x7c00u) return i;
  }
  return w.size();
}

PackedWeights PackPanels(ConstMatrixView w, int64_t width, PanelPrecision precision) {
  PackedWeights p;
  p.width = width;
  p.source = w;
  p.precision = precision;
  const int64_t panels = (w.cols + width - 1) / width;
  const bool pairs = precision == PanelPrecision::kBfloat16Pairs;
  const size_t size = static_cast<size_t>(panels * (pairs ? 2 * p.PairRows() : w.rows) * width);
  if (precision == PanelPrecision::kFloat32) {
    p.panels.assign(size, 0.0f);
  } else {
    p.panels16.assign(size, uint16_t{0});
  }
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t c0 = panel * width, count = std::min(width, w.cols - c0);
    for (int64_t r = 0; r < w.rows; ++r) {
      const float* from = w.data + r * w.ld + c0;
      if (precision == PanelPrecision::kFloat32) {
        std::copy_n(from, count, p.panels.data() + p.PanelOffset(panel, r));
      } else if (precision == PanelPrecision::kFloat16) {
        std::transform(from, from + count, p.panels16.data() + p.PanelOffset(panel, r), RoundToHalf);
      } else if (!pairs) {
        std::transform(from, from + count, p.panels16.data() + p.PanelOffset(panel, r), RoundToBfloat16);
      } else {
        uint16_t* to = p.panels16.data() + p.PanelOffset(panel, r) + r % 2;  // column c at 2c + r % 2
        for (int64_t c = 0; c < count; ++c) to[2 * c] = RoundToBfloat16(from[c]);
      }
    }
  }
  return p;
}

std::optional<PackedBlock> PackedWeights::Block(int64_t row0, int64_t col0, int64_t rows, int64_t cols) const {
  if (empty() || !Contains(row0, col0, rows, cols) || col0 % width != 0) return std::nullopt;
  if (precision == PanelPrecision::kBfloat16Pairs && row0 % 2 != 0) return std::nullopt;
  return PackedBlock{this, row0, col0, rows, cols};
}

}  // namespace attnserve
