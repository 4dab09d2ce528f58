// What the checkpoint layouts share to check and read their tensors: lookups that name the
// file and the tensor in every error, the transposes and slices from a checkpoint's storage
// to our y = x W + b, and the two shapes of attention most layouts are: one packed Q|K|V
// projection (torch-mha, gpt2) or four separate nn.Linear projections (bert, llama).
// Thread-safety: free functions over values; call from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/layer.h"
#include "server/core/status.h"
#include "server/store/arch/arch.h"
#include "server/store/safetensors.h"

namespace attnserve {

// "safetensors file 'PATH': ", which begins every message about the file as a whole.
std::string FileAt(const SafetensorsFile& file);

Status ExpectShape(const SafetensorsFile& file, const TensorInfo& t, const std::vector<int64_t>& expected,
                   const std::string& why);

// The tensor as float32, every value finite (the error names the flat index).
StatusOr<std::vector<float>> ReadValues(const SafetensorsFile& file, const std::string& name);

// Rows [row0, row0 + rows) of `src` ([*, cols], row-major), transposed: [cols, rows].
// nn.Linear stores y = x Wᵀ; our convention is y = x W.
std::vector<float> TransposedRows(const std::vector<float>& src, int64_t cols, int64_t row0, int64_t rows);
// Columns [col0, col0 + count) of `src` ([rows, cols], row-major): [rows, count].
std::vector<float> Columns(const std::vector<float>& src, int64_t rows, int64_t cols, int64_t col0, int64_t count);

// A layer's biases, each with the size its weight implies: all present or all absent, and
// those present of their size. Sets widths->bias to whether they are present.
Status CheckBiases(const SafetensorsFile& file, const std::vector<std::pair<std::string, int64_t>>& sized,
                   LayerWidths* widths);

// ---- One packed Q|K|V projection (torch-mha, gpt2) ----

struct PackedNames {
  std::string w_in, b_in;  // Q|K|V packed along the output width
  std::string w_out, b_out;
};

struct PackedWeights {
  const TensorInfo* in;
  const TensorInfo* out;
};

// Both weights present, floating and non-empty matrices.
StatusOr<PackedWeights> RequirePacked(const SafetensorsFile& file, const PackedNames& n);
// The widths once the layout has read d_model, the packed width and the query width from its
// weights: the packed width must be q + 2·kv; the biases are checked.
StatusOr<LayerWidths> PackedWidths(const SafetensorsFile& file, const PackedNames& n, int64_t d_model, int64_t packed,
                                   int64_t q);
// How a packed layout turns its two weights as stored ([in, out] or [out, in]) into our W_Q,
// W_K, W_V and W_O.
using PackedSplit = void (*)(const std::vector<float>& in, std::vector<float> out_weight, const LayerWidths& w,
                             LayerWeights* out);
// Reads both weights and hands them to `split`; b_in is split into b_Q, b_K, b_V in that order.
Status FillPacked(const SafetensorsFile& file, const PackedNames& n, const LayerWidths& w, PackedSplit split,
                  LayerWeights* out);

// A packed layout's fill, from its names and its split.
template <PackedNames (*kNamesAt)(const LayerAt&), PackedSplit kSplit>
Status FillPacked(const SafetensorsFile& file, const LayerAt& at, const LayerWidths& w, LayerWeights* out) {
  return FillPacked(file, kNamesAt(at), w, kSplit, out);
}

// ---- Separate nn.Linear projections (bert, llama) ----

struct SeparateNames {
  std::string w_q, w_k, w_v, w_o;
  std::string b_q, b_k, b_v, b_o;
};

// Each projection's weight and bias: `block` + stem + ".weight" / ".bias", stems in the order
// Q, K, V, O.
SeparateNames SeparateLinearNames(const std::string& block, const std::string_view (&stems)[4]);

StatusOr<LayerWidths> CheckSeparateShapes(const SafetensorsFile& file, const SeparateNames& n);
Status FillSeparate(const SafetensorsFile& file, const SeparateNames& n, const LayerWidths& w, LayerWeights* out);

// A layout's check_shapes and fill when only its names differ from the other separate ones.
template <SeparateNames (*kNamesAt)(const LayerAt&)>
struct SeparateLinearLayout {
  static StatusOr<LayerWidths> CheckShapes(const SafetensorsFile& file, const LayerAt& at) {
    return CheckSeparateShapes(file, kNamesAt(at));
  }
  static Status Fill(const SafetensorsFile& file, const LayerAt& at, const LayerWidths& w, LayerWeights* out) {
    return FillSeparate(file, kNamesAt(at), w, out);
  }
};

}  // namespace attnserve
