#include "server/service/footprint.h"

namespace attnserve {

std::vector<SequenceShape> ShapesOf(const AttentionRequest& r) {
  std::vector<SequenceShape> shapes;
  const int64_t m = r.context ? r.context->rows : r.n();
  for (int64_t b = 0; b < r.batch(); ++b) {
    shapes.push_back({.n = r.n(), .m = m, .keys = r.key_lengths.empty() ? -1 : r.key_lengths[b]});
  }
  return shapes;
}

int64_t JobBytes(const Layer& layer, Form form, const AttentionRequest& r, std::span<const SequenceShape> shapes,
                 const Backend* backend) {
  const int64_t output = r.output_elements() * static_cast<int64_t>(sizeof(float));
  const ResidentForm* resident = layer.Find(form);
  if (backend == nullptr || resident == nullptr) return output;
  return output + backend->ScratchBytes(resident->weights(), shapes, !r.context.has_value());
}

int64_t RequestFootprint(const Layer& layer, const AttentionRequest& r, std::span<const Form> forms,
                         int64_t wire_bytes, const Backend* backend) {
  const std::vector<SequenceShape> shapes = ShapesOf(r);
  int64_t bytes = wire_bytes;
  if (r.input.owns_values()) bytes += r.input.elements() * static_cast<int64_t>(sizeof(float));
  if (r.context && r.context->owns_values()) bytes += r.context->elements() * static_cast<int64_t>(sizeof(float));
  for (Form form : forms) bytes += JobBytes(layer, form, r, shapes, backend);
  return bytes;
}

}  // namespace attnserve
