// The device operations the attention skeleton (skeleton.h) runs a forward with, in the manner
// of CTranslate2's primitives<Device>: the skeleton decides what is computed, in which order and
// into which buffers; a device decides only how one operation runs on it. The CPU backend
// implements them with oneDNN/Eigen GEMMs, OpenMP and tiled attention (cpu/), the CUDA backend
// with cuBLAS and its kernels on a lane's stream (cuda/); the CUDA emulation then emulates only
// what these call.
//
// Every matrix is a MatrixView over the device's own memory (host memory on the CPU, device
// memory on a GPU): the skeleton only offsets views, it never reads or writes through them.
// Thread-safety: one DeviceOps serves one forward on one thread.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "server/backend/attention/plan.h"
#include "server/core/forms.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/core/tensor.h"

namespace attnserve {

// Which of a form's weight matrices (DeviceWeights) a GEMM multiplies by.
enum class WeightMatrix { kIn, kOut };

inline std::string_view WeightMatrixName(WeightMatrix m) { return m == WeightMatrix::kIn ? "W_in" : "W_out"; }

// A block of one of the form's weight matrices, named by the matrix and its place in it, not by
// its address: rows [row0, row0 + view.rows) and columns [col0, col0 + view.cols) of `matrix`,
// where `view` is that block of the matrix the device holds. A device that keeps the weights in
// another layout as well (the CPU's packed panels) finds the same block there by the name,
// whatever memory `view` points into.
struct WeightBlock {
  WeightMatrix matrix = WeightMatrix::kIn;
  int64_t row0 = 0, col0 = 0;
  ConstMatrixView view;

  bool empty() const { return view.empty(); }
  // Columns [first, first + count) of this block.
  WeightBlock ColBlock(int64_t first, int64_t count) const {
    return {matrix, row0, col0 + first, view.ColBlock(first, count)};
  }
};

// A form's weights as the device holds them.
struct DeviceWeights {
  WeightBlock w_in;             // [d_model, in_cols]: W_Q | W_K | the value block's weights
  const float* b_in = nullptr;  // [in_cols], or null (FormWeights::b_in may cover Q and K only)
  // [out_rows, d_model]: concat-then-project forms only (an empty view for the others)
  WeightBlock w_out{WeightMatrix::kOut, 0, 0, ConstMatrixView()};
  const float* b_out = nullptr;  // [d_model], or null
};

// The form's weights at the device's copies of FormWeights' w_in, b_in, w_out and b_out: the
// shapes are the form's, a bias or output projection the form lacks is null.
inline DeviceWeights WeightsAt(const FormWeights& f, const float* w_in, const float* b_in, const float* w_out,
                               const float* b_out) {
  DeviceWeights w;
  w.w_in = {WeightMatrix::kIn, 0, 0, ConstMatrixView(w_in, f.config.d_model, f.in_cols())};
  w.b_in = f.b_in.empty() ? nullptr : b_in;
  if (!f.w_out.empty()) w.w_out.view = ConstMatrixView(w_out, f.out_rows, f.config.d_model);
  w.b_out = f.b_out.empty() ? nullptr : b_out;
  return w;
}

// The weights where FormWeights holds them, in host memory (the CPU backend's).
inline DeviceWeights HostWeights(const FormWeights& f) {
  return WeightsAt(f, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data());
}

// The memory one forward computes in, on the device, as DeviceOps::Prepare laid it out.
struct ForwardBuffers {
  ConstMatrixView x;                // the stacked inputs [Tx, d_model]
  ConstMatrixView c;                // the stacked contexts [Tc, d_model] (x in self-attention)
  MatrixView q, k;                  // [Tx, q_cols], [Tc, k_cols]; one [Tx, q_cols + k_cols]
                                    // block (q then k) when every sequence is self-attention
  MatrixView val;                   // the value block [val_rows, value_cols], contiguous; the
                                    // last columns of q's block when plan.qkv_one_block
  MatrixView o;                     // the heads' outputs [Tx, out_rows] (concat-then-project)
  MatrixView y;                     // the stacked output [Tx, d_model] (concat-then-project)
  std::vector<MatrixView> outputs;  // each sequence's output rows [n, d_model]
};

// Rows [row0, row0 + rows) of a matrix, the first of them at `position` (RoPE).
struct RopeRun {
  int64_t row0 = 0, rows = 0, position = 0;
};

// What each head of an attention reads as its values and where its output goes.
//   kValueBlock (concat-then-project forms): head i mixes value columns
//     [value_offset_i, + value_width_i) and writes output columns [mix_offset_i, + value_width_i).
//   kContext (the summed form mixing first): every head mixes the whole context [m, d_model]
//     and writes columns [value_offset_i, + d_model) of the mixes [rows, h·d].
enum class AttentionValues { kValueBlock, kContext };

// One sequence's query rows [row0, row0 + rows), for every head of the form.
struct AttentionRange {
  const Sequence* sequence = nullptr;  // its masks: causal, key_length
  int64_t row0 = 0, rows = 0;
  ConstMatrixView q;       // the sequence's queries [n, q_cols] (row0 indexes them)
  ConstMatrixView k;       // its keys [m, k_cols]
  ConstMatrixView values;  // what its heads mix [m, ·] (AttentionValues)
  MatrixView out;          // the range's output rows [rows, ·]
};

// out_i = softmax(scale · q_i k_g(i)ᵀ + mask) · values_i for every range and head.
struct AttentionJob {
  const FormWeights* form = nullptr;
  AttentionValues values = AttentionValues::kValueBlock;
  std::vector<AttentionRange> ranges;

