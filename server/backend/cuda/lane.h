// A CUDA lane: one worker's share of the device — its own stream, cuBLAS handle (CublasOps),
// workspace (laid out by workspace_plan.h) and pinned staging (Staging) — so that batches from
// different workers overlap on the GPU. It is the CUDA backend's DeviceOps: the attention
// skeleton (server/backend/attention) runs each batch over it. The weights (CudaResidentForm) are
// shared by every lane, uploaded and synchronised once, read-only afterwards.
// docs/architecture.md, "The CUDA backend".
// Thread-safety: a lane serves one caller at a time (the backend's pool hands it out); its
// reclaim callback may release other, idle lanes' workspaces.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "server/backend/attention/device_ops.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/cublas_ops.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/device_memory.h"
#include "server/backend/cuda/graph_cache.h"
#include "server/backend/cuda/kernels.h"
#include "server/backend/cuda/staging.h"
#include "server/backend/cuda/workspace_plan.h"

namespace attnserve::cuda {

// The summed order the options ask for: by shape alone (no A_cat bound: it is blocked here).
inline SummedOrder SummedOrderOf(const CudaBackendOptions& options) {
  return {.mix_first_allowed = options.summed_mix_first};
}

// The 16-bit format of kBf16 and kFp16 (HalfWeights), as the conversion kernel names it.
inline HalfFormat HalfFormatOf(Math math) { return math == Math::kBf16 ? HalfFormat::kBf16 : HalfFormat::kFp16; }

// A form's weights on the device, counted against the budget. Under Math kBf16 and kFp16,
// W_in and W_out are held in 16 bits (rounded once, here, to nearest even), two values a float
// of their DeviceArray, so the budget counts their real bytes; the biases stay float32.
class CudaResidentForm final : public ResidentForm {
 public:
  CudaResidentForm(std::shared_ptr<const FormWeights> w, const std::shared_ptr<DeviceBudget>& budget, Math math)
      : w_in(budget),
        b_in(budget),
        w_out(budget),
        b_out(budget),
        math_(math),
        serial(NextSerial()),
        host_(std::move(w)) {}
  const FormWeights& weights() const override { return *host_; }
  Math math() const override { return math_; }

  // Returns once the weights are on the device: the host copies may go after that.
  Status Upload(cudaStream_t stream);

  // The weights as the skeleton names them (DeviceWeights). With 16-bit weights the device holds
  // no float32 copy: the views are the host's, which no device operation reads (Lane::GemmWeights
  // finds the 16-bit block by its name; a GEMM reading a host view would fault on a device and in
  // the emulation).
  DeviceWeights Weights() const;
  // Block `w` of the 16-bit W_in or W_out; INTERNAL when it lies outside the matrix.
  StatusOr<HalfBlock> HalfBlockOf(const WeightBlock& w) const;

  DeviceArray w_in, b_in, w_out, b_out;
  const Math math_;
  // This form's number among every form made in the process: what a lane's CUDA graphs name it
  // by (an address may be reused by a later form, with other weights).
  const uint64_t serial;

 private:
  static uint64_t NextSerial();
  std::shared_ptr<const FormWeights> host_;
};

// What a lane's CUDA graphs did (CudaBackendOptions::graph_rows): batches captured into a graph,
// batches that replayed one, and captures that failed (each batch of those ran again without).
struct GraphCounts {
  int64_t captures = 0, replays = 0, failures = 0;
};
// The graphs a lane keeps: a few shapes repeat in small-batch serving; more would hold device
// memory (each instantiation's own) for shapes that do not.
inline constexpr size_t kGraphsPerLane = 8;
// A lane whose captures failed this many times captures no more: where the device or driver
// refuses graphs, each small batch would otherwise pay a capture on top of its run.
inline constexpr int64_t kGraphFailuresPerLane = 4;

// One batch's workspace as Prepare laid it out: where each piece is, the bound its blocks of
// query rows were cut to, and what it holds in all.
struct BatchWorkspace {
  float* piece[kPieces] = {};
  int64_t score_bytes = 0;     // the bound the blocks were cut to (BlockRows)
  int64_t score_capacity = 0;  // floats of the score piece (a group's blocks side by side)
  int64_t pointer_slots = 0;   // of the pointer piece
  int64_t staged_values = 0;   // floats staged in the inputs piece (inputs, then contexts)
  int64_t half_operand_capacity = 0;  // 16-bit values the 16-bit operand piece holds
  int64_t bytes = 0;           // the whole workspace's
  float* scores() const { return piece[kScores]; }
  float* a_cat() const { return piece[kACat]; }
};

class Lane final : public DeviceOps {
 public:
  // `reclaim` takes back the workspaces of the backend's idle lanes (not this one's).
  Lane(CudaBackendOptions options, std::shared_ptr<DeviceBudget> budget, std::function<void()> reclaim);
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() override;

  Status Init();

  // Out of room, the weights first take back this lane's and the idle lanes' workspaces.
  Status Upload(CudaResidentForm& resident);

  // Runs one batch on this lane's stream (the skeleton over this lane's operations); returns
  // once the outputs are written.
  Status RunBatch(const CudaResidentForm& r, std::span<const Sequence> batch);

  // Runs one small batch of `r` (kWarmupRows self-attention queries and a cross-attention
  // sequence of kWarmupRows / 4 queries over kWarmupRows contexts), its outputs discarded: the
  // stream, handle, workspace, pinned staging and the kernels `r` uses are ready afterwards, so
  // a later batch no larger than this one allocates nothing (Backend::Warmup).
  Status Warm(const CudaResidentForm& r);
  static constexpr int64_t kWarmupRows = 64;

