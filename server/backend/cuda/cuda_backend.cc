
#include "server/backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "server/backend/attention/skeleton.h"
#include "server/backend/compute_team.h"
#include "server/backend/cuda/device_memory.h"
#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/kernels.h"
#include "server/backend/cuda/staging.h"
#include "server/backend/cuda/workspace_plan.h"
#include "server/core/thread_annotations.h"

namespace attnserve {
namespace {

using cuda::CublasCheck;
using cuda::CudaCheck;
using cuda::IsStickyError;
using cuda::Mib;
using cuda::BudgetText;
using cuda::DeviceArray;
using cuda::DeviceBudget;
using cuda::PinnedArray;
using namespace cuda;  // NOLINT: the lane's own parts (moved to lane.cc next)

// The summed order the options ask for: by shape alone (no A_cat bound: it is blocked here).
SummedOrder SummedOrderOf(const CudaBackendOptions& options) { return {.mix_first_allowed = options.summed_mix_first}; }

class CudaResidentForm final : public ResidentForm {
 public:
  CudaResidentForm(std::shared_ptr<const FormWeights> w, const std::shared_ptr<DeviceBudget>& budget)
      : w_in(budget), b_in(budget), w_out(budget), b_out(budget), host_(std::move(w)) {}
  const FormWeights& weights() const override { return *host_; }

  // Returns once the weights are on the device: the host copies may go after that.
  Status Upload(cudaStream_t stream) {
    ATTNSERVE_RETURN_IF_ERROR(w_in.Upload(host_->w_in, stream));
    ATTNSERVE_RETURN_IF_ERROR(b_in.Upload(host_->b_in, stream));
    ATTNSERVE_RETURN_IF_ERROR(w_out.Upload(host_->w_out, stream));
    ATTNSERVE_RETURN_IF_ERROR(b_out.Upload(host_->b_out, stream));
    CUDA_TRY(cudaStreamSynchronize(stream));
    return OkStatus();
  }

  DeviceArray w_in, b_in, w_out, b_out;

 private:
  std::shared_ptr<const FormWeights> host_;
};

// A row-major device matrix block: rows × cols, row stride ld.
struct DeviceBlock {
  float* data;
  int64_t rows, cols, ld;
  DeviceBlock Rows(int64_t first, int64_t count) const { return {data + first * ld, count, cols, ld}; }
  DeviceBlock Cols(int64_t first, int64_t count) const { return {data + first, rows, count, ld}; }
};

// One worker's share of the device: its own stream, cuBLAS handle, scratch workspace and pinned
// staging buffers, so that batches from different workers overlap on the GPU. The weights are
// shared by every lane (uploaded and synchronised once, read-only afterwards).
class Lane final : public DeviceOps {
 public:
  // `reclaim` takes back the workspaces of the backend's idle lanes (not this one's).
  Lane(CudaBackendOptions options, std::shared_ptr<DeviceBudget> budget, std::function<void()> reclaim)
      : options_(options),
        budget_(budget),
        reclaim_(std::move(reclaim)),
        workspace_(std::move(budget)),
        staging_(options.staging_slice_bytes, cuda::StagingThreads(options.staging_threads)) {}
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() {
    cudaSetDevice(options_.device);
    staging_.DestroyEvents();
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init() {
    CUDA_TRY(cudaSetDevice(options_.device));
    CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUBLAS_TRY(cublasCreate(&handle_));
    CUBLAS_TRY(cublasSetStream(handle_, stream_));
    CUBLAS_TRY(cublasSetMathMode(handle_, options_.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    ATTNSERVE_RETURN_IF_ERROR(staging_.Init(stream_));
    return OkStatus();
  }

  // Out of room, the weights first take back this lane's and the idle lanes' workspaces.
  Status Upload(CudaResidentForm& resident) {
    CUDA_TRY(cudaSetDevice(options_.device));
    Status st = resident.Upload(stream_);
    if (st.code() != StatusCode::kResourceExhausted) return st;
    cudaGetLastError();  // a cudaMalloc that ran out leaves its error behind
    ReleaseWorkspace();
    reclaim_();
    return resident.Upload(stream_);
  }

  // Waits for what this lane's stream has queued: after a failed batch, the copies and kernels
  // it issued before the failure, which still read the pinned staging and write the workspace.
  // The stream's error, sticky or not, is what it reports.
  cudaError_t Drain() {
    cudaSetDevice(options_.device);
    return cudaStreamSynchronize(stream_);
  }

  // Called on an idle lane (no work in flight: every batch synchronises before it returns).
  void ReleaseWorkspace() {
    cudaSetDevice(options_.device);
    workspace_.Release();
  }

 private:
  cublasComputeType_t ComputeType() const {
    return options_.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }

  // Row-major y = alpha · x · w (+ beta · y). cuBLAS is column-major, where a row-major [r, c]
  // block is a [c, r] one: y^T = w^T x^T, so the operands swap.
  Status CublasGemm(DeviceBlock x, DeviceBlock w, DeviceBlock y, float alpha = 1.0f, float beta = 0.0f) {
    CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(w.cols), static_cast<int>(x.rows),
                            static_cast<int>(x.cols), &alpha, w.data, CUDA_R_32F, static_cast<int>(w.ld), x.data,
                            CUDA_R_32F, static_cast<int>(x.ld), &beta, y.data, CUDA_R_32F, static_cast<int>(y.ld),
                            ComputeType(), CUBLAS_GEMM_DEFAULT));
    return OkStatus();
  }

  // `count` products C_b = op(A_b) · B_b laid out at fixed strides, column-major as cuBLAS sees them.
  Status GemmStridedBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float* c,
                            int64_t ldc, int64_t stride_c, int64_t count) {
    const float beta = 0.0f;
    CUBLAS_TRY(cublasGemmStridedBatchedEx(handle_, op_a, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                                          static_cast<int>(k), &alpha, a, CUDA_R_32F, static_cast<int>(lda), stride_a,
                                          b, CUDA_R_32F, static_cast<int>(ldb), stride_b, &beta, c, CUDA_R_32F,
                                          static_cast<int>(ldc), stride_c, static_cast<int>(count), ComputeType(),
                                          CUBLAS_GEMM_DEFAULT));
    return OkStatus();
  }

