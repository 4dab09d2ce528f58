#include "server/backend/cpu/cpu_backend.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "server/backend/attention/skeleton.h"
#include "server/backend/compute_team.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/backend/cpu/softmax_rows.h"
#include "server/core/rope.h"

namespace attnserve {

// The memory one forward works in, kept for the next: the stacked inputs and contexts, Q, K,
// the value block, O, Y and the summed form's A_cat. Freed and allocated per call, the value
// block alone (40 MB at bert-base, summed) was paged in and zeroed by the kernel every time:
// 20% of the summed form's time there (perf: clear_page_erms, exc_page_fault).
struct ForwardScratch {
  // On cache lines (AlignedFloats): Q, K and the value block are the scores' and mixes' operands.
  AlignedFloats x, c, q, k, val, o, y, a_cat;  // a_cat also holds the summed form's mixes

  int64_t Bytes() const {
    size_t floats = 0;
    for (const auto* v : {&x, &c, &q, &k, &val, &o, &y, &a_cat}) floats += v->capacity();
    return static_cast<int64_t>(floats * sizeof(float));
  }
};

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Stride = Eigen::OuterStride<>;
using ConstMap = Eigen::Map<const RowMatrix, 0, Stride>;
using MutableMap = Eigen::Map<RowMatrix, 0, Stride>;
using BiasMap = Eigen::Map<const Eigen::RowVectorXf>;

ConstMap AsEigen(ConstMatrixView v) { return ConstMap(v.data, v.rows, v.cols, Stride(v.ld)); }
MutableMap AsEigen(MatrixView v) { return MutableMap(v.data, v.rows, v.cols, Stride(v.ld)); }

// A form as the CPU backend holds it: its weights, and with WeightLayout::kPacked their
// projection matrices packed into panels as well (packed_weights.h).
class CpuResidentForm final : public ResidentForm {
 public:
  CpuResidentForm(std::shared_ptr<const FormWeights> w, int64_t panel_width, PanelPrecision precision)
      : w_(std::move(w)) {
    if (panel_width <= 0) return;
    const DeviceWeights host = HostWeights(*w_);
    w_in_ = PackPanels(host.w_in, panel_width, precision);
    if (!host.w_out.empty()) w_out_ = PackPanels(host.w_out, panel_width, precision);
  }
  const FormWeights& weights() const override { return *w_; }
  int64_t HostBytes() const override { return w_->Bytes() + w_in_.Bytes() + w_out_.Bytes(); }

  // The packed block of W_in or W_out that `w` views (PackedWeights::Find); nothing when the
  // weights are not packed or `w` is not a block of them.
  std::optional<PackedBlock> Packed(ConstMatrixView w) const {
    if (auto block = w_in_.Find(w)) return block;
    return w_out_.Find(w);
  }