  // Head i's columns: those it reads of a range's values, those it writes of its out, and how
  // many (the same for both).
  int64_t ValueColumn(int64_t head) const {
    return values == AttentionValues::kValueBlock ? form->value_offset[head] : 0;
  }
  int64_t OutColumn(int64_t head) const {
    return values == AttentionValues::kValueBlock ? form->mix_offset[head] : form->value_offset[head];
  }
  int64_t Width(int64_t head) const {
    return values == AttentionValues::kValueBlock ? form->value_width[head] : form->config.d_model;
  }
  // The width w shared by every head when head i reads value columns [g(i)·w, +w) and writes
  // output columns [i·w, +w) (the factored form; the summed form mixing first with one kv
  // head), so that the heads' mixes are batches at fixed strides; 0 when they are not (the
  // low-rank form's ragged ranks, the context as the values of several kv heads).
  int64_t StridedHeadWidth() const {
    const LayerConfig& c = form->config;
    const int64_t w = Width(0);
    for (int64_t i = 0; i < c.heads; ++i) {
      if (Width(i) != w || ValueColumn(i) != c.KvHeadOf(i) * w || OutColumn(i) != i * w) return 0;
    }
    return w;
  }
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  // What the device lets the plan choose (the summed order, the mixes' bound).
  virtual PlanPolicy Policy() const = 0;

  // Lays out the plan's buffers on the device and puts the batch's inputs (and contexts) there.
  // RESOURCE_EXHAUSTED when the device has no room for them.
  virtual Status Prepare(const FormWeights& form, const BatchPlan& plan, std::span<const Sequence> batch,
                         ForwardBuffers& buffers) = 0;

  // y = x · w + bias (a row vector over y's columns; null: none), or y += x · w + bias with
  // `accumulate`.
  virtual Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) = 0;

  // Gemm with a block of the form's weights as w: every product the skeleton runs by a weight
  // matrix comes here. A device that holds the weights in a layout of its own as well finds the
  // block there by its name (WeightBlock); by default, Gemm on the block's view.
  virtual Status GemmWeights(ConstMatrixView x, const WeightBlock& w, const float* bias, MatrixView y,
                             bool accumulate) {
    return Gemm(x, w.view, bias, y, accumulate);
  }

  // Rotates rows of `m` in place (RoPE, server/core/rope.h): `heads` heads of `d_head` columns,
  // each run's rows from its position on. The runs are a batch's sequences, in row order and
  // back to back, so that a device can rotate them all at once.
  virtual Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) = 0;

  // The memory a chunk of mix-first parts keeps its mixes in (BatchPlan::mix_floats floats),
  // asked for once the sequences that project first are done: on the CPU it is the memory their
  // A_cat had (what one forward holds at once is then the larger of the two, as the memory
  // budget counts it, not both, nor either during the projections).
  virtual StatusOr<float*> MixBuffer(const BatchPlan& plan) = 0;

  // Runs every range of the job (scores, mask, softmax and mix), in whatever tiles or blocks
  // the device runs them.
  virtual Status Attend(const AttentionJob& job) = 0;

  // The summed form projecting first: out = A_cat · [M_1; …; M_h] + bias for each range, where
  // a range's values are its sequence's rows of the value block, read as the [L·h, d_model]
  // matrix of the M_i with rows (key, head), and A_cat [rows, L·h] puts A_i[q, j] at column
  // j·h + i to match (docs/architecture.md, §3). The device holds A_cat however it likes.
  virtual Status SumHeadsProjectingFirst(const FormWeights& form, std::span<const AttentionRange> ranges,
                                         const float* bias) = 0;

  // Brings the outputs back: from `y` (the stacked output, when `stacked`) or from each
  // sequence's buffers.outputs, into the sequences' own outputs.
  virtual Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& buffers,
                        bool stacked) = 0;
};

}  // namespace attnserve
