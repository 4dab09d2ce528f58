// server/metrics: the families are exactly the design's (§5 of the shared ARCHITECTURE.md, plus
// the two this project adds), recorded values come out of a text-format scrape as the exact
// samples Prometheus would read, promtool accepts the scrape, the HTTP endpoint serves it, and
// the Grafana dashboard asks only for metrics and labels the server exports.
#include "server/metrics/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server/metrics/device_gauges.h"
#include "server/metrics/metrics_endpoint.h"
#include "tests/unit/http_get.h"

namespace attnserve {
namespace {

using ::attnserve::testing::HttpGet;
using ::testing::HasSubstr;
using ::testing::Not;

// One sample of a scrape: name{label="value",...} value, labels sorted by name.
using Samples = std::map<std::string, double>;

std::string Key(const std::string& name, std::map<std::string, std::string> labels) {
  std::string key = name + "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    key += (first ? "" : ",") + k + "=\"" + v + "\"";
    first = false;
  }
  return key + "}";
}

// Parses the text exposition format (no escapes are needed for our label values). `le`
// values are normalised through strtod so that "0.0005" and "5.0000000000000001e-04" agree.
Samples Parse(const std::string& text) {
  Samples samples;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    std::string name = line.substr(0, std::min(brace, space));
    std::map<std::string, std::string> labels;
    if (brace != std::string::npos) {
      const size_t close = line.find('}', brace);
      const std::string body = line.substr(brace + 1, close - brace - 1);
      std::regex pair(R"re(([a-z_]+)="([^"]*)")re");
      for (auto it = std::sregex_iterator(body.begin(), body.end(), pair); it != std::sregex_iterator(); ++it) {
        std::string value = (*it)[2];
        if ((*it)[1] == "le" && value != "+Inf") {
          char buf[64];
          std::snprintf(buf, sizeof buf, "%g", std::strtod(value.c_str(), nullptr));
          value = buf;
        }
        labels[(*it)[1]] = value;
      }
    }
    samples[Key(name, labels)] = std::strtod(line.substr(space + 1).c_str(), nullptr);
  }
  return samples;
}

double Sample(const Samples& s, const std::string& name, std::map<std::string, std::string> labels) {
  auto it = s.find(Key(name, labels));
  if (it == s.end()) {
    ADD_FAILURE() << "no sample " << Key(name, labels);
    return -1;
  }
  return it->second;
}

bool Has(const Samples& s, const std::string& name, std::map<std::string, std::string> labels) {
  return s.count(Key(name, labels)) > 0;
}

// A registry with a sample in every family.
Metrics& FullyRecorded(Metrics& m) {
  m.SetBuildInfo("0.1.0", "cpu", "eigen");
  m.RequestStarted();
  m.RequestFinished("demo", Variant{Form::kFactored}, StatusCode::kOk, 0.001);
  m.JobQueued("demo", Variant{Form::kFactored});
  m.JobDequeued("demo", Variant{Form::kFactored}, 0.0002);
  m.BatchDone({.layer = "demo", .variant = Variant{Form::kFactored}, .device = "cpu", .requests = 1, .tokens = 8,
               .flops = 1e6, .compute_seconds = 0.0005});
  m.BatchDone({.layer = "demo", .variant = Variant{Form::kFactored}, .device = "cuda:0", .requests = 1, .tokens = 8,
               .flops = 1e6, .compute_seconds = 0.0005, .device_seconds = {{1e-4, 3e-4, 5e-5}}});
  m.SetLayerForm("demo", Variant{Form::kFactored}, "cpu", 100, 400);
  m.RouteChanged("*", {{Form::kFactored, 0.9}, {Form::kSummed, 0.1}});
  m.RoutesApplied(12345);
  m.RoutesFileLoaded(true);
  m.ShadowCompared("demo", Variant{Form::kSummed}, {.max_abs = 1e-6, .rel_l2 = 1e-7});
  m.ShadowDropped("demo");
  m.CountDeviceError("cuda:0");
  m.CountNonFiniteOutput("demo", Variant{Form::kSummed});
  m.CountAutoChoice("demo", Variant{Form::kSummed});
  const double stages[] = {1e-6, 2e-6, 3e-6, 4e-6, 5e-4, 6e-6, 7e-6};
  m.StagesServed(stages);
  return m;
}

TEST(MetricsTest, FamiliesAreExactlyTheDesignsWithTheirLabels) {
  // Written from ../shared/ARCHITECTURE.md §5 (prefix attnserve_), not from metrics.cc; the
  // last three are this project's additions (docs/metrics.md).
  const std::map<std::string, std::pair<std::string, std::vector<std::string_view>>> want = {
      {"attnserve_requests_total", {"counter", {"layer", "form", "math", "code"}}},
      {"attnserve_request_duration_seconds", {"histogram", {"layer", "form", "math", "code"}}},
      {"attnserve_queue_duration_seconds", {"histogram", {"layer", "form", "math"}}},
      {"attnserve_compute_duration_seconds", {"histogram", {"layer", "form", "math", "device"}}},
      {"attnserve_batch_requests", {"histogram", {"layer", "form", "math"}}},
      {"attnserve_batch_tokens", {"histogram", {"layer", "form", "math"}}},
      {"attnserve_flops_total", {"counter", {"layer", "form", "math", "device"}}},
      {"attnserve_queue_depth", {"gauge", {"layer", "form", "math"}}},
      {"attnserve_computing_requests", {"gauge", {"layer", "form", "math"}}},
      {"attnserve_inflight_requests", {"gauge", {}}},
      {"attnserve_memory_reserved_bytes", {"gauge", {}}},
      {"attnserve_memory_budget_bytes", {"gauge", {}}},
      {"attnserve_shadow_divergence", {"histogram", {"layer", "form", "math"}}},
      {"attnserve_shadow_dropped_total", {"counter", {"layer"}}},
      {"attnserve_layer_parameters", {"gauge", {"layer", "form", "math"}}},
      {"attnserve_layer_bytes", {"gauge", {"layer", "form", "math", "device"}}},
      {"attnserve_route_weight", {"gauge", {"layer", "form", "math"}}},
      {"attnserve_routes_generation", {"gauge", {}}},
      {"attnserve_config_reload_total", {"counter", {"result"}}},
      {"attnserve_build_info", {"gauge", {"version", "device", "blas"}}},
      {"attnserve_shadow_divergence_max_abs", {"histogram", {"layer", "form", "math"}}},
      {"attnserve_device_errors_total", {"counter", {"device"}}},
      {"attnserve_nonfinite_outputs_total", {"counter", {"layer", "form", "math"}}},
      {"attnserve_auto_choice_total", {"counter", {"layer", "form", "math"}}},
      {"attnserve_backend_retained_bytes", {"gauge", {}}},
      {"attnserve_stage_seconds", {"histogram", {"stage"}}},
      // What GPU operators expect (issue 48): the backend call's split, the device budget and
      // lanes, NVML's readings.
      {"attnserve_device_time_seconds", {"histogram", {"layer", "form", "math", "device", "part"}}},
      {"attnserve_device_memory_held_bytes", {"gauge", {"device"}}},
      {"attnserve_device_memory_limit_bytes", {"gauge", {"device"}}},
      {"attnserve_device_lanes", {"gauge", {"device"}}},
      {"attnserve_gpu_utilization_ratio", {"gauge", {"device"}}},
      {"attnserve_gpu_memory_used_bytes", {"gauge", {"device"}}},
      {"attnserve_gpu_memory_total_bytes", {"gauge", {"device"}}},
      {"attnserve_gpu_temperature_celsius", {"gauge", {"device"}}},
      {"attnserve_gpu_power_watts", {"gauge", {"device"}}},
  };
  std::map<std::string, std::pair<std::string, std::vector<std::string_view>>> got;
  for (const MetricFamilySpec& f : MetricFamilies()) got[std::string(f.name)] = {std::string(f.type), f.labels};
  EXPECT_EQ(got, want);

  // And a scrape declares each with that type (a family appears once it has a series).
  Metrics metrics;
  FullyRecorded(metrics);
  DeviceGauges device(metrics, "cuda:0");
  device.SetDeviceMemory(1 << 20, 1 << 30, 2);
  device.SetGpuSample({.utilization = 0.5, .memory_used = 1, .memory_total = 2, .temperature_c = 40, .power_w = 100});
  const std::string text = metrics.Scrape();
  for (const auto& [name, spec] : want) {
    EXPECT_THAT(text, HasSubstr("# TYPE " + name + " " + spec.first + "\n")) << name;
  }
}

TEST(MetricsTest, BucketsSpanMicrosecondsToSecondsAndAreIncreasing) {
  for (const std::vector<double>* b :
       {&LatencyBuckets(), &RequestLatencyBuckets(), &BatchRequestBuckets(), &BatchTokenBuckets(), &DivergenceBuckets(), &StageBuckets()}) {
    for (size_t i = 1; i < b->size(); ++i) EXPECT_LT((*b)[i - 1], (*b)[i]);
  }
  // request_duration_seconds: factor 1.25 from 100 µs to about 30 s, so that a quantile read
  // between two bounds is within 25 % (the 1-2.5-5 buckets allowed 2.5×).
  const std::vector<double>& r = RequestLatencyBuckets();
  ASSERT_EQ(r.size(), 57u);
  EXPECT_DOUBLE_EQ(r.front(), 1e-4);
  for (size_t i = 1; i < r.size(); ++i) EXPECT_NEAR(r[i] / r[i - 1], 1.25, 1e-12) << i;
  EXPECT_NEAR(r.back(), 1e-4 * std::exp(56 * std::log(1.25)), 1e-9);
  EXPECT_GT(r.back(), 25.0);
  EXPECT_LT(r.back(), 30.0);
  EXPECT_DOUBLE_EQ(LatencyBuckets().front(), 50e-6);
  EXPECT_DOUBLE_EQ(LatencyBuckets().back(), 10.0);
  EXPECT_DOUBLE_EQ(DivergenceBuckets().front(), 1e-9);
  EXPECT_DOUBLE_EQ(DivergenceBuckets().back(), 1.0);
  EXPECT_DOUBLE_EQ(StageBuckets().front(), 1e-6);
  EXPECT_DOUBLE_EQ(StageBuckets().back(), 10.0);
}

TEST(MetricsTest, EachServingStageHasItsOwnSeries) {
  Metrics m;
  // Two calls: every stage sees both, each under its own label, in the buckets its time falls in.
  const double first[] = {2e-6, 30e-6, 7e-6, 0, 0.004, 8e-6, 60e-6};
  const double second[] = {3e-6, 40e-6, 9e-6, 0.0002, 0.006, 20e-6, 90e-6};
  m.StagesServed(first);
  m.StagesServed(second);
  const Samples s = Parse(m.Scrape());
  const std::string family = "attnserve_stage_seconds";
  for (size_t i = 0; i < std::size(kAllServingStages); ++i) {
    const std::string stage(ServingStageName(kAllServingStages[i]));
    EXPECT_EQ(Sample(s, family + "_count", {{"stage", stage}}), 2) << stage;
    EXPECT_DOUBLE_EQ(Sample(s, family + "_sum", {{"stage", stage}}), first[i] + second[i]) << stage;
  }
  EXPECT_EQ(Sample(s, family + "_bucket", {{"stage", "route"}, {"le", "2.5e-06"}}), 1);
  EXPECT_EQ(Sample(s, family + "_bucket", {{"stage", "route"}, {"le", "5e-06"}}), 2);
  EXPECT_EQ(Sample(s, family + "_bucket", {{"stage", "queue"}, {"le", "1e-06"}}), 1);  // ran at once
  EXPECT_EQ(Sample(s, family + "_bucket", {{"stage", "compute"}, {"le", "0.005"}}), 1);
  EXPECT_EQ(Sample(s, family + "_bucket", {{"stage", "send"}, {"le", "0.0001"}}), 2);
  std::set<std::string> names;
  for (ServingStage stage : kAllServingStages) names.insert(std::string(ServingStageName(stage)));
  EXPECT_EQ(names, (std::set<std::string>{"route", "decode", "admit", "queue", "compute", "encode", "send"}));
}

// The upper bound 1e-4 · 1.25^k as Parse writes an `le`, computed here and not read from metrics.cc.
std::string Le(int k) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", 1e-4 * std::pow(1.25, k));
  return buf;
}

// A served variant's math is a label of its own (docs/metrics.md): the same form in two maths
// is two series of every family, and a route's targets carry the math they were resolved to.
TEST(MetricsTest, EachMathOfAFormIsASeriesOfItsOwn) {
  Metrics m;
  for (int i = 0; i < 3; ++i) m.RequestStarted();
  m.RequestFinished("demo", Variant{Form::kFactored, Math::kBf16}, StatusCode::kOk, 0.001);
  m.RequestFinished("demo", Variant{Form::kFactored, Math::kBf16}, StatusCode::kOk, 0.002);
  m.RequestFinished("demo", Variant{Form::kFactored, Math::kFp32}, StatusCode::kOk, 0.003);
  m.ShadowCompared("demo", Variant{Form::kFactored, Math::kFp32}, {.max_abs = 1e-3, .rel_l2 = 2e-3});
  m.RouteChanged("demo", {{RouteTarget(Form::kFactored, Math::kFp32), 0.1}, {RouteTarget(Form::kFactored, Math::kBf16), 0.9}});
  const Samples s = Parse(m.Scrape());
  const std::string req = "attnserve_requests_total";
  EXPECT_EQ(Sample(s, req, {{"layer", "demo"}, {"form", "factored"}, {"math", "bf16"}, {"code", "OK"}}), 2);
  EXPECT_EQ(Sample(s, req, {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}, {"code", "OK"}}), 1);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_count", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}}),
            1);
  EXPECT_FALSE(Has(s, "attnserve_shadow_divergence_count", {{"layer", "demo"}, {"form", "factored"}, {"math", "bf16"}}));
  EXPECT_DOUBLE_EQ(Sample(s, "attnserve_route_weight", {{"layer", "demo"}, {"form", "factored"}, {"math", "bf16"}}), 0.9);
  EXPECT_DOUBLE_EQ(Sample(s, "attnserve_route_weight", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}}), 0.1);
}

