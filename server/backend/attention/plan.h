// The plan of one forward, written once for every device: where each sequence of the batch sits
// among the stacked rows, how the form combines its heads, which sequences the value block
// holds, the summed form's association order per sequence and its mix-first parts in chunks, and
// the size of every buffer the skeleton (skeleton.h) asks a device for.
// Thread-safety: a value computed from its arguments; const access from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "server/core/forms.h"
#include "server/core/sequence.h"

namespace attnserve {

// What a device lets the plan choose: the summed form's association order (SummedMixesFirst),
// the bound on the mixes a chunk of mix-first parts holds at once, and the bound on the value
// rows a group of project-first sequences holds at once.
struct PlanPolicy {
  SummedOrder summed_order;                    // {}: every summed sequence projects first
  int64_t max_mix_bytes = int64_t{256} << 20;  // one chunk's mixes [rows, h·d], at least a row
  // The summed form's value rows (h·d columns each: 64 MiB for gpt2-medium's 4 × 256 tokens)
  // are projected and read back by the head sum one group at a time, at most this many bytes
  // or one sequence, so that the value block does not grow with the batch. The default is one
  // group for the batch (the CUDA lane, whose workspace is sized per batch).
  int64_t max_value_group_bytes = INT64_MAX;
  // Whether the device can hold Q, K and the value block as one [T, in_cols] matrix, so that a
  // self-attention batch of a concat-then-project form projects all three in one GEMM
  // (BatchPlan::qkv_one_block).
  bool qkv_one_block = false;
};

// Query rows [row0, row0 + rows) of a summed sequence that mixes first, and where its mixes
// [rows, h·d] start in its chunk's mixes buffer (in floats).
struct MixPart {
  size_t sequence = 0;
  int64_t row0 = 0, rows = 0;
  int64_t offset = 0;
};

// Parts [first, last) of BatchPlan::mix_parts, whose mixes are held at once.
struct MixChunk {
  size_t first = 0, last = 0;
};

// Sequences [first, last) of the batch whose value rows (rows of them in all) the value block
// holds at once, from its row 0 (ValueGroups): the concat-then-project forms' one group of the
// whole batch, or a group of the summed form's project-first sequences under
// PlanPolicy::max_value_group_bytes (a sequence among them that mixes first has no value rows).
struct ValueGroup {
  size_t first = 0, last = 0;
  int64_t rows = 0;
};

struct BatchPlan {
  HeadCombine combine = HeadCombine::kConcatThenProject;
  BatchRows rows;  // each sequence's first query row (X, Q, O, Y) and context row (C, K)
  // Summed sequences that mix their keys first need no value rows of their own. The others are
  // in value groups; val_row is each one's first row in the value block while its group is
  // there (0 for a sequence that mixes first), and val_rows the largest group's rows.
  std::vector<bool> mixes_first;
  std::vector<ValueGroup> value_groups;
  std::vector<int64_t> val_row;
  int64_t val_rows = 0;
  std::vector<MixPart> mix_parts;
  std::vector<MixChunk> mix_chunks;

  // The buffers the skeleton computes into, in floats: Q and K, the value block, the heads'
  // outputs O (concat-then-project forms), the largest chunk's mixes. (Where the inputs and the
  // outputs live is the device's choice: DeviceOps::Prepare.)
  int64_t qk_floats = 0, value_floats = 0, o_floats = 0, mix_floats = 0;

  // Q, K and the value block as one [Tx, in_cols] matrix (columns q, k, then the values), all
  // three projected by one GEMM: where the device allows it (PlanPolicy::qkv_one_block), every
  // sequence is self-attention, the form concatenates then projects (one value group of every
  // row, in the query rows' order), and b_in covers all of W_in's columns or none (a bias of Q
  // and K alone would need two GEMMs). The input is then read and packed once, not twice: one
  // thread's share of gpt2-medium's Q|K|V, [1024, 1024] · [1024, 1536], measured 1.03–1.07×
  // faster in one GEMM than in two (docs/journal/benchmarks-journal.md, "Attention's own kernel").
  bool qkv_one_block = false;

  // One group holds every sequence's value rows (the concat-then-project forms always).
  bool value_block_is_whole() const { return value_groups.size() == 1 && val_rows == rows.contexts; }
};

// Items of these sizes grouped in order into chunks [first, last) whose sum stays within `cap`
// (an item larger than the cap makes a chunk alone), with where each item starts in its chunk
// and the largest chunk's sum: the mix-first parts here, the CPU's A_cat chunks too.
struct Chunks {
  std::vector<std::pair<size_t, size_t>> bounds;
  std::vector<int64_t> offset;
  int64_t largest = 0;
};
Chunks ChunksUnder(std::span<const int64_t> sizes, int64_t cap);

BatchPlan PlanBatch(const FormWeights& form, std::span<const Sequence> batch, const PlanPolicy& policy);

}  // namespace attnserve
