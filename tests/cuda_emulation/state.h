// Internal to the CUDA emulation: the device state runtime.cc keeps and cublas.cc and simt.cc
// consult (memory spaces, sticky errors, faults, counters).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"

namespace cuda_emulation::internal {

// True when [p, p + bytes) lies inside one live device allocation.
bool IsDeviceRange(const void* p, size_t bytes);
// True when p points into a device allocation at all (a host pointer must not).
bool IsDevicePointer(const void* p);

// A sticky device error (a fault) fails every later call until Reset(); a plain one is only
// what the next cudaGetLastError reports.
cudaError_t StickyError();
void SetLastError(cudaError_t error);
void RaiseFault(cudaError_t error, const std::string& diagnostic);

// Records what went wrong for LastDiagnostic() and prints it on stderr.
void Diagnose(const std::string& diagnostic);

// The error an injected device fault raises: `fallback`, or SetInjectedFaultError's.
cudaError_t InjectedError(cudaError_t fallback);

// True (once) when a fault of this kind was injected.
bool TakeFault(Fault fault);

// Held while the emulated device reads or writes device memory (a stream's work running, a
// synchronous copy or memset). Under AddressSanitizer device memory is poisoned while no thread
// holds one, so host code that dereferences a device pointer is reported, as a device's
// pointer would fault on the host; the heap's own redzones, and so overruns, are untouched.
class DeviceAccess {
 public:
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};

// Queues `work` on `stream` (nullptr: the legacy default stream). It runs, in issue order
// within its stream, at the next synchronisation that covers the stream: cudaStreamSynchronize
// of it, cudaDeviceSynchronize, a synchronous copy or memset, cudaFree, cudaFreeHost, an
// event recorded on it and waited for. Work of different streams runs in an order drawn anew
// at each device-wide synchronisation. While `stream` is capturing (cudaStreamBeginCapture) the
// work is recorded into the capture instead; cudaErrorStreamCaptureInvalidated (nothing
// recorded) when the capture was invalidated.
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work);
// Runs what `stream` has queued; every stream's, for a device-wide synchronisation.
void DrainStream(cudaStream_t stream);
void DrainAll();

// A value to seed one launch's draws (the order of its blocks and threads) from: the schedule
// seed (SetScheduleSeed) mixed with the number of launches run so far.
uint64_t LaunchDraw();

void CountKernelLaunch();
void CountGemm();
void CountBlasHandle();
// Work issued on the legacy default stream (stream 0): Counters::legacy_stream_work.
void CountLegacyStreamWork();

}  // namespace cuda_emulation::internal
