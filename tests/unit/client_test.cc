// Tests of the client library and the CLI: tensor helpers, argument parsing, and calls against
// an in-process fake AttentionService (the real server's round trip is an integration test).
#include "client/client.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/cli/args.h"
#include "client/cli/commands.h"
#include "client/npy.h"
#include "tests/unit/temp_dir.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------------------------
// Tensor helpers

TEST(ClientTensor, RoundTripsRandomValues) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {}, {0}, {5}, {2, 3}, {2, 3, 4}, {1, 0, 7}, {3, 1, 2, 2}}) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    const v1::Tensor t = MakeTensor(v, shape);
    EXPECT_EQ(t.dtype(), v1::DATA_TYPE_FLOAT32);
    EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), shape);
    EXPECT_EQ(t.data().size(), n * 4);
    std::vector<float> back;
    grpc::Status s = TensorToFloats(t, &back);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(back, v);
  }
}

TEST(ClientTensor, BytesAreLittleEndianFloat32) {
  const float v[] = {1.0f, -2.0f};
  const v1::Tensor t = MakeTensor(v, {2});
  EXPECT_EQ(t.data(), std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8));
}

TEST(ClientTensor, KeepsSpecialValues) {
  const float v[] = {std::numeric_limits<float>::infinity(), -0.0f,
                     std::numeric_limits<float>::denorm_min(),
                     std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> back;
  ASSERT_TRUE(TensorToFloats(MakeTensor(v, {4}), &back).ok());
  EXPECT_TRUE(std::isinf(back[0]));
  EXPECT_TRUE(std::signbit(back[1]));
  EXPECT_EQ(back[2], v[2]);
  EXPECT_TRUE(std::isnan(back[3]));
}

TEST(ClientTensor, RefusesWrongDtype) {
  const float v[] = {1, 2};
  v1::Tensor t = MakeTensor(v, {2});
  t.set_dtype(v1::DATA_TYPE_FLOAT16);
  std::vector<float> back;
  grpc::Status s = TensorToFloats(t, &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expected DATA_TYPE_FLOAT32"));
  EXPECT_THAT(s.error_message(), HasSubstr("got DATA_TYPE_FLOAT16"));
  t.set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  EXPECT_EQ(TensorToFloats(t, &back).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(ClientTensor, RefusesSizeMismatch) {
  const float v[] = {1, 2, 3, 4, 5};
  std::vector<float> back;
  grpc::Status s = TensorToFloats(MakeTensor(v, {2, 3}), &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expected 24 bytes"));
  EXPECT_THAT(s.error_message(), HasSubstr("[2,3]"));
  EXPECT_THAT(s.error_message(), HasSubstr("got 20"));

  v1::Tensor t = MakeTensor(v, {5});
  t.mutable_data()->push_back('\0');  // not a whole number of floats
  EXPECT_EQ(TensorToFloats(t, &back).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(ClientTensor, RefusesBadShapes) {
  std::vector<float> back;
  grpc::Status s = TensorToFloats(MakeTensor({}, {-1}), &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expected non-negative"));
  s = TensorToFloats(MakeTensor({}, {1LL << 40, 1LL << 40}), &back);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("overflows"));
  // A zero dimension makes any other size fine.
  EXPECT_TRUE(TensorToFloats(MakeTensor({}, {0, 1LL << 62}), &back).ok());
  EXPECT_TRUE(back.empty());
}

TEST(ClientTensor, CodeNames) {
  EXPECT_STREQ(GrpcCodeName(grpc::StatusCode::NOT_FOUND), "NOT_FOUND");
  EXPECT_STREQ(GrpcCodeName(grpc::StatusCode::INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(ServingStatusName(ServingStatus::kNotServing), "NOT_SERVING");
}

// ---------------------------------------------------------------------------------------------
// Argument parsing

namespace cli_ns = ::attnserve::cli;

TEST(ClientCliArgs, GlobalDefaultsEnvAndOverrides) {
  cli_ns::GlobalArgs g;
  std::string err;
  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"layers"}, {}, &g, &err)) << err;
  EXPECT_EQ(g.client.target, "localhost:50051");
  EXPECT_EQ(g.client.timeout, std::chrono::milliseconds(30000));
  EXPECT_EQ(g.client.max_message_mb, 64);
  EXPECT_EQ(g.command, "layers");
  EXPECT_TRUE(g.command_args.empty());

  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"health"}, {.target = "env:1"}, &g, &err));
  EXPECT_EQ(g.client.target, "env:1");
  ASSERT_TRUE(
      cli_ns::ParseGlobalArgs({"--target", "flag:2", "health"}, {.target = "env:1"}, &g, &err));
  EXPECT_EQ(g.client.target, "flag:2");

  ASSERT_TRUE(cli_ns::ParseGlobalArgs(
      {"--target=dns:///h:3", "--timeout-ms", "250", "--max-message-mb=8", "--load-balancing",
       "round_robin", "forward", "--layer", "x", "--target", "y"},
      {}, &g, &err))
      << err;
  EXPECT_EQ(g.client.target, "dns:///h:3");
  EXPECT_EQ(g.client.timeout, std::chrono::milliseconds(250));
  EXPECT_EQ(g.client.max_message_mb, 8);
  EXPECT_EQ(g.client.load_balancing, "round_robin");
  EXPECT_EQ(g.command, "forward");
  // Flags after the subcommand are the subcommand's.
  EXPECT_EQ(g.command_args, (std::vector<std::string>{"--layer", "x", "--target", "y"}));

  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"layers"}, {.admin_token = "env"}, &g, &err));
  EXPECT_EQ(g.client.admin_token, "env");
  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"--admin-token", "flag", "layers"}, {.admin_token = "env"},
                                      &g, &err));
  EXPECT_EQ(g.client.admin_token, "flag");
  EXPECT_EQ(g.command, "layers");

  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"--help"}, {}, &g, &err));
  EXPECT_TRUE(g.help);
  EXPECT_TRUE(g.command.empty());
}

