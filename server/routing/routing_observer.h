// RoutingObserver: what routing reports (the current split, shadow comparisons and drops), so
// that metrics (server/metrics) records them without routing depending on Prometheus.
// Header-only.
// Thread-safety: an implementation must accept calls from any thread at once; calls must be
// cheap and must not call back into routing (RouteChanged runs under the router's lock).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/batching/divergence.h"
#include "server/core/form_table.h"
#include "server/core/forms.h"
#include "server/core/math.h"

namespace attnserve {

// Where a route sends a request: a form, or auto (no form: the exact form the cost model picks
// for the request, resolved by the call path, server/service/auto_form.h), in a math or in the
// layer's default one. Converts from a Form. Written FORM[@MATH] ("summed@bf16", "auto@fp32").
struct RouteTarget {
  std::optional<Form> form;  // nullopt: auto
  std::optional<Math> math;  // nullopt: the layer's default math (Layer::default_math)

  RouteTarget() = default;  // auto
  RouteTarget(Form f) : form(f) {}  // NOLINT(google-explicit-constructor): a form is a target
  RouteTarget(std::optional<Form> f, std::optional<Math> m) : form(f), math(m) {}
  static RouteTarget Auto() { return {}; }
  bool is_auto() const { return !form; }
  // "factored", "summed", "lowrank" or "auto": the metrics' form label.
  std::string_view name() const { return form ? FormName(*form) : kAutoChoice.name; }
  // FORM or FORM@MATH, as routes are written.
  std::string label() const {
    return std::string(name()) + (math ? "@" + std::string(MathName(*math)) : std::string());
  }
  friend bool operator==(const RouteTarget&, const RouteTarget&) = default;
};

// One layer's split: (target, share) with shares > 0 summing to 1, in Form order with auto last
// (within a form: its maths in Math order, then the default math), each target once.
using RouteSplit = std::vector<std::pair<RouteTarget, double>>;

class RoutingObserver {
 public:
  virtual ~RoutingObserver() = default;
  // The split of `layer` ("*": the default of every layer without its own) is now `split`
  // (fractions summing to 1, one entry per target with a positive share); empty: removed.
  virtual void RouteChanged(std::string_view layer, const RouteSplit& split) = 0;
  // Every route change ends with the generation of the routes now applied (RoutesGeneration).
  virtual void RoutesApplied(uint64_t generation) = 0;
  // A routes file (--routes-file) was read: applied (`ok`), or refused and the routes kept.
  virtual void RoutesFileLoaded(bool ok) = 0;
  // A shadow run of `mirror` finished and its output was compared with the served one.
  virtual void ShadowCompared(std::string_view layer, Variant mirror, const DivergenceStats& divergence) = 0;
  // A shadow run was not done: its queue was full, or it failed.
  virtual void ShadowDropped(std::string_view layer) = 0;
};

}  // namespace attnserve
