#include "server/routing/router.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include "server/core/splitmix64.h"

namespace attnserve {
namespace {

std::string Str(std::string_view v) { return std::string(v); }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string HeldNames() {
  std::string names;
  for (Form f : kAllForms) names += (names.empty() ? "" : ", ") + Str(FormName(f));
  return names + ", " + Str(kAutoChoice.name);
}

// A target's place in a split: its form's value, auto after every form; within one, its math's
// value, the default math (none named) after every math.
constexpr size_t kForms = std::size(kAllForms), kMaths = std::size(kAllMaths);
constexpr size_t kTargetSlots = (kForms + 1) * (kMaths + 1);
size_t SlotOf(const RouteTarget& t) {
  return (t.form ? static_cast<size_t>(*t.form) : kForms) * (kMaths + 1) +
         (t.math ? static_cast<size_t>(*t.math) : kMaths);
}
RouteTarget TargetOfSlot(size_t slot) {
  const size_t form = slot / (kMaths + 1), math = slot % (kMaths + 1);
  return {form < kForms ? std::optional<Form>(kAllForms[form]) : std::nullopt,
          math < kMaths ? std::optional<Math>(kAllMaths[math]) : std::nullopt};
}

// The target with its math named: the layer's default where the route named none.
RouteTarget Resolved(RouteTarget t, Math default_math) {
  if (!t.math) t.math = default_math;
  return t;
}
// A split with every target's math resolved, shares of targets that become one added up
// ("factored:1,factored@fp32:1" under fp32 is factored@fp32 at 100 %), in slot order.
RouteSplit Resolved(const RouteSplit& split, Math default_math) {
  RouteSplit resolved;
  for (const auto& [target, share] : split) {
    const RouteTarget t = Resolved(target, default_math);
    auto same = std::find_if(resolved.begin(), resolved.end(), [&](const auto& r) { return r.first == t; });
    if (same != resolved.end()) {
      same->second += share;
    } else {
      resolved.emplace_back(t, share);
    }
  }
  std::sort(resolved.begin(), resolved.end(),
            [](const auto& a, const auto& b) { return SlotOf(a.first) < SlotOf(b.first); });
  return resolved;
}

// A uniform draw in [0, 1) from this thread's generator: routing is on every request's path,
// and one shared generator would need a lock.
double UniformDraw() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   std::hash<std::thread::id>{}(std::this_thread::get_id()));
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

const RouteSplit& DefaultSplit() {
  static const RouteSplit split = {{Form::kFactored, 1.0}};
  return split;
}

}  // namespace

StatusOr<RouteSplit> MakeRouteSplit(const std::vector<std::pair<RouteTarget, double>>& weights, std::string_view what) {
  const std::string w(what);
  double by_form[kTargetSlots] = {};
  bool seen[kTargetSlots] = {};
  double total = 0;
  for (const auto& [target, weight] : weights) {
    const size_t index = SlotOf(target);
    if (seen[index]) {
      return InvalidArgumentError(w + ": expected each form at most once, got " + target.label() + " twice");
    }
    seen[index] = true;
    if (!std::isfinite(weight) || weight < 0) {
      return InvalidArgumentError(w + ": expected a finite weight >= 0 for " + target.label() + ", got " +
                                  std::to_string(weight));
    }
    by_form[index] = weight;
    total += weight;
  }
  if (!(total > 0) || !std::isfinite(total)) {
    return InvalidArgumentError(w + ": expected at least one positive weight, got " + std::to_string(weights.size()) +
                                " summing to " + std::to_string(total));
  }
  RouteSplit split;
  for (size_t slot = 0; slot < kTargetSlots; ++slot) {
    if (by_form[slot] > 0) split.emplace_back(TargetOfSlot(slot), by_form[slot] / total);
  }
  return split;
}

