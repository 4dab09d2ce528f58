#include "server/backend/cuda_options.h"

#include <charconv>
#include <cstdint>
#include <optional>
#include <set>
#include <string_view>
#include <variant>

namespace attnserve {
namespace {

using C = CudaBackendOptions;

// One option: its key, its field and, for integers, its range.
struct CudaOption {
  std::string_view key;
  std::variant<int C::*, int64_t C::*, bool C::*, Math C::*> member;
  int64_t min = 0, max = 0;
};

constexpr int64_t kMaxBytes = int64_t{1} << 50;

const CudaOption kCudaOptions[] = {
    {"device", &C::device, 0, 1 << 16},
    {"math", &C::math},
    {"max_score_workspace_bytes", &C::max_score_workspace_bytes, 1, kMaxBytes},
    {"max_device_bytes", &C::max_device_bytes, 0, kMaxBytes},
    {"max_lane_workspace_bytes", &C::max_lane_workspace_bytes, 0, kMaxBytes},
    {"retain_workspace_bytes", &C::retain_workspace_bytes, 0, kMaxBytes},
    {"staging_slice_bytes", &C::staging_slice_bytes, 1, kMaxBytes},
    {"staging_threads", &C::staging_threads, 1, 1024},
    {"summed_mix_first", &C::summed_mix_first},
    {"gemm_attention", &C::gemm_attention},
    {"graph_rows", &C::graph_rows, 0, 1 << 20},
    {"guard_zones", &C::guard_zones},
};

Status Refuse(std::string_view key, const std::string& expected, std::string_view got) {
  return InvalidArgumentError("CUDA backend option '" + std::string(key) + "': expected " + expected + ", got '" +
                              std::string(got) + "'");
}

Status Set(const CudaOption& option, std::string_view text, CudaBackendOptions* out) {
  if (auto* b = std::get_if<bool C::*>(&option.member)) {
    if (text != "true" && text != "false") return Refuse(option.key, "true or false", text);
    out->** b = text == "true";
    return OkStatus();
  }
  if (auto* m = std::get_if<Math C::*>(&option.member)) {
    const std::optional<Math> math = ParseMath(text);
    if (!math) return Refuse(option.key, "fp32, tf32, bf16 or fp16", text);
    out->** m = *math;
    return OkStatus();
  }
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || v < option.min || v > option.max) {
    return Refuse(option.key, "an integer in [" + std::to_string(option.min) + ", " + std::to_string(option.max) + "]",
                  text);
  }
  if (auto* i = std::get_if<int C::*>(&option.member)) out->** i = static_cast<int>(v);
  if (auto* l = std::get_if<int64_t C::*>(&option.member)) out->** l = v;
  return OkStatus();
}

}  // namespace

OptionPairs EncodeCudaOptions(const CudaBackendOptions& options) {
  OptionPairs pairs;
  for (const CudaOption& option : kCudaOptions) {
    std::string value;
    if (auto* b = std::get_if<bool C::*>(&option.member)) value = options.**b ? "true" : "false";
    if (auto* m = std::get_if<Math C::*>(&option.member)) value = MathName(options.**m);
    if (auto* i = std::get_if<int C::*>(&option.member)) value = std::to_string(options.**i);
    if (auto* l = std::get_if<int64_t C::*>(&option.member)) value = std::to_string(options.**l);
    pairs.emplace_back(option.key, std::move(value));
  }
  return pairs;
}

AttnserveOptions CudaOptionsView(const OptionPairs& pairs, std::vector<AttnserveOption>* items) {
  items->clear();
  for (const auto& [key, value] : pairs) items->push_back({key.c_str(), value.c_str()});
  return AttnserveOptions{.struct_size = sizeof(AttnserveOptions),
                          .version = ATTNSERVE_PLUGIN_OPTIONS_VERSION,
                          .options = items->data(),
                          .count = items->size()};
}

StatusOr<CudaBackendOptions> DecodeCudaOptions(const AttnserveOptions* options) {
  if (options == nullptr) return InvalidArgumentError("CUDA backend options: expected an options struct, got none");
  // The size first: a struct of another size cannot be read, even for its version.
  if (options->struct_size != sizeof(AttnserveOptions)) {
    return InvalidArgumentError("CUDA backend options: expected a struct of " +
                                std::to_string(sizeof(AttnserveOptions)) + " bytes, got " +
                                std::to_string(options->struct_size) + "; use the plugin built with this server");
  }
  if (options->version != ATTNSERVE_PLUGIN_OPTIONS_VERSION) {
    return InvalidArgumentError("CUDA backend options: expected version " +
                                std::to_string(ATTNSERVE_PLUGIN_OPTIONS_VERSION) + ", got version " +
                                std::to_string(options->version) + "; use the plugin built with this server");
  }
  if (options->count > 0 && options->options == nullptr) {
    return InvalidArgumentError("CUDA backend options: expected " + std::to_string(options->count) +
                                " options, got a null array");
  }
  CudaBackendOptions out;
  std::set<std::string_view> seen;
  for (size_t n = 0; n < options->count; ++n) {
    const AttnserveOption& item = options->options[n];
    const std::string_view key = item.key == nullptr ? "" : item.key;
    const std::string_view value = item.value == nullptr ? "" : item.value;
    const CudaOption* option = nullptr;
    for (const CudaOption& o : kCudaOptions) {
      if (o.key == key) option = &o;
    }
    if (option == nullptr) {
      return InvalidArgumentError("CUDA backend option '" + std::string(key) + "': unknown (expected one of " +
                                  CudaOptionKeys() + ")");
    }
    if (!seen.insert(option->key).second) {
      return InvalidArgumentError("CUDA backend option '" + std::string(key) + "': expected once, got twice");
    }
    ATTNSERVE_RETURN_IF_ERROR(Set(*option, value, &out));
  }
  return out;
}

std::string CudaOptionKeys() {
  std::string keys;
  for (const CudaOption& option : kCudaOptions) keys += (keys.empty() ? "" : ", ") + std::string(option.key);
  return keys;
}

}  // namespace attnserve