 private:
  std::shared_ptr<const FormWeights> w_;
  PackedWeights w_in_, w_out_;
};

// How a forward computes: which GEMM library, on how many threads, in which summed order.
struct Compute {
  GemmLibrary gemm;
  int threads;
  SummedOrder summed_order;      // when the summed form mixes first (SummedMixesFirst)
  ComputeTeam* team = nullptr;   // the forward's threads (threads of them); none: this one alone
};

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

// y = x · w (+ bias) with the threads splitting w's columns: each thread streams its own share
// of the weights once. (A split by rows of y, Eigen's own, makes every thread pack the whole
// weight matrix when the batch has few tokens: 2 threads were 3x slower than 1 there.)
// With `accumulate`, y += x · w instead.
// `packed`, where given, is w packed (CpuResidentForm::Packed): the column split falls on its
// panels (kColumnAlign is a multiple of every PanelWidth), and PanelGemm computes where it pays,
// and always on bfloat16 panels: a layer's weights are rounded alike whatever the batch.
void Gemm(Compute run, ConstMatrixView x, ConstMatrixView w, std::optional<PackedBlock> packed, const float* bias,
          MatrixView y, bool accumulate = false) {
  if (packed && packed->weights->precision == PanelPrecision::kFloat32 && !PanelGemmPays(x.rows, w.ld)) {
    packed.reset();
  }
  constexpr int64_t kColumnAlign = 64;  // whole cache lines and register blocks per thread
  const int64_t chunks = std::min<int64_t>(run.threads, (w.cols + kColumnAlign - 1) / kColumnAlign);
  const int64_t chunk_cols = ((w.cols + chunks - 1) / chunks + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
  ForEachTask(run, chunks, [&](int64_t t, int /*member*/) {
    const int64_t c0 = t * chunk_cols, count = std::min(chunk_cols, w.cols - c0);
    if (count <= 0) return;
    const MatrixView block = y.ColBlock(c0, count);
    // The bias before the product where y is written over: on the panels it is where the
    // kernel's accumulators start (no pass of its own over y); for the library it is written
    // first and the product added to it, one pass over y fewer than adding it after (3-5 % of a
    // projection's time at bert-base widths, one thread).
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

// One row of A from scratch in float64, for a row whose float32 scores are not all finite:
// inputs from ~1e19 on make scale · q·k pass float32's range (an overflowed +inf max would give
// inf - inf = NaN in the max subtraction) although the softmax itself is well defined. The
// products of float32 values are exact in float64, and |q·k| < d_h · FLT_MAX² cannot overflow
// there, so the row comes out as the exact softmax rounded once. A non-finite Q or K (the
// projection itself overflowed: no float32 answer can be right) makes the row NaN, which the
// service reports as OUT_OF_RANGE.
template <typename QRow, typename KRows, typename ARow>
void SoftmaxRowInFloat64(const QRow& q, const KRows& k, double scale, ARow&& out) {
  const int64_t visible = k.rows();
  std::vector<double> e(static_cast<size_t>(visible));
  double top = -std::numeric_limits<double>::infinity();
  bool finite = true;
  for (int64_t j = 0; j < visible; ++j) {
    double dot = 0;
    for (int64_t t = 0; t < q.size(); ++t) dot += static_cast<double>(q(t)) * static_cast<double>(k(j, t));
    e[j] = scale * dot;
    finite = finite && std::isfinite(e[j]);
    top = std::max(top, e[j]);
  }
  if (!finite) {
    out.setConstant(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  double sum = 0;
  for (int64_t j = 0; j < visible; ++j) sum += (e[j] = std::exp(e[j] - top));
  for (int64_t j = 0; j < visible; ++j) out(j) = static_cast<float>(e[j] / sum);
}

// A = softmax(scale · Q_i K_g(i)^T + mask) for the query rows [row0, row0 + rows) of the
// range's sequence, into `a` [rows, keys]. `keys` are those the block's last row sees: a causal
// block skips the keys none of its rows sees, and within the block a key a row does not see is 0.
void HeadScores(GemmLibrary gemm, const FormWeights& f, const AttentionRange& range, int64_t head, int64_t row0,
                int64_t rows, RowMatrix& a) {
  const LayerConfig& c = f.config;
  const Sequence& s = *range.sequence;
  const int64_t keys = VisibleKeys(s, row0 + rows - 1), dh = c.d_head;
  const ConstMatrixView q = range.q.RowBlock(row0, rows).ColBlock(head * dh, dh);
  const ConstMatrixView k = range.k.RowBlock(0, keys).ColBlock(c.KvHeadOf(head) * dh, dh);
  a.resize(rows, keys);
  GemmOnThisThread(gemm, q, k, /*transpose_w=*/true, c.SoftmaxScale(), MatrixView(a.data(), rows, keys));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t visible = VisibleKeys(s, row0 + row);
    float* const scores = a.row(row).data();
    const float top = RowMaxOrNaN(scores, visible);
    if (std::isfinite(top)) {
      a.row(row).head(visible) /= ExpShiftedAndSum(scores, visible, top);
    } else {
      SoftmaxRowInFloat64(AsEigen(q).row(row), AsEigen(k).topRows(visible), c.SoftmaxScale(), a.row(row).head(visible));
    }
    a.row(row).tail(keys - visible).setZero();
  }
}

// Asks for `m`'s lines, row by row up to kMaxBytes, into L2. Attention's operands are a head's
// columns of the Q|K|V buffer: 256 bytes (d_h = 64) of rows 9 KB apart, each on its own page,
// where the hardware prefetchers do not follow; read as they are needed, every row is a wait on
// L3. Asked for all at once, the waits overlap (attention's time 18 % shorter in a bert-base
// forward, with the kernel's own prefetch of x, SkinnyGemm). The cap keeps a task's Q, K and V
// tiles (3 × 128 KiB) inside the smallest L2 of the CPUs this runs on (512 KiB, Zen 3).
void PrefetchToL2(ConstMatrixView m) {
  constexpr int64_t kMaxBytes = 128 * 1024;
  const int64_t rows = std::min(m.rows, kMaxBytes / std::max<int64_t>(1, m.cols * int64_t{sizeof(float)}));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < m.cols; c += kCacheLineFloats) {
      __builtin_prefetch(m.data + r * m.ld + c, /*rw=*/0, /*locality=*/2);
    }
  }
}

// A thread's working memory for tiled attention, kept across its tasks.
struct TileScratch {
  RowMatrix s;                   // one tile's scores, then its probabilities [stacked rows, keys]
  RowMatrix kt;                  // the tile's keys transposed and scaled, [d_h, keys] (OwnTileKernel)
  RowMatrix q, o;                // the stacked heads' queries and running output (G > 1 only)
  Eigen::VectorXf max, sum;      // the online softmax's running max and sum, per stacked row
  std::vector<int64_t> exact;    // stacked rows whose float32 scores were not all finite
  Eigen::RowVectorXf row;        // one such row's probabilities, from SoftmaxRowInFloat64
  std::vector<ConstMatrixView> q_views;  // a task's heads' queries and outputs (RunAttentionTask),
  std::vector<MatrixView> out_views;     // kept so that a task allocates nothing
};

// Whether attention's two products per tile run on the backend's own register-blocked kernel
// (SkinnyGemm) rather than the GEMM library. A tile's operands are already in cache (a query
// block, a key tile and its values, at most 512 KiB), so packing them, as a library GEMM does on
// every call, is cost without return. Measured at d_h = 64, one thread (docs/journal/benchmarks-journal.md,
// "Attention's own kernel"): the AVX-512 kernel 1.03× oneDNN on the scores and 1.09–1.10× on
// the mix. The AVX2 one (6 × 16 blocks), on the same Zen 4 capped at AVX2, 0.86–1.04× and
// 0.97–1.22× oneDNN's AVX2 GEMM: not a clear win, and not measured on an AVX2-only CPU, so AVX2
// keeps the library.
// The scores take it from kOwnScoresMinKeys keys: fewer fill part of its 64-column block only
// (0.45× at 16 keys). The mix takes it for values of at most kOwnMixMaxCols columns: the kernel
// reads the value tile once per 64 columns, which for the summed form's context values
// (d_model wide) would stream from L3.
bool OwnTileKernel() { return SkinnyGemmIsa() == "avx512"; }
constexpr int64_t kOwnScoresMinKeys = 64, kOwnMixMaxCols = 256;

// One attention task: the query rows [row0, row0 + rows) of a sequence, for a set of heads that
// share their keys `k` [L, d_h] and values `v` [L, d_v] (StackedHeads), with `q[g]` the rows'
// queries of head g and `out[g]` where its output goes, [rows, d_v]:
//   out_g = softmax(scale · q_g kᵀ + mask) v
// computed key tile by key tile (kKeyTile) with the online softmax of FlashAttention: each row
// keeps a running max and sum, and the output so far is rescaled when the max grows. The heads
// are stacked into one GEMM per tile, so a group's K and V tiles are read once for all of them.
// Tiles beyond the keys the block's last row sees (causal, key_length) are never computed; a
// tile crossing a row's limit masks that row's tail. Rows whose float32 scores overflow are
// recomputed exactly at the end (SoftmaxRowInFloat64), in O(L) memory.
void AttendTiled(GemmLibrary gemm, const Sequence& s, float scale, std::span<const ConstMatrixView> q,
                 ConstMatrixView k, ConstMatrixView v, int64_t row0, std::span<const MatrixView> out,
                 TileScratch& t) {
  const int64_t heads = static_cast<int64_t>(q.size()), rows = q[0].rows, dh = q[0].cols, dv = v.cols;
  const int64_t stacked = heads * rows, keys = VisibleKeys(s, row0 + rows - 1);
  ConstMatrixView queries = q[0];
  MatrixView acc = out[0];
  if (heads > 1) {
    t.q.resize(stacked, dh);
    t.o.resize(stacked, dv);
    for (int64_t g = 0; g < heads; ++g) t.q.middleRows(g * rows, rows) = AsEigen(q[g]);
    queries = ConstMatrixView(t.q.data(), stacked, dh);
    acc = MatrixView(t.o.data(), stacked, dv);
  }
  t.max.setConstant(stacked, -std::numeric_limits<float>::infinity());
  t.sum.setZero(stacked);
  t.exact.clear();
  // The key tile from key `first` on, its keys and values asked for (PrefetchToL2): the first
  // tile with the queries, each next one while the one before computes.
  auto ask_for_tile = [&](int64_t first) {
    const int64_t width = std::min(kKeyTile, keys - first);
    PrefetchToL2(k.RowBlock(first, width));
    PrefetchToL2(v.RowBlock(first, width));
  };
  PrefetchToL2(queries);
  ask_for_tile(0);
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyTile) {
    const int64_t width = std::min(kKeyTile, keys - k0);
    if (k0 + width < keys) ask_for_tile(k0 + width);
    t.s.resize(stacked, width);
    const MatrixView scores(t.s.data(), stacked, width);
    if (OwnTileKernel() && width >= kOwnScoresMinKeys) {
      // The key tile as the kernel's right operand, [d_h, keys] with the keys contiguous; the
      // scale folded in there costs nothing and leaves the product a plain one.
      t.kt.resize(dh, width);
      TransposeScaled(k.RowBlock(k0, width), scale, MatrixView(t.kt.data(), dh, width));
      SkinnyGemm(queries, ConstMatrixView(t.kt.data(), dh, width), scores);
    } else {
      GemmOnThisThread(gemm, queries, k.RowBlock(k0, width), /*transpose_w=*/true, scale, scores);
    }
    for (int64_t r = 0; r < stacked; ++r) {
      const int64_t seen = std::clamp<int64_t>(VisibleKeys(s, row0 + r % rows) - k0, 0, width);
      float* const p = t.s.row(r).data();
      t.s.row(r).tail(width - seen).setZero();
      if (seen == 0) continue;  // a causal row that sees none of this tile: its output stands
      const float tile_top = RowMaxOrNaN(p, seen);
      if (!std::isfinite(tile_top)) {
        t.exact.push_back(r);  // once per tile that overflows: made unique below
        t.s.row(r).head(seen).setZero();
        continue;
      }
      const float top = std::max(t.max(r), tile_top);
      const float rescale = std::exp(t.max(r) - top);  // 0 on the first tile (max = -inf)
      t.sum(r) = t.sum(r) * rescale + ExpShiftedAndSum(p, seen, top);
      t.max(r) = top;
      if (k0 > 0) AsEigen(acc).row(r) *= rescale;
    }
    // The first tile sets the output (every row sees key 0), later ones add to it.
    const ConstMatrixView probabilities(t.s.data(), stacked, width);
    if (OwnTileKernel() && dv <= kOwnMixMaxCols) {
      SkinnyGemm(probabilities, v.RowBlock(k0, width), acc, /*accumulate=*/k0 > 0);
    } else {
      GemmOnThisThread(gemm, probabilities, v.RowBlock(k0, width), /*transpose_w=*/false, 1.0f, acc,
                       /*accumulate=*/k0 > 0);
    }
  }
  for (int64_t r = 0; r < stacked; ++r) AsEigen(acc).row(r) /= t.sum(r);
  std::sort(t.exact.begin(), t.exact.end());
  t.exact.erase(std::unique(t.exact.begin(), t.exact.end()), t.exact.end());
  for (int64_t r : t.exact) {
    const int64_t seen = VisibleKeys(s, row0 + r % rows);
    t.row.resize(seen);
    SoftmaxRowInFloat64(AsEigen(queries).row(r), AsEigen(k).topRows(seen), scale, t.row);
    AsEigen(acc).row(r) = t.row * AsEigen(v).topRows(seen);
  }
  if (heads > 1) {
    for (int64_t g = 0; g < heads; ++g) AsEigen(out[g]) = t.o.middleRows(g * rows, rows);
  }
}

// The attention tasks of one range's query rows: blocks of at most kQueryTile stacked rows,
// for every set of StackedHeads heads.
struct AttentionTask {
  size_t range;        // in the job
  int64_t first_head;  // of the set
  int64_t row0, rows;  // the query block, rows of the range's sequence
};

void AddAttentionTasks(const FormWeights& f, size_t range, int64_t row0, int64_t rows,
                       std::vector<AttentionTask>& tasks) {
  const int64_t set = StackedHeads(f), block = std::max<int64_t>(1, kQueryTile / set);
  for (int64_t b = row0; b < row0 + rows; b += block) {
    for (int64_t head = 0; head < f.config.heads; head += set) {
      tasks.push_back({range, head, b, std::min(block, row0 + rows - b)});
    }
  }
}

// Runs one task: the set's queries and keys from its range, the values its heads mix (the set's
// heads mix the same value columns, StackedHeads: their group's, or the whole context), and each
// head's output in its columns of the range's out.
void RunAttentionTask(GemmLibrary gemm, const AttentionJob& job, const AttentionTask& task, TileScratch& t) {
  const FormWeights& f = *job.form;
  const LayerConfig& c = f.config;
  const AttentionRange& range = job.ranges[task.range];
  const Sequence& s = *range.sequence;
  const int64_t set = StackedHeads(f), dh = c.d_head, kv = c.KvHeadOf(task.first_head);
  t.q_views.clear();
  t.out_views.clear();
  for (int64_t i = task.first_head; i < task.first_head + set; ++i) {
    t.q_views.push_back(range.q.RowBlock(task.row0, task.rows).ColBlock(i * dh, dh));
    t.out_views.push_back(
        range.out.RowBlock(task.row0 - range.row0, task.rows).ColBlock(job.OutColumn(i), job.Width(i)));
  }
  const int64_t keys = s.visible_keys();
  const ConstMatrixView k = range.k.RowBlock(0, keys).ColBlock(kv * dh, dh);
  const ConstMatrixView values =
      range.values.RowBlock(0, keys).ColBlock(job.ValueColumn(task.first_head), job.Width(task.first_head));
  AttendTiled(gemm, s, c.SoftmaxScale(), t.q_views, k, values, task.row0, t.out_views, t);
}

// The query rows one task of the summed form's project-first score loop takes: enough tasks for
// every thread (4 each, for balance), few enough that each runs a GEMM of some size.
int64_t RowsPerTask(int64_t rows, int threads) {
  constexpr int64_t kMinRows = 4, kTasksPerThread = 4;
  return std::clamp<int64_t>(rows / (int64_t{threads} * kTasksPerThread), kMinRows, kSummedBlockRows);
}

// A range's A_cat [n, L·h] (the summed form projecting first), in floats.
int64_t ACatFloats(const FormWeights& f, const Sequence& s) { return s.n() * s.visible_keys() * f.config.heads; }

// Project first: A_cat's rows [row0, row0 + rows) of the range's sequence (one task: a block of
// query rows with every head: the heads of a row interleave in A_cat, so tasks split by head
// would write the same cache lines from different threads).
void ScoreIntoACat(GemmLibrary gemm, const FormWeights& f, const AttentionRange& range, int64_t row0, int64_t rows,
                   float* a_cat, RowMatrix& a) {
  const int64_t heads = f.config.heads, width = range.sequence->visible_keys() * heads;  // A_cat's row
  float* const block_rows = a_cat + row0 * width;
  int64_t seen = 0;  // the keys this block's rows see (all heads alike)
  for (int64_t i = 0; i < heads; ++i) {
    HeadScores(gemm, f, range, i, row0, rows, a);
    seen = a.cols();
    for (int64_t q = 0; q < rows; ++q) {
      float* dst = block_rows + q * width + i;
      for (int64_t j = 0; j < seen; ++j) dst[j * heads] = a(q, j);
    }
  }
  // Keys beyond what the block sees (a causal block): zero, as A_cat's scratch is reused.
  for (int64_t q = 0; q < rows; ++q) std::fill(block_rows + q * width + seen * heads, block_rows + (q + 1) * width, 0.0f);
}

// The skeleton's operations on the CPU (server/backend/attention/device_ops.h): the buffers
// are this forward's scratch, the GEMMs split across the backend's threads (Gemm), attention
// runs as tiled tasks (AttendTiled) on the forward's compute team.
class CpuOps final : public DeviceOps {
 public:
  CpuOps(Compute run, const CpuResidentForm* resident, int64_t max_score_scratch_bytes, int64_t value_group_bytes,
         ForwardScratch& scratch)
      : run_(run),
        resident_(resident),
        max_score_scratch_bytes_(max_score_scratch_bytes),
        value_group_bytes_(value_group_bytes),
        scratch_(scratch) {}

  PlanPolicy Policy() const override {
    return {.summed_order = run_.summed_order,
            .max_mix_bytes = max_score_scratch_bytes_,
            .max_value_group_bytes = value_group_bytes_,
            .qkv_one_block = true};
  }

  // The inputs are used where they are (one sequence, or sequences that lie one after another:
  // OneBlock) or stacked into the scratch; the output is written in place the same way. The summed form's A_cat and its mixes share one buffer,
  // used one after the other (SumHeadsProjectingFirst, then MixBuffer for the mix-first chunks).
  Status Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                 ForwardBuffers& b) override {
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
  StatusOr<float*> MixBuffer(const BatchPlan& plan) override {
    return Reserve(scratch_.a_cat, plan.mix_floats, 1).data;
  }

  Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) override {
    attnserve::Gemm(run_, x, w, resident_ != nullptr ? resident_->Packed(w) : std::nullopt, bias, y, accumulate);
    return OkStatus();
  }

  Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) override {
    for (const RopeRun& run : runs) ApplyRope(m.RowBlock(run.row0, run.rows), heads, d_head, theta, run.position);
    return OkStatus();
  }

  Status Attend(const AttentionJob& job) override {
    std::vector<AttentionTask> tasks;
    for (size_t i = 0; i < job.ranges.size(); ++i) {
      AddAttentionTasks(*job.form, i, job.ranges[i].row0, job.ranges[i].rows, tasks);
    }
    std::vector<TileScratch> scratch(Members(run_));
    ForEachTask(run_, static_cast<int64_t>(tasks.size()), [&](int64_t i, int member) {
      RunAttentionTask(run_.gemm, job, tasks[i], scratch[member]);
    });
    return OkStatus();
  }

  // The ranges' A_cat in chunks under the scratch bound (a range larger than the bound runs
  // alone); per chunk, blocks of rows with every head in parallel, then each range's head sum.
  Status SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                 const float* bias) override {
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
        attnserve::Gemm({run_.gemm, gemm_threads, run_.summed_order, run_.team}, a, m, std::nullopt, bias,
                        range.out);
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

  Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b,
                bool stacked) override {
    if (!stacked || b.y.data == batch[0].output.data) return OkStatus();  // written in place
    for (size_t r = 0; r < batch.size(); ++r) {
      AsEigen(batch[r].output) = AsEigen(ConstMatrixView(b.y.RowBlock(plan.rows.x_row[r], batch[r].n())));
    }
    return OkStatus();
  }

