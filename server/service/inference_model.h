// What the Open Inference Protocol says of a layer as a model, shared by its gRPC service
// (inference_service.h) and its HTTP/REST one (http/http_service.h): the model a request names,
// its metadata, and the answer a ModelInfer call writes (ModelInferResponse). Protobuf, no gRPC.
// Thread-safety: pure functions; an InferAnswer is one call's.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "inference/grpc_service.pb.h"
#include "server/core/status.h"
#include "server/service/forward_pipeline.h"
#include "server/store/layer_store.h"

namespace attnserve {

// The model's platform and backend in metadata and config.
inline constexpr char kInferPlatform[] = "attnserve";

// The layer a model request names at `version` ("1" or empty); NOT_FOUND naming the loaded ones.
StatusOr<std::shared_ptr<const Layer>> FindInferModel(const LayerStore& store, const std::string& name,
                                                      const std::string& version);

// ModelMetadata's answer for `layer`: x, context, key_lengths in; y out.
void FillModelMetadata(const Layer& layer, inference::ModelMetadataResponse* response);

// The OIP answer: the output `y` as raw_output_contents (tritonclient's as_numpy reads only
// those), the served form and the timings as response parameters.
class InferAnswer final : public ForwardAnswer {
 public:
  InferAnswer(inference::ModelInferResponse* response, std::string model, std::string id)
      : response_(response), model_(std::move(model)), id_(std::move(id)) {}

  std::string* OutputBytes(int64_t batch, int64_t n, int64_t d_model) override;
  void Served(Variant served, const ServedTimings& timings, std::span<const FormDivergence> divergences) override;

 private:
  inference::ModelInferResponse* const response_;
  const std::string model_;
  const std::string id_;
};

}  // namespace attnserve
