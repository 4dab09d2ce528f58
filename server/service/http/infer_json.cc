#include "server/service/http/infer_json.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using nlohmann::json;

// Deeper `data` nesting than any tensor attnserve takes (rank 3) by far; beyond it a body is
// refused rather than recursed into.
constexpr int kMaxDataDepth = 16;
// More elements than any message the server takes could carry (the shape's product is checked
// against the data before anything is allocated for it).
constexpr uint64_t kMaxElements = uint64_t{1} << 40;

std::string TypeOf(const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "an array";
    case json::value_t::string:
      return "a string";
    case json::value_t::boolean:
      return "a bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number with a fraction";
    default:
      return "a value of another kind";
  }
}

// A short, safe rendering of what came, for messages.
std::string Shown(const json& j) {
  std::string text = j.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  if (text.size() > 64) text = text.substr(0, 61) + "...";
  return text;
}

Status Wrong(const std::string& field, std::string_view expected, const json& got) {
  return InvalidArgumentError(field + ": expected " + std::string(expected) + ", got " + TypeOf(got) +
                              (got.is_primitive() && !got.is_null() ? " " + Shown(got) : ""));
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status ReadParameters(const json& j, const std::string& field,
                      google::protobuf::Map<std::string, InferParameter>* out) {
  if (!j.is_object()) return Wrong(field, "an object of name: value", j);
  for (const auto& [name, value] : j.items()) {
    InferParameter& p = (*out)[name];
    if (value.is_boolean()) {
      p.set_bool_param(value.get<bool>());
    } else if (value.is_number_integer() && value.is_number_unsigned()) {
      const uint64_t v = value.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        p.set_uint64_param(v);
      } else {
        p.set_int64_param(static_cast<int64_t>(v));
      }
    } else if (value.is_number_integer()) {
      p.set_int64_param(value.get<int64_t>());
    } else if (value.is_number_float()) {
      p.set_double_param(value.get<double>());
    } else if (value.is_string()) {
      p.set_string_param(value.get<std::string>());
    } else {
      return Wrong(field + "['" + name + "']", "a bool, a number or a string", value);
    }
  }
  return OkStatus();
}

// Appends the numbers of `data` (a number, or arrays of them nested to any depth up to the
// limit) to `values`, refusing anything else by its place.
Status Flatten(const json& data, const std::string& field, int depth, uint64_t limit, std::vector<double>* values) {
  if (data.is_number()) {
    if (values->size() >= limit) {
      return InvalidArgumentError(field + ": expected " + std::to_string(limit) + " values (the shape's), got more");
    }
    values->push_back(data.get<double>());
    return OkStatus();
  }
  if (!data.is_array()) return Wrong(field, "a number or an array of numbers", data);
  if (depth >= kMaxDataDepth) {
    return InvalidArgumentError(field + ": expected arrays nested at most " + std::to_string(kMaxDataDepth) +
                                " deep, got deeper");
  }
  for (size_t i = 0; i < data.size(); ++i) {
    ATTNSERVE_RETURN_IF_ERROR(Flatten(data[i], field, depth + 1, limit, values));
  }
  return OkStatus();
}

template <typename T>
void Append(std::string* bytes, T value) {
  char b[sizeof(T)];
  std::memcpy(b, &value, sizeof(T));
  bytes->append(b, sizeof(T));
}

