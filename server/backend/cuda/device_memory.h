// The CUDA backend's device memory: the budget it counts against (--max-device-memory-mb),
// arrays that free themselves on the device they came from, and the guard zones that catch a
// write past a piece of a lane's workspace (docs/architecture.md, "The CUDA backend").
// Thread-safety: DeviceBudget is thread-safe; a DeviceArray or GuardZones serves one thread at
// a time (a lane's, or an upload's), though the last reference to an array may go on any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace attnserve::cuda {

// The device memory the backend may hold (CudaBackendOptions::max_device_bytes) and what its
// weights and workspaces hold now.
class DeviceBudget {
 public:
  explicit DeviceBudget(int64_t limit) : limit_(limit) {}
  int64_t limit() const { return limit_; }
  int64_t held() const {
    MutexLock lock(mu_);
    return held_;
  }
  // Takes `bytes` when they fit under the limit.
  bool TryTake(int64_t bytes) {
    MutexLock lock(mu_);
    if (held_ + bytes > limit_) return false;
    held_ += bytes;
    return true;
  }
  void Give(int64_t bytes) {
    MutexLock lock(mu_);
    held_ -= bytes;
  }

 private:
  const int64_t limit_;
  mutable Mutex mu_;
  int64_t held_ ATTNSERVE_GUARDED_BY(mu_) = 0;
};

// "the device memory budget of 90.0 MiB (--max-device-memory-mb; 12.0 MiB held)"
std::string BudgetText(const DeviceBudget& b);

// Device memory that frees itself, counted against a budget when it has one.
class DeviceArray {
 public:
  explicit DeviceArray(std::shared_ptr<DeviceBudget> budget = nullptr) : budget_(std::move(budget)) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { Release(); }
  // Grows to at least `count` floats (contents not kept). RESOURCE_EXHAUSTED when the budget
  // or the device has no room; the old memory is released either way.
  Status Reserve(size_t count);
  // Gives the memory back to the device and the budget. On the device it came from: the last
  // reference to a form may go on any thread (an unload), and cudaFree on a thread whose
  // current device is another (GPU 0 by default) would first create a context there.
  void Release();
  size_t capacity() const { return capacity_; }
  // Queued on `stream`: a plain cudaMemcpy runs on the legacy default stream, which the
  // backend's non-blocking stream does not wait for, and from pageable memory it may return
  // before the data has reached the device.
  Status Upload(std::span<const float> host, cudaStream_t stream);
  // The same for 16-bit values (bfloat16 or half bits), two to a float of the array: the budget
  // counts their bytes (rounded up to whole floats). `host` must live until the stream has run
  // the copy.
  Status Upload(std::span<const uint16_t> host, cudaStream_t stream);
  float* get() const { return ptr_; }
  const uint16_t* get16() const { return reinterpret_cast<const uint16_t*>(ptr_); }

 private:
  std::shared_ptr<DeviceBudget> budget_;
  float* ptr_ = nullptr;
  size_t capacity_ = 0;
  int device_ = 0;  // where ptr_ was allocated
};

// Stretches of a workspace filled with a known pattern before a batch and checked after it
// (CudaBackendOptions::guard_zones): a write past its piece that stays inside the one
// allocation, where neither the emulation's bounds checks nor AddressSanitizer see it, fails the
// batch with INTERNAL naming the piece.
class GuardZones {
 public:
  static constexpr int kByte = 0xA5;

  // Forgets the last batch's zones.
  void Clear() { zones_.clear(); }
  // The `floats` floats at `start`, after the piece `piece` names, filled on `stream` (before any
  // work of the batch is queued there).
  Status Add(const char* piece, float* start, int64_t floats, cudaStream_t stream);
  // Reads every zone back once the stream is done: INTERNAL naming the piece whose guard a write
  // reached, OK when every zone still holds the pattern (or there are none).
  Status Check() const;

 private:
  struct Zone {
    const char* piece;
    float* start;
    int64_t floats;
  };
  std::vector<Zone> zones_;
};

}  // namespace attnserve::cuda
