// attnserve.v1.AttentionService over gRPC's callback API: converts proto ⇄ core and runs Forward
// through the shared call path (forward_pipeline.h), finishing each call on its reactor; the
// layer admin (layer_admin.cc) and routing (routing_service.cc) calls. No math here
// (docs/architecture.md §2).
// Thread-safety: every handler may run on any gRPC thread at once; per-call state lives in
// the call's own reactor state, shared state in LayerStore and the pipeline (both thread-safe).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/service/forward_pipeline.h"
#include "server/service/validation.h"
#include "server/store/layer_store.h"

namespace attnserve {

// FLOPs per token in LayerInfo are those of self-attention at this sequence length.
inline constexpr int64_t kFlopsReferenceLength = 128;

class Metrics;  // server/metrics/metrics.h
class Router;   // server/routing/router.h

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
  // Not owned; they outlive the service. Null: nothing is recorded; SetRouting answers
  // FAILED_PRECONDITION.
  Metrics* metrics = nullptr;
  Router* router = nullptr;
  // The --routes-file the router follows: SetRouting may not change a route (one source of
  // truth for the fleet) and answers FAILED_PRECONDITION naming it. Empty: routes per process.
  std::string routes_file;
};

// The reactor of every gRPC inference call (Forward, ModelInfer). When gRPC is done with a call
// that was served, it reports the call's stages to the metrics, the send among them (only known
// here); then it deletes itself, as gRPC's callback API asks of a reactor the handler made.
// Thread-safety: Served runs before Finish, OnDone after it (gRPC orders the two).
class ForwardReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit ForwardReactor(const ForwardPipeline* pipeline) : pipeline_(pipeline) {}
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
  const ForwardPipeline* const pipeline_;
  std::optional<CallTimeline> served_;
};

// Runs one gRPC inference call (Forward, ModelInfer) through `pipeline`: the client's deadline
// and cancellation from `context`, the call finished on `reactor` (made here; returned for the
// handler to return). `request` views the request message, which gRPC keeps until the finish.
ForwardReactor* StartGrpcForward(ForwardPipeline& pipeline, grpc::CallbackServerContext* context,
                                 const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer,
                                 std::chrono::steady_clock::time_point arrived, const Status& refused = OkStatus());

class AdminWorker;  // runs slow admin calls (layer loads) off gRPC's threads; admin_worker.h

class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  // `store` and `pipeline` outlive the service; destroy the service after the server's
  // Shutdown has returned (no call may still be running).
  AttentionServiceImpl(LayerStore* store, ForwardPipeline* pipeline, ServiceOptions options);
  ~AttentionServiceImpl() override;

  // At shutdown: waits for the admin calls accepted so far (a layer load may take seconds),
  // until `until`. False when one still runs then: the caller may exit without it rather than
  // let a load stuck on a hung file system hold the drain (main.cc does).
  bool WaitForAdminCalls(std::chrono::steady_clock::time_point until);
  // At the drain deadline: answers every admin call still waiting or running UNAVAILABLE, so
  // that gRPC's Server::Wait returns; a running load goes on, unanswered (docs/security.md).
  void AbandonAdminCalls();

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
  ForwardPipeline* const pipeline_;  // Forward's call path, shared with the other protocols
  const ServiceOptions options_;
  std::unique_ptr<AdminWorker> admin_;
};

// What LayerInfo says of a layer (also used by the server's start-up log).
void FillLayerInfo(const Layer& layer, v1::LayerInfo* info);

// attnserve::Status as a grpc::Status: the codes share their numbers, so a cast.
grpc::Status ToGrpc(const Status& status);

// The client's deadline on the steady clock the batcher uses (max when there is none).
std::chrono::steady_clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context);

// Sets the layer_parameters and layer_bytes series of every form `layer` holds, replacing
// those of an earlier layer of that name (routing_service.cc).
void ReportLayerMetrics(const Layer& layer, Metrics& metrics);

}  // namespace attnserve
