// The emulated CUDA runtime: device memory on the host heap with its extents recorded, copies
// checked against the memory spaces they name, streams whose work is queued and runs at
// synchronisation points, wall-clock events.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include <unistd.h>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "state.h"

#if defined(ATTNSERVE_ASAN)
#include <sanitizer/asan_interface.h>
#define CUDA_EMULATION_ASAN 1
#endif

// A stream: its queued work, run in order by whichever thread synchronises it. `mu` is held
// while the work runs, so a stream's work never runs on two threads at once or out of order.
// A stream capture in progress (cudaStreamBeginCapture): the operations recorded so far.
struct StreamCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;  // the one that began it, the only one that may end it
  std::vector<std::function<void()>> recorded;
  bool invalidated = false;
  bool invalidate_first = false;  // Fault::kCaptureInvalidated: the first operation invalidates it
};

struct CUstream_st {
  unsigned flags = 0;
  std::mutex mu;
  std::deque<std::function<void()>> queue;
  std::thread::id issuer;  // the thread whose work is queued now
  std::unique_ptr<StreamCapture> capture;  // while capturing
};
// A graph and its instantiation: the recorded operations, each a copy of what the capture took
// (kernel arguments, GEMM operands' addresses, a copy's pointers), replayed in order.
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
  bool timing = true;
  cudaStream_t stream = nullptr;
};

namespace cuda_emulation {
namespace {

enum class Space { kDevice, kPinnedHost };

struct Allocation {
  size_t bytes;
  Space space;
  int device = 0;  // the allocating thread's current device
};

// An integer from the environment, or `fallback`.
int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

struct State {
  std::mutex mu;
  std::map<const char*, Allocation> allocations;  // by base address
  Counters counters;
  int device_count = 1;
  int64_t device_memory = kDefaultDeviceMemoryBytes;
  int64_t device_live = 0;  // bytes of the live device allocations
  cudaError_t sticky = cudaSuccess;
  int pending_fault[kFaultKinds] = {};  // operations of each kind still to fail
  // From the environment, for a server process that loads the emulated plugin: the GEMM (0 the
  // first) that faults, and GEMMs issued so far; -1 for none.
  int64_t gemm_fault_at = -1, gemms_issued = 0;
  // ATTNSERVE_CUDA_EMULATION_FAULT_ARMED_BY: GEMMs count towards gemm_fault_at only once this
  // file exists (a test creates it when the server is up, after its warmup's GEMMs); "" always.
  std::string gemm_fault_armed_by;
  std::string diagnostic;
  std::function<void()> sync_hook;
  std::function<void()> after_fault_hook;
  cudaError_t injected_error = cudaSuccess;  // SetInjectedFaultError's, or none
  int device_access = 0;  // DeviceAccess objects alive, on every thread
  int64_t live_graph_execs = 0;
};

// The streams that exist, and the legacy default stream (stream 0). Its lock comes before a
// stream's, and no stream's work takes it.
struct Streams {
  std::mutex mu;
  std::vector<CUstream_st*> live;
  CUstream_st legacy;
  uint64_t draws = 0;  // device-wide synchronisations so far: each draws its own order
};

// The schedule's seed (SetScheduleSeed) and the launches run so far, each of which draws from
// the two.
std::atomic<uint64_t> schedule_seed{[] {
  const char* v = std::getenv("ATTNSERVE_SEED");
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : uint64_t{0x5eed};
}()};
std::atomic<uint64_t> launches_run{0};

Streams& GetStreams() {
  static Streams* streams = new Streams;  // never destroyed, as State
  return *streams;
}

CUstream_st* Resolve(cudaStream_t stream) { return stream == nullptr ? &GetStreams().legacy : stream; }

State& GetState() {
  // Never destroyed: backends may outlive static destruction.
  static State* state = [] {
    auto* s = new State;
    s->device_count = static_cast<int>(EnvInt("ATTNSERVE_CUDA_EMULATION_DEVICES", 1));
    s->gemm_fault_at = EnvInt("ATTNSERVE_CUDA_EMULATION_FAULT_AT_GEMM", -1);
    if (const char* armed = std::getenv("ATTNSERVE_CUDA_EMULATION_FAULT_ARMED_BY")) s->gemm_fault_armed_by = armed;
    s->injected_error = static_cast<cudaError_t>(EnvInt("ATTNSERVE_CUDA_EMULATION_FAULT_ERROR", 0));
    return s;
  }();
  return *state;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local bool fault_fired = false;  // an injected fault fired on this thread (SetAfterFaultHook)
thread_local int current_device = 0;
// The stream this thread is capturing in cudaStreamCaptureModeGlobal or ThreadLocal, whose
// capture an unsafe call of this thread invalidates; and the Global captures of every thread,
// during which every thread is refused those calls.
thread_local CUstream_st* capturing_here = nullptr;
std::atomic<int> global_captures{0};

// Marks `stream`'s capture invalidated (when it is capturing); true when it was.
bool InvalidateCapture(CUstream_st* stream) {
  if (stream == nullptr) return false;
  std::lock_guard<std::mutex> lock(stream->mu);
  if (stream->capture == nullptr) return false;
  stream->capture->invalidated = true;
  return true;
}

bool IsCapturing(CUstream_st* stream) {
  if (stream == nullptr) return false;
  std::lock_guard<std::mutex> lock(stream->mu);
  return stream->capture != nullptr;
}

constexpr size_t kAlignment = 256;  // cudaMalloc's alignment

// Under AddressSanitizer: marks a device allocation's bytes as the host's to touch or not (the
// heap's redzones around them stay as they are). Caller holds the lock.
void PoisonDevice(const char* base, size_t bytes, bool poisoned) {
#if defined(CUDA_EMULATION_ASAN)
  if (poisoned) {
    __asan_poison_memory_region(base, bytes);
  } else {
    __asan_unpoison_memory_region(base, bytes);
  }
#else
  (void)base, (void)bytes, (void)poisoned;
#endif
}

// The allocation containing p, or nullptr. Caller holds the lock.
const std::pair<const char* const, Allocation>* Find(State& s, const void* p) {
  const char* c = static_cast<const char*>(p);
  auto it = s.allocations.upper_bound(c);
  if (it == s.allocations.begin()) return nullptr;
  --it;
  return c < it->first + std::max<size_t>(it->second.bytes, 1) ? &*it : nullptr;
}

bool InSpace(const void* p, size_t bytes, Space space) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto* a = Find(s, p);
  if (a == nullptr || a->second.space != space) return false;
  return static_cast<const char*>(p) + bytes <= a->first + a->second.bytes;
}

// Every call first answers with a sticky error, as a faulted context does.
#define RETURN_IF_STICKY()                                    \
  do {                                                        \
    if (const cudaError_t sticky = internal::StickyError()) { \
      last_error = sticky;                                    \
      return sticky;                                          \
    }                                                         \
  } while (false)

cudaError_t Fail(cudaError_t error, const std::string& diagnostic) {
  internal::Diagnose(diagnostic);
  last_error = error;
  return error;
}

// A call that is unsafe during a capture (it allocates, frees or waits for the device), made
// while this thread captures (Global or ThreadLocal mode) or any thread captures in Global mode:
// cudaErrorStreamCaptureUnsupported, and this thread's capture is invalidated.
cudaError_t RefuseDuringCapture(const char* what) {
  if (capturing_here == nullptr && global_captures.load() == 0) return cudaSuccess;
  InvalidateCapture(capturing_here);
  return Fail(cudaErrorStreamCaptureUnsupported,
              std::string(what) + ": not allowed while a stream capture is in progress (the capture is invalidated)");
}

cudaError_t Allocate(void** ptr, size_t bytes, Space space) {
  RETURN_IF_STICKY();
  if (const cudaError_t e = RefuseDuringCapture(space == Space::kDevice ? "cudaMalloc" : "cudaMallocHost")) return e;
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue, "cudaMalloc: null result pointer");
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (space == Space::kDevice && internal::TakeFault(Fault::kOutOfMemory)) {
    return Fail(cudaErrorMemoryAllocation, "cudaMalloc: injected out of memory");
  }
  if (space == Space::kPinnedHost && internal::TakeFault(Fault::kPinnedOutOfMemory)) {
    return Fail(cudaErrorMemoryAllocation, "cudaMallocHost: injected out of memory");
  }
  if (space == Space::kDevice) {
    State& s = GetState();
    std::unique_lock<std::mutex> lock(s.mu);
    if (s.device_live + static_cast<int64_t>(bytes) > s.device_memory) {
      const std::string why = "cudaMalloc: " + std::to_string(bytes) + " bytes do not fit: " +
                              std::to_string(s.device_live) + " of the device's " + std::to_string(s.device_memory) +
                              " bytes are in use";
      lock.unlock();
      return Fail(cudaErrorMemoryAllocation, why);
    }
  }
  void* p = ::operator new(bytes, std::align_val_t(kAlignment), std::nothrow);
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory");
  // Fresh device memory reads as NaN, so a result that uses unwritten memory shows it.
  std::memset(p, 0xff, bytes);
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.allocations[static_cast<const char*>(p)] = {bytes, space, current_device};
  if (space == Space::kDevice) s.device_live += static_cast<int64_t>(bytes);
  if (space == Space::kDevice && s.device_access == 0) PoisonDevice(static_cast<const char*>(p), bytes, true);
  (space == Space::kDevice ? s.counters.device_allocations : s.counters.pinned_allocations)++;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t Release(void* ptr, Space space, const char* what) {
  if (ptr == nullptr) return cudaSuccess;
  if (const cudaError_t e = RefuseDuringCapture(what)) return e;
  State& s = GetState();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.allocations.find(static_cast<const char*>(ptr));
    if (it == s.allocations.end() || it->second.space != space) {
      s.diagnostic = std::string(what) + ": pointer was not allocated by its allocator (or was freed twice)";
      std::fprintf(stderr, "[cuda emulation] %s\n", s.diagnostic.c_str());
      last_error = cudaErrorInvalidValue;
      return cudaErrorInvalidValue;
    }
    if (space == Space::kDevice && it->second.device != current_device) s.counters.frees_on_another_device++;
    if (space == Space::kDevice) s.device_live -= static_cast<int64_t>(it->second.bytes);
    if (space == Space::kDevice) PoisonDevice(it->first, it->second.bytes, false);  // the heap's again
    s.allocations.erase(it);
  }
  ::operator delete(ptr, std::align_val_t(kAlignment));
  return cudaSuccess;
}

const char* KindName(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      return "HostToHost";
    case cudaMemcpyHostToDevice:
      return "HostToDevice";
    case cudaMemcpyDeviceToHost:
      return "DeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "DeviceToDevice";
    default:
      return "Default";
  }
}

cudaError_t Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, bool async,
                 cudaStream_t stream = nullptr) {
  RETURN_IF_STICKY();
  if (bytes == 0) return cudaSuccess;
  if (internal::TakeFault(Fault::kCopy)) {
    const cudaError_t error = internal::InjectedError(cudaErrorIllegalAddress);
    internal::RaiseFault(error, "injected fault in a copy");
    return last_error = error;
  }
  if (!async) {
    if (const cudaError_t e = RefuseDuringCapture("cudaMemcpy")) return e;
  }
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice) {
    return Fail(cudaErrorInvalidMemcpyDirection,
                std::string("cudaMemcpy: kind ") + KindName(kind) + " is not used by attnserve and not emulated");
  }
  const bool dst_ok = dst_device ? internal::IsDeviceRange(dst, bytes) : !internal::IsDevicePointer(dst);
  const bool src_ok = src_device ? internal::IsDeviceRange(src, bytes) : !internal::IsDevicePointer(src);
  if (!dst_ok || !src_ok) {
    return Fail(cudaErrorInvalidValue,
                std::string("cudaMemcpy") + (async ? "Async" : "") + " " + KindName(kind) + ": " +
                    (dst_ok ? "source" : "destination") + " of " + std::to_string(bytes) + " bytes is not " +
                    ((dst_ok ? src_device : dst_device) ? "inside one device allocation" : "host memory"));
  }
  bool pinned = false;
  {
    State& s = GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    if (kind == cudaMemcpyHostToDevice) {
      s.counters.host_to_device_bytes += static_cast<int64_t>(bytes);
      s.counters.host_to_device_copies++;
    }
    if (kind == cudaMemcpyDeviceToHost) {
      s.counters.device_to_host_bytes += static_cast<int64_t>(bytes);
      s.counters.device_to_host_copies++;
    }
    if (kind != cudaMemcpyDeviceToDevice) {
      const auto* a = Find(s, kind == cudaMemcpyHostToDevice ? src : dst);
      pinned = a != nullptr && a->second.space == Space::kPinnedHost;
      if (async && !pinned) s.counters.pageable_async_copies++;
    }
  }
  if (!async) {  // a synchronous copy waits for the device, as cudaMemcpy does
    internal::DrainAll();
    internal::DeviceAccess device;
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  if (kind != cudaMemcpyDeviceToDevice && !pinned && IsCapturing(stream)) {
    // A graph's copy node reads its host memory when the graph runs: the emulation's pageable
    // copies (a snapshot now, or a wait for the stream) have no such form, and attnserve stages
    // through pinned memory anyway.
    InvalidateCapture(stream);
    return Fail(
        cudaErrorStreamCaptureUnsupported,
        "cudaMemcpyAsync: a copy to or from pageable memory on a capturing stream (the capture is invalidated)");
  }
  if (kind == cudaMemcpyHostToDevice && !pinned) {
    // From pageable memory the call returns once the data is staged: a snapshot, copied later.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    return internal::Enqueue(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  } else if (kind == cudaMemcpyDeviceToHost && !pinned) {
    // Into pageable memory the call returns once the copy is done.
    internal::DrainStream(stream);
    internal::DeviceAccess device;
    std::memmove(dst, src, bytes);
  } else {
    // Into pinned memory the host sees poison until the stream has run the copy: a read before
    // the synchronisation reads NaN.
    if (kind == cudaMemcpyDeviceToHost) std::memset(dst, 0xff, bytes);
    return internal::Enqueue(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  }
  return cudaSuccess;
}

}  // namespace

namespace internal {

bool IsDeviceRange(const void* p, size_t bytes) { return InSpace(p, bytes, Space::kDevice); }

bool IsDevicePointer(const void* p) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto* a = Find(s, p);
  return a != nullptr && a->second.space == Space::kDevice;
}

cudaError_t StickyError() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.sticky;
}

void SetLastError(cudaError_t error) { last_error = error; }

void Diagnose(const std::string& diagnostic) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.diagnostic = diagnostic;
  std::fprintf(stderr, "[cuda emulation] %s\n", diagnostic.c_str());
}

void RaiseFault(cudaError_t error, const std::string& diagnostic) {
  Diagnose(diagnostic);
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sticky = error;
  last_error = error;
}

cudaError_t InjectedError(cudaError_t fallback) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.injected_error != cudaSuccess ? s.injected_error : fallback;
}

bool TakeFault(Fault fault) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  if (fault == Fault::kGemm && s.gemm_fault_at >= 0 &&
      (s.gemm_fault_armed_by.empty() || access(s.gemm_fault_armed_by.c_str(), F_OK) == 0) &&
      s.gemms_issued++ == s.gemm_fault_at) {
    return true;
  }
  int& pending = s.pending_fault[static_cast<int>(fault)];
  if (pending == 0) return false;
  --pending;
  fault_fired = true;
  return true;
}

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work) {
  CUstream_st* s = Resolve(stream);
  bool shared = false;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (StreamCapture* capture = s->capture.get()) {
      // Recorded, not run: what runs is the graph, each time it is launched.
      if (capture->invalidate_first) {
        capture->invalidate_first = false;
        capture->invalidated = true;
        last_error = cudaErrorStreamCaptureUnsupported;
        return cudaErrorStreamCaptureUnsupported;
      }
      if (capture->invalidated) {
        last_error = cudaErrorStreamCaptureInvalidated;
        return cudaErrorStreamCaptureInvalidated;
      }
      capture->recorded.push_back(std::move(work));
      return cudaSuccess;
    }
    // The legacy stream is everyone's; a created stream belongs to one caller at a time.
    shared = stream != nullptr && !s->queue.empty() && s->issuer != std::this_thread::get_id();
    s->issuer = std::this_thread::get_id();
    s->queue.push_back(std::move(work));
  }
  if (shared) {
    State& st = GetState();
    std::lock_guard<std::mutex> lock(st.mu);
    st.counters.threads_sharing_a_stream++;
  }
  return cudaSuccess;
}

namespace {
// Runs the first queued work of `s`; false when there is none.
bool RunOne(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->queue.empty()) return false;
  std::function<void()> work = std::move(s->queue.front());
  s->queue.pop_front();
  work();
  return true;
}
}  // namespace

DeviceAccess::DeviceAccess() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.device_access++ > 0) return;
  for (const auto& [base, a] : s.allocations) {
    if (a.space == Space::kDevice) PoisonDevice(base, a.bytes, false);
  }
}

DeviceAccess::~DeviceAccess() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  if (--s.device_access > 0) return;
  for (const auto& [base, a] : s.allocations) {
    if (a.space == Space::kDevice) PoisonDevice(base, a.bytes, true);
  }
}

void DrainStream(cudaStream_t stream) {
  CUstream_st* s = Resolve(stream);
  DeviceAccess device;
  while (RunOne(s)) {
  }
}

void DrainAll() {
  Streams& streams = GetStreams();
  std::lock_guard<std::mutex> lock(streams.mu);
  std::vector<CUstream_st*> pending = streams.live;
  pending.push_back(&streams.legacy);
  // One work item at a time from a stream drawn at random: the streams' work interleaves in an
  // order no caller can count on, as on a device.
  std::mt19937_64 rng(schedule_seed.load() + streams.draws++);
  DeviceAccess device;
  while (!pending.empty()) {
    const size_t i = std::uniform_int_distribution<size_t>(0, pending.size() - 1)(rng);
    if (!RunOne(pending[i])) pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

uint64_t LaunchDraw() {
  // Distinct launches, and the same launch under distinct seeds, draw unrelated orders.
  return schedule_seed.load() * 0x9e3779b97f4a7c15ull + launches_run.fetch_add(1);
}

void CountKernelLaunch() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.kernel_launches++;
}

void CountGemm() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.gemm_calls++;
}

void CountBlasHandle() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.blas_handles_created++;
}

void CountLegacyStreamWork() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.legacy_stream_work++;
}

}  // namespace internal

Counters ReadCounters() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.counters;
}

void ResetCounters() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters = {};
}

int64_t LiveDeviceAllocations() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  int64_t live = 0;
  for (const auto& [base, a] : s.allocations) live += a.space == Space::kDevice;
  return live;
}

int64_t LiveDeviceBytes() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  int64_t bytes = 0;
  for (const auto& [base, a] : s.allocations) bytes += a.space == Space::kDevice ? static_cast<int64_t>(a.bytes) : 0;
  return bytes;
}

int64_t LiveGraphExecs() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.live_graph_execs;
}

void SetScheduleSeed(uint64_t seed) { schedule_seed.store(seed); }

void SetAfterFaultHook(std::function<void()> hook) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.after_fault_hook = std::move(hook);
}

namespace {
// SetAfterFaultHook's hook, once, when a fault fired on this thread.
void RunAfterFaultHook() {
  if (!fault_fired) return;
  fault_fired = false;
  std::function<void()> hook;
  {
    State& s = GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    hook = std::move(s.after_fault_hook);
    s.after_fault_hook = nullptr;
  }
  if (hook) hook();
}
}  // namespace

void SetStreamSyncHook(std::function<void()> hook) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sync_hook = std::move(hook);
}

void SetDeviceMemoryBytes(int64_t bytes) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.device_memory = bytes;
}

void SetDeviceCount(int count) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.device_count = count;
}

void InjectFault(Fault fault, int times) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.pending_fault[static_cast<int>(fault)] = times;
}

void SetInjectedFaultError(int error) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.injected_error = static_cast<cudaError_t>(error);
}

void Reset() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sticky = cudaSuccess;
  s.injected_error = cudaSuccess;
  s.device_count = 1;
  for (int& p : s.pending_fault) p = 0;
  s.sync_hook = nullptr;
  s.after_fault_hook = nullptr;
  fault_fired = false;
  s.diagnostic.clear();
  last_error = cudaSuccess;
}

std::string LastDiagnostic() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.diagnostic;
}

}  // namespace cuda_emulation

using cuda_emulation::last_error;
namespace internal = cuda_emulation::internal;

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureWrongThread:
      return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorECCUncorrectable:
      return "cudaErrorECCUncorrectable";
    case cudaErrorLaunchTimeout:
      return "cudaErrorLaunchTimeout";
    case cudaErrorAssert:
      return "cudaErrorAssert";
    case cudaErrorHardwareStackError:
      return "cudaErrorHardwareStackError";
    case cudaErrorIllegalInstruction:
      return "cudaErrorIllegalInstruction";
    case cudaErrorMisalignedAddress:
      return "cudaErrorMisalignedAddress";
    case cudaErrorInvalidAddressSpace:
      return "cudaErrorInvalidAddressSpace";
    case cudaErrorInvalidPc:
      return "cudaErrorInvalidPc";
    case cudaErrorContained:
      return "cudaErrorContained";
    case cudaErrorTensorMemoryLeak:
      return "cudaErrorTensorMemoryLeak";
    case cudaErrorExternalDevice:
      return "cudaErrorExternalDevice";
    case cudaErrorUnknown:
      return "cudaErrorUnknown";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorIllegalState:
      return "the resource is not valid in its current state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorECCUncorrectable:
      return "uncorrectable ECC error encountered";
    case cudaErrorLaunchTimeout:
      return "the launch timed out and was terminated";
    case cudaErrorAssert:
      return "device-side assert triggered";
    case cudaErrorHardwareStackError:
      return "hardware stack error";
    case cudaErrorIllegalInstruction:
      return "an illegal instruction was encountered";
    case cudaErrorMisalignedAddress:
      return "misaligned address";
    case cudaErrorInvalidAddressSpace:
      return "operation not supported on global/shared address space";
    case cudaErrorInvalidPc:
      return "invalid program counter";
    case cudaErrorContained:
      return "device encountered an error in the application that was contained";
    case cudaErrorTensorMemoryLeak:
      return "tensor memory not completely freed";
    case cudaErrorExternalDevice:
      return "external device error";
    case cudaErrorUnknown:
      return "unknown error";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  cuda_emulation::RunAfterFaultHook();
  const cudaError_t sticky = internal::StickyError();
  const cudaError_t e = sticky != cudaSuccess ? sticky : last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky = internal::StickyError();
  return sticky != cudaSuccess ? sticky : last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  *count = s.device_count;
  return s.device_count > 0 ? cudaSuccess : (last_error = cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) return e;
  if (device < 0 || device >= count) return last_error = cudaErrorInvalidDevice;
  cuda_emulation::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = cuda_emulation::current_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* pci_bus_id, int len, int device) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) return e;
  if (device < 0 || device >= count) return last_error = cudaErrorInvalidDevice;
  if (pci_bus_id == nullptr || len < 13) return last_error = cudaErrorInvalidValue;
  std::snprintf(pci_bus_id, static_cast<size_t>(len), "0000:%02X:00.0", 0x10 + device);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  cuda_emulation::RunAfterFaultHook();
  if (const cudaError_t e = cuda_emulation::RefuseDuringCapture("cudaDeviceSynchronize")) return e;
  {
    auto& s = cuda_emulation::GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    s.counters.device_synchronizations++;
  }
  internal::DrainAll();
  RETURN_IF_STICKY();
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  return cuda_emulation::Allocate(ptr, bytes, cuda_emulation::Space::kDevice);
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  RETURN_IF_STICKY();
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  *total = static_cast<size_t>(s.device_memory);
  *free = static_cast<size_t>(std::max<int64_t>(0, s.device_memory - s.device_live));
  return cudaSuccess;
}
// Both free calls synchronise the device first, as CUDA's do: no queued work may touch the memory.
cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr) internal::DrainAll();
  return cuda_emulation::Release(ptr, cuda_emulation::Space::kDevice, "cudaFree");
}
cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  return cuda_emulation::Allocate(ptr, bytes, cuda_emulation::Space::kPinnedHost);
}
cudaError_t cudaFreeHost(void* ptr) {
  if (ptr != nullptr) internal::DrainAll();
  return cuda_emulation::Release(ptr, cuda_emulation::Space::kPinnedHost, "cudaFreeHost");
}

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  RETURN_IF_STICKY();
  if (bytes == 0) return cudaSuccess;
  if (const cudaError_t e = cuda_emulation::RefuseDuringCapture("cudaMemset")) return e;
  if (!internal::IsDeviceRange(ptr, bytes)) {
    return cuda_emulation::Fail(cudaErrorInvalidValue, "cudaMemset: range is not inside one device allocation");
  }
  internal::DrainAll();
  internal::DeviceAccess device;
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

// Queued on the stream like a kernel: it runs when the stream does.
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  RETURN_IF_STICKY();
  if (stream == nullptr) cuda_emulation::internal::CountLegacyStreamWork();
  if (bytes == 0) return cudaSuccess;
  if (!internal::IsDeviceRange(ptr, bytes)) {
    return cuda_emulation::Fail(cudaErrorInvalidValue, "cudaMemsetAsync: range is not inside one device allocation");
  }
  return internal::Enqueue(stream, [ptr, value, bytes] { std::memset(ptr, value, bytes); });
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cuda_emulation::Copy(dst, src, bytes, kind, /*async=*/false);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (stream == nullptr) cuda_emulation::internal::CountLegacyStreamWork();
  return cuda_emulation::Copy(dst, src, bytes, kind, /*async=*/true, stream);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  RETURN_IF_STICKY();
  *stream = new CUstream_st;
  (*stream)->flags = flags;
  {
    auto& streams = cuda_emulation::GetStreams();
    std::lock_guard<std::mutex> lock(streams.mu);
    streams.live.push_back(*stream);
  }
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.streams_created++;
  return cudaSuccess;
}

// Its queued work still runs, as on a device.
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return last_error = cudaErrorInvalidValue;
  {
    auto& streams = cuda_emulation::GetStreams();
    std::lock_guard<std::mutex> lock(streams.mu);
    std::erase(streams.live, stream);
  }
  internal::DrainStream(stream);
  delete stream;
  return cudaSuccess;
}

// Runs the stream's queued work; a fault it raised surfaces here, as on a device.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  cuda_emulation::RunAfterFaultHook();
  std::function<void()> hook;
  {
    auto& s = cuda_emulation::GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    hook = s.sync_hook;
  }
  if (hook) hook();
  if (cuda_emulation::InvalidateCapture(stream)) {
    return cuda_emulation::Fail(cudaErrorStreamCaptureUnsupported,
                                "cudaStreamSynchronize: the stream is capturing (the capture is invalidated)");
  }
  internal::DrainStream(stream);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  RETURN_IF_STICKY();
  // The legacy default stream cannot be captured.
  if (stream == nullptr) {
    return cuda_emulation::Fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: the legacy default stream");
  }
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return cuda_emulation::Fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: mode " + std::to_string(mode));
  }
  const bool invalidate_first = internal::TakeFault(cuda_emulation::Fault::kCaptureInvalidated);
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    if (stream->capture != nullptr) {
      return cuda_emulation::Fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
    }
    stream->capture = std::make_unique<StreamCapture>();
    stream->capture->mode = mode;
    stream->capture->thread = std::this_thread::get_id();
    stream->capture->invalidate_first = invalidate_first;
  }
  if (mode != cudaStreamCaptureModeRelaxed) cuda_emulation::capturing_here = stream;
  if (mode == cudaStreamCaptureModeGlobal) cuda_emulation::global_captures++;
  return cudaSuccess;
}

