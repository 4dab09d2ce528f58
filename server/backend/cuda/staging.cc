#include "server/backend/cuda/staging.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace attnserve::cuda {

int StagingThreads(int asked) {
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(asked, 1, std::max(1, hardware));
}

Staging::Staging(int64_t slice_bytes, int threads)
    : slice_bytes_(slice_bytes), staging_team_(threads, std::chrono::microseconds(0)) {}

void Staging::DestroyEvents() {
  for (cudaEvent_t& e : marks_) {
    if (e != nullptr) cudaEventDestroy(e);
    e = nullptr;
  }
  for (cudaEvent_t e : slice_done_) cudaEventDestroy(e);
  slice_done_.clear();
}

Status Staging::Init(cudaStream_t stream) {
  stream_ = stream;
  for (cudaEvent_t& e : marks_) CUDA_TRY(cudaEventCreate(&e));
  return OkStatus();
}

int64_t Staging::SliceRows(int64_t d) const {
  return std::max<int64_t>(1, slice_bytes_ / (d * static_cast<int64_t>(sizeof(float))));
}

template <class Row>
void Staging::ForRows(int64_t r0, int64_t r1, int64_t bytes, const Row& row) {
  const int64_t tasks = bytes < kTeamSliceBytes ? 1 : std::min<int64_t>(4 * staging_team_.size(), r1 - r0);
  staging_team_.Run(tasks, [&](int64_t task, int) {
    const int64_t lo = r0 + (r1 - r0) * task / tasks, hi = r0 + (r1 - r0) * (task + 1) / tasks;
    for (int64_t r = lo; r < hi; ++r) row(r);
  });
}

void Staging::CopyRows(std::span<float* const> rows, float* pinned, int64_t r0, int64_t r1, int64_t d, bool pack) {
  ForRows(r0, r1, (r1 - r0) * d * static_cast<int64_t>(sizeof(float)), [&](int64_t r) {
    float* block = pinned + (r - r0) * d;
    if (pack) {
      std::memcpy(block, rows[r], d * sizeof(float));
    } else {
      std::memcpy(rows[r], block, d * sizeof(float));
    }
  });
}

void Staging::PackRowsHalf(std::span<float* const> rows, uint16_t* pinned, int64_t r0, int64_t r1, int64_t d,
                           HalfFormat format) {
  ForRows(r0, r1, (r1 - r0) * d * static_cast<int64_t>(sizeof(uint16_t)), [&](int64_t r) {
    uint16_t* block = pinned + (r - r0) * d;
    const float* row = rows[r];
    if (format == HalfFormat::kBf16) {
      for (int64_t c = 0; c < d; ++c) block[c] = __bfloat16_as_ushort(__float2bfloat16_rn(row[c]));
    } else {
      for (int64_t c = 0; c < d; ++c) block[c] = __half_as_ushort(__float2half_rn(row[c]));
    }
  });
}

Status Staging::StageInputs(std::span<const Sequence> batch, bool all_self, int64_t d, float* device,
                            std::optional<HalfFormat> half, uint16_t* device16) {
  row_pointers_.clear();
  const auto add = [&](ConstMatrixView v) {
    for (int64_t row = 0; row < v.rows; ++row) row_pointers_.push_back(const_cast<float*>(v.row(row)));
  };
  for (const Sequence& s : batch) add(s.input);
  if (!all_self) {
    for (const Sequence& s : batch) add(s.keys_source());
  }
  const int64_t rows = static_cast<int64_t>(row_pointers_.size()), slice_rows = SliceRows(d);
  ATTNSERVE_RETURN_IF_ERROR(staging_in_.Reserve(rows * d));
  float* const pinned = staging_in_.get();
  CUDA_TRY(cudaEventRecord(marks_[kStagingStarted], stream_));
  // 16-bit rows take half of the pinned floats reserved for them.
  uint16_t* const pinned16 = reinterpret_cast<uint16_t*>(pinned);
  for (int64_t r0 = 0; r0 < rows; r0 += slice_rows) {
    const int64_t r1 = std::min(rows, r0 + slice_rows);
    if (half) {
      PackRowsHalf(row_pointers_, pinned16 + r0 * d, r0, r1, d, *half);
      CUDA_TRY(cudaMemcpyAsync(device16 + r0 * d, pinned16 + r0 * d, (r1 - r0) * d * sizeof(uint16_t),
                               cudaMemcpyHostToDevice, stream_));
      continue;
    }
    CopyRows(row_pointers_, pinned + r0 * d, r0, r1, d, /*pack=*/true);
    CUDA_TRY(cudaMemcpyAsync(device + r0 * d, pinned + r0 * d, (r1 - r0) * d * sizeof(float), cudaMemcpyHostToDevice,
                             stream_));
  }
  CUDA_TRY(cudaEventRecord(marks_[kInputsOnDevice], stream_));
  return OkStatus();
}

