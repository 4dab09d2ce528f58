// The lane's batch lifecycle: its stream and handle, uploads, the workspace each batch is placed
// in, the copies in and out, and what it keeps afterwards. Its compute is lane_attention.cc.
#include "server/backend/cuda/lane.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "server/backend/attention/skeleton.h"
#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/kernels.h"

namespace attnserve::cuda {

namespace {

// Each weight rounded once to the 16-bit format, to nearest, ties to even: the toolkit's
// host conversions, the same rounding as the kernel that converts the activations.
std::vector<uint16_t> ToHalf(std::span<const float> values, Math math) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = math == Math::kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(values[i]))
                                     : __half_as_ushort(__float2half_rn(values[i]));
  }
  return bits;
}

}  // namespace

Status CudaResidentForm::Upload(cudaStream_t stream) {
  // The 16-bit copies live until the stream has run their copies (the synchronisation below).
  std::vector<uint16_t> w_in16, w_out16;
  if (HalfWeights(math_)) {
    w_in16 = ToHalf(host_->w_in, math_);
    w_out16 = ToHalf(host_->w_out, math_);
    ATTNSERVE_RETURN_IF_ERROR(w_in.Upload(std::span<const uint16_t>(w_in16), stream));
    ATTNSERVE_RETURN_IF_ERROR(w_out.Upload(std::span<const uint16_t>(w_out16), stream));
  } else {
    ATTNSERVE_RETURN_IF_ERROR(w_in.Upload(host_->w_in, stream));
    ATTNSERVE_RETURN_IF_ERROR(w_out.Upload(host_->w_out, stream));
  }
  ATTNSERVE_RETURN_IF_ERROR(b_in.Upload(host_->b_in, stream));
  ATTNSERVE_RETURN_IF_ERROR(b_out.Upload(host_->b_out, stream));
  CUDA_TRY(cudaStreamSynchronize(stream));
  return OkStatus();
}

DeviceWeights CudaResidentForm::Weights() const {
  if (!HalfWeights(math_)) return WeightsAt(*host_, w_in.get(), b_in.get(), w_out.get(), b_out.get());
  return WeightsAt(*host_, host_->w_in.data(), b_in.get(), host_->w_out.data(), b_out.get());
}

StatusOr<HalfBlock> CudaResidentForm::HalfBlockOf(const WeightBlock& w) const {
  const FormWeights& f = *host_;
  const bool in = w.matrix == WeightMatrix::kIn;
  const int64_t rows = in ? f.config.d_model : f.out_rows, cols = in ? f.in_cols() : f.config.d_model;
  const int64_t last_row = w.row0 + w.view.rows, last_col = w.col0 + w.view.cols;
  if (!HalfWeights(math_) || w.row0 < 0 || w.col0 < 0 || w.view.rows < 0 || w.view.cols < 0 || last_row > rows ||
      last_col > cols) {
    return InternalError("GemmWeights: rows [" + std::to_string(w.row0) + ", " + std::to_string(last_row) +
                         ") and columns [" + std::to_string(w.col0) + ", " + std::to_string(last_col) + ") of " +
                         std::string(WeightMatrixName(w.matrix)) + ": expected a block inside its 16-bit [" +
                         std::to_string(rows) + ", " + std::to_string(cols) + "], held in math " +
                         std::string(MathName(math_)));
  }
  const uint16_t* base = (in ? w_in : w_out).get16();
  return HalfBlock{base + w.row0 * cols + w.col0, w.view.rows, w.view.cols, cols};
}

Lane::Lane(CudaBackendOptions options, std::shared_ptr<DeviceBudget> budget, std::function<void()> reclaim)
    : options_(options),
      budget_(budget),
      reclaim_(std::move(reclaim)),
      workspace_(std::move(budget)),
      staging_(options.staging_slice_bytes, StagingThreads(options.staging_threads)) {}

