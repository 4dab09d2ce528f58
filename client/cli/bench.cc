#include "client/cli/bench.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>
#include <utility>

#include "attnserve/v1/attention.grpc.pb.h"
#include "client/cli/args.h"

namespace attnserve::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

// ---------------------------------------------------------------------------------------------
// Arguments

bool ParseForms(std::string_view text, std::vector<v1::Form>* out, std::string* error) {
  out->clear();
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item = text.substr(start, comma == std::string_view::npos ? comma : comma - start);
    v1::Form form = v1::FORM_UNSPECIFIED;
    if (!ParseForm(item, &form, error)) {
      *error = "--forms: expected a comma-separated list of factored, summed, lowrank, auto, routed; got " + Quote(text);
      return false;
    }
    if (std::find(out->begin(), out->end(), form) != out->end()) {
      *error = "--forms: " + Quote(item) + " appears twice in " + Quote(text);
      return false;
    }
    out->push_back(form);
    if (comma == std::string_view::npos) return true;
    start = comma + 1;
  }
}

void AddBenchFlags(FlagParser* f, BenchArgs* a, std::string* s) {
  // s: forms, shape, concurrency, duration, requests, warmup, interleave, slice, max_samples, seed
  f->AddString("layer", &a->layer, "L", "layer to load-test (required)");
  f->AddString("forms", &s[0], "F1,F2", "forms to compare (default factored,summed)");
  f->AddString("shape", &s[1], "B,N[,M]",
               "each request: input [B, N, d_model] (and context [B, M, d_model]) (required)");
  f->AddString("concurrency", &s[2], "C1,C2,..", "requests in flight, one level after another (default 1)");
  f->AddString("duration", &s[3], "T", "measured time per level, all forms together (default 10s)");
  f->AddString("requests", &s[4], "K", "instead of --duration: each form completes K requests per level");
  f->AddString("warmup", &s[5], "T", "unmeasured load before each level (default 2s)");
  f->AddBool("causal", &a->causal, "causal requests");
  f->AddString("target", &a->target, "ADDR", "server (default: the global --target)");
  f->AddString("json", &a->json, "FILE", "write one JSON record per form x concurrency");
  f->AddString("csv", &a->csv, "FILE", "the same records as CSV");
  f->AddString("plot", &a->plot, "FILE.svg", "latency and throughput against concurrency, as SVG");
  f->AddString("interleave", &s[6], "MODE", "slice (default): forms take turns; request: round-robin per request");
  f->AddString("slice", &s[7], "T", "shortest turn of a form with --interleave slice (default 500ms)");
  f->AddString("max-samples", &s[8], "N", "latency samples kept per form x concurrency (default 100000)");
  f->AddString("seed", &s[9], "S", "seed of the random inputs (default 1)");
  f->AddBool("noop-server", &a->noop_server, "bench an in-process server that answers at once: the tool's own cost");
}

constexpr int kStringFlags = 10;

// Numbers as JSON and CSV print them: finite, shortest-round-trip enough for a benchmark.
std::string Num(double v) {
  if (!std::isfinite(v)) return "0";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string CsvField(std::string_view s) {
  if (s.find_first_of(",\"\r\n") == std::string_view::npos) return std::string(s);
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 at all.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
    }
  }
  return out;
}

std::string ErrorCodesText(const std::map<std::string, int64_t>& codes, char sep) {
  std::string s;
  for (const auto& [code, count] : codes) {
    if (!s.empty()) s += sep;
    s += code + "=" + std::to_string(count);
  }
  return s;
}

// The form measured against: factored when present, else the first.
std::string BaselineForm(const std::vector<BenchRecord>& records) {
  for (const BenchRecord& r : records) {
    if (r.form == FormName(v1::FORM_FACTORED)) return r.form;
  }
  return records.empty() ? "" : records.front().form;
}

std::vector<std::string> FormsInOrder(const std::vector<BenchRecord>& records) {
  std::vector<std::string> forms;
  for (const BenchRecord& r : records) {
    if (std::find(forms.begin(), forms.end(), r.form) == forms.end()) forms.push_back(r.form);
  }
  return forms;
}

std::vector<int64_t> ConcurrencyInOrder(const std::vector<BenchRecord>& records) {
  std::vector<int64_t> c;
  for (const BenchRecord& r : records) {
    if (std::find(c.begin(), c.end(), r.concurrency) == c.end()) c.push_back(r.concurrency);
  }
  std::sort(c.begin(), c.end());
  return c;
}

const BenchRecord* Find(const std::vector<BenchRecord>& records, const std::string& form, int64_t c) {
  for (const BenchRecord& r : records) {
    if (r.form == form && r.concurrency == c) return &r;
  }
  return nullptr;
}

}  // namespace