TEST(ClientCliArgs, GlobalErrorsNameTheArgument) {
  cli_ns::GlobalArgs g;
  std::string err;
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--timeout-ms", "soon", "layers"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("--timeout-ms"));
  EXPECT_THAT(err, HasSubstr("'soon'"));
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--timeout-ms=0", "layers"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("--timeout-ms"));
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--max-message-mb", "4096", "layers"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("--max-message-mb"));
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--nope", "layers"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("'--nope'"));
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--target"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("--target needs a value"));
  EXPECT_FALSE(cli_ns::ParseGlobalArgs({"--target=", "layers"}, {}, &g, &err));
  EXPECT_THAT(err, HasSubstr("--target: expected ADDR, got ''"));
}

// The TLS flags are checked before any channel is made: a client certificate and its key come
// together, each file named must hold PEM, and --server-name (a TLS name override) needs TLS;
// each refusal names the flag and what came.
TEST(ClientCliArgs, TlsFlagsComeInPairsHoldPemAndServerNameNeedsTls) {
  attnserve::testing::TempDir dir;
  const std::string pem = dir.File("a.pem"), not_pem = dir.File("b.txt"), missing = dir.File("none.pem");
  std::ofstream(pem) << "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  std::ofstream(not_pem) << "a certificate, honestly\n";
  cli_ns::GlobalArgs g;
  std::string err;
  const auto refused = [&](std::vector<std::string> args) {
    args.push_back("layers");
    err.clear();
    return !cli_ns::ParseGlobalArgs(args, {}, &g, &err);
  };
  EXPECT_TRUE(refused({"--tls-cert", pem}));
  EXPECT_EQ(err, "--tls-cert and --tls-key: expected both or neither, got only --tls-cert");
  EXPECT_TRUE(refused({"--tls-key", pem}));
  EXPECT_EQ(err, "--tls-cert and --tls-key: expected both or neither, got only --tls-key");
  EXPECT_TRUE(refused({"--tls-ca", missing}));
  EXPECT_EQ(err, "--tls-ca: cannot read a PEM file at '" + missing + "'");
  EXPECT_TRUE(refused({"--tls-cert", pem, "--tls-key", not_pem}));
  EXPECT_EQ(err, "--tls-key: cannot read a PEM file at '" + not_pem + "'");
  EXPECT_TRUE(refused({"--server-name", "attnserve.internal"}));
  EXPECT_EQ(err, "--server-name: only with TLS (--tls-ca)");

  ASSERT_TRUE(cli_ns::ParseGlobalArgs({"--tls-ca", pem, "--tls-cert", pem, "--tls-key", pem, "--server-name",
                                       "attnserve.internal", "layers"},
                                      {}, &g, &err))
      << err;
  EXPECT_EQ(g.client.tls_ca, pem);
  EXPECT_EQ(g.client.tls_cert, pem);
  EXPECT_EQ(g.client.tls_key, pem);
  EXPECT_EQ(g.client.server_name, "attnserve.internal");
  EXPECT_TRUE(g.client.tls());
}

