// attnserve.v1.AttentionService over gRPC's callback API: converts proto ⇄ core, checks
// requests (validation.h), hands Forward work to the Executor and finishes each call from the
// job's completion. No math here (docs/architecture.md §2).
// Thread-safety: every handler may run on any gRPC thread at once; per-call state lives in
// the call's own reactor state, shared state in LayerStore and Executor (both thread-safe).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/batching/divergence.h"
#include "server/batching/executor.h"
#include "server/batching/memory_budget.h"
#include "server/service/call_gate.h"
#include "server/service/validation.h"
#include "server/store/layer_store.h"

namespace attnserve {

// FLOPs per token in LayerInfo are those of self-attention at this sequence length.
inline constexpr int64_t kFlopsReferenceLength = 128;

class Metrics;       // server/metrics/metrics.h
class Router;        // server/routing/router.h
class ShadowRunner;  // server/routing/shadow.h

// Who may call the admin API (LoadLayer, UnloadLayer, SetRouting) on one listener
// (docs/security.md).
enum class AdminAccess {
  kClosed,  // PERMISSION_DENIED, saying how to open it
  kToken,   // "authorization: Bearer TOKEN"; missing or wrong: UNAUTHENTICATED
  kOpen,    // anyone who reaches the listener: only an admin listener bound to loopback
};

struct ServiceOptions {
  AdminAccess admin_access = AdminAccess::kClosed;
  std::string admin_token;  // kToken: the token callers must send
  int admin_queue = 8;      // admin calls waiting at most; beyond: RESOURCE_EXHAUSTED
  // Attention scores one request may ask for (Σ n · m · heads); beyond: RESOURCE_EXHAUSTED.
  int64_t max_request_scores = int64_t{4096} * 1000000;
  // Not owned; they outlive the service. Null: nothing is recorded; FORM_UNSPECIFIED is the
  // factored form and SetRouting answers FAILED_PRECONDITION; nothing is mirrored.
  Metrics* metrics = nullptr;
  Router* router = nullptr;
  // The --routes-file the router follows: SetRouting may not change a route (one source of
  // truth for the fleet) and answers FAILED_PRECONDITION naming it. Empty: routes per process.
  std::string routes_file;
  ShadowRunner* shadow = nullptr;
  // The server-wide memory budget every Forward reserves its footprint from at admission, and
  // the backend whose scratch that footprint includes (not owned; null: no budget).
  MemoryBudget* memory = nullptr;
  const Backend* backend = nullptr;
  // The largest response gRPC will send: a larger output is refused before any compute.
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

// The reactor of every inference call (Forward, ModelInfer). When gRPC is done with a call that
// was served, it reports the call's stages to the metrics, the send among them (only known
// here); then it deletes itself, as gRPC's callback API asks of a reactor the handler made.
// Thread-safety: Served runs before Finish, OnDone after it (gRPC orders the two).
class ForwardReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit ForwardReactor(Metrics* metrics) : metrics_(metrics) {}
  // The call was answered OK with this timeline (its `answered` set): report it at OnDone.
  void Served(const CallTimeline& timeline) { served_ = timeline; }
  void OnDone() override;
  // OnDone runs on the thread that ends the call (the batch worker inside Finish, or the gRPC
  // thread that sees the stream close), not handed to gRPC's executor thread: that hand-off woke
  // one more server thread just as the answer left, on the cores the client needs to read it, and
  // cost a lone call about 40 µs on a 2-vCPU host (docs/journal/benchmarks-journal.md, "OnDone
  // without the executor, and the queue's lock taken spinning"). gRPC allows it for reactors whose reactions are trivial and never block: OnDone
  // records the stages (a few histogram updates) and deletes the reactor; OnCancel is the
  // default no-op.
  bool InternalInlineable() override { return true; }

 private:
  Metrics* const metrics_;
  std::optional<CallTimeline> served_;
};

// Writes one inference call's answer into its protocol's response: attnserve.v1's
// ForwardResponse (service.cc) or the Open Inference Protocol's ModelInferResponse
// (inference_service.cc). The shared call path (StartForward) computes; this only places bytes.
// Thread-safety: one call's; OutputBytes runs before any compute, Served after all of it.
class ForwardAnswer {
 public:
  virtual ~ForwardAnswer() = default;
  // Where the served form's [batch, n, d_model] float32 output goes: a string in the response,
  // which the caller sizes and the backend writes into (no copy).
  virtual std::string* OutputBytes(int64_t batch, int64_t n, int64_t d_model) = 0;
  // Only for a call answered OK, just before the answer: the form that served it, its batch's
  // timings and, with `compare`, every other held form's divergence.
  virtual void Served(Form form, const ServedTimings& timings, std::span<const FormDivergence> divergences) = 0;
};

class AdminWorker;  // runs slow admin calls (layer loads) off gRPC's threads; service.cc

class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  // `store` and `executor` outlive the service; destroy the service after the server's
  // Shutdown has returned (no call may still be running).
  AttentionServiceImpl(LayerStore* store, Executor* executor, ServiceOptions options);
  ~AttentionServiceImpl() override;

