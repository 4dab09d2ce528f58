// A float64 forward written straight from the definition of multi-head attention (factored,
// with concatenation), for tests only: slow, simple, and independent of FormWeights and of
// every backend.
#pragma once

#include <vector>

#include "server/core/layer.h"
#include "server/core/sequence.h"

namespace attnserve {

// Returns the [n, d_model] output, row-major; ignores seq.output.
std::vector<double> ReferenceForward(const LayerWeights& weights, const Sequence& seq);

}  // namespace attnserve
