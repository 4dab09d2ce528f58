#include "server/store/source.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "server/store/checkpoint_file.h"
#include "server/store/safetensors.h"

namespace attnserve {
namespace {

constexpr int64_t kMaxIndex = 1'000'000;
constexpr uintmax_t kMaxConfigJsonBytes = uintmax_t{16} << 20;

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

// Shortest text that reads back as the same double ("0.99", "1e+06").
std::string FormatDouble(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

// Largest rope_theta accepted: real models use 1e4 to 1e6; far beyond that the angles are all
// zero and the option is surely a typo.
constexpr double kMaxRopeTheta = 1e12;

// The options every kind of source takes, after its own.
constexpr std::string_view kCommonOptions[] = {"summed", "spectrum", "lowrank", "rope_theta"};

std::vector<std::string_view> WithCommon(std::vector<std::string_view> own) {
  own.insert(own.end(), std::begin(kCommonOptions), std::end(kCommonOptions));
  return own;
}

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

// lowrank=energy:E (0 < E <= 1) or lowrank=budget:R (R >= 1; its upper bound, the sum of every
// head's full rank, is checked at load against the layer's shape).
StatusOr<LowRankSpec> ParseLowRank(const std::string& value) {
  const std::string expected =
      "option 'lowrank': expected energy:E (a share of each head's energy, 0 < E <= 1) or budget:R (a total "
      "rank over all heads, R >= 1), got '" + value + "'";
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
  return InvalidArgumentError(expected);
}

Status ParseCommon(const Options& o, SourceSpec* spec) {
  ATTNSERVE_RETURN_IF_ERROR(o.Bool("summed", &spec->hold_summed));
  ATTNSERVE_RETURN_IF_ERROR(o.Bool("spectrum", &spec->compute_spectrum));
  ATTNSERVE_RETURN_IF_ERROR(o.Double("rope_theta", 0.0, kMaxRopeTheta, &spec->rope_theta));
  if (o.Has("lowrank")) {
    auto lowrank = ParseLowRank(o.Get("lowrank"));
    if (!lowrank.ok()) return lowrank.status();
    spec->lowrank = std::move(*lowrank);
    if (!spec->compute_spectrum) {
      return InvalidArgumentError("option 'lowrank' needs the layer's spectrum, but spectrum=false: drop one of them");
    }
  }
  return OkStatus();
}

Status ParseRandom(const std::vector<std::string_view>& items, SourceSpec* spec) {
  auto parsed = Options::Parse(items, "random", WithCommon({"d_model", "heads", "kv_heads", "d_head", "bias", "seed"}), {});
  if (!parsed.ok()) return parsed.status();
  const Options& o = *parsed;
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
  auto complete = CompleteConfig(c);
  if (!complete.ok()) return complete.status();
  spec->config = *complete;
  return OkStatus();
}

Status ParseSafetensors(const std::vector<std::string_view>& items, SourceSpec* spec) {
  spec->path = std::string(Trim(items[0]));
  if (spec->path.empty()) {
    return InvalidArgumentError("missing the file path (expected safetensors:PATH[,key=value...])");
  }
  // An empty prefix is meaningful: "no prefix", which also turns detection off.
  auto parsed = Options::Parse({items.begin() + 1, items.end()}, "safetensors",
                               WithCommon({"arch", "index", "prefix", "heads", "kv_heads"}), {"prefix"});
  if (!parsed.ok()) return parsed.status();
  const Options& o = *parsed;
  if (o.Has("arch")) {
    const std::string& a = o.Get("arch");
    if (a == "torch-mha") {
      spec->arch = CheckpointArch::kTorchMha;
    } else if (a == "gpt2") {
      spec->arch = CheckpointArch::kGpt2;
    } else if (a == "bert") {
      spec->arch = CheckpointArch::kBert;
    } else if (a == "llama") {
      spec->arch = CheckpointArch::kLlama;
    } else {
      return InvalidArgumentError("option 'arch': expected torch-mha, gpt2, bert or llama, got '" + a + "'");
    }
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
  if (spec->index && spec->arch == CheckpointArch::kTorchMha) {
    return InvalidArgumentError("option 'index' does not apply to arch=torch-mha (its tensors have no block "
                                "number); select the module with prefix= instead");
  }
  return OkStatus();
}

// ---- Checkpoint layouts ---------------------------------------------------------------

// How an arch's anchor tensor (its input projection weight) is named:
//   PREFIX + head + [INDEX] + tail, PREFIX empty or ending in '.'.
struct Pattern {
  CheckpointArch arch;
  std::string_view head;
  bool indexed;
  std::string_view tail;
};

constexpr Pattern kPatterns[] = {
    {CheckpointArch::kTorchMha, "", false, "in_proj_weight"},
    {CheckpointArch::kGpt2, "h.", true, ".attn.c_attn.weight"},
    {CheckpointArch::kBert, "encoder.layer.", true, ".attention.self.query.weight"},
    {CheckpointArch::kLlama, "layers.", true, ".self_attn.q_proj.weight"},
};

const Pattern& PatternOf(CheckpointArch arch) {
  for (const Pattern& p : kPatterns) {
    if (p.arch == arch) return p;
  }
  return kPatterns[0];
}

std::string PatternText(const Pattern& p) {
  return std::string(p.head) + (p.indexed ? "N" : "") + std::string(p.tail);
}

struct Match {
  std::string prefix;
  int64_t index = -1;
};

// Splits `name` into PREFIX and INDEX when it is an anchor of `p`.
std::optional<Match> MatchAnchor(const Pattern& p, std::string_view name) {
  if (name.size() < p.tail.size() || name.substr(name.size() - p.tail.size()) != p.tail) return std::nullopt;
  name.remove_suffix(p.tail.size());
  Match m;
  if (p.indexed) {
    size_t digits = 0;
    while (digits < name.size() && digits < 10 && name[name.size() - 1 - digits] >= '0' &&
           name[name.size() - 1 - digits] <= '9') {
      ++digits;
    }
    if (digits == 0 || digits > 9) return std::nullopt;
    m.index = 0;
    for (char c : name.substr(name.size() - digits)) m.index = m.index * 10 + (c - '0');
    name.remove_suffix(digits);
  }
  if (name.size() < p.head.size() || name.substr(name.size() - p.head.size()) != p.head) return std::nullopt;
  name.remove_suffix(p.head.size());
  if (!name.empty() && name.back() != '.') return std::nullopt;
  m.prefix = std::string(name);
  return m;
}

// Every anchor of `p` in the file, under `prefix` when one is given.
std::vector<Match> FindAnchors(const SafetensorsFile& file, const Pattern& p, const std::optional<std::string>& prefix) {
  std::vector<Match> found;
  for (const TensorInfo& t : file.tensors()) {
    auto m = MatchAnchor(p, t.name);
    if (m && (!prefix || m->prefix == *prefix)) found.push_back(std::move(*m));
  }
  return found;
}

// The tensor names of one layer in one layout.
struct LayerNames {
  CheckpointArch arch = CheckpointArch::kAuto;
  // torch-mha, gpt2: the packed input projection; bert, llama: query, key, value separately.
  std::string w_in, b_in;
  std::string w_q, w_k, w_v, b_q, b_k, b_v;
  std::string w_out, b_out;
};

LayerNames NamesOf(CheckpointArch arch, const std::string& prefix, int64_t index) {
  LayerNames n;
  n.arch = arch;
  const std::string i = std::to_string(index);
  switch (arch) {
    case CheckpointArch::kTorchMha:
      n.w_in = prefix + "in_proj_weight";
      n.b_in = prefix + "in_proj_bias";
      n.w_out = prefix + "out_proj.weight";
      n.b_out = prefix + "out_proj.bias";
      break;
    case CheckpointArch::kGpt2: {
      const std::string block = prefix + "h." + i + ".attn.";
      n.w_in = block + "c_attn.weight";
      n.b_in = block + "c_attn.bias";
      n.w_out = block + "c_proj.weight";
      n.b_out = block + "c_proj.bias";
      break;
    }
    case CheckpointArch::kLlama: {
      const std::string block = prefix + "layers." + i + ".self_attn.";
      n.w_q = block + "q_proj.weight";
      n.w_k = block + "k_proj.weight";
      n.w_v = block + "v_proj.weight";
      n.w_out = block + "o_proj.weight";
      // LLaMA has none; attention_bias=true variants have all four.
      n.b_q = block + "q_proj.bias";
      n.b_k = block + "k_proj.bias";
      n.b_v = block + "v_proj.bias";
      n.b_out = block + "o_proj.bias";
      break;
    }
    case CheckpointArch::kBert:
    case CheckpointArch::kAuto: {
      const std::string block = prefix + "encoder.layer." + i + ".attention.";
      n.w_q = block + "self.query.weight";
      n.w_k = block + "self.key.weight";
      n.w_v = block + "self.value.weight";
      n.b_q = block + "self.query.bias";
      n.b_k = block + "self.key.bias";
      n.b_v = block + "self.value.bias";
      n.w_out = block + "output.dense.weight";
      n.b_out = block + "output.dense.bias";
      break;
    }
  }
  return n;
}

// Picks the layout and the names of the requested layer: the arch given or the only one whose
// anchors the file holds, the prefix given or the only one found, the index given or 0.
StatusOr<LayerNames> ResolveLayout(const SafetensorsFile& file, const SourceSpec& spec) {
  const std::string at = "safetensors file '" + file.path() + "': ";
  const std::string under = spec.prefix ? " under prefix '" + *spec.prefix + "'" : "";
  std::vector<std::pair<const Pattern*, std::vector<Match>>> candidates;
  for (const Pattern& p : kPatterns) {
    if (spec.arch != CheckpointArch::kAuto && p.arch != spec.arch) continue;
    auto anchors = FindAnchors(file, p, spec.prefix);
    if (!anchors.empty()) candidates.emplace_back(&p, std::move(anchors));
  }
  if (candidates.empty()) {
    if (spec.arch != CheckpointArch::kAuto) {
      const Pattern& p = PatternOf(spec.arch);
      return NotFoundError(at + "no tensor named like '" + PatternText(p) + "'" + under + ", as arch=" +
                           std::string(CheckpointArchName(spec.arch)) + " needs");
    }
    std::string expected;
    for (const Pattern& p : kPatterns) {
      if (!expected.empty()) expected += ", ";
      expected += "'" + PatternText(p) + "' (" + std::string(CheckpointArchName(p.arch)) + ")";
    }
    return NotFoundError(at + "cannot tell the layout: no tensor named like " + expected + under +
                         "; give arch= (and prefix=) to say where the attention weights are");
  }
  if (candidates.size() > 1) {
    std::string archs;
    for (const auto& c : candidates) archs += (archs.empty() ? "" : ", ") + std::string(CheckpointArchName(c.first->arch));
    return InvalidArgumentError(at + "holds tensors of several layouts (" + archs + "); give arch=");
  }
  const Pattern& p = *candidates[0].first;
  const std::vector<Match>& anchors = candidates[0].second;
  std::set<std::string> prefixes;
  for (const Match& m : anchors) prefixes.insert(m.prefix);
  if (prefixes.size() > 1) {
    std::string list;
    int shown = 0;
    for (const auto& pr : prefixes) {
      if (shown++ == 8) {
        list += ", ...";
        break;
      }
      list += (list.empty() ? "'" : ", '") + pr + "'";
    }
    return InvalidArgumentError(at + "holds " + std::string(CheckpointArchName(p.arch)) +
                                " layers under several prefixes (" + list + "); give prefix=");
  }
  const std::string& prefix = *prefixes.begin();
  const int64_t index = spec.index.value_or(0);
  if (p.indexed) {
    bool present = false;
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (const Match& m : anchors) {
      present = present || m.index == index;
      lo = std::min(lo, m.index);
      hi = std::max(hi, m.index);
    }
    if (!present) {
      return NotFoundError(at + "no " + std::string(CheckpointArchName(p.arch)) + " layer index=" +
                           std::to_string(index) + (prefix.empty() ? "" : " under prefix '" + prefix + "'") +
                           " (the file holds indices " + std::to_string(lo) + ".." + std::to_string(hi) + ")");
    }
  }
  return NamesOf(p.arch, prefix, index);
}

// ---- Shapes and heads -------------------------------------------------------------------

StatusOr<const TensorInfo*> Require(const SafetensorsFile& file, const std::string& name) {
  const TensorInfo* t = file.Find(name);
  if (t == nullptr) {
    return NotFoundError("safetensors file '" + file.path() + "', tensor '" + name + "': no such tensor in the file");
  }
  if (!IsFloatDtype(t->dtype)) {
    return InvalidArgumentError("safetensors file '" + file.path() + "', tensor '" + name + "': dtype " +
                                std::string(DtypeName(t->dtype)) + " is not a floating type (expected F32, F16, BF16 or F64)");
  }
  return t;
}

Status ExpectShape(const SafetensorsFile& file, const TensorInfo& t, const std::vector<int64_t>& expected,
                   const std::string& why) {
  if (t.shape != expected) {
    return InvalidArgumentError("safetensors file '" + file.path() + "', tensor '" + t.name + "': expected shape " +
                                ShapeString(expected) + " (" + why + "), got " + ShapeString(t.shape));
  }
  return OkStatus();
}

Status ExpectRank2(const SafetensorsFile& file, const TensorInfo& t) {
  if (t.shape.size() != 2 || t.shape[0] < 1 || t.shape[1] < 1) {
    return InvalidArgumentError("safetensors file '" + file.path() + "', tensor '" + t.name +
                                "': expected a non-empty matrix, got shape " + ShapeString(t.shape));
  }
  return OkStatus();
}

// The widths a layer's tensors imply: d_model, the query width (heads · d_head) and the
// key/value width (kv_heads · d_head); and whether the layer has biases.
struct Widths {
  int64_t d_model = 0, q = 0, kv = 0;
  bool bias = false;
  std::string q_from;   // the tensor the query width was read from, for error messages
  std::string kv_from;
};

// bert and llama store query, key, value and output as four nn.Linear weights.
bool SeparateProjections(CheckpointArch arch) {
  return arch == CheckpointArch::kBert || arch == CheckpointArch::kLlama;
}

StatusOr<Widths> CheckShapes(const SafetensorsFile& file, const LayerNames& n) {
  Widths w;
  const std::string at = "safetensors file '" + file.path() + "': ";
  std::vector<std::string> bias_names;
  if (SeparateProjections(n.arch)) {
    auto wq = Require(file, n.w_q);
    if (!wq.ok()) return wq.status();
    auto wk = Require(file, n.w_k);
    if (!wk.ok()) return wk.status();
    auto wv = Require(file, n.w_v);
    if (!wv.ok()) return wv.status();
    auto wo = Require(file, n.w_out);
    if (!wo.ok()) return wo.status();
    ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, **wq));
    ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, **wk));
    // Linear stores [out, in].
    w.q = (*wq)->shape[0];
    w.d_model = (*wq)->shape[1];
    w.kv = (*wk)->shape[0];
    w.q_from = n.w_q;
    w.kv_from = n.w_k;
    ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **wk, {w.kv, w.d_model}, "Linear [kv_heads·d_head, d_model]"));
    ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **wv, {w.kv, w.d_model}, "the key's shape"));
    ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **wo, {w.d_model, w.q}, "Linear [d_model, heads·d_head]"));
    bias_names = {n.b_q, n.b_k, n.b_v, n.b_out};
  } else {
    auto wi = Require(file, n.w_in);
    if (!wi.ok()) return wi.status();
    auto wo = Require(file, n.w_out);
    if (!wo.ok()) return wo.status();
    ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, **wi));
    ATTNSERVE_RETURN_IF_ERROR(ExpectRank2(file, **wo));
    int64_t packed = 0;
    if (n.arch == CheckpointArch::kTorchMha) {
      // Linear: in_proj_weight [q + 2·kv, d_model], out_proj.weight [d_model, q].
      packed = (*wi)->shape[0];
      w.d_model = (*wi)->shape[1];
      w.q = (*wo)->shape[1];
      ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **wo, {w.d_model, w.q}, "Linear [d_model, heads·d_head]"));
      const std::string p = n.w_in.substr(0, n.w_in.size() - std::string_view("in_proj_weight").size());
      for (const char* extra : {"bias_k", "bias_v", "q_proj_weight"}) {
        if (file.Has(p + extra)) {
          return InvalidArgumentError(at + "tensor '" + p + extra + "' is present: MultiheadAttention with "
                                      "add_bias_kv or separate kdim/vdim is not supported");
        }
      }
    } else {
      // Conv1D: c_attn.weight [d_model, q + 2·kv], c_proj.weight [q, d_model].
      w.d_model = (*wi)->shape[0];
      packed = (*wi)->shape[1];
      w.q = (*wo)->shape[0];
      ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **wo, {w.q, w.d_model}, "Conv1D [heads·d_head, d_model]"));
    }
    w.q_from = n.w_out;
    w.kv_from = n.w_in;
    if (packed <= w.q || (packed - w.q) % 2 != 0) {
      return InvalidArgumentError("safetensors file '" + file.path() + "', tensor '" + n.w_in + "': packed Q|K|V width " +
                                  std::to_string(packed) + " must be the query width " + std::to_string(w.q) +
                                  " (from '" + n.w_out + "') plus twice a key/value width");
    }
    w.kv = (packed - w.q) / 2;
    bias_names = {n.b_in, n.b_out};
  }
  // Biases: all or none.
  std::vector<std::string> present, absent;
  for (const auto& b : bias_names) (file.Has(b) ? present : absent).push_back(b);
  if (!present.empty() && !absent.empty()) {
    return InvalidArgumentError(at + "has bias '" + present[0] + "' but not '" + absent[0] +
                                "' (a layer has all its biases or none)");
  }
  w.bias = !present.empty();
  if (w.bias) {
    const int64_t packed = w.q + 2 * w.kv;
    const std::vector<std::pair<std::string, int64_t>> sizes =
        SeparateProjections(n.arch)
            ? std::vector<std::pair<std::string, int64_t>>{{n.b_q, w.q}, {n.b_k, w.kv}, {n.b_v, w.kv}, {n.b_out, w.d_model}}
            : std::vector<std::pair<std::string, int64_t>>{{n.b_in, packed}, {n.b_out, w.d_model}};
    for (const auto& [name, size] : sizes) {
      auto t = Require(file, name);
      if (!t.ok()) return t.status();
      ATTNSERVE_RETURN_IF_ERROR(ExpectShape(file, **t, {size}, "a bias of its weight's output width"));
    }
  }
  return w;
}

