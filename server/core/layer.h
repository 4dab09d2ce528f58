// A multi-head attention layer as the user gives it: its shape (LayerConfig) and its weights in
// the standard factored layout (LayerWeights), row-vector convention y = x W.
// Thread-safety: plain values; share a const one freely.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/core/status.h"

namespace attnserve {

// Every function that takes a LayerConfig (or weights or a form built from one) expects it
// complete: passed through CompleteConfig, so kv_heads and d_head are set and valid.
struct LayerConfig {
  int64_t d_model = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;  // grouped-query attention when < heads; 0 means "= heads"
  int64_t d_head = 0;    // 0 means d_model / heads; need not equal d_model / heads
  bool bias = true;
  float scale = 0.0f;    // softmax scale; 0 means 1 / sqrt(d_head)
  // Rotary position embedding on Q and K (LLaMA family, rotate-half pairing (t, t + d_head/2));
  // 0 means none. Needs an even d_head.
  double rope_theta = 0.0;

  int64_t group_size() const { return heads / kv_heads; }
  // g(i): the key/value head that query head i reads.
  int64_t KvHeadOf(int64_t head) const { return head / group_size(); }
  float SoftmaxScale() const;
  std::string ToString() const;
};

// Largest sizes a layer may have: keeps every product of dims far from int64 overflow and
// every weight matrix below a few GiB.
inline constexpr int64_t kMaxDModel = 65536;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxDHead = 4096;

// Fills the defaults (kv_heads, d_head, scale) and checks the result; the error names the
// field, what was expected and what came.
StatusOr<LayerConfig> CompleteConfig(LayerConfig config);

struct LayerWeights {
  LayerConfig config;      // complete (see CompleteConfig)
  std::vector<float> w_q;  // [d_model, heads * d_head]
  std::vector<float> w_k;  // [d_model, kv_heads * d_head]
  std::vector<float> w_v;  // [d_model, kv_heads * d_head]
  std::vector<float> w_o;  // [heads * d_head, d_model]; rows i*d_head.. are W_O_i
  std::vector<float> b_q, b_k, b_v, b_o;  // empty when !config.bias
};

// Checks that every matrix has the size the config implies and that all values are finite.
Status ValidateWeights(const LayerWeights& weights);

// Seeded random weights, scaled so that outputs are O(1) for O(1) inputs. Deterministic for a
// given (config, seed) on every platform.
LayerWeights RandomLayerWeights(const LayerConfig& config, uint64_t seed);

}  // namespace attnserve
