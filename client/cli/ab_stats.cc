#include "client/cli/ab_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnserve::cli::ab {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The index of the first bucket whose cumulative count reaches `rank`.
size_t BucketOfRank(const Buckets& b, double rank) {
  for (size_t i = 0; i < b.cumulative.size(); ++i) {
    if (b.cumulative[i] >= rank) return i;
  }
  return b.cumulative.size() - 1;
}

// The lower edge of bucket i; the first bucket starts at 0 as in histogram_quantile.
double LowerEdge(const Buckets& b, size_t i) { return i == 0 ? std::min(0.0, b.upper[0]) : b.upper[i - 1]; }

// The (lower, upper) edges that place a geometric midpoint for bucket i: the first and the
// +Inf bucket borrow the ratio of their finite neighbour.
std::pair<double, double> GeometricEdges(const Buckets& b, size_t i) {
  const size_t finite = b.upper.size() - 1;  // buckets with a finite bound
  auto ratio_at = [&](size_t j) {            // upper[j] / upper[j - 1], j >= 1
    return b.upper[j] / b.upper[j - 1];
  };
  if (i == finite) {  // (upper[finite - 1], +Inf)
    const double lo = b.upper[finite - 1];
    const double r = finite >= 2 ? ratio_at(finite - 1) : 2.0;
    return {lo, lo * r};
  }
  const double hi = b.upper[i];
  if (i == 0 || b.upper[i - 1] <= 0) {
    const double r = finite >= 2 && i + 1 < finite ? ratio_at(i + 1) : 2.0;
    return {hi / r, hi};
  }
  return {b.upper[i - 1], hi};
}

double Clamp01(double x) { return std::min(1.0, std::max(0.0, x)); }

}  // namespace

std::vector<double> ExponentialBounds(double start, double factor, double end) {
  std::vector<double> bounds;
  for (double v = start; v <= end * (1 + 1e-12); v *= factor) bounds.push_back(v);
  bounds.push_back(kInf);
  return bounds;
}

Buckets Bin(const std::vector<double>& samples, const std::vector<double>& upper) {
  Buckets b;
  b.upper = upper;
  std::vector<double> counts(upper.size(), 0.0);
  for (double s : samples) {
    // Prometheus counts x in the first bucket with x <= le.
    const size_t i = static_cast<size_t>(std::lower_bound(upper.begin(), upper.end(), s) - upper.begin());
    counts[std::min(i, upper.size() - 1)] += 1;
  }
  double sum = 0;
  for (double c : counts) b.cumulative.push_back(sum += c);
  return b;
}

double NormalCdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

