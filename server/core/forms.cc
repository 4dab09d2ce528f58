#include "server/core/forms.h"

#include <algorithm>

#include <Eigen/Core>

#include "server/core/form_table.h"

namespace attnserve {
namespace {

using RowMatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMapF = Eigen::Map<const RowMatrixF>;

// Copies `src` ([d, cols], row-major) into columns [col0, col0 + cols) of `dst` ([d, ld]).
void PlaceColumns(const std::vector<float>& src, int64_t d, int64_t cols, AlignedFloats& dst,
                  int64_t ld, int64_t col0) {
  for (int64_t r = 0; r < d; ++r) {
    std::copy(src.begin() + r * cols, src.begin() + (r + 1) * cols, dst.begin() + r * ld + col0);
  }
}

// Columns [col0, col0 + cols) of `src` ([d, ld]) as a [d, cols] row-major matrix.
std::vector<float> TakeColumns(const AlignedFloats& src, int64_t d, int64_t ld, int64_t col0, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(d * cols));
  for (int64_t r = 0; r < d; ++r) {
    std::copy(src.begin() + r * ld + col0, src.begin() + r * ld + col0 + cols, out.begin() + r * cols);
  }
  return out;
}

// The parts every form shares: W_in's Q and K columns, b_in's Q and K entries.
FormWeights StartForm(Form form, const LayerWeights& w, int64_t value_cols) {
  const LayerConfig& c = w.config;
  FormWeights f;
  f.form = form;
  f.config = c;
  f.q_cols = c.heads * c.d_head;
  f.k_cols = c.kv_heads * c.d_head;
  f.value_cols = value_cols;
  f.w_in.assign(c.d_model * f.in_cols(), 0.0f);
  PlaceColumns(w.w_q, c.d_model, f.q_cols, f.w_in, f.in_cols(), 0);
  PlaceColumns(w.w_k, c.d_model, f.k_cols, f.w_in, f.in_cols(), f.q_cols);
  if (c.bias) {
    f.b_in = w.b_q;
    f.b_in.insert(f.b_in.end(), w.b_k.begin(), w.b_k.end());
  }
  return f;
}

}  // namespace

std::string_view FormName(Form form) { return DefOf(form).name; }

HeadCombine HeadCombineOf(Form form) { return DefOf(form).combine; }

Status CheckHeadCombine(const FormWeights& f) {
  const int64_t want = f.concat_then_project() ? f.out_rows * f.config.d_model : 0;
  if (static_cast<int64_t>(f.w_out.size()) == want && (want > 0) == f.concat_then_project()) return OkStatus();
  return InvalidArgumentError(
      "w_out: the " + std::string(FormName(f.form)) + " form " +
      (f.concat_then_project() ? "projects its heads' outputs and needs out_rows x d_model = " +
                                     std::to_string(f.out_rows) + " x " + std::to_string(f.config.d_model) + " floats"
                               : std::string("sums its heads' mixes and has no output projection (0 floats)")) +
      ", got " + std::to_string(f.w_out.size()));
}

std::optional<Form> ParseForm(std::string_view name) {
  const FormDef* def = DefNamed(name);
  if (def == nullptr) return std::nullopt;
  return def->form;
}

int64_t FormWeights::Parameters() const {
  return static_cast<int64_t>(w_in.size() + b_in.size() + w_out.size() + b_out.size());
}

FormWeights MaterializeFactored(const LayerWeights& w) {
  const LayerConfig& c = w.config;
  FormWeights f = StartForm(Form::kFactored, w, c.kv_heads * c.d_head);
  PlaceColumns(w.w_v, c.d_model, f.value_cols, f.w_in, f.in_cols(), f.q_cols + f.k_cols);
  if (c.bias) f.b_in.insert(f.b_in.end(), w.b_v.begin(), w.b_v.end());
  for (int64_t i = 0; i < c.heads; ++i) {
    f.value_offset.push_back(c.KvHeadOf(i) * c.d_head);
    f.value_width.push_back(c.d_head);
    f.mix_offset.push_back(i * c.d_head);
  }
  f.w_out.assign(w.w_o.begin(), w.w_o.end());
  f.out_rows = c.heads * c.d_head;
  f.b_out = w.b_o;
  return f;
}

LayerWeights LayerWeightsOfFactored(const FormWeights& f) {
  const LayerConfig& c = f.config;
  LayerWeights w;
  w.config = c;
  w.w_q = TakeColumns(f.w_in, c.d_model, f.in_cols(), 0, f.q_cols);
  w.w_k = TakeColumns(f.w_in, c.d_model, f.in_cols(), f.q_cols, f.k_cols);
  w.w_v = TakeColumns(f.w_in, c.d_model, f.in_cols(), f.q_cols + f.k_cols, f.value_cols);
  w.w_o.assign(f.w_out.begin(), f.w_out.end());
  if (c.bias) {
    const auto at = [&](int64_t i) { return f.b_in.begin() + i; };
    w.b_q.assign(at(0), at(f.q_cols));
    w.b_k.assign(at(f.q_cols), at(f.q_cols + f.k_cols));
    w.b_v.assign(at(f.q_cols + f.k_cols), at(f.in_cols()));
    w.b_o = f.b_out;
  }
  return w;
}

