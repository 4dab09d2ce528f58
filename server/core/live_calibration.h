// LiveCalibration: the calibration rows of lowrank=divergence:EPS,calibration=live:ROWS,
// gathered from the layer's own traffic instead of a file (docs/spectra.md, "Calibrating on
// live traffic"). A layer loaded so serves its exact forms at once and holds no low-rank form;
// each served call offers its sequences' key rows (the rows the values are projected from: the
// context, or the input in self-attention, up to the key length) until ROWS are in, in the
// order the calls offered them. The call that completes the set hands it to the layer store
// (LayerStore::CompleteLiveCalibration), which builds the low-rank form from it exactly as
// from a .npy of the same rows, off the serving threads, and publishes the layer with it.
// Memory: ROWS · d_model floats, reserved at load and counted in the layer's bytes.
// Thread-safety: every method may be called from any thread at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <string>

#include "server/core/calibrated_rank.h"
#include "server/core/request.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace attnserve {

class LiveCalibration {
 public:
  // `rows_wanted` in [d_model, kMaxCalibrationRows] (the source parser and ValidateCalibration
  // check it); `eps` the divergence the ranks are chosen for.
  LiveCalibration(int64_t rows_wanted, int64_t d_model, double eps);

  // Copies the key rows of `batch` until rows_wanted are in. True for the one call whose rows
  // completed the set, and again for a later call after Unclaim: that caller starts the build.
  bool Offer(std::span<const Sequence> batch);
  // The same for a decoded request's rows (its outputs are not needed).
  bool Offer(const AttentionRequest& request);
  // The build could not be started (its queue was full): the next Offer claims it again.
  void Unclaim();
  // False once the set is complete and its build claimed: the one check a served call makes
  // when nothing is wanted of it.
  bool wants_offers() const { return wants_offers_.load(std::memory_order_acquire); }

  // A copy of the rows gathered, as a calibration set: all of them once complete. Release frees
  // them once the build has read them (it succeeded or failed: either way they are not needed).
  CalibrationSet Rows() const;
  void Release();

  // The build's failure, for GetLayer (the layer then serves its exact forms only).
  void Fail(const Status& status);
  Status failure() const;

  int64_t rows_wanted() const { return rows_wanted_; }
  int64_t rows_seen() const;
  int64_t d_model() const { return d_model_; }
  double eps() const { return eps_; }
  int64_t Bytes() const { return rows_wanted_ * d_model_ * static_cast<int64_t>(sizeof(float)); }

 private:
  const int64_t rows_wanted_, d_model_;
  const double eps_;
  std::atomic<bool> wants_offers_{true};
  mutable Mutex mu_;
  std::vector<float> rows_ ATTNSERVE_GUARDED_BY(mu_);  // [rows_seen_, d_model], capacity reserved at load
  int64_t rows_seen_ ATTNSERVE_GUARDED_BY(mu_) = 0;
  bool claimed_ ATTNSERVE_GUARDED_BY(mu_) = false;
  Status failure_ ATTNSERVE_GUARDED_BY(mu_);
};

}  // namespace attnserve
