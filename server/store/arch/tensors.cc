#include "server/store/arch/tensors.h"

#include <algorithm>
#include <cmath>

namespace attnserve {
namespace {

std::string TensorAt(const SafetensorsFile& file, const std::string& name) {
  return "safetensors file '" + file.path() + "', tensor '" + name + "': ";
}

Status ExpectRank2(const SafetensorsFile& file, const TensorInfo& t) {
  if (t.shape.size() != 2 || t.shape[0] < 1 || t.shape[1] < 1) {
    return InvalidArgumentError(TensorAt(file, t.name) + "expected a non-empty matrix, got shape " +
                                ShapeString(t.shape));
  }
  return OkStatus();
}

Status CheckFinite(const SafetensorsFile& file, const std::string& name, const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return InvalidArgumentError(TensorAt(file, name) + "non-finite value at flat index " + std::to_string(i));
    }
  }
  return OkStatus();
}

std::vector<float> Slice(const std::vector<float>& src, int64_t first, int64_t count) {
  return {src.begin() + first, src.begin() + first + count};
}

}  // namespace

std::string FileAt(const SafetensorsFile& file) { return "safetensors file '" + file.path() + "': "; }

Status ExpectShape(const SafetensorsFile& file, const TensorInfo& t, const std::vector<int64_t>& expected,
                   const std::string& why) {
  if (t.shape != expected) {
    return InvalidArgumentError(TensorAt(file, t.name) + "expected shape " + ShapeString(expected) + " (" + why +
                                "), got " + ShapeString(t.shape));
  }
  return OkStatus();
}

StatusOr<std::vector<float>> ReadValues(const SafetensorsFile& file, const std::string& name) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto t, file.ReadFloat(name));
  ATTNSERVE_RETURN_IF_ERROR(CheckFinite(file, name, t.values));
  return std::move(t.values);
}

std::vector<float> TransposedRows(const std::vector<float>& src, int64_t cols, int64_t row0, int64_t rows) {
  std::vector<float> out(static_cast<size_t>(cols * rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = src[(row0 + r) * cols + c];
  }
  return out;
}

std::vector<float> Columns(const std::vector<float>& src, int64_t rows, int64_t cols, int64_t col0, int64_t count) {
  std::vector<float> out(static_cast<size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(src.begin() + r * cols + col0, src.begin() + r * cols + col0 + count, out.begin() + r * count);
  }
  return out;
}

Status CheckBiases(const SafetensorsFile& file, const std::vector<std::pair<std::string, int64_t>>& sized,
                   LayerWidths* widths) {
  std::vector<std::string> present, absent;
  for (const auto& [name, size] : sized) (file.Has(name) ? present : absent).push_back(name);
  if (!present.empty() && !absent.empty()) {
    return InvalidArgumentError(FileAt(file) + "has bias '" + present[0] + "' but not '" + absent[0] +
                                "' (a layer has all its biases or none)");
  }
  widths->bias = !present.empty();
  if (!widths->bias) return OkStatus();
  for (const auto& [name, size] : sized) {
    ATTNSERVE_ASSIGN_OR_RETURN(auto t, file.FindFloat(name));
    ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, *t, {size}, "a bias of its weight's output width"));
  }
  return OkStatus();
}

StatusOr<PackedWeights> RequirePacked(const SafetensorsFile& file, const PackedNames& n) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto in, file.FindFloat(n.w_in));
  ATTNSERVE_ASSIGN_OR_RETURN(auto out, file.FindFloat(n.w_out));
  ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, *in));
  ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, *out));
  return PackedWeights{in, out};
}

StatusOr<LayerWidths> PackedWidths(const SafetensorsFile& file, const PackedNames& n, int64_t d_model, int64_t packed,
                                   int64_t q) {
  if (packed <= q || (packed - q) % 2 != 0) {
    return InvalidArgumentError(TensorAt(file, n.w_in) + "packed Q|K|V width " + std::to_string(packed) +
                                " must be the query width " + std::to_string(q) + " (from '" + n.w_out +
                                "') plus twice a key/value width");
  }
  LayerWidths w;
  w.d_model = d_model;
  w.q = q;
  w.kv = (packed - q) / 2;
  w.q_from = n.w_out;
  w.kv_from = n.w_in;
  ATTNSERVE_RETURN_IF_ERROR(CheckBiases(file, {{n.b_in, packed}, {n.b_out, d_model}}, &w));
  return w;
}