// Reads a positive integer field of config.json, if there.
StatusOr<int64_t> JsonPositive(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return int64_t{0};
  if (!it->is_number_unsigned() || it->get<uint64_t>() < 1 || it->get<uint64_t>() > static_cast<uint64_t>(kMaxHeads)) {
    return InvalidArgumentError(where + ": '" + key + "' must be an integer in [1, " + std::to_string(kMaxHeads) +
                                "], got " + it->dump());
  }
  return static_cast<int64_t>(it->get<uint64_t>());
}

// config.json beside the checkpoint (Hugging Face's layout), parsed; nullopt when there is none.
// `ask` ends every error, saying what the source can give instead.
StatusOr<std::optional<nlohmann::json>> ReadConfigJson(const std::string& checkpoint, const std::string& beneath,
                                                      const std::string& ask) {
  const std::string config = (std::filesystem::path(checkpoint).parent_path() / "config.json").string();
  const std::string where = "'" + config + "'";
  // Opened as the checkpoint is (beneath its model dir, regular files only, never blocking).
  StatusOr<FileDescriptor> fd = OpenCheckpointFile(beneath, config);
  if (!fd.ok()) {
    if (fd.status().code() == StatusCode::kNotFound) return std::optional<nlohmann::json>();
    return InvalidArgumentError(where + ": " + fd.status().message() + ask);
  }
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0 || st.st_size > static_cast<off_t>(kMaxConfigJsonBytes)) {
    return InvalidArgumentError(where + ": cannot read it or larger than " + std::to_string(kMaxConfigJsonBytes) +
                                " bytes" + ask);
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::pread(fd->get(), text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (got <= 0) return InvalidArgumentError(where + ": cannot read it" + ask);
    done += static_cast<size_t>(got);
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    return InvalidArgumentError(where + ": not valid JSON (at byte " + std::to_string(e.byte) + ")" + ask);
  } catch (const nlohmann::json::exception&) {
    return InvalidArgumentError(where + ": not valid JSON" + ask);
  }
  if (!j.is_object()) return InvalidArgumentError(where + ": expected a JSON object" + ask);
  return std::optional<nlohmann::json>(std::move(j));
}