  // `c.size()` products C_e = alpha · op(A_e) · B_e, column-major as cuBLAS sees them, in one
  // call: the pointer arrays are staged in pinned memory and copied to the device in one copy,
  // each call into slots of the batch's pointer arena of its own (Prepare sized it), so that no
  // slot is rewritten before the stream has copied it.
  Status GemmPointerBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha,
                            std::span<const float* const> a, int64_t lda, std::span<const float* const> b, int64_t ldb,
                            std::span<float* const> c, int64_t ldc) {
    const int64_t count = static_cast<int64_t>(c.size());
    if (pointers_used_ + 3 * count > pointer_slots_) {
      return InternalError("batched GEMM: " + std::to_string(3 * count) + " pointers past the batch's arena of " +
                           std::to_string(pointer_slots_) + " (" + std::to_string(pointers_used_) + " used)");
    }
    const void** host = pointers_host_.get() + pointers_used_;
    const void** device = pointers_device_ + pointers_used_;
    pointers_used_ += 3 * count;
    std::copy(a.begin(), a.end(), host);
    std::copy(b.begin(), b.end(), host + count);
    std::copy(c.begin(), c.end(), host + 2 * count);
    CUDA_TRY(cudaMemcpyAsync(device, host, 3 * count * sizeof(void*), cudaMemcpyHostToDevice, stream_));
    const float beta = 0.0f;
    CUBLAS_TRY(cublasGemmBatchedEx(handle_, op_a, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                                   static_cast<int>(k), &alpha, device, CUDA_R_32F, static_cast<int>(lda),
                                   device + count, CUDA_R_32F, static_cast<int>(ldb), &beta,
                                   const_cast<void**>(device + 2 * count), CUDA_R_32F, static_cast<int>(ldc),
                                   static_cast<int>(count), ComputeType(), CUBLAS_GEMM_DEFAULT));
    return OkStatus();
  }

  // Scores of every head for a block of one sequence's queries (q's rows, the first of them
  // query `first_row`) against k's rows: S_i = scale · Q_i K_g(i)^T ([heads, n, keys] in `s`),
  // then the masked softmax. In column-major terms S_i^T = K_g · Q_i^T: op(K) = T. Heads
  // i = g·group + j share K_g, so each j is one strided batch over the kv heads.
  Status Scores(const LayerConfig& c, DeviceBlock q, DeviceBlock k, int64_t first_row, bool causal, float* s,
                float* a_cat = nullptr) {
    const int64_t n = q.rows, keys = k.rows, dh = c.d_head, group = c.group_size();
    for (int64_t j = 0; j < group; ++j) {
      ATTNSERVE_RETURN_IF_ERROR(GemmStridedBatched(CUBLAS_OP_T, keys, n, dh, c.SoftmaxScale(), k.data, k.ld, dh,
                                                   q.data + j * dh, q.ld, group * dh, s + j * n * keys, keys,
                                                   group * n * keys, c.kv_heads));
    }
    const cuda::ScoreOperands operands{.q = q.data, .q_ld = q.ld, .k = k.data, .k_ld = k.ld, .d_head = dh,
                                       .group = group, .scale = c.SoftmaxScale()};
    CUDA_TRY(cuda::MaskedSoftmax(s, c.heads, n, first_row, keys, causal, operands, a_cat, stream_));
    return OkStatus();
  }

