// Checks a Forward request against its layer and turns its tensors into an AttentionRequest
// (server/core/request.h), and checks the output computed for it, with errors that name the
// field, what was expected and what came (docs/service.md). Works on a plain view of the wire
// message, so it is tested without protobuf or gRPC; service.cc fills the view from the proto.
// Thread-safety: stateless functions; a decoded request is owned by one call.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/request.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

// The numbers of attnserve.v1.DataType and attnserve.v1.Form (service.cc checks they match). A
// form's own wire value is its row's in the form table (server/core/form_table.h).
enum class WireDtype : int { kUnspecified = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };
enum class WireForm : int { kUnspecified = 0 };

// "FLOAT32", "FLOAT16", ... or the number when it is no DataType.
std::string WireDtypeName(int dtype);
int64_t WireDtypeSize(int dtype);  // 0 when not a supported dtype

std::optional<Form> FormFromWire(int wire_form);  // nullopt for UNSPECIFIED and unknown values
int FormToWire(Form form);

// A wire Tensor, viewed: `data` points into the request message, which outlives the request.
struct WireTensor {
  bool present = false;  // a message field was set (context is optional)
  int dtype = 0;
  std::span<const int64_t> shape;
  std::string_view data;
};

// One inference request as either protocol carries it (attnserve.v1 Forward: wire_request.h;
// the Open Inference Protocol's ModelInfer: inference_request.h). Every call runs the same
// admission, decoding and compute on it (ForwardPipeline::Start, forward_pipeline.h).
struct WireForwardRequest {
  std::string_view layer;
  int form = 0;
  WireTensor input;
  WireTensor context;
  bool causal = false;
  std::span<const int32_t> key_lengths;
  int64_t position_offset = 0;
  std::string_view request_key;  // sticky routing; empty: none
  bool compare = false;          // also run the other held forms, report divergence
  std::string_view math;         // the math asked for ("bf16"); empty: the route's, or the default
  // Bytes of the request the protocol's response repeats (the OIP echoes the id and the model
  // name): counted with the output against the largest response gRPC will send.
  int64_t echoed_bytes = 0;
  // What errors call the tensors: the protocol's own names ("input" in attnserve.v1, "x" in the
  // Open Inference Protocol), so that a message names what the client sent.
  std::string_view input_field = "input";
  std::string_view context_field = "context";
  std::string_view key_lengths_field = "key_lengths";
};

// INVALID_ARGUMENT when `wire_form` is no attnserve.v1.Form value (FORM_AUTO is one).
Status CheckWireForm(int wire_form);

// The form that serves a request: the requested one, or the default when unspecified.
// INVALID_ARGUMENT for a value that is no Form; FAILED_PRECONDITION when the layer does not
// hold the form. The one place where the server picks a form (routing replaces it later).
// FORM_AUTO is no form: the call path resolves it first (forward_pipeline.cc); here it is an
// INVALID_ARGUMENT.
StatusOr<Form> ChooseForm(int wire_form, const Layer& layer);

// The math a request named: nullopt when it named none. INVALID_ARGUMENT for a name that is no
// math; FAILED_PRECONDITION, listing the layer's maths, for one the layer is not held in.
StatusOr<std::optional<Math>> ChooseMath(std::string_view wire_math, const Layer& layer);

// Checks dtype, rank 3, every dim >= 1 (the product checked for overflow before anything is
// allocated), d_model, byte length (= product × dtype size) and finiteness; converts FLOAT16
// and BFLOAT16 to float32. `batch`: the batch the tensor must have, when known. The result
// views the wire bytes when they are float32 and aligned (no copy), else owns a converted copy.
StatusOr<RequestTensor> DecodeTensor(std::string_view field, const WireTensor& wire, int64_t d_model,
                                     std::optional<int64_t> batch = std::nullopt);

// What DecodeForward returns: the request's tensors, checked against its layer. Its tensors may
// view the wire message; a copy of it owns everything (the shadow keeps one).
using DecodedForward = AttentionRequest;

// Bounds on what one request may make the server compute, beyond the message size.
struct ForwardLimits {
  // The attention scores of the whole request, Σ over its sequences of n · m · heads: its work.
  // A message well under the size limit can still ask for [n, n] scores per head that take
  // minutes to compute (memory is not the issue: the backends tile the attention).
  int64_t max_request_scores = int64_t{4096} * 1000000;
};

// RESOURCE_EXHAUSTED when a sequence exceeds `limits` (the message names the flag to raise).
StatusOr<DecodedForward> DecodeForward(const LayerConfig& config, const WireForwardRequest& request,
                                       const ForwardLimits& limits = {});

// OUT_OF_RANGE when `output`, the [batch, n, d_model] answer `form` computed for `request`, holds
// a NaN or an infinity: DecodeForward refused non-finite inputs, so float32 overflowed in the
// computation (inputs near its limit overflow the projections), and no float32 answer is right.
// The message names the first such element, the form and the inputs' largest magnitude.
Status CheckOutputFinite(const AttentionRequest& request, Form form, std::span<const float> output);

}  // namespace attnserve
