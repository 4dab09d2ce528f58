// libFuzzer target: bytes → an HTTP/REST infer body of the Open Inference Protocol → what
// HttpService (server/service/http/http_service.cc) does with it: ParseInferRequest
// (server/service/http/infer_json.h: JSON, nested data, the binary-data extension), then the
// gRPC protocol's conversion (ConvertInferRequest), ChooseForm and DecodeForward over
// forward_request's fixed layer, then the CPU backend on what was accepted. The first byte
// picks the Inference-Header-Content-Length: 0 none (all JSON), else that many bytes of JSON
// less one, modulo the body's length. Nothing may crash; a request every step accepts must run
// on every held form.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/service/http/infer_json.h"
#include "server/service/inference_request.h"
#include "server/service/validation.h"
#include "server/store/layer_store.h"
#include "tests/fuzz/request_fuzz_layer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  // Never destroyed: no exit-time ordering.
  static fuzz::RequestFuzzLayer* const fixture = new fuzz::RequestFuzzLayer("http_infer");
  const Layer& layer = *fixture->layer;
  if (size == 0) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::optional<std::string> header;
  if (data[0] != 0) header = std::to_string(body.empty() ? 0 : (data[0] - 1u) % (body.size() + 1));

  HttpInferRequest parsed;
  if (!ParseInferRequest(body, header ? std::optional<std::string_view>(*header) : std::nullopt, "fuzz", "", &parsed)
           .ok()) {
    return 0;
  }
  InferForwardRequest converted;
  ConvertInferRequest(parsed.request, &converted);
  if (!converted.refused.ok()) return 0;
  StatusOr<Form> form = ChooseForm(converted.wire.form, layer);
  if (!form.ok()) return 0;
  auto decoded =
      DecodeForward(layer.config, converted.wire, ForwardLimits{.max_request_scores = fuzz::kMaxRequestScores});
  if (!decoded.ok()) return 0;

  std::vector<float> output(decoded->output_elements());
  const std::vector<Sequence> sequences = decoded->Sequences(output.data());
  for (const auto& [f, resident] : layer.forms) {
    const Status status = fixture->backend.Forward(*resident, sequences);
    if (!status.ok()) {
      std::fprintf(stderr, "http_infer fuzz: every step accepted a request the %s form refused: %s\n",
                   std::string(FormName(f)).c_str(), status.ToString().c_str());
      std::abort();
    }
  }
  return 0;
}