TEST(MetricsTest, RequestsCountByCodeAndObserveLatency) {
  Metrics m;
  for (int i = 0; i < 5; ++i) m.RequestStarted();
  m.RequestFinished("demo", Variant{Form::kFactored}, StatusCode::kOk, 0.0003);
  m.RequestFinished("demo", Variant{Form::kFactored}, StatusCode::kOk, 0.004);
  m.RequestFinished("demo", Variant{Form::kSummed}, StatusCode::kResourceExhausted, 0.00004);
  m.RequestFinished("demo", Variant{Form::kFactored}, StatusCode::kResourceExhausted, 0.00011);
  const Samples s = Parse(m.Scrape());
  const std::string req = "attnserve_requests_total", dur = "attnserve_request_duration_seconds";
  EXPECT_EQ(Sample(s, req, {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}, {"code", "OK"}}), 2);
  EXPECT_EQ(Sample(s, req, {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}, {"code", "RESOURCE_EXHAUSTED"}}), 1);
  EXPECT_EQ(Sample(s, "attnserve_inflight_requests", {}), 1);  // 5 started, 4 finished
  // Cumulative buckets, OK calls apart from failed ones: 0.0003 s lies in (1e-4·1.25^4, 1e-4·1.25^5]
  // = (0.000244, 0.000305], 0.004 s in (1e-4·1.25^16, 1e-4·1.25^17] = (0.00355, 0.00444].
  const std::map<std::string, std::string> ok = {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}, {"code", "OK"}};
  auto bucket = [&](const std::map<std::string, std::string>& labels, const std::string& le) {
    auto l = labels;
    l["le"] = le;
    return Sample(s, dur + "_bucket", l);
  };
  EXPECT_EQ(bucket(ok, Le(4)), 0);
  EXPECT_EQ(bucket(ok, Le(5)), 1);
  EXPECT_EQ(bucket(ok, Le(16)), 1);
  EXPECT_EQ(bucket(ok, Le(17)), 2);
  EXPECT_EQ(bucket(ok, "+Inf"), 2);
  EXPECT_EQ(Sample(s, dur + "_count", ok), 2);
  EXPECT_DOUBLE_EQ(Sample(s, dur + "_sum", ok), 0.0043);
  // The refused factored call has its own series: it does not pull the OK latency down.
  const std::map<std::string, std::string> shed = {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"},
                                                   {"code", "RESOURCE_EXHAUSTED"}};
  EXPECT_EQ(Sample(s, dur + "_count", shed), 1);
  EXPECT_EQ(bucket(shed, Le(0)), 0);
  EXPECT_EQ(bucket(shed, Le(1)), 1);
  // Below the first bound: the first bucket.
  EXPECT_EQ(bucket({{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}, {"code", "RESOURCE_EXHAUSTED"}}, Le(0)), 1);
  EXPECT_FALSE(Has(s, dur + "_count", {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}, {"code", "OK"}}));
}