  // At shutdown: waits for the admin calls accepted so far (a layer load may take seconds),
  // until `until`. False when one still runs then: the caller may exit without it rather than
  // let a load stuck on a hung file system hold the drain (main.cc does).
  bool WaitForAdminCalls(std::chrono::steady_clock::time_point until);
  // At the drain deadline: answers every admin call still waiting or running UNAVAILABLE, so
  // that gRPC's Server::Wait returns; a running load goes on, unanswered (docs/security.md).
  void AbandonAdminCalls();
  // The drain (main.cc): from now on Forward answers UNAVAILABLE ("draining"); the calls
  // accepted before keep running. WaitForForwardCalls: until every accepted Forward call has
  // been answered, or `until`; false when some are still open then.
  void StopAcceptingForwardCalls() { forward_gate_.Close(); }
  bool WaitForForwardCalls(std::chrono::steady_clock::time_point until) { return forward_gate_.WaitIdle(until); }
  // True once StopAcceptingForwardCalls has run: the Open Inference Protocol's readiness.
  bool Draining() { return forward_gate_.closed(); }

  // The one path of every inference call, whatever protocol it came in (Forward here, ModelInfer
  // in inference_service.cc): the drain gate, the layer, the form (the router when unspecified),
  // DecodeForward, the response-size and memory admission, the executor, and the metrics and
  // shadows of its answer. `answer` writes the protocol's response. `refused`, the protocol's
  // own conversion error, is answered where a decode error would be (counted under the layer).
  // The call is finished on `reactor`, here or from the jobs' completions. `request` views
  // bytes that must live until the call is finished (the request message's).
  // The reactor StartForward finishes a call on; it deletes itself when gRPC is done with it.
  ForwardReactor* NewForwardReactor() const { return new ForwardReactor(options_.metrics); }
  void StartForward(grpc::CallbackServerContext* context, ForwardReactor* reactor,
                    const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer,
                    std::chrono::steady_clock::time_point arrived, const Status& refused = OkStatus());

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext* context, const v1::ListLayersRequest* request,
                                       v1::ListLayersResponse* response) override;
  grpc::ServerUnaryReactor* GetLayer(grpc::CallbackServerContext* context, const v1::GetLayerRequest* request,
                                     v1::LayerInfo* response) override;
  grpc::ServerUnaryReactor* LoadLayer(grpc::CallbackServerContext* context, const v1::LoadLayerRequest* request,
                                      v1::LayerInfo* response) override;
  grpc::ServerUnaryReactor* UnloadLayer(grpc::CallbackServerContext* context, const v1::UnloadLayerRequest* request,
                                        v1::UnloadLayerResponse* response) override;
  // The A/B split and the shadow rate (routing_service.cc).
  grpc::ServerUnaryReactor* SetRouting(grpc::CallbackServerContext* context, const v1::SetRoutingRequest* request,
                                       v1::RoutingInfo* response) override;
  grpc::ServerUnaryReactor* GetRouting(grpc::CallbackServerContext* context, const v1::GetRoutingRequest* request,
                                       v1::RoutingInfo* response) override;

 private:
  Status CheckAdmin(const grpc::CallbackServerContext& context) const;

  LayerStore* const store_;
  Executor* const executor_;
  const ServiceOptions options_;
  std::unique_ptr<AdminWorker> admin_;
  CallGate forward_gate_;
};

// What LayerInfo says of a layer (also used by the server's start-up log).
void FillLayerInfo(const Layer& layer, v1::LayerInfo* info);

// attnserve::Status as a grpc::Status: the codes share their numbers, so a cast.
grpc::Status ToGrpc(const Status& status);

// Sets the layer_parameters and layer_bytes series of every form `layer` holds, replacing
// those of an earlier layer of that name (routing_service.cc).
void ReportLayerMetrics(const Layer& layer, Metrics& metrics);

}  // namespace attnserve