// On the lane's device; the events and the handle before the stream they were used on.
Lane::~Lane() {
  cudaSetDevice(options_.device);
  graphs_.Clear();
  staging_.DestroyEvents();
  gemms_.Destroy();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status Lane::Init() {
  CUDA_TRY(cudaSetDevice(options_.device));
  CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  ATTNSERVE_RETURN_IF_ERROR(gemms_.Init(stream_, options_.math));
  ATTNSERVE_RETURN_IF_ERROR(staging_.Init(stream_));
  return OkStatus();
}

Status Lane::Upload(CudaResidentForm& resident) {
  CUDA_TRY(cudaSetDevice(options_.device));
  Status st = resident.Upload(stream_);
  if (st.code() != StatusCode::kResourceExhausted) return st;
  cudaGetLastError();  // a cudaMalloc that ran out leaves its error behind
  ReleaseWorkspace();
  reclaim_();
  return resident.Upload(stream_);
}

Status Lane::Warm(const CudaResidentForm& r) {
  const LayerConfig& c = r.weights().config;
  const int64_t d = c.d_model, n = kWarmupRows, cross = kWarmupRows / 4;
  // Inputs of a fixed, non-zero pattern (what the outputs are does not matter).
  std::vector<float> inputs((n + cross + n) * d), outputs((n + cross) * d);
  for (size_t i = 0; i < inputs.size(); ++i) inputs[i] = 0.01f * static_cast<float>(i % 97) - 0.48f;
  Sequence batch[2];
  batch[0].input = ConstMatrixView(inputs.data(), n, d);
  batch[0].output = MatrixView(outputs.data(), n, d);
  batch[1].input = ConstMatrixView(inputs.data() + n * d, cross, d);
  batch[1].context = ConstMatrixView(inputs.data() + (n + cross) * d, n, d);
  batch[1].output = MatrixView(outputs.data() + n * d, cross, d);
  // A layer that refuses the cross-attention sequence warms on the self-attention one alone.
  const std::span<const Sequence> both(batch), self_only = both.first(1);
  const std::span<const Sequence> warm = ValidateBatch(c, both).ok() ? both : self_only;
  ATTNSERVE_RETURN_IF_ERROR(ValidateBatch(c, warm));
  return RunBatch(r, warm);
}

cudaError_t Lane::Drain() {
  cudaSetDevice(options_.device);
  return cudaStreamSynchronize(stream_);
}

void Lane::ReleaseWorkspace() {
  cudaSetDevice(options_.device);
  graphs_.Clear();  // their pointers lie in the workspace
  workspace_.Release();
}

Status Lane::RunBatch(const CudaResidentForm& r, std::span<const Sequence> batch) {
  CUDA_TRY(cudaSetDevice(options_.device));
  const DeviceWeights w = r.Weights();
  batch_bytes_ = 0;
  resident_ = &r;
  capture_failed_ = graphs_refused_ = false;
  ATTNSERVE_RETURN_IF_ERROR(gemms_.SetMath(r.math()));
  Status st = RunWithinBound(r.weights(), w, batch);
  AbandonCapture();  // a batch that failed while capturing leaves the capture open
  if (capture_failed_) {
    // What the capture took was recorded, not run: the batch again, without a graph. A device
    // fault fails this run too; a failure of the graph alone does not fail the batch.
    cudaGetLastError();
    graphs_refused_ = true;
    st = RunWithinBound(r.weights(), w, batch);
    graphs_refused_ = false;
  }
  graph_mode_ = GraphMode::kOff;
  resident_ = nullptr;
  TrimAfterBatch();
  return st;
}

// A batch whose workspace does not fit (the lane's bound, or the budget's room while other
// lanes hold theirs), even in blocks of one query row, runs in halves, in order, each a forward
// of its own: the sequences are independent, and Prepare refused before anything ran. A
// sequence that does not fit alone fails with FitWorkspace's figures.
Status Lane::RunWithinBound(const FormWeights& f, const DeviceWeights& w, std::span<const Sequence> batch) {
  workspace_refused_ = false;
  const Status st = RunAttention(*this, f, w, batch);
  if (st.ok() || !workspace_refused_ || batch.size() < 2) return st;
  const size_t half = batch.size() / 2;
  ATTNSERVE_RETURN_IF_ERROR(RunWithinBound(f, w, batch.first(half)));
  return RunWithinBound(f, w, batch.subspan(half));
}

// What a batch leaves behind is kept for the next one only up to retain_workspace_bytes (device
// workspace and pinned staging each): a rare large batch does not hold its memory for good.
// A run of batches past the bound keeps it from the second on (CudaBackendOptions says why);
// the first batch that fits under the bound again releases it.
// The stream is idle here (Finish synchronised it, or the batch failed and MarkFailed will).
void Lane::TrimAfterBatch() {
  const int64_t keep = options_.retain_workspace_bytes;
  const bool oversized = batch_bytes_ > keep;
  const bool in_a_run = oversized && oversized_before_;
  oversized_before_ = oversized;
  if (in_a_run) return;
  if (static_cast<int64_t>(workspace_.capacity() * sizeof(float)) > keep) {
    cudaStreamSynchronize(stream_);
    graphs_.Clear();
    workspace_.Release();
  }
  if (PinnedBytes() > keep) {
    cudaStreamSynchronize(stream_);
    staging_.ReleasePinned();
    gemms_.ReleasePinned();
  }
}

// A summed sequence mixes first only by shape (n < m) and only when the options allow it
// (CudaBackendOptions::summed_mix_first): a device holds A_cat a block of query rows at a time
// (the workspace's score pieces), so mixing first buys FLOPs, not memory. The mixes' bound is
// the score workspace's.
PlanPolicy Lane::Policy() const {
  return {.summed_order = SummedOrderOf(options_), .max_mix_bytes = options_.max_score_workspace_bytes};
}

// Makes the workspace hold the plan `plan_for(max_score_workspace_bytes)` within the lane's
// bound and the device memory budget: when it does not fit the budget, the idle lanes'
// workspaces are taken back; when it still does not (or passes the lane's bound), the blocks
// get as many query rows as the room left holds (at least one); failing that,
// RESOURCE_EXHAUSTED with the figures.
StatusOr<WorkspacePlan> Lane::FitWorkspace(const std::function<WorkspacePlan(int64_t)>& plan_for) {
  WorkspacePlan plan = plan_for(options_.max_score_workspace_bytes);
  const int64_t lane_bound = options_.max_lane_workspace_bytes;
  Status st;
  if (plan.bytes() <= lane_bound) {
    if (static_cast<size_t>(plan.total) <= workspace_.capacity()) return plan;
    for (int attempt = 0; attempt < 2; ++attempt) {
      st = workspace_.Reserve(plan.total);
      if (st.ok()) return plan;
      if (st.code() != StatusCode::kResourceExhausted) return st;
      cudaGetLastError();  // a cudaMalloc that ran out leaves its error behind
      if (attempt == 0) reclaim_();
    }
  }
  workspace_.Release();
  // The room the budget has left (this lane's workspace released), within the lane's bound.
  // When the plan fits it, the device refused, not the budget: smaller blocks would not help.
  const int64_t budget_room = budget_->limit() - budget_->held();
  const int64_t room = std::min(budget_room, lane_bound);
  if (!st.ok() && plan.bytes() <= room) return st;
  // Smaller blocks: as many query rows as the room left holds.
  const WorkspacePlan smallest = plan_for(0);  // one query row per block
  plan = plan_for(std::max<int64_t>(0, ScoreBytesForRoom(smallest, room)));
  if (plan.bytes() > room) {
    const std::string where = budget_room > lane_bound
                                  ? Mib(lane_bound) + " is one lane's bound (--gpu-max-lane-workspace-mb)"
                                  : Mib(std::max<int64_t>(room, 0)) + " is free under " + BudgetText(*budget_);
    return ResourceExhaustedError("device memory: this batch needs " + Mib(smallest.bytes()) +
                                  " of workspace even in blocks of one query row, and " + where +
                                  "; send fewer or shorter sequences at once, or raise the budget");
  }
  ATTNSERVE_RETURN_IF_ERROR(workspace_.Reserve(plan.total));
  return plan;
}

StatusOr<BatchWorkspace> Lane::PlaceWorkspace(const FormWeights& f, const BatchPlan& plan,
                                              std::span<const Sequence> batch) {
  const int64_t guard = options_.guard_zones ? kGuardFloats : 0;
  ATTNSERVE_ASSIGN_OR_RETURN(const WorkspacePlan w, FitWorkspace([&](int64_t score_bytes) {
                               return PlanWorkspace(f, plan, batch, score_bytes, guard, !options_.gemm_attention,
                                                    HalfWeights(math()));
                             }));
  const PieceLayout layout = LayOut(w, guard);
  BatchWorkspace placed{.score_bytes = w.score_bytes,
                        .score_capacity = w.sizes[kScores],
                        .pointer_slots = w.sizes[kPointers] / kFloatsPerPointer,
                        .staged_values = w.sizes[kInputs],
                        .half_operand_capacity = 2 * w.sizes[kHalfOperands],
                        .bytes = w.bytes()};
  guards_.Clear();
  for (int p = 0; p < kPieces; ++p) {
    placed.piece[p] = workspace_.get() + layout.offset[p];
    // The piece's alignment padding and the guard after it, filled on the stream before any
    // work of the batch: a kernel or GEMM that writes past its piece changes them.
    if (guard > 0) {
      ATTNSERVE_RETURN_IF_ERROR(
          guards_.Add(PieceName(p), workspace_.get() + layout.guard_offset[p], layout.guard_floats[p], stream_));
    }
  }
  return placed;
}

// Workspace: one allocation carved into the pieces this batch needs. Inputs and (when staged)
// contexts share the first piece, in that order. Blocks of query rows keep the scores linear in
// the sequence length (not heads · n · L). The inputs go through pinned memory, one copy.
Status Lane::Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch, ForwardBuffers& b) {
  const LayerConfig& c = f.config;
  const int64_t d = c.d_model, tx = plan.rows.queries, tc = plan.rows.contexts;
  const bool all_self = plan.rows.all_self;
  const int64_t c_rows = all_self ? 0 : tc;  // contexts are staged only when some differ
  StatusOr<BatchWorkspace> placed = PlaceWorkspace(f, plan, batch);
  if (!placed.ok()) {
    workspace_refused_ = placed.status().code() == StatusCode::kResourceExhausted;
    return placed.status();
  }
  batch_ = *placed;
  const int64_t staged = (tx + c_rows) * d + tx * d;  // pinned floats: inputs (and contexts), outputs
  batch_bytes_ = std::max({batch_bytes_, batch_.bytes, staged * static_cast<int64_t>(sizeof(float))});
  float* const* piece = batch_.piece;
  ATTNSERVE_RETURN_IF_ERROR(gemms_.StartBatch(reinterpret_cast<const void**>(piece[kPointers]), batch_.pointer_slots));

  // Under 16-bit weights every product by W_in reads the inputs' 16-bit rows. They are rounded
  // on the host as they are packed, and half the bytes cross, unless something reads the
  // float32 rows too: the summed form's mix-first parts mix the context rows themselves, so a
  // batch with a sequence that mixes first (the plan's choice, per sequence) stages float32.
  auto* const inputs16 = reinterpret_cast<uint16_t*>(piece[kHalfInputs]);
  const bool half = HalfWeights(math());
  const bool float_inputs_read = std::ranges::find(plan.mixes_first, true) != plan.mixes_first.end();
  const bool half_staged = half && !float_inputs_read;
  ATTNSERVE_RETURN_IF_ERROR(staging_.StageInputs(
      batch, all_self, d, piece[kInputs], half_staged ? std::optional(HalfFormatOf(math())) : std::nullopt, inputs16));
  BeginGraph(f, plan, batch);  // the device work from here to Finish: captured, or replayed there
  if (half && !half_staged && !replaying()) {
    // Staged in float32: converted once, behind their copies on the stream.
    CUDA_TRY(cuda::ConvertToHalf(piece[kInputs], tx + c_rows, d, d, inputs16, d, HalfFormatOf(math()), stream_));
  }
  b.x = ConstMatrixView(piece[kInputs], tx, d);
  b.c = all_self ? b.x : ConstMatrixView(piece[kInputs] + tx * d, tc, d);
  if (all_self) {
    const MatrixView qk(piece[kQK], tx, f.q_cols + f.k_cols);
    b.q = qk.ColBlock(0, f.q_cols);
    b.k = qk.ColBlock(f.q_cols, f.k_cols);
  } else {
    b.q = MatrixView(piece[kQK], tx, f.q_cols);
    b.k = MatrixView(piece[kQK] + tx * f.q_cols, tc, f.k_cols);
  }
  b.val = MatrixView(piece[kValues], plan.val_rows, f.value_cols);
  b.o = MatrixView(piece[kHeadOutputs], tx, f.out_rows);
  b.y = MatrixView(piece[kOutput], tx, d);
  for (size_t i = 0; i < batch.size(); ++i) b.outputs.push_back(b.y.RowBlock(plan.rows.x_row[i], batch[i].n()));
  return OkStatus();
}

// Every output is in y (ForwardBuffers::outputs are its rows, ld = d): brought back through
// pinned memory (Staging::ReturnOutputs). Then the guard zones and the batch's split.
Status Lane::Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool) {
  ATTNSERVE_RETURN_IF_ERROR(LaunchGraph());
  ATTNSERVE_RETURN_IF_ERROR(staging_.ReturnOutputs(plan, batch, b.y.data, b.y.cols));
  ATTNSERVE_RETURN_IF_ERROR(guards_.Check());
  ATTNSERVE_ASSIGN_OR_RETURN(last_times_, staging_.ReadTimes());
  return OkStatus();
}

}  // namespace attnserve::cuda