TEST(MetricsTest, RefusedBeforeAFormIsKnownCountsUnderNone) {
  Metrics m;
  m.RequestStarted();
  m.RequestFinished("", std::nullopt, StatusCode::kNotFound, 0.0001);
  const Samples s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_requests_total", {{"layer", ""}, {"form", "none"}, {"math", "none"}, {"code", "NOT_FOUND"}}), 1);
}

// A layer's work in flight is its queue plus its jobs in a backend call; a call that fails ends
// as surely as one that succeeds.
TEST(MetricsTest, ComputingRequestsCountJobsInABackendCallPerLayerAndForm) {
  Metrics m;
  m.BatchStarted("demo", Variant{Form::kSummed}, 2);
  m.BatchStarted("demo", Variant{Form::kFactored}, 1);
  m.BatchStarted("other", Variant{Form::kSummed}, 5);
  Samples s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}}), 2);
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}}), 1);
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "other"}, {"form", "summed"}, {"math", "fp32"}}), 5);
  m.BatchDone({.layer = "demo", .variant = Variant{Form::kSummed}, .device = "cpu", .requests = 2, .code = StatusCode::kOk});
  m.BatchDone({.layer = "other", .variant = Variant{Form::kSummed}, .device = "cpu", .requests = 5,
               .code = StatusCode::kResourceExhausted});
  s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}}), 0);
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}}), 1);
  EXPECT_EQ(Sample(s, "attnserve_computing_requests", {{"layer", "other"}, {"form", "summed"}, {"math", "fp32"}}), 0);
}