// JSON numbers as the datatype's little-endian bytes.
Status ToBytes(const std::vector<double>& values, const std::string& datatype, const std::string& field,
               std::string* bytes) {
  if (datatype == "FP32") {
    bytes->reserve(values.size() * 4);
    for (double v : values) Append(bytes, static_cast<float>(v));
  } else if (datatype == "FP16" || datatype == "BF16") {
    bytes->reserve(values.size() * 2);
    const bool half = datatype == "FP16";
    for (double v : values) {
      const float f = static_cast<float>(v);
      Append(bytes, half ? FloatToHalf(f) : FloatToBFloat16(f));
    }
  } else if (datatype == "INT32") {
    bytes->reserve(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      const double v = values[i];
      if (!(v == std::floor(v) && v >= std::numeric_limits<int32_t>::min() &&
            v <= std::numeric_limits<int32_t>::max())) {
        return InvalidArgumentError(field + "[" + std::to_string(i) + "]: expected an INT32 integer, got " +
                                    json(v).dump());
      }
      Append(bytes, static_cast<int32_t>(v));
    }
  } else {
    return InvalidArgumentError(field + ": expected the datatype FP32, FP16, BF16 or INT32 for JSON data, got '" +
                                datatype + "'");
  }
  return OkStatus();
}

// One element of "inputs": its tensor added to `request`, its raw bytes from JSON or from the
// binary tail at *offset.
Status ReadInput(const json& in, size_t i, std::string_view binary, size_t* offset, ModelInferRequest* request) {
  const std::string field = "inputs[" + std::to_string(i) + "]";
  if (!in.is_object()) return Wrong(field, "an object with name, shape, datatype and data", in);
  auto* tensor = request->add_inputs();
  std::string* raw = request->add_raw_input_contents();

  auto name = in.find("name");
  if (name == in.end() || !name->is_string()) {
    return Wrong(field + ".name", "a string", name == in.end() ? json() : *name);
  }
  tensor->set_name(name->get<std::string>());
  auto datatype = in.find("datatype");
  if (datatype == in.end() || !datatype->is_string()) {
    return Wrong(field + ".datatype", "a string (FP32, FP16, BF16, INT32)", datatype == in.end() ? json() : *datatype);
  }
  tensor->set_datatype(datatype->get<std::string>());
  auto shape = in.find("shape");
  if (shape == in.end() || !shape->is_array()) {
    return Wrong(field + ".shape", "an array of dimensions", shape == in.end() ? json() : *shape);
  }
  std::vector<int64_t> dims;
  uint64_t elements = 1;
  for (size_t k = 0; k < shape->size(); ++k) {
    const json& d = (*shape)[k];
    if (!d.is_number_integer() || (!d.is_number_unsigned() && d.get<int64_t>() < 0)) {
      return Wrong(field + ".shape[" + std::to_string(k) + "]", "a non-negative integer", d);
    }
    const uint64_t v = d.get<uint64_t>();
    if (v > kMaxElements || (v != 0 && elements > kMaxElements / v)) {
      return InvalidArgumentError(field + ".shape: expected at most " + std::to_string(kMaxElements) +
                                  " elements, got a larger product");
    }
    elements *= v;
    dims.push_back(static_cast<int64_t>(v));
    tensor->add_shape(static_cast<int64_t>(v));
  }

  std::optional<uint64_t> binary_size;
  if (auto params = in.find("parameters"); params != in.end()) {
    if (!params->is_object()) return Wrong(field + ".parameters", "an object", *params);
    for (const auto& [key, value] : params->items()) {
      if (key == "binary_data_size") {
        if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0)) {
          return Wrong(field + ".parameters.binary_data_size", "a non-negative integer (bytes)", value);
        }
        binary_size = value.get<uint64_t>();
      }
      // Any other input parameter is not ours to refuse (Triton ignores what it does not use).
    }
  }
  auto data = in.find("data");
  if (binary_size) {
    if (data != in.end()) {
      return InvalidArgumentError(field + ": expected either data or parameters.binary_data_size, got both");
    }
    const size_t left = binary.size() - *offset;
    if (*binary_size > left) {
      return InvalidArgumentError(field + ".parameters.binary_data_size: expected at most the " + std::to_string(left) +
                                  " bytes left after the JSON header, got " + std::to_string(*binary_size));
    }
    raw->assign(binary.substr(*offset, *binary_size));
    *offset += *binary_size;
    return OkStatus();
  }
  if (data == in.end()) {
    return InvalidArgumentError(field + ".data: expected the tensor's " + std::to_string(elements) +
                                " values (or parameters.binary_data_size), got none");
  }
  std::vector<double> values;
  ATTNSERVE_RETURN_IF_ERROR(Flatten(*data, field + ".data", 0, elements, &values));
  if (values.size() != elements) {
    return InvalidArgumentError(field + ".data: expected " + std::to_string(elements) + " values (shape " +
                                ShapeText(dims) + "), got " + std::to_string(values.size()));
  }
  return ToBytes(values, tensor->datatype(), field + ".data", raw);
}

