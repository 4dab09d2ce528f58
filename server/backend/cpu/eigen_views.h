// Eigen's maps over the core's row-major views, for the CPU backend's sources (internal to
// server/backend/cpu: it brings in Eigen's headers).
// Thread-safety: views only; they share whatever the view points into.
#pragma once

#include <Eigen/Core>

#include "server/core/tensor.h"

namespace attnserve {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using EigenStride = Eigen::OuterStride<>;
using ConstEigenMap = Eigen::Map<const RowMatrix, 0, EigenStride>;
using EigenMap = Eigen::Map<RowMatrix, 0, EigenStride>;
using BiasMap = Eigen::Map<const Eigen::RowVectorXf>;

inline ConstEigenMap AsEigen(ConstMatrixView v) { return ConstEigenMap(v.data, v.rows, v.cols, EigenStride(v.ld)); }
inline EigenMap AsEigen(MatrixView v) { return EigenMap(v.data, v.rows, v.cols, EigenStride(v.ld)); }

}  // namespace attnserve
