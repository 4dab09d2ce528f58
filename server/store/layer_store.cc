#include "server/store/layer_store.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <exception>
#include <new>
#include <optional>
#include <utility>

#include "server/core/calibrated_rank.h"
#include "server/core/form_table.h"
#include "server/store/checkpoint_file.h"
#include "server/store/source.h"

namespace attnserve {
namespace {

Status Prefixed(const std::string& prefix, const Status& status) {
  return Status(status.code(), prefix + status.message());
}

bool NameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-';
}

// Makes one form resident in every math the layer is held in (Layer::maths: the backend's
// default into `forms`, the others into `other_maths`), sharing one copy of its weights; the
// error names the form and the math.
Status UploadForm(Backend* backend, FormWeights weights, Layer* layer) {
  const Form form = weights.form;
  const auto shared = std::make_shared<const FormWeights>(std::move(weights));
  for (const Math math : layer->maths) {
    auto resident = backend->UploadIn(shared, math);
    if (!resident.ok()) {
      return Prefixed("uploading the " + std::string(FormName(form)) + " form in " + std::string(MathName(math)) +
                          " to " + backend->DeviceName() + ": ",
                      resident.status());
    }
    if (math == layer->default_math()) {
      layer->forms[form] = std::move(*resident);
    } else {
      layer->other_maths[{form, math}] = std::move(*resident);
    }
  }
  return OkStatus();
}

// One head's Σ_{j<rank} σ_j² and Σ_j σ_j²: the OV energy a rank keeps, and all of it.
std::pair<double, double> KeptAndTotalEnergy(const HeadSpectrum& head, int64_t rank) {
  double kept = 0, total = 0;
  const std::vector<double>& s = head.singular_values;
  for (size_t j = 0; j < s.size(); ++j) {
    total += s[j] * s[j];
    if (static_cast<int64_t>(j) < rank) kept += s[j] * s[j];
  }
  return {kept, total};
}

// The low-rank form for lowrank=divergence:EPS (`option` as the source wrote it) on `set`,
// its size checked, its report written into `layer`.
StatusOr<FormWeights> BuildCalibratedLowRank(const LayerWeights& weights, const CalibrationSet& set, double eps,
                                             const std::string& option, int64_t max_form_bytes, Layer* layer) {
  auto built = MaterializeCalibratedLowRank(weights, set, eps);
  if (!built.ok()) return Prefixed(option, built.status());
  // At most 2 · d_model · h · d_head more than its query and key blocks (every rank full): for
  // grouped heads that can pass the factored form's size, so it is checked here too.
  if (built->form.Bytes() > max_form_bytes) {
    return ResourceExhaustedError("the low-rank form (total rank " + std::to_string(built->form.value_cols) +
                                  ") would take " + std::to_string(built->form.Bytes()) +
                                  " bytes, more than the limit of " + std::to_string(max_form_bytes) +
                                  " per form; choose a larger EPS");
  }
  layer->lowrank_kept_energy = built->kept_energy;
  layer->lowrank_head_kept_energy = std::move(built->head_kept_energy);
  layer->lowrank_head_divergence = std::move(built->head_divergence);
  layer->lowrank_calibration_divergence = built->divergence;
  layer->lowrank_calibration_rows = set.rows;
  layer->lowrank_ranks = built->form.value_width;
  return std::move(built->form);
}

// The low-rank form of a loaded source: ranks from the spectrum by the source's selection, its
// size checked before it is allocated.
StatusOr<FormWeights> BuildLowRank(const LayerSource& loaded, const LayerSpectrum& spectrum, int64_t max_form_bytes,
                                   Layer* layer) {
  const FormDef& lowrank = DefOf(Form::kLowRank);
  const std::string option = "option '" + std::string(lowrank.hold_option) + "=" + loaded.lowrank->text + "': ";
  if (loaded.lowrank->selection.kind == RankSelection::Kind::kDivergence) {
    if (!loaded.calibration) return InvalidArgumentError(option + "no calibration inputs were read (calibration=PATH)");
    return BuildCalibratedLowRank(loaded.weights, *loaded.calibration, loaded.lowrank->selection.divergence, option,
                                  max_form_bytes, layer);
  }
  auto ranks = SelectRanks(spectrum, loaded.lowrank->selection);
  if (!ranks.ok()) return Prefixed(option, ranks.status());
  int64_t total = 0;
  for (int64_t r : *ranks) total += r;
  if (total == 0) {
    // A form with no value columns would have no output projection either: refuse it rather
    // than serve a layer whose attention contributes nothing but the bias.
    return InvalidArgumentError(option + "keeps no direction at all (every head's OV product W_V·W_O is zero)");
  }
  const int64_t bytes = lowrank.parameters(loaded.weights.config, total) * int64_t{sizeof(float)};
  if (bytes > max_form_bytes) {
    return ResourceExhaustedError("the low-rank form (total rank " + std::to_string(total) + ") would take " +
                                  std::to_string(bytes) + " bytes, more than the limit of " +
                                  std::to_string(max_form_bytes) + " per form; choose a smaller " + std::string(lowrank.hold_option) + "=budget:R");
  }
  layer->lowrank_kept_energy = KeptEnergy(spectrum, *ranks);
  for (size_t i = 0; i < ranks->size(); ++i) {
    const auto [kept, all] = KeptAndTotalEnergy(spectrum.ov[i], (*ranks)[i]);
    layer->lowrank_head_kept_energy.push_back(all > 0 ? kept / all : 1.0);
  }
  return lowrank.materialize(loaded.weights, *ranks);
}

}  // namespace