Status ReadBody(const json& j, std::string_view binary, HttpInferRequest* out) {
  ModelInferRequest& request = out->request;
  if (!j.is_object()) return Wrong("body", "a JSON object", j);
  if (auto id = j.find("id"); id != j.end()) {
    if (!id->is_string()) return Wrong("id", "a string", *id);
    request.set_id(id->get<std::string>());
  }
  if (auto params = j.find("parameters"); params != j.end()) {
    ATTNSERVE_RETURN_IF_ERROR(ReadParameters(*params, "parameters", request.mutable_parameters()));
  }
  auto inputs = j.find("inputs");
  if (inputs == j.end() || !inputs->is_array()) {
    return Wrong("inputs", "an array of input tensors", inputs == j.end() ? json() : *inputs);
  }
  size_t offset = 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    ATTNSERVE_RETURN_IF_ERROR(ReadInput((*inputs)[i], i, binary, &offset, &request));
  }
  if (offset != binary.size()) {
    return InvalidArgumentError("body: expected " + std::to_string(offset) +
                                " bytes of binary data after the JSON header (the inputs' binary_data_size), got " +
                                std::to_string(binary.size()));
  }
  bool any_output = false;
  if (auto outputs = j.find("outputs"); outputs != j.end()) {
    if (!outputs->is_array()) return Wrong("outputs", "an array of requested outputs", *outputs);
    for (size_t i = 0; i < outputs->size(); ++i) {
      const json& o = (*outputs)[i];
      const std::string field = "outputs[" + std::to_string(i) + "]";
      if (!o.is_object()) return Wrong(field, "an object with a name", o);
      auto name = o.find("name");
      if (name == o.end() || !name->is_string())
        return Wrong(field + ".name", "a string", name == o.end() ? json() : *name);
      request.add_outputs()->set_name(name->get<std::string>());
      any_output = true;
      if (auto params = o.find("parameters"); params != o.end()) {
        if (!params->is_object()) return Wrong(field + ".parameters", "an object", *params);
        if (auto b = params->find("binary_data"); b != params->end()) {
          if (!b->is_boolean()) return Wrong(field + ".parameters.binary_data", "a bool", *b);
          out->binary_output = out->binary_output || b->get<bool>();
        }
      }
    }
  }
  if (!any_output) {
    const auto& p = request.parameters();
    if (auto it = p.find("binary_data_output"); it != p.end()) {
      if (it->second.parameter_choice_case() != InferParameter::kBoolParam) {
        return InvalidArgumentError("parameters['binary_data_output']: expected a bool");
      }
      out->binary_output = it->second.bool_param();
    }
  }
  return OkStatus();
}

json ParameterJson(const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return p.bool_param();
    case InferParameter::kInt64Param:
      return p.int64_param();
    case InferParameter::kUint64Param:
      return p.uint64_param();
    case InferParameter::kDoubleParam:
      return p.double_param();
    case InferParameter::kStringParam:
      return p.string_param();
    default:
      return nullptr;
  }
}

json TensorMetadataJson(const inference::ModelMetadataResponse::TensorMetadata& t) {
  return json{{"name", t.name()},
              {"datatype", t.datatype()},
              {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}};
}

}  // namespace