TEST(MetricsTest, BatchesRecordQueueComputeSizesAndFlops) {
  Metrics m;
  m.JobQueued("demo", Variant{Form::kSummed});
  m.JobQueued("demo", Variant{Form::kSummed});
  m.JobQueued("demo", Variant{Form::kSummed});
  m.JobDequeued("demo", Variant{Form::kSummed}, 0.002);
  m.JobDequeued("demo", Variant{Form::kSummed}, 0.0001);
  for (int i = 0; i < 3; ++i) m.BatchStarted("demo", Variant{Form::kSummed}, 2);
  BatchReport r{.layer = "demo",
                .variant = Variant{Form::kSummed},
                .device = "cpu",
                .requests = 2,
                .tokens = 300,
                .flops = 1.5e9,
                .compute_seconds = 0.03,
                .code = StatusCode::kOk,
                .backend_retained_bytes = 5 << 20};
  m.BatchDone(r);
  m.BatchDone(r);
  r.code = StatusCode::kResourceExhausted;  // computed nothing: no flops, no compute time
  r.backend_retained_bytes = 7 << 20;       // what the backend keeps now, whatever the call did
  m.BatchDone(r);
  const Samples s = Parse(m.Scrape());
  const std::map<std::string, std::string> lf = {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    auto l = lf;
    l.insert(extra.begin(), extra.end());
    return l;
  };
  EXPECT_EQ(Sample(s, "attnserve_queue_depth", lf), 1);
  EXPECT_EQ(Sample(s, "attnserve_queue_duration_seconds_count", lf), 2);
  EXPECT_EQ(Sample(s, "attnserve_queue_duration_seconds_bucket", with({{"le", "0.0001"}})), 1);
  EXPECT_EQ(Sample(s, "attnserve_queue_duration_seconds_bucket", with({{"le", "0.0025"}})), 2);
  EXPECT_DOUBLE_EQ(Sample(s, "attnserve_flops_total", with({{"device", "cpu"}})), 3e9);
  EXPECT_EQ(Sample(s, "attnserve_compute_duration_seconds_count", with({{"device", "cpu"}})), 2);
  EXPECT_EQ(Sample(s, "attnserve_compute_duration_seconds_bucket", with({{"device", "cpu"}, {"le", "0.025"}})), 0);
  EXPECT_EQ(Sample(s, "attnserve_compute_duration_seconds_bucket", with({{"device", "cpu"}, {"le", "0.05"}})), 2);
  EXPECT_EQ(Sample(s, "attnserve_batch_requests_bucket", with({{"le", "1"}})), 0);
  EXPECT_EQ(Sample(s, "attnserve_batch_requests_bucket", with({{"le", "2"}})), 2);
  EXPECT_EQ(Sample(s, "attnserve_batch_requests_sum", lf), 4);
  EXPECT_EQ(Sample(s, "attnserve_batch_tokens_bucket", with({{"le", "256"}})), 0);
  EXPECT_EQ(Sample(s, "attnserve_batch_tokens_bucket", with({{"le", "1024"}})), 2);
  EXPECT_EQ(Sample(s, "attnserve_batch_tokens_sum", lf), 600);
  EXPECT_FALSE(Has(s, "attnserve_device_errors_total", {{"device", "cpu"}}));
  EXPECT_EQ(Sample(s, "attnserve_backend_retained_bytes", {}), 7 << 20);
}