double KeptEnergy(const LayerSpectrum& spectrum, const std::vector<int64_t>& ranks) {
  double kept = 0, total = 0;
  for (size_t i = 0; i < spectrum.ov.size(); ++i) {
    const auto [head_kept, head_total] = KeptAndTotalEnergy(spectrum.ov[i], i < ranks.size() ? ranks[i] : 0);
    kept += head_kept;
    total += head_total;
  }
  return total > 0 ? kept / total : 1.0;
}

Status ValidateLayerName(std::string_view name) {
  if (name.empty()) return InvalidArgumentError("layer name: expected 1 to 128 characters of [A-Za-z0-9._-], got ''");
  if (name.size() > kMaxLayerNameLength) {
    return InvalidArgumentError("layer name: expected at most " + std::to_string(kMaxLayerNameLength) +
                                " characters, got " + std::to_string(name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i])) {
      // The name is not echoed whole: it may hold bytes a log should not print.
      return InvalidArgumentError("layer name: character " + std::to_string(i) +
                                  " is not one of [A-Za-z0-9._-] (byte value " +
                                  std::to_string(static_cast<unsigned char>(name[i])) + ")");
    }
  }
  return OkStatus();
}

namespace {

int64_t LayerBytes(const Layer& layer) {
  int64_t bytes = 0;
  for (const Variant& v : layer.Variants()) bytes += layer.HostBytesOf(v);
  if (layer.live_calibration != nullptr) bytes += layer.live_calibration->Bytes();
  return bytes;
}

// `path` relative to the model dir it lies under ("" when under none).
std::string RelativeTo(const std::string& dir, const std::string& path) {
  std::string prefix = dir;
  while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
  prefix += '/';
  return path.rfind(prefix, 0) == 0 ? path.substr(prefix.size()) : "";
}

bool HasDotDot(const std::string& path) {
  size_t start = 0;
  for (;;) {
    const size_t slash = path.find('/', start);
    if (path.substr(start, slash - start) == "..") return true;
    if (slash == std::string::npos) return false;
    start = slash + 1;
  }
}

// Points an API load's file (`what`: "checkpoint", "calibration") at the model dir that holds
// it: an absolute path must lie under one; a relative one is looked up in each in turn.
// Whatever is refused gets one answer.
Status ConfineToModelDirs(const std::vector<std::string>& model_dirs, const std::string& what, std::string* path,
                          std::string* model_dir) {
  if (model_dirs.empty()) {
    return PermissionDeniedError(
        what + " files over the API need the server started with --model-dir DIR (the files it may "
        "read); without it only the operator's own --layer and config sources read files");
  }
  if (HasDotDot(*path)) return InvalidArgumentError(what + " path: '..' is not allowed");
  for (const std::string& dir : model_dirs) {
    const std::string relative = path->starts_with('/') ? RelativeTo(dir, *path) : *path;
    if (relative.empty()) continue;
    if (OpenCheckpointFile(dir, relative).ok()) {
      *model_dir = dir;
      *path = relative;
      return OkStatus();
    }
  }
  return NotFoundError(what + ": no readable regular file " + QuoteUntrusted(*path) + " beneath the model dirs");
}

// A path as the server shows it: relative to its model dir, or its file name alone.
std::string ShownPath(const std::string& path, const std::string& model_dir, const std::vector<std::string>& model_dirs) {
  if (!model_dir.empty()) return path;
  for (const std::string& dir : model_dirs) {
    const std::string relative = RelativeTo(dir, path);
    if (!relative.empty()) return relative;
  }
  return std::filesystem::path(path).filename().string();
}

// The source as ListLayers shows it: a checkpoint's path relative to its model dir, or its
// file name alone when it lies under none.
std::string ShownSource(const std::string& source, const SourceSpec& spec, const std::vector<std::string>& model_dirs) {
  std::string shown = source;
  if (spec.kind == SourceKind::kSafetensors) {
    const size_t comma = source.find(',');
    shown = "safetensors:" + ShownPath(spec.path, spec.model_dir, model_dirs) +
            (comma == std::string::npos ? "" : source.substr(comma));
  }
  // calibration=PATH, likewise (the option is given at most once).
  if (const size_t at = shown.find("calibration="); !spec.calibration.empty() && at != std::string::npos) {
    const size_t value = at + std::string_view("calibration=").size();
    const size_t end = shown.find(',', value);
    shown = shown.substr(0, value) + ShownPath(spec.calibration, spec.calibration_dir, model_dirs) +
            (end == std::string::npos ? "" : shown.substr(end));
  }
  return shown;
}

}  // namespace