bool ParseDuration(std::string_view text, std::string_view what, std::chrono::nanoseconds* out, std::string* error) {
  const auto fail = [&] {
    *error = std::string(what) + ": expected a duration such as 10s, 500ms or 2m, got " + Quote(text);
    return false;
  };
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  if (digits == 0) return fail();
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(std::string(text.substr(0, digits)), &used);
    if (used != digits) return fail();
  } catch (const std::exception&) {
    return fail();
  }
  const std::string_view unit = text.substr(digits);
  double seconds_per_unit = 0;
  if (unit.empty() || unit == "s") {
    seconds_per_unit = 1;
  } else if (unit == "ms") {
    seconds_per_unit = 1e-3;
  } else if (unit == "us") {
    seconds_per_unit = 1e-6;
  } else if (unit == "m") {
    seconds_per_unit = 60;
  } else if (unit == "h") {
    seconds_per_unit = 3600;
  } else {
    return fail();
  }
  const double ns = value * seconds_per_unit * 1e9;
  // A week is far beyond any benchmark; the bound keeps the conversion exact and finite.
  if (!std::isfinite(ns) || ns > 7 * 24 * 3600 * 1e9) return fail();
  *out = std::chrono::nanoseconds(static_cast<int64_t>(ns));
  return true;
}

bool ParseBenchArgs(const std::vector<std::string>& args, BenchArgs* out, std::string* error) {
  *out = BenchArgs();
  std::string s[kStringFlags];
  FlagParser flags;
  AddBenchFlags(&flags, out, s);
  std::vector<std::string> positionals;
  if (!flags.Parse(args, &positionals, &out->help, error)) return false;
  if (out->help) return true;
  if (!positionals.empty()) {
    *error = "unexpected argument " + Quote(positionals[0]);
    return false;
  }
  if (out->layer.empty()) {
    if (!out->noop_server) {
      *error = "--layer is required";
      return false;
    }
    out->layer = "noop";
  }
  if (flags.Seen("forms") && !ParseForms(s[0], &out->forms, error)) return false;
  if (!flags.Seen("shape")) {
    *error = "--shape is required (B,N or B,N,M)";
    return false;
  }
  std::vector<int64_t> shape;
  if (!ParseIntList(s[1], "--shape", 1, &shape, error)) return false;
  if (shape.size() != 2 && shape.size() != 3) {
    *error = "--shape: expected B,N or B,N,M, got " + Quote(s[1]);
    return false;
  }
  out->batch = shape[0];
  out->n = shape[1];
  out->m = shape.size() == 3 ? shape[2] : 0;
  if (flags.Seen("concurrency")) {
    if (!ParseIntList(s[2], "--concurrency", 1, &out->concurrency, error)) return false;
    // More calls in flight than this is a typo, not a benchmark: each holds a request copy.
    for (int64_t c : out->concurrency) {
      if (c > 4096) {
        *error = "--concurrency: expected values <= 4096, got " + std::to_string(c);
        return false;
      }
    }
  }
  if (flags.Seen("duration") && flags.Seen("requests")) {
    *error = "--duration and --requests exclude each other";
    return false;
  }
  if (flags.Seen("duration")) {
    if (!ParseDuration(s[3], "--duration", &out->duration, error)) return false;
    if (out->duration.count() <= 0) {
      *error = "--duration: expected more than 0, got " + Quote(s[3]);
      return false;
    }
  }
  if (flags.Seen("requests")) {
    if (!ParseInt64(s[4], "--requests", &out->requests, error)) return false;
    if (out->requests < 1) {
      *error = "--requests: expected at least 1, got " + s[4];
      return false;
    }
  }
  if (flags.Seen("warmup") && !ParseDuration(s[5], "--warmup", &out->warmup, error)) return false;
  if (flags.Seen("interleave")) {
    if (s[6] == "slice") {
      out->interleave = Interleave::kSlice;
    } else if (s[6] == "request") {
      out->interleave = Interleave::kRequest;
    } else {
      *error = "--interleave: expected slice or request, got " + Quote(s[6]);
      return false;
    }
  }
  if (flags.Seen("slice")) {
    if (!ParseDuration(s[7], "--slice", &out->slice, error)) return false;
    if (out->slice < std::chrono::milliseconds(1)) {
      *error = "--slice: expected at least 1ms, got " + Quote(s[7]);
      return false;
    }
  }
  if (flags.Seen("max-samples")) {
    if (!ParseInt64(s[8], "--max-samples", &out->max_samples, error)) return false;
    if (out->max_samples < 1) {
      *error = "--max-samples: expected at least 1, got " + s[8];
      return false;
    }
  }
  if (flags.Seen("seed") && !ParseUint64(s[9], "--seed", &out->seed, error)) return false;
  return true;
}

std::string BenchFlagsHelp() {
  BenchArgs a;
  std::string s[kStringFlags];
  FlagParser flags;
  AddBenchFlags(&flags, &a, s);
  return flags.Describe();
}

// ---------------------------------------------------------------------------------------------
// Statistics

void LatencyStats::Add(double ms) {
  ++count_;
  sum_ += ms;
  max_ = std::max(max_, ms);
  sorted_valid_ = false;
  if (static_cast<int64_t>(samples_.size()) < capacity_) {
    samples_.push_back(ms);
    return;
  }
  // Algorithm R: the n-th value replaces a random kept one with probability capacity / n, so
  // the reservoir stays a uniform sample of everything seen.
  std::uniform_int_distribution<int64_t> pick(0, count_ - 1);
  const int64_t j = pick(rng_);
  if (j < capacity_) samples_[static_cast<size_t>(j)] = ms;
}

