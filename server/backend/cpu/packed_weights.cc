#include "server/backend/cpu/packed_weights.h"

#include <algorithm>
#include <bit>

namespace attnserve {

uint16_t RoundToBfloat16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  // Adding 0x7fff and the kept part's lowest bit rounds to nearest, ties to even; a carry into
  // the exponent is the correct rounding up (to the next binade, or to infinity past the top).
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
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
    p.panels_bf16.assign(size, uint16_t{0});
  }
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t c0 = panel * width, count = std::min(width, w.cols - c0);
    for (int64_t r = 0; r < w.rows; ++r) {
      const float* from = w.data + r * w.ld + c0;
      if (precision == PanelPrecision::kFloat32) {
        std::copy_n(from, count, p.panels.data() + p.PanelOffset(panel, r));
      } else if (!pairs) {
        std::transform(from, from + count, p.panels_bf16.data() + p.PanelOffset(panel, r), RoundToBfloat16);
      } else {
        uint16_t* to = p.panels_bf16.data() + p.PanelOffset(panel, r) + r % 2;  // column c at 2c + r % 2
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
