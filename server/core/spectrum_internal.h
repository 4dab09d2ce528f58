// What spectrum.cc and calibrated_rank.cc share inside the core: a head's OV factors in
// float64, the factorisation of a product A·Bᵀ, and the low-rank form's assembly from per-head
// factors. Not for use outside server/core (it exposes Eigen types).
// Thread-safety: pure functions of their arguments.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <utility>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/status.h"

namespace attnserve::spectrum_internal {

using MatrixD = Eigen::MatrixXd;
using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Columns [col0, col0 + count) of a row-major [rows, cols] float matrix, as float64.
MatrixD ColumnsOf(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t col0, int64_t count);

// A · B^T = left · diag(s) · right^T for A, B [d, k0], via thin QRs and a small SVD.
struct Factorization {
  Eigen::VectorXd s;  // descending
  MatrixD left;       // [d, k]
  MatrixD right;      // [d, k]
};
Factorization FactorProduct(const MatrixD& a, const MatrixD& b);

// A and B of head i's OV product W_V_g · W_O_i = A B^T: A = W_V_g [d, d_h], B = W_O_i^T.
std::pair<MatrixD, MatrixD> OvFactors(const LayerWeights& w, int64_t head);

// Head i's kept factors: W̃_i = p[i] · q[i], p[i] [d, r_i], q[i] [r_i, d] (r_i may be 0).
struct HeadFactors {
  MatrixD p, q;
};

// The low-rank form with value block [p_1 | … | p_h] and output [q_1; …; q_h] (forms.h).
FormWeights AssembleLowRank(const LayerWeights& w, const std::vector<HeadFactors>& heads);

}  // namespace attnserve::spectrum_internal
