// A float64 forward written straight from the definition of multi-head attention (factored,
// with concatenation), for tests only: slow, simple, and independent of FormWeights and of
// every backend. A second entry takes each head's value-output matrix in place of
// W_V_g(i) W_O_i, so a test can hand it a matrix it derived itself (a truncated SVD for the
// low-rank form).
#pragma once

#include <vector>

#include "server/core/layer.h"
#include "server/core/sequence.h"

namespace attnserve {

// Returns the [n, d_model] output, row-major; ignores seq.output.
std::vector<double> ReferenceForward(const LayerWeights& weights, const Sequence& seq);

// Y = Σ_i A_i C M_i + b for M_i = head_matrices[i] ([d_model, d_model], row-major) and
// b = output_bias (empty: none); A_i from the layer's Q and K as in ReferenceForward. The
// layer's W_V, b_V, W_O and b_O are not read. Returns the [n, d_model] output, row-major.
std::vector<double> ReferenceForwardWithHeadMatrices(const LayerWeights& weights,
                                                     const std::vector<std::vector<double>>& head_matrices,
                                                     const std::vector<double>& output_bias, const Sequence& seq);

}  // namespace attnserve
