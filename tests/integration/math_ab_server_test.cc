// Precision as an A/B dimension inside the real attnserve binary on loopback (docs/ab.md,
// "Between precisions"): a layer held in fp32 and bf16 (--extra-maths bf16), split by FORM@MATH
// routes, sticky per key; each answer names its math and lies within bfloat16's rounding of the
// fp32 one; requests and shadows between the precisions are counted under their math; requests
// and SetRouting may name a math, and one the layer is not held in is refused, named. fp16 as
// a third math, closer to fp32 than bf16.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::Describe;
using testing::ServerProcess;
using testing::TempDir;

constexpr int64_t kD = 128;
// d_model and the head width whole panels of the CPU's kernel, so every block is held in bf16.
constexpr char kLayer[] = "ab=random:d_model=128,heads=2,seed=5,summed=false";

v1::ForwardRequest Request(const std::string& key, uint64_t seed, const std::string& math = "") {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(2 * 5 * kD);
  for (float& v : x) v = normal(rng);
  v1::ForwardRequest req;
  req.set_layer("ab");
  req.set_request_key(key);
  req.set_math(math);
  *req.mutable_input() = MakeTensor(x, {2, 5, kD});
  return req;
}

std::vector<float> Output(const v1::ForwardResponse& resp) {
  std::vector<float> out;
  EXPECT_TRUE(TensorToFloats(resp.output(), &out).ok());
  return out;
}

double RelativeL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

// The server with its metrics port, or nullptr with the reason when this CPU cannot hold bf16
// (no AVX2 with FMA: the server refuses --extra-maths bf16 at start).
struct MathServer {
  TempDir dir;
  std::unique_ptr<ServerProcess> process;
  int metrics_port = 0;
  std::string error;

  explicit MathServer(std::vector<std::string> args) {
    const std::string port_file = dir.File("metrics_port");
    args.insert(args.end(), {"--metrics-port-file", port_file});
    process = ServerProcess::Start(ATTNSERVE_BINARY, args, &error);
    if (process) std::ifstream(port_file) >> metrics_port;
  }
  bool NoBf16Here() const { return !process && error.find("needs the backend's own GEMM kernel") != std::string::npos; }
  double Sample(const std::string& series) const { return testing::MetricSample(testing::ScrapeMetrics(metrics_port), series); }
  double WaitFor(const std::string& series, double value) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    double got = Sample(series);
    while (got != value && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      got = Sample(series);
    }
    return got;
  }
};

std::string Series(const std::string& name, const std::string& math, const std::string& extra = "") {
  return name + "{" + extra + "form=\"factored\",layer=\"ab\",math=\"" + math + "\"}";
}

TEST(PrecisionAbTest, RoutesSplitTheMathsAndShadowsMeasureTheirDivergence) {
  MathServer server({"--layer", kLayer, "--extra-maths", "bf16", "--route", "ab=factored@bf16:50,factored@fp32:50",
                     "--shadow-rate", "1", "--shadow-queue", "1000"});
  if (server.NoBf16Here()) GTEST_SKIP() << "this CPU holds no bf16 forms: " << server.error;
  ASSERT_NE(server.process, nullptr) << server.error;
  Client& client = server.process->client();

  // The layer says the maths it is held in, the default first.
  v1::LayerInfo info;
  ASSERT_TRUE(client.GetLayer("ab", &info).ok());
  ASSERT_EQ(info.maths_size(), 2);
  EXPECT_EQ(info.maths(0), "fp32");
  EXPECT_EQ(info.maths(1), "bf16");

  // Routed by key: both maths served, each key always the same one.
  std::map<std::string, int> served;
  constexpr int kKeys = 40;
  for (int k = 0; k < kKeys; ++k) {
    const std::string key = "user-" + std::to_string(k);
    v1::ForwardResponse first, again;
    ASSERT_TRUE(client.Forward(Request(key, k), &first).ok());
    ASSERT_TRUE(client.Forward(Request(key, 1000 + k), &again).ok());
    EXPECT_EQ(first.form(), v1::FORM_FACTORED);
    EXPECT_EQ(again.math(), first.math()) << key << ": sticky";
    served[first.math()] += 2;
  }
  ASSERT_EQ(served.size(), 2u) << "expected fp32 and bf16 answers";
  EXPECT_GT(served["bf16"], 10);
  EXPECT_GT(served["fp32"], 10);

  // A request that names its math gets it; the two answers differ by bfloat16's rounding: more
  // than float32's, within a few 2^-9.
  v1::ForwardResponse fp32, bf16;
  ASSERT_TRUE(client.Forward(Request("", 7, "fp32"), &fp32).ok());
  ASSERT_TRUE(client.Forward(Request("", 7, "bf16"), &bf16).ok());
  served["fp32"] += 1;
  served["bf16"] += 1;
  EXPECT_EQ(fp32.math(), "fp32");
  EXPECT_EQ(bf16.math(), "bf16");
  const double apart = RelativeL2(Output(bf16), Output(fp32));
  EXPECT_GT(apart, 1e-4);
  EXPECT_LT(apart, 2e-2);

  // Every answer counted under its math; every one mirrored in the other math, off the path.
  for (const std::string math : {"fp32", "bf16"}) {
    EXPECT_EQ(server.Sample(Series("attnserve_requests_total", math, "code=\"OK\",")), served[math]) << math;
    const std::string other = math == "fp32" ? "bf16" : "fp32";
    EXPECT_EQ(server.WaitFor(Series("attnserve_shadow_divergence_count", other), served[math]), served[math])
        << "mirrors in " << other;
    // Divergences between the precisions: none within float32's 1e-5, all within 5 %.
    std::string within_float32 = Series("attnserve_shadow_divergence_bucket", other);
    within_float32.insert(within_float32.size() - 1, ",le=\"1e-05\"");
    EXPECT_EQ(server.Sample(within_float32), 0) << other;
    const double mean = server.Sample(Series("attnserve_shadow_divergence_sum", other)) / served[math];
    EXPECT_GT(mean, 1e-4) << other;
    EXPECT_LT(mean, 2e-2) << other;
  }
  // The split as a gauge per variant.
  EXPECT_DOUBLE_EQ(server.Sample(Series("attnserve_route_weight", "bf16")), 0.5);
  EXPECT_DOUBLE_EQ(server.Sample(Series("attnserve_route_weight", "fp32")), 0.5);

  // A math that is no math, and one the layer is not held in: refused, named.
  v1::ForwardResponse resp;
  grpc::Status s = client.Forward(Request("", 1, "fp64"), &resp);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << Describe(s);
  EXPECT_EQ(s.error_message(), "math: expected fp32, tf32, bf16 or fp16 (or nothing), got 'fp64'");
  s = client.Forward(Request("", 1, "fp16"), &resp);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << Describe(s);
  EXPECT_EQ(s.error_message(), "math: layer 'ab' is held in fp32, bf16 (--extra-maths), got fp16");
}