Status FillPacked(const SafetensorsFile& file, const PackedNames& n, const LayerWidths& w, PackedSplit split,
                  LayerWeights* out) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto in, ReadValues(file, n.w_in));
  ATTNSERVE_ASSIGN_OR_RETURN(auto o, ReadValues(file, n.w_out));
  split(in, std::move(o), w, out);
  if (!w.bias) return OkStatus();
  ATTNSERVE_ASSIGN_OR_RETURN(auto b, ReadValues(file, n.b_in));
  out->b_q = Slice(b, 0, w.q);
  out->b_k = Slice(b, w.q, w.kv);
  out->b_v = Slice(b, w.q + w.kv, w.kv);
  ATTNSERVE_ASSIGN_OR_RETURN(out->b_o, ReadValues(file, n.b_out));
  return OkStatus();
}

SeparateNames SeparateLinearNames(const std::string& block, const std::string_view (&stems)[4]) {
  SeparateNames n;
  std::string* weights[] = {&n.w_q, &n.w_k, &n.w_v, &n.w_o};
  std::string* biases[] = {&n.b_q, &n.b_k, &n.b_v, &n.b_o};
  for (int i = 0; i < 4; ++i) {
    *weights[i] = block + std::string(stems[i]) + ".weight";
    *biases[i] = block + std::string(stems[i]) + ".bias";
  }
  return n;
}

StatusOr<LayerWidths> CheckSeparateShapes(const SafetensorsFile& file, const SeparateNames& n) {
  const TensorInfo* t[4];
  const std::string* names[] = {&n.w_q, &n.w_k, &n.w_v, &n.w_o};
  for (int i = 0; i < 4; ++i) {
    ATTNSERVE_ASSIGN_OR_RETURN(t[i], file.FindFloat(*names[i]));
  }
  const TensorInfo &wq = *t[0], &wk = *t[1], &wv = *t[2], &wo = *t[3];
  ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, wq));
  ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, wk));
  // Linear stores [out, in].
  LayerWidths w;
  w.q = wq.shape[0];
  w.d_model = wq.shape[1];
  w.kv = wk.shape[0];
  w.q_from = n.w_q;
  w.kv_from = n.w_k;
  ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, wk, {w.kv, w.d_model}, "Linear [kv_heads·d_head, d_model]"));
  ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, wv, {w.kv, w.d_model}, "the key's shape"));
  ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, wo, {w.d_model, w.q}, "Linear [d_model, heads·d_head]"));
  ATTNSERVE_RETURN_IF_ERROR(CheckBiases(file, {{n.b_q, w.q}, {n.b_k, w.kv}, {n.b_v, w.kv}, {n.b_o, w.d_model}}, &w));
  return w;
}

Status FillSeparate(const SafetensorsFile& file, const SeparateNames& n, const LayerWidths& w, LayerWeights* out) {
  // Each Linear weight [out, in] transposed to [in, out].
  const std::pair<const std::string*, std::vector<float>*> weights[] = {
      {&n.w_q, &out->w_q}, {&n.w_k, &out->w_k}, {&n.w_v, &out->w_v}, {&n.w_o, &out->w_o}};
  const int64_t in_cols[] = {w.d_model, w.d_model, w.d_model, w.q};
  for (int k = 0; k < 4; ++k) {
    ATTNSERVE_ASSIGN_OR_RETURN(auto m, ReadValues(file, *weights[k].first));
    const int64_t rows = static_cast<int64_t>(m.size()) / in_cols[k];
    *weights[k].second = TransposedRows(m, in_cols[k], 0, rows);
  }
  if (!w.bias) return OkStatus();
  const std::pair<const std::string*, std::vector<float>*> biases[] = {
      {&n.b_q, &out->b_q}, {&n.b_k, &out->b_k}, {&n.b_v, &out->b_v}, {&n.b_o, &out->b_o}};
  for (const auto& [name, dst] : biases) {
    ATTNSERVE_ASSIGN_OR_RETURN(*dst, ReadValues(file, *name));
  }
  return OkStatus();
}

}  // namespace attnserve
