#include "server/backend/backend.h"

namespace attnserve {

Status ValidateBatch(const LayerConfig& config, std::span<const Sequence> batch) {
  for (size_t r = 0; r < batch.size(); ++r) {
    Status st = ValidateSequence(config, batch[r]);
    if (!st.ok()) return Status(st.code(), "sequence " + std::to_string(r) + ": " + st.message());
  }
  return OkStatus();
}

}  // namespace attnserve