 private:
  int64_t ScratchCap() const { return max_score_scratch_bytes_ / static_cast<int64_t>(sizeof(float)); }

  const Compute run_;
  const CpuResidentForm* resident_;  // null for a form another backend uploaded: nothing packed
  const int64_t max_score_scratch_bytes_;
  const int64_t value_group_bytes_;
  ForwardScratch& scratch_;
};

// The rule SummedMixesFirst applies for the options' order: auto mixes first past the scratch
// bound (and where n < m), mix-first past 0 bytes, project-first never.
SummedOrder OrderOf(const CpuBackendOptions& options) {
  switch (options.summed_order) {
    case CpuBackendOptions::SummedOrderChoice::kProjectFirst: return {.mix_first_allowed = false};
    case CpuBackendOptions::SummedOrderChoice::kMixFirst: return {.mix_first_allowed = true, .max_a_cat_bytes = 0};
    case CpuBackendOptions::SummedOrderChoice::kAuto: break;
  }
  return {.mix_first_allowed = true, .max_a_cat_bytes = options.max_score_scratch_bytes};
}

}  // namespace

CpuBackend::CpuBackend(CpuBackendOptions options)
    : threads_(options.threads > 0 ? options.threads : omp_get_max_threads()),
      gemm_(options.gemm),
      weight_layout_(options.weight_layout),
      max_score_scratch_bytes_(options.max_score_scratch_bytes),
      max_retained_scratch_bytes_(options.max_retained_scratch_bytes),
      summed_value_group_bytes_(options.summed_value_group_bytes),
      summed_order_(OrderOf(options)),
      idle_spin_(options.idle_spin) {
  // Every GEMM here splits its own work across threads (Gemm above); Eigen's own split by
  // output rows is pathological for few rows (16 tokens × 9216 columns: 4× slower on 2 threads
  // than on 1), so it stays off.
  Eigen::setNbThreads(1);
}

