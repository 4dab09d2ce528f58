// The forms a layer is held in, laid out for execution, and what each costs.
//
// Every form runs the same skeleton (docs/architecture.md, "One layout for every form"):
//   [Q | K | Val] = [X | C] W_in + b_in         (one GEMM over all stacked tokens)
//   A_i = softmax(scale · Q_i K_g(i)^T + mask)  (per sequence and head)
//   mix: factored / lowrank  O_i = A_i Val_i,  Y = O W_out + b_out
//        summed              Y = Σ_i A_i Val_i + b_out   (one GEMM over the heads)
// The forms differ only in the value block Val and in W_out:
//   factored  Val = C W_V (h_kv · d_h columns; head i reads its group's), W_out = W_O
//   summed    Val = C [W_M_1 | … | W_M_h] (h · d columns), no W_out, b_out = b_eff
//   lowrank   Val = C [P_1 | … | P_h] (R columns), W_out = [Q_1; …; Q_h], b_out = b_eff
// Thread-safety: FormWeights is immutable once built; share it as shared_ptr<const>.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/layer.h"
#include "server/core/status.h"
#include "server/core/tensor.h"

namespace attnserve {

// Each form's name, wire value, load option, size and materialisation: one row of kFormTable
// (server/core/form_table.h), which the rest of the server reads.
enum class Form { kFactored = 0, kSummed = 1, kLowRank = 2 };
inline constexpr Form kAllForms[] = {Form::kFactored, Form::kSummed, Form::kLowRank};

// "factored", "summed", "lowrank": the label metrics and the CLI use (its table row's name).
std::string_view FormName(Form form);
std::optional<Form> ParseForm(std::string_view name);

// How a form combines its heads: the one choice that splits the attention skeleton.
//   kConcatThenProject: each head's mix A_i V_i lands in its columns of O, and one GEMM with
//     w_out projects them all (factored: W_O; lowrank: the stacked Q_i).
//   kSumOfMixes: the heads' A_i M_i are summed by one GEMM over A_cat = [A_1 | … | A_h] and the
//     stacked M_i, with no output projection (summed).
enum class HeadCombine { kConcatThenProject, kSumOfMixes };

// The form's table row says (a form without a row does not build: form_table.cc).
HeadCombine HeadCombineOf(Form form);

struct FormWeights {
  Form form = Form::kFactored;
  LayerConfig config;
  // [d_model, in_cols], in_cols = q_cols + k_cols + value_cols, columns [W_Q | W_K | value].
  // On a cache line (AlignedFloats), as is w_out.
  AlignedFloats w_in;
  // Bias of W_in's first b_in.size() columns: [q_cols + k_cols] plus, for the factored form,
  // the value bias; the summed and low-rank forms fold the value bias into b_out instead.
  // Empty when the layer has no bias.
  std::vector<float> b_in;
  int64_t q_cols = 0, k_cols = 0, value_cols = 0;
  // Per query head i: the columns [value_offset[i], + value_width[i]) of the value block that
  // A_i mixes, and (factored, lowrank) where O_i lands in O: columns [mix_offset[i], + width).
  std::vector<int64_t> value_offset, value_width, mix_offset;
  // [out_rows, d_model]: W_O (factored, out_rows = h·d_h) or the stacked Q_i (lowrank, = R);
  // empty for the summed form, whose head sum needs no output projection.
  AlignedFloats w_out;
  int64_t out_rows = 0;
  std::vector<float> b_out;  // [d_model]: b_O or b_eff; empty when the layer has no bias

