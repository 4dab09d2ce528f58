#include "server/backend/cpu/cpu_ops.h"

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "server/backend/cpu/eigen_views.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/backend/cpu/tiled_attention.h"
#include "server/core/rope.h"

namespace attnserve {

int64_t ForwardScratch::Bytes() const {
  size_t floats = 0;
  for (const auto* v : {&x, &c, &q, &k, &val, &o, &y, &a_cat}) floats += v->capacity();
  return static_cast<int64_t>(floats * sizeof(float));
}

CpuResidentForm::CpuResidentForm(std::shared_ptr<const FormWeights> w, int64_t panel_width, PanelPrecision precision)
    : w_(std::move(w)), precision_(panel_width > 0 ? precision : PanelPrecision::kFloat32) {
  if (panel_width <= 0) return;
  const DeviceWeights host = HostWeights(*w_);
  w_in_ = PackPanels(host.w_in.view, panel_width, precision);
  if (!host.w_out.empty()) w_out_ = PackPanels(host.w_out.view, panel_width, precision);
}

StatusOr<std::optional<PackedBlock>> CpuResidentForm::Packed(const WeightBlock& w) const {
  const FormWeights& f = *w_;
  const bool in = w.matrix == WeightMatrix::kIn;
  const int64_t rows = in ? f.config.d_model : f.out_rows, cols = in ? f.in_cols() : f.config.d_model;
  const int64_t last_row = w.row0 + w.view.rows, last_col = w.col0 + w.view.cols;
  if (w.row0 < 0 || w.col0 < 0 || w.view.rows < 0 || w.view.cols < 0 || last_row > rows || last_col > cols) {
    return InternalError("GemmWeights: rows [" + std::to_string(w.row0) + ", " + std::to_string(last_row) +
                         ") and columns [" + std::to_string(w.col0) + ", " + std::to_string(last_col) + ") of " +
                         std::string(WeightMatrixName(w.matrix)) + ": expected a block inside its [" +
                         std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }
  const PackedWeights& packed = in ? w_in_ : w_out_;
  return packed.Block(w.row0, w.col0, w.view.rows, w.view.cols);
}

ColumnSplit SplitColumns(int64_t rows, int64_t depth, int64_t cols, int threads, bool on_panels) {
  if (cols <= 0) return {0, 0};
  constexpr int64_t kColumnAlign = 64;  // whole cache lines, and whole panels of either ISA's kernel
  int64_t blocks = std::max(threads, 1);
  if (on_panels && threads > 1) {
    const int64_t by_work = rows * depth * cols / kMinColumnBlockMultiplyAdds;
    blocks = std::max<int64_t>(threads, std::min<int64_t>(int64_t{threads} * kPanelBlocksPerThread, by_work));
  }
  blocks = std::min(blocks, (cols + kColumnAlign - 1) / kColumnAlign);
  const int64_t width = ((cols + blocks - 1) / blocks + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
  return {(cols + width - 1) / width, width};  // counted again: a width rounded up can leave the last block empty
}

namespace {

// How many members a step of `run` may run on: per-member scratch is indexed by member. One where
// the step is to run on this thread alone (threads 1, or no team).
int Members(const Compute& run) { return run.team == nullptr || run.threads == 1 ? 1 : run.team->size(); }

// body(task, member) for every task in [0, tasks): across the forward's team, or on this thread
// alone where Members is 1.
template <typename Body>
void ForEachTask(const Compute& run, int64_t tasks, Body&& body) {
  if (Members(run) == 1) {
    for (int64_t t = 0; t < tasks; ++t) body(t, 0);
    return;
  }
  run.team->Run(tasks, body);
}

// y = x · w (+ bias) with the threads splitting w's columns (SplitColumns): each block of the
// weights is streamed once. (A split by rows of y, Eigen's own, makes every thread pack the whole
// weight matrix when the batch has few tokens: slower on 2 threads than on 1,
// docs/journal/benchmarks-journal.md, "Figures the CPU backend's comments held".)
// With `accumulate`, y += x · w instead.
// `packed`, where given, is w packed (CpuResidentForm::Packed): the column split falls on its
// panels (the blocks' width is a multiple of every PanelWidth), and PanelGemm computes where it
// pays, and always on bfloat16 panels: a layer's weights are rounded alike whatever the batch.
void SplitGemm(Compute run, ConstMatrixView x, ConstMatrixView w, std::optional<PackedBlock> packed, const float* bias,
               MatrixView y, bool accumulate = false) {
  if (packed && packed->weights->precision == PanelPrecision::kFloat32 && !PanelGemmPays(x.rows, w.ld)) {
    packed.reset();
  }
  const ColumnSplit split = SplitColumns(x.rows, x.cols, w.cols, run.threads, packed.has_value());
  ForEachTask(run, split.blocks, [&](int64_t t, int /*member*/) {
    const int64_t c0 = t * split.width, count = std::min(split.width, w.cols - c0);
    const MatrixView block = y.ColBlock(c0, count);
    // The bias before the product where y is written over: on the panels it is where the
    // kernel's accumulators start (no pass of its own over y); for the library it is written
    // first and the product added to it, one pass over y fewer than adding it after.
    const bool bias_first = bias != nullptr && !accumulate;
    if (packed) {
      PanelGemm(x, packed->ColBlock(c0, count), block, accumulate, bias_first ? bias + c0 : nullptr);
    } else {
      if (bias_first) AsEigen(block).rowwise() = BiasMap(bias + c0, count);
      if (UseSkinnyGemm(run.gemm, x.rows, count)) {
        SkinnyGemm(x, w.ColBlock(c0, count), block, accumulate || bias_first);
      } else {
        GemmOnThisThread(run.gemm, x, w.ColBlock(c0, count), /*transpose_w=*/false, 1.0f, block,
                         accumulate || bias_first);
      }
    }
    if (bias != nullptr && !bias_first) AsEigen(block).rowwise() += BiasMap(bias + c0, count);
  });
}

// `buffer` grown to at least rows × cols floats, as a [rows, cols] view; what it held before is
// not kept. Buffers only grow: one that is reused is neither paged in by the kernel nor zeroed
// again (see ForwardScratch). A buffer grows to exactly the size asked, every float of it
// written (zeroed) now, so that its capacity is what it holds resident: the backend reports the
// capacity it retains (RetainedScratchBytes), and vector::resize's geometric growth kept up to
// twice what was written, paged in later by a larger batch without the figure moving. The old
// buffer goes first, so that both are never held at once.
MatrixView Reserve(AlignedFloats& buffer, int64_t rows, int64_t cols) {
  const int64_t floats = rows * cols;
  if (static_cast<int64_t>(buffer.size()) < floats) {
    buffer = AlignedFloats();
    buffer = AlignedFloats(static_cast<size_t>(floats));
  }
  return MatrixView(buffer.data(), rows, cols);
}

// The blocks as one view when each starts where the one before it ends, all with one row
// stride: the sequences of one request, decoded into one buffer, or one block alone. Else
// nothing: they need a copy.
template <typename T>
std::optional<MatrixViewT<T>> OneBlock(std::span<const MatrixViewT<T>> blocks) {
  if (blocks.empty()) return std::nullopt;
  const MatrixViewT<T>& first = blocks[0];
  int64_t rows = 0;
  for (const MatrixViewT<T>& b : blocks) {
    if (b.data == nullptr || b.ld != first.ld || b.cols != first.cols || b.data != first.data + rows * first.ld) {
      return std::nullopt;
    }
    rows += b.rows;
  }
  return MatrixViewT<T>(first.data, rows, first.cols, first.ld);
}

// The stacked rows of several blocks as one view: the blocks themselves when they already lie
// so (OneBlock), else a copy into `storage`.
ConstMatrixView StackRows(const std::vector<ConstMatrixView>& blocks, AlignedFloats& storage) {
  if (const auto whole = OneBlock<const float>(blocks)) return *whole;
  int64_t rows = 0;
  for (const auto& b : blocks) rows += b.rows;
  const int64_t cols = blocks[0].cols;
  MatrixView out = Reserve(storage, rows, cols);
  int64_t r0 = 0;
  for (const auto& b : blocks) {
    AsEigen(out.RowBlock(r0, b.rows)) = AsEigen(b);
    r0 += b.rows;
  }
  return out;
}

// The query rows one task of the summed form's project-first score loop takes: enough tasks for
// every thread (4 each, for balance), few enough that each runs a GEMM of some size.
int64_t RowsPerTask(int64_t rows, int threads) {
  constexpr int64_t kMinRows = 4, kTasksPerThread = 4;
  return std::clamp<int64_t>(rows / (int64_t{threads} * kTasksPerThread), kMinRows, kSummedBlockRows);
}

// A range's A_cat [n, L·h] (the summed form projecting first), in floats.
int64_t ACatFloats(const FormWeights& f, const Sequence& s) { return s.n() * s.visible_keys() * f.config.heads; }

}  // namespace

PlanPolicy CpuOps::Policy() const {
  return {.summed_order = run_.summed_order,
          .max_mix_bytes = max_score_scratch_bytes_,
          .max_value_group_bytes = value_group_bytes_,
          .qkv_one_block = true};
}

// The inputs are used where they are (one sequence, or sequences that lie one after another:
// OneBlock) or stacked into the scratch; the output is written in place the same way. The summed
// form's A_cat and its mixes share one buffer, used one after the other (SumHeadsProjectingFirst,
// then MixBuffer for the mix-first chunks).
Status CpuOps::Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                       ForwardBuffers& b) {
  const int64_t tx = plan.rows.queries, tc = plan.rows.contexts, d = f.config.d_model;
  std::vector<ConstMatrixView> xs, cs;
  for (const Sequence& s : batch) {
    xs.push_back(s.input);
    cs.push_back(s.keys_source());
  }
  b.x = StackRows(xs, scratch_.x);
  b.c = plan.rows.all_self ? b.x : StackRows(cs, scratch_.c);
  if (plan.qkv_one_block) {
    const MatrixView qkv = Reserve(scratch_.q, tx, f.in_cols());
    b.q = qkv.ColBlock(0, f.q_cols);
    b.k = qkv.ColBlock(f.q_cols, f.k_cols);
    b.val = qkv.ColBlock(f.q_cols + f.k_cols, f.value_cols);
  } else if (plan.rows.all_self) {
    const MatrixView qk = Reserve(scratch_.q, tx, f.q_cols + f.k_cols);
    b.q = qk.ColBlock(0, f.q_cols);
    b.k = qk.ColBlock(f.q_cols, f.k_cols);
  } else {
    b.q = Reserve(scratch_.q, tx, f.q_cols);
    b.k = Reserve(scratch_.k, tc, f.k_cols);
  }
  if (!plan.qkv_one_block) b.val = Reserve(scratch_.val, plan.val_rows, f.value_cols);
  for (const Sequence& s : batch) b.outputs.push_back(s.output);
  if (plan.combine == HeadCombine::kConcatThenProject) {
    b.o = Reserve(scratch_.o, tx, f.out_rows);
    const std::optional<MatrixView> in_place = OneBlock<float>(b.outputs);
    b.y = in_place ? *in_place : Reserve(scratch_.y, tx, d);
  }
  return OkStatus();
}

// The A_cat buffer again (SumHeadsProjectingFirst is done with it by now), grown if need be.
// Neither is reserved in Prepare: held during the projections, it would add its size to the
// peak of the projections' own GEMM packing (12 MiB at bert-base width with Eigen's GEMMs).
StatusOr<float*> CpuOps::MixBuffer(const BatchPlan& plan) { return Reserve(scratch_.a_cat, plan.mix_floats, 1).data; }

// Activations only (the skeleton's products by weights come through GemmWeights): the library.
Status CpuOps::Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) {
  SplitGemm(run_, x, w, std::nullopt, bias, y, accumulate);
  return OkStatus();
}

Status CpuOps::GemmWeights(ConstMatrixView x, const WeightBlock& w, const float* bias, MatrixView y, bool accumulate) {
  std::optional<PackedBlock> packed;
  if (resident_ != nullptr) {
    ATTNSERVE_ASSIGN_OR_RETURN(packed, resident_->Packed(w));
  }
  SplitGemm(run_, x, w.view, packed, bias, y, accumulate);
  return OkStatus();
}

Status CpuOps::Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) {
  for (const RopeRun& run : runs) ApplyRope(m.RowBlock(run.row0, run.rows), heads, d_head, theta, run.position);
  return OkStatus();
}

