#include "server/store/source.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <set>
#include <utility>
#include <vector>

#include "server/core/form_table.h"
#include "server/store/arch/arch.h"
#include "server/store/arch/config_json.h"
#include "server/store/arch/tensors.h"
#include "server/store/calibration_file.h"
#include "server/store/pick_layout.h"
#include "server/store/safetensors.h"

namespace attnserve {
namespace {

constexpr int64_t kMaxIndex = 1'000'000;

Status Prefixed(const std::string& prefix, const Status& status) {
  return Status(status.code(), prefix + status.message());
}

std::string_view Trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    parts.push_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

std::string Join(const std::vector<std::string_view>& items) {
  std::string s;
  for (auto item : items) {
    if (!s.empty()) s += ", ";
    s += item;
  }
  return s;
}

// The options every kind of source takes, after its own.
// The forms' hold options (summed=, lowrank=) come from the form table.
constexpr std::string_view kCommonOptions[] = {"spectrum", "rope_theta", "calibration"};

std::vector<std::string_view> WithCommon(std::vector<std::string_view> own) {
  for (const FormDef& def : kFormTable) {
    if (!def.hold_option.empty()) own.push_back(def.hold_option);
  }
  own.insert(own.end(), std::begin(kCommonOptions), std::end(kCommonOptions));
  return own;
}

std::string SummedOption() { return std::string(DefOf(Form::kSummed).hold_option); }
std::string LowRankOption() { return std::string(DefOf(Form::kLowRank).hold_option); }

// The key=value options of a source, each key at most once and each known to the kind.
class Options {
 public:
  static StatusOr<Options> Parse(const std::vector<std::string_view>& items, std::string_view kind,
                                 const std::vector<std::string_view>& known,
                                 const std::vector<std::string_view>& may_be_empty) {
    Options o;
    for (std::string_view raw : items) {
      const std::string_view item = Trim(raw);
      if (item.empty()) {
        return InvalidArgumentError("empty option (a stray comma?); expected key=value with key one of " +
                                    Join(known));
      }
      const size_t eq = item.find('=');
      const std::string key(Trim(item.substr(0, eq)));
      if (key.empty()) return InvalidArgumentError("option '" + std::string(item) + "' has no key");
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        return InvalidArgumentError("unknown option '" + key + "' for a " + std::string(kind) +
                                    " source (expected one of " + Join(known) + ")");
      }
      const std::string value(eq == std::string_view::npos ? std::string_view() : Trim(item.substr(eq + 1)));
      const bool empty_ok = std::find(may_be_empty.begin(), may_be_empty.end(), key) != may_be_empty.end();
      if (eq == std::string_view::npos || (value.empty() && !empty_ok)) {
        return InvalidArgumentError("option '" + key + "' has no value (expected " + key + "=VALUE)");
      }
      if (!o.values_.emplace(key, value).second) {
        return InvalidArgumentError("option '" + key + "' is given more than once");
      }
    }
    return o;
  }

  bool Has(const std::string& key) const { return values_.count(key) > 0; }
  const std::string& Get(const std::string& key) const { return values_.at(key); }

  // Sets *out when the key is present; an error naming the key when its value is bad.
  Status Int(const std::string& key, int64_t lo, int64_t hi, int64_t* out) const {
    if (!Has(key)) return OkStatus();
    const std::string& v = Get(key);
    int64_t parsed = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), parsed);
    if (ec != std::errc() || end != v.data() + v.size() || parsed < lo || parsed > hi) {
      return InvalidArgumentError("option '" + key + "': expected an integer in [" + std::to_string(lo) + ", " +
                                  std::to_string(hi) + "], got '" + v + "'");
    }
    *out = parsed;
    return OkStatus();
  }

  Status Uint(const std::string& key, uint64_t* out) const {
    if (!Has(key)) return OkStatus();
    const std::string& v = Get(key);
    uint64_t parsed = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), parsed);
    if (ec != std::errc() || end != v.data() + v.size()) {
      return InvalidArgumentError("option '" + key + "': expected an unsigned 64-bit integer, got '" + v + "'");
    }
    *out = parsed;
    return OkStatus();
  }

  // A finite decimal or exponent number ("500000", "1e6", "0.99") in [lo, hi].
  Status Double(const std::string& key, double lo, double hi, std::optional<double>* out) const {
    if (!Has(key)) return OkStatus();
    const std::string& v = Get(key);
    double parsed = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), parsed);
    if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(parsed) || parsed < lo || parsed > hi) {
      return InvalidArgumentError("option '" + key + "': expected a number in [" + FormatDouble(lo) + ", " +
                                  FormatDouble(hi) + "], got '" + v + "'");
    }
    *out = parsed;
    return OkStatus();
  }

  Status Bool(const std::string& key, bool* out) const {
    if (!Has(key)) return OkStatus();
    const std::string& v = Get(key);
    if (v == "true") {
      *out = true;
    } else if (v == "false") {
      *out = false;
    } else {
      return InvalidArgumentError("option '" + key + "': expected true or false, got '" + v + "'");
    }
    return OkStatus();
  }

 private:
  std::map<std::string, std::string> values_;
};