  // O_i = A_i · values_i into out's columns of head i (AttentionJob's columns). Column-major:
  // O_i^T = values_i^T · A_i^T. Heads at fixed strides (AttentionJob::StridedHeadWidth: the
  // factored form) run as strided batches; the others (the low-rank form's ragged widths, the
  // context as every head's values) head by head.
  Status Mix(const AttentionJob& job, DeviceBlock values, const float* s, int64_t n, int64_t keys, DeviceBlock out) {
    const LayerConfig& c = job.form->config;
    const int64_t group = c.group_size(), w = job.StridedHeadWidth();
    if (w > 0) {
      for (int64_t j = 0; j < group; ++j) {
        ATTNSERVE_RETURN_IF_ERROR(GemmStridedBatched(CUBLAS_OP_N, w, n, keys, 1.0f, values.data, values.ld, w,
                                                     s + j * n * keys, keys, group * n * keys, out.data + j * w, out.ld,
                                                     group * w, c.kv_heads));
      }
      return OkStatus();
    }
    for (int64_t i = 0; i < c.heads; ++i) {
      const DeviceBlock a{const_cast<float*>(s) + i * n * keys, n, keys, keys};
      ATTNSERVE_RETURN_IF_ERROR(CublasGemm(a, values.Cols(job.ValueColumn(i), job.Width(i)).Rows(0, keys),
                                           out.Cols(job.OutColumn(i), job.Width(i))));
    }
    return OkStatus();
  }

  // Every head's scores and softmax for a group of single-block ranges: one pointer-array GEMM
  // (entry (r, i): S_ri^T = K_g(i) Q_i^T of range r), one softmax launch; range r's scores at
  // scores_ + r·heads·rows·keys, and its A_cat (when a_cat is set) at a_cat + r·rows·keys·heads.
  Status GroupScores(const LayerConfig& c, std::span<const AttentionRange* const> group, int64_t rows, int64_t keys,
                     float* a_cat) {
    const int64_t heads = c.heads, dh = c.d_head, per_range = heads * rows * keys;
    std::vector<const float*> a, b;
    std::vector<float*> out;
    cuda::SoftmaxBlocks blocks;
    for (size_t r = 0; r < group.size(); ++r) {
      const AttentionRange& range = *group[r];
      const float* q = range.q.row(range.row0);
      for (int64_t i = 0; i < heads; ++i) {
        a.push_back(range.k.data + c.KvHeadOf(i) * dh);
        b.push_back(q + i * dh);
        out.push_back(scores_ + r * per_range + i * rows * keys);
      }
      blocks.block[blocks.count++] = {.scores = scores_ + r * per_range,
                                      .a_cat = a_cat == nullptr ? nullptr : a_cat + r * per_range,
                                      .q = q,
                                      .k = range.k.data,
                                      .first_row = range.row0,
                                      .causal = range.sequence->causal};
    }
    const AttentionRange& first = *group.front();
    ATTNSERVE_RETURN_IF_ERROR(
        GemmPointerBatched(CUBLAS_OP_T, keys, rows, dh, c.SoftmaxScale(), a, first.k.ld, b, first.q.ld, out, keys));
    const cuda::ScoreOperands shared{
        .q_ld = first.q.ld, .k_ld = first.k.ld, .d_head = dh, .group = c.group_size(), .scale = c.SoftmaxScale()};
    CUDA_TRY(cuda::MaskedSoftmaxBlocks(blocks, heads, rows, keys, shared, stream_));
    return OkStatus();
  }

  // The mixes of a group (after GroupScores): O_ri = A_ri · values_ri into range r's out columns
  // of head i, one pointer-array GEMM per distinct head width (one for every form but the
  // low-rank one, whose heads' ranks differ). Column-major: O^T = values^T · A^T.
  Status GroupMix(const AttentionJob& job, std::span<const AttentionRange* const> group, int64_t rows, int64_t keys) {
    const int64_t heads = job.form->config.heads, per_range = heads * rows * keys;
    std::vector<int64_t> widths;
    for (int64_t i = 0; i < heads; ++i) {
      if (std::find(widths.begin(), widths.end(), job.Width(i)) == widths.end()) widths.push_back(job.Width(i));
    }
    for (const int64_t width : widths) {
      if (width == 0) continue;
      std::vector<const float*> a, b;
      std::vector<float*> out;
      for (size_t r = 0; r < group.size(); ++r) {
        const AttentionRange& range = *group[r];
        for (int64_t i = 0; i < heads; ++i) {
          if (job.Width(i) != width) continue;
          a.push_back(range.values.data + job.ValueColumn(i));
          b.push_back(scores_ + r * per_range + i * rows * keys);
          out.push_back(range.out.data + job.OutColumn(i));
        }
      }
      const AttentionRange& first = *group.front();
      ATTNSERVE_RETURN_IF_ERROR(
          GemmPointerBatched(CUBLAS_OP_N, width, rows, keys, 1.0f, a, first.values.ld, b, keys, out, first.out.ld));
    }
    return OkStatus();
  }

