// The Backend interface: what runs a form on a device. One implementation per device kind
// (cpu/, later cuda/); the batching and service layers see only this header.
// Thread-safety: Upload and Forward may be called from several threads at once; a
// ResidentForm is immutable and shared between the calls that use it.
#pragma once

#include <climits>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "server/core/forms.h"
#include "server/core/math.h"
#include "server/core/sequence.h"
#include "server/core/status.h"

namespace attnserve {

// Where one batch's time went on a device with memory of its own, read from events on its
// stream: the inputs' copy to the device (paced by the host packing them into pinned memory),
// the compute, and the outputs' copy back. The compute alone is what a caller whose data already
// lives on the device would wait for (PyTorch's device-only figure); the rest of a Forward's wall
// time is host work: packing, unpacking, allocation.
struct DeviceTimes {
  double inputs_ms = 0;
  double compute_ms = 0;
  double outputs_ms = 0;
};

// What a backend with memory of its own holds on its device, for the operators' gauges: the
// device budget's count (weights and every lane's workspace) against its limit, and the lanes
// (streams with their handles and buffers) made so far.
struct DeviceMemoryState {
  int64_t held_bytes = 0;
  int64_t limit_bytes = 0;
  int lanes = 0;
};

// A form's weights made resident on a backend's device (a host pointer on the CPU, device
// memory on a GPU). Lives as long as any batch that uses it.
class ResidentForm {
 public:
  virtual ~ResidentForm() = default;
  virtual const FormWeights& weights() const = 0;
  // What its projections multiply in (server/core/math.h).
  virtual Math math() const { return Math::kFp32; }
  // Host memory this form holds: its weights, and any copy of them the backend made (the CPU
  // backend's packed panels). The layer store's --max-layer-mb and attnserve_layer_bytes count it.
  virtual int64_t HostBytes() const { return weights().Bytes(); }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N": the device label of metrics and LayerInfo.
  virtual std::string DeviceName() const = 0;

  // Makes the form resident on this device in default_math(). Called once per (layer, form) at load.
  virtual StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> form) = 0;
  // The math Upload holds a form in: the device's flag (--gpu-math, --cpu-weight-layout).
  virtual Math default_math() const { return Math::kFp32; }
  // Makes the form resident in `math` (a served variant's precision, --extra-maths): a backend
  // holds one layer's form in several maths side by side, and Forward runs each in its own.
  // INVALID_ARGUMENT naming the math and what this device runs when it cannot.
  virtual StatusOr<std::shared_ptr<const ResidentForm>> UploadIn(std::shared_ptr<const FormWeights> form, Math math) {
    ATTNSERVE_RETURN_IF_ERROR(CheckMath(math));
    return Upload(std::move(form));
  }
  // OK when UploadIn can hold forms in `math` here; else what UploadIn would answer. The server
  // checks --extra-maths with it at start, before any layer loads.
  virtual Status CheckMath(Math math) const {
    if (math == default_math()) return OkStatus();
    return InvalidArgumentError("math: " + DeviceName() + " runs " + std::string(MathName(default_math())) +
                                " only, got " + std::string(MathName(math)));
  }

  // False once a device error made the backend unusable (a GPU fault): the server then reports
  // NOT_SERVING for it. The CPU backend is always healthy.
  virtual bool Healthy() const { return true; }

  // Runs the form over a ragged batch and writes every sequence's output. The sequences keep
  // their own n, m, causal flag and key length; each is checked with ValidateSequence first,
  // and a bad one fails the call before anything is computed.
  virtual Status Forward(const ResidentForm& form, std::span<const Sequence> batch) = 0;

  // Host memory one Forward of `batch` allocates beyond its inputs and outputs, for the
  // server's memory budget. The default is the CPU backend's formula on one thread with the
  // summed form unchunked (an upper bound for a backend whose host side stages less).
  virtual int64_t ScratchBytes(const FormWeights& form, std::span<const SequenceShape> batch,
                               bool self_attention) const {
    return ForwardScratchBytes(form, batch, self_attention, 1, INT64_MAX);
  }

  // Host memory the backend keeps between calls (scratch it reuses), in bytes: not part of the
  // memory budget, which counts what a running batch needs; exported as a gauge.
  virtual int64_t RetainedScratchBytes() const { return 0; }

  // The split of the last batch this backend finished (any caller's); nullopt where the
  // backend computes in host memory (the CPU) or has run no batch yet. For benchmarks.
  virtual std::optional<DeviceTimes> LastDeviceTimes() const { return std::nullopt; }

  // The DeviceTimes of the last Forward this thread made on this backend, when it succeeded:
  // the executor's worker reads it right after its call, for the per-call histograms (the
  // "any caller's" LastDeviceTimes would mix workers' batches). nullopt on the CPU.
  virtual std::optional<DeviceTimes> ThisThreadsDeviceTimes() const { return std::nullopt; }

  // Readies the backend for `callers` concurrent callers before the server reports ready: on a
  // GPU, one lane per caller made and each run over every form in `forms` once, with a small
  // batch (its stream, cuBLAS handle and workspace, its pinned staging, the kernels' modules),
  // so that the first requests do no lazy initialisation. The CPU has nothing to warm.
  virtual Status Warmup(int callers, std::span<const ResidentForm* const> forms) {
    (void)callers;
    (void)forms;
    return OkStatus();
  }

  // The device budget and lanes, for the gauges; nullopt on the CPU.
  virtual std::optional<DeviceMemoryState> DeviceMemory() const { return std::nullopt; }

  // The device's PCI bus id ("0000:3B:00.0"), by which NVML finds it; "" on the CPU.
  virtual std::string PciBusId() const { return ""; }

  // The order this backend runs a summed sequence in (SummedMixesFirst): what the cost model of
  // `auto` counts (server/core/form_cost.h). The default: every summed sequence projects first.
  virtual SummedOrder summed_order() const { return {}; }

  // FLOPs one Forward of `batch` does, as this backend computes it (the metrics' count).
  virtual double Flops(const FormWeights& form, std::span<const SequenceShape> batch) const {
    return ForwardFlops(form, batch);
  }
};

// Checks every sequence of a batch against the form's layer; the error names the sequence.
Status ValidateBatch(const LayerConfig& config, std::span<const Sequence> batch);

}  // namespace attnserve
