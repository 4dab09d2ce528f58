// A form's weights packed once, at load, into column panels for the backend's own GEMM kernel
// (PanelGemm, skinny_gemm.h).
//
// A row-major weight matrix of gpt2-medium width has rows 4 KiB apart (1024 floats): a kernel
// walking down a block of its columns touches a new page every row, and the rows fall into the
// same cache sets. The GEMM libraries copy ("pack") the block they work on inside every call to
// get around that; for a request of a few tokens the copy costs as much as the product.
// Packed here once, each panel of `width` columns lies row after row in one contiguous run, which
// the kernel streams and the hardware prefetchers follow. Each call goes where it measured faster,
// the panels or the library on the row-major weights (PanelGemmPays; the figures in
// docs/journal/benchmarks-journal.md, "Weights packed once").
// The packed copy is a second copy of the weights in host memory (ResidentForm::HostBytes);
// --cpu-weight-layout plain keeps only the row-major one.
// Panels may hold the weights as bfloat16 (--cpu-weight-layout packed-bf16): half the bytes a
// request streams, each weight rounded to the nearest bfloat16 (8 bits of mantissa) and widened
// back to float32 in the kernel's registers; the products and sums stay float32. Or as IEEE
// half (packed-fp16): the same bytes with 11 bits of mantissa, 8 times closer, in a range of
// ±65504 (a weight beyond it is refused at upload: FirstBeyondHalf).
// A block is found by its place in the matrix packed (Block), never by the address of a view:
// the caller names which matrix and where (WeightBlock, server/backend/attention/device_ops.h).
// Thread-safety: immutable once packed; any number of forwards read it at once.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "server/core/tensor.h"

namespace attnserve {

struct PackedWeights;

// A block of packed weights: rows [row0, row0 + rows) and columns [col0, col0 + cols) of the
// source matrix, col0 on a panel's first column.
struct PackedBlock {
  const PackedWeights* weights = nullptr;
  int64_t row0 = 0, col0 = 0, rows = 0, cols = 0;

  // Columns [first, first + count) of this block; `first` a multiple of the panel width.
  PackedBlock ColBlock(int64_t first, int64_t count) const { return {weights, row0, col0 + first, rows, count}; }
};

// How a panel holds each weight: float32 as loaded, or rounded to bfloat16 (round to nearest
// even: the top 16 bits of the float32 it rounds to), row after row or (kBfloat16Pairs, for
// vdpbf16ps: bf16_dot_gemm.h) two rows interleaved: each column's weights of rows 2i and 2i + 1
// side by side, a zero past an odd last row; or rounded to IEEE half (kFloat16, round to nearest
// even, RoundToHalf), row after row.
enum class PanelPrecision { kFloat32, kBfloat16, kBfloat16Pairs, kFloat16 };

using Aligned16 = std::vector<uint16_t, CacheLineAllocator<uint16_t>>;

struct PackedWeights {
  // Panel p holds the source's columns [p·width, (p + 1)·width), all its rows, each row's
  // `width` weights after the one before: [rows][width], zeros past the source's last column.
  // One of the two is filled, as `precision` says: panels16 holds bfloat16 or IEEE half bits.
  AlignedFloats panels;
  Aligned16 panels16;
  PanelPrecision precision = PanelPrecision::kFloat32;
  int64_t width = 0;
  ConstMatrixView source;  // the row-major matrix packed: its shape and row stride

  bool empty() const { return width == 0; }
  int64_t Bytes() const {
    return static_cast<int64_t>(panels.size() * sizeof(float) + panels16.size() * sizeof(uint16_t));
  }
  // Panel p's row r: `width` weights (kBfloat16Pairs: row pair r / 2, 2 · width weights).
  int64_t PanelOffset(int64_t p, int64_t r) const {
    if (precision == PanelPrecision::kBfloat16Pairs) return (p * PairRows() + r / 2) * 2 * width;
    return (p * source.rows + r) * width;
  }
  int64_t PairRows() const { return (source.rows + 1) / 2; }
  const float* PanelRow(int64_t p, int64_t r) const { return panels.data() + PanelOffset(p, r); }
  const uint16_t* PanelRow16(int64_t p, int64_t r) const { return panels16.data() + PanelOffset(p, r); }

  // Whether rows [row0, row0 + rows) and columns [col0, col0 + cols) lie inside the source.
  bool Contains(int64_t row0, int64_t col0, int64_t rows, int64_t cols) const {
    return row0 >= 0 && col0 >= 0 && rows >= 0 && cols >= 0 && row0 + rows <= source.rows && col0 + cols <= source.cols;
  }
  // That block of the source, packed, when it lies inside the source (Contains) and col0 is a
  // panel's first column (and row0 even, in pairs). Else nothing: nothing packed, or columns that
  // start mid-panel (the caller multiplies those row-major).
  std::optional<PackedBlock> Block(int64_t row0, int64_t col0, int64_t rows, int64_t cols) const;
};

// `w` packed into panels of `width` columns (> 0), each weight as `precision` says.
PackedWeights PackPanels(ConstMatrixView w, int64_t width, PanelPrecision precision = PanelPrecision::kFloat32);

// x rounded to the nearest bfloat16, ties to even: the top half of the float32 it rounds to.
// NaN stays NaN; a finite x past bfloat16's largest finite value becomes an infinity.
uint16_t RoundToBfloat16(float x);

// x rounded to the nearest IEEE half (binary16), ties to even, subnormals kept: NaN stays NaN,
// a finite x of magnitude 65520 or more (past the largest half, 65504, by half a unit) becomes
// an infinity, and below 2^-25 a zero of x's sign.
uint16_t RoundToHalf(float x);
inline constexpr float kLargestHalf = 65504.0f;

// The index of the first finite value of `w` that RoundToHalf makes an infinity (magnitude
// 65520 or more, past kLargestHalf), or w.size(). An upload in halves asks this first.
size_t FirstBeyondHalf(std::span<const float> w);

}  // namespace attnserve
