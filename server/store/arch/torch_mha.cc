// torch-mha: torch.nn.MultiheadAttention.state_dict(), optionally under a prefix such as
// "layers.0.self_attn." (docs/sources.md). One packed in_proj [q + 2·kv, d_model] and
// out_proj [d_model, q], nn.Linear's [out, in]: every weight is transposed on load.
#include "server/store/arch/arch.h"
#include "server/store/arch/config_json.h"
#include "server/store/arch/tensors.h"

namespace attnserve {
namespace {

PackedNames NamesAt(const LayerAt& at) {
  return {at.prefix + "in_proj_weight", at.prefix + "in_proj_bias", at.prefix + "out_proj.weight",
          at.prefix + "out_proj.bias"};
}

// add_bias_kv adds keys and values that no input projects to, and kdim/vdim split the input
// projection: neither fits LayerWeights, so refuse rather than load a different layer.
Status RefuseUnsupportedModules(const SafetensorsFile& file, const std::string& prefix) {
  for (const char* extra : {"bias_k", "bias_v", "q_proj_weight"}) {
    if (file.Has(prefix + extra)) {
      return InvalidArgumentError(FileAt(file) + "tensor '" + prefix + extra +
                                  "' is present: MultiheadAttention with add_bias_kv or separate kdim/vdim is not "
                                  "supported");
    }
  }
  return OkStatus();
}

StatusOr<LayerWidths> CheckShapes(const SafetensorsFile& file, const LayerAt& at) {
  const PackedNames n = NamesAt(at);
  ATTNSERVE_ASSIGN_OR_RETURN(auto w, RequirePacked(file, n));
  // Linear: in_proj_weight [q + 2·kv, d_model], out_proj.weight [d_model, q].
  const int64_t packed = w.in->shape[0], d_model = w.in->shape[1], q = w.out->shape[1];
  ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, *w.out, {d_model, q}, "Linear [d_model, heads·d_head]"));
  ATTNSERVE_RETURN_IF_ERROR(RefuseUnsupportedModules(file, at.prefix));
  return PackedWidths(file, n, d_model, packed, q);
}

// in [q + 2·kv, d_model] by rows, and out [d_model, q], each transposed.
void Split(const std::vector<float>& in, std::vector<float> o, const LayerWidths& w, LayerWeights* out) {
  out->w_q = TransposedRows(in, w.d_model, 0, w.q);
  out->w_k = TransposedRows(in, w.d_model, w.q, w.kv);
  out->w_v = TransposedRows(in, w.d_model, w.q + w.kv, w.kv);
  out->w_o = TransposedRows(o, w.q, 0, w.d_model);
}

}  // namespace

extern const ArchLayout kTorchMhaLayout = {
    .name = "torch-mha",
    .anchor = {.head = "", .indexed = false, .tail = "in_proj_weight"},
    .check_shapes = CheckShapes,
    .fill = FillPacked<NamesAt, Split>,
    .read_config = HeadsFromSourceOrConfigJson,
};

}  // namespace attnserve
