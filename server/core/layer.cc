#include "server/core/layer.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "server/core/splitmix64.h"

namespace attnserve {
namespace {

Status OutOfRange(const char* field, int64_t got, int64_t lo, int64_t hi) {
  return InvalidArgumentError(std::string("layer config: ") + field + " must be in [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                              std::to_string(got));
}

Status CheckSize(const char* name, const std::vector<float>& v, int64_t rows, int64_t cols) {
  if (static_cast<int64_t>(v.size()) != rows * cols) {
    return InvalidArgumentError(std::string("layer weights: ") + name + " must hold " +
                                std::to_string(rows) + "x" + std::to_string(cols) + " = " +
                                std::to_string(rows * cols) + " values, got " +
                                std::to_string(v.size()));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return InvalidArgumentError(std::string("layer weights: ") + name + " holds a non-finite value at index " +
                                  std::to_string(i));
    }
  }
  return OkStatus();
}

void FillUniform(std::vector<float>& v, size_t count, double std_dev, SplitMix64& rng) {
  // A uniform on [-a, a] has standard deviation a / sqrt(3).
  const double a = std_dev * std::sqrt(3.0);
  v.resize(count);
  for (auto& x : v) x = static_cast<float>(a * rng.Symmetric());
}

}  // namespace

float LayerConfig::SoftmaxScale() const {
  return scale != 0.0f ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d_head)));
}

std::string LayerConfig::ToString() const {
  return "d_model=" + std::to_string(d_model) + " heads=" + std::to_string(heads) +
         " kv_heads=" + std::to_string(kv_heads) + " d_head=" + std::to_string(d_head) +
         " bias=" + (bias ? "true" : "false") + (rope_theta > 0 ? " rope_theta=" + std::to_string(rope_theta) : "");
}

StatusOr<LayerConfig> CompleteConfig(LayerConfig c) {
  if (c.d_model < 1 || c.d_model > kMaxDModel) return OutOfRange("d_model", c.d_model, 1, kMaxDModel);
  if (c.heads < 1 || c.heads > kMaxHeads) return OutOfRange("heads", c.heads, 1, kMaxHeads);
  if (c.kv_heads == 0) c.kv_heads = c.heads;
  if (c.kv_heads < 1 || c.kv_heads > c.heads) return OutOfRange("kv_heads", c.kv_heads, 1, c.heads);
  if (c.heads % c.kv_heads != 0) {
    return InvalidArgumentError("layer config: kv_heads must divide heads (" + std::to_string(c.heads) +
                                "), got kv_heads=" + std::to_string(c.kv_heads));
  }
  if (c.d_head == 0) {
    if (c.d_model % c.heads != 0) {
      return InvalidArgumentError("layer config: d_head not given and d_model (" + std::to_string(c.d_model) +
                                  ") is not a multiple of heads (" + std::to_string(c.heads) +
                                  "); give d_head explicitly");
    }
    c.d_head = c.d_model / c.heads;
  }
  if (c.d_head < 1 || c.d_head > kMaxDHead) return OutOfRange("d_head", c.d_head, 1, kMaxDHead);
  if (!std::isfinite(c.scale) || c.scale < 0.0f) {
    return InvalidArgumentError("layer config: scale must be finite and >= 0 (0 = 1/sqrt(d_head)), got " +
                                std::to_string(c.scale));
  }
  if (!std::isfinite(c.rope_theta) || c.rope_theta < 0.0) {
    return InvalidArgumentError("layer config: rope_theta must be finite and >= 0 (0 = no rotary embedding), got " +
                                std::to_string(c.rope_theta));
  }
  if (c.rope_theta > 0.0 && c.d_head % 2 != 0) {
    return InvalidArgumentError("layer config: rotary embedding needs an even d_head, got d_head=" +
                                std::to_string(c.d_head));
  }
  return c;
}

Status ValidateWeights(const LayerWeights& w) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto complete, CompleteConfig(w.config));
  const LayerConfig& c = w.config;
  if (c.kv_heads != complete.kv_heads || c.d_head != complete.d_head) {
    return InvalidArgumentError("layer weights: config is not complete (" + c.ToString() + ")");
  }
  const int64_t d = c.d_model, q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("w_q", w.w_q, d, q));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("w_k", w.w_k, d, kv));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("w_v", w.w_v, d, kv));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("w_o", w.w_o, q, d));
  const int64_t b = c.bias ? 1 : 0;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("b_q", w.b_q, b, q));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("b_k", w.b_k, b, kv));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("b_v", w.b_v, b, kv));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("b_o", w.b_o, b, d));
  return OkStatus();
}

LayerWeights RandomLayerWeights(const LayerConfig& c, uint64_t seed) {
  LayerWeights w;
  w.config = c;
  SplitMix64 rng{seed * 0x2545f4914f6cdd1dULL + 1};
  const size_t d = c.d_model, q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  // Fan-in scaling keeps each projection's outputs O(1) for O(1) inputs.
  const double in_std = 1.0 / std::sqrt(static_cast<double>(d));
  const double out_std = 1.0 / std::sqrt(static_cast<double>(q));
  FillUniform(w.w_q, d * q, in_std, rng);
  FillUniform(w.w_k, d * kv, in_std, rng);
  FillUniform(w.w_v, d * kv, in_std, rng);
  FillUniform(w.w_o, q * d, out_std, rng);
  if (c.bias) {
    FillUniform(w.b_q, q, 0.1, rng);
    FillUniform(w.b_k, kv, 0.1, rng);
    FillUniform(w.b_v, kv, 0.1, rng);
    FillUniform(w.b_o, d, 0.1, rng);
  }
  return w;
}

}  // namespace attnserve