TEST(MetricsTest, InternalBatchFailureCountsADeviceError) {
  Metrics m;
  m.BatchDone({.layer = "demo", .variant = Variant{Form::kFactored}, .device = "cuda:0", .requests = 1, .code = StatusCode::kInternal});
  m.CountDeviceError("cuda:0");
  const Samples s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_device_errors_total", {{"device", "cuda:0"}}), 2);
  EXPECT_FALSE(Has(s, "attnserve_flops_total", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}, {"device", "cuda:0"}}));
}

TEST(MetricsTest, LayerGaugesFollowLoadsAndUnloads) {
  Metrics m;
  m.SetLayerForm("a", Variant{Form::kFactored}, "cpu", 1000, 4000);
  m.SetLayerForm("a", Variant{Form::kSummed}, "cpu", 3000, 12000);
  m.SetLayerForm("b", Variant{Form::kFactored}, "cpu", 10, 40);
  Samples s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_layer_parameters", {{"layer", "a"}, {"form", "summed"}, {"math", "fp32"}}), 3000);
  EXPECT_EQ(Sample(s, "attnserve_layer_bytes", {{"layer", "a"}, {"form", "summed"}, {"math", "fp32"}, {"device", "cpu"}}), 12000);
  m.RemoveLayer("a");
  m.SetLayerForm("a", Variant{Form::kFactored}, "cpu", 1001, 4004);  // reloaded with one form only
  s = Parse(m.Scrape());
  EXPECT_FALSE(Has(s, "attnserve_layer_parameters", {{"layer", "a"}, {"form", "summed"}, {"math", "fp32"}}));
  EXPECT_FALSE(Has(s, "attnserve_layer_bytes", {{"layer", "a"}, {"form", "summed"}, {"math", "fp32"}, {"device", "cpu"}}));
  EXPECT_EQ(Sample(s, "attnserve_layer_parameters", {{"layer", "a"}, {"form", "factored"}, {"math", "fp32"}}), 1001);
  EXPECT_EQ(Sample(s, "attnserve_layer_bytes", {{"layer", "b"}, {"form", "factored"}, {"math", "fp32"}, {"device", "cpu"}}), 40);
}

TEST(MetricsTest, RoutesGenerationIsExactAndReloadsCountByResult) {
  Metrics m;
  // 53 bits, the largest a routes generation can be: a double holds it exactly, and the
  // exposition prints every digit of it.
  const uint64_t generation = (uint64_t{1} << 53) - 12345;
  m.RoutesApplied(generation);
  m.RoutesFileLoaded(true);
  m.RoutesFileLoaded(false);
  m.RoutesFileLoaded(false);
  const std::string text = m.Scrape();
  const Samples s = Parse(text);
  EXPECT_EQ(static_cast<uint64_t>(Sample(s, "attnserve_routes_generation", {})), generation);
  EXPECT_THAT(text, HasSubstr("attnserve_routes_generation " + std::to_string(generation) + "\n"));
  EXPECT_EQ(Sample(s, "attnserve_config_reload_total", {{"result", "ok"}}), 1);
  EXPECT_EQ(Sample(s, "attnserve_config_reload_total", {{"result", "error"}}), 2);
}

