#include "server/core/sequence.h"

#include <string>

namespace attnserve {
namespace {

std::string Dims(int64_t r, int64_t c) { return "[" + std::to_string(r) + ", " + std::to_string(c) + "]"; }

Status CheckBlock(const char* field, ConstMatrixView v, int64_t d_model) {
  if (v.data == nullptr || v.rows < 1 || v.cols != d_model || v.ld < v.cols) {
    return InvalidArgumentError(std::string(field) + ": expected [rows >= 1, " + std::to_string(d_model) +
                                "], got " + Dims(v.rows, v.cols) + (v.data == nullptr ? " (no data)" : ""));
  }
  return OkStatus();
}

}  // namespace

Status ValidateSequence(const LayerConfig& config, const Sequence& seq) {
  ATTNSERVE_RETURN_IF_ERROR(CheckBlock("input", seq.input, config.d_model));
  if (!seq.self_attention()) ATTNSERVE_RETURN_IF_ERROR(CheckBlock("context", seq.context, config.d_model));
  if (seq.output.data == nullptr || seq.output.rows != seq.n() || seq.output.cols != config.d_model ||
      seq.output.ld < seq.output.cols) {
    return InvalidArgumentError("output: expected " + Dims(seq.n(), config.d_model) + ", got " +
                                Dims(seq.output.rows, seq.output.cols));
  }
  if (seq.key_length != -1 && (seq.key_length < 1 || seq.key_length > seq.m())) {
    return InvalidArgumentError("key_length: expected -1 (all) or a value in [1, " + std::to_string(seq.m()) +
                                "], got " + std::to_string(seq.key_length));
  }
  if (seq.position_offset < 0 || seq.position_offset > kMaxPosition) {
    return InvalidArgumentError("position_offset: expected a value in [0, " + std::to_string(kMaxPosition) + "], got " +
                                std::to_string(seq.position_offset));
  }
  return OkStatus();
}

BatchRows StackedRows(std::span<const Sequence> batch) {
  BatchRows rows;
  rows.x_row.reserve(batch.size());
  rows.c_row.reserve(batch.size());
  for (const Sequence& s : batch) {
    rows.x_row.push_back(rows.queries);
    rows.c_row.push_back(rows.contexts);
    rows.queries += s.n();
    rows.contexts += s.m();
    rows.all_self = rows.all_self && s.self_attention();
  }
  return rows;
}

}  // namespace attnserve