double LatencyStats::Percentile(double p) const {
  if (samples_.empty()) return 0.0;
  if (!sorted_valid_) {
    sorted_ = samples_;
    std::sort(sorted_.begin(), sorted_.end());
    sorted_valid_ = true;
  }
  // Nearest rank: the smallest sample with at least p % of the samples at or below it.
  const double rank = std::ceil(p / 100.0 * static_cast<double>(sorted_.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(sorted_.size()))) - 1;
  return sorted_[i];
}

BenchRecord MakeRecord(const BenchArgs& args, const BenchCell& cell) {
  BenchRecord r;
  r.layer = args.layer;
  r.form = cell.form == v1::FORM_UNSPECIFIED ? "routed" : FormName(cell.form);
  r.batch = args.batch;
  r.n = args.n;
  r.m = args.m;
  r.causal = args.causal;
  r.concurrency = cell.concurrency;
  r.requests = cell.latency.count();
  r.error_codes = cell.errors;
  for (const auto& [code, count] : cell.errors) r.errors += count;
  r.seconds = cell.seconds;
  if (cell.seconds > 0) {
    r.requests_per_s = static_cast<double>(r.requests) / cell.seconds;
    r.tokens_per_s = r.requests_per_s * static_cast<double>(args.batch * args.n);
  }
  r.mean_ms = cell.latency.mean();
  r.p50_ms = cell.latency.Percentile(50);
  r.p90_ms = cell.latency.Percentile(90);
  r.p95_ms = cell.latency.Percentile(95);
  r.p99_ms = cell.latency.Percentile(99);
  r.max_ms = cell.latency.max();
  if (r.requests > 0) {
    const double ok = static_cast<double>(r.requests);
    r.queue_us = static_cast<double>(cell.queue_us_sum) / ok;
    r.compute_us = static_cast<double>(cell.compute_us_sum) / ok;
    r.batch_requests = static_cast<double>(cell.batch_requests_sum) / ok;
  }
  r.samples = cell.latency.samples();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Reports

void PrintTable(const std::vector<BenchRecord>& records, std::ostream& out) {
  char line[512];
  std::snprintf(line, sizeof line, "%-9s %11s %8s %14s %12s %8s %8s %8s %8s %8s %10s %10s %14s  %s\n", "form",
                "concurrency", "requests", "requests_per_s", "tokens_per_s", "p50_ms", "p90_ms", "p95_ms", "p99_ms",
                "max_ms", "queue_us", "compute_us", "batch_requests", "errors");
  out << line;
  for (const BenchRecord& r : records) {
    const std::string errors = r.errors == 0 ? "0" : ErrorCodesText(r.error_codes, ',');
    std::snprintf(line, sizeof line,
                  "%-9s %11lld %8lld %14.1f %12.0f %8.3f %8.3f %8.3f %8.3f %8.3f %10.0f %10.0f %14.2f  %s\n",
                  r.form.c_str(), static_cast<long long>(r.concurrency), static_cast<long long>(r.requests),
                  r.requests_per_s, r.tokens_per_s, r.p50_ms, r.p90_ms, r.p95_ms, r.p99_ms, r.max_ms, r.queue_us,
                  r.compute_us, r.batch_requests, errors.c_str());
    out << line;
  }
}

void PrintRatios(const std::vector<BenchRecord>& records, std::ostream& out) {
  const std::string base = BaselineForm(records);
  for (const std::string& form : FormsInOrder(records)) {
    if (form == base) continue;
    std::string tput = "requests_per_s", p50 = "p50_ms";
    for (int64_t c : ConcurrencyInOrder(records)) {
      const BenchRecord* a = Find(records, form, c);
      const BenchRecord* b = Find(records, base, c);
      if (a == nullptr || b == nullptr) continue;
      char buf[64];
      const std::string label = " c" + std::to_string(c) + "=";
      if (b->requests_per_s > 0) {
        std::snprintf(buf, sizeof buf, "%.3f", a->requests_per_s / b->requests_per_s);
        tput += label + buf;
      } else {
        tput += label + "-";
      }
      if (b->p50_ms > 0 && a->requests > 0) {
        std::snprintf(buf, sizeof buf, "%.3f", a->p50_ms / b->p50_ms);
        p50 += label + buf;
      } else {
        p50 += label + "-";
      }
    }
    out << "ratio " << form << "/" << base << ": " << tput << "  " << p50 << "\n";
  }
}

// One record a line, so that a file of them reads and diffs line by line.
std::string RecordsJson(const std::vector<BenchRecord>& records) {
  const auto num = [](double v) { return std::isfinite(v) ? v : 0.0; };  // JSON has no NaN
  std::string s = "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const BenchRecord& r = records[i];
    nlohmann::ordered_json codes = nlohmann::ordered_json::object();
    for (const auto& [code, count] : r.error_codes) codes[code] = count;
    const nlohmann::ordered_json j = {{"layer", r.layer},
                                      {"form", r.form},
                                      {"batch", r.batch},
                                      {"n", r.n},
                                      {"m", r.m},
                                      {"causal", r.causal},
                                      {"concurrency", r.concurrency},
                                      {"requests", r.requests},
                                      {"errors", r.errors},
                                      {"error_codes", codes},
                                      {"seconds", num(r.seconds)},
                                      {"requests_per_s", num(r.requests_per_s)},
                                      {"tokens_per_s", num(r.tokens_per_s)},
                                      {"mean_ms", num(r.mean_ms)},
                                      {"p50_ms", num(r.p50_ms)},
                                      {"p90_ms", num(r.p90_ms)},
                                      {"p95_ms", num(r.p95_ms)},
                                      {"p99_ms", num(r.p99_ms)},
                                      {"max_ms", num(r.max_ms)},
                                      {"queue_us", num(r.queue_us)},
                                      {"compute_us", num(r.compute_us)},
                                      {"batch_requests", num(r.batch_requests)},
                                      {"samples", r.samples}};
    s += "  " + j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + (i + 1 < records.size() ? "," : "") +
         "\n";
  }
  return s + "]\n";
}