std::string ConfigJsonPath(const std::string& checkpoint) {
  return "'" + (std::filesystem::path(checkpoint).parent_path() / "config.json").string() + "'";
}

// The number of heads from config.json beside the checkpoint.
StatusOr<int64_t> HeadsFromConfigJson(const std::string& checkpoint, const std::string& beneath) {
  const std::string where = ConfigJsonPath(checkpoint);
  const std::string ask = "; give the number of heads in the source with heads=H";
  auto j = ReadConfigJson(checkpoint, beneath, ask);
  if (!j.ok()) return j.status();
  if (!*j) {
    return InvalidArgumentError("the source does not say how many heads the layer has and there is no " + where +
                                " beside '" + checkpoint + "'" + ask);
  }
  for (const char* key : {"num_attention_heads", "n_head"}) {
    auto heads = JsonPositive(**j, key, where);
    if (!heads.ok()) return heads.status();
    if (*heads > 0) return *heads;
  }
  return InvalidArgumentError(where + " has neither 'num_attention_heads' nor 'n_head'" + ask);
}

// What a LLaMA-family config.json says about attention; 0 / nullopt where it is silent.
struct LlamaJson {
  int64_t heads = 0;     // num_attention_heads
  int64_t kv_heads = 0;  // num_key_value_heads
  int64_t head_dim = 0;  // head_dim (some families set d_head != d_model / heads)
  std::optional<double> rope_theta;
};

