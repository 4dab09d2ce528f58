// Where `attnserve-cli ab` reads its counts: /metrics endpoints (the Prometheus text format,
// scraped once or twice and summed over replicas) or a Prometheus server's HTTP API
// (increase() over a window, or the raw counters). Both end in the same per-layer, per-form
// counts (FormCounts), through the same aggregation (Aggregate).
// HTTP only (http://host:port/path, plain HTTP/1.1 GET, blocking, with a timeout); https and
// basic auth are for a later step. Thread-safety: pure functions, except HttpGet's socket.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "client/cli/ab_stats.h"

namespace attnserve::cli::ab {

// One sample line: a series (name and labels) and its value. `origin` names where it came from
// (an endpoint, or Prometheus's series identity: instance, job, pod, ...), so that histograms
// from replicas with different bucket layouts are never added bucket by bucket.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
  std::string origin;
};

// GET `url` (http://host[:port]/path?query). On success the body; otherwise false with *error
// naming the URL and what failed (connect, status line, HTTP status).
bool HttpGet(const std::string& url, std::chrono::milliseconds timeout, std::string* body, std::string* error);

// The Prometheus text exposition format (what /metrics serves): sample lines only, comments and
// HELP/TYPE skipped. Errors name the line.
bool ParseExposition(std::string_view text, const std::string& origin, std::vector<Sample>* out, std::string* error);

// Keeps the series of the families `ab` reads.
bool IsAbSeries(std::string_view name);

// The change of each series from `before` to `after` (same origin): after - before, or after
// alone when the counter went down (the process restarted) or the series is new.
std::vector<Sample> Difference(const std::vector<Sample>& before, const std::vector<Sample>& after);

// A Prometheus HTTP API instant-query response (resultType "vector"): one Sample per result,
// named `name`, with `origin` the result's labels other than layer, form, math, code and le.
bool ParsePrometheusVector(std::string_view json, const std::string& name, std::vector<Sample>* out,
                           std::string* error);
// The queries the Prometheus source runs: each family's series, raw (window empty) or as
// increase(...[window]). Pairs of (series name, PromQL).
std::vector<std::pair<std::string, std::string>> PrometheusQueries(const std::string& window);
// `base` (http://host:port) + /api/v1/query?query=<escaped promql>.
std::string PrometheusQueryUrl(const std::string& base, const std::string& promql);

// What one form of one layer did in the window.
struct FormCounts {
  double requests = 0;  // attnserve_requests_total, every code
  double errors = 0;    // code != "OK"
  Buckets latency;      // attnserve_request_duration_seconds: OK calls when it has a code label
  // True when some origin's latency histogram has no `code` label: its failed calls are in.
  bool latency_includes_failures = false;
  Buckets divergence;  // attnserve_shadow_divergence, this form as the mirror
  double flops = 0;    // attnserve_flops_total
};
// layer -> arm -> counts: an arm is a form ("factored"), or FORM@MATH ("factored@bf16") on a layer
// whose series carry more than one math. Forms "none" (calls refused before a form was known)
// are kept apart by the caller.
using LayerCounts = std::map<std::string, std::map<std::string, FormCounts>>;

// Sums samples over origins and every label but layer, form, math and (for latency) code. Histograms
// are merged on the bucket bounds every origin has (cumulative counts there are exact).
LayerCounts Aggregate(const std::vector<Sample>& samples);

}  // namespace attnserve::cli::ab
