#include "server/backend/attention/skeleton.h"

namespace attnserve {

namespace {

// x · W_in[:, col0 : col0 + count] (+ b_in over those columns, where the form has one) into y.
Status ProjectColumns(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, ConstMatrixView x, int64_t col0,
                      int64_t count, MatrixView y) {
  const bool has_bias = w.b_in != nullptr && static_cast<int64_t>(f.b_in.size()) >= col0 + count;
  return ops.GemmWeights(x, w.w_in.ColBlock(col0, count), has_bias ? w.b_in + col0 : nullptr, y, /*accumulate=*/false);
}

// Q and K of every token (one GEMM for both in self-attention: they come from the same rows;
// with the value block too where the plan holds them as one block), rotated (each sequence from
// its position); then, for the concat-then-project forms, the value block of every sequence in
// one GEMM (the summed form projects its values group by group: SumOfMixes).
Status Project(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, const BatchPlan& plan,
               std::span<const Sequence> batch, const ForwardBuffers& b) {
  const int64_t qk_cols = f.q_cols + f.k_cols;
  if (plan.rows.all_self) {
    const int64_t cols = plan.qkv_one_block ? f.in_cols() : qk_cols;
    ATTNSERVE_RETURN_IF_ERROR(ProjectColumns(ops, f, w, b.x, 0, cols, MatrixView(b.q.data, b.q.rows, cols, b.q.ld)));
  } else {
    ATTNSERVE_RETURN_IF_ERROR(ProjectColumns(ops, f, w, b.x, 0, f.q_cols, b.q));
    ATTNSERVE_RETURN_IF_ERROR(ProjectColumns(ops, f, w, b.c, f.q_cols, f.k_cols, b.k));
  }
  const LayerConfig& c = f.config;
  if (c.rope_theta > 0) {
    std::vector<RopeRun> queries, keys;
    for (size_t r = 0; r < batch.size(); ++r) {
      const Sequence& s = batch[r];
      queries.push_back({plan.rows.x_row[r], s.n(), s.position_offset});
      keys.push_back({plan.rows.c_row[r], s.m(), s.key_position_offset()});
    }
    ATTNSERVE_RETURN_IF_ERROR(ops.Rope(b.q, c.heads, c.d_head, c.rope_theta, queries));
    ATTNSERVE_RETURN_IF_ERROR(ops.Rope(b.k, c.kv_heads, c.d_head, c.rope_theta, keys));
  }
  if (plan.combine != HeadCombine::kConcatThenProject || plan.qkv_one_block) return OkStatus();
  return ProjectColumns(ops, f, w, b.c, qk_cols, f.value_cols, b.val);  // the plan's one group: every row
}

// Sequence r's rows of Q and K, and its query rows [row0, row0 + rows) as a range with `values`
// and `out`.
AttentionRange RangeOf(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, size_t r,
                       int64_t row0, int64_t rows, ConstMatrixView values, MatrixView out) {
  const Sequence& s = batch[r];
  return {.sequence = &s,
          .row0 = row0,
          .rows = rows,
          .q = b.q.RowBlock(plan.rows.x_row[r], s.n()),
          .k = b.k.RowBlock(plan.rows.c_row[r], s.m()),
          .values = values,
          .out = out};
}

// Factored and low-rank: O_i = A_i Val_i into O's columns of head i, then Y = O W_out + b.
Status ConcatThenProject(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, const BatchPlan& plan,
                         std::span<const Sequence> batch, const ForwardBuffers& b) {
  AttentionJob job{.form = &f, .values = AttentionValues::kValueBlock, .ranges = {}};
  for (size_t r = 0; r < batch.size(); ++r) {
    const int64_t n = batch[r].n(), m = batch[r].m();
    job.ranges.push_back(
        RangeOf(plan, batch, b, r, 0, n, b.val.RowBlock(plan.val_row[r], m), b.o.RowBlock(plan.rows.x_row[r], n)));
  }
  ATTNSERVE_RETURN_IF_ERROR(ops.Attend(job));
  ATTNSERVE_RETURN_IF_ERROR(ops.GemmWeights(b.o, w.w_out, w.b_out, b.y, /*accumulate=*/false));
  return ops.Finish(plan, batch, b, /*stacked=*/true);
}

// Summed, mixing first, one chunk of parts: each head's mix A_i C is an attention whose values
// are the context, into the part's mixes [rows, h·d]; then Y = Σ_i mixes_i W_M_i + b_eff, with
// W_M_i read straight from the value block's weights.
Status SumMixingFirst(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, const BatchPlan& plan,
                      std::span<const Sequence> batch, const ForwardBuffers& b, float* mixes, const MixChunk& chunk) {
  AttentionJob job{.form = &f, .values = AttentionValues::kContext, .ranges = {}};
  for (size_t i = chunk.first; i < chunk.last; ++i) {
    const MixPart& part = plan.mix_parts[i];
    job.ranges.push_back(RangeOf(plan, batch, b, part.sequence, part.row0, part.rows,
                                 b.c.RowBlock(plan.rows.c_row[part.sequence], batch[part.sequence].m()),
                                 MatrixView(mixes + part.offset, part.rows, f.value_cols)));
  }
  ATTNSERVE_RETURN_IF_ERROR(ops.Attend(job));
  const int64_t value_col0 = f.q_cols + f.k_cols;
  for (const AttentionRange& range : job.ranges) {
    const size_t r = static_cast<size_t>(range.sequence - batch.data());
    const MatrixView y = b.outputs[r].RowBlock(range.row0, range.rows);
    for (int64_t i = 0; i < f.config.heads; ++i) {
      const int64_t col = f.value_offset[i], width = f.value_width[i];
      // The first head's product (with the bias) sets Y; the others add to it.
      ATTNSERVE_RETURN_IF_ERROR(ops.GemmWeights(range.out.ColBlock(col, width),
                                                w.w_in.ColBlock(value_col0 + col, width), i == 0 ? w.b_out : nullptr, y,
                                                /*accumulate=*/i > 0));
    }
  }
  return OkStatus();
}

// A value group's rows of the value block: one GEMM per run of its sequences that project
// first (back to back in the stacked contexts and in the value block; a sequence that mixes
// first ends a run).
Status ProjectValueGroup(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, const BatchPlan& plan,
                         std::span<const Sequence> batch, const ForwardBuffers& b, const ValueGroup& group) {
  for (size_t r = group.first; r < group.last;) {
    if (plan.mixes_first[r]) {
      ++r;
      continue;
    }
    const size_t run_first = r;
    int64_t rows = 0;
    for (; r < group.last && !plan.mixes_first[r]; ++r) rows += batch[r].m();
    ATTNSERVE_RETURN_IF_ERROR(ProjectColumns(ops, f, w, b.c.RowBlock(plan.rows.c_row[run_first], rows),
                                             f.q_cols + f.k_cols, f.value_cols,
                                             b.val.RowBlock(plan.val_row[run_first], rows)));
  }
  return OkStatus();
}

// Summed: the sequences that project first, group by group (the group's value rows, then the
// device's head sum over them; the device holds A_cat), then those that mix first, chunk by
// chunk.
Status SumOfMixes(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, const BatchPlan& plan,
                  std::span<const Sequence> batch, const ForwardBuffers& b) {
  for (const ValueGroup& group : plan.value_groups) {
    ATTNSERVE_RETURN_IF_ERROR(ProjectValueGroup(ops, f, w, plan, batch, b, group));
    std::vector<AttentionRange> projecting;
    for (size_t r = group.first; r < group.last; ++r) {
      if (plan.mixes_first[r]) continue;
      projecting.push_back(
          RangeOf(plan, batch, b, r, 0, batch[r].n(), b.val.RowBlock(plan.val_row[r], batch[r].m()), b.outputs[r]));
    }
    ATTNSERVE_RETURN_IF_ERROR(ops.SumHeadsProjectingFirst(f, projecting, w.b_out));
  }
  if (!plan.mix_chunks.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(float* const mixes, ops.MixBuffer(plan));
    for (const MixChunk& chunk : plan.mix_chunks) {
      ATTNSERVE_RETURN_IF_ERROR(SumMixingFirst(ops, f, w, plan, batch, b, mixes, chunk));
    }
  }
  return ops.Finish(plan, batch, b, /*stacked=*/false);
}

}  // namespace

Status RunAttention(DeviceOps& ops, const FormWeights& f, const DeviceWeights& w, std::span<const Sequence> batch) {
  if (batch.empty()) return OkStatus();
  const BatchPlan plan = PlanBatch(f, batch, ops.Policy());
  ForwardBuffers buffers;
  ATTNSERVE_RETURN_IF_ERROR(ops.Prepare(f, plan, batch, buffers));
  ATTNSERVE_RETURN_IF_ERROR(Project(ops, f, w, plan, batch, buffers));
  switch (plan.combine) {
    case HeadCombine::kConcatThenProject:
      return ConcatThenProject(ops, f, w, plan, batch, buffers);
    case HeadCombine::kSumOfMixes:
      return SumOfMixes(ops, f, w, plan, batch, buffers);
  }
  return InternalError("RunAttention: a head combine without a branch");
}

}  // namespace attnserve
