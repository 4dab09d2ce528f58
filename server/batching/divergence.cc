#include "server/batching/divergence.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

namespace attnserve {

DivergenceStats MeasureDivergence(std::span<const float> served, std::span<const float> other) {
  assert(served.size() == other.size());
  const size_t count = std::min(served.size(), other.size());
  constexpr double kInf = std::numeric_limits<double>::infinity();
  DivergenceStats stats;
  double diff_sq = 0, served_sq = 0;
  for (size_t i = 0; i < count; ++i) {
    // A NaN or an infinity on either side is no agreement, even with itself: inf - inf and
    // NaN - NaN are NaN, which a max skips and a sum hides.
    if (!std::isfinite(served[i]) || !std::isfinite(other[i])) return {.max_abs = kInf, .rel_l2 = kInf};
    const double s = served[i], d = static_cast<double>(other[i]) - s;
    stats.max_abs = std::max(stats.max_abs, std::abs(d));
    diff_sq += d * d;
    served_sq += s * s;
  }
  if (served_sq > 0) {
    stats.rel_l2 = std::sqrt(diff_sq / served_sq);
  } else {
    stats.rel_l2 = diff_sq > 0 ? kInf : 0.0;
  }
  return stats;
}

}  // namespace attnserve
