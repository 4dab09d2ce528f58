// llama: the Hugging Face LLaMA family (LlamaForCausalLM under "model.", LlamaModel under no
// prefix), block I (docs/sources.md). Four separate nn.Linear projections, transposed on load;
// grouped-query attention comes from the shapes. Rotary embedding is part of the layer, so
// config.json gives rope_theta as well as the heads, and what it says of kv heads and
// head_dim is checked against the shapes.
#include <optional>

#include "server/store/arch/arch.h"
#include "server/store/arch/config_json.h"
#include "server/store/arch/tensors.h"

namespace attnserve {
namespace {

SeparateNames NamesAt(const LayerAt& at) {
  // LLaMA has no biases; attention_bias=true variants have all four.
  return SeparateLinearNames(at.prefix + "layers." + std::to_string(at.index) + ".self_attn.",
                             {"q_proj", "k_proj", "v_proj", "o_proj"});
}

using Layout = SeparateLinearLayout<NamesAt>;

// What a LLaMA-family config.json says about attention; 0 / nullopt where it is silent.
struct LlamaJson {
  int64_t heads = 0;     // num_attention_heads
  int64_t kv_heads = 0;  // num_key_value_heads
  int64_t head_dim = 0;  // head_dim (some families set d_head != d_model / heads)
  std::optional<double> rope_theta;
};

// Hugging Face's LlamaConfig default, used when config.json has no rope_theta.
constexpr double kLlamaDefaultRopeTheta = 10000.0;

StatusOr<int64_t> HeadDim(const nlohmann::json& json, const std::string& where) {
  const auto it = json.find("head_dim");
  if (it == json.end() || it->is_null()) return int64_t{0};
  if (!it->is_number_unsigned() || it->get<uint64_t>() < 1 || it->get<uint64_t>() > static_cast<uint64_t>(kMaxDHead)) {
    return InvalidArgumentError(where + ": 'head_dim' must be an integer in [1, " + std::to_string(kMaxDHead) +
                                "], got " + it->dump());
  }
  return static_cast<int64_t>(it->get<uint64_t>());
}

// A rotary base, `key` as messages name it: a number in (0, kMaxRopeTheta].
StatusOr<double> RopeTheta(const nlohmann::json& value, const std::string& key, const std::string& where) {
  if (!value.is_number() || !(value.get<double>() > 0) || value.get<double>() > kMaxRopeTheta) {
    return InvalidArgumentError(where + ": '" + key + "' must be a number in (0, " + FormatDouble(kMaxRopeTheta) +
                                "], got " + value.dump());
  }
  return value.get<double>();
}

// transformers 5 writes the rotary settings as "rope_parameters": {"rope_theta": T,
// "rope_type": "default"} and no top-level rope_theta. Read as absent, a base other than
// 10000 would load silently as 10000, and a scaled type as plain RoPE.
Status ReadRopeParameters(const nlohmann::json& json, const std::string& where, LlamaJson* out) {
  const auto it = json.find("rope_parameters");
  if (it == json.end() || it->is_null()) return OkStatus();
  if (!it->is_object()) return InvalidArgumentError(where + ": 'rope_parameters' must be an object, got " + it->dump());
  const auto type = it->find("rope_type");
  if (type != it->end() && !type->is_null() && *type != "default") {
    return InvalidArgumentError(where + ": 'rope_parameters' has rope_type " + type->dump() +
                                ", but only plain rotary embedding is supported (expected \"default\")");
  }
  const auto theta = it->find("rope_theta");
  if (theta == it->end()) return OkStatus();
  ATTNSERVE_ASSIGN_OR_RETURN(auto value, RopeTheta(*theta, "rope_parameters.rope_theta", where));
  if (out->rope_theta && *out->rope_theta != value) {
    return InvalidArgumentError(where + ": 'rope_theta' (" + FormatDouble(*out->rope_theta) +
                                ") and 'rope_parameters.rope_theta' (" + FormatDouble(value) + ") disagree");
  }
  out->rope_theta = value;
  return OkStatus();
}

StatusOr<std::optional<LlamaJson>> LlamaConfigFromJson(const std::string& checkpoint, const std::string& beneath) {
  const std::string where = ConfigJsonPath(checkpoint);
  ATTNSERVE_ASSIGN_OR_RETURN(
      auto j, ReadConfigJson(checkpoint, beneath, "; give heads=H and rope_theta=T in the source instead"));
  if (!j) return std::optional<LlamaJson>();
  const nlohmann::json& json = *j;
  LlamaJson out;
  ATTNSERVE_ASSIGN_OR_RETURN(out.heads, JsonPositive(json, "num_attention_heads", where));
  ATTNSERVE_ASSIGN_OR_RETURN(out.kv_heads, JsonPositive(json, "num_key_value_heads", where));
  ATTNSERVE_ASSIGN_OR_RETURN(out.head_dim, HeadDim(json, where));
  if (const auto it = json.find("rope_theta"); it != json.end()) {
    ATTNSERVE_ASSIGN_OR_RETURN(out.rope_theta, RopeTheta(*it, "rope_theta", where));
  }
  ATTNSERVE_RETURN_IF_ERROR(ReadRopeParameters(json, where, &out));
  // Scaled RoPE (linear, dynamic, yarn, llama3) changes the frequencies: computing plain RoPE
  // instead would silently give other outputs than the model.
  if (const auto it = json.find("rope_scaling"); it != json.end() && !it->is_null()) {
    return InvalidArgumentError(where + ": 'rope_scaling' is " + it->dump() +
                                ", but only plain rotary embedding is supported (expected null or absent)");
  }
  return std::optional<LlamaJson>(out);
}

// Heads, kv heads and rope_theta from config.json; the source's options win over it, and
// config.json's head counts are then no longer checks.
StatusOr<HeadSettings> ReadConfig(const SourceSpec& spec) {
  ATTNSERVE_ASSIGN_OR_RETURN(const std::optional<LlamaJson> llama, LlamaConfigFromJson(spec.path, spec.model_dir));
  const std::string where = ConfigJsonPath(spec.path);
  if (!llama && (spec.heads == 0 || !spec.rope_theta)) {
    return InvalidArgumentError("arch=llama needs the number of heads and rope_theta, and there is no " + where +
                                " beside the file; give heads=H and rope_theta=T");
  }
  HeadSettings s;
  s.heads = spec.heads;
  if (s.heads == 0) {
    if (llama->heads == 0) {
      return InvalidArgumentError(where + " has no 'num_attention_heads'; give heads=H in the source");
    }
    s.heads = llama->heads;
  }
  s.rope_theta = spec.rope_theta ? *spec.rope_theta : llama->rope_theta.value_or(kLlamaDefaultRopeTheta);
  if (llama && spec.heads == 0) {
    s.config_json = where;
    s.config_head_dim = llama->head_dim;
    if (spec.kv_heads == 0) s.config_kv_heads = llama->kv_heads;
  }
  return s;
}

}  // namespace

extern const ArchLayout kLlamaLayout = {
    .name = "llama",
    .anchor = {.head = "layers.", .indexed = true, .tail = ".self_attn.q_proj.weight"},
    .check_shapes = Layout::CheckShapes,
    .fill = Layout::Fill,
    .read_config = ReadConfig,
};

}  // namespace attnserve