Status CpuOps::Attend(const AttentionJob& job) {
  std::vector<AttentionTask> tasks;
  for (size_t i = 0; i < job.ranges.size(); ++i) {
    AddAttentionTasks(*job.form, i, job.ranges[i].row0, job.ranges[i].rows, tasks);
  }
  std::vector<TileScratch> scratch(Members(run_));
  ForEachTask(run_, static_cast<int64_t>(tasks.size()),
              [&](int64_t i, int member) { RunAttentionTask(run_.gemm, job, tasks[i], scratch[member]); });
  return OkStatus();
}

// The ranges' A_cat in chunks under the scratch bound (a range larger than the bound runs
// alone); per chunk, blocks of rows with every head in parallel, then each range's head sum.
Status CpuOps::SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                       const float* bias) {
  std::vector<int64_t> sizes;
  for (const AttentionRange& range : ranges) sizes.push_back(ACatFloats(f, *range.sequence));
  const Chunks chunks = ChunksUnder(sizes, ScratchCap());
  float* const work = Reserve(scratch_.a_cat, chunks.largest, 1).data;
  for (const auto& bounds : chunks.bounds) {
    const size_t first = bounds.first, last = bounds.second;  // (no structured binding: the lambdas capture them)
    struct ScoreTask {
      size_t range;
      int64_t row0, rows;
    };
    std::vector<ScoreTask> tasks;
    int64_t rows = 0;
    for (size_t i = first; i < last; ++i) rows += ranges[i].rows;
    const int64_t block = RowsPerTask(rows, run_.threads);
    for (size_t i = first; i < last; ++i) {
      for (int64_t row0 = 0; row0 < ranges[i].rows; row0 += block) {
        tasks.push_back({i, row0, std::min(block, ranges[i].rows - row0)});
      }
    }
    std::vector<RowMatrix> a(Members(run_));
    ForEachTask(run_, static_cast<int64_t>(tasks.size()), [&](int64_t i, int member) {
      const ScoreTask& task = tasks[i];
      ScoreIntoACat(run_.gemm, f, ranges[task.range], task.row0, task.rows, work + chunks.offset[task.range],
                    a[member]);
    });
    const int64_t heads = f.config.heads, d = f.config.d_model;
    auto head_sum = [&](size_t i, int gemm_threads) {
      const AttentionRange& range = ranges[i];
      const int64_t keys = range.sequence->visible_keys();
      const ConstMatrixView a(work + chunks.offset[i], range.rows, keys * heads);
      const ConstMatrixView m(range.values.data, keys * heads, d);
      SplitGemm({run_.gemm, gemm_threads, run_.summed_order, run_.team}, a, m, std::nullopt, bias, range.out);
    };
    if (last - first == 1) {
      head_sum(first, run_.threads);  // one range: its GEMM's columns across the threads
      continue;
    }
    // many: a range per member
    ForEachTask(run_, static_cast<int64_t>(last - first), [&](int64_t i, int) { head_sum(first + i, 1); });
  }
  return OkStatus();
}

Status CpuOps::Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool stacked) {
  if (!stacked || b.y.data == batch[0].output.data) return OkStatus();  // written in place
  for (size_t r = 0; r < batch.size(); ++r) {
    AsEigen(batch[r].output) = AsEigen(ConstMatrixView(b.y.RowBlock(plan.rows.x_row[r], batch[r].n())));
  }
  return OkStatus();
}

}  // namespace attnserve
