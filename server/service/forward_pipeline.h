// The one call path of every inference call, whatever protocol brought it (attnserve.v1's
// Forward and the Open Inference Protocol's ModelInfer over gRPC, the OIP over HTTP): the drain
// gate, the layer, the form (the router when unspecified), DecodeForward, the response-size and
// memory admission, the executor, and the metrics and shadows of its answer. A protocol turns
// its request into a WireForwardRequest, supplies a ForwardAnswer (where its response's bytes
// go) and a ForwardDone (how the call ends); nothing here knows a protocol (docs/architecture.md
// §2, "The call path").
// Thread-safety: Start, Close, WaitIdle and Draining may be called from any thread at once;
// per-call state lives in the call, shared state in LayerStore, Executor, Router, MemoryBudget,
// ShadowRunner and Metrics (all thread-safe).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "server/batching/divergence.h"
#include "server/batching/executor.h"
#include "server/batching/memory_budget.h"
#include "server/core/status.h"
#include "server/service/call_gate.h"
#include "server/service/validation.h"
#include "server/store/layer_store.h"

namespace attnserve {

class AutoFormChooser;  // server/service/auto_form.h
class Metrics;       // server/metrics/metrics.h
class Router;        // server/routing/router.h
class ShadowRunner;  // server/routing/shadow.h

struct ForwardPipelineOptions {
  // Attention scores one request may ask for (Σ n · m · heads); beyond: RESOURCE_EXHAUSTED.
  int64_t max_request_scores = int64_t{4096} * 1000000;
  // Not owned; they outlive the pipeline. Null: nothing is recorded; FORM_UNSPECIFIED is the
  // factored form; nothing is mirrored.
  Metrics* metrics = nullptr;
  Router* router = nullptr;
  ShadowRunner* shadow = nullptr;
  // The server-wide memory budget every call reserves its footprint from at admission, and
  // the backend whose scratch that footprint includes (not owned; null: no budget).
  MemoryBudget* memory = nullptr;
  const Backend* backend = nullptr;
  // What FORM_AUTO resolves by (not owned). Null: the flop count (FlopCountModel).
  AutoFormChooser* auto_form = nullptr;
  // Starts the build of a layer's low-rank form from its live calibration rows (LiveCalibration,
  // lowrank=...,calibration=live:ROWS) off the serving threads, once a call completed them;
  // false when it cannot now (the next call offers again). Null: the rows are gathered, never built.
  std::function<bool(std::shared_ptr<const Layer>)> build_live_calibration;
  // The largest response a protocol will send: a larger output is refused before any compute.
  int64_t max_response_bytes = int64_t{64} << 20;
};

// One compared form's divergence from the served output (`compare`).
struct FormDivergence {
  Form form;
  DivergenceStats stats;
};

// What a served call's answer says of its time (ForwardResponse's timing fields; the Open
// Inference Protocol's response parameters of the same names).
struct ServedTimings {
  int64_t decode_us = 0;       // arrival → the job submitted: routing, decoding, admission
  int64_t queue_us = 0;        // arrival → its batch started (decode_us is part of it)
  int64_t compute_us = 0;      // the backend call that computed it
  int32_t batch_requests = 0;  // requests in that backend call
  int64_t encode_us = 0;       // compute end → the answer written: output checks, divergences
};

// The moments one served call passed, on the steady clock: the ends of its stages
// (ServingStage, server/metrics/metrics.h). `arrived` is when its handler started.
struct CallTimeline {
  std::chrono::steady_clock::time_point arrived, routed, decoded, submitted, compute_start, compute_end, answered;
};

// Writes one inference call's answer into its protocol's response. The pipeline computes; this
// only places bytes.
// Thread-safety: one call's; OutputBytes runs before any compute, Served after all of it.
class ForwardAnswer {
 public:
  virtual ~ForwardAnswer() = default;
  // Where the served form's [batch, n, d_model] float32 output goes: a string in the response,
  // which the caller sizes and the backend writes into (no copy).
  virtual std::string* OutputBytes(int64_t batch, int64_t n, int64_t d_model) = 0;
  // Only for a call answered OK, just before the answer: the variant (form and math) that
  // served it, its batch's timings and, with `compare`, the divergence of every other form held
  // in that math.
  virtual void Served(Variant served, const ServedTimings& timings, std::span<const FormDivergence> divergences) = 0;
};

// How a call ends: called exactly once, on the thread that ends it (the caller's for a refusal,
// a batch worker's otherwise). `served` is the call's timeline (its `answered` set) when the
// call is answered OK, null otherwise. The call's drain ticket is given back right after.
using ForwardDone = std::function<void(const Status& status, const CallTimeline* served)>;

// What may cut a call short: the client's deadline on the steady clock (max: none) and a probe
// of its cancellation (null: never), read by the batcher before compute.
struct CallControl {
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<bool()> cancelled;
};

class ForwardPipeline {
 public:
  // `store` and `executor` outlive the pipeline; destroy it after every call has ended.
  ForwardPipeline(LayerStore* store, Executor* executor, ForwardPipelineOptions options);

  // Runs one call. `refused`, the protocol's own conversion error, is answered where a decode
  // error would be (counted under the layer). `request` views bytes that must live until `done`
  // has run; so must `control.cancelled`'s captures. Never throws; `done` runs exactly once.
  void Start(const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer, ForwardDone done,
             CallControl control, std::chrono::steady_clock::time_point arrived, const Status& refused = OkStatus());

  // The drain (Server::Drain): from now on Start answers UNAVAILABLE ("draining"); the calls
  // accepted before keep running. WaitIdle: until every accepted call has been answered, or
  // `until`; false when some are still open then.
  void Close() { gate_.Close(); }
  bool WaitIdle(std::chrono::steady_clock::time_point until) { return gate_.WaitIdle(until); }
  // True once Close has run: the protocols' readiness.
  bool Draining() { return gate_.closed(); }

  // Reports a served call's seven stages (attnserve_stage_seconds) once its answer has been
  // sent at `sent`: the protocol calls it when it knows the send ended.
  void ReportStages(const CallTimeline& timeline, std::chrono::steady_clock::time_point sent) const;

  LayerStore& store() const { return *store_; }

 private:
  // The exact form FORM_AUTO resolves to for a request of these shapes (auto_form.h).
  Form ResolveAuto(const std::shared_ptr<const Layer>& layer, std::span<const SequenceShape> shapes) const;
  // Offers a decoded call's rows to the layer's live calibration, and starts its build once
  // they complete it.
  void OfferCalibrationRows(const std::shared_ptr<const Layer>& layer, const DecodedForward& decoded) const;

  LayerStore* const store_;
  Executor* const executor_;
  const ForwardPipelineOptions options_;
  CallGate gate_;
};

// The names of the loaded layers, comma-separated ("none" when none): for NOT_FOUND messages.
std::string LoadedNames(const LayerStore& store);

}  // namespace attnserve