Status ParseInferRequest(std::string_view body, std::optional<std::string_view> header_length, std::string_view model,
                         std::string_view version, HttpInferRequest* out) {
  out->request.set_model_name(std::string(model));
  out->request.set_model_version(std::string(version));
  std::string_view text = body;
  std::string_view binary;
  if (header_length) {
    size_t length = 0;
    const auto [end, ec] =
        std::from_chars(header_length->data(), header_length->data() + header_length->size(), length);
    if (header_length->empty() || ec != std::errc() || end != header_length->data() + header_length->size()) {
      return InvalidArgumentError("Inference-Header-Content-Length: expected the JSON header's length in bytes, got '" +
                                  std::string(header_length->substr(0, 32)) + "'");
    }
    if (length > body.size()) {
      return InvalidArgumentError("Inference-Header-Content-Length: expected at most the body's " +
                                  std::to_string(body.size()) + " bytes, got " + std::to_string(length));
    }
    text = body.substr(0, length);
    binary = body.substr(length);
  }
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return InvalidArgumentError(std::string(header_length ? "the JSON header" : "body") +
                                ": expected a JSON object, got text that is not JSON");
  }
  try {
    return ReadBody(j, binary, out);
  } catch (const json::exception& e) {
    // Every access above checks its type first; this is a last defence, not a path.
    return InvalidArgumentError(std::string("body: ") + e.what());
  }
}

HttpBody WriteInferResponse(const inference::ModelInferResponse& response, bool binary_output) {
  json j = {{"model_name", response.model_name()}, {"model_version", response.model_version()}};
  if (!response.id().empty()) j["id"] = response.id();
  json params = json::object();
  for (const auto& [name, p] : response.parameters()) params[name] = ParameterJson(p);
  j["parameters"] = std::move(params);
  json outputs = json::array();
  std::string binary;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& t = response.outputs(i);
    json o = {{"name", t.name()},
              {"datatype", t.datatype()},
              {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}};
    const std::string& raw = i < response.raw_output_contents_size() ? response.raw_output_contents(i) : std::string();
    if (binary_output) {
      o["parameters"] = {{"binary_data_size", raw.size()}};
      binary += raw;
    } else {
      // FP32, the one datatype attnserve answers in; printed to round-trip each float exactly.
      std::vector<float> values(raw.size() / sizeof(float));
      if (!values.empty()) std::memcpy(values.data(), raw.data(), values.size() * sizeof(float));
      o["data"] = std::move(values);
    }
    outputs.push_back(std::move(o));
  }
  j["outputs"] = std::move(outputs);
  HttpBody body;
  body.bytes = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (binary_output) {
    body.json_length = body.bytes.size();
    body.bytes += binary;
  }
  return body;
}

std::string ModelMetadataJson(const inference::ModelMetadataResponse& m) {
  json inputs = json::array(), outputs = json::array();
  for (const auto& t : m.inputs()) inputs.push_back(TensorMetadataJson(t));
  for (const auto& t : m.outputs()) outputs.push_back(TensorMetadataJson(t));
  const json j = {{"name", m.name()},
                  {"versions", std::vector<std::string>(m.versions().begin(), m.versions().end())},
                  {"platform", m.platform()},
                  {"inputs", std::move(inputs)},
                  {"outputs", std::move(outputs)}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ErrorJson(std::string_view message) {
  return json{{"error", std::string(message)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

int HttpStatusOf(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
      return 400;
    case StatusCode::kUnauthenticated:
      return 401;
    case StatusCode::kPermissionDenied:
      return 403;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
      return 429;
    case StatusCode::kUnimplemented:
      return 501;
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

uint16_t FloatToHalf(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  // 65520 and above round to infinity (65504 is the largest half; ties go to even, which is up).
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    // Below 2^-14: a subnormal half, in units of 2^-24; scaling by 2^24 is exact, nearbyint
    // rounds ties to even. 1024 units is the smallest normal, which is also its encoding.
    float magnitude;
    std::memcpy(&magnitude, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  uint32_t h = (((abs >> 23) - 112) << 10) | ((abs & 0x7fffffu) >> 13);
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

uint16_t FloatToBFloat16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // a quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace attnserve
