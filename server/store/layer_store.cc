#include "server/store/layer_store.h"

#include <exception>
#include <new>
#include <optional>
#include <utility>

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

// Makes one form resident; the error names the form.
StatusOr<std::shared_ptr<const ResidentForm>> UploadForm(Backend* backend, FormWeights weights) {
  const Form form = weights.form;
  auto resident = backend->Upload(std::make_shared<const FormWeights>(std::move(weights)));
  if (!resident.ok()) {
    return Prefixed("uploading the " + std::string(FormName(form)) + " form to " + backend->DeviceName() + ": ",
                    resident.status());
  }
  return resident;
}

}  // namespace

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

StatusOr<std::shared_ptr<const Layer>> LayerStore::Load(const std::string& name, const std::string& source) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateLayerName(name));
  const std::string at = "layer '" + name + "': ";
  if (backend_ == nullptr) return FailedPreconditionError(at + "the store has no backend");
  auto spec = ParseSource(source);
  if (!spec.ok()) return Prefixed(at, spec.status());

  // Everything slow (reading, drawing, materialising, uploading) runs outside the mutex, so
  // readers of other layers never wait on a load.
  std::shared_ptr<const Layer> published;
  try {
    auto loaded = LoadSource(*spec, options_.max_form_bytes);
    if (!loaded.ok()) return Prefixed(at + "source '" + source + "': ", loaded.status());
    auto layer = std::make_shared<Layer>();
    layer->name = name;
    layer->source = source;
    layer->config = loaded->weights.config;
    layer->device = backend_->DeviceName();
    FormWeights factored = MaterializeFactored(loaded->weights);
    std::optional<FormWeights> summed;
    if (loaded->hold_summed) summed = MaterializeSummed(loaded->weights);
    loaded->weights = LayerWeights();  // the forms hold all we need: free the source copy now

    auto resident = UploadForm(backend_, std::move(factored));
    if (!resident.ok()) return Prefixed(at, resident.status());
    layer->forms[Form::kFactored] = std::move(*resident);
    if (summed) {
      resident = UploadForm(backend_, std::move(*summed));
      if (!resident.ok()) return Prefixed(at, resident.status());
      layer->forms[Form::kSummed] = std::move(*resident);
    }
    published = std::move(layer);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(at + "out of memory loading source '" + source + "'");
  } catch (const std::exception& e) {
    return InternalError(at + "unexpected error loading source '" + source + "': " + e.what());
  }

  std::shared_ptr<const Layer> replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = layers_[name];
    replaced = std::move(slot);
    slot = published;
  }
  // `replaced` is released here, outside the mutex: when no request holds it any more, its
  // forms are freed without blocking other callers.
  return published;
}

Status LayerStore::Unload(std::string_view name) {
  std::shared_ptr<const Layer> removed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = layers_.find(name);
    if (it == layers_.end()) return NotFoundError("layer '" + std::string(name) + "': no such layer");
    removed = std::move(it->second);
    layers_.erase(it);
  }
  return OkStatus();
}

std::shared_ptr<const Layer> LayerStore::Get(std::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(name);
  return it == layers_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const Layer>> LayerStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<const Layer>> out;
  out.reserve(layers_.size());
  for (const auto& [name, layer] : layers_) out.push_back(layer);
  return out;
}

}  // namespace attnserve