TEST(MetricsTest, RouteWeightShowsTheCurrentSplitOnly) {
  Metrics m;
  m.RouteChanged("*", {{Form::kFactored, 0.9}, {Form::kSummed, 0.1}});
  m.RouteChanged("*", {{Form::kSummed, 1.0}});
  m.RouteChanged("enc", {{Form::kFactored, 0.5}, {Form::kLowRank, 0.5}});
  m.RouteChanged("gone", {{Form::kFactored, 1.0}});
  m.RouteChanged("gone", {});
  const Samples s = Parse(m.Scrape());
  EXPECT_FALSE(Has(s, "attnserve_route_weight", {{"layer", "*"}, {"form", "factored"}, {"math", "fp32"}}));
  EXPECT_EQ(Sample(s, "attnserve_route_weight", {{"layer", "*"}, {"form", "summed"}, {"math", "fp32"}}), 1.0);
  EXPECT_EQ(Sample(s, "attnserve_route_weight", {{"layer", "enc"}, {"form", "lowrank"}, {"math", "fp32"}}), 0.5);
  EXPECT_FALSE(Has(s, "attnserve_route_weight", {{"layer", "gone"}, {"form", "factored"}, {"math", "fp32"}}));
}

TEST(MetricsTest, ShadowDivergenceAndDrops) {
  Metrics m;
  m.ShadowCompared("demo", Variant{Form::kSummed}, {.max_abs = 3e-6, .rel_l2 = 2e-7});
  m.ShadowCompared("demo", Variant{Form::kSummed}, {.max_abs = 0.5, .rel_l2 = 0.02});
  m.ShadowDropped("demo");
  m.ShadowDropped("demo");
  m.ShadowDropped("demo");
  const Samples s = Parse(m.Scrape());
  const std::map<std::string, std::string> lf = {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}};
  auto le = [&](const char* v) {
    auto l = lf;
    l["le"] = v;
    return l;
  };
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_bucket", le("1e-07")), 0);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_bucket", le("1e-06")), 1);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_bucket", le("0.1")), 2);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_max_abs_bucket", le("1e-05")), 1);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_max_abs_bucket", le("1")), 2);
  EXPECT_EQ(Sample(s, "attnserve_shadow_dropped_total", {{"layer", "demo"}}), 3);
}

// A mirror whose output held a NaN or an infinity: infinite divergence, beyond every finite
// bucket (never agreement), and one non-finite output of the mirror's form.
TEST(MetricsTest, NonFiniteOutputsAreCountedPerLayerAndForm) {
  Metrics m;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  m.ShadowCompared("demo", Variant{Form::kSummed}, {.max_abs = 3e-6, .rel_l2 = 2e-7});
  m.ShadowCompared("demo", Variant{Form::kSummed}, {.max_abs = kInf, .rel_l2 = kInf});
  m.CountNonFiniteOutput("demo", Variant{Form::kFactored});
  m.CountNonFiniteOutput("demo", Variant{Form::kFactored});
  const Samples s = Parse(m.Scrape());
  const std::map<std::string, std::string> lf = {{"layer", "demo"}, {"form", "summed"}, {"math", "fp32"}};
  auto le = [&](const char* v) {
    auto l = lf;
    l["le"] = v;
    return l;
  };
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_bucket", le("1")), 1);
  EXPECT_EQ(Sample(s, "attnserve_shadow_divergence_bucket", le("+Inf")), 2);
  EXPECT_EQ(Sample(s, "attnserve_nonfinite_outputs_total", lf), 1);
  EXPECT_EQ(Sample(s, "attnserve_nonfinite_outputs_total", {{"layer", "demo"}, {"form", "factored"}, {"math", "fp32"}}), 2);
}

TEST(MetricsTest, BuildInfoIsOne) {
  Metrics m;
  m.SetBuildInfo("0.1.0", "cpu", "eigen");
  const Samples s = Parse(m.Scrape());
  EXPECT_EQ(Sample(s, "attnserve_build_info", {{"version", "0.1.0"}, {"device", "cpu"}, {"blas", "eigen"}}), 1);
}

TEST(MetricsTest, ConcurrentRecordingLosesNothing) {
  Metrics m;
  constexpr int kThreads = 8, kEach = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&m, t] {
      const std::string layer = "l" + std::to_string(t % 2);  // two layers, four threads each
      for (int i = 0; i < kEach; ++i) {
        m.RequestStarted();
        m.RequestFinished(layer, Variant{i % 2 ? Form::kSummed : Form::kFactored}, StatusCode::kOk, 1e-4);
      }
    });
  }
  for (auto& t : threads) t.join();
  const Samples s = Parse(m.Scrape());
  double total = 0;
  for (const char* layer : {"l0", "l1"}) {
    for (const char* form : {"factored", "summed"}) {
      total += Sample(s, "attnserve_requests_total", {{"layer", layer}, {"form", form}, {"math", "fp32"}, {"code", "OK"}});
    }
  }
  EXPECT_EQ(total, kThreads * kEach);
  EXPECT_EQ(Sample(s, "attnserve_inflight_requests", {}), 0);
}