double NormalQuantile(double p) {
  if (p <= 0) return -kInf;
  if (p >= 1) return kInf;
  // Acklam's rational approximation (relative error 1.15e-9), then one Halley step on erfc.
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                             1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01, -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                             3.754408661907416e+00};
  const double plow = 0.02425;
  double x;
  if (p < plow) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p <= 1 - plow) {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  } else {
    const double q = std::sqrt(-2 * std::log(1 - p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  const double e = NormalCdf(x) - p;
  const double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

QuantileEstimate Quantile(const Buckets& b, double q, double confidence) {
  QuantileEstimate out;
  const double n = b.count();
  if (n <= 0 || b.upper.size() < 2) return out;
  out.valid = true;
  const size_t last = b.upper.size() - 1;
  const double rank = q * n;
  const size_t i = BucketOfRank(b, rank);
  if (i == last) {
    out.value = b.upper[last - 1];
  } else {
    const double below = i == 0 ? 0.0 : b.cumulative[i - 1];
    const double in = b.cumulative[i] - below;
    const double lo = LowerEdge(b, i);
    out.value = in > 0 ? lo + (b.upper[i] - lo) * (rank - below) / in : b.upper[i];
  }
  const double z = NormalQuantile(1 - (1 - confidence) / 2);
  const double sd = std::sqrt(n * q * (1 - q));
  const double lo_rank = std::max(1.0, std::floor(rank - z * sd));
  const double hi_rank = std::min(n, std::ceil(rank + z * sd));
  out.ci.lo = LowerEdge(b, BucketOfRank(b, lo_rank));
  out.ci.hi = b.upper[BucketOfRank(b, hi_rank)];
  return out;
}

LogMoments LogMomentsOf(const Buckets& b) {
  LogMoments m;
  if (b.upper.size() < 2) return m;
  std::vector<std::pair<double, double>> points;  // (log midpoint, count)
  double prev = 0;
  const size_t last = b.upper.size() - 1;
  for (size_t i = 0; i < b.upper.size(); ++i) {
    const double c = b.cumulative[i] - prev;
    prev = b.cumulative[i];
    if (c <= 0) continue;
    const auto [lo, hi] = GeometricEdges(b, i);
    points.emplace_back(0.5 * (std::log(lo) + std::log(hi)), c);
    m.n += c;
    if (i == 0 || i == last) m.open_ended += c;
    m.widest_ratio = std::max(m.widest_ratio, hi / lo);
  }
  if (m.n <= 0) return m;
  for (const auto& [x, c] : points) m.mean += c * x;
  m.mean /= m.n;
  for (const auto& [x, c] : points) m.variance += c * (x - m.mean) * (x - m.mean);
  m.variance = m.n > 1 ? m.variance / (m.n - 1) : 0.0;
  return m;
}

RatioComparison CompareLogMeans(const LogMoments& a, const LogMoments& b, double alpha, double power, double mde) {
  RatioComparison r;
  if (a.n < 2 || b.n < 2) {
    r.more_needed = kInf;
    r.needed_total = kInf;
    r.ci = {0, kInf};
    return r;
  }
  // An observation known only to a bucket of log-width w carries at least the rounding variance
  // w^2/12 (Sheppard): the floor keeps one-bucket data from looking exact.
  auto floor_var = [](const LogMoments& m) {
    const double w = std::log(m.widest_ratio);
    return std::max(m.variance, w * w / 12);
  };
  const double va = floor_var(a), vb = floor_var(b);
  const double d = b.mean - a.mean;
  const double se = std::sqrt(va / a.n + vb / b.n);
  const double za = NormalQuantile(1 - alpha / 2), zb = NormalQuantile(power);
  r.ratio = std::exp(d);
  r.ci = {std::exp(d - za * se), std::exp(d + za * se)};
  r.p_value = se > 0 ? std::erfc(std::fabs(d) / se / std::sqrt(2.0)) : (d == 0 ? 1.0 : 0.0);  // two-sided
  r.significant = r.p_value < alpha;
  const double total = a.n + b.n;
  const double fa = a.n / total, fb = b.n / total;
  const double delta = std::log1p(mde);
  r.needed_total = (za + zb) * (za + zb) * (va / fa + vb / fb) / (delta * delta);
  r.more_needed = std::max(0.0, std::ceil(r.needed_total - total));
  r.detectable_now = std::expm1((za + zb) * se);
  return r;
}

Interval WilsonInterval(const Proportion& p, double alpha) {
  if (p.requests <= 0) return {0, 1};
  const double z = NormalQuantile(1 - alpha / 2), n = p.requests, ph = p.ratio();
  const double denom = 1 + z * z / n;
  const double center = (ph + z * z / (2 * n)) / denom;
  const double half = z * std::sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / denom;
  return {Clamp01(center - half), Clamp01(center + half)};
}

DifferenceComparison CompareProportions(const Proportion& a, const Proportion& b, double alpha, double power,
                                        double margin) {
  DifferenceComparison r;
  const double pa = a.ratio(), pb = b.ratio();
  r.difference = pb - pa;
  const Interval wa = WilsonInterval(a, alpha), wb = WilsonInterval(b, alpha);
  r.ci = {r.difference - std::sqrt((pb - wb.lo) * (pb - wb.lo) + (wa.hi - pa) * (wa.hi - pa)),
          r.difference + std::sqrt((wb.hi - pb) * (wb.hi - pb) + (pa - wa.lo) * (pa - wa.lo))};
  const double za = NormalQuantile(1 - alpha / 2), zb = NormalQuantile(power);
  const double total = a.requests + b.requests;
  if (a.requests <= 0 || b.requests <= 0) {
    r.needed_total = r.more_needed = r.detectable_now = kInf;
    return r;
  }
  const double pooled = (a.errors + b.errors) / total;
  const double se0 = std::sqrt(pooled * (1 - pooled) * (1 / a.requests + 1 / b.requests));
  r.p_value = se0 > 0 ? std::erfc(std::fabs(r.difference) / se0 / std::sqrt(2.0)) : 1.0;  // two-sided
  r.significant = r.p_value < alpha;
  // The sample size for an absolute difference `margin` above today's pooled ratio, at today's
  // shares (Fleiss's formula with unequal allocation).
  const double fa = a.requests / total, fb = b.requests / total;
  const double p1 = std::min(pooled, 1 - margin), p2 = p1 + margin, pm = fa * p1 + fb * p2;
  const double h0 = za * std::sqrt(pm * (1 - pm) * (1 / fa + 1 / fb));
  const double h1 = zb * std::sqrt(p1 * (1 - p1) / fa + p2 * (1 - p2) / fb);
  r.needed_total = (h0 + h1) * (h0 + h1) / (margin * margin);
  r.more_needed = std::max(0.0, std::ceil(r.needed_total - total));
  // With no errors yet, the ratio is taken at its rule-of-three bound 3/n, not at zero.
  const double q = std::max(pooled, 3 / total);
  r.detectable_now = (za + zb) * std::sqrt(q * (1 - q) * (1 / a.requests + 1 / b.requests));
  return r;
}

}  // namespace attnserve::cli::ab
