// Tests of `attnserve-cli bench` without a real server: argument errors (exit 2, the message
// names the argument), the latency statistics, the JSON and CSV schema, the SVG (checked as XML
// by tests/tools/check_bench_svg.py), and whole runs against the in-process no-op server.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "client/cli/bench.h"
#include "client/cli/commands.h"

namespace attnserve::cli {
namespace {

using ::testing::HasSubstr;

// The JSON keys and CSV columns, in order: the documented schema.
const std::vector<std::string> kFields = {"layer",      "form",           "batch",        "n",       "m",
                                          "causal",     "concurrency",    "requests",     "errors",  "error_codes",
                                          "seconds",    "requests_per_s", "tokens_per_s", "mean_ms", "p50_ms",
                                          "p90_ms",     "p95_ms",         "p99_ms",       "max_ms",  "queue_us",
                                          "compute_us", "batch_requests", "samples"};

struct CliResult {
  int code;
  std::string out, err;
};

CliResult Cli(std::vector<std::string> args) {
  std::ostringstream out, err;
  GlobalEnv env;
  // A port nothing listens on: a usage error must be reported before any connection.
  args.insert(args.begin(), {"--target", "127.0.0.1:1", "--timeout-ms", "2000"});
  const int code = RunCli(args, env, out, err);
  return {code, out.str(), err.str()};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Output and exit status of a shell command.
int Shell(const std::string& command, std::string* output) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  output->clear();
  while (size_t n = fread(buf, 1, sizeof buf, p)) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class TempFile {
 public:
  explicit TempFile(const std::string& suffix)
      : path_((std::filesystem::temp_directory_path() /
               ("attnserve_bench_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++) + suffix))
                  .string()) {}
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

// ---------------------------------------------------------------------------------------------
// Arguments

struct UsageCase {
  std::vector<std::string> args;
  std::string names;  // what the message must mention
};

TEST(BenchArgs, UsageErrorsExitTwoAndNameTheArgument) {
  const std::vector<UsageCase> cases = {
      {{"--shape", "1,16"}, "--layer"},
      {{"--layer", "x"}, "--shape"},
      {{"--layer", "x", "--shape", "1"}, "--shape"},
      {{"--layer", "x", "--shape", "1,2,3,4"}, "--shape"},
      {{"--layer", "x", "--shape", "0,16"}, "--shape"},
      {{"--layer", "x", "--shape", "1,a"}, "--shape"},
      {{"--layer", "x", "--shape", "1,16", "--forms", "factored,bogus"}, "--forms"},
      {{"--layer", "x", "--shape", "1,16", "--forms", "summed,summed"}, "--forms"},
      {{"--layer", "x", "--shape", "1,16", "--concurrency", "0"}, "--concurrency"},
      {{"--layer", "x", "--shape", "1,16", "--concurrency", "1,,2"}, "--concurrency"},
      {{"--layer", "x", "--shape", "1,16", "--concurrency", "5000"}, "--concurrency"},
      {{"--layer", "x", "--shape", "1,16", "--duration", "1s", "--requests", "5"}, "--duration and --requests"},
      {{"--layer", "x", "--shape", "1,16", "--duration", "ten"}, "--duration"},
      {{"--layer", "x", "--shape", "1,16", "--duration", "5parsecs"}, "--duration"},
      {{"--layer", "x", "--shape", "1,16", "--duration", "0s"}, "--duration"},
      {{"--layer", "x", "--shape", "1,16", "--requests", "0"}, "--requests"},
      {{"--layer", "x", "--shape", "1,16", "--requests", "many"}, "--requests"},
      {{"--layer", "x", "--shape", "1,16", "--warmup", "-1s"}, "--warmup"},
      {{"--layer", "x", "--shape", "1,16", "--interleave", "random"}, "--interleave"},
      {{"--layer", "x", "--shape", "1,16", "--slice", "0"}, "--slice"},
      {{"--layer", "x", "--shape", "1,16", "--max-samples", "0"}, "--max-samples"},
      {{"--layer", "x", "--shape", "1,16", "--seed", "-3"}, "--seed"},
      {{"--layer", "x", "--shape", "1,16", "--json"}, "--json"},
      {{"--layer", "x", "--shape", "1,16", "--plot="}, "--plot"},
      {{"--layer", "x", "--shape", "1,16", "--bogus"}, "--bogus"},
      {{"--layer", "x", "--shape", "1,16", "extra"}, "extra"},
  };
  for (const UsageCase& c : cases) {
    std::vector<std::string> args = {"bench"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const CliResult r = Cli(args);
    std::string joined;
    for (const std::string& a : c.args) joined += a + " ";
    EXPECT_EQ(r.code, kExitUsage) << joined << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr("attnserve-cli bench: ")) << joined;
    EXPECT_THAT(r.err, HasSubstr(c.names)) << joined;
    EXPECT_THAT(r.err, HasSubstr("usage: attnserve-cli [global flags] bench")) << joined;
    EXPECT_EQ(r.out, "") << joined;
  }
}

TEST(BenchArgs, ParsesEveryFlag) {
  BenchArgs a;
  std::string error;
  ASSERT_TRUE(ParseBenchArgs({"--layer",
                              "L",
                              "--forms",
                              "summed,factored,lowrank",
                              "--shape",
                              "2,8,5",
                              "--concurrency",
                              "1,8,32",
                              "--requests",
                              "40",
                              "--warmup",
                              "250ms",
                              "--causal",
                              "--target",
                              "dns:///h:1",
                              "--json",
                              "a.json",
                              "--csv",
                              "a.csv",
                              "--plot",
                              "a.svg",
                              "--interleave",
                              "request",
                              "--slice",
                              "2s",
                              "--max-samples",
                              "7",
                              "--seed",
                              "9"},
                             &a, &error))
      << error;
  EXPECT_EQ(a.layer, "L");
  EXPECT_EQ(a.forms, (std::vector<v1::Form>{v1::FORM_SUMMED, v1::FORM_FACTORED, v1::FORM_LOWRANK}));
  EXPECT_EQ(a.batch, 2);
  EXPECT_EQ(a.n, 8);
  EXPECT_EQ(a.m, 5);
  EXPECT_EQ(a.concurrency, (std::vector<int64_t>{1, 8, 32}));
  EXPECT_EQ(a.requests, 40);
  EXPECT_EQ(a.warmup, std::chrono::milliseconds(250));
  EXPECT_TRUE(a.causal);
  EXPECT_EQ(a.target, "dns:///h:1");
  EXPECT_EQ(a.json, "a.json");
  EXPECT_EQ(a.csv, "a.csv");
  EXPECT_EQ(a.plot, "a.svg");
  EXPECT_EQ(a.interleave, Interleave::kRequest);
  EXPECT_EQ(a.slice, std::chrono::seconds(2));
  EXPECT_EQ(a.max_samples, 7);
  EXPECT_EQ(a.seed, 9u);

  ASSERT_TRUE(ParseBenchArgs({"--layer", "L", "--shape", "1,16"}, &a, &error)) << error;
  EXPECT_EQ(a.forms, (std::vector<v1::Form>{v1::FORM_FACTORED, v1::FORM_SUMMED}));
  EXPECT_EQ(a.m, 0);
  EXPECT_EQ(a.concurrency, (std::vector<int64_t>{1}));
  EXPECT_EQ(a.duration, std::chrono::seconds(10));
  EXPECT_EQ(a.requests, 0);
  EXPECT_EQ(a.interleave, Interleave::kSlice);
}

TEST(BenchArgs, Durations) {
  std::chrono::nanoseconds d{};
  std::string error;
  const std::pair<const char*, std::chrono::nanoseconds> ok[] = {{"10s", std::chrono::seconds(10)},
                                                                 {"10", std::chrono::seconds(10)},
                                                                 {"1.5s", std::chrono::milliseconds(1500)},
                                                                 {"250ms", std::chrono::milliseconds(250)},
                                                                 {"2m", std::chrono::minutes(2)},
                                                                 {"500us", std::chrono::microseconds(500)},
                                                                 {"0", std::chrono::seconds(0)}};
  for (const auto& [text, want] : ok) {
    ASSERT_TRUE(ParseDuration(text, "--d", &d, &error)) << text << ": " << error;
    EXPECT_EQ(d, want) << text;
  }
  for (const char* bad : {"", "s", "-1s", "1.2.3s", "1 s", "5d", "ms10", "1e3s"}) {
    EXPECT_FALSE(ParseDuration(bad, "--d", &d, &error)) << bad;
    EXPECT_THAT(error, HasSubstr("--d")) << bad;
  }
}

TEST(BenchHelp, StatesTheToolsOwnCost) {
  const CliResult r = Cli({"bench", "--help"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_THAT(r.out, HasSubstr("--noop-server"));
  EXPECT_THAT(r.out, HasSubstr("Own cost"));
  EXPECT_THAT(r.out, HasSubstr("--interleave"));
}

// ---------------------------------------------------------------------------------------------
// Statistics

TEST(LatencyStats, ExactPercentilesWhileUnderCapacity) {
  LatencyStats s(1000);
  for (int i = 100; i >= 1; --i) s.Add(i);  // order must not matter
  EXPECT_EQ(s.count(), 100);
  EXPECT_EQ(s.samples(), 100);
  EXPECT_DOUBLE_EQ(s.Percentile(50), 50);
  EXPECT_DOUBLE_EQ(s.Percentile(90), 90);
  EXPECT_DOUBLE_EQ(s.Percentile(95), 95);
  EXPECT_DOUBLE_EQ(s.Percentile(99), 99);
  EXPECT_DOUBLE_EQ(s.Percentile(100), 100);
  EXPECT_DOUBLE_EQ(s.Percentile(0), 1);
  EXPECT_DOUBLE_EQ(s.max(), 100);
  EXPECT_DOUBLE_EQ(s.mean(), 50.5);
  // A rank between two samples rounds up: the smallest sample with at least p % of them at or
  // below it (of 1..10, p95 is 10, for 9 has only 90 % at or below it).
  LatencyStats ten(100);
  for (int i = 10; i >= 1; --i) ten.Add(i);
  EXPECT_EQ(ten.Percentile(95), 10);
  EXPECT_EQ(ten.Percentile(85), 9);
  EXPECT_EQ(ten.Percentile(15), 2);
  LatencyStats empty(10);
  EXPECT_EQ(empty.Percentile(50), 0);
  LatencyStats one(10);
  one.Add(3.5);
  EXPECT_EQ(one.Percentile(1), 3.5);
  EXPECT_EQ(one.Percentile(99), 3.5);
}

TEST(LatencyStats, ReservoirBoundsMemoryAndStaysUniform) {
  LatencyStats s(2000, 7);
  for (int i = 1; i <= 200000; ++i) s.Add(i);
  EXPECT_EQ(s.count(), 200000);
  EXPECT_EQ(s.samples(), 2000);
  EXPECT_DOUBLE_EQ(s.max(), 200000);  // exact, whatever the reservoir kept
  EXPECT_DOUBLE_EQ(s.mean(), 100000.5);
  // A uniform sample of 2000 puts the quantiles within a few percent of the truth.
  EXPECT_NEAR(s.Percentile(50), 100000, 8000);
  EXPECT_NEAR(s.Percentile(90), 180000, 6000);
  EXPECT_NEAR(s.Percentile(10), 20000, 6000);
}

// ---------------------------------------------------------------------------------------------
// Records and files

std::vector<BenchRecord> SyntheticRecords() {
  BenchArgs args;
  args.layer = "demo,\"x\"";  // a name that needs quoting in CSV and escaping in JSON
  args.batch = 2;
  args.n = 16;
  args.forms = {v1::FORM_FACTORED, v1::FORM_SUMMED};
  std::vector<BenchRecord> records;
  for (int64_t c : {1, 8, 32}) {
    for (v1::Form f : args.forms) {
      BenchCell cell(100, 1);
      cell.form = f;
      cell.concurrency = c;
      cell.seconds = 2;
      const double base = (f == v1::FORM_SUMMED ? 2.0 : 1.0) * static_cast<double>(c);
      for (int i = 1; i <= 10; ++i) cell.latency.Add(base * i);
      cell.queue_us_sum = 10 * 100;
      cell.compute_us_sum = 10 * 900;
      cell.batch_requests_sum = 10 * 3;
      if (c == 8) cell.errors = {{"UNAVAILABLE", 2}, {"DEADLINE_EXCEEDED", 1}};
      records.push_back(MakeRecord(args, cell));
    }
  }
  return records;
}

TEST(BenchRecords, RecordFromCell) {
  const std::vector<BenchRecord> records = SyntheticRecords();
  ASSERT_EQ(records.size(), 6u);
  const BenchRecord& r = records[3];  // summed at concurrency 8
  EXPECT_EQ(r.form, "summed");
  EXPECT_EQ(r.concurrency, 8);
  EXPECT_EQ(r.requests, 10);
  EXPECT_EQ(r.errors, 3);
  EXPECT_DOUBLE_EQ(r.requests_per_s, 5);
  EXPECT_DOUBLE_EQ(r.tokens_per_s, 5 * 2 * 16);
  EXPECT_DOUBLE_EQ(r.p50_ms, 16 * 5);
  EXPECT_DOUBLE_EQ(r.p90_ms, 16 * 9);
  EXPECT_DOUBLE_EQ(r.max_ms, 16 * 10);
  EXPECT_DOUBLE_EQ(r.queue_us, 100);
  EXPECT_DOUBLE_EQ(r.compute_us, 900);
  EXPECT_DOUBLE_EQ(r.batch_requests, 3);
}

TEST(BenchRecords, JsonSchema) {
  const std::vector<BenchRecord> records = SyntheticRecords();
  const nlohmann::json j = nlohmann::json::parse(RecordsJson(records));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), records.size());
  for (const auto& rec : j) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : rec.items()) keys.push_back(k);
    std::vector<std::string> want = kFields;
    std::sort(want.begin(), want.end());
    std::sort(keys.begin(), keys.end());  // nlohmann sorts object keys; compare as sets
    EXPECT_EQ(keys, want);
    EXPECT_TRUE(rec["layer"].is_string());
    EXPECT_EQ(rec["layer"], "demo,\"x\"");
    EXPECT_TRUE(rec["form"] == "factored" || rec["form"] == "summed");
    EXPECT_TRUE(rec["causal"].is_boolean());
    EXPECT_TRUE(rec["error_codes"].is_object());
    for (const char* k : {"batch", "n", "m", "concurrency", "requests", "errors", "samples"}) {
      EXPECT_TRUE(rec[k].is_number_integer()) << k;
    }
    for (const char* k : {"seconds", "requests_per_s", "tokens_per_s", "mean_ms", "p50_ms", "p90_ms", "p95_ms",
                          "p99_ms", "max_ms", "queue_us", "compute_us", "batch_requests"}) {
      EXPECT_TRUE(rec[k].is_number()) << k;
    }
    EXPECT_LE(rec["p50_ms"].get<double>(), rec["p90_ms"].get<double>());
    EXPECT_LE(rec["p99_ms"].get<double>(), rec["max_ms"].get<double>());
  }
  EXPECT_EQ(j[2]["error_codes"]["UNAVAILABLE"], 2);
  EXPECT_EQ(j[2]["error_codes"]["DEADLINE_EXCEEDED"], 1);
  EXPECT_EQ(j[2]["errors"], 3);
  EXPECT_EQ(j[1]["p50_ms"], 10.0);
}

TEST(BenchRecords, CsvSchema) {
  const std::string csv = RecordsCsv(SyntheticRecords());
  std::istringstream in(csv);
  std::string header;
  std::getline(in, header);
  std::string want;
  for (const std::string& f : kFields) want += (want.empty() ? "" : ",") + f;
  EXPECT_EQ(header, want);
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(line);
  ASSERT_EQ(rows.size(), 6u);
  // The layer name is quoted (it holds a comma and a quote); the rest splits on commas.
  const std::string quoted = "\"demo,\"\"x\"\"\",";
  for (const std::string& row : rows) {
    ASSERT_EQ(row.rfind(quoted, 0), 0u) << row;
    const std::string rest = row.substr(quoted.size());
    EXPECT_EQ(std::count(rest.begin(), rest.end(), ','), static_cast<long>(kFields.size()) - 2) << row;
  }
  EXPECT_THAT(rows[2], HasSubstr(",DEADLINE_EXCEEDED=1;UNAVAILABLE=2,"));
}

TEST(BenchRecords, TableAndRatios) {
  std::ostringstream out;
  const std::vector<BenchRecord> records = SyntheticRecords();
  PrintTable(records, out);
  PrintRatios(records, out);
  const std::string text = out.str();
  for (const char* column : {"form", "concurrency", "requests_per_s", "tokens_per_s", "p50_ms", "p90_ms", "p95_ms",
                             "p99_ms", "max_ms", "queue_us", "compute_us", "batch_requests", "errors"}) {
    EXPECT_THAT(text, HasSubstr(column));
  }
  EXPECT_THAT(text, HasSubstr("DEADLINE_EXCEEDED=1,UNAVAILABLE=2"));
  // Summed latencies are twice the factored ones, throughputs equal.
  EXPECT_THAT(text, HasSubstr("ratio summed/factored: requests_per_s c1=1.000 c8=1.000 c32=1.000  "
                              "p50_ms c1=2.000 c8=2.000 c32=2.000"));
}

TEST(BenchRecords, SvgIsWellFormedWithEverySeries) {
  TempFile svg(".svg");
  ASSERT_TRUE(WriteTextFile(svg.path(), RecordsSvg(SyntheticRecords(), "title <&> \"q\"")).ok());
  std::string output;
  const int code = Shell(std::string(ATTNSERVE_PYTHON) + " " + ATTNSERVE_TEST_TOOLS_DIR + "/check_bench_svg.py " +
                             svg.path() + " factored,summed 3",
                         &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("svg ok"));
  // One level only: the points sit in the middle of the axis, still one per series.
  std::vector<BenchRecord> one;
  for (const BenchRecord& r : SyntheticRecords()) {
    if (r.concurrency == 8) one.push_back(r);
  }
  ASSERT_TRUE(WriteTextFile(svg.path(), RecordsSvg(one, "one level")).ok());
  EXPECT_EQ(Shell(std::string(ATTNSERVE_PYTHON) + " " + ATTNSERVE_TEST_TOOLS_DIR + "/check_bench_svg.py " + svg.path() +
                      " factored,summed 1",
                  &output),
            0)
      << output;
}

TEST(BenchRecords, UnwritableFileIsAnError) {
  const grpc::Status s = WriteTextFile("/nonexistent-dir/x.json", "[]");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.error_message(), HasSubstr("/nonexistent-dir/x.json"));
}

// ---------------------------------------------------------------------------------------------
// Whole runs against the in-process no-op server

TEST(BenchNoop, SliceInterleaveByCount) {
  TempFile json(".json"), csv(".csv"), svg(".svg");
  const CliResult r =
      Cli({"bench", "--noop-server", "--shape", "1,4", "--concurrency", "1,4", "--requests", "60", "--warmup", "0",
           "--slice", "20ms", "--json", json.path(), "--csv", csv.path(), "--plot", svg.path()});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("interleave=slice"));
  EXPECT_THAT(r.out, HasSubstr("ratio summed/factored: requests_per_s c1="));
  const nlohmann::json j = nlohmann::json::parse(ReadFile(json.path()));
  ASSERT_EQ(j.size(), 4u);
  std::set<std::pair<std::string, int64_t>> cells;
  for (const auto& rec : j) {
    cells.insert({rec["form"].get<std::string>(), rec["concurrency"].get<int64_t>()});
    EXPECT_GE(rec["requests"].get<int64_t>(), 60) << rec;
    EXPECT_EQ(rec["errors"], 0) << rec;
    EXPECT_GT(rec["requests_per_s"].get<double>(), 0) << rec;
    EXPECT_GT(rec["seconds"].get<double>(), 0) << rec;
    EXPECT_NEAR(rec["tokens_per_s"].get<double>() / rec["requests_per_s"].get<double>(), 4, 1e-6) << rec;
    EXPECT_EQ(rec["batch_requests"], 1.0) << rec;
  }
  EXPECT_EQ(cells, (std::set<std::pair<std::string, int64_t>>{
                       {"factored", 1}, {"summed", 1}, {"factored", 4}, {"summed", 4}}));
  std::string output;
  EXPECT_EQ(Shell(std::string(ATTNSERVE_PYTHON) + " " + ATTNSERVE_TEST_TOOLS_DIR + "/check_bench_svg.py " + svg.path() +
                      " factored,summed 2",
                  &output),
            0)
      << output;
  const std::string csv_text = ReadFile(csv.path());
  EXPECT_EQ(std::count(csv_text.begin(), csv_text.end(), '\n'), 5) << csv_text;
}

TEST(BenchNoop, RequestInterleaveByDuration) {
  TempFile json(".json");
  const CliResult r =
      Cli({"bench", "--noop-server", "--forms", "summed,factored,lowrank", "--shape", "2,3,5", "--concurrency", "3",
           "--duration", "300ms", "--warmup", "50ms", "--interleave", "request", "--causal", "--json", json.path()});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("context=[2, 5, 768]"));
  // Baseline factored even when listed second.
  EXPECT_THAT(r.out, HasSubstr("ratio summed/factored:"));
  EXPECT_THAT(r.out, HasSubstr("ratio lowrank/factored:"));
  const nlohmann::json j = nlohmann::json::parse(ReadFile(json.path()));
  ASSERT_EQ(j.size(), 3u);
  int64_t most = 0, least = INT64_MAX;
  for (const auto& rec : j) {
    EXPECT_EQ(rec["m"], 5);
    EXPECT_EQ(rec["causal"], true);
    EXPECT_NEAR(rec["seconds"].get<double>(), 0.3, 0.25);
    most = std::max(most, rec["requests"].get<int64_t>());
    least = std::min(least, rec["requests"].get<int64_t>());
  }
  // Round-robin per request: the forms complete as many requests as each other, within the
  // calls in flight.
  EXPECT_GT(least, 0);
  EXPECT_LE(most - least, 3);
}

// ---------------------------------------------------------------------------------------------
// The load loop against a server whose answers are known

// Every third call fails at once; the others take at least kServiceTime. So what the load loop
// records can be held to what the server did: no failed call's latency among the OK ones, no
// more completions than calls, and no time shorter than the OK calls' service took.
class SlowAndFailingService final : public v1::AttentionService::CallbackService {
 public:
  static constexpr std::chrono::milliseconds kServiceTime{2};

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override {
    auto* reactor = ctx->DefaultReactor();
    if (calls.fetch_add(1) % 3 == 2) {
      ++failed;
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "every third call fails"));
      return reactor;
    }
    std::this_thread::sleep_for(kServiceTime);
    *resp->mutable_output() = req->input();
    resp->set_form(req->form());
    resp->set_batch_requests(1);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  std::atomic<int64_t> calls{0}, failed{0};
};

class BenchLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port_ != 0) << "cannot start the test server on 127.0.0.1";
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    options.timeout = std::chrono::milliseconds(10000);
    client_ = std::make_unique<Client>(options);
  }
  void TearDown() override {
    client_.reset();
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  static BenchArgs Args() {
    BenchArgs args;
    args.layer = "fake";
    args.batch = 1;
    args.n = 4;
    args.warmup = std::chrono::nanoseconds(0);
    return args;
  }

  static int64_t Errors(const BenchCell& cell) {
    int64_t errors = 0;
    for (const auto& [code, count] : cell.errors) errors += count;
    return errors;
  }

  SlowAndFailingService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(BenchLoadTest, FailedCallsAreCountedApartAndTheirLatenciesLeftOut) {
  BenchArgs args = Args();
  args.concurrency = {3};
  args.interleave = Interleave::kRequest;
  args.duration = std::chrono::milliseconds(300);
  const std::vector<BenchCell> cells = RunLoad(*client_, args, 8, nullptr);
  ASSERT_EQ(cells.size(), 2u);
  int64_t recorded = 0;
  for (const BenchCell& cell : cells) {
    SCOPED_TRACE(FormName(cell.form));
    ASSERT_GT(cell.latency.count(), 0);
    EXPECT_GT(cell.errors.count("UNAVAILABLE"), 0u);
    EXPECT_EQ(cell.errors.size(), 1u);
    // The fastest OK call still took the server's service time: a failed call, answered at
    // once, counted among them would be faster.
    EXPECT_GE(cell.latency.Percentile(0), 2.0);
    EXPECT_NEAR(cell.seconds, 0.3, 0.2);
    recorded += cell.latency.count() + Errors(cell);
  }
  // The calls still in flight when the time was up ended uncounted.
  EXPECT_LE(recorded, service_.calls.load());
  EXPECT_GE(recorded, service_.calls.load() - 3);
}

TEST_F(BenchLoadTest, ByCountEachFormEndsAtItsCountAndIsTimedOverEveryTurn) {
  BenchArgs args = Args();
  // One form: with two, the form done first still takes its turn in each round the other needs
  // (a completion a turn), so only "at least" holds for it.
  args.forms = {v1::FORM_SUMMED};
  args.concurrency = {2};
  args.interleave = Interleave::kSlice;
  args.slice = std::chrono::milliseconds(10);
  args.requests = 60;
  const std::vector<BenchCell> cells = RunLoad(*client_, args, 8, nullptr);
  ASSERT_EQ(cells.size(), 1u);
  const BenchCell& cell = cells[0];
  // Each turn ends at the count still wanted, and what completes in its drain is not counted.
  EXPECT_EQ(cell.latency.count() + Errors(cell), 60);
  EXPECT_GT(Errors(cell), 0);
  // Two calls in flight, each OK one at least 2 ms: the turns together took at least this long,
  // however many it needed (10 ms each, so several).
  const double served_s = static_cast<double>(cell.latency.count()) * 0.002 / 2;
  EXPECT_GE(cell.seconds, served_s) << cell.latency.count() << " OK calls";
  EXPECT_GT(service_.calls.load(), 60);  // the drains' calls were made, and left out
}

TEST(BenchNoop, UnreachableServerFails) {
  const CliResult r = Cli({"bench", "--layer", "x", "--shape", "1,4", "--requests", "1"});
  EXPECT_EQ(r.code, kExitFailure) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("error: UNAVAILABLE"));
}

}  // namespace
}  // namespace attnserve::cli
