// attnserve-cli route: shows or changes the server's A/B split and shadow rate (SetRouting,
// GetRouting; docs/metrics.md). The parsing is here, free of I/O, for the unit tests.
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"

namespace attnserve::cli {

struct RouteArgs {
  std::string layer;                      // empty: no route changes
  std::vector<v1::RouteWeight> weights;   // the split; empty with clear
  bool clear = false;                     // --clear: remove LAYER's own route
  std::optional<double> shadow_rate;      // --shadow-rate R
  bool change() const { return !layer.empty() || shadow_rate.has_value(); }
};

// `route [LAYER (SPEC | --clear)] [--shadow-rate R]`. SPEC is FORM:WEIGHT[,FORM:WEIGHT...] with
// FORM factored, summed, lowrank or auto and WEIGHT >= 0 (e.g. factored:90,summed:10). Errors name
// the argument, what was expected and what came.
bool ParseRouteArgs(const std::vector<std::string>& args, RouteArgs* out, std::string* error);
// "factored:90,summed:10": the weights as percentages of their sum.
std::string FormatRoute(const v1::Route& route);
std::string RouteDetails();

}  // namespace attnserve::cli
