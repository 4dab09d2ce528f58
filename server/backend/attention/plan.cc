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
  const int64_t cap = policy.max_mix_bytes / static_cast<int64_t>(sizeof(float));
  size_t first = 0;
  while (first < plan.mix_parts.size()) {
    int64_t floats = 0;
    size_t last = first;
    do {
      plan.mix_parts[last].offset = floats;
      floats += plan.mix_parts[last].rows * f.value_cols;
      ++last;
    } while (last < plan.mix_parts.size() && floats + plan.mix_parts[last].rows * f.value_cols <= cap);
    plan.mix_chunks.push_back({first, last});
    plan.mix_floats = std::max(plan.mix_floats, floats);
    first = last;
  }
}

}  // namespace

BatchPlan PlanBatch(const FormWeights& f, std::span<const Sequence> batch, const PlanPolicy& policy) {
  BatchPlan plan;
  plan.combine = f.head_combine();
  plan.rows = StackedRows(batch);
  const int64_t tx = plan.rows.queries, tc = plan.rows.contexts;
  for (const Sequence& s : batch) {
    const bool mix_first = SummedMixesFirst(f, {.n = s.n(), .m = s.m(), .keys = s.visible_keys()}, policy.summed_order);
    plan.mixes_first.push_back(mix_first);
    plan.val_row.push_back(plan.val_rows);
    if (!mix_first) plan.val_rows += s.m();
  }
  PlanMixParts(f, batch, policy, plan);
  plan.qk_floats = plan.rows.all_self ? tx * (f.q_cols + f.k_cols) : tx * f.q_cols + tc * f.k_cols;
  plan.value_floats = plan.val_rows * f.value_cols;
  plan.o_floats = plan.combine == HeadCombine::kConcatThenProject ? tx * f.out_rows : 0;
  return plan;
}

}  // namespace attnserve
