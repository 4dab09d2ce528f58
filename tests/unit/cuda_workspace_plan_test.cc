// The CUDA lane's workspace plan (server/backend/cuda/workspace_plan.h), pure host arithmetic,
// over random forms and batches without a device or the emulation: the pieces lie aligned and
// apart with their guards, each holds what the batch puts there, blocks of query rows keep to the
// score bound, a bound shrunk to the room fits it, and groups of short sequences keep to the
// score piece and the launch's table while sharing every call they can.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "server/backend/attention/plan.h"
#include "server/backend/cuda/workspace_plan.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/spectrum.h"
#include "tests/unit/test_support.h"

namespace attnserve::cuda {
namespace {

using testing::OwnedSequence;
using testing::RandomSequence;
using testing::TestSeed;

int64_t Draw(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// A random layer and one of its forms (factored: one score piece; summed: scores and A_cat).
FormWeights RandomForm(std::mt19937_64& rng, bool summed) {
  LayerConfig c;
  c.kv_heads = Draw(rng, 1, 3);
  c.heads = c.kv_heads * Draw(rng, 1, 3);
  c.d_head = 2 * Draw(rng, 1, 6);
  c.d_model = c.heads * Draw(rng, 1, 4);
  const LayerWeights w = RandomLayerWeights(c, rng());
  return summed ? MaterializeSummed(w) : MaterializeFactored(w);
}

std::vector<OwnedSequence> RandomBatch(std::mt19937_64& rng, int64_t d_model, int64_t max_n) {
  std::vector<OwnedSequence> owned;
  const bool cross = Draw(rng, 0, 2) == 0;
  for (int64_t i = Draw(rng, 1, 8); i > 0; --i) {
    const int64_t n = Draw(rng, 1, max_n), m = cross ? Draw(rng, 1, max_n) : n;
    const bool causal = !cross && Draw(rng, 0, 1) == 1;
    const int64_t key_length = !causal && Draw(rng, 0, 2) == 0 ? Draw(rng, 1, m) : -1;
    owned.push_back(RandomSequence(rng, d_model, n, m, cross, causal, key_length));
  }
  return owned;
}

std::vector<Sequence> Views(std::vector<OwnedSequence>& owned) {
  std::vector<Sequence> views;
  for (OwnedSequence& s : owned) views.push_back(s.View());
  return views;
}

int64_t Copies(const FormWeights& f) { return f.concat_then_project() ? 1 : 2; }

TEST(CudaWorkspacePlanTest, PiecesAreAlignedApartAndHoldWhatTheBatchPutsThere) {
  std::mt19937_64 rng(TestSeed());
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const FormWeights f = RandomForm(rng, trial % 2 == 1);
    auto owned = RandomBatch(rng, f.config.d_model, 40);
    const std::vector<Sequence> batch = Views(owned);
    const BatchPlan plan = PlanBatch(f, batch, {});
    const int64_t guard = trial % 3 == 0 ? 0 : kGuardFloats;
    const int64_t score_bytes = Draw(rng, 0, 1 << 16);
    const WorkspacePlan w = PlanWorkspace(f, plan, batch, score_bytes, guard);
    const PieceLayout layout = LayOut(w, guard);

    // Aligned, in order, apart: piece p, then its guard, then piece p + 1; the last ends the total.
    int64_t end = 0;
    for (int p = 0; p < kPieces; ++p) {
      SCOPED_TRACE(PieceName(p));
      EXPECT_EQ(layout.offset[p] % 64, 0) << "a piece starts 256-byte aligned";
      EXPECT_GE(layout.offset[p], end) << "a piece starts after the one before and its guard";
      EXPECT_EQ(layout.guard_offset[p], layout.offset[p] + w.sizes[p]);
      EXPECT_GE(layout.guard_floats[p], guard) << "each guard zone has at least the guard's floats";
      end = layout.guard_offset[p] + layout.guard_floats[p];
    }
    EXPECT_EQ(end, w.total) << "the pieces and guards fill exactly the total";

    // What the batch puts in each piece, worked out from the shapes.
    const LayerConfig& c = f.config;
    int64_t tx = 0, tc = 0;
    bool all_self = true;
    for (const Sequence& s : batch) {
      tx += s.n();
      tc += s.m();
      all_self = all_self && s.self_attention();
    }
    EXPECT_GE(w.sizes[kInputs], (tx + (all_self ? 0 : tc)) * c.d_model);
    EXPECT_GE(w.sizes[kOutput], tx * c.d_model);
    EXPECT_GE(w.sizes[kQK], plan.qk_floats);
    EXPECT_GE(w.sizes[kValues], plan.value_floats);
    EXPECT_GE(w.sizes[kHeadOutputs], plan.o_floats);
    EXPECT_GE(w.sizes[kMixes], plan.mix_floats);
    const int64_t ranges = static_cast<int64_t>(batch.size() + plan.mix_parts.size());
    EXPECT_GE(w.sizes[kPointers], 3 * (2 * c.heads + 1) * ranges * static_cast<int64_t>(sizeof(void*) / sizeof(float)));
    for (const Sequence& s : batch) {
      const int64_t block_scores = c.heads * BlockRows(f, s, score_bytes) * s.visible_keys();
      EXPECT_GE(w.sizes[kScores], block_scores) << "the score piece holds any one block";
      if (!f.concat_then_project()) {
        EXPECT_GE(w.sizes[kACat], block_scores) << "so does A_cat's";
      }
    }
    if (f.concat_then_project()) {
      EXPECT_EQ(w.sizes[kACat], 0);
    }
  }
}

TEST(CudaWorkspacePlanTest, BlocksCoverTheRangeAndKeepToTheScoreBound) {
  std::mt19937_64 rng(TestSeed());
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const FormWeights f = RandomForm(rng, trial % 2 == 1);
    OwnedSequence owned = RandomBatch(rng, f.config.d_model, 300)[0];
    const Sequence s = owned.View();
    const int64_t score_bytes = Draw(rng, 0, 1 << 18);
    const int64_t row0 = Draw(rng, 0, s.n() - 1), rows = Draw(rng, 1, s.n() - row0);
    AttentionRange range;
    range.sequence = &s;
    range.row0 = row0;
    range.rows = rows;
    const int64_t row_bytes = Copies(f) * f.config.heads * s.visible_keys() * static_cast<int64_t>(sizeof(float));
    int64_t next = row0;
    ASSERT_TRUE(ForEachBlock(f, range, score_bytes, [&](int64_t first, int64_t count, int64_t keys) {
                  EXPECT_EQ(first, next) << "blocks follow each other";
                  EXPECT_GE(count, 1);
                  EXPECT_LE(count * row_bytes, std::max(score_bytes, row_bytes)) << "a block keeps to the bound";
                  const int64_t want_keys = s.causal ? std::min(s.visible_keys(), first + count) : s.visible_keys();
                  EXPECT_EQ(keys, want_keys) << "a causal block computes only the keys its last row sees";
                  next = first + count;
                  return OkStatus();
                }).ok());
    EXPECT_EQ(next, row0 + rows) << "the blocks cover the range";
  }
}

TEST(CudaWorkspacePlanTest, ABoundShrunkToTheRoomFitsIt) {
  std::mt19937_64 rng(TestSeed());
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const FormWeights f = RandomForm(rng, trial % 2 == 1);
    auto owned = RandomBatch(rng, f.config.d_model, 200);
    const std::vector<Sequence> batch = Views(owned);
    const BatchPlan plan = PlanBatch(f, batch, {});
    const int64_t guard = trial % 2 == 0 ? 0 : kGuardFloats;
    auto plan_for = [&](int64_t score_bytes) { return PlanWorkspace(f, plan, batch, score_bytes, guard); };
    const WorkspacePlan smallest = plan_for(0), whole = plan_for(int64_t{1} << 40);
    int64_t last_bound = -1;
    for (int64_t room = smallest.bytes(); room <= whole.bytes() + 4096; room += Draw(rng, 1, 4096)) {
      const int64_t bound = std::max<int64_t>(0, ScoreBytesForRoom(smallest, room));
      const WorkspacePlan fitted = plan_for(bound);
      ASSERT_LE(fitted.bytes(), room) << "room " << room << ", bound " << bound;
      EXPECT_GE(bound, last_bound) << "more room never cuts smaller blocks";
      last_bound = bound;
    }
    // With the room of the whole plan and the score pieces' alignment, every sequence runs in
    // one block (the shrunk bound keeps that alignment in hand, so it is not a bound too small).
    const int64_t bound = ScoreBytesForRoom(smallest, whole.bytes() + 2 * kAlignFloats * sizeof(float));
    for (const Sequence& s : batch) EXPECT_EQ(BlockRows(f, s, bound), s.n());
  }
}

