// One attention sequence as the backends see it: a query block, an optional context block, its
// masks and where its output goes. A wire request [batch, n, d] becomes `batch` sequences; a
// backend batch is a span of sequences with their own n, m and masks (a ragged batch).
// Thread-safety: views only; the caller keeps the memory alive for the call.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "server/core/layer.h"
#include "server/core/status.h"
#include "server/core/tensor.h"

namespace attnserve {

// Largest rotary position accepted (keeps position · frequency exact enough in float64).
inline constexpr int64_t kMaxPosition = int64_t{1} << 40;

struct Sequence {
  ConstMatrixView input;    // [n, d_model]: the queries
  ConstMatrixView context;  // [m, d_model]; empty: self-attention (the context is the input)
  // Query q sees key j only if j <= q (top-left aligned, as torch's is_causal).
  bool causal = false;
  // Keys [0, key_length) are visible; -1: all m. Must be in [1, m] otherwise.
  int64_t key_length = -1;
  MatrixView output;        // [n, d_model], written by the backend
  // Rotary embedding positions (layers with rope_theta > 0): query q is at position_offset + q;
  // key j at position_offset + j in self-attention and at j for a separate context.
  int64_t position_offset = 0;

  bool self_attention() const { return context.empty(); }
  int64_t n() const { return input.rows; }
  int64_t m() const { return self_attention() ? input.rows : context.rows; }
  ConstMatrixView keys_source() const { return self_attention() ? input : context; }
  int64_t visible_keys() const { return key_length < 0 ? m() : key_length; }
  int64_t key_position_offset() const { return self_attention() ? position_offset : 0; }
};

// Where each sequence of a batch sits when the batch is stacked: its first row among all the
// queries (X, Q, O, Y) and among all the contexts (C, K, the value block). Both backends stack a
// batch this way; computed once here.
struct BatchRows {
  std::vector<int64_t> x_row, c_row;  // per sequence
  int64_t queries = 0;                // Tx: the stacked query rows
  int64_t contexts = 0;               // Tc: the stacked context rows (= Tx when all_self)
  bool all_self = true;               // every sequence is self-attention
};
BatchRows StackedRows(std::span<const Sequence> batch);

// Checks the sequence's shapes against the layer; errors name the field, expected and got.
Status ValidateSequence(const LayerConfig& config, const Sequence& seq);

// Number of keys query row q sees.
inline int64_t VisibleKeys(const Sequence& seq, int64_t q) {
  const int64_t limit = seq.visible_keys();
  return seq.causal ? (q + 1 < limit ? q + 1 : limit) : limit;
}

}  // namespace attnserve