CpuBackend::~CpuBackend() = default;

std::unique_ptr<ForwardScratch> CpuBackend::TakeScratch() {
  MutexLock lock(scratch_mu_);
  if (free_scratch_.empty()) return std::make_unique<ForwardScratch>();
  std::unique_ptr<ForwardScratch> scratch = std::move(free_scratch_.back());
  free_scratch_.pop_back();
  return scratch;
}

std::unique_ptr<ComputeTeam> CpuBackend::TakeTeam() {
  {
    MutexLock lock(team_mu_);
    if (!free_teams_.empty()) {
      std::unique_ptr<ComputeTeam> team = std::move(free_teams_.back());  // the last used: warmest
      free_teams_.pop_back();
      return team;
    }
  }
  return std::make_unique<ComputeTeam>(threads_, idle_spin_);
}

void CpuBackend::ReturnTeam(std::unique_ptr<ComputeTeam> team) {
  MutexLock lock(team_mu_);
  free_teams_.push_back(std::move(team));
}

void CpuBackend::ReturnScratch(std::unique_ptr<ForwardScratch> scratch) {
  if (scratch->Bytes() > max_retained_scratch_bytes_) return;  // a rare large batch: not kept
  MutexLock lock(scratch_mu_);
  free_scratch_.push_back(std::move(scratch));
}