TEST(CudaWorkspacePlanTest, GroupsKeepToTheScorePieceAndShareEveryCallTheyCan) {
  std::mt19937_64 rng(TestSeed());
  std::vector<float> memory(64);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const FormWeights f = RandomForm(rng, trial % 2 == 1);
    const int64_t heads = f.config.heads;
    // Sequences of a few shapes in a shuffled order, some longer than one block; two layouts.
    std::vector<OwnedSequence> owned;
    const int64_t shapes = Draw(rng, 1, 3);
    for (int64_t i = Draw(rng, 1, 60); i > 0; --i) {
      const int64_t shape = Draw(rng, 0, shapes - 1), n = 2 + shape * 3 + (Draw(rng, 0, 9) == 0 ? 40 : 0);
      owned.push_back(RandomSequence(rng, f.config.d_model, n, n, false, false, -1));
    }
    const std::vector<Sequence> batch = Views(owned);
    const int64_t score_bytes = Draw(rng, 1, 4) * Copies(f) * heads * 11 * 11 * static_cast<int64_t>(sizeof(float));
    const int64_t capacity = Draw(rng, 1, 12) * heads * 4, max_group = Draw(rng, 1, 48);
    std::vector<AttentionRange> ranges;
    for (const Sequence& s : batch) {
      const int64_t ld = Draw(rng, 0, 3) == 0 ? 8 : 4;
      const ConstMatrixView v(memory.data(), 1, 4, ld);
      ranges.push_back({.sequence = &s,
                        .row0 = 0,
                        .rows = s.n(),
                        .q = v,
                        .k = v,
                        .values = v,
                        .out = MatrixView(memory.data(), 1, 4, ld)});
    }
    const std::vector<RangeGroup> groups = GroupRanges(f, ranges, score_bytes, capacity, static_cast<int>(max_group));

    std::vector<int> seen(ranges.size(), 0);
    for (const RangeGroup& g : groups) {
      for (size_t r = 0; r < g.ranges.size(); ++r) {
        ++seen[g.ranges[r] - ranges.data()];
        if (r > 0) {
          EXPECT_LT(g.ranges[r - 1], g.ranges[r]) << "a group keeps the arrival order";
        }
      }
      if (g.ranges.size() < 2) continue;
      EXPECT_LE(static_cast<int64_t>(g.ranges.size()), max_group) << "no more than the launch's table";
      EXPECT_LE(static_cast<int64_t>(g.ranges.size()) * heads * g.rows * g.keys, capacity)
          << "the group's scores fit the score piece side by side";
      for (const AttentionRange* r : g.ranges) {
        EXPECT_EQ(r->rows, g.rows);
        EXPECT_EQ(r->sequence->visible_keys(), g.keys);
        EXPECT_LE(r->rows, BlockRows(f, *r->sequence, score_bytes)) << "a grouped range is a single block";
        EXPECT_EQ(r->q.ld, g.ranges.front()->q.ld) << "one layout a group";
      }
    }
    for (int count : seen) EXPECT_EQ(count, 1) << "every range in exactly one group";

    // Every call shared that could be: ranges of one shape and layout that fit one block split
    // into as few groups as the piece and the table allow.
    for (size_t a = 0; a < ranges.size(); ++a) {
      const AttentionRange& r = ranges[a];
      if (r.rows > BlockRows(f, *r.sequence, score_bytes)) continue;
      int64_t alike = 0, groups_of_it = 0;
      for (const AttentionRange& o : ranges) alike += o.rows == r.rows && o.q.ld == r.q.ld;
      for (const RangeGroup& g : groups) groups_of_it += g.rows == r.rows && g.ranges.front()->q.ld == r.q.ld;
      const int64_t per_group = std::max<int64_t>(1, std::min(max_group, capacity / (heads * r.rows * r.rows)));
      EXPECT_EQ(groups_of_it, (alike + per_group - 1) / per_group) << "rows " << r.rows << ", ld " << r.q.ld;
    }
  }
}