std::string RecordsCsv(const std::vector<BenchRecord>& records) {
  std::string s =
      "layer,form,batch,n,m,causal,concurrency,requests,errors,error_codes,seconds,requests_per_s,tokens_per_s,"
      "mean_ms,p50_ms,p90_ms,p95_ms,p99_ms,max_ms,queue_us,compute_us,batch_requests,samples\n";
  for (const BenchRecord& r : records) {
    s += CsvField(r.layer) + "," + r.form + "," + std::to_string(r.batch) + "," + std::to_string(r.n) + "," +
         std::to_string(r.m) + "," + (r.causal ? "true" : "false") + "," + std::to_string(r.concurrency) + "," +
         std::to_string(r.requests) + "," + std::to_string(r.errors) + "," + ErrorCodesText(r.error_codes, ';') + "," +
         Num(r.seconds) + "," + Num(r.requests_per_s) + "," + Num(r.tokens_per_s) + "," + Num(r.mean_ms) + "," +
         Num(r.p50_ms) + "," + Num(r.p90_ms) + "," + Num(r.p95_ms) + "," + Num(r.p99_ms) + "," + Num(r.max_ms) + "," +
         Num(r.queue_us) + "," + Num(r.compute_us) + "," + Num(r.batch_requests) + "," + std::to_string(r.samples) +
         "\n";
  }
  return s;
}

