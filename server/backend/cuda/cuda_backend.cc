// The CUDA backend: a pool of lanes (lane.h) over one device and one memory budget, the
// device's health, and the entry points of cuda_backend.h.
#include "server/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/backend/cuda/device_memory.h"
#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/lane.h"
#include "server/core/thread_annotations.h"

namespace attnserve {
namespace {

using cuda::CudaResidentForm;
using cuda::DeviceBudget;
using cuda::IsStickyError;
using cuda::Lane;
using cuda::SummedOrderOf;

// The split of the last batch each thread finished, and on which backend (ThisThreadsDeviceTimes):
// by a number of its own, not its address, which a backend made after another was destroyed may
// reuse (its thread would then read the other's split).
struct ThreadTimes {
  uint64_t backend = 0;
  DeviceTimes times;
};
thread_local ThreadTimes this_threads_times;
std::atomic<uint64_t> backends_made{0};

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
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, options_.device) == cudaSuccess) pci_bus_id_ = bus_id;
    cudaGetLastError();  // no bus id is no error: NVML then finds no device
    ATTNSERVE_ASSIGN_OR_RETURN(auto lane, NewLane());
    MutexLock lock(mu_);
    idle_.push_back(std::move(lane));
    return OkStatus();
  }

  std::string DeviceName() const override { return "cuda:" + std::to_string(options_.device); }
  // The summed form in the order it runs.
  SummedOrder summed_order() const override { return SummedOrderOf(options_); }
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
    return UploadIn(std::move(form), options_.math);
  }
  Math default_math() const override { return options_.math; }
  Status CheckMath(Math) const override { return OkStatus(); }
  // Every math runs here: the lane sets its handle's math per batch from the running form's.
  StatusOr<std::shared_ptr<const ResidentForm>> UploadIn(std::shared_ptr<const FormWeights> form, Math math) override {
    if (!form) return InvalidArgumentError("Upload: no form given");
    ATTNSERVE_RETURN_IF_ERROR(CheckHeadCombine(*form));
    auto resident = std::make_shared<CudaResidentForm>(std::move(form), budget_, math);
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
    this_threads_times.backend = 0;
    const Status st = WithLane([&](Lane& lane) {
      ATTNSERVE_RETURN_IF_ERROR(lane.RunBatch(*resident, batch));
      this_threads_times = {id_, lane.last_times()};
      MutexLock lock(mu_);
      last_times_ = lane.last_times();
      return OkStatus();
    });
    return st;
  }

  std::optional<DeviceTimes> ThisThreadsDeviceTimes() const override {
    if (this_threads_times.backend != id_) return std::nullopt;
    return this_threads_times.times;
  }

  // `callers` lanes held at once (the idle ones first, then new ones), each run over every form:
  // afterwards as many callers as that find a warm lane each. A failure fails the warmup (a lost
  // device also marks the backend unhealthy); the lanes go back to the pool either way.
  Status Warmup(int callers, std::span<const ResidentForm* const> forms) override {
    std::vector<std::unique_ptr<Lane>> lanes;
    {
      MutexLock lock(mu_);
      while (!idle_.empty() && static_cast<int>(lanes.size()) < callers) {
        lanes.push_back(std::move(idle_.back()));
        idle_.pop_back();
      }
    }
    Status st;
    while (st.ok() && static_cast<int>(lanes.size()) < callers) {
      auto made = NewLane();
      if (made.ok()) {
        lanes.push_back(std::move(made).value());
      } else {
        st = MarkFailed(made.status(), cudaSuccess);
      }
    }
    for (auto& lane : lanes) {
      for (const ResidentForm* form : forms) {
        const auto* resident = dynamic_cast<const CudaResidentForm*>(form);
        if (!st.ok()) break;
        if (resident == nullptr) {
          st = InvalidArgumentError("Warmup: form was not uploaded to " + DeviceName());
          break;
        }
        st = lane->Warm(*resident);
        if (!st.ok()) st = MarkFailed(st, lane->Drain());
      }
    }
    MutexLock lock(mu_);
    for (auto& lane : lanes) idle_.push_back(std::move(lane));
    return st;
  }

  std::optional<DeviceMemoryState> DeviceMemory() const override {
    return DeviceMemoryState{.held_bytes = budget_->held(), .limit_bytes = budget_->limit(), .lanes = lanes_.load()};
  }

  std::string PciBusId() const override { return pci_bus_id_; }

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
    lanes_.fetch_add(1);
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
  const uint64_t id_ = ++backends_made;   // ThreadTimes::backend
  std::shared_ptr<DeviceBudget> budget_;  // set by Init, shared with the lanes and the weights
  std::atomic<bool> healthy_{true};
  std::atomic<int> lanes_{0};  // made and not destroyed (a lane lives as long as the backend)
  std::string pci_bus_id_;     // set by Init
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
    return UnavailableError("cuda:" + std::to_string(options.device) + " requested, but only " + std::to_string(count) +
                            " device(s) present");
  }
  auto backend = std::make_unique<CudaBackend>(options);
  Status st = backend->Init();
  if (!st.ok()) return UnavailableError("cuda:" + std::to_string(options.device) + ": " + st.message());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnserve
