// Controls of the host emulation of CUDA and cuBLAS (tests only): what a test can see and
// steer that a real device would not show — bytes moved, allocations made, injected faults.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace cuda_emulation {

// What the emulated device did since the last ResetCounters().
struct Counters {
  int64_t host_to_device_bytes = 0;
  int64_t device_to_host_bytes = 0;
  int64_t host_to_device_copies = 0;  // cudaMemcpy and cudaMemcpyAsync calls, each direction
  int64_t device_to_host_copies = 0;
  int64_t device_allocations = 0;     // cudaMalloc calls that allocated
  int64_t pinned_allocations = 0;     // cudaMallocHost calls that allocated
  int64_t pageable_async_copies = 0;  // cudaMemcpyAsync from or to memory not from cudaMallocHost
  int64_t kernel_launches = 0;
  int64_t streams_created = 0;
  int64_t gemm_calls = 0;  // cuBLAS GEMM calls (a strided batch counts once)
  // Kernel launches, GEMMs (through a handle whose stream was never set) and async copies on
  // the legacy default stream: the backend's own non-blocking stream does not wait for that
  // stream, so on a device such work races the rest of the batch. The emulation queues it on
  // the legacy stream, which runs only at a device-wide synchronisation (so the batch reads
  // what it has not yet computed), and counts it.
  int64_t legacy_stream_work = 0;
  // Work queued on a stream by one thread while another thread's work was still queued on it:
  // two callers sharing a stream (and a lane) at once.
  int64_t threads_sharing_a_stream = 0;
  // cudaDeviceSynchronize calls: each waits for every stream's work, so one a caller's failed
  // batch makes stalls every other caller's lane.
  int64_t device_synchronizations = 0;
  // cudaFree calls made while the calling thread's current device (cudaSetDevice) was not the
  // one the memory was allocated on: on a real device the call first creates a context on the
  // current one (GPU 0 for a thread that never chose), holding its memory for good.
  int64_t frees_on_another_device = 0;
  // cublasCreate calls that made a handle (with its own workspace on a device, made lazily):
  // what a warmed backend's first request must not do.
  int64_t blas_handles_created = 0;
  // Stream capture: captures ended into a graph (cudaStreamEndCapture that succeeded), graphs
  // instantiated, and graph launches (each queues every recorded operation at once; the
  // kernels and GEMMs it replays are not counted again in kernel_launches or gemm_calls).
  int64_t graph_captures = 0;
  int64_t graph_instantiations = 0;
  int64_t graph_launches = 0;
};
Counters ReadCounters();
void ResetCounters();

// Device allocations not yet freed (device memory a test expects to be returned).
int64_t LiveDeviceAllocations();
// Their size in bytes: what the process holds on the device now (weights and workspaces).
int64_t LiveDeviceBytes();

// Instantiated graphs (cudaGraphInstantiate) not yet destroyed (cudaGraphExecDestroy).
int64_t LiveGraphExecs();

// The emulated device's memory, which cudaMemGetInfo reports and cudaMalloc does not pass
// (cudaErrorMemoryAllocation beyond it): 80 GiB until set; Reset() does not change it.
void SetDeviceMemoryBytes(int64_t bytes);
inline constexpr int64_t kDefaultDeviceMemoryBytes = int64_t{80} << 30;

// Devices cudaGetDeviceCount reports: 1, or ATTNSERVE_CUDA_EMULATION_DEVICES; 0 makes it fail
// as with no GPU.
void SetDeviceCount(int count);

// The next operation of this kind fails as a device fault would: the call reports it and the
// error stays (sticky), as after a fault on a real device, until Reset(); for the first three.
// A process that cannot call this (a server that loaded the emulated plugin) sets
// ATTNSERVE_CUDA_EMULATION_FAULT_AT_GEMM=K instead: its GEMM number K (0 the first) faults,
// counting from when the file ATTNSERVE_CUDA_EMULATION_FAULT_ARMED_BY names exists, when that
// is set (the server's warmup runs GEMMs before it is ready: the test arms the fault after).
// Recoverable errors, which a real device reports and keeps serving after (not sticky):
// kOutOfMemory fails the next device cudaMalloc with cudaErrorMemoryAllocation, kGemmInvalid
// the next cuBLAS GEMM with CUBLAS_STATUS_INVALID_VALUE, kLaunchInvalid the next kernel launch
// with cudaErrorInvalidConfiguration (left for cudaGetLastError, nothing queued), kGemmAllocFailed
// the next GEMM with CUBLAS_STATUS_ALLOC_FAILED (cuBLAS could not get its own workspace),
// kPinnedOutOfMemory the next cudaMallocHost with cudaErrorMemoryAllocation, kGraphInstantiate
// the next cudaGraphInstantiate with cudaErrorInvalidValue, kCaptureInvalidated the next capture
// (cudaStreamBeginCapture succeeds; its first recorded operation invalidates it, as an
// operation the capture cannot record would), kLtLayoutAllocFailed the next
// cublasLtMatrixLayoutCreate with CUBLAS_STATUS_ALLOC_FAILED (a cuBLASLt plan half made).
// `times` > 1: the next `times` operations of the kind fail.
enum class Fault {
  kKernel,
  kGemm,
  kCopy,
  kOutOfMemory,
  kGemmInvalid,
  kLaunchInvalid,
  kGemmAllocFailed,
  kPinnedOutOfMemory,
  kGraphInstantiate,
  kCaptureInvalidated,
  kLtLayoutAllocFailed
};
inline constexpr int kFaultKinds = 11;
void InjectFault(Fault fault, int times = 1);
// The error an injected kKernel, kGemm or kCopy fault raises (a cudaError_t; 0: each its own,
// cudaErrorLaunchFailure or cudaErrorIllegalAddress), so that a test can raise each sticky error
// a device reports (cudaErrorContained, cudaErrorExternalDevice, …). Reset() clears it. A
// server process that loaded the emulated plugin sets ATTNSERVE_CUDA_EMULATION_FAULT_ERROR.
void SetInjectedFaultError(int error);

// Called first in every cudaStreamSynchronize (an empty function: none): a test's way to hold a
// caller at the point where its batch has been issued and not yet run. Reset() clears it.
void SetStreamSyncHook(std::function<void()> hook);

// Called once, on the thread an injected fault (InjectFault) fired on, at the start of that
// thread's next cudaStreamSynchronize, cudaDeviceSynchronize or cudaGetLastError: the moment the
// failed caller first turns to the device again. A test's way to run another caller there, at
// the backend's failure path (a lane handed back before its stream has drained is taken by that
// caller while the failed batch's work is still queued on it: Counters::threads_sharing_a_stream).
// Reset() clears it.
void SetAfterFaultHook(std::function<void()> hook);

// The seed of the emulated device's schedule: the order a launch runs its blocks in and the
// threads of a block between barriers, and the order streams' work interleaves at a device-wide
// synchronisation. Each launch draws its own order from it. ATTNSERVE_SEED until set (a fixed
// seed without it); the tests set the run's seed (TestSeed), so a replayed seed replays the
// schedules too. Reset() does not change it.
void SetScheduleSeed(uint64_t seed);

// Clears sticky errors, pending faults and the device count; keeps allocations and counters.
void Reset();

// The last problem the emulation found in a call (an argument cuBLAS would reject, an
// address outside every allocation, a barrier not reached by all threads), or "".
std::string LastDiagnostic();

}  // namespace cuda_emulation
