#include "server/core/live_calibration.h"

#include <algorithm>
#include <vector>

namespace attnserve {

LiveCalibration::LiveCalibration(int64_t rows_wanted, int64_t d_model, double eps)
    : rows_wanted_(rows_wanted), d_model_(d_model), eps_(eps) {
  MutexLock lock(mu_);
  // Reserved now, so the memory the layer is charged for at load is the memory it holds, and a
  // served call never reallocates it.
  rows_.reserve(static_cast<size_t>(rows_wanted_ * d_model_));
}

bool LiveCalibration::Offer(std::span<const Sequence> batch) {
  MutexLock lock(mu_);
  for (const Sequence& s : batch) {
    if (rows_seen_ >= rows_wanted_) break;
    const ConstMatrixView keys = s.keys_source();
    if (keys.cols != d_model_) continue;  // validated upstream; never mixes widths
    // Keys past key_length are padding the request does not attend to: not the layer's inputs.
    const int64_t visible = s.key_length >= 0 ? std::min(s.key_length, keys.rows) : keys.rows;
    const int64_t take = std::min(visible, rows_wanted_ - rows_seen_);
    for (int64_t r = 0; r < take; ++r) {
      const float* row = keys.row(r);
      rows_.insert(rows_.end(), row, row + d_model_);
    }
    rows_seen_ += take;
  }
  if (rows_seen_ < rows_wanted_ || claimed_) return false;
  claimed_ = true;
  wants_offers_.store(false, std::memory_order_release);
  return true;
}

bool LiveCalibration::Offer(const AttentionRequest& request) {
  std::vector<Sequence> views(static_cast<size_t>(request.batch()));
  const int64_t d = request.d_model();
  for (int64_t b = 0; b < request.batch(); ++b) {
    Sequence& s = views[static_cast<size_t>(b)];
    s.input = ConstMatrixView(request.input.data() + b * request.n() * d, request.n(), d);
    if (request.context) {
      s.context = ConstMatrixView(request.context->data() + b * request.context->rows * d, request.context->rows, d);
    }
    s.key_length = request.key_lengths.empty() ? -1 : request.key_lengths[static_cast<size_t>(b)];
  }
  return Offer(views);
}

void LiveCalibration::Unclaim() {
  MutexLock lock(mu_);
  claimed_ = false;
  wants_offers_.store(true, std::memory_order_release);
}

CalibrationSet LiveCalibration::Rows() const {
  MutexLock lock(mu_);
  return CalibrationSet{.rows = rows_seen_, .d_model = d_model_, .x = rows_};
}

void LiveCalibration::Release() {
  MutexLock lock(mu_);
  std::vector<float>().swap(rows_);
}

void LiveCalibration::Fail(const Status& status) {
  MutexLock lock(mu_);
  failure_ = status;
}

Status LiveCalibration::failure() const {
  MutexLock lock(mu_);
  return failure_;
}

int64_t LiveCalibration::rows_seen() const {
  MutexLock lock(mu_);
  return rows_seen_;
}

}  // namespace attnserve
