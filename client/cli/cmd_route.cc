// attnserve-cli route [LAYER (SPEC | --clear)] [--shadow-rate R]
#include "client/cli/cmd_route.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "client/cli/args.h"
#include "client/cli/commands.h"

namespace attnserve::cli {
namespace {

bool ParseNumber(std::string_view text, double* out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return !text.empty() && ec == std::errc() && p == end && std::isfinite(*out);
}

bool ParseSpec(std::string_view spec, std::vector<v1::RouteWeight>* out, std::string* error) {
  const std::string expected =
      "SPEC: expected FORM:WEIGHT[,FORM:WEIGHT...] with FORM factored, summed, lowrank or auto, optionally "
      "@MATH (a math the layer is held in, e.g. bf16), and WEIGHT >= 0 (e.g. factored:90,summed:10 or "
      "factored@bf16:90,factored@fp32:10), got '" + std::string(spec) + "'";
  if (spec.empty()) {
    *error = expected;
    return false;
  }
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t comma = spec.find(',', start);
    const std::string_view item = spec.substr(start, comma == std::string_view::npos ? spec.npos : comma - start);
    start = comma == std::string_view::npos ? spec.size() + 1 : comma + 1;
    const size_t colon = item.find(':');
    const std::string_view target = item.substr(0, colon);
    const size_t at = target.find('@');
    const std::string_view math = at == std::string_view::npos ? std::string_view() : target.substr(at + 1);
    v1::Form form = v1::FORM_UNSPECIFIED;
    double weight = 0;
    std::string form_error;
    // The maths' names are the server's vocabulary: it judges them (SetRouting's error names
    // the ones it knows), so a client older than the server routes to a math added since.
    if (colon == std::string_view::npos || !ParseForm(target.substr(0, at), &form, &form_error) ||
        form == v1::FORM_UNSPECIFIED || (at != std::string_view::npos && math.empty()) ||
        !ParseNumber(item.substr(colon + 1), &weight) || weight < 0) {
      *error = expected + " (at '" + std::string(item) + "')";
      return false;
    }
    v1::RouteWeight w;
    w.set_form(form);
    w.set_weight(weight);
    w.set_math(std::string(math));
    out->push_back(w);
  }
  return true;
}

}  // namespace

bool ParseRouteArgs(const std::vector<std::string>& args, RouteArgs* out, std::string* error) {
  FlagParser flags;
  std::string shadow;
  flags.AddString("shadow-rate", &shadow, "R", "mirror this fraction of requests to another held form (0..1)");
  flags.AddBool("clear", &out->clear, "remove LAYER's own route (the default '*' then applies)");
  std::vector<std::string> pos;
  bool help = false;
  if (!flags.Parse(args, &pos, &help, error)) return false;
  if (flags.Seen("shadow-rate")) {
    double rate = 0;
    if (!ParseNumber(shadow, &rate) || rate < 0 || rate > 1) {
      *error = "--shadow-rate: expected a fraction in [0, 1], got '" + shadow + "'";
      return false;
    }
    out->shadow_rate = rate;
  }
  if (pos.size() > 2) {
    *error = "unexpected argument '" + pos[2] + "'";
    return false;
  }
  if (!pos.empty()) out->layer = pos[0];
  if (out->clear) {
    if (pos.size() != 1) {
      *error = pos.empty() ? "--clear: expected a LAYER whose route to remove" : "--clear: expected no SPEC, got '" +
                                                                                    pos[1] + "'";
      return false;
    }
    return true;
  }
  if (pos.size() == 1) {
    *error = "missing SPEC after LAYER '" + pos[0] + "' (e.g. factored:90,summed:10; or --clear)";
    return false;
  }
  if (pos.size() == 2 && !ParseSpec(pos[1], &out->weights, error)) return false;
  return true;
}

std::string FormatRoute(const v1::Route& route) {
  double total = 0;
  for (const v1::RouteWeight& w : route.weights()) total += w.weight();
  std::string text;
  for (const v1::RouteWeight& w : route.weights()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4g", total > 0 ? 100 * w.weight() / total : 0.0);
    text += (text.empty() ? "" : ",") + FormName(w.form()) + (w.math().empty() ? "" : "@" + w.math()) + ":" + buf;
  }
  return text.empty() ? "-" : text;
}

std::string RouteDetails() {
  return std::string(
      "Without arguments, prints the routing in force. With LAYER SPEC, sets how requests to\n"
      "LAYER that leave the form unspecified are split (LAYER '*' is the default of every layer\n"
      "without its own route); SPEC is FORM[@MATH]:WEIGHT[,...], e.g. factored:90,summed:10, or\n"
      "factored@bf16:90,factored@fp32:10 on a server holding its layers in two maths.\n"
      "Requests with a request key keep their form while the split stays put.\n"
      "  --clear           remove LAYER's own route ('*': back to factored only)\n"
      "  --shadow-rate R   also run this fraction of requests by another held form, off the\n"
      "                    request path, and record the divergence (0 turns it off)\n"
      "Changing needs the admin token when the server has one, and changes that one process:\n"
      "a fleet shares one split through the servers' --routes-file, and a server that follows\n"
      "one refuses a route change (FAILED_PRECONDITION naming the file; --shadow-rate still\n"
      "works). Prints 'route LAYER: SPEC' lines (the default first) and 'shadow_rate: R'.\n");
}

int RunRoute(CommandContext& ctx, const std::vector<std::string>& args) {
  RouteArgs ra;
  std::string error;
  if (!ParseRouteArgs(args, &ra, &error)) return ctx.UsageError("route", error);
  v1::RoutingInfo info;
  if (ra.change()) {
    v1::SetRoutingRequest request;
    request.set_layer(ra.layer);
    for (const v1::RouteWeight& w : ra.weights) *request.add_weights() = w;
    if (ra.shadow_rate) request.set_shadow_rate(*ra.shadow_rate);
    if (grpc::Status s = ctx.client().SetRouting(request, &info); !s.ok()) return ctx.Fail(s);
  } else if (grpc::Status s = ctx.client().GetRouting(&info); !s.ok()) {
    return ctx.Fail(s);
  }
  for (const v1::Route& r : info.routes()) ctx.out() << "route " << r.layer() << ": " << FormatRoute(r) << "\n";
  char rate[32];
  std::snprintf(rate, sizeof rate, "%.6g", info.shadow_rate());
  ctx.out() << "shadow_rate: " << rate << "\n";
  return kExitOk;
}

}  // namespace attnserve::cli
