#include "server/service/inference_request.h"

#include <cstring>
#include <string>

#include "server/core/form_table.h"
#include "server/core/forms.h"

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;

std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::string s = "[";
  for (int i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string_view ParameterKind(const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return "a bool";
    case InferParameter::kInt64Param:
      return "an int64";
    case InferParameter::kStringParam:
      return "a string";
    case InferParameter::kDoubleParam:
      return "a double";
    case InferParameter::kUint64Param:
      return "a uint64";
    default:
      return "no value";
  }
}

Status WrongParameterKind(const std::string& name, std::string_view expected, const InferParameter& p) {
  return InvalidArgumentError("parameters['" + name + "']: expected " + std::string(expected) + ", got " +
                              std::string(ParameterKind(p)));
}

// The request options attnserve.v1 has as fields; every other parameter is ignored.
Status ConvertParameters(const ModelInferRequest& request, WireForwardRequest* wire) {
  for (const auto& [name, p] : request.parameters()) {
    if (name == "form") {
      if (p.parameter_choice_case() != InferParameter::kStringParam) return WrongParameterKind(name, "a string", p);
      const std::optional<Form> form = ParseForm(p.string_param());
      if (p.string_param() == kAutoChoice.name) {
        wire->form = kAutoChoice.wire;
        continue;
      }
      if (!form) {
        return InvalidArgumentError("parameters['form']: expected 'factored', 'summed', 'lowrank' or 'auto', got " +
                                    QuoteUntrusted(p.string_param()));
      }
      wire->form = static_cast<int>(FormToWire(*form));
    } else if (name == "causal") {
      if (p.parameter_choice_case() != InferParameter::kBoolParam) return WrongParameterKind(name, "a bool", p);
      wire->causal = p.bool_param();
    } else if (name == "compare") {
      if (p.parameter_choice_case() != InferParameter::kBoolParam) return WrongParameterKind(name, "a bool", p);
      wire->compare = p.bool_param();
    } else if (name == "position_offset") {
      if (p.parameter_choice_case() != InferParameter::kInt64Param) return WrongParameterKind(name, "an int64", p);
      wire->position_offset = p.int64_param();  // its range is DecodeForward's to check
    } else if (name == "math") {
      if (p.parameter_choice_case() != InferParameter::kStringParam) return WrongParameterKind(name, "a string", p);
      wire->math = p.string_param();  // ChooseMath checks it against the layer
    } else if (name == "request_key") {
      if (p.parameter_choice_case() != InferParameter::kStringParam) return WrongParameterKind(name, "a string", p);
      wire->request_key = p.string_param();
    }
    // Anything else (Triton's triton_*, sequence_id, priority, timeout, binary_data_output,
    // headers, or a client's own) is not ours to refuse: Triton ignores what it does not use too.
  }
  return OkStatus();
}

// FP32, FP16 and BF16 have attnserve.v1's dtypes; other datatypes get 0, which is none.
int WireDtypeOf(const std::string& datatype) {
  if (datatype == "FP32") return static_cast<int>(WireDtype::kFloat32);
  if (datatype == "FP16") return static_cast<int>(WireDtype::kFloat16);
  if (datatype == "BF16") return static_cast<int>(WireDtype::kBFloat16);
  return 0;
}

bool HasTypedContents(const inference::InferTensorContents& c) {
  return c.bool_contents_size() || c.int_contents_size() || c.int64_contents_size() || c.uint_contents_size() ||
         c.uint64_contents_size() || c.fp32_contents_size() || c.fp64_contents_size() || c.bytes_contents_size();
}

