// gpt2: Hugging Face GPT-2, block I under no prefix or "transformer." (docs/sources.md). The
// fused c_attn [d_model, q + 2·kv] is split by columns into W_Q, W_K, W_V; Conv1D already
// computes y = x W + b, so nothing is transposed. The causal-mask buffer h.I.attn.bias is
// ignored: causality is per request (Sequence::causal), not part of the layer.
#include "server/store/arch/arch.h"
#include "server/store/arch/config_json.h"
#include "server/store/arch/tensors.h"

namespace attnserve {
namespace {

PackedNames NamesAt(const LayerAt& at) {
  const std::string block = at.prefix + "h." + std::to_string(at.index) + ".attn.";
  return {block + "c_attn.weight", block + "c_attn.bias", block + "c_proj.weight", block + "c_proj.bias"};
}

StatusOr<LayerWidths> CheckShapes(const SafetensorsFile& file, const LayerAt& at) {
  const PackedNames n = NamesAt(at);
  ATTNSERVE_ASSIGN_OR_RETURN(auto w, RequirePacked(file, n));
  // Conv1D: c_attn.weight [d_model, q + 2·kv], c_proj.weight [q, d_model].
  const int64_t d_model = w.in->shape[0], packed = w.in->shape[1], q = w.out->shape[0];
  ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, *w.out, {q, d_model}, "Conv1D [heads·d_head, d_model]"));
  return PackedWidths(file, n, d_model, packed, q);
}

// The fused c_attn [d_model, q + 2·kv] by columns; c_proj [q, d_model] as it is.
void Split(const std::vector<float>& in, std::vector<float> o, const LayerWidths& w, LayerWeights* out) {
  const int64_t packed = w.q + 2 * w.kv;
  out->w_q = Columns(in, w.d_model, packed, 0, w.q);
  out->w_k = Columns(in, w.d_model, packed, w.q, w.kv);
  out->w_v = Columns(in, w.d_model, packed, w.q + w.kv, w.kv);
  out->w_o = std::move(o);
}

}  // namespace

extern const ArchLayout kGpt2Layout = {
    .name = "gpt2",
    .anchor = {.head = "h.", .indexed = true, .tail = ".attn.c_attn.weight"},
    .check_shapes = CheckShapes,
    .fill = FillPacked<NamesAt, Split>,
    .read_config = HeadsFromSourceOrConfigJson,
};

}  // namespace attnserve