StatusOr<std::shared_ptr<const Layer>> LayerStore::Load(const std::string& name, const std::string& source,
                                                        LoadOrigin origin) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateLayerName(name));
  const std::string at = "layer '" + name + "': ";
  if (backend_ == nullptr) return FailedPreconditionError(at + "the store has no backend");
  auto spec = ParseSource(source);
  if (!spec.ok()) return Prefixed(at, spec.status());
  if (origin == LoadOrigin::kApi && spec->kind == SourceKind::kSafetensors) {
    ATTNSERVE_RETURN_IF_ERROR(Prefixed(at, ConfineToModelDirs(options_.model_dirs, "checkpoint", &spec->path, &spec->model_dir)));
  }
  if (origin == LoadOrigin::kApi && !spec->calibration.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(
        Prefixed(at, ConfineToModelDirs(options_.model_dirs, "calibration", &spec->calibration, &spec->calibration_dir)));
  }
  ATTNSERVE_RETURN_IF_ERROR(Prefixed(at, CheckLayerCount(name)));
  const std::string layer_source_shown = ShownSource(source, *spec, options_.model_dirs);

  // Everything slow (reading, drawing, materialising, uploading) runs outside the mutex, so
  // readers of other layers never wait on a load.
  std::shared_ptr<const Layer> published;
  try {
    auto loaded = LoadSource(*spec, options_.max_form_bytes);
    if (!loaded.ok()) return Prefixed(at + "source " + QuoteUntrusted(layer_source_shown) + ": ", loaded.status());
    auto layer = std::make_shared<Layer>();
    layer->name = name;
    static std::atomic<uint64_t> next_serial{1};
    layer->serial = next_serial.fetch_add(1);
    layer->source = layer_source_shown;
    layer->config = loaded->weights.config;
    layer->device = backend_->DeviceName();
    FormWeights factored = MaterializeFactored(loaded->weights);
    std::optional<FormWeights> summed;
    if (loaded->hold_summed) summed = MaterializeSummed(loaded->weights);
    // Once per load, never per request: GetLayer and the low-rank form read this one.
    if (loaded->compute_spectrum || loaded->lowrank) layer->spectrum = std::make_shared<const LayerSpectrum>(ComputeSpectrum(loaded->weights));
    std::optional<FormWeights> lowrank;
    if (loaded->live_calibration_rows > 0) {
      // Built later from the layer's own traffic (CompleteLiveCalibration); the exact forms
      // serve from now on.
      layer->lowrank_selection = loaded->lowrank->text;
      layer->live_calibration = std::make_shared<LiveCalibration>(
          loaded->live_calibration_rows, layer->config.d_model, loaded->lowrank->selection.divergence);
    } else if (loaded->lowrank) {
      auto built = BuildLowRank(*loaded, *layer->spectrum, options_.max_form_bytes, layer.get());
      if (!built.ok()) return Prefixed(at + "source " + QuoteUntrusted(layer_source_shown) + ": ", built.status());
      layer->lowrank_selection = loaded->lowrank->text;
      layer->lowrank_ranks = built->value_width;
      lowrank = std::move(*built);
    }
    loaded->weights = LayerWeights();  // the forms hold all we need: free the source copy now
    loaded->calibration.reset();

    layer->maths = Maths();
    Status uploaded = UploadForm(backend_, std::move(factored), layer.get());
    if (uploaded.ok() && summed) uploaded = UploadForm(backend_, std::move(*summed), layer.get());
    if (uploaded.ok() && lowrank) uploaded = UploadForm(backend_, std::move(*lowrank), layer.get());
    if (!uploaded.ok()) return Prefixed(at, uploaded);
    published = std::move(layer);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(at + "out of memory loading source " + QuoteUntrusted(layer_source_shown));
  } catch (const std::exception& e) {
    return InternalError(at + "unexpected error loading source " + QuoteUntrusted(layer_source_shown) + ": " + e.what());
  }

  ATTNSERVE_RETURN_IF_ERROR(Publish(published, at, nullptr));
  return published;
}

