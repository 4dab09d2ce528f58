#include "server/backend/cuda/workspace_plan.h"

namespace attnserve::cuda {

const char* PieceName(int piece) {
  static constexpr const char* kNames[kPieces] = {"inputs",         "Q and K",         "values",
                                                  "scores",         "A_cat",           "heads' outputs",
                                                  "output",         "mixes",           "pointer arrays",
                                                  "16-bit inputs",  "16-bit operands"};
  return kNames[piece];
}

int64_t BlockRows(const FormWeights& f, const Sequence& seq, int64_t score_bytes) {
  const int64_t copies = f.concat_then_project() ? 1 : 2;
  const int64_t row_bytes = copies * f.config.heads * seq.visible_keys() * static_cast<int64_t>(sizeof(float));
  return std::clamp<int64_t>(score_bytes / row_bytes, 1, seq.n());
}

FusedShape FusedShapeOf(const FormWeights& f, AttentionValues values) {
  const LayerConfig& c = f.config;
  const AttentionJob job{.form = &f, .values = values, .ranges = {}};
  const int64_t w = job.Width(0);
  if (c.d_head > kFusedMaxDHead || w <= 0 || w > kFusedMaxWidth) return {};
  for (const FusedShape shape : {FusedShape{w, w, c.group_size()}, FusedShape{w, w, 1}, FusedShape{w, 0, 1}}) {
    bool all = true;
    for (int64_t i = 0; i < c.heads && all; ++i) {
      all = job.Width(i) == w && job.ValueColumn(i) == i / shape.value_group * shape.value_stride &&
            job.OutColumn(i) == i * w;
    }
    if (all) return shape;
  }
  return {};
}

bool ScoresNeeded(const FormWeights& f, const BatchPlan& plan, bool fused) {
  if (!fused) return true;
  if (f.concat_then_project()) return FusedShapeOf(f, AttentionValues::kValueBlock).width == 0;
  const bool all_mix_first = std::all_of(plan.mixes_first.begin(), plan.mixes_first.end(), [](bool b) { return b; });
  return !all_mix_first || FusedShapeOf(f, AttentionValues::kContext).width == 0;
}

WorkspacePlan PlanWorkspace(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                            int64_t score_bytes, int64_t guard_floats, bool fused, bool half_inputs) {
  const LayerConfig& c = f.config;
  const int64_t d = c.d_model, tx = plan.rows.queries;
  const int64_t c_rows = plan.rows.all_self ? 0 : plan.rows.contexts;
  // The score piece holds the largest block, or more: the blocks of a group of short
  // sequences side by side (GroupRanges), up to all of the batch's within the bound.
  const int64_t copies = f.concat_then_project() ? 1 : 2;
  int64_t max_scores = 0, all_scores = 0;
  for (const Sequence& s : batch) {
    max_scores = std::max(max_scores, c.heads * BlockRows(f, s, score_bytes) * s.visible_keys());
    all_scores += c.heads * s.n() * s.visible_keys();
  }
  max_scores = std::max(max_scores, std::min<int64_t>(all_scores, score_bytes / (copies * sizeof(float))));
  if (!ScoresNeeded(f, plan, fused)) max_scores = 0;
  // The batched GEMMs' pointer arrays: three pointers an entry, at most 2·heads + 1 entries a
  // range (scores, mixes, the summed head sum), a range a sequence or a mix-first part.
  const int64_t pointer_slots = 3 * (2 * c.heads + 1) * static_cast<int64_t>(batch.size() + plan.mix_parts.size());
  // 16-bit values, two a float: the staged rows, and the largest other input of a product by
  // the weights (the heads' outputs, or a head's columns of a part's mixes).
  const auto halves = [&](int64_t values) { return half_inputs ? (values + 1) / 2 : 0; };
  WorkspacePlan w{score_bytes,
                  {(tx + c_rows) * d, plan.qk_floats, plan.value_floats, max_scores,
                   f.concat_then_project() ? 0 : max_scores, plan.o_floats, tx * d, plan.mix_floats,
                   pointer_slots * kFloatsPerPointer, halves((tx + c_rows) * d),
                   halves(std::max(plan.o_floats, plan.mix_floats))}};
  for (int64_t size : w.sizes) w.total += Aligned(size) + guard_floats;
  return w;
}

PieceLayout LayOut(const WorkspacePlan& plan, int64_t guard_floats) {
  PieceLayout layout;
  int64_t next = 0;
  for (int p = 0; p < kPieces; ++p) {
    layout.offset[p] = next;
    next += Aligned(plan.sizes[p]) + guard_floats;
    layout.guard_offset[p] = layout.offset[p] + plan.sizes[p];
    layout.guard_floats[p] = next - layout.guard_offset[p];
  }
  return layout;
}

int64_t ScoreBytesForRoom(const WorkspacePlan& smallest, int64_t room_bytes) {
  const int64_t linear = smallest.total - Aligned(smallest.sizes[kScores]) - Aligned(smallest.sizes[kACat]);
  return room_bytes - (linear + 2 * kAlignFloats) * static_cast<int64_t>(sizeof(float));
}

std::vector<RangeGroup> GroupRanges(const FormWeights& f, std::span<const AttentionRange> ranges, int64_t score_bytes,
                                    int64_t score_capacity, int max_group) {
  const int64_t heads = f.config.heads;
  auto same_layout = [](const AttentionRange& a, const AttentionRange& b) {
    return a.q.ld == b.q.ld && a.k.ld == b.k.ld && a.values.ld == b.values.ld && a.out.ld == b.out.ld;
  };
  std::vector<RangeGroup> groups;
  std::vector<size_t> open;  // groups that may still take a range
  for (const AttentionRange& range : ranges) {
    const Sequence& s = *range.sequence;
    if (range.rows > BlockRows(f, s, score_bytes)) {
      groups.push_back({{&range}, 0, 0});
      continue;
    }
    const int64_t keys = s.causal ? std::min(s.visible_keys(), range.row0 + range.rows) : s.visible_keys();
    const int64_t scores = heads * range.rows * keys;
    bool placed = false;
    for (size_t& g : open) {
      RangeGroup& group = groups[g];
      const int64_t count = static_cast<int64_t>(group.ranges.size());
      if (group.rows != range.rows || group.keys != keys || !same_layout(*group.ranges.front(), range)) continue;
      if (count == max_group || (count + 1) * scores > score_capacity) continue;
      group.ranges.push_back(&range);
      placed = true;
      break;
    }
    if (!placed) {
      open.push_back(groups.size());
      groups.push_back({{&range}, range.rows, keys});
    }
  }
  return groups;
}

}  // namespace attnserve::cuda
