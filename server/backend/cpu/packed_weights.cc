#include "server/backend/cpu/packed_weights.h"

#include <algorithm>

namespace attnserve {

PackedWeights PackPanels(ConstMatrixView w, int64_t width) {
  PackedWeights p;
  p.width = width;
  p.source = w;
  const int64_t panels = (w.cols + width - 1) / width;
  p.panels.assign(panels * w.rows * width, 0.0f);
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t c0 = panel * width, count = std::min(width, w.cols - c0);
    for (int64_t r = 0; r < w.rows; ++r) {
      std::copy_n(w.data + r * w.ld + c0, count, p.panels.data() + (panel * w.rows + r) * width);
    }
  }
  return p;
}

std::optional<PackedBlock> PackedWeights::Find(ConstMatrixView view) const {
  if (empty() || view.data == nullptr || view.ld != source.ld) return std::nullopt;
  // Compared as addresses: `view` may point into any other buffer.
  const auto begin = reinterpret_cast<uintptr_t>(source.data);
  const auto at = reinterpret_cast<uintptr_t>(view.data);
  if (at < begin || (at - begin) % sizeof(float) != 0) return std::nullopt;
  const int64_t offset = static_cast<int64_t>((at - begin) / sizeof(float));
  const int64_t row0 = offset / source.ld, col0 = offset % source.ld;
  if (col0 % width != 0 || row0 + view.rows > source.rows || col0 + view.cols > source.cols) return std::nullopt;
  return PackedBlock{this, row0, col0, view.rows, view.cols};
}

}  // namespace attnserve
