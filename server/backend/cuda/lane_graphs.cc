// A lane's CUDA graphs (CudaBackendOptions::graph_rows): the device work of a small batch,
// between its staged inputs and its outputs' copies, captured once per signature and replayed
// in one launch afterwards. docs/architecture.md, "CUDA graphs".
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>

#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/lane.h"

namespace attnserve::cuda {

uint64_t CudaResidentForm::NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// Everything that changes an argument or a pointer of the batch's launches: the form (its
// weights' addresses and shapes), the math, where the workspace and each of its pieces lie and
// the score bound its blocks were cut to (the plan's row offsets follow from the sequences
// below), and each sequence's queries, context rows (or none: self-attention), visible keys,
// mask and, under RoPE, position offset. The inputs' values are not in it: the graph reads them
// from the workspace, where this batch's copies put them.
std::vector<int64_t> Lane::GraphKey(const FormWeights& f, const BatchPlan& plan,
                                    std::span<const Sequence> batch) const {
  std::vector<int64_t> key = {static_cast<int64_t>(resident_->serial),
                              static_cast<int64_t>(math()),
                              batch_.score_bytes,
                              batch_.pointer_slots,
                              static_cast<int64_t>(plan.combine),
                              static_cast<int64_t>(batch.size())};
  for (const float* p : batch_.piece) key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(p)));
  const bool rope = f.config.rope_theta > 0.0;
  for (const Sequence& s : batch) {
    key.insert(key.end(), {s.n(), s.self_attention() ? -1 : s.m(), s.visible_keys(), s.causal ? 1 : 0,
                           rope ? s.position_offset : 0});
  }
  return key;
}

void Lane::BeginGraph(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch) {
  graph_mode_ = GraphMode::kOff;
  if (options_.graph_rows <= 0) return;
  // A workspace allocated anew (grown, or released and taken again) invalidates every graph:
  // their pointers are baked in.
  if (workspace_.get() != graph_workspace_ || workspace_.capacity() != graph_workspace_capacity_) {
    graphs_.Clear();
    graph_workspace_ = workspace_.get();
    graph_workspace_capacity_ = workspace_.capacity();
  }
  const int64_t rows = plan.rows.queries + (plan.rows.all_self ? 0 : plan.rows.contexts);
  if (graphs_refused_ || rows > options_.graph_rows || graph_counts_.failures >= kGraphFailuresPerLane) return;
  graph_key_ = GraphKey(f, plan, batch);
  if (graphs_.Find(graph_key_) != nullptr) {
    graph_mode_ = GraphMode::kReplaying;
    return;
  }
  // ThreadLocal: another lane's thread allocating or freeing meanwhile does not spoil this
  // capture, and this thread's own such calls (none are made between here and LaunchGraph) would.
  if (const cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal); e != cudaSuccess) {
    GraphFailed("cudaStreamBeginCapture", e);
    capture_failed_ = false;  // nothing was recorded: the batch goes on as it is
    cudaGetLastError();
    return;
  }
  gemms_.DeferPointerCopies(true);
  graph_mode_ = GraphMode::kCapturing;
}

// Queued after the staged inputs and before the outputs' copies: the pointer arena's contents,
// then the graph. A capture becomes its graph here, and runs (capturing ran nothing).
Status Lane::LaunchGraph() {
  if (graph_mode_ == GraphMode::kReplaying) {
    const GraphCache::Entry* entry = graphs_.Find(graph_key_);
    if (entry == nullptr) return InternalError("CUDA graph: the replayed batch's graph is gone");
    ATTNSERVE_RETURN_IF_ERROR(gemms_.CopyPointers(entry->pointers));
    CUDA_TRY(cudaGraphLaunch(entry->exec, stream_));
    graph_counts_.replays++;
    return OkStatus();
  }
  if (graph_mode_ != GraphMode::kCapturing) return OkStatus();
  graph_mode_ = GraphMode::kOff;
  gemms_.DeferPointerCopies(false);
  cudaGraph_t graph = nullptr;
  if (const cudaError_t e = cudaStreamEndCapture(stream_, &graph); e != cudaSuccess) {
    GraphFailed("cudaStreamEndCapture", e);
    return InternalError("CUDA graph capture failed");  // RunBatch runs the batch again
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    GraphFailed("cudaGraphInstantiate", e);
    return InternalError("CUDA graph instantiation failed");
  }
  std::vector<const void*> pointers = gemms_.StagedPointers();
  ATTNSERVE_RETURN_IF_ERROR(gemms_.CopyPointers(pointers));
  graphs_.Insert(graph_key_, exec, std::move(pointers));
  CUDA_TRY(cudaGraphLaunch(exec, stream_));
  graph_counts_.captures++;
  return OkStatus();
}

void Lane::AbandonCapture() {
  if (graph_mode_ != GraphMode::kCapturing) return;
  graph_mode_ = GraphMode::kOff;
  gemms_.DeferPointerCopies(false);
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  GraphFailed("a capture's batch", e == cudaSuccess ? cudaErrorStreamCaptureInvalidated : e);
}

// Counted per lane and said once per process: a device or driver that refuses graphs refuses
// every one, and each batch still runs (without).
void Lane::GraphFailed(const char* step, cudaError_t error) {
  graph_counts_.failures++;
  capture_failed_ = true;
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "attnserve: CUDA graph: %s failed (%s); the batch ran without a graph, as will any whose "
                 "capture fails\n",
                 step, cudaGetErrorName(error));
  }
}

}  // namespace attnserve::cuda
