// Views of row-major float32 matrices over memory the caller owns (a request's bytes, a
// response's buffer, a weight vector). A view never allocates or frees.
// Thread-safety: a view is a pointer and a shape; whoever owns the memory decides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
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

// An allocator whose blocks start on a cache line (64 bytes: also one AVX-512 register). glibc
// hands out large blocks 16 bytes past a page boundary, so every row of a weight matrix whose
// stride is a multiple of 64 bytes sat 16 bytes off a line: each 32-byte load a GEMM kernel took
// from it straddled two lines every other time. oneDNN's SGEMM for a request of 4–16 tokens,
// which streams the weights without copying them, ran 1.17–1.21× slower so (docs/journal/benchmarks-journal.md,
// "Weights on cache lines").
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

// Float storage for what the CPU kernels read as matrices: weights and forward scratch.
using AlignedFloats = std::vector<float, CacheLineAllocator<float>>;

inline MatrixView ViewOf(std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), rows, cols};
}
inline ConstMatrixView ViewOf(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), rows, cols};
}

}  // namespace attnserve
