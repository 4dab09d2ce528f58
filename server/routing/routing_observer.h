// RoutingObserver: what routing reports (the current split, shadow comparisons and drops), so
// that metrics (server/metrics) records them without routing depending on Prometheus.
// Header-only.
// Thread-safety: an implementation must accept calls from any thread at once; calls must be
// cheap and must not call back into routing (RouteChanged runs under the router's lock).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "server/batching/divergence.h"
#include "server/core/forms.h"

namespace attnserve {

class RoutingObserver {
 public:
  virtual ~RoutingObserver() = default;
  // The split of `layer` ("*": the default of every layer without its own) is now `split`
  // (fractions summing to 1, one entry per form with a positive share); empty: removed.
  virtual void RouteChanged(std::string_view layer, const std::vector<std::pair<Form, double>>& split) = 0;
  // Every route change ends with the generation of the routes now applied (RoutesGeneration).
  virtual void RoutesApplied(uint64_t generation) = 0;
  // A routes file (--routes-file) was read: applied (`ok`), or refused and the routes kept.
  virtual void RoutesFileLoaded(bool ok) = 0;
  // A shadow run of `mirror` finished and its output was compared with the served one.
  virtual void ShadowCompared(std::string_view layer, Form mirror, const DivergenceStats& divergence) = 0;
  // A shadow run was not done: its queue was full, or it failed.
  virtual void ShadowDropped(std::string_view layer) = 0;
};

}  // namespace attnserve
