// One Forward request as the backends need it, whoever holds it: the decode path (viewing the
// wire bytes), `compare` (a job per form over the same request) and a shadow's mirror (an owned
// copy that outlives the call). One type for all three, so that a field added here reaches each
// of them: a shadow once copied the request field by field and lost position_offset.
// Thread-safety: a value type; const access from any thread, as for any object.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "server/core/sequence.h"

namespace attnserve {

// A [batch, rows, cols] row-major float32 block: a view of memory someone else owns (a wire
// message's aligned float32 bytes) or values it owns (converted or copied). A copy always owns
// its values, so it outlives whatever the original viewed; a move keeps a view a view.
class RequestTensor {
 public:
  RequestTensor() = default;
  // Views `data` (batch · rows · cols floats), which must outlive this tensor and its moves.
  static RequestTensor View(const float* data, int64_t batch, int64_t rows, int64_t cols);
  // Owns `values`, which hold batch · rows · cols floats.
  static RequestTensor Own(std::vector<float> values, int64_t batch, int64_t rows, int64_t cols);

  RequestTensor(const RequestTensor& other);
  RequestTensor& operator=(const RequestTensor& other);
  RequestTensor(RequestTensor&&) noexcept = default;
  RequestTensor& operator=(RequestTensor&&) noexcept = default;

  const float* data() const { return owned_.empty() ? view_ : owned_.data(); }
  int64_t elements() const { return batch * rows * cols; }
  std::span<const float> values() const { return {data(), static_cast<size_t>(elements())}; }
  // False for a view of someone else's memory.
  bool owns_values() const { return view_ == nullptr; }

  int64_t batch = 0, rows = 0, cols = 0;

 private:
  const float* view_ = nullptr;  // null when the values are owned_ (or there are none)
  std::vector<float> owned_;
};

// A request's tensors and options, checked against its layer (server/service/validation.h
// decodes one from the wire). Copying it copies every field and owns every value.
struct AttentionRequest {
  RequestTensor input;                   // [batch, n, d_model]: the queries
  std::optional<RequestTensor> context;  // [batch, m, d_model]; none: self-attention (m = n)
  bool causal = false;                   // query q sees key j only if j <= q
  std::vector<int64_t> key_lengths;      // empty, or one per batch row: keys [0, length) visible
  int64_t position_offset = 0;           // rotary position of each row's first query

  int64_t batch() const { return input.batch; }
  int64_t n() const { return input.rows; }
  int64_t d_model() const { return input.cols; }
  int64_t output_elements() const { return input.elements(); }
  // The bytes of its values (input, context and key lengths), as a copy holds them.
  int64_t Bytes() const;
  // One Sequence per batch row, viewing this object's tensors and writing into `output`
  // ([batch, n, d_model], row-major). Keep this object, and whatever its tensors view, alive
  // while they run.
  std::vector<Sequence> Sequences(float* output) const;
};

}  // namespace attnserve