// lowrank=energy:E (0 < E <= 1), lowrank=budget:R (R >= 1; its upper bound, the sum of every
// head's full rank, is checked at load against the layer's shape) or lowrank=divergence:EPS
// (0 < EPS < 1, with calibration=).
StatusOr<LowRankSpec> ParseLowRank(const std::string& value) {
  const std::string expected =
      "option '" + LowRankOption() + "': expected energy:E (a share of each head's energy, 0 < E <= 1) or budget:R (a total "
      "rank over all heads, R >= 1) or divergence:EPS (the output's relative L2 on calibration= inputs, 0 < EPS < 1), "
      "got '" + value + "'";
  const size_t colon = value.find(':');
  if (colon == std::string::npos) return InvalidArgumentError(expected);
  const std::string kind(Trim(std::string_view(value).substr(0, colon)));
  const std::string arg(Trim(std::string_view(value).substr(colon + 1)));
  LowRankSpec out;
  if (kind == "energy") {
    double e = 0;
    const auto [end, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), e);
    if (ec != std::errc() || end != arg.data() + arg.size() || !(e > 0 && e <= 1)) return InvalidArgumentError(expected);
    out.selection.kind = RankSelection::Kind::kEnergy;
    out.selection.energy = e;
    out.text = "energy:" + FormatDouble(e);
    return out;
  }
  if (kind == "budget") {
    int64_t r = 0;
    const auto [end, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), r);
    if (ec != std::errc() || end != arg.data() + arg.size() || r < 1 || r > kMaxHeads * kMaxDHead) {
      return InvalidArgumentError(expected);
    }
    out.selection.kind = RankSelection::Kind::kBudget;
    out.selection.budget = r;
    out.text = "budget:" + std::to_string(r);
    return out;
  }
  if (kind == "divergence") {
    double eps = 0;
    const auto [end, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), eps);
    if (ec != std::errc() || end != arg.data() + arg.size() || !(eps > 0 && eps < 1)) return InvalidArgumentError(expected);
    out.selection.kind = RankSelection::Kind::kDivergence;
    out.selection.divergence = eps;
    out.text = "divergence:" + FormatDouble(eps);
    return out;
  }
  return InvalidArgumentError(expected);
}

// calibration=PATH (a .npy) or calibration=live:ROWS (1 <= ROWS <= kMaxCalibrationRows; at
// least d_model, which is checked once the layer's shape is known).
Status ParseCalibration(const std::string& value, SourceSpec* spec) {
  constexpr std::string_view kLive = "live:";
  if (value.rfind(kLive, 0) != 0) {
    spec->calibration = value;
    return OkStatus();
  }
  const std::string arg(Trim(std::string_view(value).substr(kLive.size())));
  int64_t rows = 0;
  const auto [end, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), rows);
  if (ec != std::errc() || end != arg.data() + arg.size() || rows < 1 || rows > kMaxCalibrationRows) {
    return InvalidArgumentError("option 'calibration': expected PATH (a .npy) or live:ROWS (1 <= ROWS <= " +
                                std::to_string(kMaxCalibrationRows) + ", at least d_model), got '" + value + "'");
  }
  spec->live_calibration_rows = rows;
  return OkStatus();
}