TEST(ClientCliArgs, ForwardFlags) {
  cli_ns::ForwardArgs f;
  std::string err;
  ASSERT_TRUE(cli_ns::ParseForwardArgs({"--layer", "l", "--random", "2,3"}, &f, &err)) << err;
  EXPECT_EQ(f.layer, "l");
  EXPECT_EQ(f.form, v1::FORM_UNSPECIFIED);
  EXPECT_EQ(f.random, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.seed, 1u);
  EXPECT_FALSE(f.causal);

  ASSERT_TRUE(
      cli_ns::ParseForwardArgs({"--layer=l", "--form", "lowrank", "--input", "x.npy", "--context",
                                "c.npy", "--causal", "--key-lengths", "3,5", "--output", "y.npy",
                                "--compare", "--seed", "42", "--request-key", "k"},
                               &f, &err))
      << err;
  EXPECT_EQ(f.form, v1::FORM_LOWRANK);
  EXPECT_EQ(f.input, "x.npy");
  EXPECT_EQ(f.context, "c.npy");
  EXPECT_TRUE(f.causal);
  EXPECT_EQ(f.key_lengths, (std::vector<int32_t>{3, 5}));
  EXPECT_EQ(f.output, "y.npy");
  EXPECT_TRUE(f.compare);
  EXPECT_EQ(f.seed, 42u);
  EXPECT_EQ(f.request_key, "k");

  ASSERT_TRUE(cli_ns::ParseForwardArgs({"--layer", "l", "--random", "1,4,6", "--form", "summed"},
                                       &f, &err));
  EXPECT_EQ(f.random, (std::vector<int64_t>{1, 4, 6}));
  EXPECT_EQ(f.form, v1::FORM_SUMMED);

  ASSERT_TRUE(cli_ns::ParseForwardArgs({"--help"}, &f, &err));
  EXPECT_TRUE(f.help);
}

TEST(ClientCliArgs, ForwardErrorsNameTheArgument) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--random", "2,3"}, "--layer is required"},
      {{"--layer", "l"}, "one of --input or --random"},
      {{"--layer", "l", "--random", "2,3", "--input", "x"}, "exclude each other"},
      {{"--layer", "l", "--random", "2"}, "--random: expected B,N or B,N,M"},
      {{"--layer", "l", "--random", "2,0"}, "--random: expected values >= 1"},
      {{"--layer", "l", "--random", "2,x"}, "bad item 'x'"},
      {{"--layer", "l", "--random", "1,2,3", "--context", "c.npy"}, "--context"},
      {{"--layer", "l", "--random", "2,3", "--form", "dense"}, "--form: expected factored"},
      {{"--layer", "l", "--random", "2,3", "--key-lengths", "3,-1"}, "--key-lengths"},
      {{"--layer", "l", "--random", "2,3", "--key-lengths", "99999999999"}, "--key-lengths"},
      {{"--layer", "l", "--random", "2,3", "--seed", "-1"}, "--seed: expected an unsigned"},
      {{"--layer", "l", "--random", "2,3", "--bogus"}, "unknown flag '--bogus'"},
      {{"--layer", "l", "--random", "2,3", "extra"}, "unexpected argument 'extra'"},
      {{"--layer", "l", "--random"}, "--random needs a value"},
      {{"--layer", "l", "--random", "2,3", "--causal=yes"}, "--causal takes no value"},
      {{"--layer", "l", "--input", ""}, "--input: expected X.npy, got ''"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.args));
    cli_ns::ForwardArgs f;
    std::string err;
    EXPECT_FALSE(cli_ns::ParseForwardArgs(c.args, &f, &err));
    EXPECT_THAT(err, HasSubstr(c.message));
  }
}

TEST(ClientCliArgs, IntListAndForms) {
  std::vector<int64_t> v;
  std::string err;
  EXPECT_TRUE(cli_ns::ParseIntList("7", "--x", 0, &v, &err));
  EXPECT_EQ(v, (std::vector<int64_t>{7}));
  EXPECT_FALSE(cli_ns::ParseIntList("", "--x", 0, &v, &err));
  EXPECT_FALSE(cli_ns::ParseIntList("1,,2", "--x", 0, &v, &err));
  EXPECT_FALSE(cli_ns::ParseIntList("1,2,", "--x", 0, &v, &err));
  EXPECT_FALSE(cli_ns::ParseIntList("1 ,2", "--x", 0, &v, &err));
  v1::Form form;
  for (const char* name : {"factored", "summed", "lowrank"}) {
    ASSERT_TRUE(cli_ns::ParseForm(name, &form, &err));
    EXPECT_EQ(cli_ns::FormName(form), name);
  }
}

TEST(ClientCliArgs, EveryCommandHasHelpAndUsage) {
  for (const cli_ns::Subcommand& c : cli_ns::Subcommands()) {
    SCOPED_TRACE(std::string(c.name));
    std::ostringstream out, err;
    EXPECT_EQ(cli_ns::RunCli({std::string(c.name), "--help"}, {}, out, err), 0);
    EXPECT_THAT(out.str(), HasSubstr("usage: attnserve-cli [global flags] " + std::string(c.name)));
    EXPECT_EQ(err.str(), "");
  }
  std::ostringstream out, err;
  EXPECT_EQ(cli_ns::RunCli({"--help"}, {}, out, err), 0);
  for (const cli_ns::Subcommand& c : cli_ns::Subcommands()) {
    EXPECT_THAT(out.str(), HasSubstr("  " + std::string(c.name)));
  }
}

