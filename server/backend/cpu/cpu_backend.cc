#include "server/backend/cpu/cpu_backend.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/core/rope.h"

namespace attnserve {

// The memory one forward works in, kept for the next: the stacked inputs and contexts, Q, K,
// the value block, O, Y and the summed form's A_cat. Freed and allocated per call, the value
// block alone (40 MB at bert-base, summed) was paged in and zeroed by the kernel every time:
// 20% of the summed form's time there (perf: clear_page_erms, exc_page_fault).
struct ForwardScratch {
  std::vector<float> x, c, q, k, val, o, y, a_cat;  // a_cat also holds the summed form's mixes

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

class CpuResidentForm final : public ResidentForm {
 public:
  explicit CpuResidentForm(std::shared_ptr<const FormWeights> w) : w_(std::move(w)) {}
  const FormWeights& weights() const override { return *w_; }

 private:
  std::shared_ptr<const FormWeights> w_;
};

// How a forward computes: which GEMM library, on how many threads, in which summed order.
struct Compute {
  GemmLibrary gemm;
  int threads;
  SummedOrder summed_order;  // when the summed form mixes first (SummedMixesFirst)
};

// Where the backend's own SkinnyGemm beats the GEMM library for a block of x's rows × `cols`
// columns of w (docs/benchmarks.md, "The GEMM library"): against Eigen from 2 to 16 rows, against
// oneDNN only at 2–4 rows (from 8 rows oneDNN is up to 1.7× faster).

bool UseSkinnyGemm(GemmLibrary library, int64_t rows, int64_t cols) {
  constexpr int64_t kMaxRowsAgainstOneDnn = 4;
  return SkinnyGemmPays(rows, cols) && (library == GemmLibrary::kEigen || rows <= kMaxRowsAgainstOneDnn);
}

// y = x · w (+ bias) with the threads splitting w's columns: each thread streams its own share
// of the weights once. (A split by rows of y, Eigen's own, makes every thread pack the whole
// weight matrix when the batch has few tokens: 2 threads were 3x slower than 1 there.)
// With `accumulate`, y += x · w instead.
void Gemm(Compute run, ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate = false) {
  constexpr int64_t kColumnAlign = 64;  // whole cache lines and register blocks per thread
  const int64_t chunks = std::min<int64_t>(run.threads, (w.cols + kColumnAlign - 1) / kColumnAlign);
  const int64_t chunk_cols = ((w.cols + chunks - 1) / chunks + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
#pragma omp parallel for num_threads(run.threads) schedule(static) if (chunks > 1)
  for (int64_t t = 0; t < chunks; ++t) {
    const int64_t c0 = t * chunk_cols, count = std::min(chunk_cols, w.cols - c0);
    if (count <= 0) continue;
    if (!accumulate && UseSkinnyGemm(run.gemm, x.rows, count)) {
      SkinnyGemm(x, w.ColBlock(c0, count), y.ColBlock(c0, count));
    } else {
      GemmOnThisThread(run.gemm, x, w.ColBlock(c0, count), /*transpose_w=*/false, 1.0f, y.ColBlock(c0, count),
                       accumulate);
    }
    if (bias != nullptr) AsEigen(y.ColBlock(c0, count)).rowwise() += BiasMap(bias + c0, count);
  }
}

// y = x · W_in[:, cols] + b_in[cols] for the column range [col0, col0 + count) of W_in.
void ProjectColumns(Compute run, const FormWeights& f, ConstMatrixView x, int64_t col0, int64_t count,
                    MatrixView y) {
  const ConstMatrixView w_in(f.w_in.data() + col0, f.config.d_model, count, f.in_cols());
  const bool has_bias = static_cast<int64_t>(f.b_in.size()) >= col0 + count;
  Gemm(run, x, w_in, has_bias ? f.b_in.data() + col0 : nullptr, y);
}

// `buffer` grown to at least `count` floats, as a [rows, cols] view. Buffers only grow: one that
// is reused is neither paged in by the kernel nor zeroed again (see ForwardScratch).
MatrixView Reserve(std::vector<float>& buffer, int64_t rows, int64_t cols) {
  if (static_cast<int64_t>(buffer.size()) < rows * cols) buffer.resize(rows * cols);
  return MatrixView(buffer.data(), rows, cols);
}

// The stacked rows of several blocks as one view: the block itself when there is one, else a
// copy into `storage`.
ConstMatrixView StackRows(const std::vector<ConstMatrixView>& blocks, std::vector<float>& storage) {
  if (blocks.size() == 1) return blocks[0];
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

// Whether this forward runs the sequence mixing its keys first (SummedMixesFirst, the core's rule).
bool MixesFirst(Compute run, const FormWeights& f, const Sequence& s) {
  return SummedMixesFirst(f, {.n = s.n(), .m = s.m(), .keys = s.visible_keys()}, run.summed_order);
}

// The projections of a whole batch: Q of every query token, K and the value block of every
// context token, stacked in sequence order.
struct Projection {
  MatrixView q, k;       // [Tx, q_cols], [Tc, k_cols] (may share storage, with ld = their sum)
  ConstMatrixView c;     // [Tc, d_model]: the stacked contexts (the inputs, in self-attention)
  ConstMatrixView val;   // the value block of the sequences that project first, contiguous: the
                         // summed form reads a sequence's rows as [m·h, d]
  std::vector<int64_t> x_row, c_row, val_row;  // first row of each sequence in q, k (and c), val
};

Projection Project(Compute run, const FormWeights& f, std::span<const Sequence> batch, ForwardScratch& scratch) {
  Projection p;
  std::vector<ConstMatrixView> xs, cs;
  int64_t tx = 0, tc = 0;
  bool all_self = true;
  for (const Sequence& s : batch) {
    p.x_row.push_back(tx);
    p.c_row.push_back(tc);
    tx += s.n();
    tc += s.m();
    xs.push_back(s.input);
    cs.push_back(s.keys_source());
    all_self = all_self && s.self_attention();
  }
  const ConstMatrixView x = StackRows(xs, scratch.x);
  const ConstMatrixView c = all_self ? x : StackRows(cs, scratch.c);
  if (all_self) {
    // Self-attention: Q and K come from the same rows, so one GEMM makes both.
    const MatrixView qk = Reserve(scratch.q, tx, f.q_cols + f.k_cols);
    ProjectColumns(run, f, x, 0, f.q_cols + f.k_cols, qk);
    p.q = qk.ColBlock(0, f.q_cols);
    p.k = qk.ColBlock(f.q_cols, f.k_cols);
  } else {
    const MatrixView q = Reserve(scratch.q, tx, f.q_cols), k = Reserve(scratch.k, tc, f.k_cols);
    ProjectColumns(run, f, x, 0, f.q_cols, q);
    ProjectColumns(run, f, c, f.q_cols, f.k_cols, k);
    p.q = q;
    p.k = k;
  }
  if (f.config.rope_theta > 0) {
    // Q and K live in this forward's scratch; rotate each sequence's rows in place.
    const int64_t dh = f.config.d_head;
    for (size_t r = 0; r < batch.size(); ++r) {
      const Sequence& s = batch[r];
      ApplyRope(p.q.RowBlock(p.x_row[r], s.n()), f.config.heads, dh, f.config.rope_theta, s.position_offset);
      ApplyRope(p.k.RowBlock(p.c_row[r], s.m()), f.config.kv_heads, dh, f.config.rope_theta, s.key_position_offset());
    }
  }
  p.c = c;
  // The value block, for the sequences that project first: one GEMM over every context row when
  // all do, else one per such sequence (a summed sequence that mixes first needs none).
  int64_t val_rows = 0;
  for (size_t r = 0; r < batch.size(); ++r) {
    p.val_row.push_back(val_rows);
    if (!MixesFirst(run, f, batch[r])) val_rows += batch[r].m();
  }
  const MatrixView val = Reserve(scratch.val, val_rows, f.value_cols);
  if (val_rows == tc) {
    ProjectColumns(run, f, c, f.q_cols + f.k_cols, f.value_cols, val);
  } else {
    for (size_t r = 0; r < batch.size(); ++r) {
      if (MixesFirst(run, f, batch[r])) continue;
      ProjectColumns(run, f, c.RowBlock(p.c_row[r], batch[r].m()), f.q_cols + f.k_cols, f.value_cols,
                     val.RowBlock(p.val_row[r], batch[r].m()));
    }
  }
  p.val = val;
  return p;
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

// The max of a row of scores, or NaN when any score is not finite: a dot product that overflowed
// float32 on the way (±inf, or inf − inf = NaN), whose true value may be anything, the row's
// max included — so the row is recomputed in float64. Two vectorised passes (the max and the
// min, both propagating NaN); allFinite() was a scalar loop, 60% of the softmax's time.
template <typename Row>
float RowMax(const Row& row) {
  const float top = row.template maxCoeff<Eigen::PropagateNaN>();
  return std::isfinite(row.template minCoeff<Eigen::PropagateNaN>()) ? top : std::numeric_limits<float>::quiet_NaN();
}

// A = softmax(scale · Q_i K_g(i)^T + mask) for the query rows [row0, row0 + rows) of the
// sequence, into `a` [rows, keys]. `keys` are those the block's last row sees: a causal block
// skips the keys none of its rows sees, and within the block a key a row does not see is 0.
void HeadScores(GemmLibrary gemm, const FormWeights& f, const Projection& p, const Sequence& s, size_t r,
                int64_t head, int64_t row0, int64_t rows, RowMatrix& a) {
  const LayerConfig& c = f.config;
  const int64_t keys = VisibleKeys(s, row0 + rows - 1), dh = c.d_head;
  const ConstMatrixView q = p.q.RowBlock(p.x_row[r] + row0, rows).ColBlock(head * dh, dh);
  const ConstMatrixView k = p.k.RowBlock(p.c_row[r], keys).ColBlock(c.KvHeadOf(head) * dh, dh);
  a.resize(rows, keys);
  GemmOnThisThread(gemm, q, k, /*transpose_w=*/true, c.SoftmaxScale(), MatrixView(a.data(), rows, keys));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t visible = VisibleKeys(s, row0 + row);
    auto v = a.row(row).head(visible).array();
    const float top = RowMax(v);
    if (std::isfinite(top)) {
      v = (v - top).exp();
      v /= v.sum();
    } else {
      SoftmaxRowInFloat64(AsEigen(q).row(row), AsEigen(k).topRows(visible), c.SoftmaxScale(), a.row(row).head(visible));
    }
    a.row(row).tail(keys - visible).setZero();
  }
}

// A thread's working memory for tiled attention, kept across its tasks.
struct TileScratch {
  RowMatrix s;                   // one tile's scores, then its probabilities [stacked rows, keys]
  RowMatrix q, o;                // the stacked heads' queries and running output (G > 1 only)
  Eigen::VectorXf max, sum;      // the online softmax's running max and sum, per stacked row
  std::vector<int64_t> exact;    // stacked rows whose float32 scores were not all finite
  Eigen::RowVectorXf row;        // one such row's probabilities, from SoftmaxRowInFloat64
  std::vector<ConstMatrixView> q_views;  // a task's heads' queries and outputs (RunAttentionTask),
  std::vector<MatrixView> out_views;     // kept so that a task allocates nothing
};

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
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyTile) {
    const int64_t width = std::min(kKeyTile, keys - k0);
    t.s.resize(stacked, width);
    GemmOnThisThread(gemm, queries, k.RowBlock(k0, width), /*transpose_w=*/true, scale,
                     MatrixView(t.s.data(), stacked, width));
    for (int64_t r = 0; r < stacked; ++r) {
      const int64_t seen = std::clamp<int64_t>(VisibleKeys(s, row0 + r % rows) - k0, 0, width);
      auto p = t.s.row(r).head(seen).array();
      t.s.row(r).tail(width - seen).setZero();
      if (seen == 0) continue;  // a causal row that sees none of this tile: its output stands
      const float tile_top = RowMax(p);
      if (!std::isfinite(tile_top)) {
        t.exact.push_back(r);  // once per tile that overflows: made unique below
        p.setZero();
        continue;
      }
      const float top = std::max(t.max(r), tile_top);
      const float rescale = std::exp(t.max(r) - top);  // 0 on the first tile (max = -inf)
      p = (p - top).exp();
      t.sum(r) = t.sum(r) * rescale + p.sum();
      t.max(r) = top;
      if (k0 > 0) AsEigen(acc).row(r) *= rescale;
    }
    // The first tile sets the output (every row sees key 0), later ones add to it.
    GemmOnThisThread(gemm, ConstMatrixView(t.s.data(), stacked, width), v.RowBlock(k0, width),
                     /*transpose_w=*/false, 1.0f, acc, /*accumulate=*/k0 > 0);
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

// The attention tasks of one sequence's query rows [row0, row0 + rows): blocks of at most
// kQueryTile stacked rows, for every set of StackedHeads heads.
struct AttentionTask {
  size_t r;            // the sequence
  int64_t first_head;  // of the set
  int64_t row0, rows;  // the query block
};

void AddAttentionTasks(const FormWeights& f, size_t r, int64_t row0, int64_t rows, std::vector<AttentionTask>& tasks) {
  const int64_t set = StackedHeads(f), block = std::max<int64_t>(1, kQueryTile / set);
  for (int64_t b = row0; b < row0 + rows; b += block) {
    for (int64_t head = 0; head < f.config.heads; head += set) {
      tasks.push_back({r, head, b, std::min(block, row0 + rows - b)});
    }
  }
}

// Runs one task: the set's queries and keys from the projection, its values `values` (the
// sequence's rows of what the set's heads mix, [m, d_v]), and each head's output at `out(head)`
// (a [rows, d_v] view of the task's rows).
template <typename OutputOf>
void RunAttentionTask(GemmLibrary gemm, const FormWeights& f, const Projection& p, std::span<const Sequence> batch,
                      const AttentionTask& task, ConstMatrixView values, OutputOf&& out, TileScratch& t) {
  const LayerConfig& c = f.config;
  const Sequence& s = batch[task.r];
  const int64_t set = StackedHeads(f), dh = c.d_head, kv = c.KvHeadOf(task.first_head);
  t.q_views.clear();
  t.out_views.clear();
  for (int64_t i = task.first_head; i < task.first_head + set; ++i) {
    t.q_views.push_back(p.q.RowBlock(p.x_row[task.r] + task.row0, task.rows).ColBlock(i * dh, dh));
    t.out_views.push_back(out(i));
  }
  const int64_t keys = s.visible_keys();
  const ConstMatrixView k = p.k.RowBlock(p.c_row[task.r], keys).ColBlock(kv * dh, dh);
  AttendTiled(gemm, s, c.SoftmaxScale(), t.q_views, k, values.RowBlock(0, keys), task.row0, t.out_views, t);
}

// Factored and low-rank forms: O_i = A_i Val_i into O's columns of head i (tiled, AttendTiled),
// then Y = O W_out + b.
void MixProjected(Compute run, const FormWeights& f, const Projection& p, std::span<const Sequence> batch,
                  ForwardScratch& scratch) {
  const int64_t tx = p.q.rows, d = f.config.d_model;
  const MatrixView o = Reserve(scratch.o, tx, f.out_rows);
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < batch.size(); ++r) AddAttentionTasks(f, r, 0, batch[r].n(), tasks);
#pragma omp parallel num_threads(run.threads)
  {
    TileScratch t;
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < tasks.size(); ++i) {
      const AttentionTask& task = tasks[i];
      const auto out = [&](int64_t head) {
        return o.RowBlock(p.x_row[task.r] + task.row0, task.rows).ColBlock(f.mix_offset[head], f.value_width[head]);
      };
      // The set's heads mix the same value columns (StackedHeads): their group's.
      const ConstMatrixView values = p.val.RowBlock(p.val_row[task.r], batch[task.r].m())
                                         .ColBlock(f.value_offset[task.first_head], f.value_width[task.first_head]);
      RunAttentionTask(run.gemm, f, p, batch, task, values, out, t);
    }
  }
  const ConstMatrixView w_out(f.w_out.data(), f.out_rows, d);
  // One sequence with a dense output: the GEMM writes straight into it.
  const bool in_place = batch.size() == 1 && !batch[0].output.empty();
  const MatrixView y = in_place ? batch[0].output : Reserve(scratch.y, tx, d);
  Gemm(run, o, w_out, f.b_out.empty() ? nullptr : f.b_out.data(), y);
  if (!in_place) {
    for (size_t r = 0; r < batch.size(); ++r) {
      AsEigen(batch[r].output) = AsEigen(ConstMatrixView(y.RowBlock(p.x_row[r], batch[r].n())));
    }
  }
}

// The query rows one task of the summed form's project-first score loop takes: enough tasks for
// every thread (4 each, for balance), few enough that each runs a GEMM of some size.
int64_t RowsPerTask(int64_t rows, int threads) {
  constexpr int64_t kMinRows = 4, kTasksPerThread = 4;
  return std::clamp<int64_t>(rows / (int64_t{threads} * kTasksPerThread), kMinRows, kSummedBlockRows);
}

// A part of the summed form's work: query rows [row0, row0 + rows) of sequence r, and where its
// A_cat or mixes start in the chunk's scratch. A sequence that projects first is one part; one
// that mixes first is cut into parts of SummedRowsPerPart rows, so a long sequence's mixes
// never exceed the scratch bound.
struct SummedPart {
  size_t r;
  int64_t row0, rows;
  int64_t offset = 0;
};

// The summed form's scratch for a part: A_cat [n, L·h] when its sequence projects first, its
// heads' mixes [rows, h·d] when it mixes first (MixesFirst).
int64_t SummedPartFloats(Compute run, const FormWeights& f, const Sequence& s, const SummedPart& part) {
  return MixesFirst(run, f, s) ? part.rows * f.value_cols : s.n() * s.visible_keys() * f.config.heads;
}

// Project first: the part's A_cat rows [row0, row0 + rows) (one task: a block of query rows with
// every head: the heads of a row interleave in A_cat, so tasks split by head would write the same
// cache lines from different threads).
void ScoreIntoACat(Compute run, const FormWeights& f, const Projection& p, const Sequence& s, size_t r,
                   int64_t row0, int64_t rows, float* a_cat, RowMatrix& a) {
  const int64_t heads = f.config.heads, width = s.visible_keys() * heads;  // A_cat's row
  float* const block_rows = a_cat + row0 * width;
  int64_t seen = 0;  // the keys this block's rows see (all heads alike)
  for (int64_t i = 0; i < heads; ++i) {
    HeadScores(run.gemm, f, p, s, r, i, row0, rows, a);
    seen = a.cols();
    for (int64_t q = 0; q < rows; ++q) {
      float* dst = block_rows + q * width + i;
      for (int64_t j = 0; j < seen; ++j) dst[j * heads] = a(q, j);
    }
  }
  // Keys beyond what the block sees (a causal block): zero, as A_cat's scratch is reused.
  for (int64_t q = 0; q < rows; ++q) std::fill(block_rows + q * width + seen * heads, block_rows + (q + 1) * width, 0.0f);
}

// Summed form, for some parts of the batch, in each sequence's association order
// (SummedMixesFirst, server/core/forms.h):
//   - Project first. Val's rows are [h·d] wide and contiguous, so a sequence's first L rows are
//     also the [L·h, d] matrix [M_1; …; M_h] with rows (key, head); A_cat puts A_i[q, j] at
//     column j·h + i to match, and the head sum is one GEMM: Y = A_cat · Val + b_eff.
//   - Mix first. Head i's mix A_i C[:L] is an attention whose values are the context, run tiled
//     (AttendTiled) into columns i·d of the part's mixes [rows, h·d]; then
//     Y = Σ_i mixes_i W_M_i + b_eff reads W_M_i straight from the value block of W_in.
void MixSummed(Compute run, const FormWeights& f, const Projection& p, std::span<const Sequence> batch,
               std::span<const SummedPart> parts, ForwardScratch& scratch) {
  const int64_t heads = f.config.heads, d = f.config.d_model;
  int64_t floats = 0, project_rows = 0;
  for (const SummedPart& part : parts) {
    floats = std::max(floats, part.offset + SummedPartFloats(run, f, batch[part.r], part));
    if (!MixesFirst(run, f, batch[part.r])) project_rows += part.rows;
  }
  // Tasks: blocks of a projecting part's rows (every head); tiled attention tasks of a mixing one.
  struct ScoreTask {
    size_t part;
    int64_t row0, rows;
  };
  std::vector<ScoreTask> score_tasks;
  std::vector<AttentionTask> attention_tasks;
  std::vector<size_t> attention_part;
  const int64_t block = RowsPerTask(project_rows, run.threads);
  for (size_t i = 0; i < parts.size(); ++i) {
    const SummedPart& part = parts[i];
    if (MixesFirst(run, f, batch[part.r])) {
      AddAttentionTasks(f, part.r, part.row0, part.rows, attention_tasks);
      attention_part.resize(attention_tasks.size(), i);
      continue;
    }
    for (int64_t row0 = 0; row0 < part.rows; row0 += block) score_tasks.push_back({i, row0, std::min(block, part.rows - row0)});
  }
  float* const work = Reserve(scratch.a_cat, floats, 1).data;
  const size_t task_count = score_tasks.size() + attention_tasks.size();
#pragma omp parallel num_threads(run.threads)
  {
    RowMatrix a;
    TileScratch t;
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < task_count; ++i) {
      if (i < score_tasks.size()) {
        const ScoreTask& task = score_tasks[i];
        const SummedPart& part = parts[task.part];
        ScoreIntoACat(run, f, p, batch[part.r], part.r, task.row0, task.rows, work + part.offset, a);
        continue;
      }
      const size_t j = i - score_tasks.size();
      const AttentionTask& task = attention_tasks[j];
      const SummedPart& part = parts[attention_part[j]];
      const MatrixView mixes(work + part.offset, part.rows, f.value_cols);
      const auto out = [&](int64_t head) {
        return mixes.RowBlock(task.row0 - part.row0, task.rows).ColBlock(f.value_offset[head], f.value_width[head]);
      };
      // Every head mixes the context itself: Y's head sum projects the mixes afterwards.
      RunAttentionTask(run.gemm, f, p, batch, task, p.c.RowBlock(p.c_row[task.r], batch[task.r].m()), out, t);
    }
  }
  const float* bias = f.b_out.empty() ? nullptr : f.b_out.data();
  auto head_sum = [&](const SummedPart& part, int gemm_threads) {
    const Sequence& s = batch[part.r];
    const Compute on{run.gemm, gemm_threads, run.summed_order};
    const MatrixView y = s.output.RowBlock(part.row0, part.rows);
    if (MixesFirst(run, f, s)) {
      const ConstMatrixView mixes(work + part.offset, part.rows, f.value_cols);
      for (int64_t i = 0; i < heads; ++i) {
        const ConstMatrixView w_m(f.w_in.data() + f.q_cols + f.k_cols + f.value_offset[i], d, f.value_width[i],
                                  f.in_cols());
        // The first head's product (with the bias) sets Y; the others add to it.
        Gemm(on, mixes.ColBlock(f.value_offset[i], f.value_width[i]), w_m, i == 0 ? bias : nullptr, y,
             /*accumulate=*/i > 0);
      }
      return;
    }
    const int64_t keys = s.visible_keys();
    const ConstMatrixView a(work + part.offset, s.n(), keys * heads);
    const ConstMatrixView m(p.val.row(p.val_row[part.r]), keys * heads, d);
    Gemm(on, a, m, bias, y);
  };
  if (parts.size() == 1) {
    head_sum(parts[0], run.threads);  // one part: its GEMM's columns across the threads
    return;
  }
#pragma omp parallel for schedule(dynamic) num_threads(run.threads)
  for (size_t i = 0; i < parts.size(); ++i) head_sum(parts[i], 1);  // many: a part per thread
}

// The summed form's parts (SummedPart), grouped into chunks whose scratch stays under the bound
// (a single part larger than the bound — a projecting sequence when mixing first is not allowed —
// runs alone), each chunk run by MixSummed.
void RunSummed(Compute run, const FormWeights& f, const Projection& p, std::span<const Sequence> batch,
               int64_t max_score_scratch_bytes, ForwardScratch& scratch) {
  std::vector<SummedPart> parts;
  const int64_t part_rows = SummedRowsPerPart(f, max_score_scratch_bytes);
  for (size_t r = 0; r < batch.size(); ++r) {
    const int64_t n = batch[r].n(), step = MixesFirst(run, f, batch[r]) ? part_rows : n;
    for (int64_t row0 = 0; row0 < n; row0 += step) parts.push_back({r, row0, std::min(step, n - row0)});
  }
  const int64_t cap = max_score_scratch_bytes / int64_t{sizeof(float)};
  size_t first = 0;
  while (first < parts.size()) {
    int64_t floats = 0;
    size_t last = first;
    do {
      parts[last].offset = floats;
      floats += SummedPartFloats(run, f, batch[parts[last].r], parts[last]);
      ++last;
    } while (last < parts.size() && floats + SummedPartFloats(run, f, batch[parts[last].r], parts[last]) <= cap);
    MixSummed(run, f, p, batch, std::span<const SummedPart>(parts).subspan(first, last - first), scratch);
    first = last;
  }
}

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
      max_score_scratch_bytes_(options.max_score_scratch_bytes),
      max_retained_scratch_bytes_(options.max_retained_scratch_bytes),
      summed_order_(OrderOf(options)) {
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

void CpuBackend::ReturnScratch(std::unique_ptr<ForwardScratch> scratch) {
  if (scratch->Bytes() > max_retained_scratch_bytes_) return;  // a rare large batch: not kept
  MutexLock lock(scratch_mu_);
  free_scratch_.push_back(std::move(scratch));
}

int64_t CpuBackend::RetainedScratchBytes() const {
  MutexLock lock(scratch_mu_);
  int64_t bytes = 0;
  for (const auto& s : free_scratch_) bytes += s->Bytes();
  return bytes;
}

StatusOr<std::shared_ptr<const ResidentForm>> CpuBackend::Upload(std::shared_ptr<const FormWeights> form) {
  if (!form) return InvalidArgumentError("Upload: no form given");
  return std::shared_ptr<const ResidentForm>(std::make_shared<CpuResidentForm>(std::move(form)));
}

Status CpuBackend::Forward(const ResidentForm& resident, std::span<const Sequence> batch) {
  const FormWeights& f = resident.weights();
  if (batch.empty()) return OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(ValidateBatch(f.config, batch));
  const Compute run{gemm_, threads_, summed_order_};
  // Returned to the pool however the forward ends.
  std::unique_ptr<ForwardScratch> scratch = TakeScratch();
  struct Return {
    CpuBackend* backend;
    std::unique_ptr<ForwardScratch>& scratch;
    ~Return() { backend->ReturnScratch(std::move(scratch)); }
  } give_back{this, scratch};
  const Projection p = Project(run, f, batch, *scratch);
  if (f.has_output_projection()) {
    MixProjected(run, f, p, batch, *scratch);
    return OkStatus();
  }
  // The summed form's A_cat or mixes, in parts and chunks under the bound (RunSummed).
  RunSummed(run, f, p, batch, max_score_scratch_bytes_, *scratch);
  return OkStatus();
}

}  // namespace attnserve
