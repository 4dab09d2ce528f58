#include "server/service/inference_service.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <utility>

#include "server/core/forms.h"
#include "server/service/inference_model.h"
#include "server/service/inference_request.h"

namespace attnserve {
namespace {

using inference::InferParameter;

// The largest batch ModelConfig reports. attnserve bounds a request by its bytes (--max-message-mb),
// its scores (--max-scores-m) and the memory budget, not by rows; Triton's clients want a
// number > 0 to send batched shapes at all, and one that large requests never meet first.
constexpr int32_t kReportedMaxBatchSize = 1 << 16;

// ModelStreamInfer: answered UNIMPLEMENTED at once; the reactor deletes itself when gRPC is done.
class UnimplementedStream final
    : public grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
 public:
  UnimplementedStream() {
    Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "ModelStreamInfer is not implemented by attnserve: send each request with ModelInfer "
                        "(docs/service.md, Open Inference Protocol)"));
  }
  void OnDone() override { delete this; }
};

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpc(status));
  return reactor;
}

}  // namespace

InferenceServiceImpl::InferenceServiceImpl(LayerStore* store, ForwardPipeline* pipeline,
                                           InferenceServiceOptions options)
    : store_(store), pipeline_(pipeline), options_(std::move(options)) {}

bool InferenceServiceImpl::Ready() const {
  return !pipeline_->Draining() && (!options_.device_healthy || options_.device_healthy());
}