int64_t CpuBackend::ScratchBytes(const FormWeights& f, std::span<const SequenceShape> batch,
                                 bool self_attention) const {
  const int64_t formula =
      ForwardScratchBytes(f, batch, self_attention, threads_, max_score_scratch_bytes_, summed_order_,
                          summed_value_group_bytes_);
  if (gemm_ != GemmLibrary::kEigen) return formula;
  // The formula counts 4 MiB of packing per thread (oneDNN's, and Eigen's on small caches); Eigen's
  // panels grow with the product and the CPU's caches, so its largest GEMM of this forward, per
  // thread (Gemm splits the columns: a thread's share), replaces that figure.
  const int64_t d = f.config.d_model;
  const auto share = [&](int64_t cols) { return (cols + threads_ - 1) / threads_; };
  const auto packing = [&](int64_t rows, int64_t depth, int64_t cols) {
    return GemmPackingBytes(GemmLibrary::kEigen, rows, depth, share(cols));
  };
  int64_t tx = 0, tc = 0, largest = 0;
  for (const SequenceShape& s : batch) {
    tx += s.n;
    tc += s.m;
    const int64_t keys = s.keys < 0 ? s.m : s.keys;
    if (f.concat_then_project()) continue;
    largest = std::max(largest, SummedMixesFirst(f, s, summed_order_) ? packing(s.n, d, d)  // a head's W_M_i
                                                                      : packing(s.n, keys * f.config.heads, d));
  }
  largest = std::max({largest, packing(tx, d, f.q_cols + f.k_cols), packing(tc, d, f.value_cols)});
  if (f.concat_then_project()) largest = std::max(largest, packing(tx, f.out_rows, d));
  return formula + int64_t{threads_} * std::max<int64_t>(0, largest - (int64_t{4} << 20));
}

