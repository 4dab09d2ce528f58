// The GEMMs of a CUDA lane on its cuBLAS handle and stream: row-major blocks over cuBLAS's
// column-major calls, strided batches, and pointer-array batches whose arrays go to the device
// through the batch's pointer arena (docs/architecture.md, "The CUDA backend", step 4).
// Thread-safety: a CublasOps serves one lane, on that lane's thread.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/staging.h"
#include "server/core/status.h"

namespace attnserve::cuda {

// A row-major device matrix block: rows × cols, row stride ld.
struct DeviceBlock {
  float* data;
  int64_t rows, cols, ld;
  DeviceBlock Rows(int64_t first, int64_t count) const { return {data + first * ld, count, cols, ld}; }
  DeviceBlock Cols(int64_t first, int64_t count) const { return {data + first, rows, count, ld}; }
};

// The same over 16-bit values (bfloat16 or half, by the handle's Math), as raw bits.
struct HalfBlock {
  const uint16_t* data;
  int64_t rows, cols, ld;
};

class CublasOps {
 public:
  CublasOps() = default;
  CublasOps(const CublasOps&) = delete;
  CublasOps& operator=(const CublasOps&) = delete;
  ~CublasOps() { Destroy(); }

  // A handle whose every call is queued on `stream` (the lane's; never the legacy default
  // stream, which the lane's non-blocking stream does not wait for), in TF32 under kTf32; under
  // kBf16 and kFp16 GemmHalf's operands are of that type.
  Status Init(cudaStream_t stream, Math math);
  // The math of the form a batch runs (its resident form's): each lane runs every math its
  // backend holds forms in. Cheap when unchanged.
  Status SetMath(Math math);
  // Destroys the handle on the current device, before the lane destroys its stream; idempotent.
  void Destroy();

  // Row-major y = alpha · x · w (+ beta · y). cuBLAS is column-major, where a row-major [r, c]
  // block is a [c, r] one: y^T = w^T x^T, so the operands swap.
  Status Gemm(DeviceBlock x, DeviceBlock w, DeviceBlock y, float alpha = 1.0f, float beta = 0.0f);

  // Row-major y = x · w + beta · y over 16-bit x and w (one cublasGemmEx, CUBLAS_COMPUTE_32F:
  // products and sums in float32, y float32). INTERNAL unless the handle's math is kBf16 or kFp16.
  Status GemmHalf(HalfBlock x, HalfBlock w, DeviceBlock y, float beta);

  // The same with `bias` (one float per column of y, in device memory) added in the GEMM's
  // epilogue: one cublasLtMatmul (CUBLASLT_EPILOGUE_BIAS) in place of a GEMM and a bias kernel.
  // False, with nothing queued, when cuBLASLt offers no algorithm for these operands (their
  // alignments are given to its heuristic) or the bias is not 16-byte aligned: the caller then
  // runs GemmHalf and adds the bias itself. The descriptors and the algorithm are kept per
  // shape and alignment (kMaxLtPlans of them), so a batch after the first queries nothing.
  StatusOr<bool> GemmHalfBias(HalfBlock x, HalfBlock w, const float* bias, DeviceBlock y, float beta);

  // `count` products C_b = op(A_b) · B_b laid out at fixed strides, column-major as cuBLAS sees them.
  Status GemmStridedBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float* c,
                            int64_t ldc, int64_t stride_c, int64_t count);

  // The batch's pointer arena: `slots` pointers at `device` (the workspace's pointer piece), and
  // as many pinned on the host to stage them. Every pointer-array GEMM of the batch takes slots
  // of its own from it.
  Status StartBatch(const void** device, int64_t slots);

  // `c.size()` products C_e = alpha · op(A_e) · B_e, column-major as cuBLAS sees them, in one
  // call: the pointer arrays are staged in pinned memory and copied to the device in one copy,
  // each call into slots of the batch's pointer arena of its own, so that no slot is rewritten
  // before the stream has copied it. INTERNAL when the arena has no room left.
  Status GemmPointerBatched(cublasOperation_t op_a, int64_t m, int64_t n, int64_t k, float alpha,
                            std::span<const float* const> a, int64_t lda, std::span<const float* const> b, int64_t ldb,
                            std::span<float* const> c, int64_t ldc);

  // While deferred (a batch captured into a CUDA graph), GemmPointerBatched stages its arrays in
  // the pinned arena but copies nothing: a graph's copy from pinned memory would read the arena
  // when the graph runs, after later batches rewrote it. StagedPointers is what the batch staged;
  // CopyPointers queues one copy of such contents into the batch's device arena (before the
  // graph's launch, every time).
  void DeferPointerCopies(bool defer) { defer_copies_ = defer; }
  std::vector<const void*> StagedPointers() const;
  Status CopyPointers(std::span<const void* const> pointers);

  // The pinned pointer staging kept between batches, and its release (the stream idle).
  int64_t PinnedBytes() const { return pointers_host_.bytes(); }
  void ReleasePinned() { pointers_host_.Release(); }

 private:
  // What a cuBLASLt matmul is planned for: one shape, type and set of alignments.
  struct LtKey {
    int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
    cudaDataType type = CUDA_R_32F;
    uint32_t align_a = 0, align_b = 0, align_c = 0;
    bool operator==(const LtKey&) const = default;
  };
  // Its descriptors, and the heuristic's algorithm if it found one.
  struct LtPlan {
    LtKey key;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool found = false;
  };
  static constexpr size_t kMaxLtPlans = 64;

  cublasComputeType_t ComputeType() const { return tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F; }
  // The plan for `key`, made and queried once. A plan is kept only once it is whole: one whose
  // making failed (an allocation) is destroyed and its error returned, so that the next batch of
  // that shape tries again instead of finding "no algorithm" and taking the slower path for good.
  StatusOr<const LtPlan*> PlanFor(const LtKey& key);
  Status MakePlan(LtPlan& plan);  // its descriptors and the heuristic's answer
  static void DestroyPlan(LtPlan& plan);
  void DestroyPlans();

  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;  // made by the first GemmHalfBias
  std::vector<LtPlan> lt_plans_;
  bool tf32_ = false;
  Math math_ = Math::kFp32;
  // This batch's pointer arena (StartBatch): device slots, how many, how many used so far.
  const void** pointers_device_ = nullptr;
  int64_t pointer_slots_ = 0, pointers_used_ = 0;
  bool defer_copies_ = false;
  PinnedArray<const void*> pointers_host_;  // the pointer arrays of batched GEMMs, staged
};

}  // namespace attnserve::cuda