Status ParseCommon(const Options& o, SourceSpec* spec) {
  ATTNSERVE_RETURN_IF_ERROR(o.Bool(SummedOption(), &spec->hold_summed));
  ATTNSERVE_RETURN_IF_ERROR(o.Bool("spectrum", &spec->compute_spectrum));
  ATTNSERVE_RETURN_IF_ERROR(o.Double("rope_theta", 0.0, kMaxRopeTheta, &spec->rope_theta));
  if (o.Has(LowRankOption())) {
    ATTNSERVE_ASSIGN_OR_RETURN(spec->lowrank, ParseLowRank(o.Get(LowRankOption())));
    if (!spec->compute_spectrum) {
      return InvalidArgumentError("option '" + LowRankOption() +
                                  "' needs the layer's spectrum, but spectrum=false: drop one of them");
    }
  }
  if (o.Has("calibration")) ATTNSERVE_RETURN_IF_ERROR(ParseCalibration(o.Get("calibration"), spec));
  const bool by_divergence = spec->lowrank && spec->lowrank->selection.kind == RankSelection::Kind::kDivergence;
  const bool calibrated = !spec->calibration.empty() || spec->live_calibration_rows > 0;
  if (by_divergence && !calibrated) {
    return InvalidArgumentError("option '" + LowRankOption() + "=" + spec->lowrank->text +
                                "' needs calibration inputs: add calibration=PATH (a .npy of float32 [rows, d_model]) "
                                "or calibration=live:ROWS (the first ROWS rows of the layer's traffic)");
  }
  if (!by_divergence && calibrated) {
    return InvalidArgumentError("option 'calibration' is read only by " + LowRankOption() +
                                "=divergence:EPS, which the source does not ask for");
  }
  return OkStatus();
}

Status ParseRandom(const std::vector<std::string_view>& items, SourceSpec* spec) {
  ATTNSERVE_ASSIGN_OR_RETURN(
      const Options o,
      Options::Parse(items, "random", WithCommon({"d_model", "heads", "kv_heads", "d_head", "bias", "seed"}), {}));
  for (const char* required : {"d_model", "heads"}) {
    if (!o.Has(required)) {
      return InvalidArgumentError(std::string("missing option '") + required +
                                  "' (a random source needs d_model= and heads=)");
    }
  }
  LayerConfig c;
  ATTNSERVE_RETURN_IF_ERROR(o.Int("d_model", 1, kMaxDModel, &c.d_model));
  ATTNSERVE_RETURN_IF_ERROR(o.Int("heads", 1, kMaxHeads, &c.heads));
  ATTNSERVE_RETURN_IF_ERROR(o.Int("kv_heads", 1, kMaxHeads, &c.kv_heads));
  ATTNSERVE_RETURN_IF_ERROR(o.Int("d_head", 1, kMaxDHead, &c.d_head));
  ATTNSERVE_RETURN_IF_ERROR(o.Bool("bias", &c.bias));
  ATTNSERVE_RETURN_IF_ERROR(o.Uint("seed", &spec->seed));
  ATTNSERVE_RETURN_IF_ERROR(ParseCommon(o, spec));
  c.rope_theta = spec->rope_theta.value_or(0.0);
  ATTNSERVE_ASSIGN_OR_RETURN(spec->config, CompleteConfig(c));
  return OkStatus();
}

Status ParseSafetensors(const std::vector<std::string_view>& items, SourceSpec* spec) {
  spec->path = std::string(Trim(items[0]));
  if (spec->path.empty()) {
    return InvalidArgumentError("missing the file path (expected safetensors:PATH[,key=value...])");
  }
  // An empty prefix is meaningful: "no prefix", which also turns detection off.
  ATTNSERVE_ASSIGN_OR_RETURN(const Options o,
                             Options::Parse({items.begin() + 1, items.end()}, "safetensors",
                                            WithCommon({"arch", "index", "prefix", "heads", "kv_heads"}), {"prefix"}));
  const ArchLayout* layout = nullptr;
  if (o.Has("arch")) {
    layout = FindArchLayout(o.Get("arch"));
    if (layout == nullptr) return UnknownArchError(o.Get("arch"));
    spec->arch = CheckpointArch(layout->name);
  }
  if (o.Has("index")) {
    int64_t index = 0;
    ATTNSERVE_RETURN_IF_ERROR(o.Int("index", 0, kMaxIndex, &index));
    spec->index = index;
  }
  if (o.Has("prefix")) spec->prefix = o.Get("prefix");
  ATTNSERVE_RETURN_IF_ERROR(o.Int("heads", 1, kMaxHeads, &spec->heads));
  ATTNSERVE_RETURN_IF_ERROR(o.Int("kv_heads", 1, kMaxHeads, &spec->kv_heads));
  ATTNSERVE_RETURN_IF_ERROR(ParseCommon(o, spec));
  if (spec->index && layout != nullptr && !layout->anchor.indexed) {
    return InvalidArgumentError("option 'index' does not apply to arch=" + std::string(layout->name) +
                                " (its tensors have no block number); select the module with prefix= instead");
  }
  return OkStatus();
}

// ---- Loading ------------------------------------------------------------------------------

