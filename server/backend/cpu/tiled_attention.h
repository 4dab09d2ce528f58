// The CPU backend's attention kernels, each one task on the calling thread (CpuOps, cpu_ops.h,
// spreads the tasks over the forward's compute team):
//   - tiled attention (RunAttentionTask): a block of one sequence's query rows, for the heads
//     that share a K/V tile (StackedHeads), the scores and the mix key tile by key tile with an
//     online softmax: no n × L matrix exists, memory is linear in the sequence length;
//   - the summed form's scores projecting first (ScoreIntoACat): a block of query rows of
//     A_cat [n, L·h], every head's softmax row at column j·h + i.
// A row whose float32 scores are not all finite is recomputed exactly in float64 in both.
// Thread-safety: reentrant; a task writes only its own rows of the output and its TileScratch.
#pragma once

#include <cstdint>
#include <vector>

#include "server/backend/attention/device_ops.h"
#include "server/backend/cpu/eigen_views.h"
#include "server/backend/cpu/gemm.h"

namespace attnserve {

// A thread's working memory for tiled attention, kept across its tasks.
struct TileScratch {
  RowMatrix s;                           // one tile's scores, then its probabilities [stacked rows, keys]
  RowMatrix kt;                          // the tile's keys transposed and scaled, [d_h, keys] (OwnTileKernel)
  RowMatrix q, o;                        // the stacked heads' queries and running output (G > 1 only)
  Eigen::VectorXf max, sum;              // the online softmax's running max and sum, per stacked row
  std::vector<int64_t> exact;            // stacked rows whose float32 scores were not all finite
  Eigen::RowVectorXf row;                // one such row's probabilities, from SoftmaxRowInFloat64
  std::vector<ConstMatrixView> q_views;  // a task's heads' queries and outputs (RunAttentionTask),
  std::vector<MatrixView> out_views;     // kept so that a task allocates nothing
};

// The attention tasks of one range's query rows: blocks of at most kQueryTile stacked rows,
// for every set of StackedHeads heads.
struct AttentionTask {
  size_t range;        // in the job
  int64_t first_head;  // of the set
  int64_t row0, rows;  // the query block, rows of the range's sequence
};

// Appends the tasks of the job's range `range`, query rows [row0, row0 + rows).
void AddAttentionTasks(const FormWeights& f, size_t range, int64_t row0, int64_t rows,
                       std::vector<AttentionTask>& tasks);

// Runs one task: the set's queries and keys from its range, the values its heads mix (the set's
// heads mix the same value columns, StackedHeads: their group's, or the whole context), and each
// head's output in its columns of the range's out.
void RunAttentionTask(GemmLibrary gemm, const AttentionJob& job, const AttentionTask& task, TileScratch& t);

// Project first: A_cat's rows [row0, row0 + rows) of the range's sequence, into `a_cat` (the
// range's A_cat, [n, L·h] with L its visible keys), `a` a head's scores on the way. One task is
// a block of query rows with every head: the heads of a row interleave in A_cat, so tasks split
// by head would write the same cache lines from different threads.
void ScoreIntoACat(GemmLibrary gemm, const FormWeights& f, const AttentionRange& range, int64_t row0, int64_t rows,
                   float* a_cat, RowMatrix& a);

}  // namespace attnserve
