// How a CUDA lane lays out one batch's workspace, decided on the host alone: the pieces and
// their sizes, where each lies (aligned, with its guard zone), how many query rows a block of
// attention takes under the score bound, the smaller bound that fits the room left, and which
// short sequences share their batched calls. Pure arithmetic over the batch's shapes: no CUDA
// header, so it is unit-tested without a device or the emulation (cuda_workspace_plan_test).
// docs/architecture.md, "The CUDA backend", says what each piece holds.
// Thread-safety: pure functions of their arguments.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "server/backend/attention/device_ops.h"
#include "server/backend/attention/plan.h"
#include "server/backend/cuda/fused_bounds.h"
#include "server/core/forms.h"
#include "server/core/sequence.h"
#include "server/core/status.h"

namespace attnserve::cuda {

// The workspace of one batch: its pieces, in floats, each starting 256-byte aligned. With 16-bit
// weights (Math kBf16, kFp16) two more hold the GEMM inputs in 16 bits, two to a float: the
// staged inputs and contexts converted once, and the other products' inputs (the heads'
// outputs before W_out, a mix-first part's mixes before W_M_i) converted before each.
inline constexpr int kPieces = 11;
enum Piece {
  kInputs,
  kQK,
  kValues,
  kScores,
  kACat,
  kHeadOutputs,
  kOutput,
  kMixes,
  kPointers,
  kHalfInputs,
  kHalfOperands
};
// "heads' outputs": the piece a guard zone message names.
const char* PieceName(int piece);

inline constexpr int64_t kAlignFloats = 64;  // 256 bytes
inline int64_t Aligned(int64_t floats) { return (floats + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }
// With CudaBackendOptions::guard_zones, each piece is followed by at least this many floats of
// a known pattern, checked when the batch ends.
inline constexpr int64_t kGuardFloats = 64;
inline constexpr int64_t kFloatsPerPointer = sizeof(void*) / sizeof(float);

struct WorkspacePlan {
  int64_t score_bytes = 0;  // the bound its blocks were cut to
  int64_t sizes[kPieces] = {};
  int64_t total = 0;  // floats, alignment and guards included
  int64_t bytes() const { return total * static_cast<int64_t>(sizeof(float)); }
};

// Query rows per block of `seq`: as many as keep the block's scores, and the summed form's
// A_cat block beside them, within `score_bytes`; at least one, at most n.
int64_t BlockRows(const FormWeights& f, const Sequence& seq, int64_t score_bytes);

// How the fused kernel runs a form's attention jobs of one kind: head i reads value columns
// [(i / value_group)·value_stride, +width) — its kv head's (the factored form), its own (the
// low-rank form at one rank) or all the same (value_stride 0: the context the summed form
// mixes first) — and writes out columns [i·width, +width). width 0: it does not run them (the
// low-rank form's ragged ranks, d_head or a width past the bounds: the summed form mixing first
// at d_model > 128).
struct FusedShape {
  int64_t width = 0, value_stride = 0, value_group = 1;
};
FusedShape FusedShapeOf(const FormWeights& f, AttentionValues values);

// Whether the batch still needs the score pieces when the lane fuses what it can (`fused`):
// the summed form projecting first (its A_cat is a block of scores) and any job FusedShapeOf
// refuses do.
bool ScoresNeeded(const FormWeights& f, const BatchPlan& plan, bool fused);

// The workspace `batch` needs with its blocks cut to `score_bytes` (0: one query row a block),
// each piece followed by `guard_floats` (0 or kGuardFloats). Inputs and (when staged) contexts
// share the first piece, in that order; contexts are staged only when some differ from the
// inputs. With `fused` (the lane's fused attention), the score pieces are empty where
// ScoresNeeded says the batch needs none. With `half_inputs` (16-bit weights), the two 16-bit
// pieces; without, they are empty.
WorkspacePlan PlanWorkspace(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                            int64_t score_bytes, int64_t guard_floats, bool fused = false, bool half_inputs = false);

// Where each piece starts in the workspace (floats from its start), and its guard zone: the
// piece's alignment padding and the guard after it, [start + size, next piece's start).
struct PieceLayout {
  std::array<int64_t, kPieces> offset{};
  std::array<int64_t, kPieces> guard_offset{}, guard_floats{};
};
PieceLayout LayOut(const WorkspacePlan& plan, int64_t guard_floats);

// The score bound whose plan fits `room_bytes`, given the plan of one query row a block
// (`smallest`, PlanWorkspace's at 0): the room less the pieces linear in the tokens, for the two
// score pieces (and their alignment). May be negative when not even `smallest` fits.
int64_t ScoreBytesForRoom(const WorkspacePlan& smallest, int64_t room_bytes);

// Calls `block(row0, rows, keys)` for the blocks of query rows of `range` (rows of its
// sequence) under the score bound; `keys` are those the block sees (causal: no row of the block
// sees past its last row's keys, so those are not computed).
template <class Block>
Status ForEachBlock(const FormWeights& f, const AttentionRange& range, int64_t score_bytes, Block block) {
  const Sequence& s = *range.sequence;
  const int64_t step = BlockRows(f, s, score_bytes);
  for (int64_t row0 = range.row0; row0 < range.row0 + range.rows; row0 += step) {
    const int64_t rows = std::min(step, range.row0 + range.rows - row0);
    const int64_t keys = s.causal ? std::min(s.visible_keys(), row0 + rows) : s.visible_keys();
    ATTNSERVE_RETURN_IF_ERROR(block(row0, rows, keys));
  }
  return OkStatus();
}

// Ranges that one batched call of each kind serves: each a single block of query rows, all of
// `rows` rows seeing `keys` keys, with the same leading dimensions, their scores side by side
// within the score piece, at most `max_group` of them (the softmax launch's table). A batch of
// short sequences then costs one score GEMM, one softmax and one mix GEMM per shape, not per
// sequence, whatever order the shapes arrive in. A group of one (a range of several blocks among
// them) runs the per-sequence path.
struct RangeGroup {
  std::vector<const AttentionRange*> ranges;
  int64_t rows = 0, keys = 0;
};
// `score_bytes` is the bound the blocks were cut to, `score_capacity` the score piece's floats.
std::vector<RangeGroup> GroupRanges(const FormWeights& f, std::span<const AttentionRange> ranges, int64_t score_bytes,
                                    int64_t score_capacity, int max_group);

}  // namespace attnserve::cuda