int64_t CpuBackend::RetainedScratchBytes() const {
  MutexLock lock(scratch_mu_);
  int64_t bytes = 0;
  for (const auto& s : free_scratch_) bytes += s->Bytes();
  return bytes;
}

StatusOr<std::shared_ptr<const ResidentForm>> CpuBackend::Upload(std::shared_ptr<const FormWeights> form) {
  if (!form) return InvalidArgumentError("Upload: no form given");
  ATTNSERVE_RETURN_IF_ERROR(CheckHeadCombine(*form));
  const int64_t panel_width = weight_layout_ == WeightLayout::kPlain ? 0 : PanelWidth();
  const PanelPrecision precision =
      weight_layout_ == WeightLayout::kPackedBf16 ? PanelPrecision::kBfloat16 : PanelPrecision::kFloat32;
  return std::shared_ptr<const ResidentForm>(
      std::make_shared<CpuResidentForm>(std::move(form), panel_width, precision));
}

Status CpuBackend::Forward(const ResidentForm& resident, std::span<const Sequence> batch) {
  const FormWeights& f = resident.weights();
  if (batch.empty()) return OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(ValidateBatch(f.config, batch));
  // The team first: its helpers wake while the scratch and the inputs are made ready.
  // Both are returned to their pools however the forward ends.
  std::unique_ptr<ComputeTeam> team = TakeTeam();
  team->Hold();
  std::unique_ptr<ForwardScratch> scratch = TakeScratch();
  struct Return {
    CpuBackend* backend;
    std::unique_ptr<ComputeTeam>& team;
    std::unique_ptr<ForwardScratch>& scratch;
    ~Return() {
      team->Release();
      backend->ReturnTeam(std::move(team));
      backend->ReturnScratch(std::move(scratch));
    }
  } give_back{this, team, scratch};
  const Compute run{gemm_, threads_, summed_order_, team.get()};
  CpuOps ops(run, dynamic_cast<const CpuResidentForm*>(&resident), max_score_scratch_bytes_,
             summed_value_group_bytes_, *scratch);
  return RunAttention(ops, f, HostWeights(f), batch);
}

}  // namespace attnserve