Status Staging::SliceEvents(int64_t count) {
  while (static_cast<int64_t>(slice_done_.size()) < count) {
    cudaEvent_t e = nullptr;
    CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    slice_done_.push_back(e);
  }
  return OkStatus();
}

Status Staging::ReturnOutputs(const BatchPlan& plan, std::span<const Sequence> batch, const float* y, int64_t d) {
  const int64_t tx = plan.rows.queries, slice_rows = SliceRows(d);
  const int64_t slices = (tx + slice_rows - 1) / slice_rows;
  ATTNSERVE_RETURN_IF_ERROR(staging_out_.Reserve(tx * d));
  ATTNSERVE_RETURN_IF_ERROR(SliceEvents(slices));
  CUDA_TRY(cudaEventRecord(marks_[kComputed], stream_));
  for (int64_t i = 0; i < slices; ++i) {
    const int64_t r0 = i * slice_rows, rows = std::min(slice_rows, tx - r0);
    CUDA_TRY(cudaMemcpyAsync(staging_out_.get() + r0 * d, y + r0 * d, rows * d * sizeof(float), cudaMemcpyDeviceToHost,
                             stream_));
    CUDA_TRY(cudaEventRecord(slice_done_[i], stream_));
  }
  CUDA_TRY(cudaEventRecord(marks_[kOutputsOnHost], stream_));
  // Row r of y belongs to the sequence whose rows start at or before it (plan.rows.x_row).
  row_pointers_.assign(tx, nullptr);
  for (size_t i = 0; i < batch.size(); ++i) {
    float** first = row_pointers_.data() + plan.rows.x_row[i];
    for (int64_t row = 0; row < batch[i].n(); ++row) first[row] = batch[i].output.row(row);
  }
  for (int64_t i = 0; i < slices; ++i) {
    const int64_t r0 = i * slice_rows, r1 = std::min(tx, r0 + slice_rows);
    CUDA_TRY(cudaEventSynchronize(slice_done_[i]));
    CopyRows(row_pointers_, staging_out_.get() + r0 * d, r0, r1, d, /*pack=*/false);
  }
  CUDA_TRY(cudaEventSynchronize(marks_[kOutputsOnHost]));
  return OkStatus();
}

StatusOr<DeviceTimes> Staging::ReadTimes() const {
  float inputs = 0, compute = 0, outputs = 0;
  CUDA_TRY(cudaEventElapsedTime(&inputs, marks_[kStagingStarted], marks_[kInputsOnDevice]));
  CUDA_TRY(cudaEventElapsedTime(&compute, marks_[kInputsOnDevice], marks_[kComputed]));
  CUDA_TRY(cudaEventElapsedTime(&outputs, marks_[kComputed], marks_[kOutputsOnHost]));
  return DeviceTimes{.inputs_ms = inputs, .compute_ms = compute, .outputs_ms = outputs};
}

void Staging::ReleasePinned() {
  staging_in_.Release();
  staging_out_.Release();
}

}  // namespace attnserve::cuda