std::vector<float> FoldedOutputBias(const LayerWeights& w) {
  const LayerConfig& c = w.config;
  if (!c.bias) return {};
  const int64_t d = c.d_model, dh = c.d_head;
  const RowMatrixD w_o = ConstMapF(w.w_o.data(), c.heads * dh, d).cast<double>();
  Eigen::RowVectorXd b_eff = Eigen::Map<const Eigen::RowVectorXf>(w.b_o.data(), d).cast<double>();
  for (int64_t i = 0; i < c.heads; ++i) {
    const auto b_v_g = Eigen::Map<const Eigen::RowVectorXf>(w.b_v.data() + c.KvHeadOf(i) * dh, dh).cast<double>();
    b_eff += b_v_g * w_o.middleRows(i * dh, dh);
  }
  std::vector<float> out(d);
  Eigen::Map<Eigen::RowVectorXf>(out.data(), d) = b_eff.cast<float>();
  return out;
}

FormWeights MaterializeSummed(const LayerWeights& w) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, dh = c.d_head, kv_cols = c.kv_heads * dh;
  FormWeights f = StartForm(Form::kSummed, w, c.heads * d);
  const RowMatrixD w_v = ConstMapF(w.w_v.data(), d, kv_cols).cast<double>();
  const RowMatrixD w_o = ConstMapF(w.w_o.data(), c.heads * dh, d).cast<double>();
  Eigen::Map<RowMatrixF, 0, Eigen::OuterStride<>> w_in(f.w_in.data(), d, f.in_cols(),
                                                      Eigen::OuterStride<>(f.in_cols()));
  for (int64_t i = 0; i < c.heads; ++i) {
    const auto w_v_g = w_v.middleCols(c.KvHeadOf(i) * dh, dh);
    const auto w_o_i = w_o.middleRows(i * dh, dh);
    w_in.middleCols(f.q_cols + f.k_cols + i * d, d) = (w_v_g * w_o_i).cast<float>();
    f.value_offset.push_back(i * d);
    f.value_width.push_back(d);
    f.mix_offset.push_back(0);  // every head adds into the same d output columns
  }
  f.b_out = FoldedOutputBias(w);
  return f;
}

FormWeights MaterializeQueryKeyOnly(Form form, const LayerWeights& w) { return StartForm(form, w, 0); }

bool SummedMixesFirst(const FormWeights& f, const SequenceShape& s, const SummedOrder& order) {
  if (!order.mix_first_allowed || f.form != Form::kSummed || static_cast<int64_t>(f.b_in.size()) > f.q_cols + f.k_cols) return false;
  if (s.n < s.m) return true;
  const double a_cat_bytes = static_cast<double>(s.n) * static_cast<double>(s.keys < 0 ? s.m : s.keys) *
                             static_cast<double>(f.config.heads) * sizeof(float);
  return a_cat_bytes > static_cast<double>(order.max_a_cat_bytes);
}

int64_t StackedHeads(const FormWeights& f) { return f.form == Form::kLowRank ? 1 : f.config.group_size(); }

int64_t SummedRowsPerPart(const FormWeights& f, int64_t max_score_scratch_bytes) {
  const int64_t row_bytes = f.value_cols * static_cast<int64_t>(sizeof(float));
  return std::max<int64_t>(1, max_score_scratch_bytes / row_bytes);
}

std::vector<std::pair<size_t, size_t>> ValueGroups(std::span<const int64_t> rows, int64_t max_rows) {
  std::vector<std::pair<size_t, size_t>> groups;
  int64_t held = 0;  // the last group's rows
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r] < 0) continue;
    if (groups.empty() || held + rows[r] > max_rows) {
      groups.emplace_back(r, r);
      held = 0;
    }
    groups.back().second = r + 1;
    held += rows[r];
  }
  return groups;
}

