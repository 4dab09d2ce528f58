// Router: which form serves a request that left the form unspecified, and whether it is also
// mirrored to another form (the shadow policy). The A/B of docs/metrics.md: per-layer split
// weights ("factored:90,summed:10"), sticky on the request key, random without one.
//
// Routes are keyed by layer name; "*" is the default for every layer without its own, and is
// "factored:100" until set. Forms a layer does not hold are skipped when choosing (the split is
// renormalised over the held ones), so a route may name forms some layers lack.
// Thread-safety: every method may be called from any thread; Choose and ShadowMirror take a
// shared lock only, SetRoute an exclusive one.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/forms.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/routing/routing_observer.h"

namespace attnserve {

// Every route of a router, LAYER ("*" for the default) → split.
using Routes = std::vector<std::pair<std::string, RouteSplit>>;

inline constexpr char kDefaultRoute[] = "*";

// Checks (each target at most once, weights finite and >= 0, at least one positive) and
// normalises raw weights into a split. INVALID_ARGUMENT naming `what`, expected and got.
StatusOr<RouteSplit> MakeRouteSplit(const std::vector<std::pair<RouteTarget, double>>& weights, std::string_view what);
// Parses "factored:90,summed:10", "summed:50,auto:50" or, naming the math of each (a served
// variant, server/core/math.h), "factored@bf16:90,factored@fp32:10" (weights are non-negative
// numbers, normalised to shares; a target may be left out or given 0; a target without @MATH is
// served in the layer's default math). INVALID_ARGUMENT naming `what`, expected and got: unknown
// form or math, bad or negative weight, a target twice, every weight 0, an empty spec.
StatusOr<RouteSplit> ParseRouteSpec(std::string_view spec, std::string_view what = "route");
// "factored:90,summed:10" with the shares as percentages (at most 4 significant digits).
std::string FormatRouteSpec(const RouteSplit& split);
// Splits "LAYER=SPEC" ("*=SPEC" for the default) and parses the SPEC; `what` names the flag.
StatusOr<std::pair<std::string, RouteSplit>> ParseRouteFlag(std::string_view flag, std::string_view what = "--route");

// 64-bit FNV-1a of the bytes: the sticky hash, fixed so that every replica and every restart
// sends a key to the same form (std::hash promises neither).
uint64_t Fnv1a64(std::string_view bytes);
// A request key's point in [0, 1): FNV-1a, then a 64-bit finaliser so that keys differing in
// the last byte spread over the whole interval.
double StickyPoint(std::string_view key);

// The routes as canonical text: one "LAYER=FORM:PERCENT,..." line per route, sorted by layer,
// the default included (factored:100 when absent), percentages to 6 significant digits. Two
// route sets that split every layer alike give the same text, however they were written.
std::string CanonicalRoutesText(const Routes& routes);
// FNV-1a 64 of CanonicalRoutesText, its top 53 bits: the same on every process and restart
// that applies the same routes, and exact as a double (attnserve_routes_generation).
uint64_t RoutesGeneration(const Routes& routes);

class Router {
 public:
  // `observer` (may be null) hears every route change, each target's math resolved to
  // `default_math` where the route named none; it is told the default route at once.
  // `default_math`: the backend's (Backend::default_math), what a target without @MATH means.
  explicit Router(RoutingObserver* observer = nullptr, Math default_math = Math::kFp32);

  // Sets the split of `layer` ("*" = the default). An empty split removes the layer's own route
  // (for "*": back to factored:100). INVALID_ARGUMENT for an empty layer name.
  Status SetRoute(std::string_view layer, RouteSplit split);
  // Replaces every route at once (a routes file): requests see the old routes or the new ones,
  // never a mix. Routes absent from `routes` are removed; "*" absent means factored:100.
  // INVALID_ARGUMENT (nothing changed) for an empty layer name, an empty split or a layer twice.
  Status ReplaceRoutes(const Routes& routes);
  // The split `layer` is routed by: its own, else the default.
  RouteSplit RouteOf(std::string_view layer) const;
  // Every configured route, the default first.
  Routes AllRoutes() const;
  // RoutesGeneration of the routes now applied.
  uint64_t generation() const;

  // The target for a request to `layer` holding the variants `held` (non-empty), its math
  // resolved (a target without one: `default_math`, the layer's): a held variant, or auto in a
  // held math (it resolves to a held exact form). Targets the layer does not hold are skipped
  // and the split renormalised over the rest. With a non-empty `request_key` the choice is a
  // function of the key and the split; otherwise random.
  RouteTarget Choose(std::string_view layer, std::span<const Variant> held, Math default_math,
                     std::string_view request_key) const;
  // The same for a layer holding `held` in the router's default math alone.
  RouteTarget Choose(std::string_view layer, std::span<const Form> held, std::string_view request_key) const;

  // The fraction of served requests mirrored to another form, in [0, 1].
  Status SetShadowRate(double rate);
  double shadow_rate() const { return shadow_rate_.load(std::memory_order_relaxed); }
  // With probability shadow_rate(), another held variant (uniformly among them: another form,
  // or the same form in another math) to mirror a request served by `served`; nullopt
  // otherwise or when the layer holds no other variant.
  std::optional<Variant> ShadowMirror(std::span<const Variant> held, Variant served) const;
  // The same among forms held in the router's default math alone.
  std::optional<Form> ShadowMirror(std::span<const Form> held, Form served) const;

 private:
  const RouteSplit& RouteOfLocked(std::string_view layer) const ATTNSERVE_REQUIRES_SHARED(mu_);
  Routes RoutesLocked() const ATTNSERVE_REQUIRES_SHARED(mu_);
  // Recomputes the generation and tells the observer; after every change, under the lock.
  void RoutesChangedLocked() ATTNSERVE_REQUIRES(mu_);

  RoutingObserver* const observer_;
  const Math default_math_;
  mutable SharedMutex mu_;
  std::map<std::string, RouteSplit, std::less<>> routes_ ATTNSERVE_GUARDED_BY(mu_);  // always holds "*"
  std::atomic<uint64_t> generation_{0};
  std::atomic<double> shadow_rate_{0.0};
};

}  // namespace attnserve
