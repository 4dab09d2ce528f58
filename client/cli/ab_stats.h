// The statistics of `attnserve-cli ab` (docs/ab.md): what two forms' histogram buckets and
// request counters say about their difference. The data are Prometheus histogram buckets, not
// raw samples, so every method here works on bucket counts:
//   - a quantile's confidence interval by the order-statistic (binomial) method, widened to the
//     edges of the buckets the two ranks fall in;
//   - latency compared as the ratio of geometric means: Welch's z-test on log latency, each
//     observation taken at its bucket's geometric midpoint (the binning's variance stays in);
//   - error ratios compared as a difference of proportions (pooled z-test, Newcombe's interval
//     from Wilson intervals);
//   - the sample size a decision needs, for a minimum detectable effect at a stated power, at
//     the forms' current split.
// Pure functions of their arguments: no I/O, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnserve::cli::ab {

// One histogram: cumulative counts at increasing upper bounds; the last bound is +Inf.
struct Buckets {
  std::vector<double> upper;       // strictly increasing, back() == +Inf
  std::vector<double> cumulative;  // non-decreasing, same size
  double count() const { return cumulative.empty() ? 0.0 : cumulative.back(); }
};

// The exponential bounds of the server's latency histogram: `start` times factor^i while at
// most `end` (and +Inf). Used by the tests to bin synthetic samples as the server does.
std::vector<double> ExponentialBounds(double start, double factor, double end);
// Samples binned into `upper` (which ends with +Inf): the cumulative counts.
Buckets Bin(const std::vector<double>& samples, const std::vector<double>& upper);

// The standard normal's CDF and its inverse (Acklam's approximation with one Newton step,
// |error| < 1e-12 over (0, 1)).
double NormalCdf(double x);
double NormalQuantile(double p);

struct Interval {
  double lo = 0, hi = 0;
};

struct QuantileEstimate {
  double value = 0;    // linear interpolation within the bucket, as PromQL's histogram_quantile
  Interval ci;         // bucket edges around the order statistics' ranks; hi may be +Inf
  bool valid = false;  // false when there are no observations
};
// The q-quantile of `b` with a two-sided `confidence` interval: the ranks n*q -/+ z*sqrt(n q (1-q))
// (the normal approximation of the binomial count below the quantile), each mapped to its bucket,
// the lower rank to the bucket's lower edge and the upper rank to its upper edge.
QuantileEstimate Quantile(const Buckets& b, double q, double confidence);

// Moments of log(x) with each observation at its bucket's geometric midpoint. The first bucket
// (0, u0] and the +Inf bucket use the neighbouring bucket's ratio to place a midpoint; `open_ended`
// counts the observations in those two buckets (the estimate is less sure when many are).
struct LogMoments {
  double n = 0;
  double mean = 0;
  double variance = 0;  // unbiased (n - 1)
  double open_ended = 0;
  double widest_ratio = 1;  // the largest upper/lower bound ratio of a bucket that holds observations
};
LogMoments LogMomentsOf(const Buckets& b);

// Welch's test on log latency: B against A (the baseline).
struct RatioComparison {
  double ratio = 1;  // geometric mean of B / geometric mean of A
  Interval ci;       // of the ratio, at 1 - alpha
  double p_value = 1;
  bool significant = false;
  // Total requests (both forms, at their current shares) needed to find a ratio of 1 + mde with
  // `power` at `alpha`, from the observed variances; and how many more than now.
  double needed_total = 0;
  double more_needed = 0;
  double detectable_now = 0;  // the relative effect found with `power` at today's counts
};
RatioComparison CompareLogMeans(const LogMoments& a, const LogMoments& b, double alpha, double power, double mde);

// Errors out of requests.
struct Proportion {
  double errors = 0, requests = 0;
  double ratio() const { return requests > 0 ? errors / requests : 0.0; }
};
// Wilson's score interval at 1 - alpha.
Interval WilsonInterval(const Proportion& p, double alpha);

struct DifferenceComparison {
  double difference = 0;  // B's ratio minus A's
  Interval ci;            // Newcombe's hybrid score interval at 1 - alpha
  double p_value = 1;     // pooled two-proportion z-test
  bool significant = false;
  double needed_total = 0;  // for an absolute difference `margin`, at today's shares
  double more_needed = 0;
  double detectable_now = 0;  // the absolute difference found with `power` at today's counts
};
DifferenceComparison CompareProportions(const Proportion& a, const Proportion& b, double alpha, double power,
                                        double margin);

}  // namespace attnserve::cli::ab
