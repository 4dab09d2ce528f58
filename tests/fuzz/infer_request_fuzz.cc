// libFuzzer target: bytes → the Open Inference Protocol's inference.ModelInferRequest → what
// InferenceServiceImpl::ModelInfer (server/service/inference_service.cc) does with it: the
// protocol's conversion (ConvertInferRequest, server/service/inference_request.h), then the same
// ChooseForm and DecodeForward attnserve.v1's Forward runs, over forward_request's fixed layer,
// then the CPU backend on what was accepted. Nothing may crash; a request the conversion and
// DecodeForward accept must run on every held form (a refused one would fail its whole batch).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <google/protobuf/stubs/common.h>

#include "inference/grpc_service.pb.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/service/inference_request.h"
#include "server/service/validation.h"
#include "server/store/layer_store.h"
#include "tests/fuzz/request_fuzz_layer.h"

namespace {

using namespace attnserve;

using fuzz::kMaxRequestScores;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Never destroyed: no exit-time ordering.
  static fuzz::RequestFuzzLayer* const fixture = new fuzz::RequestFuzzLayer("infer_request");
  const Layer& layer = *fixture->layer;

  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;

  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  if (!converted.refused.ok()) return 0;

  StatusOr<Form> form = ChooseForm(converted.wire.form, layer);
  if (!form.ok()) return 0;
  auto decoded = DecodeForward(layer.config, converted.wire, ForwardLimits{.max_request_scores = kMaxRequestScores});
  if (!decoded.ok()) return 0;

  std::vector<float> output(decoded->output_elements());
  const std::vector<Sequence> sequences = decoded->Sequences(output.data());
  for (const auto& [f, resident] : layer.forms) {
    const Status status = fixture->backend.Forward(*resident, sequences);
    if (!status.ok()) {
      std::fprintf(stderr, "infer_request fuzz: the conversion and DecodeForward accepted a request the %s form "
                   "refused: %s\n", std::string(FormName(f)).c_str(), status.ToString().c_str());
      std::abort();
    }
  }
  return 0;
}