namespace {

// A 1-2-5 step giving about `ticks` intervals over [0, max].
double NiceStep(double max, int ticks) {
  if (!(max > 0)) return 1;
  const double raw = max / ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

// Tick labels: whole numbers in full (12000, not 1.2e+04), small ones to 3-4 digits.
std::string Fmt(double v) {
  char buf[32];
  if (std::fabs(v) >= 1000 && std::fabs(v) < 1e12) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else if (v != 0 && std::fabs(v) < 1e-2) {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.4g", v);
  }
  return buf;
}

std::string Px(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// A form keeps its colour from plot to plot: the colour of its wire value (factored blue,
// summed red, lowrank green); "routed", "auto" and forms past the palette take the others by position.
const char* FormColour(const std::string& form, size_t index) {
  static const char* kByWire[] = {"", "#1f77b4", "#d62728", "#2ca02c"};
  for (v1::Form f : KnownForms()) {
    if (form == FormName(f) && static_cast<size_t>(f) < std::size(kByWire)) return kByWire[f];
  }
  static const char* kOthers[] = {"#9467bd", "#ff7f0e", "#8c564b"};
  return kOthers[index % 3];
}

struct Metric {
  const char* name;  // data-metric and the legend
  const char* dash;  // stroke-dasharray; "" = solid
  double BenchRecord::*field;
};

// One panel: x = concurrency (log2 when it spans a factor >= 4), y from 0; one polyline and
// markers per (form, metric).
void Panel(std::string* svg, const std::vector<BenchRecord>& records, const std::string& id, double left, double top,
           double width, double height, const std::string& y_label, const std::vector<Metric>& metrics) {
  const std::vector<int64_t> xs = ConcurrencyInOrder(records);
  const std::vector<std::string> forms = FormsInOrder(records);
  double y_max = 0;
  for (const BenchRecord& r : records) {
    for (const Metric& m : metrics) y_max = std::max(y_max, r.*m.field);
  }
  const double step = NiceStep(y_max * 1.05, 5);
  const double y_top = std::max(step, std::ceil(y_max * 1.05 / step) * step);
  const double x_lo = xs.empty() ? 1 : static_cast<double>(xs.front());
  const double x_hi = xs.empty() ? 1 : static_cast<double>(xs.back());
  const bool log_x = x_lo > 0 && x_hi / x_lo >= 4;
  const auto to_x = [&](double c) {
    if (x_hi == x_lo) return left + width / 2;
    const double t = log_x ? std::log2(c / x_lo) / std::log2(x_hi / x_lo) : (c - x_lo) / (x_hi - x_lo);
    return left + 0.04 * width + t * 0.92 * width;
  };
  const auto to_y = [&](double v) { return top + height - v / y_top * height; };

  *svg += "<g id=\"" + id + "\">\n";
  // Grid and y ticks.
  for (double v = 0; v <= y_top + step / 2; v += step) {
    const std::string y = Px(to_y(v));
    *svg += "<line x1=\"" + Px(left) + "\" y1=\"" + y + "\" x2=\"" + Px(left + width) + "\" y2=\"" + y +
            "\" stroke=\"#dddddd\" stroke-width=\"1\"/>\n";
    *svg += "<text x=\"" + Px(left - 6) + "\" y=\"" + Px(to_y(v) + 4) + "\" text-anchor=\"end\" font-size=\"11\">" +
            Fmt(v) + "</text>\n";
  }
  // x ticks at the measured concurrency levels.
  for (int64_t c : xs) {
    const std::string x = Px(to_x(static_cast<double>(c)));
    *svg += "<line x1=\"" + x + "\" y1=\"" + Px(top + height) + "\" x2=\"" + x + "\" y2=\"" + Px(top + height + 5) +
            "\" stroke=\"#333333\"/>\n";
    *svg += "<text x=\"" + x + "\" y=\"" + Px(top + height + 18) + "\" text-anchor=\"middle\" font-size=\"11\">" +
            std::to_string(c) + "</text>\n";
  }
  // Axes and labels.
  *svg += "<path d=\"M" + Px(left) + " " + Px(top) + " V" + Px(top + height) + " H" + Px(left + width) +
          "\" fill=\"none\" stroke=\"#333333\" stroke-width=\"1\"/>\n";
  *svg += "<text x=\"" + Px(left + width / 2) + "\" y=\"" + Px(top + height + 36) +
          "\" text-anchor=\"middle\" font-size=\"12\">concurrency (requests in flight" +
          std::string(log_x ? ", log scale" : "") + ")</text>\n";
  *svg += "<text transform=\"translate(" + Px(left - 48) + " " + Px(top + height / 2) +
          ") rotate(-90)\" text-anchor=\"middle\" font-size=\"12\">" + XmlEscape(y_label) + "</text>\n";
  // Series.
  for (size_t fi = 0; fi < forms.size(); ++fi) {
    const std::string& form = forms[fi];
    const std::string colour = FormColour(form, fi);
    for (const Metric& m : metrics) {
      std::string points;
      std::string markers;
      for (int64_t c : xs) {
        const BenchRecord* r = Find(records, form, c);
        if (r == nullptr || r->requests == 0) continue;
        const double v = r->*m.field;
        const std::string x = Px(to_x(static_cast<double>(c))), y = Px(to_y(v));
        points += (points.empty() ? "" : " ") + x + "," + y;
        markers += "<circle cx=\"" + x + "\" cy=\"" + y + "\" r=\"3\" fill=\"" + colour + "\"><title>" +
                   XmlEscape(form) + " " + m.name + " at concurrency " + std::to_string(c) + ": " + Fmt(v) +
                   "</title></circle>\n";
      }
      *svg += "<g class=\"series\" data-panel=\"" + id + "\" data-form=\"" + XmlEscape(form) + "\" data-metric=\"" +
              m.name + "\">\n";
      *svg += "<polyline points=\"" + points + "\" fill=\"none\" stroke=\"" + colour + "\" stroke-width=\"2\"" +
              (m.dash[0] ? std::string(" stroke-dasharray=\"") + m.dash + "\"" : std::string()) + "/>\n";
      *svg += markers + "</g>\n";
    }
  }
  *svg += "</g>\n";
}

}  // namespace

std::string RecordsSvg(const std::vector<BenchRecord>& records, const std::string& title) {
  const double width = 1000, height = 470;
  std::string svg =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" +
      Px(width) + "\" height=\"" + Px(height) + "\" viewBox=\"0 0 " + Px(width) + " " + Px(height) +
      "\" font-family=\"sans-serif\">\n"
      "<rect x=\"0\" y=\"0\" width=\"" +
      Px(width) + "\" height=\"" + Px(height) + "\" fill=\"#ffffff\"/>\n" + "<text x=\"" + Px(width / 2) +
      "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">" + XmlEscape(title) + "</text>\n";
  const std::vector<Metric> latency = {
      {"p50", "", &BenchRecord::p50_ms}, {"p90", "7 4", &BenchRecord::p90_ms}, {"p99", "2 3", &BenchRecord::p99_ms}};
  const std::vector<Metric> throughput = {{"requests_per_s", "", &BenchRecord::requests_per_s}};
  svg += "<text x=\"" + Px(290) + "\" y=\"52\" text-anchor=\"middle\" font-size=\"13\">client latency</text>\n";
  svg += "<text x=\"" + Px(770) + "\" y=\"52\" text-anchor=\"middle\" font-size=\"13\">throughput</text>\n";
  Panel(&svg, records, "latency", 80, 64, 420, 300, "latency (ms)", latency);
  Panel(&svg, records, "throughput", 570, 64, 400, 300, "throughput (requests/s)", throughput);
  // Legend: colour = form, dash = percentile.
  double x = 80;
  const double y = 438;
  svg += "<g id=\"legend\" font-size=\"12\">\n";
  const std::vector<std::string> forms = FormsInOrder(records);
  for (size_t fi = 0; fi < forms.size(); ++fi) {
    svg += "<line x1=\"" + Px(x) + "\" y1=\"" + Px(y) + "\" x2=\"" + Px(x + 26) + "\" y2=\"" + Px(y) + "\" stroke=\"" +
           FormColour(forms[fi], fi) + "\" stroke-width=\"3\"/>\n";
    svg += "<text x=\"" + Px(x + 32) + "\" y=\"" + Px(y + 4) + "\">" + XmlEscape(forms[fi]) + "</text>\n";
    x += 50 + 8.0 * static_cast<double>(forms[fi].size());
  }
  x += 20;
  for (const Metric& m : latency) {
    svg += "<line x1=\"" + Px(x) + "\" y1=\"" + Px(y) + "\" x2=\"" + Px(x + 26) + "\" y2=\"" + Px(y) +
           "\" stroke=\"#555555\" stroke-width=\"2\"" +
           (m.dash[0] ? std::string(" stroke-dasharray=\"") + m.dash + "\"" : std::string()) + "/>\n";
    svg += "<text x=\"" + Px(x + 32) + "\" y=\"" + Px(y + 4) + "\">" + m.name + " latency</text>\n";
    x += 110;
  }
  svg += "</g>\n</svg>\n";
  return svg;
}

grpc::Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return grpc::Status(grpc::StatusCode::NOT_FOUND, path + ": cannot open for writing");
  f << text;
  f.close();
  if (!f) return grpc::Status(grpc::StatusCode::INTERNAL, path + ": write failed");
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// The load loop

namespace {

// A closed loop of requests: `concurrency` calls stay in flight, each completion issuing the
// next, until the phase stops. All state is guarded by mu_; callbacks run on gRPC's threads.
//
// The calls go through the callback API of the Client's own channel rather than
// Client::ForwardAsync, for two reasons. The prebuilt requests are shared, not copied per call
// (a [8, 128, 768] input is 3 MB). And each call's ClientContext is destroyed before the call
// counts as finished: ForwardAsync frees its context after the user callback returns, so a
// caller that destroys its Client as soon as the last callback ran can drop the channel's last
// reference on gRPC's callback thread, which gRPC 1.51 answers with an abort
// (ref_counted.h "prior > 0").
class LoadEngine {
 public:
  LoadEngine(Client& client, std::vector<v1::ForwardRequest> requests)
      : channel_(client.channel()),
        stub_(v1::AttentionService::NewStub(channel_)),
        timeout_(client.options().timeout),
        requests_(std::move(requests)) {}

  struct Phase {
    int64_t concurrency = 1;
    Clock::time_point stop_at;
    std::function<size_t()> pick;               // the form of the next request; called under the lock
    std::vector<BenchCell*> cells;              // per form; null: completions are not recorded
    std::vector<LatencyStats>* warm = nullptr;  // per form: latencies of OK warmup requests
    // Per form: completions still wanted before the phase ends (ends when every one is <= 0);
    // empty: the phase ends at stop_at only.
    std::vector<int64_t> quota;
  };

  struct Result {
    Clock::time_point stopped_at;  // stop_at, or the completion that met the quota
    int64_t done = 0;              // completions recorded
  };

  // Runs `phase`; returns when every call has ended. `progress` gets the completions so far and
  // the seconds since the phase began, about every 200 ms.
  Result Run(Phase phase, const std::function<void(int64_t done, double elapsed_s)>& progress) {
    const Clock::time_point start = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      phase_ = std::move(phase);
      stopping_ = false;
      stopped_at_ = phase_.stop_at;
      done_ = 0;
    }
    for (int64_t i = 0; i < phase_.concurrency; ++i) {
      size_t form;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) break;
        form = phase_.pick();
        ++inflight_;
      }
      Issue(form);
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (!(stopping_ && inflight_ == 0)) {
      const Clock::time_point now = Clock::now();
      if (!stopping_ && now >= phase_.stop_at) {
        stopping_ = true;
        stopped_at_ = phase_.stop_at;
        continue;
      }
      const Clock::time_point wake = std::min(now + std::chrono::milliseconds(200), phase_.stop_at);
      cv_.wait_until(lock, stopping_ ? now + std::chrono::milliseconds(200) : wake);
      if (progress) {
        const int64_t done = done_;
        lock.unlock();
        progress(done, std::chrono::duration<double>(Clock::now() - start).count());
        lock.lock();
      }
    }
    return {stopped_at_, done_};
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    Clock::time_point start;
  };

  void Issue(size_t form) {
    auto* call = new Call;
    if (timeout_.count() > 0) call->ctx.set_deadline(std::chrono::system_clock::now() + timeout_);
    call->start = Clock::now();
    stub_->async()->Forward(&call->ctx, &requests_[form], &call->resp,
                            [this, call, form](grpc::Status s) { OnDone(call, form, s); });
  }

  void OnDone(Call* call, size_t form, const grpc::Status& s) {
    const Clock::time_point now = Clock::now();
    size_t next = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stopping_ && now >= phase_.stop_at) {
        stopping_ = true;
        stopped_at_ = phase_.stop_at;
      }
      if (!stopping_) {
        Record(form, now - call->start, s, call->resp);
        if (!phase_.quota.empty()) {
          --phase_.quota[form];
          if (std::all_of(phase_.quota.begin(), phase_.quota.end(), [](int64_t q) { return q <= 0; })) {
            stopping_ = true;
            stopped_at_ = now;
          }
        }
      }
      // The context goes before the call counts as ended (see the class comment).
      delete call;
      --inflight_;
      if (stopping_) {
        // Notified under the lock: once inflight_ reaches 0 the engine may be destroyed.
        if (inflight_ == 0) cv_.notify_all();
        return;
      }
      next = phase_.pick();
      ++inflight_;
    }
    Issue(next);
  }

  void Record(size_t form, Clock::duration latency, const grpc::Status& s, const v1::ForwardResponse& r) {
    ++done_;
    const double ms = std::chrono::duration<double, std::milli>(latency).count();
    if (phase_.warm != nullptr && s.ok()) (*phase_.warm)[form].Add(ms);
    BenchCell* cell = form < phase_.cells.size() ? phase_.cells[form] : nullptr;
    if (cell == nullptr) return;
    if (!s.ok()) {
      ++cell->errors[GrpcCodeName(s.error_code())];
      return;
    }
    cell->latency.Add(ms);
    cell->queue_us_sum += r.queue_us();
    cell->compute_us_sum += r.compute_us();
    cell->batch_requests_sum += r.batch_requests();
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::chrono::milliseconds timeout_;
  const std::vector<v1::ForwardRequest> requests_;  // one per form, shared by its calls
  std::mutex mu_;
  std::condition_variable cv_;
  Phase phase_;
  bool stopping_ = false;
  Clock::time_point stopped_at_;
  int64_t inflight_ = 0;
  int64_t done_ = 0;
};