Status CheckFormSizes(const LayerConfig& config, bool hold_summed, int64_t max_form_bytes) {
  const int64_t factored = FormParameters(Form::kFactored, config) * int64_t{sizeof(float)};
  if (factored > max_form_bytes) {
    return ResourceExhaustedError("the layer (" + config.ToString() + ") takes " + std::to_string(factored) +
                                  " bytes, more than the limit of " + std::to_string(max_form_bytes) + " per form");
  }
  const int64_t summed = FormParameters(Form::kSummed, config) * int64_t{sizeof(float)};
  if (hold_summed && summed > max_form_bytes) {
    return ResourceExhaustedError("the summed form of the layer (" + config.ToString() + ") would take " +
                                  std::to_string(summed) + " bytes, more than the limit of " +
                                  std::to_string(max_form_bytes) + " per form; add " + SummedOption() + "=false to the source");
  }
  return OkStatus();
}

// What config.json says of head_dim and num_key_value_heads against what the shapes give.
Status CheckConfigJsonCounts(const LayerWidths& w, const HeadSettings& s, int64_t d_head, int64_t kv_heads,
                             const std::string& at) {
  if (s.config_head_dim != 0 && s.config_head_dim != d_head) {
    return InvalidArgumentError(at + s.config_json + " says head_dim=" + std::to_string(s.config_head_dim) +
                                ", but tensor '" + w.q_from + "' of width " + std::to_string(w.q) + " and heads=" +
                                std::to_string(s.heads) + " give d_head=" + std::to_string(d_head));
  }
  if (s.config_kv_heads != 0 && s.config_kv_heads != kv_heads) {
    return InvalidArgumentError(at + s.config_json + " says num_key_value_heads=" + std::to_string(s.config_kv_heads) +
                                ", but tensor '" + w.kv_from + "' holds " + std::to_string(kv_heads) +
                                " key/value heads of d_head=" + std::to_string(d_head));
  }
  return OkStatus();
}

// The layer's shape from its widths and heads: d_head = q / heads and kv_heads = kv / d_head
// must divide, and kv_heads= and config.json's counts must agree with them.
StatusOr<LayerConfig> ConfigFromWidths(const LayerWidths& w, const HeadSettings& s, const SourceSpec& spec,
                                       const std::string& at) {
  const int64_t heads = s.heads;
  if (w.q % heads != 0) {
    return InvalidArgumentError(at + "the query width " + std::to_string(w.q) + " (from tensor '" + w.q_from +
                                "') is not a multiple of heads=" + std::to_string(heads));
  }
  const int64_t d_head = w.q / heads;
  if (w.kv % d_head != 0) {
    return InvalidArgumentError(at + "the key/value width " + std::to_string(w.kv) + " (from tensor '" + w.kv_from +
                                "') is not a multiple of d_head=" + std::to_string(d_head) + " (query width " +
                                std::to_string(w.q) + " / heads=" + std::to_string(heads) + ")");
  }
  const int64_t kv_heads = w.kv / d_head;
  if (spec.kv_heads != 0 && spec.kv_heads != kv_heads) {
    return InvalidArgumentError(at + "option kv_heads=" + std::to_string(spec.kv_heads) + " but tensor '" + w.kv_from +
                                "' holds " + std::to_string(kv_heads) + " key/value heads of d_head=" +
                                std::to_string(d_head));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckConfigJsonCounts(w, s, d_head, kv_heads, at));
  LayerConfig c;
  c.d_model = w.d_model;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.d_head = d_head;
  c.bias = w.bias;
  c.rope_theta = s.rope_theta;
  auto config = CompleteConfig(c);
  if (!config.ok()) return Prefixed(at, config.status());
  return *config;
}

// What every source yields besides its weights: the options, passed through.
LayerSource WithOptionsOf(const SourceSpec& spec) {
  LayerSource out;
  out.hold_summed = spec.hold_summed;
  out.compute_spectrum = spec.compute_spectrum;
  out.lowrank = spec.lowrank;
  return out;
}

// calibration=: read once the layer's shape is known, and checked against it.
Status ReadCalibration(const SourceSpec& spec, LayerSource* out) {
  if (spec.live_calibration_rows > 0) {
    const int64_t d = out->weights.config.d_model;
    if (spec.live_calibration_rows < d) {
      // Fewer rows than d_model leave the second moment singular (ValidateCalibration).
      return InvalidArgumentError("option 'calibration=live:" + std::to_string(spec.live_calibration_rows) +
                                  "': expected at least d_model = " + std::to_string(d) + " rows, got " +
                                  std::to_string(spec.live_calibration_rows));
    }
    out->live_calibration_rows = spec.live_calibration_rows;
    return OkStatus();
  }
  if (spec.calibration.empty()) return OkStatus();
  ATTNSERVE_ASSIGN_OR_RETURN(CalibrationSet set, ReadCalibrationNpy(spec.calibration_dir, spec.calibration));
  ATTNSERVE_RETURN_IF_ERROR(ValidateCalibration(set, out->weights.config, "calibration '" + spec.calibration + "'"));
  out->calibration = std::move(set);
  return OkStatus();
}

