// --routes-file in the real attnserve binary on loopback: the file changed under a running
// server moves the split (seen in the forms Forward answers, in requests_total by form, in
// route_weight and in a new routes_generation, which is checked against FNV-1a written here),
// a refused file leaves all of those as they were and counts an error, SetRouting is refused
// naming the file, and a bad file at start-up stops the server with the file and the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
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
using testing::ServerProcess;
using testing::TempDir;
using namespace std::chrono_literals;

constexpr char kLayer[] = "ab=random:d_model=32,heads=4,seed=5";
constexpr int kKeys = 80;

// FNV-1a 64 from its definition, top 53 bits: what attnserve_routes_generation must read for
// the canonical text (docs/metrics.md), independent of router.cc.
double Generation(const std::string& canonical) {
  uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : canonical) h = (h ^ c) * 1099511628211ULL;
  return static_cast<double>(h >> 11);
}

// Written whole and renamed into place, as a ConfigMap update or an editor does.
void Replace(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp, std::ios::trunc) << text;
  std::filesystem::rename(tmp, path);
}

struct Server : testing::MetricsServer {
  explicit Server(std::vector<std::string> args) : MetricsServer(ATTNSERVE_BINARY, std::move(args)) {}
};

// One routed (FORM_UNSPECIFIED) Forward per key: the form each key was served by.
std::map<std::string, v1::Form> ServeKeys(Client& client) {
  std::map<std::string, v1::Form> served;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  for (int k = 0; k < kKeys; ++k) {
    std::vector<float> x(1 * 4 * 32);
    for (float& v : x) v = normal(rng);
    v1::ForwardRequest req;
    req.set_layer("ab");
    req.set_request_key("user-" + std::to_string(k));
    *req.mutable_input() = MakeTensor(x, {1, 4, 32});
    v1::ForwardResponse resp;
    grpc::Status s = client.Forward(req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    served[req.request_key()] = resp.form();
  }
  return served;
}

int Count(const std::map<std::string, v1::Form>& served, v1::Form form) {
  int n = 0;
  for (const auto& [_, f] : served) n += f == form;
  return n;
}

const std::string kFactoredOk = "attnserve_requests_total{code=\"OK\",form=\"factored\",layer=\"ab\",math=\"fp32\"}";
const std::string kSummedOk = "attnserve_requests_total{code=\"OK\",form=\"summed\",layer=\"ab\",math=\"fp32\"}";
const std::string kWeightFactored = "attnserve_route_weight{form=\"factored\",layer=\"ab\",math=\"fp32\"}";
const std::string kWeightSummed = "attnserve_route_weight{form=\"summed\",layer=\"ab\",math=\"fp32\"}";
const std::string kGeneration = "attnserve_routes_generation";
const std::string kReloadOk = "attnserve_config_reload_total{result=\"ok\"}";
const std::string kReloadError = "attnserve_config_reload_total{result=\"error\"}";

TEST(RoutesFileServerTest, AChangedFileMovesTheSplitAndABadOneChangesNothing) {
  TempDir routes_dir;
  const std::string routes = routes_dir.File("routes.yaml");
  Replace(routes, "routes:\n  ab: factored:1\n");
  Server server({"--admin-token", testing::kTestAdminToken, "--layer", kLayer, "--routes-file", routes});
  ASSERT_NE(server.process, nullptr);
  Client& client = server.process->client();

  // At start: the file's split, applied once.
  std::map<std::string, v1::Form> served = ServeKeys(client);
  EXPECT_EQ(Count(served, v1::FORM_FACTORED), kKeys);
  EXPECT_EQ(server.Sample(kFactoredOk), kKeys);
  EXPECT_EQ(server.Sample(kWeightFactored), 1.0);
  EXPECT_EQ(server.Sample(kGeneration), Generation("*=factored:100\nab=factored:100\n"));
  EXPECT_EQ(server.Sample(kReloadOk), 1);
  EXPECT_EQ(server.Sample(kReloadError), 0);

  // One source of truth: SetRouting may not change a route, only the shadow rate.
  v1::SetRoutingRequest route;
  route.set_layer("ab");
  v1::RouteWeight* w = route.add_weights();
  w->set_form(v1::FORM_SUMMED);
  w->set_weight(1);
  v1::RoutingInfo info;
  grpc::Status s = client.SetRouting(route, &info);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("routes file '" + routes + "'"));
  v1::SetRoutingRequest shadow;
  shadow.set_shadow_rate(0);
  EXPECT_TRUE(client.SetRouting(shadow, &info).ok());

  // The file changes under the running server: a new generation, the new weights, and the
  // keys split between the forms, as requests_total counts them.
  Replace(routes, "routes:\n  ab: factored:50,summed:50\n");
  const double moved = Generation("*=factored:100\nab=factored:50,summed:50\n");
  ASSERT_EQ(server.WaitForSample(kGeneration, moved), moved) << server.process->Log();
  EXPECT_EQ(server.Sample(kWeightFactored), 0.5);
  EXPECT_EQ(server.Sample(kWeightSummed), 0.5);
  EXPECT_EQ(server.Sample(kReloadOk), 2);
  served = ServeKeys(client);
  const int summed = Count(served, v1::FORM_SUMMED);
  // 80 keys at p = 0.5: [22, 58] holds them with probability 1 - 6e-5.
  EXPECT_GE(summed, 22);
  EXPECT_LE(summed, 58);
  EXPECT_EQ(server.Sample(kSummedOk), summed);
  EXPECT_EQ(server.Sample(kFactoredOk), kKeys + (kKeys - summed));

  // Refused files: a form the layer does not hold, a misspelt form, not YAML. Each is counted;
  // the generation, the weights and every key's form stay.
  int errors = 0;
  for (const char* bad :
       {"routes:\n  ab: factored:50,lowrank:50\n", "routes:\n  ab: factored:50,sumed:50\n", "routes: [\n"}) {
    Replace(routes, bad);
    ++errors;
    ASSERT_EQ(server.WaitForSample(kReloadError, errors), errors) << bad << server.process->Log();
    EXPECT_EQ(server.Sample(kGeneration), moved) << bad;
    EXPECT_EQ(server.Sample(kWeightSummed), 0.5) << bad;
    EXPECT_EQ(server.Sample(kReloadOk), 2) << bad;
  }
  EXPECT_THAT(server.process->Log(), HasSubstr("refused whole"));
  EXPECT_EQ(ServeKeys(client), served);
  EXPECT_EQ(server.Sample(kSummedOk), 2 * summed);
}

TEST(RoutesFileServerTest, ABadFileAtStartUpStopsTheServerNamingIt) {
  TempDir dir;
  const std::string routes = dir.File("routes.yaml");
  Replace(routes, "routes:\n  ab: factored:1\n  nope: summed:1\n");
  std::string output;
  const std::vector<std::string> common = {"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                           "--layer",  kLayer,        "--routes-file",    routes};
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, common, &output), 1) << output;
  EXPECT_THAT(output, HasSubstr("--routes-file '" + routes + "': routes: nope: expected a loaded layer"));

  std::vector<std::string> with_route = common;
  with_route.insert(with_route.end(), {"--route", "ab=summed:1"});
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, with_route, &output), 2) << output;
  EXPECT_THAT(output, HasSubstr("routes_file, routes: expected one or the other"));
}

}  // namespace
}  // namespace attnserve
