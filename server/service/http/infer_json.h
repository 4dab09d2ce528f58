// The Open Inference Protocol's HTTP/REST bodies (KServe v2, with Triton's binary-data
// extension) as the gRPC protocol's messages, and back: an infer request's JSON (and binary
// tail) becomes the same inference::ModelInferRequest the gRPC service receives, so both
// protocols run one conversion (inference_request.h), one validation and one call path; the
// ModelInferResponse the call writes becomes JSON (and binary). Pure functions over bytes: no
// sockets, no threads, fuzzed on their own (tests/fuzz/http_infer_fuzz.cc).
// Thread-safety: stateless functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "inference/grpc_service.pb.h"
#include "server/core/status.h"

namespace attnserve {

// An infer request read from HTTP.
struct HttpInferRequest {
  // Every input as raw_input_contents (JSON `data` converted to little-endian bytes of its
  // datatype, binary data as sent); parameters as InferParameters of the JSON's own type.
  inference::ModelInferRequest request;
  // Whether `y` goes back as binary data: its requested output's parameters.binary_data, or,
  // with no outputs listed, the request's parameters.binary_data_output.
  bool binary_output = false;
};

// Reads one infer body. `header_length` is the Inference-Header-Content-Length header's value
// (nullopt: the whole body is JSON); `model` and `version` come from the URL. Every refusal is
// INVALID_ARGUMENT naming the JSON field (e.g. "inputs[0].shape"), what was expected and what
// came.
Status ParseInferRequest(std::string_view body, std::optional<std::string_view> header_length, std::string_view model,
                         std::string_view version, HttpInferRequest* out);

// An HTTP response body: JSON, or JSON followed by binary data (json_length then set: the
// Inference-Header-Content-Length header's value).
struct HttpBody {
  std::string bytes;
  std::optional<size_t> json_length;
};

// The JSON (and binary) of a served call's response: outputs with `data` as a flat list, or with
// parameters.binary_data_size and the bytes after the JSON when `binary_output`.
HttpBody WriteInferResponse(const inference::ModelInferResponse& response, bool binary_output);

// {"name", "versions", "platform", "inputs", "outputs"}: the same content as the gRPC answer.
std::string ModelMetadataJson(const inference::ModelMetadataResponse& metadata);

// {"error": message}, as KServe answers a refusal.
std::string ErrorJson(std::string_view message);

// The HTTP status KServe and Triton give a refusal of this code.
int HttpStatusOf(StatusCode code);

// IEEE half and bfloat16 from float, rounded to nearest, ties to even (JSON's numbers for FP16
// and BF16 inputs).
uint16_t FloatToHalf(float value);
uint16_t FloatToBFloat16(float value);

}  // namespace attnserve