// Ends the capture whatever it returns; an invalidated capture makes no graph.
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || graph == nullptr) return last_error = cudaErrorInvalidValue;
  *graph = nullptr;
  std::unique_ptr<StreamCapture> capture;
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    if (stream->capture == nullptr) {
      return cuda_emulation::Fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
    }
    if (stream->capture->mode != cudaStreamCaptureModeRelaxed &&
        stream->capture->thread != std::this_thread::get_id()) {
      return cuda_emulation::Fail(cudaErrorStreamCaptureWrongThread,
                                  "cudaStreamEndCapture: called on another thread than began the capture");
    }
    capture = std::move(stream->capture);
  }
  if (cuda_emulation::capturing_here == stream) cuda_emulation::capturing_here = nullptr;
  if (capture->mode == cudaStreamCaptureModeGlobal) cuda_emulation::global_captures--;
  if (capture->invalidated) {
    return cuda_emulation::Fail(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: the capture was invalidated");
  }
  *graph = new CUgraph_st{std::move(capture->recorded)};
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.graph_captures++;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return last_error = cudaErrorInvalidValue;
  *status = cudaStreamCaptureStatusNone;
  if (stream == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(stream->mu);
  if (stream->capture != nullptr) {
    *status = stream->capture->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  }
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  RETURN_IF_STICKY();
  if (exec == nullptr || graph == nullptr || flags != 0) return last_error = cudaErrorInvalidValue;
  *exec = nullptr;
  if (internal::TakeFault(cuda_emulation::Fault::kGraphInstantiate)) {
    return cuda_emulation::Fail(cudaErrorInvalidValue, "cudaGraphInstantiate: injected failure");
  }
  *exec = new CUgraphExec_st{graph->ops};
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.graph_instantiations++;
  s.live_graph_execs++;
  return cudaSuccess;
}

// Queues the graph's operations, in the order they were recorded, as one unit on `stream`.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  RETURN_IF_STICKY();
  if (exec == nullptr) return last_error = cudaErrorInvalidValue;
  if (stream == nullptr) internal::CountLegacyStreamWork();
  {
    auto& s = cuda_emulation::GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    s.counters.graph_launches++;
  }
  std::vector<std::function<void()>> ops = exec->ops;
  return internal::Enqueue(stream, [ops = std::move(ops)] {
    for (const auto& op : ops) op();
  });
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec == nullptr) return last_error = cudaErrorInvalidValue;
  delete exec;
  auto& s = cuda_emulation::GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.live_graph_execs--;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (graph == nullptr) return last_error = cudaErrorInvalidValue;
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  if ((flags & ~cudaEventDisableTiming) != 0) return last_error = cudaErrorInvalidValue;
  *event = new CUevent_st;
  (*event)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event->stream != nullptr || event->recorded) internal::DrainStream(event->stream);
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  RETURN_IF_STICKY();
  event->stream = stream;
  internal::Enqueue(stream, [event] {
    event->when = std::chrono::steady_clock::now();
    event->recorded = true;
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (cuda_emulation::IsCapturing(event->stream)) {
    cuda_emulation::InvalidateCapture(event->stream);
    return cuda_emulation::Fail(cudaErrorStreamCaptureUnsupported,
                                "cudaEventSynchronize: the event's stream is capturing (the capture is invalidated)");
  }
  internal::DrainStream(event->stream);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start->timing || !end->timing) return last_error = cudaErrorInvalidResourceHandle;
  if (!start->recorded || !end->recorded) return last_error = cudaErrorInvalidValue;
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return cudaSuccess;
}
