// Host memory a Forward call holds, as the memory budget (server/batching/memory_budget.h)
// charges it at admission: the request's tensors, then per form its output and the backend's
// scratch. docs/reliability.md has the model and its check against measured RSS. No gRPC, no
// protobuf: unit-tested on its own (footprint_test). Pure functions: any thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/request.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

// The shapes the backend sees for a request: one sequence per batch row.
std::vector<SequenceShape> ShapesOf(const AttentionRequest& r);

// Host bytes one form's job holds while it is queued and computed: its output and the
// backend's scratch (the same formula the backend allocates by). Without a backend, or for a
// form the layer does not hold, the output alone.
int64_t JobBytes(const Layer& layer, Form form, const AttentionRequest& r, std::span<const SequenceShape> shapes,
                 const Backend* backend);

// What a Forward call holds from admission to its answer: the request's wire bytes, float32
// copies of every tensor the wire sent in half precision (input and context alike), then per
// form run its output and scratch.
int64_t RequestFootprint(const Layer& layer, const AttentionRequest& r, std::span<const Form> forms,
                         int64_t wire_bytes, const Backend* backend);

}  // namespace attnserve
