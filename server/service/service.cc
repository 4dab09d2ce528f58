#include "server/service/service.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>

#include "server/core/form_table.h"
#include "server/core/forms.h"
#include "server/service/admin_worker.h"
#include "server/service/guarded.h"
#include "server/service/spectrum_proto.h"
#include "server/service/validation.h"
#include "server/service/wire_request.h"

namespace attnserve {

// validation.h speaks the wire's numbers without including the proto; they must agree (the
// forms' own: tests/unit/form_table_test.cc).
static_assert(static_cast<int>(WireDtype::kFloat32) == v1::DATA_TYPE_FLOAT32);
static_assert(static_cast<int>(WireDtype::kFloat16) == v1::DATA_TYPE_FLOAT16);
static_assert(static_cast<int>(WireDtype::kBFloat16) == v1::DATA_TYPE_BFLOAT16);
static_assert(static_cast<int>(WireForm::kUnspecified) == v1::FORM_UNSPECIFIED);
static_assert(kAutoChoice.wire == v1::FORM_AUTO);
// attnserve::StatusCode has gRPC's numbers, so conversion is a cast.
static_assert(static_cast<int>(StatusCode::kInvalidArgument) == grpc::StatusCode::INVALID_ARGUMENT);
static_assert(static_cast<int>(StatusCode::kResourceExhausted) == grpc::StatusCode::RESOURCE_EXHAUSTED);
static_assert(static_cast<int>(StatusCode::kUnauthenticated) == grpc::StatusCode::UNAUTHENTICATED);

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

std::chrono::steady_clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return std::chrono::steady_clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
}

namespace {

v1::Form ToProtoForm(Form form) { return static_cast<v1::Form>(FormToWire(form)); }

}  // namespace

void FillLayerInfo(const Layer& layer, v1::LayerInfo* info) {
  info->set_name(layer.name);
  info->set_source(layer.source);
  v1::LayerConfig* c = info->mutable_config();
  c->set_d_model(layer.config.d_model);
  c->set_heads(layer.config.heads);
  c->set_kv_heads(layer.config.kv_heads);
  c->set_d_head(layer.config.d_head);
  c->set_bias(layer.config.bias);
  c->set_scale(layer.config.SoftmaxScale());
  for (const auto& [form, resident] : layer.forms) {
    const FormWeights& w = resident->weights();
    v1::FormInfo* f = info->add_forms();
    f->set_form(ToProtoForm(form));
    f->set_parameters(w.Parameters());
    f->set_bytes(resident->HostBytes());
    f->set_device(layer.device);
    const SequenceShape shape{kFlopsReferenceLength, kFlopsReferenceLength, -1};
    f->set_flops_per_token(ForwardFlops(w, std::span<const SequenceShape>(&shape, 1)) /
                           static_cast<double>(kFlopsReferenceLength));
    f->set_flops_reference_length(kFlopsReferenceLength);
  }
  for (Math m : layer.maths) info->add_maths(std::string(MathName(m)));
  FillLowRankInfo(layer, info);
}

void ForwardReactor::OnDone() {
  if (served_) pipeline_->ReportStages(*served_, std::chrono::steady_clock::now());
  delete this;
}

ForwardReactor* StartGrpcForward(ForwardPipeline& pipeline, grpc::CallbackServerContext* context,
                                 const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer,
                                 std::chrono::steady_clock::time_point arrived, const Status& refused) {
  auto* reactor = new ForwardReactor(&pipeline);
  ForwardDone done = [reactor](const Status& status, const CallTimeline* served) {
    if (served != nullptr) reactor->Served(*served);
    reactor->Finish(ToGrpc(status));
  };
  // The context outlives the call's jobs: the call is finished only from their completions.
  CallControl control{.deadline = SteadyDeadline(*context), .cancelled = [context] { return context->IsCancelled(); }};
  pipeline.Start(request, std::move(answer), std::move(done), std::move(control), arrived, refused);
  return reactor;
}

AttentionServiceImpl::AttentionServiceImpl(LayerStore* store, ForwardPipeline* pipeline, ServiceOptions options)
    : store_(store), pipeline_(pipeline), options_(std::move(options)), admin_(std::make_unique<AdminWorker>(options_.admin_queue)) {}

AttentionServiceImpl::~AttentionServiceImpl() = default;

namespace {

// attnserve.v1's answer: the output tensor and the timings as ForwardResponse's fields.
class V1ForwardAnswer final : public ForwardAnswer {
 public:
  explicit V1ForwardAnswer(v1::ForwardResponse* response) : response_(response) {}

  std::string* OutputBytes(int64_t batch, int64_t n, int64_t d_model) override {
    v1::Tensor* out = response_->mutable_output();
    out->set_dtype(v1::DATA_TYPE_FLOAT32);
    out->add_shape(batch);
    out->add_shape(n);
    out->add_shape(d_model);
    return out->mutable_data();
  }

  void Served(Variant served, const ServedTimings& timings, std::span<const FormDivergence> divergences) override {
    for (const FormDivergence& d : divergences) {
      v1::Divergence* div = response_->add_divergence();
      div->set_form(ToProtoForm(d.form));
      div->set_max_abs(d.stats.max_abs);
      div->set_rel_l2(d.stats.rel_l2);
    }
    response_->set_form(ToProtoForm(served.form));
    response_->set_math(std::string(MathName(served.math)));
    response_->set_queue_us(timings.queue_us);
    response_->set_compute_us(timings.compute_us);
    response_->set_batch_requests(timings.batch_requests);
    response_->set_decode_us(timings.decode_us);
    response_->set_encode_us(timings.encode_us);
  }

 private:
  v1::ForwardResponse* const response_;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                        const v1::ForwardRequest* request,
                                                        v1::ForwardResponse* response) {
  const auto arrived = std::chrono::steady_clock::now();
  std::unique_ptr<ForwardAnswer> answer;
  Status made = Guarded("Forward", [&]() -> Status {
    answer = std::make_unique<V1ForwardAnswer>(response);
    return OkStatus();
  });
  if (!made.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpc(made));
    return reactor;
  }
  return StartGrpcForward(*pipeline_, context, WireRequestOf(*request), std::move(answer), arrived);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                           const v1::ListLayersRequest* /*request*/,
                                                           v1::ListLayersResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpc(Guarded("ListLayers", [&]() -> Status {
    for (const auto& layer : store_->List()) FillLayerInfo(*layer, response->add_layers());
    return OkStatus();
  })));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                         const v1::GetLayerRequest* request, v1::LayerInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpc(Guarded("GetLayer", [&]() -> Status {
    std::shared_ptr<const Layer> layer = store_->Get(request->name());
    if (layer == nullptr) {
      return NotFoundError("name: no layer named " + QuoteUntrusted(request->name()) +
                           " is loaded (loaded: " + LoadedNames(*store_) + ")");
    }
    FillLayerInfo(*layer, response);
    if (request->include_spectrum()) FillSpectrumInfo(*layer, response);
    return OkStatus();
  })));
  return reactor;
}

}  // namespace attnserve
