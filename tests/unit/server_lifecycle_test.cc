// The Server object (server/server.h) in-process: it starts from options, serves on loopback,
// drains on Stop() and ends Run(); a start that cannot complete names what failed and leaves
// nothing listening. Signals (SIGTERM under load, the drain's guarantees) are tested on the real
// binary by the integration suite (DrainTest); here nothing sends a signal to the test process.
#include "server/server.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "server/logging.h"
#include "server/server_options.h"
#include "tests/unit/temp_dir.h"

namespace attnserve {
namespace {

using testing::TempDir;

constexpr int kDModel = 64;

ServerOptions Options(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"attnserve",
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--metrics-listen",
                                   "127.0.0.1:0",
                                   "--threads",
                                   "1",
                                   "--drain-timeout-s",
                                   "5",
                                   "--layer",
                                   "small=random:d_model=" + std::to_string(kDModel) + ",heads=4,seed=3"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  StatusOr<ServerOptions> parsed = ParseServerOptions(static_cast<int>(argv.size()), argv.data());
  EXPECT_TRUE(parsed.ok()) << parsed.status().message();
  return parsed.ok() ? *parsed : ServerOptions{};
}

std::unique_ptr<Client> ClientOf(const Server& server) {
  ClientOptions options;
  options.target = server.listening_on();
  options.timeout = std::chrono::seconds(20);
  return std::make_unique<Client>(options);
}

v1::ForwardRequest RandomRequest(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> input(static_cast<size_t>(n) * kDModel);
  for (float& x : input) x = normal(rng);
  v1::ForwardRequest req;
  req.set_layer("small");
  *req.mutable_input() = MakeTensor(input, {1, n, kDModel});
  return req;
}

TEST(ServerLifecycleTest, StartsServesAndEndsRunOnStop) {
  StatusOr<std::unique_ptr<Server>> started = Server::Start(Options());
  ASSERT_TRUE(started.ok()) << started.status().message();
  Server& server = **started;
  EXPECT_GT(server.port(), 0);
  EXPECT_GT(server.metrics_port(), 0);
  EXPECT_NE(server.metrics_port(), server.port());
  EXPECT_EQ(server.admin_port(), 0);  // no --admin-listen
  EXPECT_EQ(server.listening_on(), "127.0.0.1:" + std::to_string(server.port()));

  std::future<Stopped> run = std::async(std::launch::async, [&] { return server.Run(); });
  auto client = ClientOf(server);
  v1::ForwardResponse resp;
  const grpc::Status st = client->Forward(RandomRequest(5, 11), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  std::vector<float> out;
  ASSERT_TRUE(TensorToFloats(resp.output(), &out).ok());
  ASSERT_EQ(out.size(), size_t{5} * kDModel);
  double energy = 0;
  for (float y : out) {
    ASSERT_TRUE(std::isfinite(y));
    energy += double{y} * y;
  }
  EXPECT_GT(energy, 0.0);

  server.Stop();
  ASSERT_EQ(run.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "Run() did not return after Stop()";
  EXPECT_EQ(run.get(), Stopped::kDrained);
  // The listeners are closed: a new call finds nothing there.
  const grpc::Status after = ClientOf(server)->Forward(RandomRequest(2, 12), &resp);
  EXPECT_EQ(after.error_code(), grpc::StatusCode::UNAVAILABLE) << after.error_message();
}

TEST(ServerLifecycleTest, StopBeforeRunDrainsAtOnceAndRunIsOnce) {
  StatusOr<std::unique_ptr<Server>> started = Server::Start(Options());
  ASSERT_TRUE(started.ok()) << started.status().message();
  (*started)->Stop();
  (*started)->Stop();  // idempotent
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_EQ((*started)->Run(), Stopped::kDrained);
  // Nothing was in flight: the drain ends after its linger, far inside --drain-timeout-s.
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(4));
  EXPECT_EQ((*started)->Run(), Stopped::kDrained);  // a second Run returns at once
}

TEST(ServerLifecycleTest, WritesEveryPortFileItWasAskedFor) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  StatusOr<std::unique_ptr<Server>> started = Server::Start(Options(
      {"--port-file", dir.File("port"), "--metrics-port-file", dir.File("metrics"), "--admin-listen", "127.0.0.1:0",
       "--admin-port-file", dir.File("admin")}));
  ASSERT_TRUE(started.ok()) << started.status().message();
  const auto read_port = [&](const std::string& name) {
    std::ifstream in(dir.File(name));
    int port = -1;
    in >> port;
    return port;
  };
  EXPECT_EQ(read_port("port"), (*started)->port());
  EXPECT_EQ(read_port("metrics"), (*started)->metrics_port());
  EXPECT_GT((*started)->admin_port(), 0);
  EXPECT_EQ(read_port("admin"), (*started)->admin_port());
}

TEST(ServerLifecycleTest, APortInUseIsNamedAndTheFirstServerKeepsServing) {
  StatusOr<std::unique_ptr<Server>> first = Server::Start(Options());
  ASSERT_TRUE(first.ok()) << first.status().message();
  const std::string taken = (*first)->listening_on();
  StatusOr<std::unique_ptr<Server>> second = Server::Start(Options({"--listen", taken}));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("cannot listen on " + taken), std::string::npos)
      << second.status().message();

  std::future<Stopped> run = std::async(std::launch::async, [&] { return (*first)->Run(); });
  v1::ForwardResponse resp;
  const grpc::Status st = ClientOf(**first)->Forward(RandomRequest(3, 13), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  (*first)->Stop();
  EXPECT_EQ(run.get(), Stopped::kDrained);
}

TEST(ServerLifecycleTest, ALayerThatCannotLoadIsNamed) {
  TempDir dir;
  StatusOr<std::unique_ptr<Server>> started =
      Server::Start(Options({"--layer", "missing=" + dir.File("absent.safetensors")}));
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("cannot load layer 'missing': "), std::string::npos)
      << started.status().message();
}

TEST(ServerLifecycleTest, AnUnreadableCertificateIsNamed) {
  TempDir dir;
  StatusOr<std::unique_ptr<Server>> started =
      Server::Start(Options({"--tls-cert", dir.File("cert.pem"), "--tls-key", dir.File("key.pem")}));
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("--tls-cert: cannot read"), std::string::npos)
      << started.status().message();
}

TEST(LoggingTest, Utf8SequenceLengthAcceptsValidSequencesOnly) {
  struct Case {
    std::string bytes;
    size_t want;
  };
  const Case cases[] = {
      {"a", 1},
      {"\xc3\xa9", 2},               // é
      {"\xe2\x82\xac", 3},           // €
      {"\xf0\x9f\x98\x80", 4},       // U+1F600
      {"\xc0\x80", 0},               // overlong NUL
      {"\xe0\x80\x80", 0},           // overlong 3-byte
      {"\xed\xa0\x80", 0},           // UTF-16 surrogate
      {"\xf4\x90\x80\x80", 0},       // past U+10FFFF
      {"\xe2\x82", 0},               // truncated
      {"\xe2\x28\xa1", 0},           // bad continuation byte
      {"\x80", 0},                   // a lone continuation byte
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Utf8SequenceLength(c.bytes, 0), c.want) << "bytes of length " << c.bytes.size();
  }
}

}  // namespace
}  // namespace attnserve