// Hugging Face's LlamaConfig default, used when config.json has no rope_theta.
constexpr double kLlamaDefaultRopeTheta = 10000.0;

StatusOr<std::optional<LlamaJson>> LlamaConfigFromJson(const std::string& checkpoint, const std::string& beneath) {
  const std::string where = ConfigJsonPath(checkpoint);
  const std::string ask = "; give heads=H and rope_theta=T in the source instead";
  auto j = ReadConfigJson(checkpoint, beneath, ask);
  if (!j.ok()) return j.status();
  if (!*j) return std::optional<LlamaJson>();
  const nlohmann::json& json = **j;
  LlamaJson out;
  auto heads = JsonPositive(json, "num_attention_heads", where);
  if (!heads.ok()) return heads.status();
  out.heads = *heads;
  auto kv = JsonPositive(json, "num_key_value_heads", where);
  if (!kv.ok()) return kv.status();
  out.kv_heads = *kv;
  if (const auto it = json.find("head_dim"); it != json.end() && !it->is_null()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() < 1 || it->get<uint64_t>() > static_cast<uint64_t>(kMaxDHead)) {
      return InvalidArgumentError(where + ": 'head_dim' must be an integer in [1, " + std::to_string(kMaxDHead) +
                                  "], got " + it->dump());
    }
    out.head_dim = static_cast<int64_t>(it->get<uint64_t>());
  }
  if (const auto it = json.find("rope_theta"); it != json.end()) {
    if (!it->is_number() || !(it->get<double>() > 0) || it->get<double>() > kMaxRopeTheta) {
      return InvalidArgumentError(where + ": 'rope_theta' must be a number in (0, " + FormatDouble(kMaxRopeTheta) +
                                  "], got " + it->dump());
    }
    out.rope_theta = it->get<double>();
  }
  // transformers 5 writes the rotary settings as "rope_parameters": {"rope_theta": T,
  // "rope_type": "default"} and no top-level rope_theta. Read as absent, a base other than
  // 10000 would load silently as 10000, and a scaled type as plain RoPE.
  if (const auto it = json.find("rope_parameters"); it != json.end() && !it->is_null()) {
    if (!it->is_object()) {
      return InvalidArgumentError(where + ": 'rope_parameters' must be an object, got " + it->dump());
    }
    const auto type = it->find("rope_type");
    if (type != it->end() && !type->is_null() && *type != "default") {
      return InvalidArgumentError(where + ": 'rope_parameters' has rope_type " + type->dump() +
                                  ", but only plain rotary embedding is supported (expected \"default\")");
    }
    if (const auto theta = it->find("rope_theta"); theta != it->end()) {
      if (!theta->is_number() || !(theta->get<double>() > 0) || theta->get<double>() > kMaxRopeTheta) {
        return InvalidArgumentError(where + ": 'rope_parameters.rope_theta' must be a number in (0, " +
                                    FormatDouble(kMaxRopeTheta) + "], got " + theta->dump());
      }
      if (out.rope_theta && *out.rope_theta != theta->get<double>()) {
        return InvalidArgumentError(where + ": 'rope_theta' (" + FormatDouble(*out.rope_theta) +
                                    ") and 'rope_parameters.rope_theta' (" + FormatDouble(theta->get<double>()) +
                                    ") disagree");
      }
      out.rope_theta = theta->get<double>();
    }
  }
  // Scaled RoPE (linear, dynamic, yarn, llama3) changes the frequencies: computing plain RoPE
  // instead would silently give other outputs than the model.
  if (const auto it = json.find("rope_scaling"); it != json.end() && !it->is_null()) {
    return InvalidArgumentError(where + ": 'rope_scaling' is " + it->dump() +
                                ", but only plain rotary embedding is supported (expected null or absent)");
  }
  return std::optional<LlamaJson>(out);
}

