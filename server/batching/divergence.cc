#include "server/batching/divergence.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

namespace attnserve {

DivergenceStats MeasureDivergence(std::span<const float> served, std::span<const float> other) {
  assert(served.size() == other.size());
  const size_t count = std::min(served.size(), other.size());
  DivergenceStats stats;
  double diff_sq = 0, served_sq = 0;
  for (size_t i = 0; i < count; ++i) {
    const double s = served[i], d = static_cast<double>(other[i]) - s;
    stats.max_abs = std::max(stats.max_abs, std::abs(d));
    diff_sq += d * d;
    served_sq += s * s;
  }
  if (served_sq > 0) {
    stats.rel_l2 = std::sqrt(diff_sq / served_sq);
  } else {
    stats.rel_l2 = diff_sq > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  }
  return stats;
}

}  // namespace attnserve
