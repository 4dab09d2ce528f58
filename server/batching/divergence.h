// How far another form's output lies from the served one (the `compare` field of Forward and,
// later, the shadow runs of docs/architecture.md, "Metrics and routing"). Pure arithmetic in float64.
// Thread-safety: stateless functions.
#pragma once

#include <span>

namespace attnserve {

struct DivergenceStats {
  double max_abs = 0;  // max |other - served|
  double rel_l2 = 0;   // ||other - served||_2 / ||served||_2 (0 when both are zero; inf when only served is)
};

// `served` and `other` have the same size (the caller's outputs of one request). A NaN or an
// infinity in either makes both measures infinite: it never agrees with anything.
DivergenceStats MeasureDivergence(std::span<const float> served, std::span<const float> other);

}  // namespace attnserve