int64_t ForwardScratchBytes(const FormWeights& f, std::span<const SequenceShape> batch, bool self_attention,
                            int threads, int64_t max_score_scratch_bytes, const SummedOrder& order,
                            int64_t max_value_group_bytes) {
  if (batch.empty()) return 0;
  const int64_t d = f.config.d_model, heads = f.config.heads, dh = f.config.d_head;
  // The summed form's per-part work: A_cat [n, L·h] of a sequence that projects first, the
  // heads' mixes [rows, h·d] of a part of at most SummedRowsPerPart rows when it mixes first
  // (and then no value rows of its own).
  int64_t tx = 0, tc = 0, max_block_scores = 0, work_total = 0, work_largest = 0;
  std::vector<int64_t> sequence_value_rows;
  for (const SequenceShape& s : batch) {
    const int64_t keys = s.keys < 0 ? s.m : s.keys;
    const bool mix_first = SummedMixesFirst(f, s, order);
    tx += s.n;
    tc += s.m;
    sequence_value_rows.push_back(mix_first ? -1 : s.m);
    if (f.form == Form::kSummed && !mix_first) {
      max_block_scores = std::max(max_block_scores, kSummedBlockRows * keys);  // HeadScores' block
      work_total += s.n * keys * heads;
      work_largest = std::max(work_largest, s.n * keys * heads);
    } else if (f.form == Form::kSummed) {
      work_total += s.n * f.value_cols;
      work_largest = std::max(work_largest, std::min(s.n, SummedRowsPerPart(f, max_score_scratch_bytes)) * f.value_cols);
    }
  }
  // The value block holds the largest group of value rows (the concat-then-project forms: all).
  const int64_t value_row_bytes = std::max<int64_t>(1, f.value_cols * static_cast<int64_t>(sizeof(float)));
  const int64_t max_group_rows =
      f.concat_then_project() ? INT64_MAX : std::max<int64_t>(1, max_value_group_bytes / value_row_bytes);
  int64_t value_rows = 0;
  for (const auto& [first, last] : ValueGroups(sequence_value_rows, max_group_rows)) {
    int64_t rows = 0;
    for (size_t r = first; r < last; ++r) rows += sequence_value_rows[r];
    value_rows = std::max(value_rows, rows);
  }
  int64_t widest_values = 0;
  for (int64_t w : f.value_width) widest_values = std::max(widest_values, w);
  // A tiled task's scores, its key tile transposed (Kᵀ, for the backend's own kernel), its
  // stacked queries and its running output (stacked heads only).
  const int64_t stacked = StackedHeads(f);
  const int64_t tile = kQueryTile * (kKeyTile + (stacked > 1 ? dh + widest_values : 0)) + kKeyTile * dh;
  const int64_t per_thread = std::max(tile, max_block_scores);
  const bool many = batch.size() > 1;
  int64_t floats = 0;
  if (many) floats += tx * d + (self_attention ? 0 : tc * d);             // StackRows copies
  floats += self_attention ? tx * (f.q_cols + f.k_cols) : tx * f.q_cols + tc * f.k_cols;  // Q, K
  floats += value_rows * f.value_cols;                                    // the value block
  floats += static_cast<int64_t>(std::max(threads, 1)) * per_thread;      // a score tile per thread
  if (f.concat_then_project()) {
    floats += tx * f.out_rows;                                            // heads' outputs
    if (many) floats += tx * d;                                           // the stacked output
  } else {
    const int64_t chunk_cap = max_score_scratch_bytes / static_cast<int64_t>(sizeof(float));
    floats += std::min(work_total, std::max(chunk_cap, work_largest));    // one chunk's A_cat or mixes
  }
  // The GEMM library packs its operands into blocks sized to the caches, per thread (measured
  // by tests/unit/memory_footprint_test.cc at these widths: Eigen 1-2 MiB each, oneDNN 2.6 about
  // 4 MiB, its first call included).
  const int64_t packing = static_cast<int64_t>(std::max(threads, 1)) * (int64_t{4} << 20);
  return floats * static_cast<int64_t>(sizeof(float)) + packing;
}

double ForwardFlops(const FormWeights& f, std::span<const SequenceShape> batch, const SummedOrder& order) {
  const double d = static_cast<double>(f.config.d_model);
  double mix_width = 0;
  for (int64_t w : f.value_width) mix_width += static_cast<double>(w);
  const double score_width = static_cast<double>(f.config.heads * f.config.d_head);
  double flops = 0;
  for (const SequenceShape& s : batch) {
    const double n = static_cast<double>(s.n), m = static_cast<double>(s.m);
    const double keys = static_cast<double>(s.keys < 0 ? s.m : s.keys);
    flops += 2 * n * d * static_cast<double>(f.q_cols);                   // Q projection
    // The value projection runs over the queries' mixes instead of the keys when mixing first.
    const bool mix_first = SummedMixesFirst(f, s, order);
    flops += 2 * m * d * static_cast<double>(f.k_cols);                   // K projection
    flops += 2 * (mix_first ? n : m) * d * static_cast<double>(f.value_cols);  // value projection
    flops += 2 * n * keys * score_width;                                  // scores, all heads
    flops += 2 * n * keys * mix_width;                                    // A_i · Val_i, all heads
    flops += 2 * n * static_cast<double>(f.out_rows) * d;                 // output projection
  }
  return flops;
}

}  // namespace attnserve