  // Makes the workspace hold the plan `plan_for(max_score_workspace_bytes)` within the lane's
  // bound and the device memory budget: when it does not fit the budget, the idle lanes'
  // workspaces are taken back; when it still does not (or passes the lane's bound), the blocks
  // get as many query rows as the room left holds (at least one); failing that,
  // RESOURCE_EXHAUSTED with the figures.
  template <class PlanFor>
  StatusOr<WorkspacePlan> FitWorkspace(PlanFor plan_for) {
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
    // Smaller blocks: the room less the pieces linear in the tokens, for the two score pieces.
    const WorkspacePlan smallest = plan_for(0);  // one query row per block
    const int64_t score_bytes = ScoreBytesForRoom(smallest, room);
    plan = plan_for(std::max<int64_t>(0, score_bytes));
    if (plan.bytes() > room) {
      const std::string where = budget_room > lane_bound
                                    ? Mib(lane_bound) + " is one lane's bound (max_lane_workspace_bytes)"
                                    : Mib(std::max<int64_t>(room, 0)) + " is free under " + BudgetText(*budget_);
      return ResourceExhaustedError("device memory: this batch needs " + Mib(smallest.bytes()) +
                                    " of workspace even in blocks of one query row, and " + where +
                                    "; send fewer or shorter sequences at once, or raise the budget");
    }
    ATTNSERVE_RETURN_IF_ERROR(workspace_.Reserve(plan.total));
    return plan;
  }

  static DeviceBlock Block(ConstMatrixView v) { return {const_cast<float*>(v.data), v.rows, v.cols, v.ld}; }

 public:
  // Runs one batch on this lane's stream (the skeleton over this lane's operations); returns
  // once the outputs are written.
  Status RunBatch(const CudaResidentForm& r, std::span<const Sequence> batch) {
    CUDA_TRY(cudaSetDevice(options_.device));
    const DeviceWeights w = WeightsAt(r.weights(), r.w_in.get(), r.b_in.get(), r.w_out.get(), r.b_out.get());
    batch_bytes_ = 0;
    const Status st = RunWithinBound(r.weights(), w, batch);
    TrimAfterBatch();
    return st;
  }

  // The split of this lane's last finished batch (its last part, when it ran in parts).
  const DeviceTimes& last_times() const { return last_times_; }

  // Host memory this lane keeps between batches: its pinned staging buffers.
  int64_t PinnedBytes() const { return staging_.PinnedBytes() + pointers_host_.bytes(); }

