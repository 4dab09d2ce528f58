// The skeleton's device operations on the CPU (server/backend/attention/device_ops.h), and the
// form and the scratch they run on: the buffers are one forward's ForwardScratch, the GEMMs split
// across the forward's threads by columns (SplitColumns: each block of the weights streamed
// once), and attention runs as tiled tasks (tiled_attention.h) on its compute team.
// A product by the form's weights (GemmWeights) finds their packed panels through the block's
// name, CpuResidentForm::Packed; anything else goes to the library row-major.
// Internal to server/backend/cpu; the backend (cpu_backend.h) makes one CpuOps per forward.
// Thread-safety: a CpuOps serves one forward on one thread (its team's helpers run the tasks it
// hands them); a CpuResidentForm is immutable and shared by every forward.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "server/backend/attention/device_ops.h"
#include "server/backend/backend.h"
#include "server/backend/compute_team.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/packed_weights.h"

namespace attnserve {

// The memory one forward works in, kept for the next: the stacked inputs and contexts, Q, K,
// the value block, O, Y and the summed form's A_cat. Freed and allocated per call, the value
// block was paged in and zeroed by the kernel every time (docs/journal/benchmarks-journal.md,
// "The GEMM library": where the summed form's time went).
struct ForwardScratch {
  // On cache lines (AlignedFloats): Q, K and the value block are the scores' and mixes' operands.
  AlignedFloats x, c, q, k, val, o, y, a_cat;  // a_cat also holds the summed form's mixes

  int64_t Bytes() const;
};

// A form as the CPU backend holds it: its weights, and with WeightLayout::kPacked their
// projection matrices packed into panels as well (packed_weights.h), each panel `panel_width`
// columns (0: not packed).
class CpuResidentForm final : public ResidentForm {
 public:
  CpuResidentForm(std::shared_ptr<const FormWeights> w, int64_t panel_width, PanelPrecision precision);
  const FormWeights& weights() const override { return *w_; }
  // bf16 when its panels hold bfloat16 (either PanelPrecision of it), fp16 when IEEE halves,
  // else fp32.
  Math math() const override {
    switch (precision_) {
      case PanelPrecision::kBfloat16:
      case PanelPrecision::kBfloat16Pairs:
        return Math::kBf16;
      case PanelPrecision::kFloat16:
        return Math::kFp16;
      case PanelPrecision::kFloat32:
        break;
    }
    return Math::kFp32;
  }
  int64_t HostBytes() const override { return w_->Bytes() + w_in_.Bytes() + w_out_.Bytes(); }

  // The packed block of the weights that `w` names (its matrix, rows and columns; never the
  // address of its view): nothing when the weights are not packed or the block starts
  // mid-panel. INTERNAL when the form's matrix has no such block.
  StatusOr<std::optional<PackedBlock>> Packed(const WeightBlock& w) const;

 private:
  std::shared_ptr<const FormWeights> w_;
  PanelPrecision precision_;
  PackedWeights w_in_, w_out_;
};

// How a forward computes: which GEMM library, on how many threads, in which summed order.
struct Compute {
  GemmLibrary gemm;
  int threads;
  SummedOrder summed_order;     // when the summed form mixes first (SummedMixesFirst)
  ComputeTeam* team = nullptr;  // the forward's threads (threads of them); none: this one alone
};

// How SplitGemm cuts a product of x [rows, depth] by `cols` columns of weights across `threads`:
// `blocks` blocks of `width` columns (the last one narrower where cols is not a multiple),
// handed out to the team's members as each comes free.
//   - From the library (`on_panels` false), one block per thread: the library copies x and its
//     block of w into its own layout inside every call, so every extra block is another copy of
//     x (on gpt2-medium's 4 KiB-aliased rows, three blocks a thread cost 10–15 % of a quiet
//     forward).
//   - On packed panels, kPanelBlocksPerThread per thread, none under kMinColumnBlockMultiplyAdds:
//     the kernel reads x and the panels where they lie, so a block costs nothing to start, and a
//     member whose core another process holds takes fewer blocks instead of making the step wait
//     for its one block at half speed (docs/benchmarks.md, "A disturbed machine").
// The width is a multiple of 64 columns: whole cache lines, whole panels of either ISA's kernel.
struct ColumnSplit {
  int64_t blocks = 0, width = 0;
};
constexpr int64_t kPanelBlocksPerThread = 3;
constexpr int64_t kMinColumnBlockMultiplyAdds = int64_t{1} << 21;  // tens of µs on one core
ColumnSplit SplitColumns(int64_t rows, int64_t depth, int64_t cols, int threads, bool on_panels);

class CpuOps final : public DeviceOps {
 public:
  // `resident` null: a form another backend uploaded, nothing packed.
  CpuOps(Compute run, const CpuResidentForm* resident, int64_t max_score_scratch_bytes, int64_t value_group_bytes,
         ForwardScratch& scratch)
      : run_(run),
        resident_(resident),
        max_score_scratch_bytes_(max_score_scratch_bytes),
        value_group_bytes_(value_group_bytes),
        scratch_(scratch) {}

  PlanPolicy Policy() const override;
  Status Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                 ForwardBuffers& b) override;
  StatusOr<float*> MixBuffer(const BatchPlan& plan) override;
  Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) override;
  Status GemmWeights(ConstMatrixView x, const WeightBlock& w, const float* bias, MatrixView y,
                     bool accumulate) override;
  Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) override;
  Status Attend(const AttentionJob& job) override;
  Status SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                 const float* bias) override;
  Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool stacked) override;

 private:
  int64_t ScratchCap() const { return max_score_scratch_bytes_ / static_cast<int64_t>(sizeof(float)); }

  const Compute run_;
  const CpuResidentForm* resident_;
  const int64_t max_score_scratch_bytes_;
  const int64_t value_group_bytes_;
  ForwardScratch& scratch_;
};

}  // namespace attnserve
