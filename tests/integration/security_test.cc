// The defaults and defences of docs/security.md against the real attnserve binary on loopback,
// one test per row of its attack table: the closed admin API, tokens, the admin listener,
// checkpoint confinement, caps, TLS and mTLS, and what errors and logs may echo.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <future>
#include <thread>
#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::kTestAdminToken;
using testing::RunToExit;
using testing::ServerProcess;
using testing::TempDir;

constexpr char kTinyLayer[] = "tiny=random:d_model=16,heads=2,seed=3";

std::string Describe(const grpc::Status& s) {
  return std::to_string(s.error_code()) + ": " + s.error_message();
}

std::unique_ptr<ServerProcess> StartOrFail(const std::vector<std::string>& args, const ClientOptions& client = {}) {
  std::string error;
  auto server = ServerProcess::Start(ATTNSERVE_BINARY, args, &error, std::chrono::seconds(60), {}, client);
  EXPECT_NE(server, nullptr) << error;
  return server;
}

Client AnonymousClient(const ServerProcess& server) {
  ClientOptions o;
  o.target = server.target();
  o.timeout = std::chrono::milliseconds(10000);
  return Client(o);
}

// Admin calls answer PERMISSION_DENIED on a server nobody opened them on, saying how to.
TEST(SecurityTest, AdminApiClosedByDefault) {
  auto server = StartOrFail({"--layer", kTinyLayer});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();
  grpc::Status load = client.LoadLayer("swap", "random:d_model=16,heads=2,seed=666", nullptr);
  EXPECT_EQ(load.error_code(), grpc::PERMISSION_DENIED) << Describe(load);
  EXPECT_THAT(load.error_message(), AllOf(HasSubstr("--admin-token"), HasSubstr("--admin-listen")));
  EXPECT_EQ(client.UnloadLayer("tiny").error_code(), grpc::PERMISSION_DENIED);
  v1::SetRoutingRequest route;
  route.set_layer("tiny");
  route.set_shadow_rate(0.5);
  v1::RoutingInfo info;
  EXPECT_EQ(client.SetRouting(route, &info).error_code(), grpc::PERMISSION_DENIED);
  // Reads stay open, and the layer is untouched.
  v1::LayerInfo layer;
  ASSERT_TRUE(client.GetLayer("tiny", &layer).ok());
  EXPECT_EQ(layer.source(), "random:d_model=16,heads=2,seed=3");
}

// Short tokens never start a server, and no start-up error repeats a secret.
TEST(SecurityTest, ShortTokensAndMisspeltSecretFlagsAreRefusedWithoutEchoingThem) {
  std::string output;
  EXPECT_EQ(RunToExit(ATTNSERVE_BINARY, {"--admin-token", "short-SECRET"}, &output), 2);
  EXPECT_THAT(output, AllOf(HasSubstr("at least 16 bytes"), Not(HasSubstr("short-SECRET"))));
  EXPECT_EQ(RunToExit(ATTNSERVE_BINARY, {"--admin-tokn=SECRET-0123456789abcdef"}, &output), 2);
  EXPECT_THAT(output, AllOf(HasSubstr("unknown flag '--admin-tokn'"), Not(HasSubstr("SECRET"))));
  // An admin listener off loopback without a token would be the open API by another name.
  EXPECT_EQ(RunToExit(ATTNSERVE_BINARY, {"--admin-listen", "0.0.0.0:0"}, &output), 2);
  EXPECT_THAT(output, HasSubstr("loopback"));
}

// The admin listener on loopback serves the admin API without a token; the public one does not.
TEST(SecurityTest, LoopbackAdminListenerOpensTheAdminApiThereOnly) {
  TempDir tmp;
  const std::string admin_port_file = tmp.File("admin-port");
  auto server = StartOrFail({"--layer", kTinyLayer, "--admin-listen", "127.0.0.1:0", "--admin-port-file", admin_port_file});
  ASSERT_NE(server, nullptr);
  int admin_port = 0;
  std::ifstream(admin_port_file) >> admin_port;
  ASSERT_GT(admin_port, 0);
  ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(admin_port);
  Client admin(o);
  v1::LayerInfo info;
  grpc::Status load = admin.LoadLayer("extra", "random:d_model=16,heads=2,seed=4", &info);
  ASSERT_TRUE(load.ok()) << Describe(load);
  EXPECT_EQ(server->client().GetLayer("extra", &info).error_code(), grpc::OK) << "one store behind both listeners";
  EXPECT_EQ(server->client().UnloadLayer("extra").error_code(), grpc::PERMISSION_DENIED);
  EXPECT_TRUE(admin.UnloadLayer("extra").ok());
}