// With the fused kernel (PlanWorkspace's `fused`), a batch whose attention it takes plans no
// score pieces and every other piece as before: the factored form always (at d_head ≤ 128), the
// summed form when every sequence mixes first (d_model ≤ 128 here). The summed form projecting
// first, the low-rank form at ragged ranks and heads past the kernel's bounds keep them.
TEST(CudaWorkspacePlanTest, TheFusedPathPlansNoScorePieces) {
  std::mt19937_64 rng(TestSeed());
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const bool summed = trial % 2 == 1;
    const FormWeights f = RandomForm(rng, summed);
    const LayerConfig& c = f.config;
    auto owned = RandomBatch(rng, c.d_model, 30);
    const std::vector<Sequence> batch = Views(owned);
    const bool mix_first = trial % 4 == 3;
    const BatchPlan plan = PlanBatch(f, batch, {.summed_order = {.mix_first_allowed = mix_first}});
    const int64_t score_bytes = Draw(rng, 0, 1 << 16);
    const WorkspacePlan gemm = PlanWorkspace(f, plan, batch, score_bytes, kGuardFloats);
    const WorkspacePlan fused = PlanWorkspace(f, plan, batch, score_bytes, kGuardFloats, /*fused=*/true);
    const FusedShape shape = FusedShapeOf(f, summed ? AttentionValues::kContext : AttentionValues::kValueBlock);
    EXPECT_EQ(shape.width, summed ? c.d_model : c.d_head);
    for (int64_t i = 0; i < c.heads; ++i) {  // the context's columns, or head i's kv head's
      EXPECT_EQ(i / shape.value_group * shape.value_stride, summed ? 0 : c.KvHeadOf(i) * c.d_head) << "head " << i;
    }
    const bool all_mix_first = std::all_of(plan.mixes_first.begin(), plan.mixes_first.end(), [](bool b) { return b; });
    const bool none = !summed || all_mix_first;
    EXPECT_EQ(fused.sizes[kScores], none ? 0 : gemm.sizes[kScores]);
    EXPECT_EQ(fused.sizes[kACat], none ? 0 : gemm.sizes[kACat]);
    if (none) {
      EXPECT_GT(gemm.sizes[kScores], 0);
    }
    for (int p = 0; p < kPieces; ++p) {
      if (p != kScores && p != kACat) {
        EXPECT_EQ(fused.sizes[p], gemm.sizes[p]) << PieceName(p);
      }
    }
  }
  // What the kernel does not take: the low-rank form's ragged ranks, a d_head past its bound.
  LayerConfig c{.d_model = 8, .heads = 4, .kv_heads = 2, .d_head = 2};
  const LayerWeights w = RandomLayerWeights(c, 5);
  auto ragged = MaterializeLowRank(w, {1, 2, 1, 2});
  ASSERT_TRUE(ragged.ok());
  EXPECT_EQ(FusedShapeOf(*ragged, AttentionValues::kValueBlock).width, 0);
  auto even = MaterializeLowRank(w, {2, 2, 2, 2});
  ASSERT_TRUE(even.ok());
  EXPECT_EQ(FusedShapeOf(*even, AttentionValues::kValueBlock).width, 2);
  c = {.d_model = 130, .heads = 1, .kv_heads = 1, .d_head = 130};
  EXPECT_EQ(FusedShapeOf(MaterializeFactored(RandomLayerWeights(c, 6)), AttentionValues::kValueBlock).width, 0);
  c = {.d_model = 256, .heads = 2, .kv_heads = 1, .d_head = 128};
  EXPECT_EQ(FusedShapeOf(MaterializeFactored(RandomLayerWeights(c, 6)), AttentionValues::kValueBlock).width, 128);
  EXPECT_EQ(FusedShapeOf(MaterializeSummed(RandomLayerWeights(c, 6)), AttentionValues::kContext).width, 0);
}

}  // namespace
}  // namespace attnserve::cuda
