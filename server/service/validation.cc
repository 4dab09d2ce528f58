#include "server/service/validation.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "server/core/form_table.h"
#include "server/store/safetensors.h"  // HalfToFloat, BFloat16ToFloat: one conversion for files and wire

namespace attnserve {
namespace {

// The wire is little-endian; a view of its bytes as floats is only right on such a host.
static_assert(std::endian::native == std::endian::little, "attnserve reads wire tensors in place: little-endian only");

std::string ShapeOf(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string Str(std::string_view v) { return std::string(v); }

// The index of the first value that is an infinity or NaN, or values.size(). Every request's
// input and output is scanned: blocks are checked without branches (a float is not finite when
// its exponent bits are all ones), a loop GCC vectorizes, and only a block holding one is
// scanned again for where. A scan of 12288 floats (a 1×16×768 request) took 4.5–6.5 µs as a
// loop of std::isfinite that stops at the first, 0.6–1.8 µs so (docs/journal/benchmarks-journal.md, "Serving
// overhead").
size_t FirstNonFinite(std::span<const float> values) {
  constexpr size_t kBlock = 256;
  for (size_t start = 0; start < values.size(); start += kBlock) {
    const size_t end = std::min(values.size(), start + kBlock);
    uint32_t any = 0;
    for (size_t i = start; i < end; ++i) {
      any |= static_cast<uint32_t>((std::bit_cast<uint32_t>(values[i]) & 0x7f800000u) == 0x7f800000u);
    }
    if (any == 0) continue;
    for (size_t i = start; i < end; ++i) {
      if (!std::isfinite(values[i])) return i;
    }
  }
  return values.size();
}

}  // namespace

std::string WireDtypeName(int dtype) {
  switch (static_cast<WireDtype>(dtype)) {
    case WireDtype::kUnspecified:
      return "DATA_TYPE_UNSPECIFIED";
    case WireDtype::kFloat32:
      return "FLOAT32";
    case WireDtype::kFloat16:
      return "FLOAT16";
    case WireDtype::kBFloat16:
      return "BFLOAT16";
  }
  return std::to_string(dtype);
}

int64_t WireDtypeSize(int dtype) {
  switch (static_cast<WireDtype>(dtype)) {
    case WireDtype::kFloat32:
      return 4;
    case WireDtype::kFloat16:
    case WireDtype::kBFloat16:
      return 2;
    case WireDtype::kUnspecified:
      break;
  }
  return 0;
}

std::optional<Form> FormFromWire(int wire_form) {
  const FormDef* def = DefOfWire(wire_form);
  if (def == nullptr) return std::nullopt;
  return def->form;
}

int FormToWire(Form form) { return DefOf(form).wire; }

Status CheckWireForm(int wire_form) {
  if (wire_form == static_cast<int>(WireForm::kUnspecified) || wire_form == kAutoChoice.wire ||
      FormFromWire(wire_form)) {
    return OkStatus();
  }
  return InvalidArgumentError("form: expected FORM_UNSPECIFIED, " + WireChoiceNames() + ", got " +
                              std::to_string(wire_form));
}

StatusOr<std::optional<Math>> ChooseMath(std::string_view wire_math, const Layer& layer) {
  if (wire_math.empty()) return std::optional<Math>();
  const std::optional<Math> math = ParseMath(wire_math);
  if (!math) {
    return InvalidArgumentError("math: expected " + Str(kMathChoices) + " (or nothing), got " + QuoteUntrusted(wire_math));
  }
  if (!layer.HoldsMath(*math)) {
    std::string held;
    for (Math m : layer.maths.empty() ? std::vector<Math>{layer.default_math()} : layer.maths) {
      held += (held.empty() ? "" : ", ") + Str(MathName(m));
    }
    return FailedPreconditionError("math: layer '" + layer.name + "' is held in " + held + " (--extra-maths), got " +
                                   Str(MathName(*math)));
  }
  return math;
}

StatusOr<Form> ChooseForm(int wire_form, const Layer& layer) {
  ATTNSERVE_RETURN_IF_ERROR(CheckWireForm(wire_form));
  if (wire_form == kAutoChoice.wire) {
    return InvalidArgumentError("form: expected a form, got FORM_AUTO, which the call path resolves by cost first");
  }
  // FORM_UNSPECIFIED: the factored form until routing decides (docs/metrics.md, "Routing").
  const Form form = FormFromWire(wire_form).value_or(Form::kFactored);
  if (layer.Find(form) == nullptr && form == Form::kLowRank && layer.live_calibration != nullptr) {
    const LiveCalibration& live = *layer.live_calibration;
    const Status failure = live.failure();
    if (!failure.ok()) {
      return FailedPreconditionError("form: layer '" + layer.name + "' holds no low-rank form: its build from live " +
                                     "traffic failed (" + failure.message() + ")");
    }
    // Retryable: the form appears once enough traffic came (GetLayer shows how much).
    return UnavailableError("form: layer '" + layer.name + "' is gathering the calibration rows of its low-rank form (" +
                            layer.lowrank_selection + ") from live traffic: " + std::to_string(live.rows_seen()) +
                            " of " + std::to_string(live.rows_wanted()) + " rows so far; it serves the form once " +
                            "they are in and it is built");
  }
  if (layer.Find(form) == nullptr) {
    std::string held;
    for (const auto& [f, _] : layer.forms) held += (held.empty() ? "" : ", ") + Str(FormName(f));
    return FailedPreconditionError("form: layer '" + layer.name + "' does not hold the " + Str(FormName(form)) +
                                   " form (it holds: " + held + ")");
  }
  return form;
}

StatusOr<RequestTensor> DecodeTensor(std::string_view field, const WireTensor& wire, int64_t d_model,
                                     std::optional<int64_t> batch) {
  const std::string f(field);
  const int64_t elem_size = WireDtypeSize(wire.dtype);
  if (elem_size == 0) {
    return InvalidArgumentError(f + ".dtype: expected FLOAT32, FLOAT16 or BFLOAT16, got " + WireDtypeName(wire.dtype));
  }
  if (wire.shape.size() != 3) {
    return InvalidArgumentError(f + ".shape: expected rank 3 [batch, " + (f == "context" ? "m" : "n") +
                                ", d_model=" + std::to_string(d_model) + "], got " + ShapeOf(wire.shape) + " (rank " +
                                std::to_string(wire.shape.size()) + ")");
  }
  const char* const dim_names[] = {"batch", f == "context" ? "m" : "n", "d_model"};
  for (size_t i = 0; i < 3; ++i) {
    if (wire.shape[i] < 1) {
      return InvalidArgumentError(f + ".shape[" + std::to_string(i) + "] (" + dim_names[i] + "): expected >= 1, got " +
                                  std::to_string(wire.shape[i]));
    }
  }
  if (wire.shape[2] != d_model) {
    return InvalidArgumentError(f + ".shape[2] (d_model): expected " + std::to_string(d_model) +
                                " (the layer's), got " + std::to_string(wire.shape[2]));
  }
  if (batch && wire.shape[0] != *batch) {
    return InvalidArgumentError(f + ".shape[0] (batch): expected " + std::to_string(*batch) + " (input's batch), got " +
                                std::to_string(wire.shape[0]));
  }
  // The product is checked before anything is sized from it: a hostile shape cannot make us
  // allocate, and the byte length comparison below cannot be fooled by a wrapped product.
  int64_t elements = 0, bytes = 0;
  if (__builtin_mul_overflow(wire.shape[0], wire.shape[1], &elements) ||
      __builtin_mul_overflow(elements, wire.shape[2], &elements) ||
      __builtin_mul_overflow(elements, elem_size, &bytes)) {
    return InvalidArgumentError(f + ".shape: the element count of " + ShapeOf(wire.shape) + " overflows int64");
  }
  if (bytes != static_cast<int64_t>(wire.data.size())) {
    return InvalidArgumentError(f + ".data: expected " + std::to_string(bytes) + " bytes (" + ShapeOf(wire.shape) +
                                " x " + std::to_string(elem_size) + "-byte " + WireDtypeName(wire.dtype) + "), got " +
                                std::to_string(wire.data.size()));
  }

  const int64_t b = wire.shape[0], rows = wire.shape[1], cols = wire.shape[2];
  const char* raw = wire.data.data();
  RequestTensor out;
  if (static_cast<WireDtype>(wire.dtype) == WireDtype::kFloat32) {
    if (reinterpret_cast<uintptr_t>(raw) % alignof(float) == 0) {
      out = RequestTensor::View(reinterpret_cast<const float*>(raw), b, rows, cols);
    } else {
      // Protobuf's buffers are aligned in practice; copy rather than read misaligned floats.
      std::vector<float> copy(elements);
      std::memcpy(copy.data(), raw, bytes);
      out = RequestTensor::Own(std::move(copy), b, rows, cols);
    }
  } else {
    const bool half = static_cast<WireDtype>(wire.dtype) == WireDtype::kFloat16;
    std::vector<float> converted(elements);
    for (int64_t i = 0; i < elements; ++i) {
      uint16_t bits;
      std::memcpy(&bits, raw + 2 * i, 2);
      converted[i] = half ? HalfToFloat(bits) : BFloat16ToFloat(bits);
    }
    out = RequestTensor::Own(std::move(converted), b, rows, cols);
  }
  const float* values = out.data();
  const size_t bad = FirstNonFinite(std::span<const float>(values, elements));
  if (bad < static_cast<size_t>(elements)) {
    const int64_t i = static_cast<int64_t>(bad), row = i / out.cols, col = i % out.cols;
    return InvalidArgumentError(f + ".data: expected finite values, got " + std::to_string(values[i]) + " at [" +
                                std::to_string(row / out.rows) + ", " + std::to_string(row % out.rows) + ", " +
                                std::to_string(col) + "]");
  }
  return out;
}

StatusOr<DecodedForward> DecodeForward(const LayerConfig& config, const WireForwardRequest& request,
                                       const ForwardLimits& limits) {
  DecodedForward out;
  const std::string input_field(request.input_field), context_field(request.context_field),
      key_lengths_field(request.key_lengths_field);
  if (!request.input.present) {
    return InvalidArgumentError(input_field + ": expected a [batch, n, d_model=" + std::to_string(config.d_model) +
                                "] tensor, got none");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(out.input, DecodeTensor(input_field, request.input, config.d_model));
  if (request.context.present) {
    ATTNSERVE_ASSIGN_OR_RETURN(out.context,
                               DecodeTensor(context_field, request.context, config.d_model, out.input.batch));
  }
  // The input's size is bounded by the message limit, but its work grows with n · m: bound it
  // before anything is queued.
  {
    const int64_t batch = out.input.batch, n = out.input.rows;
    const int64_t m = out.context ? out.context->rows : n;
    int64_t scores = 0;
    const bool overflow = __builtin_mul_overflow(n, m, &scores) || __builtin_mul_overflow(scores, config.heads, &scores) ||
                          __builtin_mul_overflow(scores, batch, &scores);
    if (overflow || scores > limits.max_request_scores) {
      const double millions = static_cast<double>(batch) * static_cast<double>(n) * static_cast<double>(m) *
                              static_cast<double>(config.heads) / 1e6;
      return ResourceExhaustedError(
          input_field + ": " + std::to_string(batch) + " sequence(s) of n=" + std::to_string(n) + " queries over m=" +
          std::to_string(m) + " keys with " + std::to_string(config.heads) + " heads ask for " +
          std::to_string(static_cast<int64_t>(std::ceil(millions))) + " M attention scores; this server allows " +
          std::to_string(limits.max_request_scores / 1000000) +
          " M per request (--max-scores-m): send shorter sequences or fewer per request");
    }
  }
  out.causal = request.causal;
  if (request.position_offset < 0 || request.position_offset > kMaxPosition) {
    return InvalidArgumentError("position_offset: expected a value in [0, " + std::to_string(kMaxPosition) +
                                "], got " + std::to_string(request.position_offset));
  }
  out.position_offset = request.position_offset;
  if (!request.key_lengths.empty()) {
    const int64_t m = out.context ? out.context->rows : out.input.rows;
    if (static_cast<int64_t>(request.key_lengths.size()) != out.input.batch) {
      return InvalidArgumentError(key_lengths_field + ": expected " + std::to_string(out.input.batch) +
                                  " values (one per batch row) or none, got " +
                                  std::to_string(request.key_lengths.size()));
    }
    out.key_lengths.reserve(request.key_lengths.size());
    for (size_t b = 0; b < request.key_lengths.size(); ++b) {
      const int64_t len = request.key_lengths[b];
      if (len < 1 || len > m) {
        return InvalidArgumentError(key_lengths_field + "[" + std::to_string(b) + "]: expected a value in [1, " +
                                    std::to_string(m) + "] (m = " + (out.context ? context_field : input_field) +
                                    " rows), got " + std::to_string(len));
      }
      out.key_lengths.push_back(len);
    }
  }
  return out;
}

Status CheckOutputFinite(const AttentionRequest& request, Form form, std::span<const float> output) {
  const size_t bad = FirstNonFinite(output);
  if (bad == output.size()) return OkStatus();
  // Only now, on the error path: the inputs' largest magnitude, which tells the client how far
  // to scale them down.
  float largest = 0;
  for (const RequestTensor* t : {&request.input, request.context ? &*request.context : nullptr}) {
    if (t == nullptr) continue;
    for (float v : t->values()) largest = std::max(largest, std::abs(v));
  }
  const int64_t d = std::max<int64_t>(request.d_model(), 1), n = std::max<int64_t>(request.n(), 1);
  const int64_t i = static_cast<int64_t>(bad), row = i / d, col = i % d;
  const float v = output[bad];
  char magnitude[32];
  std::snprintf(magnitude, sizeof magnitude, "%g", static_cast<double>(largest));
  return OutOfRangeError("output: expected finite values, got " +
                         std::string(std::isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf") + " at [" +
                         std::to_string(row / n) + ", " + std::to_string(row % n) + ", " + std::to_string(col) +
                         "]: the inputs are finite (largest magnitude " + magnitude + ") but the " +
                         Str(FormName(form)) + " form's computation overflowed float32; scale the inputs down");
}

}  // namespace attnserve