// Checkpoints over the API come only from beneath --model-dir: FIFOs, devices, symlinks out,
// "..", and absolute paths elsewhere are refused at once, with no file bytes in the answer.
TEST(SecurityTest, LoadLayerIsConfinedToTheModelDirs) {
  TempDir tmp;
  const std::filesystem::path models = tmp.File("models");
  std::filesystem::create_directories(models / "sub");
  ASSERT_EQ(mkfifo((models / "fifo.safetensors").c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/zero", models / "zero.safetensors");
  std::filesystem::create_symlink("/etc/passwd", models / "passwd.safetensors");
  std::filesystem::copy_file(std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch-mha/small.gpt2.safetensors",
                             models / "sub" / "gpt2.safetensors");
  std::filesystem::copy_file(std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch-mha/small.gpt2.safetensors",
                             tmp.File("outside.safetensors"));
  auto server = StartOrFail({"--admin-token", kTestAdminToken, "--model-dir", models.string()});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();

  // A real checkpoint beneath the dir loads, and is shown relative to it.
  v1::LayerInfo info;
  grpc::Status ok = client.LoadLayer("gpt2", "safetensors:sub/gpt2.safetensors,arch=gpt2,heads=4", &info);
  ASSERT_TRUE(ok.ok()) << Describe(ok);
  EXPECT_EQ(info.source(), "safetensors:sub/gpt2.safetensors,arch=gpt2,heads=4");
  ok = client.LoadLayer("gpt2-abs", "safetensors:" + (models / "sub/gpt2.safetensors").string() + ",heads=4", &info);
  ASSERT_TRUE(ok.ok()) << Describe(ok);
  EXPECT_THAT(info.source(), Not(HasSubstr(models.string())));

  const std::string missing_answer =
      client.LoadLayer("x", "safetensors:missing.safetensors,heads=4", nullptr).error_message();
  for (const std::string& path : std::vector<std::string>{"fifo.safetensors", "zero.safetensors", "passwd.safetensors", "/dev/zero",
                                 "/etc/passwd", "/proc/self/environ", "../outside.safetensors",
                                 tmp.File("outside.safetensors"), "sub/../../outside.safetensors"}) {
    const auto start = std::chrono::steady_clock::now();
    grpc::Status st = client.LoadLayer("x", "safetensors:" + path + ",heads=4", nullptr);
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_LT(took, std::chrono::seconds(1)) << path;
    EXPECT_TRUE(st.error_code() == grpc::NOT_FOUND || st.error_code() == grpc::INVALID_ARGUMENT)
        << path << " " << Describe(st);
    EXPECT_THAT(st.error_message(), AllOf(Not(HasSubstr("root:")), Not(HasSubstr("header length ")))) << path;
    if (st.error_code() == grpc::NOT_FOUND) {
      // The same answer as for a file that does not exist, but for the name.
      std::string normalized = st.error_message();
      normalized.replace(normalized.find(path), path.size(), "missing.safetensors");
      EXPECT_EQ(normalized, missing_answer) << path;
    }
  }
  v1::LayerInfo none;
  EXPECT_EQ(client.GetLayer("x", &none).error_code(), grpc::NOT_FOUND);

  // Without --model-dir the API loads no checkpoint at all; the operator's own sources still do.
  auto closed = StartOrFail({"--admin-token", kTestAdminToken, "--layer",
                             "own=safetensors:" + tmp.File("outside.safetensors") + ",heads=4"});
  ASSERT_NE(closed, nullptr);
  grpc::Status refused = closed->client().LoadLayer("x", "safetensors:" + tmp.File("outside.safetensors") + ",heads=4", nullptr);
  EXPECT_EQ(refused.error_code(), grpc::PERMISSION_DENIED) << Describe(refused);
  EXPECT_THAT(refused.error_message(), HasSubstr("--model-dir"));
  ASSERT_TRUE(closed->client().GetLayer("own", &info).ok());
  EXPECT_EQ(info.source(), "safetensors:outside.safetensors,heads=4") << "no server directory in ListLayers";
}

TEST(SecurityTest, LayerCountAndBytesAreCapped) {
  auto server = StartOrFail({"--admin-token", kTestAdminToken, "--layer", kTinyLayer, "--max-layers", "2",
                             "--max-layer-mb", "1"});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();
  ASSERT_TRUE(client.LoadLayer("second", "random:d_model=16,heads=2,seed=5", nullptr).ok());
  grpc::Status third = client.LoadLayer("third", "random:d_model=16,heads=2,seed=6", nullptr);
  EXPECT_EQ(third.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(third);
  EXPECT_THAT(third.error_message(), HasSubstr("--max-layers"));
  // Replacing a held layer is not a new one; a layer too big for the byte cap is refused.
  grpc::Status big = client.LoadLayer("second", "random:d_model=256,heads=4,seed=7", nullptr);
  EXPECT_EQ(big.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(big);
  EXPECT_THAT(big.error_message(), HasSubstr("--max-layer-mb"));
  EXPECT_TRUE(client.LoadLayer("second", "random:d_model=16,heads=2,seed=8", nullptr).ok());
}

// What a client sends comes back truncated and escaped, never whole, and never as log lines.
TEST(SecurityTest, EchoedNamesAreTruncatedAndEscapedInErrorsAndLogs) {
  auto server = StartOrFail({"--layer", kTinyLayer, "--log-level", "debug"});
  ASSERT_NE(server, nullptr);
  const std::string hostile = std::string(5000, 'A') + "\nFORGED LOG LINE\x1b[31m";
  v1::ForwardRequest req;
  req.set_layer(hostile);
  v1::ForwardResponse resp;
  grpc::Status st = server->client().Forward(req, &resp);
  EXPECT_EQ(st.error_code(), grpc::NOT_FOUND);
  EXPECT_THAT(st.error_message(), AllOf(HasSubstr("5021 bytes, first 128 shown"), Not(HasSubstr("\n")),
                                        Not(HasSubstr(std::string(129, 'A')))));
  v1::LayerInfo info;
  st = server->client().GetLayer(hostile, &info);
  EXPECT_THAT(st.error_message(), Not(HasSubstr(std::string(129, 'A'))));
  ASSERT_TRUE(server->WaitForLog("Forward layer=")) << server->Log();  // the one line the calls log
  const std::string log = server->Log();
  EXPECT_THAT(log, AllOf(Not(HasSubstr("\nFORGED")), Not(HasSubstr("\x1b")), Not(HasSubstr(std::string(129, 'A')))));
  EXPECT_THAT(log, HasSubstr("AAAA"));  // the debug line was written, escaped and cut
}

// No heap address in any answer: a full queue names the layer and form.
TEST(SecurityTest, QueueFullNamesNoAddress) {
  auto server = StartOrFail({"--threads", "1", "--max-batch-requests", "1", "--max-queue-requests", "1", "--layer",
                             "slow=random:d_model=256,heads=8,seed=4"});
  ASSERT_NE(server, nullptr);
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardResponse>>> calls;
  std::vector<float> x(64 * 256, 0.5f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) / 7.0f - 0.8f;
  for (int i = 0; i < 12; ++i) {
    v1::ForwardRequest req;
    req.set_layer("slow");
    req.set_form(v1::FORM_SUMMED);
    *req.mutable_input() = MakeTensor(x, {1, 64, 256});
    calls.push_back(server->client().ForwardFuture(req));
  }
  int refused = 0;
  for (auto& c : calls) {
    auto [status, _] = c.get();
    if (status.error_code() != grpc::RESOURCE_EXHAUSTED) continue;
    ++refused;
    EXPECT_THAT(status.error_message(), AllOf(HasSubstr("slow/summed"), Not(HasSubstr("0x"))));
  }
  EXPECT_GT(refused, 0);
}

// A layer load still running at the drain deadline (here merely slow; on a hung network file
// system it would never return) does not hold the drain: the server exits 0 about a second
// after the deadline, without it.
TEST(SecurityTest, TheDrainDoesNotWaitForALayerLoad) {
  auto server = StartOrFail({"--admin-token", kTestAdminToken, "--layer", kTinyLayer, "--drain-timeout-s", "1"});
  ASSERT_NE(server, nullptr);
  ClientOptions o = server->client().options();
  o.timeout = std::chrono::milliseconds(120000);
  Client admin(o);
  // Several seconds of materialising and spectra on this machine (more under the sanitizers).
  auto load = std::async(std::launch::async,
                         [&] { return admin.LoadLayer("slow", "random:d_model=6144,heads=48,summed=false", nullptr); });
  // The load has begun (it then runs for seconds): the drain starts while it runs.
  ASSERT_TRUE(server->WaitForLog("loading layer 'slow'")) << server->Log();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(server->Stop(SIGTERM, std::chrono::seconds(20)), 0) << server->Log();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 4.0) << server->Log();
  const grpc::Status st = load.get();
  EXPECT_FALSE(st.ok()) << "the load was cut short";
  EXPECT_THAT(server->Log(), HasSubstr("a layer load still running is abandoned"));
}

// The status-code table of docs/service.md, walked: every code it lists is answered by the real
// server to the request that should get it here, or is covered by the named test elsewhere.
TEST(SecurityTest, TheStatusCodeTableIsWhatTheServerAnswers) {
  std::ifstream doc(std::string(ATTNSERVE_SOURCE_DIR) + "/docs/service.md");
  ASSERT_TRUE(doc.good());
  std::vector<std::string> documented;
  std::string line;
  bool in_section = false;
  while (std::getline(doc, line)) {
    if (line.starts_with("## ")) in_section = line == "## Status codes";
    if (in_section && line.starts_with("| `")) documented.push_back(line.substr(3, line.find('`', 3) - 3));
  }
  ASSERT_GE(documented.size(), 8u);

  auto server = StartOrFail({"--admin-token", kTestAdminToken, "--layer", kTinyLayer, "--max-layers", "1"});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();
  Client anonymous = AnonymousClient(*server);
  auto forward = [&](v1::ForwardRequest req, int timeout_ms = 10000) {
    ClientOptions o = client.options();
    o.timeout = std::chrono::milliseconds(timeout_ms);
    Client c(o);
    v1::ForwardResponse resp;
    return c.Forward(req, &resp);
  };
  v1::ForwardRequest good;
  good.set_layer("tiny");
  std::vector<float> x(2 * 8 * 16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37f * static_cast<float>(i));
  *good.mutable_input() = MakeTensor(x, {2, 8, 16});
  std::map<std::string, grpc::Status> answered;
  {
    v1::ForwardRequest no_input;
    no_input.set_layer("tiny");
    answered["INVALID_ARGUMENT"] = forward(no_input);
    v1::ForwardRequest unknown = good;
    unknown.set_layer("nope");
    answered["NOT_FOUND"] = forward(unknown);
    v1::ForwardRequest lowrank = good;
    lowrank.set_form(v1::FORM_LOWRANK);
    answered["FAILED_PRECONDITION"] = forward(lowrank);
    answered["RESOURCE_EXHAUSTED"] = client.LoadLayer("second", "random:d_model=16,heads=2", nullptr);
    answered["UNAUTHENTICATED"] = anonymous.UnloadLayer("tiny");
    answered["PERMISSION_DENIED"] = client.LoadLayer("x", "safetensors:x.safetensors,heads=2", nullptr);
    v1::ForwardRequest big = good;
    std::vector<float> long_input(4096 * 16, 0.25f);
    *big.mutable_input() = MakeTensor(long_input, {1, 4096, 16});
    big.set_form(v1::FORM_SUMMED);
    answered["DEADLINE_EXCEEDED"] = forward(big, 1);
    v1::ForwardRequest not_utf8 = good;
    not_utf8.set_layer("tiny\xff\xfe");  // proto3 strings must be UTF-8: the request does not parse
    answered["UNIMPLEMENTED"] = forward(not_utf8);
  }
  // Codes whose trigger is a whole scenario of its own.
  const std::map<std::string, std::string> elsewhere = {
      {"UNAVAILABLE", "DrainTest.SigtermUnderLoadLosesNothing, TlsTest.*"},
      {"INTERNAL", "CudaEmulatedServerTest.ADeviceFaultFailsTheRequestAndTakesTheServerOutOfRotation"},
      {"OUT_OF_RANGE", "the non-finite output tests (server_test.cc)"},
  };
  for (const std::string& code : documented) {
    auto it = answered.find(code);
    if (it == answered.end()) {
      EXPECT_TRUE(elsewhere.count(code)) << code << " is documented, but no test here or elsewhere triggers it";
      continue;
    }
    EXPECT_EQ(std::string(GrpcCodeName(it->second.error_code())), code) << Describe(it->second);
  }
  for (const auto& [code, _] : answered) {
    EXPECT_NE(std::find(documented.begin(), documented.end(), code), documented.end()) << code << " is not documented";
  }
}

// Certificates made here with openssl: a CA, a server certificate for 127.0.0.1 and "attnserve",
// a client certificate, and a second CA nobody trusts.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const std::string d = dir_->path();
    const std::string script =
        "set -e; cd '" + d + "'\n"
        "mk_ca() { openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj \"/CN=$1\" -keyout $1.key -out $1.crt "
        ">/dev/null 2>&1; }\n"
        "mk_cert() { openssl req -newkey rsa:2048 -nodes -subj \"/CN=$1\" -keyout $1.key -out $1.csr >/dev/null 2>&1;"
        " printf 'subjectAltName=DNS:attnserve,IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' > $1.ext;"
        " openssl x509 -req -in $1.csr -CA $2.crt -CAkey $2.key -CAcreateserial -days 2 -extfile $1.ext -out $1.crt"
        " >/dev/null 2>&1; }\n"
        "mk_ca ca; mk_ca rogue; mk_cert server ca; mk_cert client ca; mk_cert stranger rogue\n";
    const std::string script_file = d + "/make-certs.sh";
    std::ofstream(script_file) << script;
    ok_ = std::system(("bash '" + script_file + "'").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!ok_) GTEST_SKIP() << "openssl could not make the test certificates";
  }
  static std::string File(const std::string& name) { return dir_->path() + "/" + name; }
  static ClientOptions Trusting(const std::string& ca) {
    ClientOptions o;
    o.tls_ca = File(ca + ".crt");
    o.timeout = std::chrono::milliseconds(10000);
    return o;
  }
  static bool Serving(const ServerProcess& server, ClientOptions o) {
    o.target = server.target();
    Client client(o);
    bool serving = false;
    return client.Health("", &serving).ok() && serving;
  }
  static grpc::StatusCode HealthCode(const ServerProcess& server, ClientOptions o) {
    o.target = server.target();
    o.timeout = std::chrono::milliseconds(5000);
    Client client(o);
    bool serving = false;
    return client.Health("", &serving).error_code();
  }
  static TempDir* dir_;
  static bool ok_;
};
TempDir* TlsTest::dir_ = nullptr;
bool TlsTest::ok_ = false;

TEST_F(TlsTest, TlsClientsConnectPlaintextAndUntrustedOnesDoNot) {
  auto server = StartOrFail({"--layer", kTinyLayer, "--tls-cert", File("server.crt"), "--tls-key", File("server.key")},
                            Trusting("ca"));
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(Serving(*server, Trusting("ca")));
  v1::ForwardRequest req;
  req.set_layer("tiny");
  std::vector<float> x(3 * 16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  *req.mutable_input() = MakeTensor(x, {1, 3, 16});
  v1::ForwardResponse resp;
  grpc::Status st = server->client().Forward(req, &resp);
  EXPECT_TRUE(st.ok()) << Describe(st);
  // By name, as a Kubernetes probe or ingress would ask.
  ClientOptions by_name = Trusting("ca");
  by_name.server_name = "attnserve";
  EXPECT_TRUE(Serving(*server, by_name));
  EXPECT_EQ(HealthCode(*server, ClientOptions{}), grpc::UNAVAILABLE) << "plaintext client";
  EXPECT_EQ(HealthCode(*server, Trusting("rogue")), grpc::UNAVAILABLE) << "client trusting another CA";
  ClientOptions wrong_name = Trusting("ca");
  wrong_name.server_name = "elsewhere.example";
  EXPECT_EQ(HealthCode(*server, wrong_name), grpc::UNAVAILABLE) << "certificate for another name";
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutATrustedCertificate) {
  ClientOptions with_cert = Trusting("ca");
  with_cert.tls_cert = File("client.crt");
  with_cert.tls_key = File("client.key");
  auto server = StartOrFail({"--layer", kTinyLayer, "--tls-cert", File("server.crt"), "--tls-key", File("server.key"),
                             "--tls-client-ca", File("ca.crt")},
                            with_cert);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(Serving(*server, with_cert));
  EXPECT_EQ(HealthCode(*server, Trusting("ca")), grpc::UNAVAILABLE) << "no client certificate";
  ClientOptions stranger = Trusting("ca");
  stranger.tls_cert = File("stranger.crt");
  stranger.tls_key = File("stranger.key");
  EXPECT_EQ(HealthCode(*server, stranger), grpc::UNAVAILABLE) << "client certificate from an untrusted CA";
}

TEST_F(TlsTest, TheCliSpeaksTls) {
  auto server = StartOrFail({"--layer", kTinyLayer, "--tls-cert", File("server.crt"), "--tls-key", File("server.key")},
                            Trusting("ca"));
  ASSERT_NE(server, nullptr);
  std::string output;
  EXPECT_EQ(RunToExit(ATTNSERVE_CLI_BINARY, {"--target", server->target(), "--tls-ca", File("ca.crt"), "health"}, &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("SERVING"));
  EXPECT_NE(RunToExit(ATTNSERVE_CLI_BINARY, {"--target", server->target(), "--timeout-ms", "3000", "health"}, &output), 0);
}

}  // namespace
}  // namespace attnserve