// ---- Weights ----------------------------------------------------------------------------

Status CheckFinite(const SafetensorsFile& file, const std::string& name, const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return InvalidArgumentError("safetensors file '" + file.path() + "', tensor '" + name +
                                  "': non-finite value at flat index " + std::to_string(i));
    }
  }
  return OkStatus();
}

StatusOr<std::vector<float>> ReadValues(const SafetensorsFile& file, const std::string& name) {
  auto t = file.ReadFloat(name);
  if (!t.ok()) return t.status();
  ATTNSERVE_RETURN_IF_ERROR(CheckFinite(file, name, t->values));
  return std::move(t->values);
}

// Rows [row0, row0 + rows) of `src` ([*, cols], row-major), transposed: [cols, rows]. Linear
// stores y = x Wᵀ; our convention is y = x W.
std::vector<float> TransposedRows(const std::vector<float>& src, int64_t cols, int64_t row0, int64_t rows) {
  std::vector<float> out(static_cast<size_t>(cols * rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = src[(row0 + r) * cols + c];
  }
  return out;
}

// Columns [col0, col0 + count) of `src` ([rows, cols], row-major): [rows, count].
std::vector<float> Columns(const std::vector<float>& src, int64_t rows, int64_t cols, int64_t col0, int64_t count) {
  std::vector<float> out(static_cast<size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(src.begin() + r * cols + col0, src.begin() + r * cols + col0 + count, out.begin() + r * count);
  }
  return out;
}

std::vector<float> Slice(const std::vector<float>& src, int64_t first, int64_t count) {
  return {src.begin() + first, src.begin() + first + count};
}

Status FillWeights(const SafetensorsFile& file, const LayerNames& n, const Widths& w, LayerWeights* out) {
  const int64_t d = w.d_model, q = w.q, kv = w.kv, packed = q + 2 * kv;
  switch (n.arch) {
    case CheckpointArch::kTorchMha: {
      auto in = ReadValues(file, n.w_in);  // [packed, d]
      if (!in.ok()) return in.status();
      auto o = ReadValues(file, n.w_out);  // [d, q]
      if (!o.ok()) return o.status();
      out->w_q = TransposedRows(*in, d, 0, q);
      out->w_k = TransposedRows(*in, d, q, kv);
      out->w_v = TransposedRows(*in, d, q + kv, kv);
      out->w_o = TransposedRows(*o, q, 0, d);
      break;
    }
    case CheckpointArch::kGpt2: {
      auto in = ReadValues(file, n.w_in);  // [d, packed]
      if (!in.ok()) return in.status();
      auto o = ReadValues(file, n.w_out);  // [q, d]
      if (!o.ok()) return o.status();
      out->w_q = Columns(*in, d, packed, 0, q);
      out->w_k = Columns(*in, d, packed, q, kv);
      out->w_v = Columns(*in, d, packed, q + kv, kv);
      out->w_o = std::move(*o);
      break;
    }
    case CheckpointArch::kBert:
    case CheckpointArch::kLlama:
    case CheckpointArch::kAuto: {
      const std::pair<const std::string*, std::vector<float>*> parts[] = {
          {&n.w_q, &out->w_q}, {&n.w_k, &out->w_k}, {&n.w_v, &out->w_v}, {&n.w_out, &out->w_o}};
      const int64_t in_cols[] = {d, d, d, q};
      for (int k = 0; k < 4; ++k) {
        auto m = ReadValues(file, *parts[k].first);
        if (!m.ok()) return m.status();
        const int64_t rows = static_cast<int64_t>(m->size()) / in_cols[k];
        *parts[k].second = TransposedRows(*m, in_cols[k], 0, rows);
      }
      break;
    }
  }
  if (!w.bias) return OkStatus();
  if (SeparateProjections(n.arch)) {
    const std::pair<const std::string*, std::vector<float>*> biases[] = {
        {&n.b_q, &out->b_q}, {&n.b_k, &out->b_k}, {&n.b_v, &out->b_v}, {&n.b_out, &out->b_o}};
    for (const auto& [name, dst] : biases) {
      auto b = ReadValues(file, *name);
      if (!b.ok()) return b.status();
      *dst = std::move(*b);
    }
  } else {
    auto b = ReadValues(file, n.b_in);
    if (!b.ok()) return b.status();
    out->b_q = Slice(*b, 0, q);
    out->b_k = Slice(*b, q, kv);
    out->b_v = Slice(*b, q + kv, kv);
    auto bo = ReadValues(file, n.b_out);
    if (!bo.ok()) return bo.status();
    out->b_o = std::move(*bo);
  }
  return OkStatus();
}

Status CheckFormSizes(const LayerConfig& config, bool hold_summed, int64_t max_form_bytes) {
  const int64_t factored = FactoredFormParameters(config) * int64_t{sizeof(float)};
  if (factored > max_form_bytes) {
    return ResourceExhaustedError("the layer (" + config.ToString() + ") takes " + std::to_string(factored) +
                                  " bytes, more than the limit of " + std::to_string(max_form_bytes) + " per form");
  }
  const int64_t summed = SummedFormParameters(config) * int64_t{sizeof(float)};
  if (hold_summed && summed > max_form_bytes) {
    return ResourceExhaustedError("the summed form of the layer (" + config.ToString() + ") would take " +
                                  std::to_string(summed) + " bytes, more than the limit of " +
                                  std::to_string(max_form_bytes) + " per form; add summed=false to the source");
  }
  return OkStatus();
}

StatusOr<LayerSource> LoadSafetensors(const SourceSpec& spec, int64_t max_form_bytes) {
  auto file = ReadSafetensors(spec.path, spec.model_dir);
  if (!file.ok()) return file.status();
  auto names = ResolveLayout(*file, spec);
  if (!names.ok()) return names.status();
  auto widths = CheckShapes(*file, *names);
  if (!widths.ok()) return widths.status();
  const Widths& w = *widths;
  const std::string at = "safetensors file '" + spec.path + "': ";

  int64_t heads = spec.heads;
  double rope_theta = spec.rope_theta.value_or(0.0);
  std::optional<LlamaJson> llama;
  if (names->arch == CheckpointArch::kLlama) {
    // LLaMA-family checkpoints take heads, key/value heads and rope_theta from config.json;
    // the source's options win over it.
    auto from_json = LlamaConfigFromJson(spec.path, spec.model_dir);
    if (!from_json.ok()) return Prefixed(at, from_json.status());
    llama = *from_json;
    if (!llama && (heads == 0 || !spec.rope_theta)) {
      return InvalidArgumentError(at + "arch=llama needs the number of heads and rope_theta, and there is no " +
                                  ConfigJsonPath(spec.path) + " beside the file; give heads=H and rope_theta=T");
    }
    if (heads == 0) {
      if (llama->heads == 0) {
        return InvalidArgumentError(at + ConfigJsonPath(spec.path) +
                                    " has no 'num_attention_heads'; give heads=H in the source");
      }
      heads = llama->heads;
    }
    if (!spec.rope_theta) rope_theta = llama->rope_theta.value_or(kLlamaDefaultRopeTheta);
  } else if (heads == 0) {
    auto from_json = HeadsFromConfigJson(spec.path, spec.model_dir);
    if (!from_json.ok()) return Prefixed(at, from_json.status());
    heads = *from_json;
  }
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
  if (llama) {
    // config.json's head counts are checks against the shapes (unless the source overrides them).
    if (spec.heads == 0 && llama->head_dim != 0 && llama->head_dim != d_head) {
      return InvalidArgumentError(at + ConfigJsonPath(spec.path) + " says head_dim=" + std::to_string(llama->head_dim) +
                                  ", but tensor '" + w.q_from + "' of width " + std::to_string(w.q) + " and heads=" +
                                  std::to_string(heads) + " give d_head=" + std::to_string(d_head));
    }
    if (spec.heads == 0 && spec.kv_heads == 0 && llama->kv_heads != 0 && llama->kv_heads != kv_heads) {
      return InvalidArgumentError(at + ConfigJsonPath(spec.path) + " says num_key_value_heads=" +
                                  std::to_string(llama->kv_heads) + ", but tensor '" + w.kv_from + "' holds " +
                                  std::to_string(kv_heads) + " key/value heads of d_head=" + std::to_string(d_head));
    }
  }
  LayerConfig c;
  c.d_model = w.d_model;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.d_head = d_head;
  c.bias = w.bias;
  c.rope_theta = rope_theta;
  auto config = CompleteConfig(c);
  if (!config.ok()) return Prefixed(at, config.status());
  ATTNSERVE_RETURN_IF_ERROR(CheckFormSizes(*config, spec.hold_summed, max_form_bytes));

  LayerSource out;
  out.hold_summed = spec.hold_summed;
  out.compute_spectrum = spec.compute_spectrum;
  out.lowrank = spec.lowrank;
  out.arch = names->arch;
  out.weights.config = *config;
  ATTNSERVE_RETURN_IF_ERROR(FillWeights(*file, *names, w, &out.weights));
  Status valid = ValidateWeights(out.weights);
  if (!valid.ok()) return Prefixed(at, valid);
  return out;
}

}  // namespace

