// The A/B inside the real attnserve binary on loopback: SetRouting's admin guard and field
// errors, routed and sticky forms as Forward reports them, forms a layer lacks, shadows and
// the metrics they leave in a scrape of /metrics, and the layer gauges across load and unload.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::ServerProcess;
using testing::TempDir;

using testing::Describe;

// A server with its metrics port known.
struct Server : testing::MetricsServer {
  explicit Server(std::vector<std::string> args) : MetricsServer(ATTNSERVE_BINARY, std::move(args)) {}
};

v1::ForwardRequest Request(const std::string& layer, v1::Form form, const std::string& key, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(2 * 5 * 32);
  for (float& v : x) v = normal(rng);
  v1::ForwardRequest req;
  req.set_layer(layer);
  req.set_form(form);
  req.set_request_key(key);
  *req.mutable_input() = MakeTensor(x, {2, 5, 32});
  return req;
}

v1::Form Served(Client& client, const v1::ForwardRequest& req) {
  v1::ForwardResponse resp;
  grpc::Status s = client.Forward(req, &resp);
  EXPECT_TRUE(s.ok()) << Describe(s);
  return resp.form();
}

v1::SetRoutingRequest Route(const std::string& layer, std::vector<std::pair<v1::Form, double>> weights) {
  v1::SetRoutingRequest r;
  r.set_layer(layer);
  for (const auto& [form, weight] : weights) {
    v1::RouteWeight* w = r.add_weights();
    w->set_form(form);
    w->set_weight(weight);
  }
  return r;
}

constexpr char kLayer[] = "ab=random:d_model=32,heads=4,seed=5";

TEST(RoutingServerTest, SetRoutingIsAdminGuardedAndChecksEveryField) {
  Server server({"--layer", kLayer, "--admin-token", "s3cret-s3cret-s3cret"});
  ASSERT_NE(server.process, nullptr);
  v1::RoutingInfo info;
  ClientOptions anonymous;
  anonymous.target = server.process->target();
  Client anonymous_client(anonymous);
  grpc::Status s = anonymous_client.SetRouting(Route("ab", {{v1::FORM_SUMMED, 1}}), &info);
  EXPECT_EQ(s.error_code(), grpc::UNAUTHENTICATED) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("SetRouting"));

  ClientOptions wrong;
  wrong.target = server.process->target();
  wrong.admin_token = "guess";
  Client wrong_client(wrong);
  s = wrong_client.SetRouting(Route("ab", {{v1::FORM_SUMMED, 1}}), &info);
  EXPECT_EQ(s.error_code(), grpc::UNAUTHENTICATED) << Describe(s);

  ClientOptions admin = wrong;
  admin.admin_token = "s3cret-s3cret-s3cret";
  Client admin_client(admin);
  struct Case {
    v1::SetRoutingRequest request;
    const char* message;
  };
  v1::SetRoutingRequest shadow_only;
  shadow_only.set_shadow_rate(1.5);
  v1::SetRoutingRequest weights_without_layer = Route("", {{v1::FORM_SUMMED, 1}});
  weights_without_layer.set_shadow_rate(0.1);
  for (const Case& c : {
           Case{Route("ab", {{v1::FORM_FACTORED, 1}, {v1::FORM_UNSPECIFIED, 1}}),
                "weights[1].form: expected FORM_FACTORED, FORM_SUMMED, FORM_LOWRANK or FORM_AUTO, got FORM_UNSPECIFIED"},
           Case{Route("ab", {{v1::FORM_FACTORED, -1}}), "weights: expected a finite weight >= 0 for factored"},
           Case{Route("ab", {{v1::FORM_FACTORED, 0}}), "weights: expected at least one positive weight"},
           Case{Route("ab", {{v1::FORM_SUMMED, 1}, {v1::FORM_SUMMED, 2}}), "expected each form at most once"},
           Case{Route("bad name", {{v1::FORM_SUMMED, 1}}), "name"},
           Case{Route("", {}), "layer: expected a layer name or '*'"},
           Case{shadow_only, "shadow_rate: expected a fraction in [0, 1]"},
           Case{weights_without_layer, "layer: expected the layer these 1 weights are for"},
       }) {
    s = admin_client.SetRouting(c.request, &info);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
  // Refused calls changed nothing.
  ASSERT_TRUE(server.client().GetRouting(&info).ok());  // no token needed to read
  ASSERT_EQ(info.routes_size(), 1);
  EXPECT_EQ(info.routes(0).layer(), "*");
  EXPECT_EQ(info.shadow_rate(), 0);

  v1::SetRoutingRequest both = Route("ab", {{v1::FORM_FACTORED, 3}, {v1::FORM_SUMMED, 1}});
  both.set_shadow_rate(0.5);
  s = admin_client.SetRouting(both, &info);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_EQ(info.routes_size(), 2);
  EXPECT_EQ(info.routes(1).layer(), "ab");
  ASSERT_EQ(info.routes(1).weights_size(), 2);
  EXPECT_DOUBLE_EQ(info.routes(1).weights(0).weight(), 0.75);
  EXPECT_DOUBLE_EQ(info.routes(1).weights(1).weight(), 0.25);
  EXPECT_EQ(info.shadow_rate(), 0.5);
  EXPECT_EQ(server.Sample("attnserve_route_weight{form=\"summed\",layer=\"ab\",math=\"fp32\"}"), 0.25);
}

