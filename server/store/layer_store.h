// LayerStore: the layers this server holds, by name, each in every form it keeps.
// A Layer (server/layer/loaded_layer.h) is immutable once published; readers take a shared_ptr
// and keep it for the whole request, so an unload or replace never frees weights a batch is using.
// Thread-safety: every method may be called from any thread.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/spectrum.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

// The share of the OV energy Σ_i Σ_{j<r_i} σ_ij² / Σ_i Σ_j σ_ij² that per-head ranks keep
// (1 for a layer whose OV products are all zero).
double KeptEnergy(const LayerSpectrum& spectrum, const std::vector<int64_t>& ranks);

// Layer names are what requests, metrics and logs name a layer by: 1 to 128 characters of
// [A-Za-z0-9._-]. INVALID_ARGUMENT saying what is wrong otherwise.
inline constexpr size_t kMaxLayerNameLength = 128;
Status ValidateLayerName(std::string_view name);

struct LayerStoreOptions {
  // The largest single form a load may materialise (see LoadSource in source.h).
  int64_t max_form_bytes = int64_t{16} << 30;
  // Caps over every held layer (a replaced layer's own bytes do not count against its
  // replacement): RESOURCE_EXHAUSTED naming the flag beyond them.
  int max_layers = 1 << 20;
  int64_t max_total_bytes = INT64_MAX;
  // Where API loads may read checkpoints (absolute paths); none: API loads of safetensors
  // sources are refused. Also what Layer::source is shown relative to.
  std::vector<std::string> model_dirs{};
  // The maths each layer is also held in, beside the backend's default (--extra-maths): every
  // form resident once more per math, a served variant for routes and shadows to name.
  std::vector<Math> extra_maths{};
};

// Who asked for a load. The operator's own sources (flags, config file) are read as written;
// a load over the API is confined to the model dirs (server/store/checkpoint_file.h).
enum class LoadOrigin { kOperator, kApi };

class LayerStore {
 public:
  explicit LayerStore(Backend* backend, LayerStoreOptions options = {}) : backend_(backend), options_(options) {}

  // Parses SOURCE, reads or draws the weights, computes the spectrum, materialises the forms
  // (the low-rank one from the spectrum, when the source asks), uploads them and publishes the
  // layer under `name`, replacing any layer of that name (requests already
  // holding the old one finish on it). Errors name the source and what was wrong.
  StatusOr<std::shared_ptr<const Layer>> Load(const std::string& name, const std::string& source,
                                              LoadOrigin origin = LoadOrigin::kOperator);

  // Builds the low-rank form of a layer loaded with calibration=live:ROWS from the rows its
  // traffic gave (once LiveCalibration::Offer said they are all in), exactly as a load from a
  // .npy of the same rows would, and publishes (and returns) the layer holding it in place of
  // `layer`. Slow
  // (float64 SVDs): the server runs it on a background thread. FAILED_PRECONDITION when the
  // layer was replaced or unloaded meanwhile; a failure is also kept in the live calibration,
  // where GetLayer reports it, and the layer goes on serving its exact forms.
  StatusOr<std::shared_ptr<const Layer>> CompleteLiveCalibration(const std::shared_ptr<const Layer>& layer);

  // NOT_FOUND when no such layer.
  Status Unload(std::string_view name);

  // nullptr when no such layer.
  std::shared_ptr<const Layer> Get(std::string_view name) const;

  // All layers, ordered by name.
  std::vector<std::shared_ptr<const Layer>> List() const;

 private:
  Status CheckLayerCount(const std::string& name) const ATTNSERVE_EXCLUDES(mu_);
  // Publishes `layer` under its name within the caps (`at` prefixes the errors); with
  // `only_over`, only while that is the layer held under the name.
  Status Publish(const std::shared_ptr<const Layer>& layer, const std::string& at, const Layer* only_over)
      ATTNSERVE_EXCLUDES(mu_);
  std::string LayerCountMessage() const;

  Backend* backend_;
  // The maths a layer is held in: the backend's default, then the extra ones not equal to it.
  std::vector<Math> Maths() const;

  const LayerStoreOptions options_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<const Layer>, std::less<>> layers_ ATTNSERVE_GUARDED_BY(mu_);
};

}  // namespace attnserve