std::string_view CheckpointArchName(CheckpointArch arch) {
  switch (arch) {
    case CheckpointArch::kAuto: return "auto";
    case CheckpointArch::kTorchMha: return "torch-mha";
    case CheckpointArch::kGpt2: return "gpt2";
    case CheckpointArch::kBert: return "bert";
    case CheckpointArch::kLlama: return "llama";
  }
  return "unknown";
}

int64_t FactoredFormParameters(const LayerConfig& c) {
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + 2 * kv + c.d_model : 0;
  return c.d_model * (q + 2 * kv) + q * c.d_model + biases;
}

int64_t LowRankFormParameters(const LayerConfig& c, int64_t total_rank) {
  // W_in = [W_Q | W_K | P_1 … P_h], W_out = [Q_1; …; Q_h]; biases b_Q, b_K and b_eff.
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + kv + c.d_model : 0;
  return c.d_model * (q + kv + total_rank) + total_rank * c.d_model + biases;
}

int64_t SummedFormParameters(const LayerConfig& c) {
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + kv + c.d_model : 0;
  return c.d_model * (q + kv + c.heads * c.d_model) + biases;
}

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
    auto config = CompleteConfig(spec.config);
    if (!config.ok()) return config.status();
    ATTNSERVE_RETURN_IF_ERROR(CheckFormSizes(*config, spec.hold_summed, max_form_bytes));
    LayerSource out;
    out.hold_summed = spec.hold_summed;
    out.compute_spectrum = spec.compute_spectrum;
    out.lowrank = spec.lowrank;
    out.weights = RandomLayerWeights(*config, spec.seed);
    ATTNSERVE_RETURN_IF_ERROR(ValidateWeights(out.weights));
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("out of memory loading the layer's weights");
  } catch (const std::exception& e) {
    return InternalError(std::string("unexpected error loading the layer's weights: ") + e.what());
  }
}

StatusOr<LayerSource> LoadSource(std::string_view source, int64_t max_form_bytes) {
  auto spec = ParseSource(source);
  if (!spec.ok()) return spec.status();
  auto loaded = LoadSource(*spec, max_form_bytes);
  if (!loaded.ok()) return Prefixed("source " + QuoteUntrusted(source, 256) + ": ", loaded.status());
  return loaded;
}

}  // namespace attnserve