TEST(RoutingServerTest, RoutedFormsAreStickyAndSkipFormsNotHeld) {
  Server server({"--admin-token", testing::kTestAdminToken, "--layer", kLayer, "--layer", "only=random:d_model=32,heads=4,seed=6,summed=false", "--route",
                 "*=factored:1,summed:1"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();
  // Sticky: one key, one form; many keys, both forms.
  std::map<v1::Form, int> seen;
  for (int k = 0; k < 40; ++k) {
    const std::string key = "user-" + std::to_string(k);
    const v1::Form first = Served(client, Request("ab", v1::FORM_UNSPECIFIED, key, k));
    for (int again = 0; again < 3; ++again) {
      EXPECT_EQ(Served(client, Request("ab", v1::FORM_UNSPECIFIED, key, 100 + again)), first) << key;
    }
    ++seen[first];
  }
  EXPECT_GT(seen[v1::FORM_FACTORED], 5);
  EXPECT_GT(seen[v1::FORM_SUMMED], 5);
  // An explicit form is never rerouted; a layer without the summed form gets the factored one.
  EXPECT_EQ(Served(client, Request("ab", v1::FORM_SUMMED, "user-0", 1)), v1::FORM_SUMMED);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(Served(client, Request("only", v1::FORM_UNSPECIFIED, "", i)), v1::FORM_FACTORED);

  // Run-time change: all of ab to summed.
  v1::RoutingInfo info;
  ASSERT_TRUE(client.SetRouting(Route("ab", {{v1::FORM_SUMMED, 1}}), &info).ok());
  for (int k = 0; k < 10; ++k) {
    EXPECT_EQ(Served(client, Request("ab", v1::FORM_UNSPECIFIED, "user-" + std::to_string(k), k)), v1::FORM_SUMMED);
  }
}

// Sticky across processes: the same request_key picks the same form in two server processes
// (two replicas, or one before and after a restart): the key's point on the split is a hash of
// its bytes alone, nothing of the process (its address space, its start time) salts it.
TEST(RoutingServerTest, AKeyPicksTheSameFormInAnotherProcess) {
  const std::vector<std::string> args = {"--layer", kLayer, "--route", "*=factored:1,summed:1"};
  Server first(args), second(args);
  ASSERT_NE(first.process, nullptr);
  ASSERT_NE(second.process, nullptr);
  ASSERT_NE(first.process->pid(), second.process->pid());
  std::map<v1::Form, int> seen;
  for (int k = 0; k < 40; ++k) {
    const std::string key = "replica-user-" + std::to_string(k);
    const v1::Form there = Served(first.client(), Request("ab", v1::FORM_UNSPECIFIED, key, k));
    EXPECT_EQ(Served(second.client(), Request("ab", v1::FORM_UNSPECIFIED, key, 500 + k)), there) << key;
    ++seen[there];
  }
  EXPECT_GT(seen[v1::FORM_FACTORED], 5) << "a 50/50 split over 40 keys";
  EXPECT_GT(seen[v1::FORM_SUMMED], 5) << "a 50/50 split over 40 keys";
}

TEST(RoutingServerTest, ShadowsRecordDivergenceAndNeverChangeTheAnswer) {
  Server server({"--layer", kLayer, "--shadow-rate", "1"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();
  constexpr int kRequests = 6;
  for (int i = 0; i < kRequests; ++i) {
    v1::ForwardResponse resp;
    ASSERT_TRUE(client.Forward(Request("ab", v1::FORM_FACTORED, "", i), &resp).ok());
    EXPECT_EQ(resp.form(), v1::FORM_FACTORED);
    EXPECT_EQ(resp.divergence_size(), 0);  // shadows are not reported to the client
  }
  // The mirrors run after the answers: wait until all are compared.
  const std::string count = "attnserve_shadow_divergence_count{form=\"summed\",layer=\"ab\",math=\"fp32\"}";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (server.Sample(count) < kRequests && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(server.Sample(count), kRequests);
  // float32 agreement of two exact forms: every rel_l2 below 1e-5.
  EXPECT_EQ(server.Sample("attnserve_shadow_divergence_bucket{form=\"summed\",layer=\"ab\",math=\"fp32\",le=\"1e-05\"}"),
            kRequests);
  // The clients' requests are counted once, under the served form only.
  EXPECT_EQ(server.Sample("attnserve_requests_total{code=\"OK\",form=\"factored\",layer=\"ab\",math=\"fp32\"}"), kRequests);
  EXPECT_EQ(server.Sample("attnserve_requests_total{code=\"OK\",form=\"summed\",layer=\"ab\",math=\"fp32\"}"), -1);
  // The mirrors' compute is the summed form's.
  EXPECT_EQ(server.Sample("attnserve_batch_tokens_sum{form=\"summed\",layer=\"ab\",math=\"fp32\"}"), kRequests * 2 * 5);
}

// A `compare` call already runs every other held form and reports the divergence to its client:
// a shadow of it would measure nothing new at the cost of a third run, so none is made. The
// mirrors run in order, so once the plain call sent after the compare calls is compared, a
// mirror of any compare call would have been counted before it.
TEST(RoutingServerTest, CompareCallsAreNotShadowed) {
  Server server({"--layer", kLayer, "--shadow-rate", "1"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();
  for (int i = 0; i < 4; ++i) {
    v1::ForwardRequest req = Request("ab", v1::FORM_FACTORED, "", 300 + i);
    req.set_compare(true);
    v1::ForwardResponse resp;
    ASSERT_TRUE(client.Forward(req, &resp).ok());
    ASSERT_EQ(resp.divergence_size(), 1);
  }
  v1::ForwardResponse plain;
  ASSERT_TRUE(client.Forward(Request("ab", v1::FORM_FACTORED, "", 400), &plain).ok());
  const std::string count = "attnserve_shadow_divergence_count{form=\"summed\",layer=\"ab\",math=\"fp32\"}";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (server.Sample(count) < 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(server.Sample(count), 1) << "only the plain call is mirrored";
  EXPECT_EQ(server.Sample("attnserve_shadow_dropped_total{layer=\"ab\"}"), -1) << "nothing was offered and dropped";
}

// A shadow mirrors the whole request. A rotary layer's answer depends on position_offset (the
// queries' positions) and on a separate context (whose keys start at 0), so a mirror that lost
// either field would diverge far beyond float32 rounding: a dropped offset measured ~0.6 here.
TEST(RoutingServerTest, ShadowsOfRotaryCrossAttentionKeepThePositionOffset) {
  Server server({"--layer", "rope=random:d_model=32,heads=4,rope_theta=10000,seed=3", "--shadow-rate", "1"});
  ASSERT_NE(server.process, nullptr);
  constexpr int kRequests = 4;
  std::mt19937_64 rng(37);
  std::normal_distribution<float> normal;
  for (int i = 0; i < kRequests; ++i) {
    std::vector<float> x(2 * 5 * 32), c(2 * 7 * 32);
    for (float& v : x) v = normal(rng);
    for (float& v : c) v = normal(rng);
    v1::ForwardRequest req;
    req.set_layer("rope");
    req.set_form(v1::FORM_FACTORED);
    *req.mutable_input() = MakeTensor(x, {2, 5, 32});
    *req.mutable_context() = MakeTensor(c, {2, 7, 32});
    req.set_position_offset(37);
    req.set_causal(i % 2 == 1);  // a causal mask over a context: query q sees keys 0..q
    v1::ForwardResponse resp;
    const grpc::Status s = server.client().Forward(req, &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
  const std::string count = "attnserve_shadow_divergence_count{form=\"summed\",layer=\"rope\",math=\"fp32\"}";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (server.Sample(count) < kRequests && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(server.Sample(count), kRequests);
  // Two exact forms over the same request agree to float32 rounding (~1e-6 rel L2).
  EXPECT_EQ(server.Sample("attnserve_shadow_divergence_bucket{form=\"summed\",layer=\"rope\",math=\"fp32\",le=\"1e-05\"}"),
            kRequests)
      << "sum of rel L2 over the mirrors: "
      << server.Sample("attnserve_shadow_divergence_sum{form=\"summed\",layer=\"rope\",math=\"fp32\"}");
}

TEST(RoutingServerTest, RefusalsAndLayerGaugesInTheScrape) {
  // The weights row-major only, so that attnserve_layer_bytes is the weights' own bytes (the
  // packed copy's are checked in ServerTest.LayerInfo).
  Server server({"--admin-token", testing::kTestAdminToken, "--layer", kLayer, "--cpu-weight-layout", "plain"});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();
  v1::ForwardResponse resp;
  EXPECT_EQ(client.Forward(Request("nope", v1::FORM_FACTORED, "", 1), &resp).error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(client.Forward(Request("typo", v1::FORM_UNSPECIFIED, "", 1), &resp).error_code(), grpc::NOT_FOUND);
  // Unknown layer names are not labels: both land under layer="".
  EXPECT_EQ(server.Sample("attnserve_requests_total{code=\"NOT_FOUND\",form=\"factored\",layer=\"\",math=\"fp32\"}"), 1);
  EXPECT_EQ(server.Sample("attnserve_requests_total{code=\"NOT_FOUND\",form=\"none\",layer=\"\",math=\"none\"}"), 1);
  EXPECT_EQ(server.Sample("attnserve_inflight_requests"), 0);

  // d_model 32, 4 heads of 8, bias: W_Q, W_K, W_V, W_O and their biases.
  EXPECT_EQ(server.Sample("attnserve_layer_parameters{form=\"factored\",layer=\"ab\",math=\"fp32\"}"), 4 * 32 * 32 + 4 * 32);
  EXPECT_EQ(server.Sample("attnserve_layer_bytes{device=\"cpu\",form=\"factored\",layer=\"ab\",math=\"fp32\"}"),
            4 * (4 * 32 * 32 + 4 * 32));
  ASSERT_TRUE(client.UnloadLayer("ab").ok());
  EXPECT_EQ(server.Sample("attnserve_layer_parameters{form=\"factored\",layer=\"ab\",math=\"fp32\"}"), -1);
  ASSERT_TRUE(client.LoadLayer("ab", "random:d_model=32,heads=4,seed=5,summed=false", nullptr).ok());
  EXPECT_EQ(server.Sample("attnserve_layer_parameters{form=\"factored\",layer=\"ab\",math=\"fp32\"}"), 4 * 32 * 32 + 4 * 32);
  EXPECT_EQ(server.Sample("attnserve_layer_parameters{form=\"summed\",layer=\"ab\",math=\"fp32\"}"), -1);
}

// Every served call is timed stage by stage (attnserve_stage_seconds, docs/metrics.md), and the
// response carries the timing fields: the stages partition the call, so their sums agree with
// the per-request and per-batch histograms measured on the same clock.
TEST(ServingStagesTest, EveryServedCallIsTimedStageByStage) {
  Server server({"--layer", kLayer});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.client();
  constexpr int kCalls = 6;
  for (int i = 0; i < kCalls; ++i) {
    v1::ForwardResponse resp;
    grpc::Status s = client.Forward(Request("ab", i % 2 ? v1::FORM_SUMMED : v1::FORM_FACTORED, "", 100 + i), &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_GT(resp.compute_us(), 0);
    EXPECT_GE(resp.decode_us(), 0);
    EXPECT_LE(resp.decode_us(), resp.queue_us()) << "decoding is part of the time before compute";
    EXPECT_GE(resp.encode_us(), 0);
    EXPECT_EQ(resp.batch_requests(), 1) << "one call at a time";
  }
  // A refused call is not a served one: it adds to no stage.
  v1::ForwardResponse refused;
  EXPECT_EQ(client.Forward(Request("nope", v1::FORM_FACTORED, "", 1), &refused).error_code(), grpc::NOT_FOUND);

  // gRPC reports a call done (the send stage) after the client may already hold the answer:
  // wait for the last one.
  const std::string count = "attnserve_stage_seconds_count{stage=\"send\"}";
  for (int tries = 0; tries < 100 && server.Sample(count) < kCalls; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string scrape = server.Scrape();
  auto sample = [&](const std::string& series) { return testing::MetricSample(scrape, series); };
  double before_answer = 0;  // route … encode: arrival until the answer was handed to gRPC
  for (const char* stage : {"route", "decode", "admit", "queue", "compute", "encode", "send"}) {
    const std::string labels = std::string("{stage=\"") + stage + "\"}";
    EXPECT_EQ(sample("attnserve_stage_seconds_count" + labels), kCalls) << stage;
    const double sum = sample("attnserve_stage_seconds_sum" + labels);
    EXPECT_GE(sum, 0) << stage;
    if (std::string(stage) != "send") before_answer += sum;
  }
  double requests = 0, computes = 0;
  for (const char* form : {"factored", "summed"}) {
    requests += sample(std::string("attnserve_request_duration_seconds_sum{code=\"OK\",form=\"") + form +
                      "\",layer=\"ab\",math=\"fp32\"}");
    computes += sample(std::string("attnserve_compute_duration_seconds_sum{device=\"cpu\",form=\"") + form +
                       "\",layer=\"ab\",math=\"fp32\"}");
  }
  // The request histogram ends a moment after the encode stage (it is recorded as the call is
  // answered); each batch held one call, timed by the same two clock reads as its compute stage.
  EXPECT_LE(before_answer, requests + 1e-6);
  EXPECT_GT(before_answer, 0.5 * requests);
  EXPECT_NEAR(sample("attnserve_stage_seconds_sum{stage=\"compute\"}"), computes, 1e-6);
}

}  // namespace
}  // namespace attnserve