// A phase without cells or quota (filled in by the caller where needed).
LoadEngine::Phase MakePhase(int64_t concurrency, Clock::time_point stop_at, std::function<size_t()> pick) {
  LoadEngine::Phase phase;
  phase.concurrency = concurrency;
  phase.stop_at = stop_at;
  phase.pick = std::move(pick);
  return phase;
}

std::vector<v1::ForwardRequest> BuildRequests(const BenchArgs& args, int64_t d_model) {
  std::mt19937_64 rng(args.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random = [&](int64_t rows) {
    std::vector<float> v(static_cast<size_t>(args.batch * rows * d_model));
    for (float& x : v) x = normal(rng);
    return MakeTensor(v, {args.batch, rows, d_model});
  };
  // Every form gets the same input, so the forms differ in nothing but the form.
  const v1::Tensor input = random(args.n);
  const v1::Tensor context = args.m > 0 ? random(args.m) : v1::Tensor();
  std::vector<v1::ForwardRequest> requests;
  for (v1::Form form : args.forms) {
    v1::ForwardRequest req;
    req.set_layer(args.layer);
    req.set_form(form);
    req.set_causal(args.causal);
    *req.mutable_input() = input;
    if (args.m > 0) *req.mutable_context() = context;
    requests.push_back(std::move(req));
  }
  return requests;
}

}  // namespace