// fp16 on the CPU (IEEE half weights) as a third math beside fp32 and bf16: the layer lists all
// three, each request gets the math it names, and fp16's answer lies at least 4 times closer to
// fp32's than bf16's does (11 bits of mantissa against 8), yet not within float32's rounding.
TEST(PrecisionAbTest, Fp16IsAThirdMathCloserToFp32ThanBf16) {
  MathServer server({"--layer", kLayer, "--extra-maths", "bf16,fp16"});
  if (server.NoBf16Here()) GTEST_SKIP() << "this CPU holds no 16-bit forms: " << server.error;
  ASSERT_NE(server.process, nullptr) << server.error;
  Client& client = server.process->client();
  v1::LayerInfo info;
  ASSERT_TRUE(client.GetLayer("ab", &info).ok());
  ASSERT_EQ(info.maths_size(), 3);
  EXPECT_EQ(info.maths(0), "fp32");
  EXPECT_EQ(info.maths(1), "bf16");
  EXPECT_EQ(info.maths(2), "fp16");
  std::map<std::string, v1::ForwardResponse> answers;
  for (const std::string math : {"fp32", "bf16", "fp16"}) {
    ASSERT_TRUE(client.Forward(Request("", 11, math), &answers[math]).ok()) << math;
    EXPECT_EQ(answers[math].math(), math);
  }
  const double fp16_apart = RelativeL2(Output(answers["fp16"]), Output(answers["fp32"]));
  const double bf16_apart = RelativeL2(Output(answers["bf16"]), Output(answers["fp32"]));
  EXPECT_GT(fp16_apart, 1e-5);
  EXPECT_LT(4 * fp16_apart, bf16_apart);
  EXPECT_EQ(server.Sample(Series("attnserve_requests_total", "fp16", "code=\"OK\",")), 1);
}

TEST(PrecisionAbTest, SetRoutingNamesTheMathOfEachWeight) {
  MathServer server({"--layer", kLayer, "--extra-maths", "bf16", "--admin-token", testing::kTestAdminToken});
  if (server.NoBf16Here()) GTEST_SKIP() << "this CPU holds no bf16 forms: " << server.error;
  ASSERT_NE(server.process, nullptr) << server.error;
  Client& client = server.process->client();
  v1::ForwardResponse resp;
  ASSERT_TRUE(client.Forward(Request("k", 1), &resp).ok());
  EXPECT_EQ(resp.math(), "fp32") << "the default route: factored in the default math";

  v1::SetRoutingRequest route;
  route.set_layer("ab");
  v1::RouteWeight* w = route.add_weights();
  w->set_form(v1::FORM_FACTORED);
  w->set_math("bf16");
  w->set_weight(1);
  v1::RoutingInfo routing;
  ASSERT_TRUE(client.SetRouting(route, &routing).ok());
  bool shown = false;
  for (const v1::Route& r : routing.routes()) {
    if (r.layer() == "ab") shown = r.weights_size() == 1 && r.weights(0).math() == "bf16";
  }
  EXPECT_TRUE(shown) << routing.DebugString();
  for (int k = 0; k < 10; ++k) {
    ASSERT_TRUE(client.Forward(Request("k" + std::to_string(k), k), &resp).ok());
    EXPECT_EQ(resp.math(), "bf16");
  }
  w->set_math("bf17");
  const grpc::Status s = client.SetRouting(route, &routing);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << Describe(s);
  EXPECT_EQ(s.error_message(), "weights[0].math: expected fp32, tf32, bf16 or fp16 or nothing (the layer's default), "
                               "got 'bf17'");
}

// A math the device cannot run stops the server at start, naming the flag and what it runs.
TEST(PrecisionAbTest, AMathTheDeviceCannotRunStopsTheServerAtStart) {
  std::string output;
  const int code = testing::RunToExit(ATTNSERVE_BINARY, {"--device", "cpu", "--layer", kLayer, "--extra-maths", "tf32"},
                                      &output);
  EXPECT_NE(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("--extra-maths: math: the CPU runs fp32, bf16 or fp16, got tf32")) << output;
  output.clear();
  EXPECT_NE(testing::RunToExit(ATTNSERVE_BINARY, {"--extra-maths", "bf16,bf16"}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--extra-maths: expected each math once, got bf16 twice in 'bf16,bf16'")) << output;
}

}  // namespace
}  // namespace attnserve
