// Checks a Forward request against its layer and turns its tensors into core Sequences, with
// errors that name the field, what was expected and what came (docs/service.md). Works on a
// plain view of the wire message, so it is tested without protobuf or gRPC; service.cc fills
// the view from the proto.
// Thread-safety: stateless functions; a DecodedForward is owned by one request.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/store/layer_store.h"

namespace attnserve {

// The numbers of attnserve.v1.DataType and attnserve.v1.Form (service.cc checks they match).
enum class WireDtype : int { kUnspecified = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };
enum class WireForm : int { kUnspecified = 0, kFactored = 1, kSummed = 2, kLowRank = 3 };

// "FLOAT32", "FLOAT16", ... or the number when it is no DataType.
std::string WireDtypeName(int dtype);
int64_t WireDtypeSize(int dtype);  // 0 when not a supported dtype

std::optional<Form> FormFromWire(int wire_form);  // nullopt for UNSPECIFIED and unknown values
WireForm FormToWire(Form form);

// A wire Tensor, viewed: `data` points into the request message, which outlives the request.
struct WireTensor {
  bool present = false;  // a message field was set (context is optional)
  int dtype = 0;
  std::span<const int64_t> shape;
  std::string_view data;
};

struct WireForwardRequest {
  int form = 0;
  WireTensor input;
  WireTensor context;
  bool causal = false;
  std::span<const int32_t> key_lengths;
  int64_t position_offset = 0;
};

// INVALID_ARGUMENT when `wire_form` is no attnserve.v1.Form value.
Status CheckWireForm(int wire_form);

// The form that serves a request: the requested one, or the default when unspecified.
// INVALID_ARGUMENT for a value that is no Form; FAILED_PRECONDITION when the layer does not
// hold the form. The one place where the server picks a form (routing replaces it later).
StatusOr<Form> ChooseForm(int wire_form, const Layer& layer);

// A [batch, rows, d_model] float32 block: a view of the wire bytes when they are float32 and
// aligned (no copy), else a converted copy it owns.
class DecodedTensor {
 public:
  const float* data() const { return owned_.empty() ? view_ : owned_.data(); }
  int64_t batch = 0, rows = 0, cols = 0;

 private:
  friend StatusOr<DecodedTensor> DecodeTensor(std::string_view field, const WireTensor& wire, int64_t d_model,
                                              std::optional<int64_t> batch);
  const float* view_ = nullptr;
  std::vector<float> owned_;
};

// Checks dtype, rank 3, every dim >= 1 (the product checked for overflow before anything is
// allocated), d_model, byte length (= product × dtype size) and finiteness; converts FLOAT16
// and BFLOAT16 to float32. `batch`: the batch the tensor must have, when known.
StatusOr<DecodedTensor> DecodeTensor(std::string_view field, const WireTensor& wire, int64_t d_model,
                                     std::optional<int64_t> batch = std::nullopt);

// A request's tensors, checked against its layer.
struct DecodedForward {
  DecodedTensor input;
  std::optional<DecodedTensor> context;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty, or one per batch row
  int64_t position_offset = 0;       // rotary position of each row's first query

  int64_t batch() const { return input.batch; }
  int64_t n() const { return input.rows; }
  int64_t d_model() const { return input.cols; }
  int64_t output_elements() const { return input.batch * input.rows * input.cols; }
  // One Sequence per batch row, writing into `output` ([batch, n, d_model], row-major). The
  // sequences view this object's memory and the wire bytes: keep both alive while they run.
  std::vector<Sequence> Sequences(float* output) const;
};

// Bounds on what one request may make the server compute, beyond the message size.
struct ForwardLimits {
  // The attention scores of one sequence, n · m · heads · 4 bytes: what the summed form holds
  // at once for it (the factored form holds one head's share per thread). A message well under
  // the size limit can still ask for a [n, n] matrix per head of many GiB.
  int64_t max_score_bytes = int64_t{2048} << 20;
};

// RESOURCE_EXHAUSTED when a sequence exceeds `limits` (the message names the flag to raise).
StatusOr<DecodedForward> DecodeForward(const LayerConfig& config, const WireForwardRequest& request,
                                       const ForwardLimits& limits = {});

}  // namespace attnserve