std::vector<BenchCell> RunLoad(Client& client, const BenchArgs& args, int64_t d_model,
                               const std::function<void(const BenchProgress&)>& progress) {
  LoadEngine engine(client, BuildRequests(args, d_model));
  const size_t forms = args.forms.size();
  const bool by_count = args.requests > 0;
  std::vector<BenchCell> all;
  uint64_t seed = args.seed;
  for (int64_t c : args.concurrency) {
    std::vector<BenchCell> cells;
    for (size_t f = 0; f < forms; ++f) {
      cells.emplace_back(args.max_samples, ++seed);
      cells.back().form = args.forms[f];
      cells.back().concurrency = c;
    }
    // Progress: a warmup phase on its own; the measurement over all its turns together.
    Clock::time_point measure_start;
    int64_t measured = 0;  // completions of the finished turns of this level
    const auto warmup_progress = [&](int64_t done, double elapsed) {
      if (progress) progress({c, true, elapsed, done, elapsed > 0 ? static_cast<double>(done) / elapsed : 0});
    };
    const auto measure_progress = [&](int64_t done, double) {
      if (!progress) return;
      const double elapsed = std::chrono::duration<double>(Clock::now() - measure_start).count();
      const int64_t total = measured + done;
      progress({c, false, elapsed, total, elapsed > 0 ? static_cast<double>(total) / elapsed : 0});
    };

    if (args.interleave == Interleave::kRequest) {
      uint64_t next = 0;
      const auto round_robin = [&next, forms] { return static_cast<size_t>(next++ % forms); };
      if (args.warmup.count() > 0) {
        engine.Run(MakePhase(c, Clock::now() + args.warmup, round_robin), warmup_progress);
      }
      measure_start = Clock::now();
      LoadEngine::Phase phase =
          MakePhase(c, by_count ? Clock::time_point::max() : measure_start + args.duration, round_robin);
      for (BenchCell& cell : cells) phase.cells.push_back(&cell);
      if (by_count) phase.quota.assign(forms, args.requests);
      const LoadEngine::Result r = engine.Run(std::move(phase), measure_progress);
      for (BenchCell& cell : cells) cell.seconds = std::chrono::duration<double>(r.stopped_at - measure_start).count();
    } else {
      // Warm each form for its share of the warmup, and learn its latency at this load.
      std::vector<LatencyStats> warm;
      for (size_t f = 0; f < forms; ++f) warm.emplace_back(args.max_samples, ++seed);
      if (args.warmup.count() > 0) {
        for (size_t f = 0; f < forms; ++f) {
          LoadEngine::Phase phase =
              MakePhase(c, Clock::now() + args.warmup / static_cast<int64_t>(forms), [f] { return f; });
          phase.warm = &warm;
          engine.Run(std::move(phase), warmup_progress);
        }
      }
      // A turn opens with a burst of `c` calls and closes with a drain whose completions are not
      // counted; each edge lasts about one latency. Turns of at least 10 latencies keep the edges
      // to ~10 % of a turn.
      double slowest_ms = 0;
      for (const LatencyStats& w : warm) slowest_ms = std::max(slowest_ms, w.Percentile(50));
      const Clock::duration turn = std::max<Clock::duration>(
          std::chrono::duration_cast<Clock::duration>(args.slice),
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(10 * slowest_ms)));
      std::vector<int64_t> completed(forms, 0);  // per form, OK or not
      measure_start = Clock::now();
      for (bool done = false; !done;) {
        // Whole rounds only, so every form gets as many turns as the others.
        for (size_t f = 0; f < forms; ++f) {
          const Clock::time_point turn_start = Clock::now();
          LoadEngine::Phase phase = MakePhase(c, turn_start + turn, [f] { return f; });
          phase.cells.assign(forms, nullptr);
          phase.cells[f] = &cells[f];
          if (by_count) {
            // The turn ends early once its form has its K completions: no longer than needed.
            phase.quota.assign(forms, 0);
            phase.quota[f] = std::max<int64_t>(1, args.requests - completed[f]);
          }
          const LoadEngine::Result r = engine.Run(std::move(phase), measure_progress);
          cells[f].seconds += std::chrono::duration<double>(r.stopped_at - turn_start).count();
          completed[f] += r.done;
          measured += r.done;
        }
        done = by_count ? std::all_of(completed.begin(), completed.end(), [&](int64_t n) { return n >= args.requests; })
                        : Clock::now() - measure_start >= args.duration;
      }
    }
    for (BenchCell& cell : cells) all.push_back(std::move(cell));
  }
  return all;
}