StatusOr<RouteSplit> ParseRouteSpec(std::string_view spec, std::string_view what) {
  const std::string w(what);
  const std::string expected = "expected FORM:WEIGHT[,FORM:WEIGHT...] with FORM one of " + HeldNames() +
                               ", optionally @MATH (" + Str(kMathChoices) +
                               "), and WEIGHT >= 0 (e.g. factored:90,summed:10 or factored@bf16:90,factored@fp32:10)";
  if (Trim(spec).empty()) return InvalidArgumentError(w + ": " + expected + ", got an empty string");
  std::vector<std::pair<RouteTarget, double>> weights;
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t comma = spec.find(',', start);
    const std::string_view item = Trim(spec.substr(start, comma == std::string_view::npos ? spec.npos : comma - start));
    start = comma == std::string_view::npos ? spec.size() + 1 : comma + 1;
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      return InvalidArgumentError(w + ": " + expected + ", got '" + Str(item) + "' (no ':') in '" + Str(spec) + "'");
    }
    const std::string_view target = Trim(item.substr(0, colon));
    const std::string_view number = Trim(item.substr(colon + 1));
    const size_t at = target.find('@');
    const std::string_view name = Trim(target.substr(0, at));
    const std::optional<Form> form = ParseForm(name);
    if (!form && name != kAutoChoice.name) {
      return InvalidArgumentError(w + ": expected a form among " + HeldNames() + ", got '" + Str(name) + "' in '" +
                                  Str(spec) + "'");
    }
    std::optional<Math> math;
    if (at != std::string_view::npos) {
      const std::string_view math_name = Trim(target.substr(at + 1));
      math = ParseMath(math_name);
      if (!math) {
        return InvalidArgumentError(w + ": expected a math after " + Str(name) + "@ among " + Str(kMathChoices) +
                                    ", got '" + Str(math_name) + "' in '" + Str(spec) + "'");
      }
    }
    double weight = 0;
    const char* end = number.data() + number.size();
    auto [p, ec] = std::from_chars(number.data(), end, weight);
    if (number.empty() || ec != std::errc() || p != end || !std::isfinite(weight) || weight < 0) {
      return InvalidArgumentError(w + ": expected a finite weight >= 0 for " + Str(name) + ", got '" + Str(number) +
                                  "' in '" + Str(spec) + "'");
    }
    weights.emplace_back(RouteTarget(form, math), weight);
  }
  StatusOr<RouteSplit> split = MakeRouteSplit(weights, what);
  if (!split.ok()) return InvalidArgumentError(split.status().message() + " in '" + Str(spec) + "'");
  return split;
}

std::string FormatRouteSpec(const RouteSplit& split) {
  std::string text;
  for (const auto& [form, share] : split) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.4g", share * 100);
    text += (text.empty() ? "" : ",") + form.label() + ":" + buf;
  }
  return text;
}

StatusOr<std::pair<std::string, RouteSplit>> ParseRouteFlag(std::string_view flag, std::string_view what) {
  const size_t eq = flag.find('=');
  if (eq == std::string_view::npos || eq == 0) {
    return InvalidArgumentError(Str(what) + ": expected LAYER=FORM:WEIGHT,... (LAYER may be *), e.g. " +
                                "'*=factored:90,summed:10', got '" + Str(flag) + "'");
  }
  const std::string layer = Str(Trim(flag.substr(0, eq)));
  ATTNSERVE_ASSIGN_OR_RETURN(RouteSplit split, ParseRouteSpec(flag.substr(eq + 1), Str(what) + " " + layer));
  return std::make_pair(layer, std::move(split));
}

uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a 64-bit offset basis
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;  // FNV-1a 64-bit prime
  }
  return h;
}

double StickyPoint(std::string_view key) {
  // FNV-1a's low bits mix well but its high bits barely move for a change in the last byte;
  // the splitmix64 finaliser spreads every input bit over the 53 bits used here.
  const uint64_t z = SplitMix64Finalise(Fnv1a64(key));
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

std::string CanonicalRoutesText(const Routes& routes) {
  std::map<std::string, RouteSplit> sorted(routes.begin(), routes.end());
  sorted.try_emplace(kDefaultRoute, DefaultSplit());
  std::string text;
  for (const auto& [layer, split] : sorted) {
    text += layer + "=";
    bool first = true;
    for (const auto& [form, share] : split) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.6g", share * 100);
      text += (first ? "" : ",") + form.label() + ":" + buf;
      first = false;
    }
    text += "\n";
  }
  return text;
}

uint64_t RoutesGeneration(const Routes& routes) { return Fnv1a64(CanonicalRoutesText(routes)) >> 11; }

Router::Router(RoutingObserver* observer, Math default_math) : observer_(observer), default_math_(default_math) {
  WriterLock lock(mu_);
  routes_.emplace(kDefaultRoute, DefaultSplit());
  if (observer_ != nullptr) observer_->RouteChanged(kDefaultRoute, Resolved(DefaultSplit(), default_math_));
  RoutesChangedLocked();
}

Routes Router::RoutesLocked() const {
  Routes routes;
  routes.emplace_back(kDefaultRoute, routes_.at(kDefaultRoute));
  for (const auto& [layer, split] : routes_) {
    if (layer != kDefaultRoute) routes.emplace_back(layer, split);
  }
  return routes;
}

void Router::RoutesChangedLocked() {
  const uint64_t generation = RoutesGeneration(RoutesLocked());
  generation_.store(generation, std::memory_order_relaxed);
  if (observer_ != nullptr) observer_->RoutesApplied(generation);
}

uint64_t Router::generation() const { return generation_.load(std::memory_order_relaxed); }