std::string RunCommand(const std::string& command, int* status) {
  std::string output;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    *status = -1;
    return "popen failed";
  }
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
  *status = pclose(pipe);
  return output;
}

TEST(MetricsTest, PromtoolAcceptsTheScrape) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    FAIL() << "promtool not found: scripts/setup installs it (Debian package 'prometheus')";
  }
  Metrics m;
  const std::string text = FullyRecorded(m).Scrape();
  const std::string path = ::testing::TempDir() + "/attnserve_scrape.txt";
  std::ofstream(path) << text;
  int status = 0;
  const std::string out = RunCommand("promtool check metrics < " + path, &status);
  EXPECT_EQ(status, 0) << out << "\n--- scrape:\n" << text;
  std::remove(path.c_str());
}

TEST(MetricsEndpointTest, ServesTheTextFormatOnAnEphemeralPort) {
  Metrics m;
  FullyRecorded(m);
  StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint = MetricsEndpoint::Start("127.0.0.1:0", m);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);
  m.RequestStarted();  // recorded after start: a scrape sees the live value (0 + 1)
  const std::string response = HttpGet(port, "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(response, HasSubstr("\nattnserve_inflight_requests 1\n"));
  EXPECT_THAT(response, Not(HasSubstr("exposer_")));  // attnserve's families only
  EXPECT_THAT(response, HasSubstr("attnserve_requests_total{code=\"OK\",form=\"factored\",layer=\"demo\",math=\"fp32\"} 1\n"));

  // The same port again is refused, naming the address.
  StatusOr<std::unique_ptr<MetricsEndpoint>> second =
      MetricsEndpoint::Start("127.0.0.1:" + std::to_string(port), m);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("127.0.0.1:" + std::to_string(port)));
}

TEST(MetricsEndpointTest, MalformedAddressIsNamed) {
  Metrics m;
  for (const char* bad : {"127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000", ""}) {
    StatusOr<std::unique_ptr<MetricsEndpoint>> e = MetricsEndpoint::Start(bad, m);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(e.status().message(), HasSubstr("metrics_listen: expected HOST:PORT")) << bad;
  }
}

// Every metric and label a dashboard query names is one the server exports: a renamed metric
// would otherwise leave an empty panel that nobody notices.
TEST(DashboardTest, QueriesNameOnlyExportedMetricsAndLabels) {
  const std::string path = std::string(ATTNSERVE_SOURCE_DIR) + "/deploy/grafana/attnserve.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  const nlohmann::json dashboard = nlohmann::json::parse(in);

  std::map<std::string, std::set<std::string>> exported;  // series name → labels
  std::set<std::string> histograms;
  for (const MetricFamilySpec& f : MetricFamilies()) {
    std::set<std::string> labels(f.labels.begin(), f.labels.end());
    if (f.type == "histogram") {
      histograms.insert(std::string(f.name));
      auto with_le = labels;
      with_le.insert("le");
      exported[std::string(f.name) + "_bucket"] = with_le;
      exported[std::string(f.name) + "_sum"] = labels;
      exported[std::string(f.name) + "_count"] = labels;
    } else {
      exported[std::string(f.name)] = labels;
    }
  }
  std::set<std::string> all_labels = {"le", "instance", "job"};  // le, and what Prometheus adds
  for (const auto& [_, labels] : exported) all_labels.insert(labels.begin(), labels.end());

  std::vector<std::string> exprs;
  std::function<void(const nlohmann::json&)> walk = [&](const nlohmann::json& j) {
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) {
        if ((it.key() == "expr" || it.key() == "query") && it.value().is_string()) {
          exprs.push_back(it.value().get<std::string>());
        } else if (it.key() == "query" && it.value().is_object() && it.value().contains("query")) {
          exprs.push_back(it.value()["query"].get<std::string>());  // templating variables
        } else {
          walk(it.value());
        }
      }
    } else if (j.is_array()) {
      for (const auto& e : j) walk(e);
    }
  };
  walk(dashboard);
  ASSERT_GE(exprs.size(), 10u) << "the dashboard should query every view of docs/metrics.md";

  const std::regex metric(R"(\battnserve_[a-z_]+)");
  const std::regex grouping(R"(\b(?:by|without)\s*\(([^)]*)\))");
  const std::regex matcher(R"(([a-z_]+)\s*(?:=~|!~|!=|=)\s*")");
  const std::regex label_values(R"(label_values\(\s*(?:[a-z_]+\s*,\s*)?([a-z_]+)\s*\))");
  std::set<std::string> used;  // families (histogram series without their suffix)
  for (const std::string& e : exprs) {
    for (auto it = std::sregex_iterator(e.begin(), e.end(), metric); it != std::sregex_iterator(); ++it) {
      const std::string name = (*it)[0];
      EXPECT_TRUE(exported.count(name)) << "'" << name << "' is not exported, in: " << e;
      std::string family = name;
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        const std::string s(suffix);
        if (family.size() > s.size() && family.compare(family.size() - s.size(), s.size(), s) == 0 &&
            histograms.count(family.substr(0, family.size() - s.size()))) {
          family.resize(family.size() - s.size());
        }
      }
      used.insert(family);
    }
    for (auto it = std::sregex_iterator(e.begin(), e.end(), grouping); it != std::sregex_iterator(); ++it) {
      std::stringstream list((*it)[1].str());
      std::string label;
      while (std::getline(list, label, ',')) {
        label.erase(0, label.find_first_not_of(" \t"));
        label.erase(label.find_last_not_of(" \t") + 1);
        if (!label.empty()) {
          EXPECT_TRUE(all_labels.count(label)) << "label '" << label << "' in: " << e;
        }
      }
    }
    for (auto it = std::sregex_iterator(e.begin(), e.end(), matcher); it != std::sregex_iterator(); ++it) {
      EXPECT_TRUE(all_labels.count((*it)[1])) << "label '" << (*it)[1] << "' in: " << e;
    }
    for (auto it = std::sregex_iterator(e.begin(), e.end(), label_values); it != std::sregex_iterator(); ++it) {
      EXPECT_TRUE(all_labels.count((*it)[1])) << "label '" << (*it)[1] << "' in: " << e;
    }
  }
  // The views the issue asks for, side by side per form.
  for (const char* needed : {"attnserve_requests_total", "attnserve_request_duration_seconds",
                             "attnserve_queue_duration_seconds", "attnserve_compute_duration_seconds",
                             "attnserve_flops_total", "attnserve_batch_requests", "attnserve_shadow_divergence",
                             "attnserve_route_weight"}) {
    EXPECT_TRUE(used.count(needed)) << "the dashboard has no panel on " << needed;
  }
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// --metrics-web-config: Prometheus's web.config.file format, checked key by key.
class MetricsWebConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (std::filesystem::temp_directory_path() / ("attnserve_webcfg_" + std::to_string(getpid()) + "_" + name)).string();
    std::ofstream(path) << text;
    files_.push_back(path);
    return path;
  }
  void TearDown() override {
    for (const auto& f : files_) std::filesystem::remove(f);
  }
  std::vector<std::string> files_;
};