 private:
  // A batch whose workspace does not fit (the lane's bound, or the budget's room while other
  // lanes hold theirs), even in blocks of one query row, runs in halves, in order, each a forward
  // of its own: the sequences are independent, and Prepare refused before anything ran. A
  // sequence that does not fit alone fails with FitWorkspace's figures.
  Status RunWithinBound(const FormWeights& f, const DeviceWeights& w, std::span<const Sequence> batch) {
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
  void TrimAfterBatch() {
    const int64_t keep = options_.retain_workspace_bytes;
    const bool oversized = batch_bytes_ > keep;
    const bool in_a_run = oversized && oversized_before_;
    oversized_before_ = oversized;
    if (in_a_run) return;
    if (static_cast<int64_t>(workspace_.capacity() * sizeof(float)) > keep) {
      cudaStreamSynchronize(stream_);
      workspace_.Release();
    }
    if (PinnedBytes() > keep) {
      cudaStreamSynchronize(stream_);
      staging_.ReleasePinned();
      pointers_host_.Release();
    }
  }

 public:
  // A summed sequence mixes first only by shape (n < m) and only when the options allow it
  // (CudaBackendOptions::summed_mix_first): a device holds A_cat a block of query rows at a time
  // (the workspace's score pieces), so mixing first buys FLOPs, not memory. The mixes' bound is
  // the score workspace's.
  PlanPolicy Policy() const override {
    return {.summed_order = SummedOrderOf(options_), .max_mix_bytes = options_.max_score_workspace_bytes};
  }

  // Workspace: one allocation carved into the pieces this batch needs. Inputs and (when staged)
  // contexts share the first piece, in that order. Blocks of query rows keep the scores linear in
  // the sequence length (not heads · n · L). The inputs go through pinned memory, one copy.
  Status Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                 ForwardBuffers& b) override {
    const LayerConfig& c = f.config;
    const int64_t d = c.d_model, tx = plan.rows.queries, tc = plan.rows.contexts;
    const bool all_self = plan.rows.all_self;
    const int64_t c_rows = all_self ? 0 : tc;  // contexts are staged only when some differ
    const int64_t guard = options_.guard_zones ? kGuardFloats : 0;
    auto plan_for = [&](int64_t score_bytes) { return PlanWorkspace(f, plan, batch, score_bytes, guard); };
    StatusOr<WorkspacePlan> fitted = FitWorkspace(plan_for);
    if (!fitted.ok()) {
      workspace_refused_ = fitted.status().code() == StatusCode::kResourceExhausted;
      return fitted.status();
    }
    const WorkspacePlan& w = *fitted;
    const int64_t staged = (tx + c_rows) * d + tx * d;  // pinned floats: inputs (and contexts), outputs
    batch_bytes_ = std::max({batch_bytes_, w.bytes(), staged * static_cast<int64_t>(sizeof(float))});
    const PieceLayout layout = LayOut(w, guard);
    float* piece[kPieces];
    guards_.Clear();
    for (int p = 0; p < kPieces; ++p) {
      piece[p] = workspace_.get() + layout.offset[p];
      // The piece's alignment padding and the guard after it, filled on the stream before any
      // work of the batch: a kernel or GEMM that writes past its piece changes them.
      if (guard > 0) {
        ATTNSERVE_RETURN_IF_ERROR(
            guards_.Add(PieceName(p), workspace_.get() + layout.guard_offset[p], layout.guard_floats[p], stream_));
      }
    }
    score_bytes_ = w.score_bytes;
    score_capacity_ = w.sizes[kScores];
    scores_ = piece[kScores];
    a_cat_ = piece[kACat];
    pointer_slots_ = w.sizes[kPointers] / kFloatsPerPointer;
    ATTNSERVE_RETURN_IF_ERROR(pointers_host_.Reserve(pointer_slots_));
    pointers_device_ = reinterpret_cast<const void**>(piece[kPointers]);
    pointers_used_ = 0;

    ATTNSERVE_RETURN_IF_ERROR(staging_.StageInputs(batch, all_self, d, piece[kInputs]));
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
    mixes_ = piece[kMixes];
    return OkStatus();
  }

  StatusOr<float*> MixBuffer(const BatchPlan&) override { return mixes_; }

  Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) override {
    ATTNSERVE_RETURN_IF_ERROR(CublasGemm(Block(x), Block(w), Block(y), 1.0f, accumulate ? 1.0f : 0.0f));
    if (bias != nullptr) CUDA_TRY(cuda::AddRowBias(y.data, y.rows, y.cols, y.ld, bias, stream_));
    return OkStatus();
  }