std::vector<Math> LayerStore::Maths() const {
  std::vector<Math> maths = {backend_->default_math()};
  for (const Math m : options_.extra_maths) {
    if (std::find(maths.begin(), maths.end(), m) == maths.end()) maths.push_back(m);
  }
  return maths;
}

Status LayerStore::Publish(const std::shared_ptr<const Layer>& layer, const std::string& at,
                           const Layer* only_over) {
  const std::string& name = layer->name;
  std::shared_ptr<const Layer> replaced;
  {
    MutexLock lock(mu_);
    auto held = layers_.find(name);
    if (only_over != nullptr && (held == layers_.end() || held->second.get() != only_over)) {
      return FailedPreconditionError(at + "it was replaced or unloaded meanwhile");
    }
    // Checked again at publication: loads run side by side, outside the mutex.
    if (held == layers_.end() && static_cast<int64_t>(layers_.size()) >= options_.max_layers) {
      return ResourceExhaustedError(at + LayerCountMessage());
    }
    int64_t others = 0;
    for (const auto& [held_name, other] : layers_) {
      if (held_name != name) others += LayerBytes(*other);
    }
    const int64_t bytes = LayerBytes(*layer);
    if (others + bytes > options_.max_total_bytes) {
      return ResourceExhaustedError(at + "its forms take " + std::to_string(bytes >> 20) + " MiB and the other layers " +
                                    std::to_string(others >> 20) + " MiB, more than --max-layer-mb (" +
                                    std::to_string(options_.max_total_bytes >> 20) + " MiB); unload a layer or raise it");
    }
    auto& slot = layers_[name];
    replaced = std::move(slot);
    slot = layer;
  }
  // `replaced` is released here, outside the mutex: when no request holds it any more, its
  // forms are freed without blocking other callers.
  return OkStatus();
}