// ---------------------------------------------------------------------------------------------
// The no-op server

namespace {

class NoopService final : public v1::AttentionService::CallbackService {
 public:
  explicit NoopService(int64_t d_model) : d_model_(d_model) {}

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override {
    // The input comes back as the output: a response of the real size, with no compute.
    *resp->mutable_output() = req->input();
    resp->set_form(req->form() == v1::FORM_UNSPECIFIED ? v1::FORM_FACTORED : req->form());
    resp->set_batch_requests(1);
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* GetLayer(grpc::CallbackServerContext* ctx, const v1::GetLayerRequest* req,
                                     v1::LayerInfo* info) override {
    info->set_name(req->name());
    info->set_source("noop");
    info->mutable_config()->set_d_model(d_model_);
    for (v1::Form f : KnownForms()) {
      v1::FormInfo* fi = info->add_forms();
      fi->set_form(f);
      fi->set_device("noop");
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  int64_t d_model_;
};

}  // namespace

struct NoopServer::Impl {
  explicit Impl(int64_t d) : service(d) {}
  NoopService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

NoopServer::NoopServer() = default;

NoopServer::~NoopServer() {
  if (impl_ && impl_->server) impl_->server->Shutdown(std::chrono::system_clock::now());
}

std::unique_ptr<NoopServer> NoopServer::Start(int64_t d_model, std::string* error) {
  std::unique_ptr<NoopServer> s(new NoopServer());
  s->impl_ = std::make_unique<Impl>(d_model);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &s->impl_->port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&s->impl_->service);
  s->impl_->server = builder.BuildAndStart();
  if (!s->impl_->server || s->impl_->port == 0) {
    *error = "cannot start the no-op server on 127.0.0.1";
    return nullptr;
  }
  return s;
}

std::string NoopServer::target() const { return "127.0.0.1:" + std::to_string(impl_->port); }

}  // namespace attnserve::cli