// Open the file, pick the layout, let it check the shapes and read its config, then size the
// forms before any weight is read, and let the layout fill the weights.
StatusOr<LayerSource> LoadSafetensors(const SourceSpec& spec, int64_t max_form_bytes) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto file, ReadSafetensors(spec.path, spec.model_dir));
  ATTNSERVE_ASSIGN_OR_RETURN(auto picked, PickLayout(file, spec));
  const ArchLayout& layout = *picked.layout;
  ATTNSERVE_ASSIGN_OR_RETURN(auto widths, layout.check_shapes(file, picked.at));
  const std::string at = "safetensors file '" + spec.path + "': ";
  auto heads = layout.read_config(spec);
  if (!heads.ok()) return Prefixed(at, heads.status());
  ATTNSERVE_ASSIGN_OR_RETURN(const LayerConfig config, ConfigFromWidths(widths, *heads, spec, at));
  ATTNSERVE_RETURN_IF_ERROR(CheckFormSizes(config, spec.hold_summed, max_form_bytes));

  LayerSource out = WithOptionsOf(spec);
  out.arch = CheckpointArch(layout.name);
  out.weights.config = config;
  ATTNSERVE_RETURN_IF_ERROR(layout.fill(file, picked.at, widths, &out.weights));
  Status valid = ValidateWeights(out.weights);
  if (!valid.ok()) return Prefixed(at, valid);
  ATTNSERVE_RETURN_IF_ERROR(ReadCalibration(spec, &out));
  return out;
}

}  // namespace

std::string_view CheckpointArchName(CheckpointArch arch) { return arch.name(); }

StatusOr<SourceSpec> ParseSource(std::string_view source) {
  const std::string at = "source " + QuoteUntrusted(source, 256) + ": ";
  const size_t colon = source.find(':');
  const std::string_view kind = Trim(source.substr(0, colon));
  if (colon == std::string_view::npos || (kind != "random" && kind != "safetensors")) {
    return InvalidArgumentError(at + "expected random:OPTIONS or safetensors:PATH[,OPTIONS], got kind '" +
                                std::string(colon == std::string_view::npos ? source : kind) + "'");
  }
  // A path holding a comma cannot be written: the first comma ends it (docs/sources.md).
  const std::vector<std::string_view> items = Split(source.substr(colon + 1), ',');
  SourceSpec spec;
  Status st;
  if (kind == "random") {
    spec.kind = SourceKind::kRandom;
    st = ParseRandom(items.size() == 1 && Trim(items[0]).empty() ? std::vector<std::string_view>{} : items, &spec);
  } else {
    spec.kind = SourceKind::kSafetensors;
    st = ParseSafetensors(items, &spec);
  }
  if (!st.ok()) return Prefixed(at, st);
  return spec;
}

StatusOr<LayerSource> LoadSource(const SourceSpec& spec, int64_t max_form_bytes) {
  try {
    if (spec.kind == SourceKind::kSafetensors) return LoadSafetensors(spec, max_form_bytes);
    ATTNSERVE_ASSIGN_OR_RETURN(auto config, CompleteConfig(spec.config));
    ATTNSERVE_RETURN_IF_ERROR(CheckFormSizes(config, spec.hold_summed, max_form_bytes));
    LayerSource out = WithOptionsOf(spec);
    out.weights = RandomLayerWeights(config, spec.seed);
    ATTNSERVE_RETURN_IF_ERROR(ValidateWeights(out.weights));
    ATTNSERVE_RETURN_IF_ERROR(ReadCalibration(spec, &out));
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("out of memory loading the layer's weights");
  } catch (const std::exception& e) {
    return InternalError(std::string("unexpected error loading the layer's weights: ") + e.what());
  }
}

StatusOr<LayerSource> LoadSource(std::string_view source, int64_t max_form_bytes) {
  ATTNSERVE_ASSIGN_OR_RETURN(auto spec, ParseSource(source));
  auto loaded = LoadSource(spec, max_form_bytes);
  if (!loaded.ok()) return Prefixed("source " + QuoteUntrusted(source, 256) + ": ", loaded.status());
  return loaded;
}

}  // namespace attnserve