  // Waits for what this lane's stream has queued: after a failed batch, the copies and kernels
  // it issued before the failure, which still read the pinned staging and write the workspace.
  // The stream's error, sticky or not, is what it reports.
  cudaError_t Drain();

  // Called on an idle lane (no work in flight: every batch synchronises before it returns).
  void ReleaseWorkspace();

  // The split of this lane's last finished batch (its last part, when it ran in parts).
  const DeviceTimes& last_times() const { return last_times_; }

  const GraphCounts& graph_counts() const { return graph_counts_; }

  // Host memory this lane keeps between batches: its pinned staging buffers.
  int64_t PinnedBytes() const { return staging_.PinnedBytes() + gemms_.PinnedBytes(); }

  // DeviceOps (lane.cc: the batch's workspace and copies; lane_attention.cc: its compute).
  PlanPolicy Policy() const override;
  Status Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                 ForwardBuffers& b) override;
  StatusOr<float*> MixBuffer(const BatchPlan&) override { return batch_.piece[kMixes]; }
  Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) override;
  Status GemmWeights(ConstMatrixView x, const WeightBlock& w, const float* bias, MatrixView y,
                     bool accumulate) override;
  Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) override;
  Status Attend(const AttentionJob& job) override;
  Status SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                 const float* bias) override;
  Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool) override;

 private:
  // A batch whose workspace does not fit runs in halves (lane.cc says when).
  Status RunWithinBound(const FormWeights& f, const DeviceWeights& w, std::span<const Sequence> batch);
  // What a batch leaves behind is kept for the next one only up to retain_workspace_bytes.
  void TrimAfterBatch();
  // The workspace for the plan `plan_for(score bound)`, reserved within the lane's bound and the
  // budget (lane.cc says how it shrinks), or RESOURCE_EXHAUSTED with the figures.
  StatusOr<WorkspacePlan> FitWorkspace(const std::function<WorkspacePlan(int64_t)>& plan_for);
  // The batch's workspace fitted, laid out and its guard zones filled: the value Prepare keeps.
  StatusOr<BatchWorkspace> PlaceWorkspace(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch);

  // Attention (lane_attention.cc): a block of one sequence's scores and softmax, its mix, and
  // the same for a group of single-block ranges in pointer-array calls.
  Status Scores(const LayerConfig& c, DeviceBlock q, DeviceBlock k, int64_t first_row, bool causal, float* s,
                float* a_cat = nullptr);
  Status Mix(const AttentionJob& job, DeviceBlock values, const float* s, int64_t n, int64_t keys, DeviceBlock out);
  Status GroupScores(const LayerConfig& c, std::span<const AttentionRange* const> group, int64_t rows, int64_t keys,
                     float* a_cat);
  Status GroupMix(const AttentionJob& job, std::span<const AttentionRange* const> group, int64_t rows, int64_t keys);
  std::vector<RangeGroup> Groups(const FormWeights& f, std::span<const AttentionRange> ranges) const;
  // The whole job in the fused kernel, a launch per kFusedMaxRanges ranges.
  Status FusedAttend(const AttentionJob& job, const FusedShape& shape);
  // x as a 16-bit GEMM input: its rows of the staged inputs' 16-bit copy (Prepare converted them
  // once), or x converted into the 16-bit operand piece on the stream.
  StatusOr<HalfBlock> HalfOperand(ConstMatrixView x);

  // CUDA graphs (lane_graphs.cc): after the inputs are staged, a batch within graph_rows either
  // replays the graph of its signature (the compute calls then issue nothing) or is captured;
  // before its outputs come back, the graph is launched. A capture that fails leaves the
  // batch to run again without one (RunBatch).
  std::vector<int64_t> GraphKey(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch) const;
  void BeginGraph(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch);
  Status LaunchGraph();
  // Ends a capture the batch left open (it failed midway): the graph is dropped.
  void AbandonCapture();
  void GraphFailed(const char* step, cudaError_t error);
  bool replaying() const { return graph_mode_ == GraphMode::kReplaying; }

  CudaBackendOptions options_;
  std::shared_ptr<DeviceBudget> budget_;
  std::function<void()> reclaim_;
  cudaStream_t stream_ = nullptr;  // destroyed last (~Lane): the handle and events go first
  CublasOps gemms_;
  DeviceArray workspace_;
  BatchWorkspace batch_;            // this batch's, as Prepare placed it
  const CudaResidentForm* resident_ = nullptr;  // the form RunBatch runs
  // The running form's math (each resident form has its own), else the backend's.
  Math math() const { return resident_ != nullptr ? resident_->math() : options_.math; }
  bool workspace_refused_ = false;  // the batch's Prepare found no room (RunWithinBound)
  GuardZones guards_;               // this batch's (options_.guard_zones)
  Staging staging_;
  DeviceTimes last_times_;
  // The most device workspace or pinned staging this batch needed, in bytes (Prepare), and
  // whether the batch before it needed more than retain_workspace_bytes (TrimAfterBatch).
  int64_t batch_bytes_ = 0;
  bool oversized_before_ = false;
  // CUDA graphs: this batch's mode and signature, the graphs kept (cleared when the workspace
  // their pointers lie in goes), the workspace they were captured in, and a batch running again
  // after its capture failed.
  enum class GraphMode { kOff, kCapturing, kReplaying };
  GraphMode graph_mode_ = GraphMode::kOff;
  std::vector<int64_t> graph_key_;
  GraphCache graphs_{kGraphsPerLane};
  const float* graph_workspace_ = nullptr;
  size_t graph_workspace_capacity_ = 0;
  bool capture_failed_ = false, graphs_refused_ = false;
  GraphCounts graph_counts_;
};

}  // namespace attnserve::cuda