  int64_t in_cols() const { return q_cols + k_cols + value_cols; }
  HeadCombine head_combine() const { return HeadCombineOf(form); }
  bool concat_then_project() const { return head_combine() == HeadCombine::kConcatThenProject; }
  int64_t Parameters() const;
  int64_t Bytes() const { return Parameters() * static_cast<int64_t>(sizeof(float)); }
};

// The form's output projection agrees with how it combines its heads: w_out holds
// out_rows x d_model floats (out_rows > 0) for kConcatThenProject, nothing for kSumOfMixes. The
// backends check it at Upload; the error names w_out, the form, expected and got.
Status CheckHeadCombine(const FormWeights& f);

// The standard form: W_in = [W_Q | W_K | W_V], W_out = W_O.
FormWeights MaterializeFactored(const LayerWeights& weights);

// The layer's weights back from its factored form, exactly (the factored form copies them
// unchanged): what a form built after load from the held layer starts from (the low-rank form
// calibrated on live traffic, server/store/layer_store.h), since the store frees the source.
LayerWeights LayerWeightsOfFactored(const FormWeights& factored);
// The summed-head form: W_M_i = W_V_g(i) · W_O_i (computed in float64, rounded once) and
// b_eff = b_O + Σ_i b_V_g(i) W_O_i — the value bias folds into the output bias because every
// row of A_i sums to 1.
FormWeights MaterializeSummed(const LayerWeights& weights);

// b_eff = b_O + Σ_i b_V_g(i) W_O_i in float64 (empty when the layer has no bias).
std::vector<float> FoldedOutputBias(const LayerWeights& weights);

// A form with only W_Q, W_K and their biases filled (value_cols = 0): the start of forms whose
// value block is built elsewhere (the low-rank form, server/core/spectrum.h).
FormWeights MaterializeQueryKeyOnly(Form form, const LayerWeights& weights);

// The shape of one sequence, for cost counts.
struct SequenceShape {
  int64_t n = 0;  // queries
  int64_t m = 0;  // context rows (= n for self-attention)
  int64_t keys = -1;  // keys the scores and mix use (key_length); -1: all m
};

// The summed form's two association orders for one sequence (docs/architecture.md, §1):
//   project first: M = C [W_M_1 | … | W_M_h], Y = Σ_i A_i M_i   2·m·d·h·d + 2·n·L·h·d
//   mix first:     Y = Σ_i (A_i C) W_M_i                        2·n·L·d·h + 2·n·h·d·d
// They differ in the projection term only, m against n: mixing first wins by m/n when a
// sequence has fewer queries than keys (cross-attention to a long context, a few new tokens
// over a long prefix), and costs the same when n = m. Mixing first is also the summed form's
// tiled order (docs/architecture.md, "Long sequences"): each head's mix A_i C is an attention
// with the context as its values, so it runs tile by tile with an online softmax in memory
// linear in n, where projecting first holds the whole A_cat [n, L·h]. True when a forward whose
// `order` allows it (`mix_first_allowed`) runs this sequence of `form` mixing first: the summed
// form, no bias on the value block (the summed form folds it into b_eff; a bias per value row
// would not commute with the mix), and either fewer queries than keys or an A_cat larger than
// `order.max_a_cat_bytes`. The one rule for the CPU backend, its FLOPs and its memory formula.
struct SummedOrder {
  bool mix_first_allowed = false;       // false: every summed sequence projects first
  int64_t max_a_cat_bytes = INT64_MAX;  // a sequence whose A_cat would pass this mixes first
};
bool SummedMixesFirst(const FormWeights& form, const SequenceShape& s, const SummedOrder& order);

// The CPU backend's attention tiles (docs/architecture.md, "Long sequences"): a task holds the
// scores of at most kQueryTile query rows — of all the heads it stacks together — against
// kKeyTile keys at a time, with a running max and sum per row (the online softmax), so no
// n × L matrix exists. 256 × 512 floats (512 KiB) stay in a core's L2 (1–2 MiB on current
// server cores) between the two GEMMs; 128 rows read each K and V tile twice as often and
// measured up to 1.2× slower at d_head 64, 512 rows no faster (docs/journal/benchmarks-journal.md).
inline constexpr int64_t kQueryTile = 256;
inline constexpr int64_t kKeyTile = 512;

// How many query heads one attention task stacks into one GEMM: the heads of a group share their
// keys and their values (factored; summed mixing first, whose values are the context), so they
// share the K and V tile; a low-rank head mixes value columns of its own.
int64_t StackedHeads(const FormWeights& form);

// The most query rows one task of the summed form's project-first score loop takes: it holds a
// block of rows × L scores (L stays short there: a long sequence mixes first).
inline constexpr int64_t kSummedBlockRows = 64;

// The query rows of one part of a summed sequence that mixes first: the part's mixes
// [rows, h·d] fit in `max_score_scratch_bytes` (at least 1 row), so a long sequence runs in
// parts and its working memory stays bounded.
int64_t SummedRowsPerPart(const FormWeights& form, int64_t max_score_scratch_bytes);

// The value groups of a batch (docs/architecture.md, "The attention skeleton"): `rows[r]` is
// sequence r's value rows, or negative for a sequence that has none (the summed form mixing
// first, which a group passes over). The sequences are cut, in order, into groups
// [first, last) whose value rows stay within `max_rows` together (a sequence with more is a
// group alone). The value block holds one group at a time: the plan's groups
// (backend/attention/plan.h) and the memory formula below both come from here.
std::vector<std::pair<size_t, size_t>> ValueGroups(std::span<const int64_t> rows, int64_t max_rows);

// FLOPs (multiply and add counted as 2) that a forward of these sequences does in this form:
// the projections, the scores, the mix and the output projection. Masked scores are counted
// as computed where the backend computes them (it skips keys beyond key_length only). With
// a summed sequence that SummedMixesFirst under `order` is counted in that order (what the CPU
// backend runs; the CUDA backend, with the default order, projects first).
double ForwardFlops(const FormWeights& form, std::span<const SequenceShape> batch, const SummedOrder& order = {});

// Bytes of host scratch the CPU backend allocates for one Forward of `batch` in this form
// (server/backend/cpu/cpu_ops.cc, whose allocations this follows line by line): the stacked
// inputs, Q and K, the value block (m · h · d_model floats in the summed form, for the largest
// group of sequences that project first, under `max_value_group_bytes`: ValueGroups), the heads' outputs and the stacked output (factored, low rank), a score
// tile per thread (kQueryTile × kKeyTile, with its stacked queries and running output; a summed
// sequence that projects first holds a block of rows × L instead), and the summed form's chunk
// of A_cat or mixes (at most `max_score_scratch_bytes`, or one sequence's n · L · h A_cat when
// mixing first is not allowed), and the GEMMs' packing blocks. Linear in the sequence lengths
// wherever mixing first is allowed. `self_attention` says whether the context is the input.
// The memory budget admits requests by this figure (docs/reliability.md compares it with RSS).
int64_t ForwardScratchBytes(const FormWeights& form, std::span<const SequenceShape> batch, bool self_attention,
                            int threads, int64_t max_score_scratch_bytes, const SummedOrder& order = {},
                            int64_t max_value_group_bytes = INT64_MAX);

}  // namespace attnserve
