#include "server/core/request.h"

#include <utility>

namespace attnserve {

RequestTensor RequestTensor::View(const float* data, int64_t batch, int64_t rows, int64_t cols) {
  RequestTensor t;
  t.view_ = data;
  t.batch = batch;
  t.rows = rows;
  t.cols = cols;
  return t;
}

RequestTensor RequestTensor::Own(std::vector<float> values, int64_t batch, int64_t rows, int64_t cols) {
  RequestTensor t;
  t.owned_ = std::move(values);
  t.batch = batch;
  t.rows = rows;
  t.cols = cols;
  return t;
}

RequestTensor::RequestTensor(const RequestTensor& other)
    : batch(other.batch), rows(other.rows), cols(other.cols), owned_(other.data(), other.data() + other.elements()) {}

RequestTensor& RequestTensor::operator=(const RequestTensor& other) {
  if (this != &other) *this = RequestTensor(other);
  return *this;
}

int64_t AttentionRequest::Bytes() const {
  const int64_t floats = input.elements() + (context ? context->elements() : 0);
  return floats * static_cast<int64_t>(sizeof(float)) + static_cast<int64_t>(key_lengths.size() * sizeof(int64_t));
}

std::vector<Sequence> AttentionRequest::Sequences(float* output) const {
  std::vector<Sequence> seqs;
  seqs.reserve(static_cast<size_t>(input.batch));
  const int64_t d = input.cols;
  for (int64_t b = 0; b < input.batch; ++b) {
    Sequence s;
    s.input = ConstMatrixView(input.data() + b * input.rows * d, input.rows, d);
    if (context) s.context = ConstMatrixView(context->data() + b * context->rows * d, context->rows, d);
    s.causal = causal;
    s.key_length = key_lengths.empty() ? -1 : key_lengths[static_cast<size_t>(b)];
    s.position_offset = position_offset;
    s.output = MatrixView(output + b * input.rows * d, input.rows, d);
    seqs.push_back(s);
  }
  return seqs;
}

}  // namespace attnserve