StatusOr<std::shared_ptr<const Layer>> InferenceServiceImpl::FindModel(const std::string& name,
                                                                       const std::string& version) const {
  return FindInferModel(*store_, name, version);
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                           const inference::ServerLiveRequest* /*request*/,
                                                           inference::ServerLiveResponse* response) {
  response->set_live(true);  // the process answers: it is live, draining or not
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerReady(grpc::CallbackServerContext* context,
                                                            const inference::ServerReadyRequest* /*request*/,
                                                            inference::ServerReadyResponse* response) {
  response->set_ready(Ready());
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                           const inference::ModelReadyRequest* request,
                                                           inference::ModelReadyResponse* response) {
  // An unknown model is not ready, which is an answer, not an error (probes poll for loads).
  const StatusOr<std::shared_ptr<const Layer>> layer = FindModel(request->name(), request->version());
  response->set_ready(layer.ok() && Ready());
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerMetadata(grpc::CallbackServerContext* context,
                                                               const inference::ServerMetadataRequest* /*request*/,
                                                               inference::ServerMetadataResponse* response) {
  response->set_name("attnserve");
  response->set_version(options_.version);
  // Only what is implemented: ModelConfig, and request/response parameters.
  response->add_extensions("model_configuration");
  response->add_extensions("parameters");
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelMetadata(grpc::CallbackServerContext* context,
                                                              const inference::ModelMetadataRequest* request,
                                                              inference::ModelMetadataResponse* response) {
  const StatusOr<std::shared_ptr<const Layer>> layer = FindModel(request->name(), request->version());
  if (!layer.ok()) return Answer(context, layer.status());
  FillModelMetadata(**layer, response);
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelConfig(grpc::CallbackServerContext* context,
                                                            const inference::ModelConfigRequest* request,
                                                            inference::ModelConfigResponse* response) {
  const StatusOr<std::shared_ptr<const Layer>> layer = FindModel(request->name(), request->version());
  if (!layer.ok()) return Answer(context, layer.status());
  const Layer& l = **layer;
  const int64_t d = l.config.d_model;
  inference::ModelConfig* c = response->mutable_config();
  c->set_name(l.name);
  c->set_platform(kInferPlatform);
  c->set_backend(kInferPlatform);
  c->set_max_batch_size(kReportedMaxBatchSize);
  // dims without the batch dimension (max_batch_size > 0).
  auto add_input = [&](const char* name, inference::DataType type, std::initializer_list<int64_t> dims, bool optional) {
    inference::ModelInput* in = c->add_input();
    in->set_name(name);
    in->set_data_type(type);
    for (int64_t v : dims) in->add_dims(v);
    in->set_optional(optional);
    in->set_allow_ragged_batch(true);  // the batcher stacks requests of any n, m
    return in;
  };
  add_input(kInferInputX, inference::TYPE_FP32, {-1, d}, false);
  add_input(kInferInputContext, inference::TYPE_FP32, {-1, d}, true);
  // One length per batch row: Triton shapes a per-row scalar as dims [1], reshaped to [].
  add_input(kInferInputKeyLengths, inference::TYPE_INT32, {1}, true)->mutable_reshape();
  inference::ModelOutput* y = c->add_output();
  y->set_name(kInferOutputY);
  y->set_data_type(inference::TYPE_FP32);
  y->add_dims(-1);
  y->add_dims(d);
  c->mutable_dynamic_batching()->set_max_queue_delay_microseconds(
      static_cast<uint64_t>(std::max<int64_t>(options_.max_queue_delay_us, 0)));
  auto& p = *c->mutable_parameters();
  std::string forms;
  for (const auto& [form, _] : l.forms) forms += (forms.empty() ? "" : ",") + std::string(FormName(form));
  p["forms"].set_string_value(forms);
  p["d_model"].set_string_value(std::to_string(l.config.d_model));
  p["heads"].set_string_value(std::to_string(l.config.heads));
  p["kv_heads"].set_string_value(std::to_string(l.config.kv_heads));
  p["d_head"].set_string_value(std::to_string(l.config.d_head));
  p["device"].set_string_value(l.device);
  return Answer(context, OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                           const inference::ModelInferRequest* request,
                                                           inference::ModelInferResponse* response) {
  const auto arrived = std::chrono::steady_clock::now();
  try {
    // The conversion's views (tensors, layer, key) point into the request message, which gRPC
    // keeps until the call is finished; key_lengths are copied by DecodeForward during Start.
    InferForwardRequest converted;
    ConvertInferRequest(*request, &converted);
    auto answer = std::make_unique<InferAnswer>(response, request->model_name(), request->id());
    return StartGrpcForward(*pipeline_, context, converted.wire, std::move(answer), arrived, converted.refused);
  } catch (const std::bad_alloc&) {
    // Only the conversion can end here (the pipeline answers every call itself).
    return Answer(context, ResourceExhaustedError("ModelInfer: out of memory"));
  }
}

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
InferenceServiceImpl::ModelStreamInfer(grpc::CallbackServerContext* /*context*/) {
  return new UnimplementedStream();
}

#define ATTNSERVE_OIP_UNIMPLEMENTED(Method, instead)                                                                   \
  grpc::ServerUnaryReactor* InferenceServiceImpl::Method(                                                              \
      grpc::CallbackServerContext* context, const inference::Method##Request*, inference::Method##Response*) {         \
    return Answer(context, Status(StatusCode::kUnimplemented, #Method " is not implemented by attnserve" instead       \
                                                                      " (docs/service.md, Open Inference Protocol)")); \
  }
ATTNSERVE_OIP_UNIMPLEMENTED(ModelStatistics, ": its metrics are on /metrics (docs/metrics.md)")
ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryIndex, ": attnserve.v1's ListLayers lists the models")
ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryModelLoad, ": load layers with attnserve.v1's LoadLayer (an admin call)")
ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryModelUnload, ": unload layers with attnserve.v1's UnloadLayer (an admin call)")
ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryStatus, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryRegister, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryUnregister, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryStatus, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryRegister, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryUnregister, ": tensors travel in the messages")
ATTNSERVE_OIP_UNIMPLEMENTED(TraceSetting, "")
ATTNSERVE_OIP_UNIMPLEMENTED(LogSettings, ": set the log level with --log-level")
#undef ATTNSERVE_OIP_UNIMPLEMENTED

}  // namespace attnserve
