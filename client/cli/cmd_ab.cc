// attnserve-cli ab (--prometheus URL [--window W] | --metrics URL[,URL...] [--interval T]) [...]
#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>

#include "client/cli/ab.h"
#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/commands.h"

namespace attnserve::cli {
namespace {

bool ParseFraction(const std::string& text, std::string_view what, double lo, double hi, bool open, double* out,
                   std::string* error) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  const bool inside = open ? (*out > lo && *out < hi) : (*out >= lo && *out <= hi);
  if (text.empty() || ec != std::errc() || p != end || !std::isfinite(*out) || !inside) {
    char range[64];
    std::snprintf(range, sizeof range, open ? "(%g, %g)" : "[%g, %g]", lo, hi);
    *error = std::string(what) + ": expected a number in " + range + ", got '" + text + "'";
    return false;
  }
  return true;
}

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string Num(double v, const char* fmt = "%.4g") {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string Ms(double seconds) { return Num(seconds * 1e3, "%.3g"); }

std::string Count(double v) {
  if (std::isinf(v)) return "inf";
  return Num(std::round(v), "%.0f");
}

std::string Percent(double v) { return Num(v * 100, "%.3g") + "%"; }

const AbFormReport* FindForm(const AbLayerReport& l, const std::string& form) {
  for (const AbFormReport& f : l.forms) {
    if (f.form == form) return &f;
  }
  return nullptr;
}

// Reads the counts the arguments name; false with *error when a source fails.
bool ReadCounts(const AbArgs& a, ab::LayerCounts* counts, std::string* source, double* window, std::string* error) {
  std::vector<ab::Sample> samples;
  if (!a.prometheus.empty()) {
    for (const auto& [name, promql] : ab::PrometheusQueries(a.window)) {
      std::string body;
      if (!ab::HttpGet(ab::PrometheusQueryUrl(a.prometheus, promql), a.timeout, &body, error)) return false;
      if (!ab::ParsePrometheusVector(body, name, &samples, error)) {
        *error = a.prometheus + ": " + promql + ": " + *error;
        return false;
      }
    }
    *source = "prometheus " + a.prometheus +
              (a.window.empty() ? " (counters since each process started)" : " (increase over " + a.window + ")");
    *window = a.window_seconds;
  } else {
    const auto scrape = [&](std::vector<ab::Sample>* out) {
      for (const std::string& url : a.metrics) {
        std::string body;
        if (!ab::HttpGet(url, a.timeout, &body, error)) return false;
        if (!ab::ParseExposition(body, url, out, error)) return false;
      }
      return true;
    };
    if (!scrape(&samples)) return false;
    *source = std::to_string(a.metrics.size()) + " /metrics endpoint(s)";
    *window = 0;
    if (a.interval.count() > 0) {
      std::this_thread::sleep_for(a.interval);
      std::vector<ab::Sample> after;
      if (!scrape(&after)) return false;
      samples = ab::Difference(samples, after);
      *window = std::chrono::duration<double>(a.interval).count();
      *source += ", two scrapes " + Num(*window) + " s apart";
    } else {
      *source += ", one scrape (counts since each process started)";
    }
  }
  *counts = ab::Aggregate(samples);
  return true;
}

}  // namespace

bool ParseAbArgs(const std::vector<std::string>& args, AbArgs* out, std::string* error) {
  FlagParser flags;
  std::string metrics, window, interval, alpha, power, mde, margin, min_requests, timeout;
  flags.AddString("prometheus", &out->prometheus, "URL", "a Prometheus server's base URL (http://host:9090)");
  flags.AddString("window", &window, "W", "with --prometheus: increase() over W (e.g. 1h); default: raw counters");
  flags.AddString("metrics", &metrics, "URL,...", "/metrics endpoints of the replicas, summed");
  flags.AddString("interval", &interval, "T", "with --metrics: scrape twice, T apart, and use the difference");
  flags.AddString("layer", &out->layer, "L", "only this layer");
  flags.AddString("baseline", &out->baseline, "F", "the form the others are compared with (default factored)");
  flags.AddString("alpha", &alpha, "A", "family-wise significance level, split over the tests (default 0.05)");
  flags.AddString("power", &power, "P", "power for the sample-size advice (default 0.8)");
  flags.AddString("mde", &mde, "R", "smallest latency ratio that matters, 0.05 = 5 % (default 0.05)");
  flags.AddString("error-margin", &margin, "D", "smallest error-ratio difference that matters (default 0.005)");
  flags.AddString("min-requests", &min_requests, "N", "requests per form before any verdict (default 100)");
  flags.AddString("timeout", &timeout, "T", "per HTTP request (default 10s)");
  flags.AddBool("json", &out->json, "print one JSON document instead of the table");
  std::vector<std::string> pos;
  if (!flags.Parse(args, &pos, &out->help, error)) return false;
  if (out->help) return true;
  if (!pos.empty()) {
    *error = "unexpected argument '" + pos[0] + "'";
    return false;
  }
  out->metrics = SplitCommas(metrics);
  if (out->prometheus.empty() == out->metrics.empty()) {
    *error = "expected exactly one of --prometheus URL and --metrics URL[,URL...]";
    return false;
  }
  if (!window.empty()) {
    if (out->prometheus.empty()) {
      *error = "--window: only with --prometheus (with --metrics, use --interval)";
      return false;
    }
    std::chrono::nanoseconds w{};
    if (!ParseDuration(window, "--window", &w, error)) return false;
    const int64_t seconds = std::chrono::duration_cast<std::chrono::seconds>(w).count();
    if (seconds < 1) {
      *error = "--window: expected at least 1s, got '" + window + "'";
      return false;
    }
    out->window = std::to_string(seconds) + "s";
    out->window_seconds = static_cast<double>(seconds);
  }
  if (!interval.empty()) {
    if (out->metrics.empty()) {
      *error = "--interval: only with --metrics (with --prometheus, use --window)";
      return false;
    }
    if (!ParseDuration(interval, "--interval", &out->interval, error)) return false;
  }
  if (!alpha.empty() && !ParseFraction(alpha, "--alpha", 0, 0.5, true, &out->alpha, error)) return false;
  if (!power.empty() && !ParseFraction(power, "--power", 0.5, 1, true, &out->power, error)) return false;
  if (!mde.empty() && !ParseFraction(mde, "--mde", 0, 10, true, &out->mde, error)) return false;
  if (!margin.empty() && !ParseFraction(margin, "--error-margin", 0, 1, true, &out->error_margin, error)) return false;
  if (!min_requests.empty() &&
      !ParseFraction(min_requests, "--min-requests", 2, 1e15, false, &out->min_requests, error)) {
    return false;
  }
  if (!timeout.empty()) {
    std::chrono::nanoseconds t{};
    if (!ParseDuration(timeout, "--timeout", &t, error)) return false;
    out->timeout = std::chrono::duration_cast<std::chrono::milliseconds>(t);
  }
  return true;
}

std::string AbDetails() {
  return std::string(
      "Compares each form of a layer with --baseline on the fleet's metrics: requests, error\n"
      "ratio (Wilson interval), latency p50/p95/p99 with order-statistic intervals, the latency\n"
      "ratio of geometric means (Welch on log latency) and the error-ratio difference (pooled\n"
      "z-test, Newcombe interval), each significant or not at --alpha split over the tests\n"
      "(Bonferroni), the shadow divergence quantiles, and the requests a decision still needs\n"
      "(--mde, --error-margin at --power). Latency counts OK calls only when the histogram has\n"
      "a `code` label; without one every call is counted and the output says so. docs/ab.md.\n"
      "  --prometheus URL     Prometheus's HTTP API; --window W: increase() over W\n"
      "  --metrics URL,...    /metrics of each replica, summed; --interval T: scrape twice\n"
      "  --layer L  --baseline F  --alpha A  --power P  --mde R  --error-margin D\n"
      "  --min-requests N  --timeout T  --json\n"
      "Exit status: 0 no difference larger than --mde/--error-margin (decided), 3 a significant\n"
      "difference, 4 not enough data yet (the output says how many more requests), 1 a source\n"
      "could not be read, 2 usage error.\n");
}

AbReport Analyze(const ab::LayerCounts& counts, const AbArgs& a, const std::string& source, double window_seconds) {
  AbReport r;
  r.source = source;
  r.window_seconds = window_seconds;
  r.alpha = a.alpha;
  r.power = a.power;
  r.mde = a.mde;
  r.error_margin = a.error_margin;
  // First the layers, forms and pairs, to know how many tests share alpha.
  for (const auto& [layer, forms] : counts) {
    if (!a.layer.empty() && layer != a.layer) continue;
    AbLayerReport l;
    l.layer = layer;
    for (const auto& [form, c] : forms) {
      if (form == "none") continue;  // refused before a form was chosen: no form's fault
      if (c.requests <= 0 && c.latency.count() <= 0) continue;
      AbFormReport f;
      f.form = form;
      f.requests = c.requests;
      f.errors = c.errors;
      f.latency_observations = c.latency.count();
      f.latency_includes_failures = c.latency_includes_failures;
      f.divergence_observations = c.divergence.count();
      f.flops = c.flops;
      l.forms.push_back(f);
    }
    std::string baseline = a.baseline;
    if (FindForm(l, baseline) == nullptr && !l.forms.empty()) {
      baseline = std::max_element(l.forms.begin(), l.forms.end(), [](const auto& x, const auto& y) {
                   return x.requests < y.requests;
                 })->form;
      r.notes.push_back(layer + ": no requests in form " + a.baseline + "; the baseline is " + baseline);
    }
    for (const AbFormReport& f : l.forms) {
      if (f.form != baseline) l.pairs.push_back({baseline, f.form, {}, {}, "", ""});
    }
    if (l.forms.size() < 2) r.notes.push_back(layer + ": only one form served; nothing to compare");
    r.tests += 2 * static_cast<int>(l.pairs.size());
    r.layers.push_back(std::move(l));
  }
  r.alpha_per_test = r.tests > 0 ? a.alpha / r.tests : a.alpha;
  const double confidence = 1 - r.alpha_per_test;
  bool any_different = false, any_short = r.tests == 0;
  for (AbLayerReport& l : r.layers) {
    const auto& forms = counts.at(l.layer);
    for (AbFormReport& f : l.forms) {
      const ab::FormCounts& c = forms.at(f.form);
      f.error_ci = ab::WilsonInterval({f.errors, f.requests}, r.alpha_per_test);
      f.p50 = ab::Quantile(c.latency, 0.5, confidence);
      f.p95 = ab::Quantile(c.latency, 0.95, confidence);
      f.p99 = ab::Quantile(c.latency, 0.99, confidence);
      f.divergence_p50 = ab::Quantile(c.divergence, 0.5, confidence);
      f.divergence_p99 = ab::Quantile(c.divergence, 0.99, confidence);
      if (c.latency_includes_failures) {
        r.notes.push_back(l.layer + "/" + f.form +
                          ": the latency histogram has no `code` label, so failed calls are in it (outcome "
                          "unknown): a form that fails fast looks faster");
      }
      const ab::LogMoments m = ab::LogMomentsOf(c.latency);
      if (m.n > 0 && m.open_ended / m.n > 0.01) {
        r.notes.push_back(l.layer + "/" + f.form + ": " + Percent(m.open_ended / m.n) +
                          " of the calls are in the histogram's open-ended first or last bucket");
      }
      if (m.n > 0 && m.widest_ratio - 1 > 2 * a.mde) {
        r.notes.push_back(l.layer + "/" + f.form + ": its calls fall in buckets up to x" + Num(m.widest_ratio, "%.3g") +
                          " wide, coarse for a " + Percent(a.mde) +
                          " effect: the test of equal latency holds, but the ratio's size describes the binned "
                          "calls (finer buckets make it the calls' own)");
      }
    }
    for (AbPairReport& p : l.pairs) {
      const ab::FormCounts& ca = forms.at(p.baseline);
      const ab::FormCounts& cb = forms.at(p.form);
      p.latency = ab::CompareLogMeans(ab::LogMomentsOf(ca.latency), ab::LogMomentsOf(cb.latency), r.alpha_per_test,
                                      a.power, a.mde);
      p.errors = ab::CompareProportions({ca.errors, ca.requests}, {cb.errors, cb.requests}, r.alpha_per_test, a.power,
                                        a.error_margin);
      const double fewest = std::min({ca.requests, cb.requests, ca.latency.count(), cb.latency.count()});
      if (fewest < a.min_requests) {
        p.verdict = "not_enough_data";
        p.reason = "a form has " + Count(fewest) + " requests, under --min-requests " + Count(a.min_requests);
        any_short = true;
      } else if (p.latency.significant || p.errors.significant) {
        p.verdict = "different";
        std::string why;
        if (p.latency.significant) {
          why = p.form + " is " + Percent(std::fabs(p.latency.ratio - 1)) +
                (p.latency.ratio > 1 ? " slower" : " faster") + " than " + p.baseline + " (geometric mean)" +
                (std::fabs(std::log(p.latency.ratio)) < std::log1p(a.mde)
                     ? ", less than the --mde " + Percent(a.mde) + " said to matter"
                     : "");
        }
        if (p.errors.significant) {
          why += (why.empty() ? "" : "; ") + p.form + "'s error ratio is " +
                 Num(std::fabs(p.errors.difference) * 100, "%.3g") + " points " +
                 (p.errors.difference > 0 ? "above " : "below ") + p.baseline + "'s";
        }
        p.reason = why;
        any_different = true;
      } else if (p.latency.more_needed > 0 || p.errors.more_needed > 0) {
        p.verdict = "not_enough_data";
        p.reason = "no difference found yet; " + Count(std::max(p.latency.more_needed, p.errors.more_needed)) +
                   " more requests (at today's split) to find a " + Percent(a.mde) + " latency ratio and a " +
                   Num(a.error_margin * 100, "%.3g") + "-point error difference with power " + Num(a.power);
        any_short = true;
      } else {
        p.verdict = "no_difference";
        p.reason = "no difference as large as " + Percent(a.mde) + " in latency or " +
                   Num(a.error_margin * 100, "%.3g") + " points in error ratio (power " + Num(a.power) + ")";
      }
    }
  }
  if (r.tests == 0) r.notes.push_back("no layer served two forms: nothing to decide");
  r.exit_code = any_different ? kExitAbDifferent : any_short ? kExitAbNotEnoughData : kExitOk;
  return r;
}

std::string FormatAbText(const AbReport& r) {
  std::ostringstream o;
  o << "source: " << r.source << "\n";
  o << "alpha " << Num(r.alpha) << " over " << r.tests << " tests (" << Num(r.alpha_per_test)
    << " each, Bonferroni), power " << Num(r.power) << ", mde " << Percent(r.mde) << " latency, "
    << Num(r.error_margin * 100, "%.3g") << " points error ratio\n";
  const std::string ci = Num(100 * (1 - r.alpha_per_test), "%.4g") + "% CI";
  for (const AbLayerReport& l : r.layers) {
    o << "\nlayer " << l.layer << "\n";
    char line[512];
    std::snprintf(line, sizeof line, "  %-9s %10s %8s  %-30s  %-26s  %-26s  %-26s\n", "form", "requests", "errors",
                  ("error ratio [" + ci + "]").c_str(), "p50 ms [CI]", "p95 ms [CI]", "p99 ms [CI]");
    o << line;
    for (const AbFormReport& f : l.forms) {
      const auto q = [](const ab::QuantileEstimate& e) {
        return e.valid ? Ms(e.value) + " [" + Ms(e.ci.lo) + ", " + Ms(e.ci.hi) + "]" : std::string("-");
      };
      const std::string err = Percent(f.requests > 0 ? f.errors / f.requests : 0) + " [" + Percent(f.error_ci.lo) +
                              ", " + Percent(f.error_ci.hi) + "]";
      std::snprintf(line, sizeof line, "  %-9s %10s %8s  %-30s  %-26s  %-26s  %-26s%s\n", f.form.c_str(),
                    Count(f.requests).c_str(), Count(f.errors).c_str(), err.c_str(), q(f.p50).c_str(), q(f.p95).c_str(),
                    q(f.p99).c_str(), f.latency_includes_failures ? "  (latency: all outcomes)" : "");
      o << line;
    }
    for (const AbFormReport& f : l.forms) {
      if (f.divergence_observations > 0) {
        o << "  shadow divergence (" << f.form << " as mirror, " << Count(f.divergence_observations)
          << " runs): rel_l2 p50 " << Num(f.divergence_p50.value) << " p99 " << Num(f.divergence_p99.value)
          << " [<= " << Num(f.divergence_p99.ci.hi) << "]\n";
      }
      if (f.flops > 0 && r.window_seconds > 0) {
        o << "  computed by " << f.form << ": " << Num(f.flops / r.window_seconds / 1e9)
          << " GFLOP/s (served and mirrored calls)\n";
      }
    }
    for (const AbPairReport& p : l.pairs) {
      o << "  latency " << p.form << "/" << p.baseline << ": ratio " << Num(p.latency.ratio) << " [" << ci << " "
        << Num(p.latency.ci.lo) << ", " << Num(p.latency.ci.hi) << "] p=" << Num(p.latency.p_value, "%.3g")
        << (p.latency.significant ? " significant" : " not significant") << "; detectable now "
        << Percent(p.latency.detectable_now) << "\n";
      o << "  errors " << p.form << "-" << p.baseline << ": " << Num(p.errors.difference * 100, "%+.3g") << " points ["
        << Num(p.errors.ci.lo * 100, "%.3g") << ", " << Num(p.errors.ci.hi * 100, "%.3g")
        << "] p=" << Num(p.errors.p_value, "%.3g") << (p.errors.significant ? " significant" : " not significant")
        << "\n";
      o << "  verdict " << p.form << " vs " << p.baseline << ": " << p.verdict << ": " << p.reason << "\n";
    }
  }
  for (const std::string& n : r.notes) o << "note: " << n << "\n";
  o << "exit " << r.exit_code << ": "
    << (r.exit_code == kExitAbDifferent ? "a significant difference"
        : r.exit_code == kExitOk        ? "decided: no difference that matters"
                                        : "not enough data yet")
    << "\n";
  return o.str();
}

std::string FormatAbJson(const AbReport& r) {
  using nlohmann::json;
  const auto finite = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  const auto interval = [&](const ab::Interval& i) { return json::array({finite(i.lo), finite(i.hi)}); };
  const auto quantile = [&](const ab::QuantileEstimate& q) {
    return q.valid ? json{{"value", finite(q.value)}, {"ci", interval(q.ci)}} : json(nullptr);
  };
  json j{{"source", r.source},     {"window_seconds", r.window_seconds},
         {"alpha", r.alpha},       {"alpha_per_test", r.alpha_per_test},
         {"tests", r.tests},       {"power", r.power},
         {"mde", r.mde},           {"error_margin", r.error_margin},
         {"notes", r.notes},       {"exit_code", r.exit_code},
         {"layers", json::array()}};
  for (const AbLayerReport& l : r.layers) {
    json jl{{"layer", l.layer}, {"forms", json::array()}, {"comparisons", json::array()}};
    for (const AbFormReport& f : l.forms) {
      jl["forms"].push_back(
          {{"form", f.form},
           {"requests", f.requests},
           {"errors", f.errors},
           {"error_ratio", f.requests > 0 ? f.errors / f.requests : 0.0},
           {"error_ratio_ci", interval(f.error_ci)},
           {"latency_observations", f.latency_observations},
           {"latency_includes_failures", f.latency_includes_failures},
           {"latency_seconds", {{"p50", quantile(f.p50)}, {"p95", quantile(f.p95)}, {"p99", quantile(f.p99)}}},
           {"shadow_runs", f.divergence_observations},
           {"shadow_divergence", {{"p50", quantile(f.divergence_p50)}, {"p99", quantile(f.divergence_p99)}}},
           {"flops", f.flops},
           {"flops_per_second", r.window_seconds > 0 ? json(f.flops / r.window_seconds) : json(nullptr)}});
    }
    for (const AbPairReport& p : l.pairs) {
      jl["comparisons"].push_back({{"baseline", p.baseline},
                                   {"form", p.form},
                                   {"latency_ratio", finite(p.latency.ratio)},
                                   {"latency_ratio_ci", interval(p.latency.ci)},
                                   {"latency_p_value", p.latency.p_value},
                                   {"latency_significant", p.latency.significant},
                                   {"latency_needed_total", finite(p.latency.needed_total)},
                                   {"latency_more_needed", finite(p.latency.more_needed)},
                                   {"latency_detectable_now", finite(p.latency.detectable_now)},
                                   {"error_difference", p.errors.difference},
                                   {"error_difference_ci", interval(p.errors.ci)},
                                   {"error_p_value", p.errors.p_value},
                                   {"error_significant", p.errors.significant},
                                   {"error_needed_total", finite(p.errors.needed_total)},
                                   {"error_more_needed", finite(p.errors.more_needed)},
                                   {"verdict", p.verdict},
                                   {"reason", p.reason}});
    }
    j["layers"].push_back(std::move(jl));
  }
  return j.dump(2) + "\n";
}

int RunAb(CommandContext& ctx, const std::vector<std::string>& args) {
  AbArgs a;
  std::string error;
  if (!ParseAbArgs(args, &a, &error)) return ctx.UsageError("ab", error);
  ab::LayerCounts counts;
  std::string source;
  double window = 0;
  if (!ReadCounts(a, &counts, &source, &window, &error)) {
    ctx.err() << "error: " << error << "\n";
    return kExitFailure;
  }
  if (!a.layer.empty() && !counts.count(a.layer)) {
    ctx.err() << "error: --layer: no series of layer '" << a.layer << "' in " << source << "\n";
    return kExitFailure;
  }
  const AbReport report = Analyze(counts, a, source, window);
  ctx.out() << (a.json ? FormatAbJson(report) : FormatAbText(report));
  return report.exit_code;
}

}  // namespace attnserve::cli
