// The CUDA backend: the attention skeleton (server/backend/attention) over a lane's device
// operations — cuBLAS for every GEMM, small kernels (kernels.cu) for the masked softmax, RoPE,
// bias adds and the summed form's head interleave. Each sequence's attention runs in blocks of
// query rows whose scores fit max_score_workspace_bytes, so device memory grows linearly with
// the sequence length (docs/architecture.md, "The CUDA backend", names the files that do each
// part). This header includes no CUDA headers, so the server can choose a device without
// compiling against CUDA.
// Thread-safety: Upload and Forward may be called from several threads at once. Each call runs
// on a lane — a stream, a cuBLAS handle, scratch and pinned buffers — that no other call uses
// meanwhile; lanes are made on demand, so there are as many as callers at once (the executor's
// workers), and their batches overlap on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "server/backend/backend.h"
#include "server/core/math.h"

namespace attnserve {

struct CudaBackendOptions {
  int device = 0;
  // What the projections' GEMMs multiply (--gpu-math; server/core/math.h), float32 by default.
  // kTf32: TF32 tensor cores (inputs rounded to a 10-bit mantissa) for every GEMM. kBf16, kFp16:
  // the form's W_in and W_out held on the device in bfloat16 or IEEE half (converted once at
  // upload, half the bytes), the inputs rounded while staged and the other activations on the
  // device before each product by a weight, float32 accumulation and outputs, the biases in the
  // GEMMs' epilogue; attention in float32, but for bf16's fused kernel on the tensor cores. Each
  // resident form carries its own (Backend::UploadIn).
  Math math = Math::kFp32;
  // Device memory for one block of a sequence's attention: its scores (heads · rows · keys
  // floats) and, for the summed form, the interleaved A_cat block of the same size. Each
  // sequence's queries run in blocks of as many rows as fit (at least one), so the workspace
  // grows linearly with the sequence length rather than with n · L.
  int64_t max_score_workspace_bytes = int64_t{256} << 20;
  // Device memory the backend may hold, as it counts it: the weights it uploaded and every
  // lane's workspace (not the CUDA context, cuBLAS's own workspace or what others hold). 0:
  // kDefaultDeviceMemoryFraction of the device memory free at start-up (cudaMemGetInfo), so
  // that what other processes already hold on a shared card is left to them.
  // A batch that would pass it first takes idle lanes' workspaces back, then runs in smaller
  // query-row blocks, and only then fails with RESOURCE_EXHAUSTED; the device keeps serving.
  int64_t max_device_bytes = 0;
  // One lane's workspace at most (0: max_device_bytes as resolved). A batch past it, or past
  // the room the budget has left while other lanes hold theirs, runs in smaller query-row
  // blocks, then in halves of its sequences (each a forward of its own); a sequence that does
  // not fit alone fails with RESOURCE_EXHAUSTED and the figures.
  int64_t max_lane_workspace_bytes = 0;
  // What a lane keeps after a batch for the next one: a device workspace or pinned staging
  // larger than this is released when its batch ends (as the CPU backend frees scratch above
  // 256 MiB), so a rare large batch does not hold its memory for good — unless the batch before
  // it needed more than this too: a run of large batches keeps its memory (reallocating a
  // workspace of hundreds of MiB a batch costs device synchronisations and allocations), and
  // the first batch of the run, and the first that fits under this again, release it.
  int64_t retain_workspace_bytes = int64_t{256} << 20;
  // Inputs go to the device, and outputs come back, in slices of about this many bytes (whole
  // rows): the host packs the next slice into pinned memory while the copy engine moves this
  // one, and unpacks a slice of outputs while the next is still on its way.
  int64_t staging_slice_bytes = int64_t{4} << 20;
  // Host threads that pack a slice into pinned memory, and unpack one, together (the lane's
  // thread and staging_threads − 1 helpers of a compute team, server/backend/compute_team.h):
  // one thread's memcpy from pageable memory, rather than the copy engine, is the likely pace
  // of a large batch's copies. Slices of under 256 KiB are packed by the lane's thread alone.
  // Capped at the host's hardware threads. 4 is where the gain stopped on an H200's 16-core
  // host (docs/journal/benchmarks-journal.md, "The second run on a GPU", has the figures).
  int staging_threads = 4;
  // The summed form's association order (SummedMixesFirst): with it, a sequence with fewer
  // queries than keys mixes them first, Y = Σ_i (A_i C) W_M_i (m/n fewer projection FLOPs, one
  // mix GEMM per head instead of strided batches); without it, every summed sequence projects
  // first, whose A_cat is a block of rows at a time here anyway. Off until measured on a device.
  bool summed_mix_first = false;
  // Attention as the score GEMM, the masked softmax kernel and the mix GEMM, the scores through
  // a workspace piece between them, instead of the fused kernel (fused_attention.h: scores,
  // online softmax and mix in one launch, the scores never in device memory). The fused kernel
  // takes every job whose heads are at most kFusedMaxDHead and kFusedMaxWidth wide at fixed
  // strides (the factored form, the low-rank form at one rank, the summed form mixing first at
  // d_model ≤ 128); the others take this path anyway.
  bool gemm_attention = false;
  // Batches of at most this many rows (query rows plus separately staged context rows) run as
  // CUDA graphs: the first batch of a signature (the form, each sequence's shape, mask and
  // positions, the workspace's layout) is captured and instantiated, the later ones of that
  // signature replay it in one launch instead of tens of kernel and GEMM launches; a lane keeps
  // kGraphsPerLane of them. 0: off. Off until measured on a device: what a replay saves is
  // launch overhead on the host, which matters only where a batch's kernels are shorter than
  // their launches (docs/architecture.md, "CUDA graphs").
  int graph_rows = 0;
  // Guard zones after every piece of a lane's workspace, filled with a pattern before a batch
  // and checked after it (a write past its piece fails the batch with INTERNAL naming the
  // piece): for the tests, which run the backend suite so; a device read-back per batch else.
  bool guard_zones = false;
};

inline constexpr double kDefaultDeviceMemoryFraction = 0.9;

// Number of usable CUDA devices; 0 with `why` set when there are none or the driver fails
// (with the runtime linked but no GPU, cudaGetDeviceCount returns an error, not 0).
int CudaDeviceCount(std::string* why);

// Fails with UNAVAILABLE and the reason when the device cannot be used.
StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options);

}  // namespace attnserve
