#include "server/service/inference_model.h"

#include <initializer_list>
#include <utility>

#include "server/core/forms.h"
#include "server/service/inference_request.h"

namespace attnserve {
namespace {

void AddTensorMetadata(inference::ModelMetadataResponse::TensorMetadata* t, const char* name, const char* datatype,
                       std::initializer_list<int64_t> shape) {
  t->set_name(name);
  t->set_datatype(datatype);
  for (int64_t d : shape) t->add_shape(d);
}

}  // namespace

StatusOr<std::shared_ptr<const Layer>> FindInferModel(const LayerStore& store, const std::string& name,
                                                      const std::string& version) {
  std::shared_ptr<const Layer> layer = store.Get(name);
  if (layer == nullptr) {
    return NotFoundError("name: no model (layer) named " + QuoteUntrusted(name) +
                         " is loaded (loaded: " + LoadedNames(store) + ")");
  }
  if (!version.empty() && version != kInferModelVersion) {
    return NotFoundError("version: model " + QuoteUntrusted(name) + " has only version \"1\", got " +
                         QuoteUntrusted(version));
  }
  return layer;
}

void FillModelMetadata(const Layer& layer, inference::ModelMetadataResponse* response) {
  const int64_t d = layer.config.d_model;
  response->set_name(layer.name);
  response->add_versions(kInferModelVersion);
  response->set_platform(kInferPlatform);
  AddTensorMetadata(response->add_inputs(), kInferInputX, "FP32", {-1, -1, d});
  AddTensorMetadata(response->add_inputs(), kInferInputContext, "FP32", {-1, -1, d});
  // [batch, 1], as Triton reports the config's dims [1] (reshaped to one scalar per row); the
  // batch dimension alone would leave clients that strip it (perf_analyzer) with no shape.
  AddTensorMetadata(response->add_inputs(), kInferInputKeyLengths, "INT32", {-1, 1});
  AddTensorMetadata(response->add_outputs(), kInferOutputY, "FP32", {-1, -1, d});
}

std::string* InferAnswer::OutputBytes(int64_t batch, int64_t n, int64_t d_model) {
  response_->set_model_name(model_);
  response_->set_model_version(kInferModelVersion);
  response_->set_id(id_);
  inference::ModelInferResponse::InferOutputTensor* y = response_->add_outputs();
  y->set_name(kInferOutputY);
  y->set_datatype("FP32");
  y->add_shape(batch);
  y->add_shape(n);
  y->add_shape(d_model);
  return response_->add_raw_output_contents();
}

void InferAnswer::Served(Variant served, const ServedTimings& timings, std::span<const FormDivergence> divergences) {
  auto& p = *response_->mutable_parameters();
  p["form"].set_string_param(std::string(FormName(served.form)));
  p["math"].set_string_param(std::string(MathName(served.math)));
  p["queue_us"].set_int64_param(timings.queue_us);
  p["compute_us"].set_int64_param(timings.compute_us);
  p["batch_requests"].set_int64_param(timings.batch_requests);
  p["decode_us"].set_int64_param(timings.decode_us);
  p["encode_us"].set_int64_param(timings.encode_us);
  for (const FormDivergence& d : divergences) {
    const std::string prefix = "divergence." + std::string(FormName(d.form));
    p[prefix + ".max_abs"].set_double_param(d.stats.max_abs);
    p[prefix + ".rel_l2"].set_double_param(d.stats.rel_l2);
  }
}

}  // namespace attnserve
