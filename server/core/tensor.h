// Views of row-major float32 matrices over memory the caller owns (a request's bytes, a
// response's buffer, a weight vector). A view never allocates or frees.
// Thread-safety: a view is a pointer and a shape; whoever owns the memory decides.
#pragma once

#include <cstdint>
#include <vector>

namespace attnserve {

template <typename T>
struct MatrixViewT {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;  // distance in elements between the starts of two rows (>= cols)

  MatrixViewT() = default;
  MatrixViewT(T* d, int64_t r, int64_t c) : data(d), rows(r), cols(c), ld(c) {}
  MatrixViewT(T* d, int64_t r, int64_t c, int64_t stride) : data(d), rows(r), cols(c), ld(stride) {}
  // A mutable view converts to a read-only one.
  template <typename U>
  MatrixViewT(const MatrixViewT<U>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), rows(o.rows), cols(o.cols), ld(o.ld) {}

  bool empty() const { return data == nullptr; }
  T* row(int64_t r) const { return data + r * ld; }
  T& at(int64_t r, int64_t c) const { return data[r * ld + c]; }
  // Rows [first, first + count) of this view.
  MatrixViewT RowBlock(int64_t first, int64_t count) const { return {row(first), count, cols, ld}; }
  // Columns [first, first + count) of this view.
  MatrixViewT ColBlock(int64_t first, int64_t count) const { return {data + first, rows, count, ld}; }
};

using MatrixView = MatrixViewT<float>;
using ConstMatrixView = MatrixViewT<const float>;

inline MatrixView ViewOf(std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), rows, cols};
}
inline ConstMatrixView ViewOf(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), rows, cols};
}

}  // namespace attnserve