  // One launch per kRopeMaxRuns sequences (a run that does not follow on from the one before
  // starts a launch of its own).
  Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) override {
    cuda::RopeRuns launch;
    const auto flush = [&]() -> Status {
      if (launch.count > 0) CUDA_TRY(cuda::ApplyRope(m.data, heads, d_head, m.ld, theta, launch, stream_));
      launch = {};
      return OkStatus();
    };
    for (const RopeRun& run : runs) {
      if (run.rows == 0) continue;
      if (launch.count == cuda::kRopeMaxRuns || (launch.count > 0 && run.row0 != launch.end)) {
        ATTNSERVE_RETURN_IF_ERROR(flush());
      }
      launch.row0[launch.count] = run.row0;
      launch.position[launch.count] = run.position;
      ++launch.count;
      launch.end = run.row0 + run.rows;
    }
    return flush();
  }

  // Per range, blocks of query rows: every head's scores and softmax in the score piece, then
  // the mix into the block's rows of out.
  Status Attend(const AttentionJob& job) override {
    const LayerConfig& c = job.form->config;
    for (const RangeGroup& g : GroupRanges(*job.form, job.ranges, score_bytes_, score_capacity_, cuda::kSoftmaxMaxBlocks)) {
      if (g.ranges.size() > 1) {
        ATTNSERVE_RETURN_IF_ERROR(GroupScores(c, g.ranges, g.rows, g.keys, nullptr));
        ATTNSERVE_RETURN_IF_ERROR(GroupMix(job, g.ranges, g.rows, g.keys));
        continue;
      }
      const AttentionRange& range = *g.ranges.front();
      ATTNSERVE_RETURN_IF_ERROR(ForEachBlock(*job.form, range, score_bytes_, [&](int64_t row0, int64_t rows, int64_t keys) {
        ATTNSERVE_RETURN_IF_ERROR(Scores(c, Block(range.q).Rows(row0, rows), Block(range.k).Rows(0, keys), row0,
                                         range.sequence->causal, scores_));
        return Mix(job, Block(range.values), scores_, rows, keys, Block(range.out).Rows(row0 - range.row0, rows));
      }));
    }
    return OkStatus();
  }

  // Per range, blocks of query rows: the scores, their softmax written straight into the block's
  // A_cat (a second score piece), and the head sum as one GEMM into the block's rows of out;
  // then the bias.
  Status SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                 const float* bias) override {
    const LayerConfig& c = f.config;
    for (const RangeGroup& g : GroupRanges(f, ranges, score_bytes_, score_capacity_, cuda::kSoftmaxMaxBlocks)) {
      if (g.ranges.size() > 1) {
        // Each range's A_cat [rows, keys·h] by the group's softmax, then every range's head sum
        // out_r = A_cat_r · [M_1; …; M_h] in one pointer-array GEMM.
        ATTNSERVE_RETURN_IF_ERROR(GroupScores(c, g.ranges, g.rows, g.keys, a_cat_));
        const int64_t inner = g.keys * c.heads;
        std::vector<const float*> m, a;
        std::vector<float*> out;
        for (size_t r = 0; r < g.ranges.size(); ++r) {
          m.push_back(g.ranges[r]->values.data);
          a.push_back(a_cat_ + r * g.rows * inner);
          out.push_back(g.ranges[r]->out.data);
        }
        ATTNSERVE_RETURN_IF_ERROR(GemmPointerBatched(CUBLAS_OP_N, c.d_model, g.rows, inner, 1.0f, m, c.d_model, a,
                                                     inner, out, g.ranges.front()->out.ld));
        continue;
      }
      const AttentionRange& range = *g.ranges.front();
      ATTNSERVE_RETURN_IF_ERROR(ForEachBlock(f, range, score_bytes_, [&](int64_t row0, int64_t rows, int64_t keys) {
        ATTNSERVE_RETURN_IF_ERROR(Scores(c, Block(range.q).Rows(row0, rows), Block(range.k).Rows(0, keys), row0,
                                         range.sequence->causal, scores_, a_cat_));
        const MatrixView a_cat(a_cat_, rows, keys * c.heads);
        const ConstMatrixView m(range.values.data, keys * c.heads, c.d_model);
        return Gemm(a_cat, m, nullptr, range.out.RowBlock(row0 - range.row0, rows), /*accumulate=*/false);
      }));
    }
    // The bias once over the outputs, not once a block or a range: the ranges' rows follow each
    // other in y, so one launch covers each run of adjacent ones (all of them, here).
    if (bias == nullptr) return OkStatus();
    for (size_t first = 0; first < ranges.size();) {
      MatrixView rows = ranges[first].out;
      size_t last = first + 1;
      for (; last < ranges.size(); ++last) {
        const MatrixView next = ranges[last].out;
        if (next.data != rows.row(rows.rows) || next.ld != rows.ld || next.cols != rows.cols) break;
        rows.rows += next.rows;
      }
      CUDA_TRY(cuda::AddRowBias(rows.data, rows.rows, rows.cols, rows.ld, bias, stream_));
      first = last;
    }
    return OkStatus();
  }

  // Every output is in y (ForwardBuffers::outputs are its rows, ld = d): brought back through
  // pinned memory (Staging::ReturnOutputs). Then the guard zones and the batch's split.
  Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool) override {
    ATTNSERVE_RETURN_IF_ERROR(staging_.ReturnOutputs(plan, batch, b.y.data, b.y.cols));
    ATTNSERVE_RETURN_IF_ERROR(guards_.Check());
    ATTNSERVE_ASSIGN_OR_RETURN(last_times_, staging_.ReadTimes());
    return OkStatus();
  }

 private:
  CudaBackendOptions options_;
  std::shared_ptr<DeviceBudget> budget_;
  std::function<void()> reclaim_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  DeviceArray workspace_;
  bool workspace_refused_ = false;  // the batch's Prepare found no room (RunWithinBound)
  // This batch's score pieces, the bound its blocks were cut to, and its mixes piece (Prepare).
  int64_t score_bytes_ = 0;
  int64_t score_capacity_ = 0;  // floats
  float* scores_ = nullptr;
  float* a_cat_ = nullptr;
  float* mixes_ = nullptr;
  // This batch's pointer arena (Prepare): device slots, how many, how many used so far.
  const void** pointers_device_ = nullptr;
  cuda::GuardZones guards_;  // this batch's (options_.guard_zones)
  int64_t pointer_slots_ = 0, pointers_used_ = 0;
  PinnedArray<const void*> pointers_host_;  // the pointer arrays of batched GEMMs, staged
  cuda::Staging staging_;
  DeviceTimes last_times_;
  // The most device workspace or pinned staging this batch needed, in bytes (Prepare), and
  // whether the batch before it needed more than retain_workspace_bytes (TrimAfterBatch).
  int64_t batch_bytes_ = 0;
  bool oversized_before_ = false;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(CudaBackendOptions options) : options_(options) {}

  // One lane up front, so that a device that cannot be used fails here, at start-up.
  Status Init() {
    int64_t limit = options_.max_device_bytes;
    if (limit <= 0) {
      size_t free = 0, total = 0;
      CUDA_TRY(cudaSetDevice(options_.device));
      CUDA_TRY(cudaMemGetInfo(&free, &total));
      limit = static_cast<int64_t>(kDefaultDeviceMemoryFraction * static_cast<double>(free));
    }
    options_.max_device_bytes = limit;
    if (options_.max_lane_workspace_bytes <= 0) options_.max_lane_workspace_bytes = limit;
    budget_ = std::make_shared<DeviceBudget>(limit);
    ATTNSERVE_ASSIGN_OR_RETURN(auto lane, NewLane());
    MutexLock lock(mu_);
    idle_.push_back(std::move(lane));
    return OkStatus();
  }

  std::string DeviceName() const override { return "cuda:" + std::to_string(options_.device); }
  // The summed form in the order it runs.
  double Flops(const FormWeights& form, std::span<const SequenceShape> batch) const override {
    return ForwardFlops(form, batch, SummedOrderOf(options_));
  }
  bool Healthy() const override { return healthy_.load(); }
  // Host memory a batch needs here: what its lane pins (Prepare), the inputs (and the contexts,
  // when some differ from the queries) and the outputs, and the batched GEMMs' pointer arrays
  // (a part per sequence, and one more for a summed sequence that mixes first; one split into
  // several blocks of query rows needs a few hundred bytes a block more). Not the CPU formula the
  // default charges: the projections, scores and A_cat live on the device, under its own budget
  // (--max-device-memory-mb), and charging them to the host refused batches the GPU can run.
  int64_t ScratchBytes(const FormWeights& form, std::span<const SequenceShape> batch,
                       bool self_attention) const override {
    int64_t queries = 0, contexts = 0, parts = 0;
    const bool summed = form.head_combine() == HeadCombine::kSumOfMixes;
    for (const SequenceShape& s : batch) {
      queries += s.n;
      contexts += s.m;
      parts += 1 + (summed && SummedOrderOf(options_).mix_first_allowed && s.n < s.m ? 1 : 0);
    }
    const int64_t floats = (2 * queries + (self_attention ? 0 : contexts)) * form.config.d_model;
    const int64_t pointers = 3 * (2 * form.config.heads + 1) * parts;
    return floats * static_cast<int64_t>(sizeof(float)) + pointers * static_cast<int64_t>(sizeof(void*));
  }
  // The idle lanes' pinned staging (a busy lane's counts once it is back).
  int64_t RetainedScratchBytes() const override {
    MutexLock lock(mu_);
    int64_t bytes = 0;
    for (const auto& lane : idle_) bytes += lane->PinnedBytes();
    return bytes;
  }

  StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> form) override {
    if (!form) return InvalidArgumentError("Upload: no form given");
    ATTNSERVE_RETURN_IF_ERROR(CheckHeadCombine(*form));
    auto resident = std::make_shared<CudaResidentForm>(std::move(form), budget_);
    Status st = WithLane([&](Lane& lane) { return lane.Upload(*resident); });
    if (!st.ok()) return st;
    return std::shared_ptr<const ResidentForm>(std::move(resident));
  }

  Status Forward(const ResidentForm& form, std::span<const Sequence> batch) override {
    const auto* resident = dynamic_cast<const CudaResidentForm*>(&form);
    if (resident == nullptr) return InvalidArgumentError("Forward: form was not uploaded to " + DeviceName());
    if (batch.empty()) return OkStatus();
    ATTNSERVE_RETURN_IF_ERROR(ValidateBatch(resident->weights().config, batch));
    if (!Healthy()) return InternalError(DeviceName() + " is unhealthy after an earlier device error");
    const Status st = WithLane([&](Lane& lane) {
      ATTNSERVE_RETURN_IF_ERROR(lane.RunBatch(*resident, batch));
      MutexLock lock(mu_);
      last_times_ = lane.last_times();
      return OkStatus();
    });
    return st;
  }

  std::optional<DeviceTimes> LastDeviceTimes() const override {
    MutexLock lock(mu_);
    return last_times_;
  }

 private:
  // After a failed upload or batch, given what draining its lane's stream reported (`drained`):
  // the device is out of service only when its context is lost, which every CUDA call then
  // reports (a sticky error; the lane's own stream reports it as well as the device would); a
  // recoverable error (out of memory, an invalid value) fails this batch alone. No device-wide
  // synchronisation: a client's RESOURCE_EXHAUSTED must not stall every other lane. The error's
  // leftover is cleared here so that it cannot fail the next, unrelated call on this thread.
  Status MarkFailed(Status st, cudaError_t drained) {
    const cudaError_t leftover = cudaGetLastError();
    const cudaError_t lost = IsStickyError(drained) ? drained : (IsStickyError(leftover) ? leftover : cudaSuccess);
    if (lost != cudaSuccess) {
      healthy_.store(false);
      return InternalError(st.message() + " (the device is lost: " + cudaGetErrorString(lost) + ")");
    }
    return st;
  }

  // Takes back the idle lanes' workspaces for a lane or an upload that needs the room.
  void ReleaseIdleWorkspaces() {
    MutexLock lock(mu_);
    for (auto& lane : idle_) lane->ReleaseWorkspace();
  }

  StatusOr<std::unique_ptr<Lane>> NewLane() {
    auto lane = std::make_unique<Lane>(options_, budget_, [this] { ReleaseIdleWorkspaces(); });
    ATTNSERVE_RETURN_IF_ERROR(lane->Init());
    return lane;
  }

  // Runs `work` on an idle lane, or on a new one when every lane is busy: as many lanes as
  // callers at once (the executor's workers), each reused afterwards.
  template <class Work>
  Status WithLane(Work work) {
    std::unique_ptr<Lane> lane;
    {
      MutexLock lock(mu_);
      if (!idle_.empty()) {
        lane = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    if (!lane) {
      auto made = NewLane();
      if (!made.ok()) return MarkFailed(made.status(), cudaSuccess);
      lane = std::move(made).value();
    }
    Status st = work(*lane);
    // A failed batch may have left work queued on the lane's stream that reads its pinned staging
    // buffers: the lane goes back only once the stream has drained, or the next batch on it would
    // overwrite them under the failed batch's copies.
    if (!st.ok()) st = MarkFailed(st, lane->Drain());
    MutexLock lock(mu_);
    idle_.push_back(std::move(lane));
    return st;
  }

  CudaBackendOptions options_;
  std::shared_ptr<DeviceBudget> budget_;  // set by Init, shared with the lanes and the weights
  std::atomic<bool> healthy_{true};
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Lane>> idle_ ATTNSERVE_GUARDED_BY(mu_);
  std::optional<DeviceTimes> last_times_ ATTNSERVE_GUARDED_BY(mu_);
};

}  // namespace

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "no CUDA device present";
  return count;
}

StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options) {
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count == 0) return UnavailableError("no usable GPU: " + why);
  if (options.device < 0 || options.device >= count) {
    return UnavailableError("cuda:" + std::to_string(options.device) + " requested, but only " +
                            std::to_string(count) + " device(s) present");
  }
  auto backend = std::make_unique<CudaBackend>(options);
  Status st = backend->Init();
  if (!st.ok()) return UnavailableError("cuda:" + std::to_string(options.device) + ": " + st.message());
  return std::unique_ptr<Backend>(std::move(backend));
}

StatusOr<double> CudaSgemmGflops(const CudaBackendOptions& options, int64_t size) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto backend, MakeCudaBackend(options));
  DeviceArray a, b, c;
  const size_t count = size * size;
  ATTNSERVE_RETURN_IF_ERROR(a.Reserve(count));
  ATTNSERVE_RETURN_IF_ERROR(b.Reserve(count));
  ATTNSERVE_RETURN_IF_ERROR(c.Reserve(count));
  // Random values in [-1, 1), not zeros: a GPU multiplying zeros toggles fewer bits, draws less
  // power and clocks higher, which would flatter the ceiling every ratio is taken against.
  {
    std::vector<float> host(count);
    uint32_t state = 0x9e3779b9u;
    for (float& v : host) {
      state = state * 1664525u + 1013904223u;
      v = static_cast<float>(state >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
    CUDA_TRY(cudaMemcpy(a.get(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    std::reverse(host.begin(), host.end());
    CUDA_TRY(cudaMemcpy(b.get(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  }
  cublasHandle_t handle;
  CUBLAS_TRY(cublasCreate(&handle));
  cublasSetMathMode(handle, options.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
  const float one = 1.0f, zero = 0.0f;
  const int s = static_cast<int>(size);
  auto run = [&] { return cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, s, s, s, &one, a.get(), s, b.get(), s, &zero, c.get(), s); };
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kReps = 20;
  cudaEventRecord(start);
  for (int i = 0; i < kReps; ++i) run();
  cudaEventRecord(stop);
  const cudaError_t e = cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  ATTNSERVE_RETURN_IF_ERROR(CudaCheck(e, "SGEMM ceiling"));
  return 2.0 * size * size * size * kReps / (ms * 1e-3) * 1e-9;
}

}  // namespace attnserve