Status ConvertInputs(const ModelInferRequest& request, InferForwardRequest* out) {
  WireForwardRequest& wire = out->wire;
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return InvalidArgumentError("raw_input_contents: expected one entry per input (" +
                                std::to_string(request.inputs_size()) + "), got " +
                                std::to_string(request.raw_input_contents_size()));
  }
  bool seen_key_lengths = false;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const ModelInferRequest::InferInputTensor& input = request.inputs(i);
    const std::string& name = input.name();
    if (raw && input.has_contents() && HasTypedContents(input.contents())) {
      // Triton refuses the mix as well: which of the two would be the input's values?
      return InvalidArgumentError("inputs[" + std::to_string(i) + "] (" + QuoteUntrusted(name) +
                                  ").contents: expected no typed contents in a request that sends "
                                  "raw_input_contents, got both (send every input one way)");
    }
    if (name == kInferInputX || name == kInferInputContext) {
      WireTensor& t = name == kInferInputX ? wire.input : wire.context;
      if (t.present) return InvalidArgumentError("inputs: expected '" + name + "' once, got it twice");
      t.present = true;
      t.dtype = WireDtypeOf(input.datatype());
      if (t.dtype == 0) {
        return InvalidArgumentError(name + ".datatype: expected FP32, FP16 or BF16, got " +
                                    QuoteUntrusted(input.datatype()));
      }
      t.shape = std::span<const int64_t>(input.shape().data(), input.shape().size());
      if (raw) {
        t.data = request.raw_input_contents(i);
      } else if (t.dtype == static_cast<int>(WireDtype::kFloat32)) {
        // The repeated floats are contiguous little-endian float32 in the message: viewed, not
        // copied. Their count is checked against the shape by DecodeTensor, as raw bytes are.
        const auto& values = input.contents().fp32_contents();
        t.data = std::string_view(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
      } else {
        return InvalidArgumentError(name + ": expected " + input.datatype() +
                                    " values in raw_input_contents (the protocol has no typed field for " +
                                    input.datatype() + "), got typed contents");
      }
    } else if (name == kInferInputKeyLengths) {
      if (seen_key_lengths) return InvalidArgumentError("inputs: expected 'key_lengths' once, got it twice");
      seen_key_lengths = true;
      if (input.datatype() != "INT32") {
        return InvalidArgumentError("key_lengths.datatype: expected INT32, got " + QuoteUntrusted(input.datatype()));
      }
      // One per batch row: [batch], or [batch, 1] as Triton's per-row scalars are shaped.
      const auto& shape = input.shape();
      if (!(shape.size() == 1 || (shape.size() == 2 && shape[1] == 1))) {
        return InvalidArgumentError("key_lengths.shape: expected [batch] or [batch, 1], got " + ShapeText(shape));
      }
      const int64_t count = shape[0];
      if (count < 1) {
        // attnserve.v1 cannot say "key_lengths, but none": an empty list there means absent.
        return InvalidArgumentError("key_lengths.shape[0]: expected the batch (>= 1), got " + std::to_string(count));
      }
      if (raw) {
        const std::string& bytes = request.raw_input_contents(i);
        // Compared by division: a hostile count times 4 could wrap to the byte count.
        if (bytes.size() % 4 != 0 || static_cast<int64_t>(bytes.size() / 4) != count) {
          return InvalidArgumentError("key_lengths: expected " + std::to_string(count) + " 4-byte INT32 values (" +
                                      ShapeText(shape) + "), got " + std::to_string(bytes.size()) + " bytes");
        }
        out->key_lengths.resize(count);
        std::memcpy(out->key_lengths.data(), bytes.data(), bytes.size());
      } else {
        const auto& values = input.contents().int_contents();
        if (values.size() != count) {
          return InvalidArgumentError("key_lengths: expected " + std::to_string(count) + " int_contents (" +
                                      ShapeText(shape) + "), got " + std::to_string(values.size()));
        }
        out->key_lengths.assign(values.begin(), values.end());
      }
      // DecodeForward checks the count against the batch and each length against m.
      wire.key_lengths = out->key_lengths;
    } else {
      return InvalidArgumentError("inputs[" + std::to_string(i) +
                                  "].name: expected 'x', 'context' or 'key_lengths', got " + QuoteUntrusted(name));
    }
  }
  return OkStatus();
}

}  // namespace

void ConvertInferRequest(const ModelInferRequest& request, InferForwardRequest* out) {
  WireForwardRequest& wire = out->wire;
  wire.layer = request.model_name();
  wire.input_field = kInferInputX;
  wire.context_field = kInferInputContext;
  wire.key_lengths_field = kInferInputKeyLengths;
  // Sticky routing on the request id unless a request_key parameter says otherwise.
  wire.request_key = request.id();
  // The response repeats both; its parameters and output metadata fit in the framing allowance.
  wire.echoed_bytes = static_cast<int64_t>(request.id().size() + request.model_name().size());
  out->refused = [&]() -> Status {
    if (!request.model_version().empty() && request.model_version() != kInferModelVersion) {
      return NotFoundError("model_version: expected \"1\" or empty (every layer is version 1), got " +
                           QuoteUntrusted(request.model_version()));
    }
    ATTNSERVE_RETURN_IF_ERROR(ConvertParameters(request, &wire));
    ATTNSERVE_RETURN_IF_ERROR(ConvertInputs(request, out));
    for (int i = 0; i < request.outputs_size(); ++i) {
      if (request.outputs(i).name() != kInferOutputY) {
        return InvalidArgumentError("outputs[" + std::to_string(i) + "].name: expected 'y', got " +
                                    QuoteUntrusted(request.outputs(i).name()));
      }
    }
    return OkStatus();
  }();
}

}  // namespace attnserve
