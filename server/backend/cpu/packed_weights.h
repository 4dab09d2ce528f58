// A form's weights packed once, at load, into column panels for the backend's own GEMM kernel
// (PanelGemm, skinny_gemm.h).
//
// A row-major weight matrix of gpt2-medium width has rows 4 KiB apart (1024 floats): a kernel
// walking down a block of its columns touches a new page every row, and the rows fall into the
// same cache sets. The GEMM libraries copy ("pack") the block they work on inside every call to
// get around that; for a request of a few tokens the copy costs as much as the product.
// Packed here once, each panel of `width` columns lies row after row in one contiguous run, which
// the kernel streams and the hardware prefetchers follow. Measured against oneDNN's SGEMM on the
// row-major weights, one thread (docs/benchmarks.md, "Weights packed once"): with AVX-512
// 1.1–1.6× at 4–16 tokens of gpt2-medium's weights and level at bert-base's; with AVX2 1.4–2.1×
// at 4–256 tokens of gpt2-medium's. Each call goes where it measured faster (PanelGemmPays).
// The packed copy is a second copy of the weights in host memory (ResidentForm::HostBytes);
// --cpu-weight-layout plain keeps only the row-major one.
// Thread-safety: immutable once packed; any number of forwards read it at once.
#pragma once

#include <cstdint>
#include <optional>

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

struct PackedWeights {
  // Panel p holds the source's columns [p·width, (p + 1)·width), all its rows, each row's
  // `width` floats after the one before: [rows][width], zeros past the source's last column.
  AlignedFloats panels;
  int64_t width = 0;
  ConstMatrixView source;  // the row-major matrix packed (its shape too): Find matches views against it

  bool empty() const { return width == 0; }
  int64_t Bytes() const { return static_cast<int64_t>(panels.size() * sizeof(float)); }
  // Panel p's row r: `width` floats.
  const float* PanelRow(int64_t p, int64_t r) const { return panels.data() + (p * source.rows + r) * width; }

  // The packed block of the source that `view` names: when it lies inside the source with the
  // source's row stride and starts on a panel's first column. Else nothing (a view of other
  // memory, such as attention's activations, or of columns that start mid-panel).
  std::optional<PackedBlock> Find(ConstMatrixView view) const;
};

// `w` packed into panels of `width` columns (> 0).
PackedWeights PackPanels(ConstMatrixView w, int64_t width);

}  // namespace attnserve
