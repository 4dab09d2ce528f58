// The Open Inference Protocol (KServe v2; Triton's GRPCInferenceService, package inference) on
// the same server and port as attnserve.v1: every loaded layer is a model of the same name,
// version "1" (docs/service.md, "Open Inference Protocol"). ModelInfer converts its request
// (inference_request.h) and runs the one call path of every protocol (forward_pipeline.h):
// the same validation, router, batcher, memory budget, metrics, shadows and drain. No math here.
// Thread-safety: every handler may run on any gRPC thread at once; it holds no state of its own.
#pragma once

#include <functional>
#include <string>

#include "inference/grpc_service.grpc.pb.h"
#include "server/service/service.h"
#include "server/store/layer_store.h"

namespace attnserve {

struct InferenceServiceOptions {
  std::string version;  // ServerMetadata's
  // Whether the device computes (Backend::Healthy); null: always. With the drain, what
  // ServerReady and ModelReady answer, as the health service does.
  std::function<bool()> device_healthy;
  // ModelConfig's dynamic_batching (the batcher's --max-queue-delay-us).
  int64_t max_queue_delay_us = 0;
};

class InferenceServiceImpl final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `store` and `pipeline` outlive the service (server.cc); destroy it after the server's Shutdown.
  InferenceServiceImpl(LayerStore* store, ForwardPipeline* pipeline, InferenceServiceOptions options);

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override;

  // Triton's extensions attnserve does not implement: UNIMPLEMENTED, saying what to use instead.
  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;
#define ATTNSERVE_OIP_UNIMPLEMENTED(Method)                                                                 \
  grpc::ServerUnaryReactor* Method(grpc::CallbackServerContext* context, const inference::Method##Request*, \
                                   inference::Method##Response*) override;
  ATTNSERVE_OIP_UNIMPLEMENTED(ModelStatistics)
  ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryIndex)
  ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryModelLoad)
  ATTNSERVE_OIP_UNIMPLEMENTED(RepositoryModelUnload)
  ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryStatus)
  ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryRegister)
  ATTNSERVE_OIP_UNIMPLEMENTED(SystemSharedMemoryUnregister)
  ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryStatus)
  ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryRegister)
  ATTNSERVE_OIP_UNIMPLEMENTED(CudaSharedMemoryUnregister)
  ATTNSERVE_OIP_UNIMPLEMENTED(TraceSetting)
  ATTNSERVE_OIP_UNIMPLEMENTED(LogSettings)
#undef ATTNSERVE_OIP_UNIMPLEMENTED

 private:
  bool Ready() const;
  // The layer a model request names at version "1" (or empty); NOT_FOUND naming the loaded ones.
  StatusOr<std::shared_ptr<const Layer>> FindModel(const std::string& name, const std::string& version) const;

  LayerStore* const store_;
  ForwardPipeline* const pipeline_;
  const InferenceServiceOptions options_;
};

}  // namespace attnserve