StatusOr<std::shared_ptr<const Layer>> LayerStore::CompleteLiveCalibration(const std::shared_ptr<const Layer>& layer) {
  LiveCalibration* live = layer->live_calibration.get();
  if (live == nullptr) return FailedPreconditionError("layer '" + layer->name + "': no live calibration");
  std::shared_ptr<const Layer> published;
  const std::string option = "option '" + std::string(DefOf(Form::kLowRank).hold_option) + "=" +
                             layer->lowrank_selection + ",calibration=live:" + std::to_string(live->rows_wanted()) +
                             "': ";
  const std::string at = "layer '" + layer->name + "': " + option;
  auto build = [&]() -> Status {
    // The same load (its serial: auto's fitted model still applies) and the same resident exact
    // forms, shared, plus the low-rank form; the rows are freed with the old layer, or below.
    auto next = std::make_shared<Layer>(*layer);
    next->live_calibration = nullptr;
    const CalibrationSet set = live->Rows();
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateCalibration(set, layer->config, "calibration=live:" + std::to_string(live->rows_wanted())));
    ATTNSERVE_ASSIGN_OR_RETURN(
        FormWeights built, BuildCalibratedLowRank(LayerWeightsOfFactored(layer->Find(Form::kFactored)->weights()), set,
                                                  live->eps(), option, options_.max_form_bytes, next.get()));
    ATTNSERVE_RETURN_IF_ERROR(UploadForm(backend_, std::move(built), next.get()));
    ATTNSERVE_RETURN_IF_ERROR(Publish(next, at, layer.get()));
    published = std::move(next);
    return OkStatus();
  };
  Status status;
  try {
    status = build();
  } catch (const std::bad_alloc&) {
    status = ResourceExhaustedError(at + "out of memory building the low-rank form");
  } catch (const std::exception& e) {
    status = InternalError(at + "unexpected error building the low-rank form: " + e.what());
  }
  live->Release();
  if (!status.ok()) {
    live->Fail(status);
    return status;
  }
  return published;
}

std::string LayerStore::LayerCountMessage() const {
  return "the server holds " + std::to_string(options_.max_layers) + " layers, the most --max-layers allows; " +
         "unload one or raise it";
}

Status LayerStore::CheckLayerCount(const std::string& name) const {
  MutexLock lock(mu_);
  if (layers_.find(name) != layers_.end() || static_cast<int64_t>(layers_.size()) < options_.max_layers) {
    return OkStatus();
  }
  return ResourceExhaustedError(LayerCountMessage());
}

Status LayerStore::Unload(std::string_view name) {
  std::shared_ptr<const Layer> removed;
  {
    MutexLock lock(mu_);
    auto it = layers_.find(name);
    if (it == layers_.end()) return NotFoundError("layer '" + std::string(name) + "': no such layer");
    removed = std::move(it->second);
    layers_.erase(it);
  }
  return OkStatus();
}

std::shared_ptr<const Layer> LayerStore::Get(std::string_view name) const {
  MutexLock lock(mu_);
  auto it = layers_.find(name);
  return it == layers_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const Layer>> LayerStore::List() const {
  MutexLock lock(mu_);
  std::vector<std::shared_ptr<const Layer>> out;
  out.reserve(layers_.size());
  for (const auto& [name, layer] : layers_) out.push_back(layer);
  return out;
}

}  // namespace attnserve
