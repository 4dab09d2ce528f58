// Client-side load balancing, as a client uses it behind the Kubernetes headless Service: one
// attnserve::Client with load_balancing = "round_robin" over two real server processes on
// loopback, behind one "ipv4:127.0.0.1:P1,127.0.0.1:P2" target (the addresses a headless
// Service's DNS name resolves to).
//
// Which server answered is read off the answer itself: both serve a layer named "demo" with the
// same shape but different weights (seed 1 on A, seed 2 on B), so a Forward's output says which
// process computed it; and each holds one extra layer only it has, so ListLayers says it too.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

using testing::RunToExit;
using testing::ServerProcess;

constexpr int kDModel = 32;
constexpr int kTokens = 4;

std::vector<std::string> ServerArgs(const std::string& seed, const std::string& own_layer) {
  std::vector<std::string> args = {
      "--layer", "demo=random:d_model=32,heads=4,seed=" + seed, "--layer", own_layer + "=random:d_model=8,heads=2,seed=9",
      "--threads", "1"};
  // Two servers on one machine: each its own metrics port, when the server has one.
  std::string help;
  RunToExit(ATTNSERVE_BINARY, {"--help"}, &help);
  if (help.find("--metrics-listen") != std::string::npos) {
    args.insert(args.end(), {"--metrics-listen", "127.0.0.1:0"});
  }
  return args;
}

v1::ForwardRequest DemoRequest() {
  std::vector<float> x(kTokens * kDModel);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  v1::ForwardRequest req;
  req.set_layer("demo");
  req.set_form(v1::FORM_FACTORED);
  *req.mutable_input() = MakeTensor(x, {1, kTokens, kDModel});
  return req;
}

std::vector<float> Output(Client& client, const v1::ForwardRequest& req, grpc::Status* status) {
  v1::ForwardResponse resp;
  *status = client.Forward(req, &resp);
  std::vector<float> y;
  if (status->ok()) *status = TensorToFloats(resp.output(), &y);
  return y;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

class RoundRobinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    a_ = ServerProcess::Start(ATTNSERVE_BINARY, ServerArgs("1", "only-a"), &error);
    ASSERT_NE(a_, nullptr) << error;
    b_ = ServerProcess::Start(ATTNSERVE_BINARY, ServerArgs("2", "only-b"), &error);
    ASSERT_NE(b_, nullptr) << error;
    // What each server computes, asked of each directly.
    grpc::Status s;
    out_a_ = Output(a_->client(), DemoRequest(), &s);
    ASSERT_TRUE(s.ok()) << s.error_message();
    out_b_ = Output(b_->client(), DemoRequest(), &s);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_GT(MaxAbsDiff(out_a_, out_b_), 1e-2) << "the two servers must be told apart by their output";
  }

  std::string Target() const { return "ipv4:127.0.0.1:" + std::to_string(a_->port()) + ",127.0.0.1:" + std::to_string(b_->port()); }

  std::unique_ptr<Client> NewClient(const std::string& policy) {
    ClientOptions options;
    options.target = Target();
    options.load_balancing = policy;
    options.timeout = std::chrono::seconds(30);
    return std::make_unique<Client>(options);
  }

  // 'a' or 'b': which server computed this output; '?' when neither.
  char Who(const std::vector<float>& y) const {
    if (MaxAbsDiff(y, out_a_) < 1e-6) return 'a';
    if (MaxAbsDiff(y, out_b_) < 1e-6) return 'b';
    return '?';
  }

  // Sends `n` Forward calls one after another; counts per server in (*a, *b).
  void Send(Client& client, int n, int* a, int* b) {
    *a = *b = 0;
    for (int i = 0; i < n; ++i) {
      grpc::Status s;
      const std::vector<float> y = Output(client, DemoRequest(), &s);
      ASSERT_TRUE(s.ok()) << "call " << i << ": " << s.error_message();
      const char who = Who(y);
      ASSERT_NE(who, '?') << "call " << i << ": an output neither server computes";
      (who == 'a' ? *a : *b) += 1;
    }
  }

  // round_robin connects to every address; until the second connection is up, calls go to the
  // first. Sends one call at a time (for at most 20 s) until both servers have answered; the
  // calls each answered in (*a, *b).
  void WaitUntilBothAnswer(Client& client, int* a, int* b) {
    *a = *b = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((*a == 0 || *b == 0) && std::chrono::steady_clock::now() < until) {
      int da = 0, db = 0;
      ASSERT_NO_FATAL_FAILURE(Send(client, 1, &da, &db));
      *a += da;
      *b += db;
    }
  }

  std::unique_ptr<ServerProcess> a_, b_;
  std::vector<float> out_a_, out_b_;
};

TEST_F(RoundRobinTest, ForwardCallsAlternateBetweenBothServers) {
  auto client = NewClient("round_robin");
  int a = 0, b = 0;
  ASSERT_NO_FATAL_FAILURE(WaitUntilBothAnswer(*client, &a, &b));
  ASSERT_GT(a, 0) << "server A never answered";
  ASSERT_GT(b, 0) << "server B never answered";
  // With both connections ready, round_robin takes them in turn: 40 calls, 20 each.
  ASSERT_NO_FATAL_FAILURE(Send(*client, 40, &a, &b));
  EXPECT_EQ(a, 20);
  EXPECT_EQ(b, 20);
}

TEST_F(RoundRobinTest, ListLayersReachesBothServers) {
  auto client = NewClient("round_robin");
  int a = 0, b = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int i = 0; i < 200 && (a < 5 || b < 5) && std::chrono::steady_clock::now() < until; ++i) {
    std::vector<v1::LayerInfo> layers;
    grpc::Status s = client->ListLayers(&layers);
    ASSERT_TRUE(s.ok()) << s.error_message();
    bool has_a = false, has_b = false;
    for (const auto& l : layers) {
      has_a |= l.name() == "only-a";
      has_b |= l.name() == "only-b";
    }
    ASSERT_NE(has_a, has_b) << "each answer comes from exactly one server";
    (has_a ? a : b) += 1;
  }
  EXPECT_GE(a, 5);
  EXPECT_GE(b, 5);
}

// The control: gRPC's default policy (pick_first) sends every call to one server, so the
// observable above does tell the policies apart.
TEST_F(RoundRobinTest, PickFirstUsesOneServer) {
  auto client = NewClient("");
  int a = 0, b = 0;
  ASSERT_NO_FATAL_FAILURE(Send(*client, 20, &a, &b));
  EXPECT_TRUE((a == 20 && b == 0) || (a == 0 && b == 20)) << "a=" << a << " b=" << b;
}

// A replica going away (a pod deleted, its endpoint removed): round_robin carries on with the
// other one. Calls in the moment of the shutdown may fail UNAVAILABLE; afterwards all succeed.
TEST_F(RoundRobinTest, CarriesOnWhenOneServerStops) {
  auto client = NewClient("round_robin");
  int a = 0, b = 0;
  ASSERT_NO_FATAL_FAILURE(WaitUntilBothAnswer(*client, &a, &b));
  ASSERT_TRUE(a > 0 && b > 0);
  EXPECT_EQ(a_->Stop(SIGTERM), 0) << a_->Log();
  // Until the channel has seen A's connection close, a call may still be sent its way.
  int failures = 0;
  for (int i = 0; i < 20; ++i) {
    grpc::Status s;
    Output(*client, DemoRequest(), &s);
    if (s.ok()) break;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    ++failures;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_LT(failures, 20);
  ASSERT_NO_FATAL_FAILURE(Send(*client, 20, &a, &b));
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 20);
}

}  // namespace
}  // namespace attnserve