// bcrypt of "secret" (cost 4: fast enough for a unit test; the format is what counts).
constexpr char kSecretHash[] = "$2b$04$WMcboLv9AK1AV0IC3FYHE.JQhHlHsF78VF.ObPD45q88bqs/wMhqC";

TEST_F(MetricsWebConfigTest, BasicAuthUsersAndBcrypt) {
  auto config = ReadMetricsWebConfig(Write("ok.yml", std::string("basic_auth_users:\n  prom: '") + kSecretHash + "'\n"));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_FALSE(config->tls());
  ASSERT_EQ(config->basic_auth_users.size(), 1u);
  EXPECT_TRUE(BcryptMatches("secret", config->basic_auth_users.at("prom")));
  EXPECT_FALSE(BcryptMatches("Secret", config->basic_auth_users.at("prom")));
  EXPECT_FALSE(BcryptMatches("", config->basic_auth_users.at("prom")));
}

TEST_F(MetricsWebConfigTest, ErrorsNameTheKey) {
  using ::testing::HasSubstr;
  EXPECT_THAT(ReadMetricsWebConfig(Write("a.yml", "basic_auth_users:\n  prom: plaintext\n")).status().message(),
              HasSubstr("basic_auth_users.prom: expected a bcrypt hash"));
  EXPECT_THAT(ReadMetricsWebConfig(Write("b.yml", "http_server_config:\n  http2: true\n")).status().message(),
              HasSubstr("http_server_config: unknown key"));
  EXPECT_THAT(ReadMetricsWebConfig(Write("c.yml", "tls_server_config:\n  cert_file: x.crt\n")).status().message(),
              HasSubstr("expected both cert_file and key_file"));
  EXPECT_THAT(ReadMetricsWebConfig(Write("d.yml", "tls_server_config:\n  min_version: TLS13\n")).status().message(),
              HasSubstr("tls_server_config.min_version: not supported"));
  EXPECT_THAT(ReadMetricsWebConfig("/nonexistent/web.yml").status().message(), HasSubstr("cannot read it"));
}

// Debian bookworm's civetweb cannot load OpenSSL 3 (docs/security.md): TLS on /metrics is
// refused at start-up with the reason, never started half-way.
TEST_F(MetricsWebConfigTest, TlsOnMetricsIsRefusedWhereCivetwebCannotLoadOpenSsl) {
  MetricsWebConfig web;
  web.cert_pem = "-----BEGIN CERTIFICATE-----\n";
  web.key_pem = "-----BEGIN PRIVATE KEY-----\n";
  Metrics metrics;
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", metrics, web);
  if (endpoint.ok()) GTEST_SKIP() << "this civetweb loads OpenSSL: TLS on /metrics is available here";
  EXPECT_EQ(endpoint.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(endpoint.status().message(), ::testing::HasSubstr("OpenSSL"));
}

}  // namespace
}  // namespace attnserve