// The version is CMakeLists.txt's project(VERSION), passed to this test by CMake separately.
TEST(ClientCliArgs, VersionPrintsTheProjectVersionWithoutConnecting) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--version"}, {"--target", "localhost:1", "--version", "forward"}}) {
    std::ostringstream out, err;
    EXPECT_EQ(cli_ns::RunCli(args, {}, out, err), 0);
    EXPECT_EQ(out.str(), std::string("attnserve-cli ") + ATTNSERVE_EXPECTED_VERSION + "\n");
    EXPECT_EQ(err.str(), "");
  }
}

TEST(ClientCliArgs, UsageErrorsExitTwoWithoutConnecting) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"frobnicate"},
      {"--bogus", "layers"},
      {"layer"},
      {"layer", "a", "b"},
      {"load", "a"},
      {"unload"},
      {"layers", "--x"},
      {"health", "a", "b"},
      {"forward", "--layer", "l"},
  };
  for (const auto& args : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    std::ostringstream out, err;
    // An unroutable target: a connection attempt would fail with exit 1, not 2.
    std::vector<std::string> full = {"--target", "127.0.0.1:1", "--timeout-ms", "100"};
    full.insert(full.end(), args.begin(), args.end());
    EXPECT_EQ(cli_ns::RunCli(full, {}, out, err), 2);
    EXPECT_THAT(err.str(), HasSubstr("usage: attnserve-cli"));
    EXPECT_EQ(out.str(), "");
  }
}

// ---------------------------------------------------------------------------------------------
// A fake server

// Output = 2 * input; form = the requested one (SUMMED when unspecified). Layer "slow" sleeps,
// anything but "small" and "slow" is NOT_FOUND.
class FakeService final : public v1::AttentionService::Service {
 public:
  std::atomic<int> forwards{0};
  std::atomic<bool> forward_had_auth{false};
  v1::ForwardRequest last;
  std::string last_admin_auth;  // "authorization" of the last LoadLayer or UnloadLayer
  std::mutex mu;

  static std::string Auth(const grpc::ServerContext* ctx) {
    auto it = ctx->client_metadata().find("authorization");
    return it == ctx->client_metadata().end() ? ""
                                              : std::string(it->second.data(), it->second.size());
  }

  grpc::Status Forward(grpc::ServerContext* ctx, const v1::ForwardRequest* req,
                       v1::ForwardResponse* resp) override {
    ++forwards;
    if (!Auth(ctx).empty()) forward_had_auth = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      last = *req;
    }
    if (req->layer() == "slow")
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    else if (req->layer() != "small") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "layer '" + req->layer() + "' is not loaded");
    }
    std::vector<float> x;
    if (grpc::Status s = TensorToFloats(req->input(), &x); !s.ok()) return s;
    for (float& v : x) v *= 2;
    *resp->mutable_output() = MakeTensor(
        x, std::vector<int64_t>(req->input().shape().begin(), req->input().shape().end()));
    resp->set_form(req->form() == v1::FORM_UNSPECIFIED ? v1::FORM_SUMMED : req->form());
    resp->set_math(req->math().empty() ? "fp32" : req->math());  // echoes the math asked for
    resp->set_queue_us(11);
    resp->set_decode_us(7);
    resp->set_encode_us(5);
    resp->set_compute_us(22);
    resp->set_batch_requests(3);
    if (req->compare()) {
      v1::Divergence* d = resp->add_divergence();
      d->set_form(v1::FORM_FACTORED);
      d->set_max_abs(1.5e-7);
      d->set_rel_l2(2.5e-8);
    }
    return grpc::Status::OK;
  }

  grpc::Status ListLayers(grpc::ServerContext*, const v1::ListLayersRequest*,
                          v1::ListLayersResponse* resp) override {
    *resp->add_layers() = Small();
    return grpc::Status::OK;
  }

  grpc::Status GetLayer(grpc::ServerContext*, const v1::GetLayerRequest* req,
                        v1::LayerInfo* info) override {
    if (req->name() != "small" && req->name() != "slow") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "layer '" + req->name() + "' is not loaded");
    }
    *info = Small();
    info->set_name(req->name());
    return grpc::Status::OK;
  }

  grpc::Status LoadLayer(grpc::ServerContext* ctx, const v1::LoadLayerRequest* req,
                         v1::LayerInfo* info) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      last_admin_auth = Auth(ctx);
    }
    if (req->source().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty source");
    *info = Small();
    info->set_name(req->name());
    info->set_source(req->source());
    return grpc::Status::OK;
  }

  grpc::Status UnloadLayer(grpc::ServerContext* ctx, const v1::UnloadLayerRequest* req,
                           v1::UnloadLayerResponse*) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      last_admin_auth = Auth(ctx);
    }
    if (req->name() != "small") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "layer '" + req->name() + "' is not loaded");
    }
    return grpc::Status::OK;
  }

  static v1::LayerInfo Small() {
    v1::LayerInfo info;
    info.set_name("small");
    info.set_source("random:d_model=8,heads=2");
    v1::LayerConfig* c = info.mutable_config();
    c->set_d_model(8);
    c->set_heads(2);
    c->set_kv_heads(2);
    c->set_d_head(4);
    c->set_bias(true);
    c->set_scale(0.5f);
    for (v1::Form f : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
      v1::FormInfo* fi = info.add_forms();
      fi->set_form(f);
      fi->set_parameters(f == v1::FORM_FACTORED ? 256 : 320);
      fi->set_bytes(fi->parameters() * 4);
      fi->set_device("cpu");
      fi->set_flops_per_token(1234.5);
      fi->set_flops_reference_length(128);
    }
    return info;
  }
};

