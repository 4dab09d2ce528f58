// The Open Inference Protocol's ModelInferRequest (package inference, Triton's
// GRPCInferenceService) as validation.h's WireForwardRequest: the same view attnserve.v1's
// Forward makes (wire_request.h), so both protocols run one validation and one call path
// (ForwardPipeline::Start, forward_pipeline.h). Only what is the protocol's own is checked here: input
// and output names, datatypes, raw versus typed contents, parameter types. Shapes, byte counts,
// values and options are DecodeForward's. Needs the generated messages, nothing of gRPC.
// Thread-safety: a pure function; the views live as long as the message (and `out`).
#pragma once

#include <cstdint>
#include <vector>

#include "inference/grpc_service.pb.h"
#include "server/core/status.h"
#include "server/service/validation.h"

namespace attnserve {

// The names a layer's inputs and output have as a model (docs/service.md).
inline constexpr char kInferInputX[] = "x";
inline constexpr char kInferInputContext[] = "context";
inline constexpr char kInferInputKeyLengths[] = "key_lengths";
inline constexpr char kInferOutputY[] = "y";
// Every layer is one model of this one version.
inline constexpr char kInferModelVersion[] = "1";

struct InferForwardRequest {
  WireForwardRequest wire;
  // key_lengths sent as raw bytes, copied (they need not be aligned for int32); `wire` views it.
  std::vector<int32_t> key_lengths;
  // The protocol's own refusal (INVALID_ARGUMENT naming the input or parameter, what was
  // expected and what came; NOT_FOUND for a version other than "1"); OK when converted.
  Status refused;

  InferForwardRequest() = default;
  InferForwardRequest(const InferForwardRequest&) = delete;  // `wire` views `key_lengths`
  InferForwardRequest& operator=(const InferForwardRequest&) = delete;
};

// Fills `out` from `request`. Parameters: form (string), causal (bool), position_offset (int),
// request_key (string; the request id when absent), compare (bool); any other name, among them
// Triton's own (triton_*, sequence_id, priority, timeout, binary_data_output, headers), is
// ignored. Inputs come as raw_input_contents (one per input, in order) or typed contents, never
// both in one request.
void ConvertInferRequest(const inference::ModelInferRequest& request, InferForwardRequest* out);

}  // namespace attnserve