Status Router::ReplaceRoutes(const Routes& routes) {
  std::map<std::string, RouteSplit, std::less<>> next;
  for (const auto& [layer, split] : routes) {
    if (layer.empty()) return InvalidArgumentError("routes: expected a layer name or '*', got an empty string");
    if (split.empty()) return InvalidArgumentError("routes " + layer + ": expected a split, got none");
    if (!next.emplace(layer, split).second) {
      return InvalidArgumentError("routes: expected each layer once, got '" + layer + "' twice");
    }
  }
  next.try_emplace(kDefaultRoute, DefaultSplit());
  WriterLock lock(mu_);
  if (observer_ != nullptr) {
    for (const auto& [layer, _] : routes_) {
      if (!next.contains(layer)) observer_->RouteChanged(layer, {});
    }
    for (const auto& [layer, split] : next) observer_->RouteChanged(layer, Resolved(split, default_math_));
  }
  routes_ = std::move(next);
  RoutesChangedLocked();
  return OkStatus();
}

Status Router::SetRoute(std::string_view layer, RouteSplit split) {
  if (layer.empty()) {
    return InvalidArgumentError("layer: expected a layer name or '*' (every layer without its own route), got an "
                                "empty string");
  }
  WriterLock lock(mu_);
  const bool is_default = layer == kDefaultRoute;
  if (split.empty() && is_default) split = DefaultSplit();
  if (split.empty()) {
    auto it = routes_.find(layer);
    if (it != routes_.end()) routes_.erase(it);
  } else {
    routes_.insert_or_assign(std::string(layer), split);
  }
  // Under the lock, so that the observer's view follows the order of the changes.
  if (observer_ != nullptr) observer_->RouteChanged(layer, Resolved(split, default_math_));
  RoutesChangedLocked();
  return OkStatus();
}

const RouteSplit& Router::RouteOfLocked(std::string_view layer) const {
  auto it = routes_.find(layer);
  if (it == routes_.end()) it = routes_.find(std::string_view(kDefaultRoute));
  return it->second;
}

RouteSplit Router::RouteOf(std::string_view layer) const {
  ReaderLock lock(mu_);
  return RouteOfLocked(layer);
}

Routes Router::AllRoutes() const {
  ReaderLock lock(mu_);
  return RoutesLocked();
}

RouteTarget Router::Choose(std::string_view layer, std::span<const Variant> held, Math default_math,
                           std::string_view request_key) const {
  // auto resolves to a held exact form (the factored form at least) in its math: every layer
  // can serve it in a math it holds.
  auto holds = [&](const RouteTarget& t) {
    const Math math = t.math.value_or(default_math);
    for (const Variant& h : held) {
      if (h.math == math && (t.is_auto() || h.form == *t.form)) return true;
    }
    return false;
  };
  // The factored form is always held (layer_store.h); it is the answer when no share applies.
  const RouteTarget fallback(Form::kFactored, default_math);
  // Drawn before the lock: the draw is the expensive part of an unkeyed request.
  const double point = request_key.empty() ? UniformDraw() : StickyPoint(request_key);
  ReaderLock lock(mu_);
  const RouteSplit& split = RouteOfLocked(layer);
  double total = 0;
  for (const auto& [target, share] : split) {
    if (holds(target)) total += share;
  }
  if (!(total > 0)) return fallback;
  // Cumulative shares in slot order: moving weight between two targets only moves the keys
  // whose points lie between the old and the new boundary.
  const double point_in_total = point * total;
  double cumulative = 0;
  RouteTarget last = fallback;
  for (const auto& [target, share] : split) {
    if (!holds(target)) continue;
    cumulative += share;
    last = Resolved(target, default_math);
    if (point_in_total < cumulative) return last;
  }
  return last;  // rounding left the point at the very top
}

RouteTarget Router::Choose(std::string_view layer, std::span<const Form> held, std::string_view request_key) const {
  std::vector<Variant> variants;
  for (Form f : held) variants.push_back({f, default_math_});
  RouteTarget chosen = Choose(layer, variants, default_math_, request_key);
  chosen.math.reset();  // one math: the target is a form (or auto) alone
  return chosen;
}

Status Router::SetShadowRate(double rate) {
  if (!std::isfinite(rate) || rate < 0 || rate > 1) {
    return InvalidArgumentError("shadow_rate: expected a fraction in [0, 1], got " + std::to_string(rate));
  }
  shadow_rate_.store(rate, std::memory_order_relaxed);
  return OkStatus();
}

std::optional<Variant> Router::ShadowMirror(std::span<const Variant> held, Variant served) const {
  const double rate = shadow_rate();
  if (!(rate > 0)) return std::nullopt;
  if (rate < 1 && UniformDraw() >= rate) return std::nullopt;
  std::vector<Variant> others;
  for (const Variant& v : held) {
    if (v != served) others.push_back(v);
  }
  if (others.empty()) return std::nullopt;
  const size_t pick = std::min(others.size() - 1, static_cast<size_t>(UniformDraw() * static_cast<double>(others.size())));
  return others[pick];
}

std::optional<Form> Router::ShadowMirror(std::span<const Form> held, Form served) const {
  std::vector<Variant> variants;
  for (Form f : held) variants.push_back({f, default_math_});
  const std::optional<Variant> mirror = ShadowMirror(variants, {served, default_math_});
  return mirror ? std::optional<Form>(mirror->form) : std::nullopt;
}

}  // namespace attnserve