class FakeServer {
 public:
  FakeServer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    b.SetMaxReceiveMessageSize(256 << 20);
    b.SetMaxSendMessageSize(256 << 20);
    server_ = b.BuildAndStart();
  }
  ~FakeServer() { server_->Shutdown(std::chrono::system_clock::now()); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  FakeService& service() { return service_; }
  grpc::Server& server() { return *server_; }

 private:
  FakeService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

ClientOptions Options(const std::string& target) {
  ClientOptions o;
  o.target = target;
  o.timeout = std::chrono::milliseconds(5000);
  return o;
}

v1::ForwardRequest SmallRequest(float scale = 1.0f) {
  v1::ForwardRequest req;
  req.set_layer("small");
  std::vector<float> x(2 * 3 * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = scale * static_cast<float>(i);
  *req.mutable_input() = MakeTensor(x, {2, 3, 8});
  return req;
}

TEST(ClientRpc, ForwardSyncAsyncAndFuture) {
  FakeServer server;
  ASSERT_GT(std::stoi(server.address().substr(10)), 0);
  Client client(Options(server.address()));

  v1::ForwardResponse resp;
  grpc::Status s = client.Forward(SmallRequest(), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.form(), v1::FORM_SUMMED);
  std::vector<float> y;
  ASSERT_TRUE(TensorToFloats(resp.output(), &y).ok());
  ASSERT_EQ(y.size(), 48u);
  EXPECT_EQ(y[5], 10.0f);

  std::promise<std::pair<grpc::Status, v1::ForwardResponse>> done;
  client.ForwardAsync(SmallRequest(3), [&done](grpc::Status st, v1::ForwardResponse r) {
    done.set_value({std::move(st), std::move(r)});
  });
  auto [st, r] = done.get_future().get();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(TensorToFloats(r.output(), &y).ok());
  EXPECT_EQ(y[1], 6.0f);

  // Many calls in flight from one client.
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardResponse>>> futures;
  for (int i = 0; i < 32; ++i) futures.push_back(client.ForwardFuture(SmallRequest(float(i))));
  for (int i = 0; i < 32; ++i) {
    auto [fs, fr] = futures[i].get();
    ASSERT_TRUE(fs.ok()) << fs.error_message();
    ASSERT_TRUE(TensorToFloats(fr.output(), &y).ok());
    EXPECT_EQ(y[1], 2.0f * static_cast<float>(i));
  }

  // Errors come back as the server's status, through every path.
  v1::ForwardRequest bad = SmallRequest();
  bad.set_layer("nope");
  s = client.Forward(bad, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("'nope'"));
  EXPECT_EQ(client.ForwardFuture(bad).get().first.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(ClientRpc, CallsFromManyThreads) {
  FakeServer server;
  Client client(Options(server.address()));
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        v1::ForwardResponse resp;
        if (client.Forward(SmallRequest(), &resp).ok()) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 80);
}

TEST(ClientRpc, LayerCalls) {
  FakeServer server;
  Client client(Options(server.address()));
  std::vector<v1::LayerInfo> layers;
  ASSERT_TRUE(client.ListLayers(&layers).ok());
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].config().d_model(), 8);

  v1::LayerInfo info;
  ASSERT_TRUE(client.GetLayer("small", &info, true).ok());
  EXPECT_EQ(info.forms_size(), 2);
  EXPECT_EQ(client.GetLayer("x", &info).error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(client.LoadLayer("new", "random:d_model=8", &info).ok());
  EXPECT_EQ(info.name(), "new");
  EXPECT_TRUE(client.LoadLayer("new2", "random:d_model=8", nullptr).ok());
  EXPECT_EQ(client.LoadLayer("bad", "", &info).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  EXPECT_TRUE(client.UnloadLayer("small").ok());
  EXPECT_EQ(client.UnloadLayer("x").error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(ClientRpc, AdminTokenOnlyOnLoadAndUnload) {
  FakeServer server;
  ClientOptions o = Options(server.address());
  Client plain(o);
  ASSERT_TRUE(plain.LoadLayer("a", "random:d_model=8", nullptr).ok());
  {
    std::lock_guard<std::mutex> lock(server.service().mu);
    EXPECT_EQ(server.service().last_admin_auth, "");
  }
  o.admin_token = "s3cret";
  Client admin(o);
  ASSERT_TRUE(admin.LoadLayer("a", "random:d_model=8", nullptr).ok());
  {
    std::lock_guard<std::mutex> lock(server.service().mu);
    EXPECT_EQ(server.service().last_admin_auth, "Bearer s3cret");
    server.service().last_admin_auth.clear();
  }
  ASSERT_TRUE(admin.UnloadLayer("small").ok());
  {
    std::lock_guard<std::mutex> lock(server.service().mu);
    EXPECT_EQ(server.service().last_admin_auth, "Bearer s3cret");
  }
  v1::ForwardResponse resp;
  ASSERT_TRUE(admin.Forward(SmallRequest(), &resp).ok());
  EXPECT_FALSE(server.service().forward_had_auth.load());
}

TEST(ClientRpc, Health) {
  FakeServer server;
  Client client(Options(server.address()));
  bool serving = false;
  grpc::Status s = client.Health("", &serving);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(serving);
  // gRPC's default health service knows only "" until the server names a service.
  server.server().GetHealthCheckService()->SetServingStatus("attnserve.v1.AttentionService", true);
  ASSERT_TRUE(client.Health("attnserve.v1.AttentionService", &serving).ok());
  EXPECT_TRUE(serving);

  server.server().GetHealthCheckService()->SetServingStatus("attnserve.v1.AttentionService", false);
  ServingStatus st = ServingStatus::kUnknown;
  ASSERT_TRUE(client.HealthStatus("attnserve.v1.AttentionService", &st).ok());
  EXPECT_EQ(st, ServingStatus::kNotServing);
  ASSERT_TRUE(client.Health("attnserve.v1.AttentionService", &serving).ok());
  EXPECT_FALSE(serving);

  EXPECT_EQ(client.Health("no.such.Service", &serving).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_FALSE(serving);
}

TEST(ClientRpc, NoServerIsUnavailable) {
  ClientOptions o = Options("127.0.0.1:1");
  o.timeout = std::chrono::milliseconds(1000);
  Client client(o);
  bool serving = true;
  grpc::Status s = client.Health("", &serving);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(serving);
  v1::ForwardResponse resp;
  s = client.Forward(SmallRequest(), &resp);
  EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAVAILABLE ||
              s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
}

TEST(ClientRpc, DeadlineApplies) {
  FakeServer server;
  ClientOptions o = Options(server.address());
  o.timeout = std::chrono::milliseconds(100);
  Client client(o);
  v1::ForwardRequest req = SmallRequest();
  req.set_layer("slow");
  v1::ForwardResponse resp;
  EXPECT_EQ(client.Forward(req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST(ClientRpc, MessageSizeLimitApplies) {
  FakeServer server;
  ClientOptions o = Options(server.address());
  o.max_message_mb = 1;
  Client client(o);
  v1::ForwardRequest req;
  req.set_layer("small");
  std::vector<float> x(2 * 1024 * 64 * 8, 1.0f);  // 4 MiB
  *req.mutable_input() = MakeTensor(x, {2, 1024 * 64, 8});
  v1::ForwardResponse resp;
  EXPECT_EQ(client.Forward(req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  o.max_message_mb = 64;
  Client big(o);
  grpc::Status s = big.Forward(req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(ClientRpc, RoundRobinSpreadsOverBackends) {
  FakeServer a, b;
  const std::string target = "ipv4:" + a.address() + "," + b.address();
  ClientOptions o = Options(target);
  o.load_balancing = "round_robin";
  Client client(o);
  for (int i = 0; i < 20; ++i) {
    v1::ForwardResponse resp;
    grpc::Status s = client.Forward(SmallRequest(), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_GT(a.service().forwards.load(), 0);
  EXPECT_GT(b.service().forwards.load(), 0);
  EXPECT_EQ(a.service().forwards.load() + b.service().forwards.load(), 20);

  // pick_first (the default) sticks to one backend.
  FakeServer c, d;
  Client sticky(Options("ipv4:" + c.address() + "," + d.address()));
  for (int i = 0; i < 10; ++i) {
    v1::ForwardResponse resp;
    ASSERT_TRUE(sticky.Forward(SmallRequest(), &resp).ok());
  }
  EXPECT_EQ(std::max(c.service().forwards.load(), d.service().forwards.load()), 10);
}

// ---------------------------------------------------------------------------------------------
// The CLI against the fake server

using testing::TempDir;

struct CliRun {
  int code;
  std::string out, err;
};

CliRun Cli(const FakeServer& server, std::vector<std::string> args) {
  args.insert(args.begin(), {"--target", server.address(), "--timeout-ms", "5000"});
  std::ostringstream out, err;
  const int code = cli_ns::RunCli(args, {}, out, err);
  return {code, out.str(), err.str()};
}

TEST(ClientCli, HealthPrintsStatusAndExitCode) {
  FakeServer server;
  CliRun r = Cli(server, {"health"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  server.server().GetHealthCheckService()->SetServingStatus(false);
  r = Cli(server, {"health"});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, "NOT_SERVING\n");
  r = Cli(server, {"health", "no.such.Service"});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, "SERVICE_UNKNOWN\n");
}

TEST(ClientCli, TargetFromEnvironment) {
  FakeServer server;
  std::ostringstream out, err;
  const std::string addr = server.address();
  EXPECT_EQ(cli_ns::RunCli({"health"}, {.target = addr.c_str()}, out, err), 0) << err.str();
  EXPECT_EQ(out.str(), "SERVING\n");
}

TEST(ClientCli, LayersTableAndLayer) {
  FakeServer server;
  CliRun r = Cli(server, {"layers"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("NAME   D_MODEL  HEADS  KV_HEADS  D_HEAD  BIAS  FORMS\n"));
  EXPECT_THAT(r.out, HasSubstr("small  8        2      2         4       yes   "
                               "factored:params=256,bytes=1024,device=cpu "
                               "summed:params=320,bytes=1280,device=cpu\n"));

  r = Cli(server, {"layer", "small"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("name: small\n"));
  EXPECT_THAT(r.out, HasSubstr("d_model: 8\n"));
  EXPECT_THAT(r.out, HasSubstr("bias: true\n"));
  EXPECT_THAT(r.out, HasSubstr("form summed: params=320 bytes=1280 device=cpu"));

  r = Cli(server, {"layer", "nope"});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "error: NOT_FOUND: layer 'nope' is not loaded\n");

  r = Cli(server, {"load", "new", "random:d_model=8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("name: new\nsource: random:d_model=8\n"));
  r = Cli(server, {"load", "new", ""});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("error: INVALID_ARGUMENT: "));

  {
    std::lock_guard<std::mutex> lock(server.service().mu);
    EXPECT_EQ(server.service().last_admin_auth, "");
  }
  r = Cli(server, {"--admin-token", "t0k", "unload", "small"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "unloaded: small\n");
  std::lock_guard<std::mutex> lock(server.service().mu);
  EXPECT_EQ(server.service().last_admin_auth, "Bearer t0k");
}

TEST(ClientCli, ForwardRandomPrintsParsableLines) {
  FakeServer server;
  CliRun r = Cli(server, {"forward", "--layer", "small", "--random", "2,3", "--form", "factored",
                          "--compare", "--causal", "--key-lengths", "3,2", "--seed", "5", "--math", "bf16"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("form: factored\n"));
  EXPECT_THAT(r.out, HasSubstr("math: bf16\n")) << "--math reaches the request";
  EXPECT_THAT(r.out, HasSubstr("queue_us: 11\n"));
  EXPECT_THAT(r.out, HasSubstr("compute_us: 22\n"));
  EXPECT_THAT(r.out, HasSubstr("decode_us: 7\n"));
  EXPECT_THAT(r.out, HasSubstr("encode_us: 5\n"));
  EXPECT_THAT(r.out, HasSubstr("batch_requests: 3\n"));
  EXPECT_THAT(r.out, HasSubstr("output_shape: [2, 3, 8]\n"));
  EXPECT_THAT(r.out, HasSubstr("\nmean: "));
  EXPECT_THAT(r.out, HasSubstr("\nstd: "));
  EXPECT_THAT(r.out, HasSubstr("nonfinite: 0\n"));
  EXPECT_THAT(r.out, HasSubstr("divergence: form=factored max_abs=1.5e-07 rel_l2=2.5e-08\n"));
  {
    std::lock_guard<std::mutex> lock(server.service().mu);
    const v1::ForwardRequest& req = server.service().last;
    EXPECT_EQ(req.form(), v1::FORM_FACTORED);
    EXPECT_TRUE(req.causal());
    EXPECT_TRUE(req.compare());
    EXPECT_EQ(req.key_lengths_size(), 2);
    EXPECT_FALSE(req.has_context());
  }
  // The same seed gives the same input.
  CliRun again = Cli(server, {"forward", "--layer", "small", "--random", "2,3", "--seed", "5"});
  ASSERT_EQ(again.code, 0);
  auto first_line = [](const std::string& s) {
    const size_t at = s.find("first:");
    return s.substr(at, s.find('\n', at) - at);
  };
  EXPECT_EQ(first_line(r.out), first_line(again.out));

  // A random context makes it cross-attention.
  r = Cli(server, {"forward", "--layer", "small", "--random", "2,3,4"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::lock_guard<std::mutex> lock(server.service().mu);
  EXPECT_EQ(server.service().last.context().shape_size(), 3);
  EXPECT_EQ(server.service().last.context().shape(1), 4);
}

TEST(ClientCli, ForwardNpyInAndOut) {
  FakeServer server;
  TempDir dir;
  NpyArray x{{1, 2, 8}, {}};
  for (int i = 0; i < 16; ++i) x.data.push_back(0.25f * static_cast<float>(i));
  const std::string in = dir.File("x.npy"), out = dir.File("y.npy");
  ASSERT_TRUE(WriteNpy(in, x).ok());
  CliRun r = Cli(server, {"forward", "--layer", "small", "--input", in, "--output", out});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("form: summed\n"));
  EXPECT_THAT(r.out, HasSubstr("output_shape: [1, 2, 8]\n"));
  EXPECT_THAT(r.out, HasSubstr("first: 0 0.5 1 1.5 2 2.5\n"));
  EXPECT_THAT(r.out, HasSubstr("output_file: " + out + "\n"));
  NpyArray y;
  ASSERT_TRUE(ReadNpy(out, &y).ok());
  EXPECT_EQ(y.shape, x.shape);
  for (size_t i = 0; i < y.data.size(); ++i) EXPECT_EQ(y.data[i], 2 * x.data[i]);

  // Local and remote failures exit 1 with the code name.
  r = Cli(server, {"forward", "--layer", "small", "--input", dir.File("absent.npy")});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("error: NOT_FOUND: "));
  EXPECT_THAT(r.err, HasSubstr("absent.npy"));
  r = Cli(server, {"forward", "--layer", "nope", "--input", in});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "error: NOT_FOUND: layer 'nope' is not loaded\n");
  r = Cli(server, {"forward", "--layer", "nope", "--random", "1,2"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("error: NOT_FOUND: "));
  EXPECT_THAT(r.out, Not(HasSubstr("form:")));
}

TEST(ClientCli, ForwardRefusesRandomInputOverTheMessageLimit) {
  FakeServer server;
  CliRun r = Cli(
      server, {"--max-message-mb", "1", "forward", "--layer", "small", "--random", "1000000,1000"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("error: INVALID_ARGUMENT: --random"));
  EXPECT_EQ(server.service().forwards.load(), 0);
}

// `noop-server` serves the bench's no-op Forward for another client: it writes its port, answers
// a random input with itself (a response of the real size), and exits 0 after --duration.
TEST(ClientCli, NoopServerServesTheFloorForAnyClient) {
  attnserve::testing::TempDir dir;
  const std::string port_file = dir.File("port");
  std::ostringstream out, err;
  int code = -1;
  std::thread server([&] { code = cli_ns::RunCli({"noop-server", "--port-file", port_file, "--duration", "3s"}, {}, out, err); });
  std::string port;
  for (int i = 0; i < 200 && port.empty(); ++i) {
    std::ifstream in(port_file);
    if (!(in >> port)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(port.empty()) << "no port file after 2 s; stderr: " << err.str();
  Client client(Options("127.0.0.1:" + port));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(16 * 24);
  for (float& v : x) v = normal(rng);
  v1::ForwardRequest req;
  req.set_layer("any");
  *req.mutable_input() = MakeTensor(x, {1, 16, 24});
  v1::ForwardResponse resp;
  ASSERT_TRUE(client.Forward(req, &resp).ok());
  std::vector<float> y;
  ASSERT_TRUE(TensorToFloats(resp.output(), &y).ok());
  EXPECT_EQ(y, x);
  server.join();
  EXPECT_EQ(code, 0) << err.str();
  EXPECT_EQ(out.str(), "listening on 127.0.0.1:" + port + "\n");
  std::ostringstream bad_out, bad_err;
  EXPECT_EQ(cli_ns::RunCli({"noop-server", "--duration", "soon"}, {}, bad_out, bad_err), cli_ns::kExitUsage);
  EXPECT_THAT(bad_err.str(), HasSubstr("--duration"));
}

}  // namespace
}  // namespace attnserve
