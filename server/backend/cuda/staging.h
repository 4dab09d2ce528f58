// A lane's copies between the host and the device: the batch's input (and context) rows packed
// into pinned memory and sent in slices, the outputs brought back in the same slices and
// unpacked into their sequences as each arrives, and the events that split a batch's time into
// inputs, compute and outputs (Backend::LastDeviceTimes). docs/architecture.md, "The CUDA
// backend", steps 1 and 6.
// Thread-safety: a Staging serves one lane, on that lane's thread; PinnedArray likewise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "server/backend/attention/plan.h"
#include "server/backend/backend.h"
#include "server/backend/compute_team.h"
#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/kernels.h"
#include "server/core/sequence.h"
#include "server/core/status.h"

namespace attnserve::cuda {

// Page-locked host memory, so copies run asynchronously on the stream.
template <class T>
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() { Release(); }
  // Grows to at least `count` elements (contents not kept).
  Status Reserve(size_t count) {
    if (count <= capacity_) return OkStatus();
    Release();
    CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&ptr_), count * sizeof(T)));
    capacity_ = count;
    return OkStatus();
  }
  void Release() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    capacity_ = 0;
  }
  T* get() const { return ptr_; }
  int64_t bytes() const { return static_cast<int64_t>(capacity_ * sizeof(T)); }

 private:
  T* ptr_ = nullptr;
  size_t capacity_ = 0;
};

// The staging team's threads: as many as asked, at least 1, at most the host's hardware threads
// (more would only take turns on the same cores).
int StagingThreads(int asked);

class Staging {
 public:
  // Slices of about `slice_bytes` (whole rows, at least one), packed and unpacked by a team of
  // `threads` (StagingThreads) host threads (CudaBackendOptions::staging_slice_bytes and
  // staging_threads say why).
  Staging(int64_t slice_bytes, int threads);
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() { DestroyEvents(); }
  // Destroys its events on the current device (the lane's, which its destructor sets first),
  // before the lane destroys the stream they were recorded on; idempotent.
  void DestroyEvents();

  // Makes the events that mark a batch's stages on `stream`, the lane's, which every copy here
  // is queued on.
  Status Init(cudaStream_t stream);

  // The inputs (then the contexts, when !all_self) of `batch`, rows of width d, packed into
  // pinned memory and queued to `device` a slice at a time: the copy engine moves one slice
  // while the host packs the next, instead of waiting for the whole batch to be packed. With
  // `half`, each value is rounded to that 16-bit format as it is packed (to nearest even, as
  // the device's conversion rounds) and the rows go to `device16` instead: half the bytes
  // copied, and no conversion on the device.
  Status StageInputs(std::span<const Sequence> batch, bool all_self, int64_t d, float* device,
                     std::optional<HalfFormat> half = std::nullopt, uint16_t* device16 = nullptr);

  // Every output row, from `y` ([plan.rows.queries, d] on the device, ld = d) into its sequence's
  // output: copied back a slice at a time, each slice's rows unpacked as soon as it has arrived
  // while the later slices are still on their way. Returns once every row is in place.
  Status ReturnOutputs(const BatchPlan& plan, std::span<const Sequence> batch, const float* y, int64_t d);

  // The last batch's split from its marks (ReturnOutputs waited for the last of them).
  StatusOr<DeviceTimes> ReadTimes() const;

  // The pinned buffers this keeps between batches, and their release (the stream idle).
  int64_t PinnedBytes() const { return staging_in_.bytes() + staging_out_.bytes(); }
  void ReleasePinned();

 private:
  // Rows of width d in one slice.
  int64_t SliceRows(int64_t d) const;
  // Copies rows [r0, r1) of width d between `rows` (one host pointer a row) and the contiguous
  // pinned block `pinned` (its row r0 first), into pinned when `pack`, out of it else: on the
  // staging team when the slice is large enough to pay for waking it.
  void CopyRows(std::span<float* const> rows, float* pinned, int64_t r0, int64_t r1, int64_t d, bool pack);
  // Rows [r0, r1) of `rows`, each rounded to `format`, into `pinned` (d values a row).
  void PackRowsHalf(std::span<float* const> rows, uint16_t* pinned, int64_t r0, int64_t r1, int64_t d,
                    HalfFormat format);
  // row(r) for every r in [r0, r1), shared among the staging team when the slice's `bytes` make
  // it worth waking them.
  template <class Row>
  void ForRows(int64_t r0, int64_t r1, int64_t bytes, const Row& row);
  // At least `count` events for the output slices (no timing: they only say a slice arrived).
  Status SliceEvents(int64_t count);

  const int64_t slice_bytes_;
  cudaStream_t stream_ = nullptr;
  PinnedArray<float> staging_in_, staging_out_;
  // The batch's marks on the stream (with timing): staging began, the last input slice arrived,
  // the compute ended, the last output slice arrived. Their differences are ReadTimes'.
  enum Mark { kStagingStarted, kInputsOnDevice, kComputed, kOutputsOnHost };
  cudaEvent_t marks_[4] = {};
  std::vector<cudaEvent_t> slice_done_;  // one per output slice (SliceEvents)
  // The copies' host threads, and a slice's smallest size for them: below it, waking the
  // helpers costs more than the memcpy they would share.
  ComputeTeam staging_team_;
  static constexpr int64_t kTeamSliceBytes = int64_t{256} << 10;
  std::vector<float*> row_pointers_;  // the batch's host rows in staging order (StageInputs, ReturnOutputs)
};

}  // namespace attnserve::cuda
