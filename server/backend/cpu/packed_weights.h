// A form's weights packed once, at load, into column panels for the backend's own GEMM kernel
// (PanelGemm, skinny_gemm.h).
//
// A row-major weight matrix of gpt2-medium width has rows 4 KiB apart (1024 floats): a kernel
// walking down a block of its columns touches a new page every row, and the rows fall into the
// same cache sets. The GEMM libraries copy ("pack") the block they work on inside every call to
// get around that; for a request of a few tokens the copy costs as much as the product.
// Packed here once, each panel of `width` columns lies row after row in one contiguous run, which
// the kernel streams and the hardware prefetchers follow. Measured against oneDNN's SGEMM on the
// row-major weights, one thread (docs/journal/benchmarks-journal.md, "Weights packed once"): with AVX-512
// 1.1–1.6× at 4–16 tokens of gpt2-medium's weights and level at bert-base's; with AVX2 1.4–2.1×
// at 4–256 tokens of gpt2-medium's. Each call goes where it measured faster (PanelGemmPays).
// The packed copy is a second copy of the weights in host memory (ResidentForm::HostBytes);
// --cpu-weight-layout plain keeps only the row-major one.
// Panels may hold the weights as bfloat16 (--cpu-weight-layout packed-bf16): half the bytes a
// request streams, each weight rounded to the nearest bfloat16 (8 bits of mantissa) and widened
// back to float32 in the kernel's registers; the products and sums stay float32.
// Thread-safety: immutable once packed; any number of forwards read it at once.
#pragma once

#include <cstdint>
#include <optional>
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
// even: the top 16 bits of the float32 it rounds to).
enum class PanelPrecision { kFloat32, kBfloat16 };

using AlignedBf16 = std::vector<uint16_t, CacheLineAllocator<uint16_t>>;

struct PackedWeights {
  // Panel p holds the source's columns [p·width, (p + 1)·width), all its rows, each row's
  // `width` weights after the one before: [rows][width], zeros past the source's last column.
  // One of the two is filled, as `precision` says.
  AlignedFloats panels;
  AlignedBf16 panels_bf16;
  PanelPrecision precision = PanelPrecision::kFloat32;
  int64_t width = 0;
  ConstMatrixView source;  // the row-major matrix packed (its shape too): Find matches views against it

  bool empty() const { return width == 0; }
  int64_t Bytes() const {
    return static_cast<int64_t>(panels.size() * sizeof(float) + panels_bf16.size() * sizeof(uint16_t));
  }
  // Panel p's row r: `width` weights.
  int64_t PanelOffset(int64_t p, int64_t r) const { return (p * source.rows + r) * width; }
  const float* PanelRow(int64_t p, int64_t r) const { return panels.data() + PanelOffset(p, r); }
  const uint16_t* PanelRowBf16(int64_t p, int64_t r) const { return panels_bf16.data() + PanelOffset(p, r); }

  // The packed block of the source that `view` names: when it lies inside the source with the
  // source's row stride and starts on a panel's first column. Else nothing (a view of other
  // memory, such as attention's activations, or of columns that start mid-panel).
  std::optional<PackedBlock> Find(ConstMatrixView view) const;
};

// `w` packed into panels of `width` columns (> 0), each weight as `precision` says.
PackedWeights PackPanels(ConstMatrixView w, int64_t width, PanelPrecision precision = PanelPrecision::kFloat32);

// x rounded to the nearest bfloat16, ties to even: the top half of the float32 it rounds to.
// NaN stays NaN; a finite x past bfloat16's largest finite value becomes an infinity.
uint16_t RoundToBfloat16(float x);

}  // namespace attnserve
