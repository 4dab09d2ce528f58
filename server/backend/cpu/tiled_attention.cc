#include "server/backend/cpu/tiled_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "server/backend/cpu/skinny_gemm.h"
#include "server/backend/cpu/softmax_rows.h"

namespace attnserve {

namespace {

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
// L3. Asked for all at once, the waits overlap (with the kernel's own prefetch of x, SkinnyGemm;
// docs/journal/benchmarks-journal.md, "Attention's operands asked for ahead"). The cap keeps a
// task's Q, K and V tiles (3 × 128 KiB) inside the smallest L2 of the CPUs this runs on (512 KiB,
// Zen 3).
void PrefetchToL2(ConstMatrixView m) {
  constexpr int64_t kMaxBytes = 128 * 1024;
  const int64_t rows = std::min(m.rows, kMaxBytes / std::max<int64_t>(1, m.cols * int64_t{sizeof(float)}));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < m.cols; c += kCacheLineFloats) {
      __builtin_prefetch(m.data + r * m.ld + c, /*rw=*/0, /*locality=*/2);
    }
  }
}

// Whether attention's two products per tile run on the backend's own register-blocked kernel
// (SkinnyGemm) rather than the GEMM library. A tile's operands are already in cache (a query
// block, a key tile and its values, at most 512 KiB), so packing them, as a library GEMM does on
// every call, is cost without return. The AVX-512 kernel measured faster than oneDNN on both
// products; the AVX2 one (6 × 16 blocks) no clear win, and not measured on an AVX2-only CPU, so
// AVX2 keeps the library (docs/journal/benchmarks-journal.md, "Attention's own kernel").
// The scores take it from kOwnScoresMinKeys keys: fewer fill part of its 64-column block only
// (slower there, the same section). The mix takes it for values of at most kOwnMixMaxCols columns: the kernel
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
                 ConstMatrixView k, ConstMatrixView v, int64_t row0, std::span<const MatrixView> out, TileScratch& t) {
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

}  // namespace

void AddAttentionTasks(const FormWeights& f, size_t range, int64_t row0, int64_t rows,
                       std::vector<AttentionTask>& tasks) {
  const int64_t set = StackedHeads(f), block = std::max<int64_t>(1, kQueryTile / set);
  for (int64_t b = row0; b < row0 + rows; b += block) {
    for (int64_t head = 0; head < f.config.heads; head += set) {
      tasks.push_back({range, head, b, std::min(block, row0 + rows - b)});
    }
  }
}

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
  for (int64_t q = 0; q < rows; ++q)
    std::fill(block_rows + q * width + seen * heads, block_rows + (q + 1) * width, 0.0f);
}

}  // namespace attnserve
