// attnserve-cli ab: the verdict of an A/B between a layer's forms, from the fleet's metrics
// (docs/ab.md). Reads counts (ab_source.h), compares each form with a baseline form
// (ab_stats.h), prints a table or JSON and exits with a status a script can branch on.
// Thread-safety: plain functions; one call at a time per AbArgs.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "client/cli/ab_source.h"
#include "client/cli/args.h"
#include "client/cli/ab_stats.h"

namespace attnserve::cli {

// Exit statuses of `ab` beyond kExitOk (decided: no difference larger than the MDE),
// kExitFailure (a source could not be read) and kExitUsage.
inline constexpr int kExitAbDifferent = 3;      // a significant difference in some layer
inline constexpr int kExitAbNotEnoughData = 4;  // no difference found yet, and too few requests to rule one out

struct AbArgs {
  std::string prometheus;            // --prometheus http://host:9090
  std::vector<std::string> metrics;  // --metrics URL[,URL...]
  std::string window;                // --window 1h (Prometheus: increase over it; empty: the raw counters)
  double window_seconds = 0;
  std::chrono::nanoseconds interval{0};  // --interval T (/metrics: scrape twice, T apart)
  std::string layer;                     // --layer L: only this layer
  std::string baseline = FormName(v1::FORM_FACTORED);  // --baseline F
  double alpha = 0.05;                   // --alpha: family-wise, split over the tests (Bonferroni)
  double power = 0.8;                    // --power
  double mde = 0.05;                     // --mde: the latency ratio that matters (0.05 = 5 %)
  double error_margin = 0.005;           // --error-margin: the error-ratio difference that matters
  double min_requests = 100;             // --min-requests per form before any verdict
  bool json = false;                     // --json: one JSON document instead of the table
  std::chrono::milliseconds timeout{10000};
  bool help = false;
};
bool ParseAbArgs(const std::vector<std::string>& args, AbArgs* out, std::string* error);
std::string AbDetails();

struct AbFormReport {
  std::string form;
  double requests = 0, errors = 0;
  ab::Interval error_ci;
  double latency_observations = 0;  // observations in the latency histogram used
  bool latency_includes_failures = false;
  ab::QuantileEstimate p50, p95, p99;  // seconds
  double divergence_observations = 0;
  ab::QuantileEstimate divergence_p50, divergence_p99;
  double flops = 0;  // in the window
};

struct AbPairReport {
  std::string baseline, form;
  ab::RatioComparison latency;      // form / baseline
  ab::DifferenceComparison errors;  // form - baseline
  std::string verdict;              // "different", "no_difference", "not_enough_data"
  std::string reason;               // one line for the operator
};

struct AbLayerReport {
  std::string layer;
  std::vector<AbFormReport> forms;
  std::vector<AbPairReport> pairs;
};

struct AbReport {
  std::string source;
  double window_seconds = 0;  // 0: since each process started
  double alpha = 0, alpha_per_test = 0, power = 0, mde = 0, error_margin = 0;
  int tests = 0;
  std::vector<AbLayerReport> layers;
  std::vector<std::string> notes;
  int exit_code = kExitAbNotEnoughData;
};

// The whole analysis of counts already read.
AbReport Analyze(const ab::LayerCounts& counts, const AbArgs& args, const std::string& source, double window_seconds);
std::string FormatAbText(const AbReport& report);
std::string FormatAbJson(const AbReport& report);

}  // namespace attnserve::cli
