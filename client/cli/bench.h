// attnserve-cli bench: a closed-loop load generator that measures the forms of one layer against
// each other on a running server (docs/client.md, "bench").
//
// The pieces are separate so the unit tests reach each: argument parsing (no I/O), the latency
// accumulator, the report writers (table, JSON, CSV, SVG), the load loop (any Client), and an
// in-process no-op server that measures the tool's own cost.
// Thread-safety: LatencyStats and BenchCell are single-threaded values (the load loop guards its
// cells with a mutex); the other functions are reentrant.
#pragma once

#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "client/client.h"

namespace attnserve::cli {

// How the forms share one run. Both keep the machine's drift (other tenants, frequency, the
// server's caches) the same for every form, measured alike:
//   kSlice: the run is cut into short slices; each slice issues one form only, the forms taking
//     turns. Each form's throughput is its completions over its own slices' time, so it is the
//     throughput of that form alone at that concurrency.
//   kRequest: consecutive requests alternate forms (round-robin per issued request). Latencies
//     compare under one mixed load, but a closed loop then completes equally many requests of
//     each form, so the throughput of the forms is equal by construction.
enum class Interleave { kSlice, kRequest };

struct BenchArgs {
  std::string layer;
  std::vector<v1::Form> forms = {v1::FORM_FACTORED, v1::FORM_SUMMED};
  int64_t batch = 0, n = 0, m = 0;  // --shape B,N[,M]; m = 0: self-attention
  std::vector<int64_t> concurrency = {1};
  // Exactly one of the two bounds the measurement of each concurrency level.
  std::chrono::nanoseconds duration{std::chrono::seconds(10)};
  int64_t requests = 0;  // > 0: each form completes at least this many, then the level ends
  std::chrono::nanoseconds warmup{std::chrono::seconds(2)};
  bool causal = false;
  std::string target;  // overrides the global --target when set
  std::string json, csv, plot;
  Interleave interleave = Interleave::kSlice;
  std::chrono::nanoseconds slice{std::chrono::milliseconds(500)};
  int64_t max_samples = 100000;  // latency samples kept per (form, concurrency)
  uint64_t seed = 1;
  bool noop_server = false;  // bench an in-process server whose Forward returns at once
  bool help = false;
};

// Parses the arguments after "bench". Errors name the argument ("--concurrency: ...").
bool ParseBenchArgs(const std::vector<std::string>& args, BenchArgs* out, std::string* error);
std::string BenchFlagsHelp();
// "10s", "250ms", "1.5s", "2m", "500us"; a bare number is seconds. Must be >= 0.
bool ParseDuration(std::string_view text, std::string_view what, std::chrono::nanoseconds* out, std::string* error);

// Latencies of one cell: exact count, sum and max; the samples themselves are a uniform
// reservoir of at most `capacity` (Vitter's algorithm R), so memory stays bounded on long runs
// and percentiles are exact while the count is at most the capacity.
class LatencyStats {
 public:
  explicit LatencyStats(int64_t capacity, uint64_t seed = 1) : capacity_(capacity), rng_(seed) {}
  void Add(double ms);
  int64_t count() const { return count_; }
  double max() const { return max_; }
  double mean() const { return count_ > 0 ? sum_ / static_cast<double>(count_) : 0.0; }
  int64_t samples() const { return static_cast<int64_t>(samples_.size()); }
  // Nearest-rank percentile (p in [0, 100]) of the kept samples; 0 when there are none.
  double Percentile(double p) const;

 private:
  int64_t capacity_;
  std::mt19937_64 rng_;
  std::vector<double> samples_;
  mutable std::vector<double> sorted_;
  mutable bool sorted_valid_ = false;
  int64_t count_ = 0;
  double sum_ = 0, max_ = 0;
};

// One (form, concurrency) cell of a run, as measured.
struct BenchCell {
  explicit BenchCell(int64_t capacity, uint64_t seed) : latency(capacity, seed) {}
  v1::Form form = v1::FORM_UNSPECIFIED;
  int64_t concurrency = 0;
  LatencyStats latency;                   // client latency of the OK requests, ms
  double seconds = 0;                     // the time this form was measured over
  int64_t queue_us_sum = 0;               // ForwardResponse.queue_us, summed over OK requests
  int64_t compute_us_sum = 0;             // ForwardResponse.compute_us
  int64_t batch_requests_sum = 0;         // ForwardResponse.batch_requests
  std::map<std::string, int64_t> errors;  // status code name -> count
};

// The record of a cell, as the table, JSON and CSV print it (the field names are the keys).
struct BenchRecord {
  std::string layer, form;
  int64_t batch = 0, n = 0, m = 0;
  bool causal = false;
  int64_t concurrency = 0;
  int64_t requests = 0;  // OK requests measured
  int64_t errors = 0;
  std::map<std::string, int64_t> error_codes;
  double seconds = 0;
  double requests_per_s = 0, tokens_per_s = 0;
  double mean_ms = 0, p50_ms = 0, p90_ms = 0, p95_ms = 0, p99_ms = 0, max_ms = 0;
  double queue_us = 0, compute_us = 0, batch_requests = 0;  // means over OK requests
  int64_t samples = 0;                                      // latency samples the percentiles come from
};

BenchRecord MakeRecord(const BenchArgs& args, const BenchCell& cell);

// The human-readable report: one row per record (columns named as the JSON fields), then one
// ratio line per concurrency for each form against the baseline (factored when measured, else
// the first form): throughput and p50 ratios.
void PrintTable(const std::vector<BenchRecord>& records, std::ostream& out);
void PrintRatios(const std::vector<BenchRecord>& records, std::ostream& out);

// The files. Each returns a status naming the file when it cannot be written.
std::string RecordsJson(const std::vector<BenchRecord>& records);
std::string RecordsCsv(const std::vector<BenchRecord>& records);
// Plain SVG 1.1, no scripts or external references: latency (p50, p90, p99) and throughput
// against concurrency, one colour per form, labelled axes and a legend.
std::string RecordsSvg(const std::vector<BenchRecord>& records, const std::string& title);
grpc::Status WriteTextFile(const std::string& path, const std::string& text);

// Progress while a run goes on: called about every 200 ms from the load loop's thread.
struct BenchProgress {
  int64_t concurrency;
  bool warmup;
  double elapsed_s;
  int64_t done;  // requests completed in this phase
  double rate;   // their rate, per second
};

// Runs every concurrency level of `args` against `client`, with `d_model` wide inputs. Cells come
// out in the order (concurrency, form). `progress` may be null.
std::vector<BenchCell> RunLoad(Client& client, const BenchArgs& args, int64_t d_model,
                               const std::function<void(const BenchProgress&)>& progress);

// A gRPC server on 127.0.0.1 (ephemeral port) whose Forward answers at once with the input as
// output, and whose GetLayer describes any name as a d_model-wide layer: what the bench costs
// by itself (client, gRPC, loopback) with no compute behind it.
class NoopServer {
 public:
  static std::unique_ptr<NoopServer> Start(int64_t d_model, std::string* error);
  ~NoopServer();
  std::string target() const;

 private:
  NoopServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::cli
