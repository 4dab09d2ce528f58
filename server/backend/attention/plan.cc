#include "server/backend/attention/plan.h"

#include <algorithm>

namespace attnserve {

namespace {

// The summed form's mix-first parts: SummedRowsPerPart rows each, so that no part's mixes pass
// the bound; then grouped into chunks whose mixes stay under it together.
void PlanMixParts(const FormWeights& f, std::span<const Sequence> batch, const PlanPolicy& policy, BatchPlan& plan) {
  const int64_t part_rows = SummedRowsPerPart(f, policy.max_mix_bytes);
  for (size_t r = 0; r < batch.size(); ++r) {
    if (!plan.mixes_first[r]) continue;
    const int64_t n = batch[r].n();
    for (int64_t row0 = 0; row0 < n; row0 += part_rows) {
      plan.mix_parts.push_back({.sequence = r, .row0 = row0, .rows = std::min(part_rows, n - row0)});
    }
  }
  std::vector<int64_t> floats;
  for (const MixPart& part : plan.mix_parts) floats.push_back(part.rows * f.value_cols);
  const Chunks chunks = ChunksUnder(floats, policy.max_mix_bytes / static_cast<int64_t>(sizeof(float)));
  for (size_t i = 0; i < plan.mix_parts.size(); ++i) plan.mix_parts[i].offset = chunks.offset[i];
  for (const auto& [first, last] : chunks.bounds) plan.mix_chunks.push_back({first, last});
  plan.mix_floats = chunks.largest;
}

// The project-first sequences in value groups under the policy's bound (ValueGroups).
void PlanValueGroups(const FormWeights& f, std::span<const Sequence> batch, const PlanPolicy& policy, BatchPlan& plan) {
  const int64_t row_bytes = std::max<int64_t>(1, f.value_cols * static_cast<int64_t>(sizeof(float)));
  std::vector<int64_t> rows;
  for (size_t r = 0; r < batch.size(); ++r) rows.push_back(plan.mixes_first[r] ? -1 : batch[r].m());
  plan.val_row.assign(batch.size(), 0);
  for (const auto& [first, last] : ValueGroups(rows, std::max<int64_t>(1, policy.max_value_group_bytes / row_bytes))) {
    ValueGroup group{.first = first, .last = last, .rows = 0};
    for (size_t r = first; r < last; ++r) {
      if (rows[r] < 0) continue;
      plan.val_row[r] = group.rows;
      group.rows += rows[r];
    }
    plan.val_rows = std::max(plan.val_rows, group.rows);
    plan.value_groups.push_back(group);
  }
}

}  // namespace

Chunks ChunksUnder(std::span<const int64_t> sizes, int64_t cap) {
  Chunks chunks;
  chunks.offset.resize(sizes.size());
  size_t first = 0;
  while (first < sizes.size()) {
    int64_t sum = 0;
    size_t last = first;
    do {
      chunks.offset[last] = sum;
      sum += sizes[last++];
    } while (last < sizes.size() && sum + sizes[last] <= cap);
    chunks.bounds.emplace_back(first, last);
    chunks.largest = std::max(chunks.largest, sum);
    first = last;
  }
  return chunks;
}

BatchPlan PlanBatch(const FormWeights& f, std::span<const Sequence> batch, const PlanPolicy& policy) {
  BatchPlan plan;
  plan.combine = f.head_combine();
  plan.rows = StackedRows(batch);
  const int64_t tx = plan.rows.queries, tc = plan.rows.contexts;
  for (const Sequence& s : batch) {
    plan.mixes_first.push_back(
        SummedMixesFirst(f, {.n = s.n(), .m = s.m(), .keys = s.visible_keys()}, policy.summed_order));
  }
  // The concat-then-project forms mix every head's own value columns: one group of all.
  PlanPolicy grouping = policy;
  if (plan.combine == HeadCombine::kConcatThenProject) grouping.max_value_group_bytes = INT64_MAX;
  PlanValueGroups(f, batch, grouping, plan);
  PlanMixParts(f, batch, policy, plan);
  plan.qkv_one_block = policy.qkv_one_block && plan.rows.all_self && plan.combine == HeadCombine::kConcatThenProject &&
                       (f.b_in.empty() || static_cast<int64_t>(f.b_in.size()) == f.in_cols());
  plan.qk_floats = plan.rows.all_self ? tx * (f.q_cols + f.k_cols) : tx * f.q_cols + tc * f.k_cols;
  plan.value_floats = plan.val_rows * f.value_cols;
  plan.o_floats = plan.combine == HeadCombine::kConcatThenProject ? tx * f.out_rows : 0;
  return plan;
}

}  // namespace attnserve
