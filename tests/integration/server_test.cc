// The real attnserve binary on loopback, through attnserve::Client and attnserve-cli: outputs
// of every form against a float64 reference and against PyTorch's vectors, every bad input's
// status code and message, layer load/unload under traffic, the message limit, checkpoint
// files, admin tokens, health, reflection, start-up errors and signals.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/npy.h"
#include "server/core/layer.h"
#include "server/core/reference.h"
#include "server/store/safetensors.h"
#include "tests/integration/server_process.h"
#include "tests/unit/thread_stats.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::ServerProcess;
using testing::TempDir;

// fp32 against float64 at these shapes (d <= 64, m <= 40): rounding is ~1e-6.
constexpr double kTolerance = 1e-5;

// Layers of the shared server: their sources and the weights the `random:` source draws
// (server/store/source.h: CompleteConfig, then RandomLayerWeights(config, seed)).
struct RandomLayer {
  const char* name;
  int64_t d_model, heads, kv_heads, d_head;
  uint64_t seed;
  bool summed;

  std::string Source() const {
    std::string s = "random:d_model=" + std::to_string(d_model) + ",heads=" + std::to_string(heads) +
                    ",seed=" + std::to_string(seed);
    if (kv_heads) s += ",kv_heads=" + std::to_string(kv_heads);
    if (d_head) s += ",d_head=" + std::to_string(d_head);
    if (!summed) s += ",summed=false";
    return s;
  }
  LayerWeights Weights() const {
    LayerConfig c;
    c.d_model = d_model;
    c.heads = heads;
    c.kv_heads = kv_heads;
    c.d_head = d_head;
    return RandomLayerWeights(*CompleteConfig(c), seed);
  }
};

const RandomLayer kSmall{"small", 64, 4, 0, 0, 5, true};
const RandomLayer kGqa{"gqa", 48, 6, 2, 12, 9, true};
const RandomLayer kFactoredOnly{"factored-only", 32, 4, 0, 0, 3, false};

std::vector<float> RandomFloats(std::mt19937_64& rng, size_t count) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// The float64 reference of a [batch, n, d] request.
std::vector<double> Reference(const LayerWeights& w, const std::vector<float>& input, int64_t batch, int64_t n,
                              const std::vector<float>* context = nullptr, int64_t m = 0, bool causal = false,
                              const std::vector<int32_t>& key_lengths = {}) {
  const int64_t d = w.config.d_model;
  std::vector<double> out;
  for (int64_t b = 0; b < batch; ++b) {
    Sequence s;
    s.input = ConstMatrixView(input.data() + b * n * d, n, d);
    if (context) s.context = ConstMatrixView(context->data() + b * m * d, m, d);
    s.causal = causal;
    s.key_length = key_lengths.empty() ? -1 : key_lengths[b];
    const std::vector<double> y = ReferenceForward(w, s);
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

double RelativeL2(const std::vector<float>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = got[i] - want[i];
    num += e * e;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

v1::ForwardRequest Request(const std::string& layer, const std::vector<float>& input, std::vector<int64_t> shape,
                           v1::Form form = v1::FORM_UNSPECIFIED) {
  v1::ForwardRequest req;
  req.set_layer(layer);
  req.set_form(form);
  *req.mutable_input() = MakeTensor(input, std::move(shape));
  return req;
}

std::vector<float> Output(const v1::ForwardResponse& resp) {
  std::vector<float> v;
  const grpc::Status st = TensorToFloats(resp.output(), &v);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return v;
}

using testing::Describe;

// gRPC 1.51 as Debian builds it (no background iomgr) serves the client callback API
// (ForwardAsync / ForwardFuture) from one process-wide completion queue, torn down whenever
// the last channel that used it is destroyed; that teardown races with the queue's own polling
// threads (ASan sees a double free in grpc_cq_internal_unref about every other run of this
// binary). A channel that has made one callback call and is never destroyed keeps the queue
// alive, so the teardown never runs while tests create and destroy clients.
class KeepCallbackQueueAlive : public ::testing::Environment {
 public:
  void SetUp() override {
    ClientOptions options;
    options.target = "127.0.0.1:1";  // nothing listens there: the call fails at once
    options.timeout = std::chrono::milliseconds(2000);
    static Client* const keeper = new Client(options);  // never destroyed, on purpose
    std::promise<void> done;
    keeper->ForwardAsync(v1::ForwardRequest(), [&done](grpc::Status, v1::ForwardResponse) { done.set_value(); });
    done.get_future().wait();
  }
};
[[maybe_unused]] ::testing::Environment* const kKeepCallbackQueueAlive =
    ::testing::AddGlobalTestEnvironment(new KeepCallbackQueueAlive);

// One server for the tests that do not need their own flags.
class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    server_ = ServerProcess::Start(ATTNSERVE_BINARY,
                                   {"--threads", "2", "--admin-token", testing::kTestAdminToken, "--model-dir",
                                    std::string(ATTNSERVE_TEST_DATA_DIR), "--model-dir",
                                    std::filesystem::temp_directory_path().string(), "--layer",
                                    std::string(kSmall.name) + "=" + kSmall.Source(),
                                    "--layer", std::string(kGqa.name) + "=" + kGqa.Source(), "--layer",
                                    std::string(kFactoredOnly.name) + "=" + kFactoredOnly.Source()},
                                   &error);
    if (!server_) start_error_ = new std::string(error);
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override {
    if (!server_) GTEST_FAIL() << "the server did not start: " << *start_error_;
  }
  // After each test: the server still answers.
  void TearDown() override {
    if (!server_) return;
    bool serving = false;
    EXPECT_TRUE(server_->client().Health("", &serving).ok() && serving) << server_->Log();
  }
  Client& client() { return server_->client(); }

  static std::unique_ptr<ServerProcess> server_;
  static std::string* start_error_;
};
std::unique_ptr<ServerProcess> ServerTest::server_;
std::string* ServerTest::start_error_ = nullptr;

TEST_F(ServerTest, EveryFormMatchesTheFloat64Reference) {
  std::mt19937_64 rng(42);
  for (const RandomLayer* layer : {&kSmall, &kGqa}) {
    const LayerWeights w = layer->Weights();
    const int64_t d = layer->d_model;
    struct Case {
      int64_t batch, n, m;
      bool cross, causal;
      std::vector<int32_t> key_lengths;
    };
    const std::vector<Case> cases = {{1, 7, 7, false, false, {}},    {3, 5, 5, false, true, {}},
                                     {2, 4, 9, true, false, {}},     {3, 6, 6, false, false, {6, 2, 1}},
                                     {2, 8, 8, false, true, {5, 8}}, {2, 3, 11, true, false, {11, 4}},
                                     {1, 1, 1, false, false, {}}};
    for (const Case& c : cases) {
      const std::vector<float> input = RandomFloats(rng, c.batch * c.n * d);
      const std::vector<float> context = c.cross ? RandomFloats(rng, c.batch * c.m * d) : std::vector<float>();
      const std::vector<double> want =
          Reference(w, input, c.batch, c.n, c.cross ? &context : nullptr, c.m, c.causal, c.key_lengths);
      for (v1::Form form : {v1::FORM_UNSPECIFIED, v1::FORM_FACTORED, v1::FORM_SUMMED}) {
        v1::ForwardRequest req = Request(layer->name, input, {c.batch, c.n, d}, form);
        if (c.cross) *req.mutable_context() = MakeTensor(context, {c.batch, c.m, d});
        req.set_causal(c.causal);
        for (int32_t len : c.key_lengths) req.add_key_lengths(len);
        v1::ForwardResponse resp;
        const grpc::Status st = client().Forward(req, &resp);
        ASSERT_TRUE(st.ok()) << Describe(st);
        const std::string what = std::string(layer->name) + " " + v1::Form_Name(form) +
                                 " batch=" + std::to_string(c.batch) + " n=" + std::to_string(c.n) +
                                 " m=" + std::to_string(c.m);
        EXPECT_EQ(resp.form(), form == v1::FORM_UNSPECIFIED ? v1::FORM_FACTORED : form) << what;
        EXPECT_EQ(resp.output().dtype(), v1::DATA_TYPE_FLOAT32);
        EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(c.batch, c.n, d)) << what;
        EXPECT_LT(RelativeL2(Output(resp), want), kTolerance) << what;
        EXPECT_EQ(resp.batch_requests(), 1);
        EXPECT_GE(resp.queue_us(), 0);
        EXPECT_GE(resp.compute_us(), 0);
        EXPECT_TRUE(resp.divergence().empty());
      }
    }
  }
}

TEST_F(ServerTest, CompareReportsTheOtherFormsDivergence) {
  std::mt19937_64 rng(7);
  const LayerWeights w = kSmall.Weights();
  const std::vector<float> input = RandomFloats(rng, 2 * 9 * 64);
  for (v1::Form served : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    v1::ForwardRequest req = Request("small", input, {2, 9, 64}, served);
    req.set_compare(true);
    req.set_causal(true);
    v1::ForwardResponse resp;
    const grpc::Status st = client().Forward(req, &resp);
    ASSERT_TRUE(st.ok()) << Describe(st);
    EXPECT_EQ(resp.form(), served);
    EXPECT_LT(RelativeL2(Output(resp), Reference(w, input, 2, 9, nullptr, 0, true)), kTolerance);
    ASSERT_EQ(resp.divergence_size(), 1);
    const v1::Divergence& d = resp.divergence(0);
    EXPECT_EQ(d.form(), served == v1::FORM_FACTORED ? v1::FORM_SUMMED : v1::FORM_FACTORED);
    // Equal in exact arithmetic; in float32 close but not bit-identical: a server comparing a
    // form with itself would report 0.
    EXPECT_LT(d.rel_l2(), 2 * kTolerance);
    EXPECT_GT(d.rel_l2(), 0);
    EXPECT_GT(d.max_abs(), 0);
    EXPECT_LT(d.max_abs(), 1e-3);
    // And it is the distance to what the other form answers on its own (same shapes, same
    // kernels: the same floats), measured here.
    v1::ForwardRequest alone = req;
    alone.set_form(d.form());
    alone.set_compare(false);
    v1::ForwardResponse other;
    ASSERT_TRUE(client().Forward(alone, &other).ok());
    const std::vector<float> a = Output(resp), b = Output(other);
    double num = 0, den = 0, max_abs = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double e = static_cast<double>(b[i]) - a[i];
      num += e * e;
      den += static_cast<double>(a[i]) * a[i];
      max_abs = std::max(max_abs, std::abs(e));
    }
    EXPECT_NEAR(d.rel_l2(), std::sqrt(num / den), 1e-3 * std::sqrt(num / den));
    EXPECT_NEAR(d.max_abs(), max_abs, 1e-3 * max_abs);
  }
  // A layer holding one form has nothing to compare with.
  v1::ForwardRequest req = Request("factored-only", RandomFloats(rng, 32), {1, 1, 32});
  req.set_compare(true);
  v1::ForwardResponse resp;
  ASSERT_TRUE(client().Forward(req, &resp).ok());
  EXPECT_TRUE(resp.divergence().empty());
}

// IEEE binary16 / bfloat16 encodings by rounding to nearest even, for inputs built here.
uint16_t ToHalf(float f) {
  // Exact for the values used: multiples of 1/64 in [-4, 4] (binary16 holds them exactly).
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  if (f == 0) return static_cast<uint16_t>(sign);
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  const uint32_t mant = (x >> 13) & 0x3ffu;
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | mant);
}
uint16_t ToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return static_cast<uint16_t>(x >> 16);  // exact for values with <= 8 significant bits
}

TEST_F(ServerTest, HalfPrecisionInputsAreConvertedOnArrival) {
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int> q(-256, 256);
  std::vector<float> input(2 * 5 * 64);
  for (float& x : input) x = static_cast<float>(q(rng)) / 64.0f;  // exact in both dtypes
  const std::vector<double> want = Reference(kSmall.Weights(), input, 2, 5);
  for (v1::DataType dtype : {v1::DATA_TYPE_FLOAT16, v1::DATA_TYPE_BFLOAT16}) {
    std::string bytes;
    for (float x : input) {
      const uint16_t h = dtype == v1::DATA_TYPE_FLOAT16 ? ToHalf(x) : ToBFloat16(x);
      bytes.append(reinterpret_cast<const char*>(&h), 2);
    }
    v1::ForwardRequest req;
    req.set_layer("small");
    req.mutable_input()->set_dtype(dtype);
    for (int64_t s : {2, 5, 64}) req.mutable_input()->add_shape(s);
    req.mutable_input()->set_data(bytes);
    v1::ForwardResponse resp;
    const grpc::Status st = client().Forward(req, &resp);
    ASSERT_TRUE(st.ok()) << Describe(st);
    EXPECT_EQ(resp.output().dtype(), v1::DATA_TYPE_FLOAT32);
    EXPECT_LT(RelativeL2(Output(resp), want), kTolerance) << v1::DataType_Name(dtype);
  }
}

// Every bad request: its code and the words its message must hold.
TEST_F(ServerTest, BadInputsYieldTheirCodeAndNameTheField) {
  std::mt19937_64 rng(5);
  const std::vector<float> good = RandomFloats(rng, 2 * 3 * 64);
  struct Bad {
    std::string what;
    v1::ForwardRequest req;
    grpc::StatusCode code;
    std::vector<std::string> words;
  };
  std::vector<Bad> bad;
  auto base = [&] { return Request("small", good, {2, 3, 64}); };
  {
    auto r = base();
    *r.mutable_input() = MakeTensor(good, {6, 64});
    bad.push_back({"rank 2", r, grpc::INVALID_ARGUMENT, {"input.shape", "rank 3", "got [6, 64]"}});
  }
  {
    auto r = base();
    *r.mutable_input() = MakeTensor(good, {2, 6, 32});
    bad.push_back({"d_model", r, grpc::INVALID_ARGUMENT, {"input.shape[2] (d_model)", "expected 64", "got 32"}});
  }
  {
    auto r = base();
    r.mutable_input()->mutable_data()->resize(100);
    bad.push_back({"byte length", r, grpc::INVALID_ARGUMENT, {"input.data", "expected 1536 bytes", "got 100"}});
  }
  {
    auto r = base();
    r.mutable_input()->set_shape(1, -3);
    bad.push_back({"negative dim", r, grpc::INVALID_ARGUMENT, {"input.shape[1] (n)", ">= 1", "got -3"}});
  }
  {
    auto r = base();
    r.mutable_input()->set_shape(0, int64_t{1} << 40);
    r.mutable_input()->set_shape(1, int64_t{1} << 40);
    bad.push_back({"overflow", r, grpc::INVALID_ARGUMENT, {"input.shape", "overflows"}});
  }
  {
    auto r = base();
    const float nan = std::nanf("");
    std::memcpy(r.mutable_input()->mutable_data()->data() + 4 * 70, &nan, 4);
    bad.push_back({"nan", r, grpc::INVALID_ARGUMENT, {"input.data", "finite", "at [0, 1, 6]"}});
  }
  {
    auto r = base();
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(r.mutable_input()->mutable_data()->data() + 4 * 200, &inf, 4);
    bad.push_back({"inf", r, grpc::INVALID_ARGUMENT, {"input.data", "finite"}});
  }
  {
    auto r = base();
    r.add_key_lengths(3);
    bad.push_back({"key_lengths count", r, grpc::INVALID_ARGUMENT, {"key_lengths", "expected 2 values", "got 1"}});
  }
  {
    auto r = base();
    r.add_key_lengths(3);
    r.add_key_lengths(4);
    bad.push_back({"key_length > m", r, grpc::INVALID_ARGUMENT, {"key_lengths[1]", "[1, 3]", "got 4"}});
  }
  {
    auto r = base();
    r.add_key_lengths(0);
    r.add_key_lengths(1);
    bad.push_back({"key_length 0", r, grpc::INVALID_ARGUMENT, {"key_lengths[0]", "got 0"}});
  }
  {
    auto r = base();
    *r.mutable_context() = MakeTensor(RandomFloats(rng, 3 * 4 * 64), {3, 4, 64});
    bad.push_back({"context batch", r, grpc::INVALID_ARGUMENT, {"context.shape[0] (batch)", "expected 2", "got 3"}});
  }
  {
    auto r = base();
    *r.mutable_context() = MakeTensor(RandomFloats(rng, 2 * 4 * 16), {2, 4, 16});
    bad.push_back({"context d_model", r, grpc::INVALID_ARGUMENT, {"context.shape[2] (d_model)", "got 16"}});
  }
  {
    auto r = base();
    r.set_form(static_cast<v1::Form>(7));
    bad.push_back({"form enum", r, grpc::INVALID_ARGUMENT, {"form", "got 7"}});
  }
  {
    auto r = base();
    r.mutable_input()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
    bad.push_back(
        {"dtype unspecified", r, grpc::INVALID_ARGUMENT, {"input.dtype", "FLOAT32", "DATA_TYPE_UNSPECIFIED"}});
  }
  {
    auto r = base();
    r.mutable_input()->set_dtype(static_cast<v1::DataType>(9));
    bad.push_back({"dtype unknown", r, grpc::INVALID_ARGUMENT, {"input.dtype", "got 9"}});
  }
  {
    auto r = base();
    r.clear_input();
    bad.push_back({"no input", r, grpc::INVALID_ARGUMENT, {"input", "got none"}});
  }
  {
    auto r = base();
    r.set_layer("nope");
    bad.push_back({"unknown layer", r, grpc::NOT_FOUND, {"layer", "'nope'", "small"}});
  }
  {
    auto r = base();
    r.set_layer("");
    bad.push_back({"empty layer", r, grpc::INVALID_ARGUMENT, {"layer", "empty"}});
  }
  {
    auto r = Request("factored-only", RandomFloats(rng, 32), {1, 1, 32}, v1::FORM_SUMMED);
    bad.push_back({"form not held", r, grpc::FAILED_PRECONDITION, {"form", "summed", "factored-only"}});
  }
  {
    auto r = Request("small", good, {2, 3, 64}, v1::FORM_LOWRANK);
    bad.push_back({"lowrank not held", r, grpc::FAILED_PRECONDITION, {"lowrank"}});
  }
  for (const Bad& b : bad) {
    v1::ForwardResponse resp;
    const grpc::Status st = client().Forward(b.req, &resp);
    EXPECT_EQ(st.error_code(), b.code) << b.what << ": " << Describe(st);
    for (const std::string& word : b.words) EXPECT_THAT(st.error_message(), HasSubstr(word)) << b.what;
    // ...and the server still answers a good request.
    v1::ForwardResponse ok;
    ASSERT_TRUE(client().Forward(base(), &ok).ok()) << "after " << b.what << "\n" << server_->Log();
  }
}

TEST_F(ServerTest, LayerInfo) {
  std::vector<v1::LayerInfo> layers;
  ASSERT_TRUE(client().ListLayers(&layers).ok());
  std::vector<std::string> names;
  for (const auto& l : layers) names.push_back(l.name());
  EXPECT_THAT(names, ::testing::IsSupersetOf({"small", "gqa", "factored-only"}));

  v1::LayerInfo info;
  ASSERT_TRUE(client().GetLayer("gqa", &info).ok());
  EXPECT_EQ(info.name(), "gqa");
  EXPECT_EQ(info.source(), kGqa.Source());
  EXPECT_EQ(info.config().d_model(), 48);
  EXPECT_EQ(info.config().heads(), 6);
  EXPECT_EQ(info.config().kv_heads(), 2);
  EXPECT_EQ(info.config().d_head(), 12);
  EXPECT_TRUE(info.config().bias());
  EXPECT_FLOAT_EQ(info.config().scale(), 1.0f / std::sqrt(12.0f));
  ASSERT_EQ(info.forms_size(), 2);
  // Parameter counts from the definitions (docs/architecture.md §1), d = 48, h = 6, h_kv = 2, d_h = 12.
  const int64_t d = 48, q = 6 * 12, kv = 2 * 12;
  const int64_t factored = d * q + 2 * d * kv + q * d + (q + 2 * kv + d);
  const int64_t summed = d * (q + kv) + d * 6 * d + (q + kv) + d;
  std::map<v1::Form, v1::FormInfo> forms;
  for (const auto& f : info.forms()) forms[f.form()] = f;
  ASSERT_TRUE(forms.count(v1::FORM_FACTORED) && forms.count(v1::FORM_SUMMED));
  EXPECT_EQ(forms[v1::FORM_FACTORED].parameters(), factored);
  EXPECT_EQ(forms[v1::FORM_SUMMED].parameters(), summed);
  // The bytes are the weights and, on a CPU with AVX2 and FMA, their packed copy
  // (--cpu-weight-layout auto): [rows, cols] matrices in whole panels of 64 columns on AVX-512,
  // 16 on AVX2 (server/backend/cpu/packed_weights.h). Factored: W_in [d, q + 2kv], W_O [q, d];
  // summed: W_in [d, q + kv + h·d].
  const char* cap = std::getenv("ATTNSERVE_CPU_ISA");
  const bool capped = cap != nullptr && std::string(cap) == "avx2";
  const int64_t panel = !capped && __builtin_cpu_supports("avx512f")                         ? 64
                        : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 16
                                                                                          : 0;
  const auto packed_floats = [&](int64_t rows, int64_t cols) {
    return panel == 0 ? 0 : rows * ((cols + panel - 1) / panel) * panel;
  };
  const std::map<v1::Form, int64_t> packed = {
      {v1::FORM_FACTORED, packed_floats(d, q + 2 * kv) + packed_floats(q, d)},
      {v1::FORM_SUMMED, packed_floats(d, q + kv + 6 * d)}};
  for (auto& [form, f] : forms) {
    EXPECT_EQ(f.bytes(), 4 * (f.parameters() + packed.at(form))) << "panel width " << panel;
    EXPECT_EQ(f.device(), "cpu");
    EXPECT_EQ(f.flops_reference_length(), 128);
    EXPECT_GT(f.flops_per_token(), 0);
  }
  EXPECT_GT(forms[v1::FORM_SUMMED].flops_per_token(), forms[v1::FORM_FACTORED].flops_per_token());

  const grpc::Status missing = client().GetLayer("nope", &info);
  EXPECT_EQ(missing.error_code(), grpc::NOT_FOUND);
  EXPECT_THAT(missing.error_message(), HasSubstr("'nope'"));
}

TEST_F(ServerTest, LoadAndUnloadWhileForwardCallsRun) {
  const RandomLayer hot{"hot", 32, 4, 0, 0, 17, true};
  const LayerWeights w = hot.Weights();
  ASSERT_TRUE(client().LoadLayer("hot", hot.Source(), nullptr).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, not_found{0};
  std::vector<std::string> unexpected;
  std::mutex mu;
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      while (!stop) {
        const std::vector<float> input = RandomFloats(rng, 2 * 6 * 32);
        v1::ForwardRequest req = Request("hot", input, {2, 6, 32}, t % 2 ? v1::FORM_SUMMED : v1::FORM_FACTORED);
        v1::ForwardResponse resp;
        const grpc::Status st = client().Forward(req, &resp);
        if (st.ok()) {
          ++ok;
          const double err = RelativeL2(Output(resp), Reference(w, input, 2, 6));
          if (err > kTolerance) {
            std::lock_guard<std::mutex> lock(mu);
            unexpected.push_back("wrong output, relative error " + std::to_string(err));
          }
        } else if (st.error_code() == grpc::NOT_FOUND) {
          ++not_found;
        } else {
          std::lock_guard<std::mutex> lock(mu);
          unexpected.push_back(Describe(st));
        }
      }
    });
  }
  for (int round = 0; round < 15; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(client().UnloadLayer("hot").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    v1::LayerInfo info;
    EXPECT_TRUE(client().LoadLayer("hot", hot.Source(), &info).ok());
    EXPECT_EQ(info.name(), "hot");
  }
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_TRUE(unexpected.empty()) << unexpected.size()
                                  << " unexpected results, first: " << (unexpected.empty() ? "" : unexpected[0]);
  EXPECT_GT(ok.load(), 0);
  // Once unloaded for good, the layer is NOT_FOUND.
  ASSERT_TRUE(client().UnloadLayer("hot").ok());
  v1::ForwardResponse resp;
  EXPECT_EQ(client().Forward(Request("hot", std::vector<float>(32), {1, 1, 32}), &resp).error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(client().UnloadLayer("hot").error_code(), grpc::NOT_FOUND);
  std::cout << "[ info ] " << ok << " Forward calls answered, " << not_found << " NOT_FOUND during unloads\n";
}

// The checkpoint layouts of tests/data/torch-mha, loaded through LoadLayer, against the
// vectors PyTorch computed (tests/data/torch-mha/README.md).
TEST_F(ServerTest, CheckpointLayoutsLoadFromFilesAndMatchPyTorch) {
  const std::string dir = std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch-mha/";
  std::ifstream manifest_file(dir + "manifest.json");
  ASSERT_TRUE(manifest_file.good());
  const nlohmann::json manifest = nlohmann::json::parse(manifest_file);
  const nlohmann::json& small = manifest["layers"]["small"];
  StatusOr<SafetensorsFile> cases = ReadSafetensors(dir + "small.cases.safetensors");
  ASSERT_TRUE(cases.ok()) << cases.status().ToString();
  const int64_t d = small["d_model"].get<int64_t>();
  const std::string heads = std::to_string(small["heads"].get<int64_t>());
  int checked = 0;
  for (const char* layout : {"torch-mha", "gpt2", "bert"}) {
    const std::string name = std::string("ckpt-") + layout;
    const std::string source = "safetensors:" + dir + "small." + layout + ".safetensors,heads=" + heads;
    v1::LayerInfo info;
    const grpc::Status load = client().LoadLayer(name, source, &info);
    ASSERT_TRUE(load.ok()) << layout << ": " << Describe(load);
    EXPECT_EQ(info.config().d_model(), d);
    for (const auto& c : small["cases"]) {
      const std::string case_name = c["name"].get<std::string>();
      StatusOr<FloatTensor> input = cases->ReadFloat(case_name + ".input");
      StatusOr<FloatTensor> want = cases->ReadFloat(case_name + ".output");
      ASSERT_TRUE(input.ok() && want.ok()) << case_name;
      for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
        v1::ForwardRequest req = Request(name, input->values, input->shape, form);
        if (c["has_context"].get<bool>()) {
          StatusOr<FloatTensor> context = cases->ReadFloat(case_name + ".context");
          ASSERT_TRUE(context.ok());
          *req.mutable_context() = MakeTensor(context->values, context->shape);
        }
        req.set_causal(c["causal"].get<bool>());
        if (!c["key_lengths"].is_null()) {
          for (const auto& len : c["key_lengths"]) req.add_key_lengths(len.get<int32_t>());
        }
        v1::ForwardResponse resp;
        const grpc::Status st = client().Forward(req, &resp);
        ASSERT_TRUE(st.ok()) << layout << " " << case_name << ": " << Describe(st);
        const std::vector<double> want64(want->values.begin(), want->values.end());
        EXPECT_LT(RelativeL2(Output(resp), want64), 2e-5) << layout << " " << case_name << " " << v1::Form_Name(form);
        ++checked;
      }
    }
    EXPECT_TRUE(client().UnloadLayer(name).ok());
  }
  EXPECT_GE(checked, 3 * 2 * 4);
}

TEST_F(ServerTest, CorruptCheckpointIsRefusedAndTheServerKeepsServing) {
  TempDir tmp;
  const std::string good = std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch-mha/small.gpt2.safetensors";
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 1000u);
  struct Corrupt {
    std::string what, contents, says;  // `says`: the reader's own words for what is wrong
  };
  std::string bad_header = bytes;
  bad_header[10] = '\x01';  // inside the JSON header
  const std::vector<Corrupt> corrupt = {
      {"truncated", bytes.substr(0, bytes.size() / 2), "reach past the data region"},
      {"garbage", std::string(4096, '\x7f'), "not a safetensors file: its header length field exceeds the limit"},
      {"empty", "", "truncated: 0 bytes"},
      {"bad header", bad_header, "header is not valid JSON"}};
  for (const Corrupt& c : corrupt) {
    const std::string path = tmp.File(c.what + ".safetensors");
    std::ofstream(path, std::ios::binary) << c.contents;
    const grpc::Status st = client().LoadLayer("corrupt", "safetensors:" + path + ",heads=4", nullptr);
    EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << c.what << ": " << Describe(st);
    EXPECT_THAT(st.error_message(), HasSubstr(c.says)) << c.what;
    // Named relative to its model dir: no server path in the answer.
    EXPECT_THAT(st.error_message(), HasSubstr(c.what + ".safetensors")) << c.what;
    EXPECT_THAT(st.error_message(), Not(HasSubstr(std::filesystem::temp_directory_path().string() + "/")));
    v1::LayerInfo info;
    EXPECT_EQ(client().GetLayer("corrupt", &info).error_code(), grpc::NOT_FOUND) << c.what;
  }
  const grpc::Status missing =
      client().LoadLayer("corrupt", "safetensors:" + tmp.File("absent.safetensors") + ",heads=4", nullptr);
  EXPECT_EQ(missing.error_code(), grpc::NOT_FOUND) << Describe(missing);
  const grpc::Status bad_source = client().LoadLayer("corrupt", "random:d_model=8", nullptr);
  EXPECT_EQ(bad_source.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(bad_source.error_message(), HasSubstr("heads"));
  const grpc::Status bad_name = client().LoadLayer("bad name", "random:d_model=8,heads=2", nullptr);
  EXPECT_EQ(bad_name.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(bad_name.error_message(), HasSubstr("name"));
  std::mt19937_64 rng(1);
  v1::ForwardResponse resp;
  EXPECT_TRUE(client().Forward(Request("small", RandomFloats(rng, 64), {1, 1, 64}), &resp).ok());
}

TEST_F(ServerTest, HealthOfBothServiceNames) {
  ServingStatus status;
  ASSERT_TRUE(client().HealthStatus("", &status).ok());
  EXPECT_EQ(status, ServingStatus::kServing);
  ASSERT_TRUE(client().HealthStatus("attnserve.v1.AttentionService", &status).ok());
  EXPECT_EQ(status, ServingStatus::kServing);
  EXPECT_EQ(client().HealthStatus("no.such.Service", &status).error_code(), grpc::NOT_FOUND);
}

// Waits for one completion-queue event and checks it is `tag` and succeeded.
bool Next(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  return cq.Next(&got, &ok) && ok && got == tag;
}

TEST_F(ServerTest, ReflectionListsTheService) {
  // grpc.reflection.v1alpha.ServerReflectionRequest{list_services: ""}: field 7, length 0.
  // Raw bytes through the generic stub: the reflection protos are not installed as headers.
  grpc::GenericStub stub(client().channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  int tags[5];
  call->StartCall(&tags[0]);
  ASSERT_TRUE(Next(cq, &tags[0]));
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer buffer(&slice, 1);
  call->Write(buffer, &tags[1]);
  ASSERT_TRUE(Next(cq, &tags[1]));
  grpc::ByteBuffer reply;
  call->Read(&reply, &tags[2]);
  ASSERT_TRUE(Next(cq, &tags[2]));
  call->WritesDone(&tags[3]);
  ASSERT_TRUE(Next(cq, &tags[3]));
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  ASSERT_TRUE(Next(cq, &tags[4]));
  EXPECT_TRUE(status.ok()) << Describe(status);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string text;
  for (const auto& s : slices) text.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_THAT(text, HasSubstr("attnserve.v1.AttentionService"));
  EXPECT_THAT(text, HasSubstr("grpc.health.v1.Health"));
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_F(ServerTest, NpyRoundTripThroughTheCli) {
  TempDir tmp;
  std::mt19937_64 rng(11);
  NpyArray x;
  x.shape = {2, 5, 64};
  x.data = RandomFloats(rng, 2 * 5 * 64);
  ASSERT_TRUE(WriteNpy(tmp.File("x.npy"), x).ok());
  std::string output;
  const int rc = testing::RunToExit(ATTNSERVE_CLI_BINARY,
                                    {"--target", server_->target(), "forward", "--layer", "small", "--form", "summed",
                                     "--causal", "--input", tmp.File("x.npy"), "--output", tmp.File("y.npy")},
                                    &output);
  ASSERT_EQ(rc, 0) << output;
  NpyArray y;
  ASSERT_TRUE(ReadNpy(tmp.File("y.npy"), &y).ok());
  EXPECT_EQ(y.shape, x.shape);
  EXPECT_LT(RelativeL2(y.data, Reference(kSmall.Weights(), x.data, 2, 5, nullptr, 0, true)), kTolerance);
  // A wrong d_model comes back as the server's error, exit status 1.
  x.shape = {1, 5, 128};
  ASSERT_TRUE(WriteNpy(tmp.File("bad.npy"), x).ok());
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_CLI_BINARY,
                               {"--target", server_->target(), "forward", "--layer", "small", "--input",
                                tmp.File("bad.npy"), "--output", tmp.File("z.npy")},
                               &output),
            1);
  EXPECT_THAT(output, AllOf(HasSubstr("INVALID_ARGUMENT"), HasSubstr("d_model")));
}

// ---------------------------------------------------------------------------------------------
// Servers with their own flags.

std::unique_ptr<ServerProcess> StartOrFail(const std::vector<std::string>& args) {
  std::string error;
  auto server = ServerProcess::Start(ATTNSERVE_BINARY, args, &error);
  EXPECT_NE(server, nullptr) << error;
  return server;
}

TEST(ServerFlagsTest, MessageLimitJustUnderPassesJustOverIsResourceExhausted) {
  auto server = StartOrFail({"--max-message-mb", "1", "--layer", "tiny=random:d_model=64,heads=4,seed=2"});
  ASSERT_NE(server, nullptr);
  std::mt19937_64 rng(2);
  // 4094 rows of one token: 1 048 064 bytes of data plus ~20 bytes of framing < 1 MiB.
  const std::vector<float> under = RandomFloats(rng, 4094 * 64);
  v1::ForwardRequest req = Request("tiny", under, {4094, 1, 64});
  ASSERT_LT(req.ByteSizeLong(), size_t{1} << 20);
  ASSERT_GT(req.ByteSizeLong(), (size_t{1} << 20) - 1024);
  v1::ForwardResponse resp;
  grpc::Status st = server->client().Forward(req, &resp);
  ASSERT_TRUE(st.ok()) << Describe(st);
  EXPECT_EQ(Output(resp).size(), under.size());

  const std::vector<float> over = RandomFloats(rng, 4097 * 64);
  req = Request("tiny", over, {4097, 1, 64});
  ASSERT_GT(req.ByteSizeLong(), size_t{1} << 20);
  st = server->client().Forward(req, &resp);
  EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(st);
  // ...and the server still serves.
  EXPECT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 64), {1, 1, 64}), &resp).ok());
}

TEST(ServerFlagsTest, AttentionWorkIsBoundedPerRequest) {
  // d_model 64, 4 heads: 2 sequences of n = m = 256 ask for 0.52 M scores; 1 of 512, 1.05 M.
  auto server = StartOrFail({"--max-scores-m", "1", "--layer", "tiny=random:d_model=64,heads=4,seed=2"});
  ASSERT_NE(server, nullptr);
  std::mt19937_64 rng(4);
  v1::ForwardResponse resp;
  grpc::Status st = server->client().Forward(Request("tiny", RandomFloats(rng, 2 * 256 * 64), {2, 256, 64}), &resp);
  EXPECT_TRUE(st.ok()) << Describe(st);
  st = server->client().Forward(Request("tiny", RandomFloats(rng, 512 * 64), {1, 512, 64}), &resp);
  EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(st);
  EXPECT_THAT(st.error_message(), AllOf(HasSubstr("n=512"), HasSubstr("--max-scores-m")));
}

// --cpu-weight-layout packed-bf16 (docs/service.md): a served answer of either form is float64's
// within bfloat16's rounding of the weights, the forms' divergence (compare) shows that rounding,
// and GetLayer counts the panels at two bytes a weight. Where the backend's own kernel cannot run,
// the server refuses the flag at startup with the reason.
TEST(ServerFlagsTest, Bfloat16PanelsServeWithinTheirRoundingAndCountHalfTheBytes) {
  const bool kernel = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const RandomLayer layer{"bf", 128, 2, 0, 0, 11, true};
  const std::vector<std::string> args = {"--cpu-weight-layout", "packed-bf16", "--layer",
                                         std::string(layer.name) + "=" + layer.Source()};
  if (!kernel) {
    std::string error;
    EXPECT_EQ(ServerProcess::Start(ATTNSERVE_BINARY, args, &error), nullptr);
    EXPECT_THAT(error, HasSubstr("packed-bf16 asked, but the backend's own GEMM kernel cannot run here"));
    return;
  }
  auto server = StartOrFail(args);
  ASSERT_NE(server, nullptr);
  const LayerWeights w = layer.Weights();
  std::mt19937_64 rng(12);
  for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    const std::vector<float> input = RandomFloats(rng, 2 * 16 * 128);
    v1::ForwardRequest req = Request("bf", input, {2, 16, 128}, form);
    req.set_compare(true);
    v1::ForwardResponse resp;
    const grpc::Status st = server->client().Forward(req, &resp);
    ASSERT_TRUE(st.ok()) << Describe(st);
    const double error = RelativeL2(Output(resp), Reference(w, input, 2, 16));
    EXPECT_LT(error, 1e-2) << "bfloat16 keeps 8 bits of each weight's mantissa";
    EXPECT_GT(error, 10 * kTolerance) << "float32's error: were the weights rounded?";
    ASSERT_EQ(resp.divergence_size(), 1);
    EXPECT_GT(resp.divergence(0).rel_l2(), 10 * kTolerance) << "each form rounds its own weights";
    EXPECT_LT(resp.divergence(0).rel_l2(), 2e-2);
  }
  v1::LayerInfo info;
  ASSERT_TRUE(server->client().GetLayer("bf", &info).ok());
  for (const auto& f : info.forms()) {
    // d = 128, 2 heads of 64: whole panels at either width (64 or 16), so the packed copy is each
    // weight matrix once, at 2 bytes. Factored: W_in [d, 3d], W_O [d, d]; summed: W_in [d, 2d + 2d].
    const int64_t d = 128, matrix_weights = 4 * d * d;
    EXPECT_EQ(f.bytes(), 4 * f.parameters() + 2 * matrix_weights) << v1::Form_Name(f.form());
  }
}

// The CPU backend's helper threads (ComputeTeam, named "compute") sleep between requests once
// their idle spin is over: with --cpu-idle-spin-us 0 at once, with the default after 500 µs.
// An idle server then uses no CPU, and a request after the pause is served.
TEST(ServerFlagsTest, ComputeThreadsSleepBetweenRequests) {
  for (const char* spin : {"0", "500"}) {
    auto server = StartOrFail({"--threads", "2", "--cpu-idle-spin-us", spin, "--layer",
                               "tiny=random:d_model=64,heads=4,seed=2"});
    ASSERT_NE(server, nullptr);
    std::mt19937_64 rng(3);
    v1::ForwardResponse resp;
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 4 * 64), {1, 4, 64}), &resp).ok());
    }
    EXPECT_THAT(server->Log(), HasSubstr("idle spin " + std::string(spin) + " µs"));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::vector<std::filesystem::path> helpers = NamedThreads(std::to_string(server->pid()), "compute");
    EXPECT_EQ(helpers.size(), 1u) << "--threads 2: the batch worker and one helper";
    const int64_t before = ThreadsCpuNs(helpers);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const int64_t idle_ns = ThreadsCpuNs(helpers) - before;
    EXPECT_LT(idle_ns, 3'000'000) << "--cpu-idle-spin-us " << spin << ": the idle helper ran " << idle_ns
                                  << " ns in 0.3 s";
    EXPECT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 4 * 64), {1, 4, 64}), &resp).ok());
  }
}

// --worker-idle-spin-us reaches the batcher: after a request its worker spins that long, then
// sleeps (a spin of 0.2 s to see it; 0 sleeps at once).
TEST(ServerFlagsTest, TheBatchWorkerSpinsAsLongAsToldThenSleeps) {
  for (const char* spin : {"200000", "0"}) {
    auto server = StartOrFail({"--threads", "1", "--worker-idle-spin-us", spin, "--layer",
                               "tiny=random:d_model=64,heads=4,seed=2"});
    ASSERT_NE(server, nullptr);
    std::mt19937_64 rng(4);
    v1::ForwardResponse resp;
    EXPECT_THAT(server->Log(), HasSubstr("1 workers spinning " + std::string(spin) + " us when idle"));
    const std::vector<std::filesystem::path> worker = NamedThreads(std::to_string(server->pid()), "batch-worker");
    EXPECT_EQ(worker.size(), 1u);
    const int64_t before = ThreadsCpuNs(worker);
    ASSERT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 4 * 64), {1, 4, 64}), &resp).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    const int64_t after_spin = ThreadsCpuNs(worker);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const int64_t idle_ns = ThreadsCpuNs(worker) - after_spin;
    if (std::string(spin) == "0") {
      EXPECT_LT(after_spin - before, 20'000'000) << "--worker-idle-spin-us 0: the worker spun";
    } else {
      EXPECT_GT(after_spin - before, 40'000'000) << "--worker-idle-spin-us 200000: the worker did not spin";
    }
    EXPECT_LT(idle_ns, 3'000'000) << "--worker-idle-spin-us " << spin << ": the idle worker ran " << idle_ns
                                  << " ns in 0.3 s";
  }
}

// A served call ends on the thread that answers it: gRPC runs the reactor's OnDone there
// (ForwardReactor::InternalInlineable) instead of waking its executor thread for it, a hand-off
// that cost a lone call about 40 µs on a 2-vCPU host (docs/journal/benchmarks-journal.md,
// "OnDone without the executor, and the queue's lock taken spinning"). Counted from /proc: how often the server's executor threads (gRPC names them
// "default-executo") were given a CPU over 50 calls in a row, at least once a call with the
// hand-off. gRPC also gives its executor work of its own when its threads contend, as they do
// when the cores are loaded: this test runs alone (tests/CMakeLists.txt, ALONE), and the least
// of three tries counts. The bound is half the calls: with the hand-off (InternalInlineable
// false) the executor ran 49–50 times in 50 calls; without it, none on a quiet machine, and up
// to 19 with two busy loops at idle priority beside the ASan server (a quarter of the calls,
// the bound until 2026-12-07, failed there).
TEST(ServingPathTest, ACallEndsWithoutWakingGrpcsExecutor) {
  auto server = StartOrFail({"--threads", "1", "--layer", "tiny=random:d_model=64,heads=4,seed=2"});
  ASSERT_NE(server, nullptr);
  std::mt19937_64 rng(6);
  v1::ForwardResponse resp;
  for (int i = 0; i < 10; ++i) {  // gRPC's threads as they are once calls flow
    ASSERT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 4 * 64), {1, 4, 64}), &resp).ok());
  }
  const std::vector<std::filesystem::path> executor = NamedThreads(std::to_string(server->pid()), "default-executo");
  ASSERT_FALSE(executor.empty()) << "no gRPC executor thread in the server: gRPC's threads changed, so this test "
                                    "no longer sees the hand-off it guards against";
  constexpr int kCalls = 50;
  int64_t fewest = std::numeric_limits<int64_t>::max();
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int64_t before = ThreadsRuns(executor);
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(server->client().Forward(Request("tiny", RandomFloats(rng, 4 * 64), {1, 4, 64}), &resp).ok());
    }
    fewest = std::min(fewest, ThreadsRuns(executor) - before);
  }
  EXPECT_LT(fewest, kCalls / 2) << "gRPC's executor ran at least " << fewest << " times over each of three runs of "
                                << kCalls << " calls: the calls' ends were handed to it";
}

TEST(ServerFlagsTest, AdminTokenGuardsLoadAndUnload) {
  auto server = StartOrFail({"--admin-token", "s3cret-s3cret-s3cret"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::AttentionService::NewStub(server->client().channel());
  auto load = [&](const char* authorization) {
    grpc::ClientContext ctx;
    if (authorization) ctx.AddMetadata("authorization", authorization);
    v1::LoadLayerRequest req;
    req.set_name("guarded");
    req.set_source("random:d_model=8,heads=2");
    v1::LayerInfo info;
    return stub->LoadLayer(&ctx, req, &info);
  };
  auto unload = [&](const char* authorization) {
    grpc::ClientContext ctx;
    if (authorization) ctx.AddMetadata("authorization", authorization);
    v1::UnloadLayerRequest req;
    req.set_name("guarded");
    v1::UnloadLayerResponse resp;
    return stub->UnloadLayer(&ctx, req, &resp);
  };
  grpc::Status st = load(nullptr);
  EXPECT_EQ(st.error_code(), grpc::UNAUTHENTICATED) << Describe(st);
  EXPECT_THAT(st.error_message(), HasSubstr("authorization"));
  // Bad credentials are UNAUTHENTICATED (the gRPC status-code guide), whatever is wrong.
  EXPECT_EQ(load("Bearer wrong").error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(load("s3cret-s3cret-s3cret").error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(load("Bearer s3cret-s3cret-s3cret2").error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(unload(nullptr).error_code(), grpc::UNAUTHENTICATED);
  st = load("Bearer s3cret-s3cret-s3cret");
  EXPECT_TRUE(st.ok()) << Describe(st);
  EXPECT_EQ(unload("Bearer nope").error_code(), grpc::UNAUTHENTICATED);
  EXPECT_TRUE(unload("Bearer s3cret-s3cret-s3cret").ok());
  // Reads stay open to everyone; with no --layer the demo layer is served.
  v1::LayerInfo info;
  ASSERT_TRUE(server->client().GetLayer("demo", &info).ok());
  EXPECT_EQ(info.source(), "random:d_model=768,heads=12,seed=1");
  EXPECT_EQ(info.config().d_model(), 768);
  EXPECT_EQ(info.config().heads(), 12);
}

TEST(ServerFlagsTest, FullQueueAnswersResourceExhausted) {
  // No batching, one waiting slot, calls of tens of ms: of 8 sent at once, some are refused.
  auto server = StartOrFail({"--threads", "1", "--workers", "1", "--max-batch-requests", "1", "--max-queue-requests",
                             "1", "--layer", "slow=random:d_model=256,heads=8,seed=4"});
  ASSERT_NE(server, nullptr);
  std::mt19937_64 rng(3);
  const std::vector<float> input = RandomFloats(rng, 1 * 1024 * 256);
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardResponse>>> calls;
  for (int i = 0; i < 8; ++i) {
    calls.push_back(server->client().ForwardFuture(Request("slow", input, {1, 1024, 256}, v1::FORM_SUMMED)));
  }
  int ok = 0, refused = 0;
  for (auto& f : calls) {
    auto [st, resp] = f.get();
    if (st.ok()) {
      ++ok;
    } else {
      EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(st);
      EXPECT_THAT(st.error_message(), HasSubstr("is full (1 requests waiting, limit --max-queue-requests=1)"));
      ++refused;
    }
  }
  EXPECT_GE(ok, 1);
  EXPECT_GE(refused, 1);
}

TEST(ServerFlagsTest, YamlConfigWithFlagOverride) {
  TempDir tmp;
  std::ofstream(tmp.File("attnserve.yaml"))
      << "layers:\n  a: random:d_model=8,heads=2\n  b: random:d_model=16,heads=2\n"
         "max_message_mb: 4\nlog_level: debug\nlog_json: true\n";
  auto server = StartOrFail({"--config", tmp.File("attnserve.yaml"), "--layer", "b=random:d_model=24,heads=3"});
  ASSERT_NE(server, nullptr);
  std::vector<v1::LayerInfo> layers;
  ASSERT_TRUE(server->client().ListLayers(&layers).ok());
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].name(), "a");
  EXPECT_EQ(layers[1].config().d_model(), 24) << "the flag's b replaces the file's";
  // --log-json: every log line is a JSON object.
  std::istringstream log(server->Log());
  int json_lines = 0;
  for (std::string line; std::getline(log, line);) {
    if (line.rfind("listening on", 0) == 0) continue;  // stdout's one plain line
    EXPECT_TRUE(nlohmann::json::accept(line)) << line;
    ++json_lines;
  }
  EXPECT_GT(json_lines, 0);
}

TEST(ServerFlagsTest, BadStartupRefusesWithAClearError) {
  std::string output;
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--listen", "127.0.0.1:0", "--layer", "x=random:d_model=0,heads=1"},
                               &output),
            1);
  EXPECT_THAT(output, AllOf(HasSubstr("'x'"), HasSubstr("d_model")));
  EXPECT_EQ(testing::RunToExit(
                ATTNSERVE_BINARY,
                {"--listen", "127.0.0.1:0", "--layer", "y=safetensors:/nonexistent/w.safetensors,heads=2"}, &output),
            1);
  EXPECT_THAT(output, HasSubstr("/nonexistent/w.safetensors"));
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--layer", "nosource"}, &output), 2);
  EXPECT_THAT(output, HasSubstr("NAME=SOURCE"));
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--frobnicate"}, &output), 2);
  EXPECT_THAT(output, HasSubstr("--frobnicate"));
  // Address already in use.
  auto first = StartOrFail({"--layer", "t=random:d_model=8,heads=2"});
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--listen", first->target(), "--layer", "t=random:d_model=8,heads=2"},
                               &output, std::chrono::seconds(20)),
            1);
  EXPECT_THAT(output, HasSubstr("cannot listen"));
}

TEST(ServerFlagsTest, HelpAndVersion) {
  std::string output;
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--help"}, &output), 0);
  for (const char* flag :
       {"--listen", "--port-file", "--layer", "--threads", "--workers", "--max-batch-requests", "--max-batch-tokens",
        "--max-queue-delay-us", "--max-queue-requests", "--drain-timeout-s", "--max-message-mb",
        "--max-scores-m", "--log-level", "--log-json", "--admin-token", "--config", "--help", "--version"}) {
    EXPECT_THAT(output, HasSubstr(flag));
  }
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--version"}, &output), 0);
  EXPECT_THAT(output, HasSubstr("attnserve "));
}

TEST(ServerFlagsTest, SigtermAndSigintShutDownCleanly) {
  for (int signal : {SIGTERM, SIGINT}) {
    auto server = StartOrFail({"--layer", "t=random:d_model=8,heads=2"});
    ASSERT_NE(server, nullptr);
    const int status = server->Stop(signal);
    EXPECT_EQ(status, 0) << "signal " << signal << "\n" << server->Log();
    EXPECT_THAT(server->Log(), HasSubstr("stopped"));
  }
}

// --device: a device that cannot be used refuses to start with the reason; auto always starts
// and says what it chose.
TEST(ServerFlagsTest, DeviceSelection) {
  std::string output;
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--device", "cuda:99", "--listen", "127.0.0.1:0",
                                                  "--metrics-listen", "127.0.0.1:0"},
                               &output),
            1);
  EXPECT_THAT(output, HasSubstr("--device cuda:99"));
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--device", "tpu"}, &output), 2);
  EXPECT_THAT(output, HasSubstr("device: expected auto, cpu, cuda or cuda:N, got 'tpu'"));
  EXPECT_EQ(testing::RunToExit(ATTNSERVE_BINARY, {"--gpu-math", "fp8"}, &output), 2);
  EXPECT_THAT(output, HasSubstr("--gpu-math: expected fp32, tf32, bf16 or fp16, got 'fp8'"));
  auto server = StartOrFail({"--device", "auto", "--layer", "t=random:d_model=8,heads=2"});
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(server->Log(), ::testing::AnyOf(HasSubstr("backend cpu: "), HasSubstr("backend cuda:0: ")));
  v1::LayerInfo info;
  ASSERT_TRUE(server->client().GetLayer("t", &info).ok());
  for (const auto& form : info.forms()) EXPECT_THAT(form.device(), ::testing::AnyOf("cpu", "cuda:0"));
}

// A rotary layer over the wire: position_offset reaches the backend (checked against the float64
// reference at that offset), and GetLayer returns per-head spectra when asked.
TEST(ServerFlagsTest, RotaryPositionOffsetAndSpectra) {
  auto server = StartOrFail({"--layer", "rope=random:d_model=32,heads=4,kv_heads=2,rope_theta=10000,seed=3"});
  ASSERT_NE(server, nullptr);
  LayerConfig c;
  c.d_model = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.rope_theta = 10000;
  const LayerWeights w = RandomLayerWeights(*CompleteConfig(c), 3);
  std::mt19937_64 rng(47);
  const std::vector<float> input = RandomFloats(rng, 7 * 32);
  for (int64_t offset : {0, 123}) {
    v1::ForwardRequest req = Request("rope", input, {1, 7, 32}, v1::FORM_SUMMED);
    req.set_causal(true);
    req.set_position_offset(offset);
    v1::ForwardResponse resp;
    const grpc::Status st = server->client().Forward(req, &resp);
    ASSERT_TRUE(st.ok()) << Describe(st);
    Sequence seq;
    seq.input = ConstMatrixView(input.data(), 7, 32);
    seq.causal = true;
    seq.position_offset = offset;
    EXPECT_LT(RelativeL2(Output(resp), ReferenceForward(w, seq)), kTolerance) << "offset " << offset;
  }
  // Causal self-attention is blind to a shift of every position (RoPE depends on q - k only),
  // so the offset must also be seen where it changes the answer: queries at offset + q over a
  // context whose keys start at 0. Both forms, against float64, and the answers must differ.
  const std::vector<float> context = RandomFloats(rng, 9 * 32);
  for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    std::vector<std::vector<float>> outputs;
    for (int64_t offset : {0, 37}) {
      v1::ForwardRequest req = Request("rope", input, {1, 7, 32}, form);
      *req.mutable_context() = MakeTensor(context, {1, 9, 32});
      req.set_position_offset(offset);
      v1::ForwardResponse resp;
      const grpc::Status st = server->client().Forward(req, &resp);
      ASSERT_TRUE(st.ok()) << Describe(st);
      Sequence seq;
      seq.input = ConstMatrixView(input.data(), 7, 32);
      seq.context = ConstMatrixView(context.data(), 9, 32);
      seq.position_offset = offset;
      outputs.push_back(Output(resp));
      EXPECT_LT(RelativeL2(outputs.back(), ReferenceForward(w, seq)), kTolerance) << "cross, offset " << offset;
    }
    std::vector<double> at_zero(outputs[0].begin(), outputs[0].end());
    EXPECT_GT(RelativeL2(outputs[1], at_zero), 1e-3) << "the offset changed nothing: was it dropped?";
  }
  v1::ForwardRequest bad = Request("rope", input, {1, 7, 32});
  bad.set_position_offset(-1);
  v1::ForwardResponse resp;
  const grpc::Status st = server->client().Forward(bad, &resp);
  EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("position_offset"));
  v1::LayerInfo info;
  ASSERT_TRUE(server->client().GetLayer("rope", &info, /*include_spectrum=*/true).ok());
  EXPECT_EQ(info.ov_spectrum_size(), 4);
  EXPECT_EQ(info.qk_spectrum_size(), 4);
  EXPECT_FLOAT_EQ(info.config().rope_theta(), 10000.0f);
}

// Inputs of ±1e20 are finite float32, but their attention scores (~1e41) are not: each form must
// still answer the float64 reference's output (finite: a convex mix of values ~1e20), never OK
// with NaN. Inputs near float32's limit overflow the projections themselves, where no float32
// answer can be right: OUT_OF_RANGE naming the output, counted in nonfinite_outputs_total.
TEST(ServerFlagsTest, HugeFiniteInputsAnswerTheReferenceOrOutOfRange) {
  TempDir dir;
  const std::string port_file = dir.File("metrics_port");
  auto server =
      StartOrFail({"--metrics-port-file", port_file, "--layer", kSmall.name + std::string("=") + kSmall.Source()});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  const LayerWeights w = kSmall.Weights();
  const int64_t d = kSmall.d_model, batch = 2, n = 5, m = 7;
  std::mt19937_64 rng(20);
  auto signs = [&](size_t count) {
    std::vector<float> v = RandomFloats(rng, count);
    for (float& x : v) x = x < 0 ? -1e20f : 1e20f;
    return v;
  };
  const std::vector<float> input = signs(batch * n * d), context = signs(batch * m * d);
  for (bool cross : {false, true}) {
    const std::vector<double> want = cross ? Reference(w, input, batch, n, &context, m) : Reference(w, input, batch, n);
    for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
      v1::ForwardRequest req = Request(kSmall.name, input, {batch, n, d}, form);
      if (cross) *req.mutable_context() = MakeTensor(context, {batch, m, d});
      req.set_compare(true);
      v1::ForwardResponse resp;
      const grpc::Status st = server->client().Forward(req, &resp);
      ASSERT_TRUE(st.ok()) << Describe(st) << " cross=" << cross << " form " << v1::Form_Name(form);
      const std::vector<float> got = Output(resp);
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); }))
          << "cross=" << cross << " form " << v1::Form_Name(form);
      EXPECT_LT(RelativeL2(got, want), kTolerance) << "cross=" << cross << " form " << v1::Form_Name(form);
      ASSERT_EQ(resp.divergence_size(), 1);
      EXPECT_LT(resp.divergence(0).rel_l2(), 2 * kTolerance) << "cross=" << cross << " form " << v1::Form_Name(form);
    }
  }
  // 3e38 in every entry: each projection column is 3e38 times a sum of weights ~N(0, 1), past
  // float32's 3.4e38 for nearly all of them.
  const std::vector<float> near_max(batch * n * d, 3e38f);
  for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    v1::ForwardResponse resp;
    const grpc::Status st = server->client().Forward(Request(kSmall.name, near_max, {batch, n, d}, form), &resp);
    EXPECT_EQ(st.error_code(), grpc::OUT_OF_RANGE) << Describe(st) << " form " << v1::Form_Name(form);
    EXPECT_THAT(st.error_message(), AllOf(HasSubstr("output"), HasSubstr("expected finite values"),
                                          HasSubstr("overflowed float32"), HasSubstr("3e+38")));
  }
  const std::string scrape = testing::ScrapeMetrics(metrics_port);
  for (const char* form : {"factored", "summed"}) {
    const std::string labels = std::string("form=\"") + form + "\",layer=\"small\",math=\"fp32\"";
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_nonfinite_outputs_total{" + labels + "}"), 1) << form;
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_requests_total{code=\"OUT_OF_RANGE\"," + labels + "}"), 1)
        << form;
  }
  // ...and the server still serves.
  v1::ForwardResponse resp;
  EXPECT_TRUE(server->client().Forward(Request(kSmall.name, RandomFloats(rng, n * d), {1, n, d}), &resp).ok());
}

// A "NAME:   N kB" line of /proc/PID/status, in kB; -1 when absent.
int64_t ProcessStatusKb(pid_t pid, const std::string& name) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(name, 0) == 0) return std::stoll(line.substr(name.size()));
  }
  return -1;
}

// A float32 safetensors file of `tensors` (name → shape, values).
void WriteF32Safetensors(const std::string& path,
                         const std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(tensor.second.data()), tensor.second.size() * sizeof(float));
    header[name] = {{"dtype", "F32"}, {"shape", tensor.first}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string h = header.dump();
  const uint64_t size = h.size();  // little-endian, as on every machine this runs on
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&size), 8);
  out << h << data;
}

// `compare` served by a form whose answer is finite, with another form that overflowed: the
// client is answered (the served output is right) and sees the other form's divergence as
// infinite, and the overflow is counted under the form that overflowed, not the served one. The
// layer makes only one form overflow: W_V is 1e20 times and W_O 1e-20 times a Gaussian matrix,
// so the factored form's values X·W_V (~1e39 for inputs of 1e19) pass float32's limit while the
// summed form's W_M = W_V·W_O is of order one.
TEST(ServerFlagsTest, ACompareOutputThatOverflowsIsCountedUnderItsOwnForm) {
  TempDir dir;
  constexpr int64_t d = 8;
  std::mt19937_64 rng(61);
  auto scaled = [&](size_t count, float scale) {
    std::vector<float> v = RandomFloats(rng, count);
    for (float& x : v) x *= scale;
    return v;
  };
  std::vector<float> in_proj = scaled(2 * d * d, 1e-10f);  // W_Q, W_K: scores of a sane size
  const std::vector<float> w_v = scaled(d * d, 1e20f);
  in_proj.insert(in_proj.end(), w_v.begin(), w_v.end());
  const std::string checkpoint = dir.File("overflow.safetensors");
  WriteF32Safetensors(checkpoint, {{"in_proj_weight", {{3 * d, d}, in_proj}},
                                   {"in_proj_bias", {{3 * d}, scaled(3 * d, 1e-3f)}},
                                   {"out_proj.weight", {{d, d}, scaled(d * d, 1e-20f)}},
                                   {"out_proj.bias", {{d}, scaled(d, 1e-3f)}}});
  const std::string port_file = dir.File("metrics_port");
  auto server = StartOrFail({"--metrics-port-file", port_file, "--layer",
                             "huge=safetensors:" + checkpoint + ",arch=torch-mha,heads=2"});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  std::vector<float> input = RandomFloats(rng, 2 * 5 * d);
  for (float& x : input) x = x < 0 ? -1e19f : 1e19f;
  v1::ForwardRequest req = Request("huge", input, {2, 5, d}, v1::FORM_SUMMED);
  req.set_compare(true);
  v1::ForwardResponse resp;
  const grpc::Status st = server->client().Forward(req, &resp);
  ASSERT_TRUE(st.ok()) << Describe(st) << "\n" << server->Log();
  const std::vector<float> got = Output(resp);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); }));
  ASSERT_EQ(resp.divergence_size(), 1);
  EXPECT_EQ(resp.divergence(0).form(), v1::FORM_FACTORED);
  EXPECT_TRUE(std::isinf(resp.divergence(0).max_abs())) << resp.divergence(0).max_abs();
  const std::string scrape = testing::ScrapeMetrics(metrics_port);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_nonfinite_outputs_total{form=\"factored\",layer=\"huge\",math=\"fp32\"}"), 1);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_nonfinite_outputs_total{form=\"summed\",layer=\"huge\",math=\"fp32\"}"), -1);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_requests_total{code=\"OK\",form=\"summed\",layer=\"huge\",math=\"fp32\"}"), 1);
}

// Concurrent requests share batches, and each gets exactly what it would alone (the float64
// reference of its own input), whatever its shape, mask or form.
// The memory budget (--max-memory-mb, docs/reliability.md): a request that can never fit is
// INVALID_ARGUMENT naming the flag, before anything is allocated (the server's peak RSS stays far
// below what the request would have taken); requests that fit alone but not together get
// RESOURCE_EXHAUSTED; everything reserved comes back.
TEST(ServerFlagsTest, MemoryBudgetRefusesWhatCanNeverFitAndWhatDoesNotFitNow) {
  TempDir dir;
  const std::string port_file = dir.File("metrics_port");
  auto server = StartOrFail({"--metrics-port-file", port_file, "--max-memory-mb", "300", "--threads", "2"});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  // The idle server's RSS (weights, runtime, threads): what the budget does not cover.
  const int64_t idle_kb = ProcessStatusKb(server->pid(), "VmRSS:");
  ASSERT_GT(idle_kb, 0);
  std::mt19937_64 rng(18000);
  // 18000 tokens: its Q, K, values and heads' outputs alone (linear in n: the attention is tiled)
  // with the request's input and output pass 300 MiB in either form.
  const std::vector<float> huge = RandomFloats(rng, 18000 * 768);
  v1::ForwardResponse resp;
  for (v1::Form form : {v1::FORM_SUMMED, v1::FORM_FACTORED}) {
    grpc::Status st = server->client().Forward(Request("demo", huge, {1, 18000, 768}, form), &resp);
    EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << Describe(st);
    EXPECT_THAT(st.error_message(), HasSubstr("--max-memory-mb"));
  }
  // Each of these fits alone (about 200 MiB in the summed form) but not two at once.
  const std::vector<float> mid = RandomFloats(rng, 1536 * 768);
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardResponse>>> calls;
  for (int i = 0; i < 4; ++i) calls.push_back(server->client().ForwardFuture(Request("demo", mid, {1, 1536, 768}, v1::FORM_SUMMED)));
  int ok = 0, exhausted = 0;
  for (auto& c : calls) {
    const grpc::Status st = c.get().first;
    ok += st.ok();
    exhausted += st.error_code() == grpc::RESOURCE_EXHAUSTED;
    if (!st.ok()) {
      EXPECT_THAT(st.error_message(), HasSubstr("--max-memory-mb")) << Describe(st);
    }
  }
  EXPECT_GE(ok, 1);
  EXPECT_GE(exhausted, 1);
  EXPECT_EQ(ok + exhausted, 4);
  // Peak RSS: the idle server plus what the admitted requests held, within the budget and the
  // allocator's slack (docs/reliability.md: 5 % + 32 MiB); never the refused ones (one 18000-token
  // request alone would pass it by hundreds of MiB).
  const int64_t peak_kb = ProcessStatusKb(server->pid(), "VmHWM:");
  EXPECT_GT(peak_kb, idle_kb);
#if !defined(ATTNSERVE_ASAN) && !defined(ATTNSERVE_TSAN)
  // A sanitized server's allocator adds redzones and keeps freed blocks in quarantine, so its RSS
  // is not what the budget charges (one run passed the bound by 0.5 MiB): the plain build holds it.
  EXPECT_LE(peak_kb, idle_kb + 300 * 1024 * 105 / 100 + 32 * 1024)
      << "peak RSS " << peak_kb / 1024 << " MiB, idle " << idle_kb / 1024 << " MiB, budget 300 MiB";
#endif
  EXPECT_EQ(testing::MetricSample(testing::ScrapeMetrics(metrics_port), "attnserve_memory_budget_bytes"),
            300.0 * 1048576);
  // A call gives its reservation back when its state goes, just after its answer is handed to
  // gRPC, so a client can read the answer first (2 of 34 runs scraped one still held): wait for
  // the gauge to come back to 0. A leaked reservation never does.
  double reserved = -1;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    reserved = testing::MetricSample(testing::ScrapeMetrics(metrics_port), "attnserve_memory_reserved_bytes");
    if (reserved == 0 || std::chrono::steady_clock::now() > give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(reserved, 0) << "bytes still reserved 10 s after every call was answered";
}

// A response gRPC would refuse to send (half-precision input, float32 output) is refused before
// it is computed, and counted as what the client saw.
// A long sequence (docs/architecture.md, "Long sequences"): 8192 tokens to the demo layer, whose
// [n, n] scores for all 12 heads would be 3 GiB, in both forms (the summed form mixes first, tiled,
// in parts). The two forms agree, and rows spread over the sequence match the float64 reference
// (those rows as queries over the whole input as context: the same attention, non-causal).
TEST(LongSequenceTest, EightThousandTokensInBothFormsMatchEachOtherAndFloat64) {
  auto server = StartOrFail({"--threads", "2"});
  ASSERT_NE(server, nullptr);
  constexpr int64_t kN = 8192, kD = 768;
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = kD, .heads = 12}), 1);  // the demo layer
  std::mt19937_64 rng(8192);
  const std::vector<float> input = RandomFloats(rng, kN * kD);
  std::vector<std::vector<float>> outputs;
  for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    v1::ForwardResponse resp;
    const grpc::Status st = server->client().Forward(Request("demo", input, {1, kN, kD}, form), &resp);
    ASSERT_TRUE(st.ok()) << Describe(st);
    outputs.push_back(Output(resp));
    ASSERT_EQ(outputs.back().size(), static_cast<size_t>(kN * kD));
  }
  std::vector<double> factored(outputs[0].begin(), outputs[0].end());
  EXPECT_LT(RelativeL2(outputs[1], factored), 2 * kTolerance) << "summed against factored";
  std::vector<int64_t> rows = {0, 1, 511, 512, kN - 1};
  for (int i = 0; i < 11; ++i) rows.push_back(std::uniform_int_distribution<int64_t>(0, kN - 1)(rng));
  std::vector<float> queries;
  for (int64_t r : rows) queries.insert(queries.end(), input.begin() + r * kD, input.begin() + (r + 1) * kD);
  const std::vector<double> want = Reference(w, queries, 1, static_cast<int64_t>(rows.size()), &input, kN);
  for (size_t f = 0; f < outputs.size(); ++f) {
    std::vector<float> got;
    for (int64_t r : rows) got.insert(got.end(), outputs[f].begin() + r * kD, outputs[f].begin() + (r + 1) * kD);
    EXPECT_LT(RelativeL2(got, want), kTolerance) << (f == 0 ? "factored" : "summed") << " against float64";
  }
}

TEST(ServerFlagsTest, OversizedResponsesAreRefusedBeforeCompute) {
  TempDir dir;
  const std::string port_file = dir.File("metrics_port");
  auto server = StartOrFail({"--metrics-port-file", port_file, "--max-message-mb", "1"});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  v1::ForwardRequest req;
  req.set_layer("demo");
  req.set_form(v1::FORM_FACTORED);
  req.mutable_input()->set_dtype(v1::DATA_TYPE_FLOAT16);
  for (int64_t s : {1, 400, 768}) req.mutable_input()->add_shape(s);
  std::string bytes(400 * 768 * 2, '\0');
  for (size_t i = 0; i < bytes.size(); i += 2) bytes[i + 1] = 0x3c;  // 1.0 in FLOAT16
  req.mutable_input()->set_data(bytes);  // 600 KiB in, 1.2 MB of float32 out
  v1::ForwardResponse resp;
  const grpc::Status st = server->client().Forward(req, &resp);
  EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << Describe(st);
  EXPECT_THAT(st.error_message(), AllOf(HasSubstr("output"), HasSubstr("--max-message-mb")));
  const std::string scrape = testing::ScrapeMetrics(metrics_port);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_requests_total{code=\"RESOURCE_EXHAUSTED\",form=\"factored\",layer=\"demo\",math=\"fp32\"}"), 1);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_requests_total{code=\"OK\",form=\"factored\",layer=\"demo\",math=\"fp32\"}"), -1);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_batch_requests_count{form=\"factored\",layer=\"demo\",math=\"fp32\"}"), -1)
      << "nothing was computed";
}

TEST(BatchingTest, ConcurrentRequestsShareBatchesAndEachGetsItsOwnResult) {
  auto server = StartOrFail({"--max-queue-delay-us", "20000", "--layer", kSmall.name + std::string("=") + kSmall.Source()});
  ASSERT_NE(server, nullptr);
  const LayerWeights w = kSmall.Weights();
  std::mt19937_64 rng(41);
  struct Sent {
    std::vector<float> input;
    int64_t batch, n;
    bool causal;
    std::future<std::pair<grpc::Status, v1::ForwardResponse>> reply;
  };
  std::vector<Sent> sent;
  for (int i = 0; i < 24; ++i) {
    Sent s;
    s.batch = 1 + i % 3;
    s.n = 1 + (i * 7) % 19;
    s.causal = i % 2 == 0;
    s.input = RandomFloats(rng, s.batch * s.n * 64);
    v1::ForwardRequest req = Request(kSmall.name, s.input, {s.batch, s.n, 64}, i % 4 == 3 ? v1::FORM_SUMMED : v1::FORM_FACTORED);
    req.set_causal(s.causal);
    s.reply = server->client().ForwardFuture(req);
    sent.push_back(std::move(s));
  }
  int shared = 0;
  for (Sent& s : sent) {
    auto [st, resp] = s.reply.get();
    ASSERT_TRUE(st.ok()) << Describe(st);
    EXPECT_LT(RelativeL2(Output(resp), Reference(w, s.input, s.batch, s.n, nullptr, 0, s.causal)), kTolerance);
    EXPECT_GE(resp.batch_requests(), 1);
    EXPECT_GE(resp.queue_us(), 0);
    EXPECT_GT(resp.compute_us(), 0);
    if (resp.batch_requests() > 1) ++shared;
  }
  EXPECT_GT(shared, 0) << "24 requests sent at once with a 20 ms queue delay must share batches";
}

// SIGTERM under load: every request the clients sent ends as OK or as an explicit error, the
// server stops answering SERVING, and it exits 0 within the drain timeout. A call is surely in
// flight at the signal, by construction rather than timing: a one-token request on a layer of
// its own waits in its queue for company for up to 10 s (--max-queue-delay-us, its maximum), and
// the signal is sent once the queue gauge shows it there, at most 6 s after it was sent; the
// drain must run it at once and answer it OK. A drain that waited out the delay would reach its
// 3 s timeout first (6 + 3 < 10) and fail it: with a 10 s timeout, a slow machine on which the
// call reached its queue seconds before the signal let that drain pass. The load's
// requests fill a batch alone (512 tokens, --max-batch-tokens 512) and run at once.
TEST(DrainTest, SigtermUnderLoadLosesNothing) {
  TempDir dir;
  const std::string metrics_port_file = dir.File("metrics_port");
  auto server = StartOrFail({"--drain-timeout-s", "3", "--max-queue-delay-us", "10000000", "--max-batch-tokens",
                             "512", "--metrics-port-file", metrics_port_file, "--layer",
                             "mid=random:d_model=256,heads=8,seed=4", "--layer", "held=random:d_model=16,heads=2,seed=9"});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(metrics_port_file) >> metrics_port;
  ASSERT_GT(metrics_port, 0);
  std::mt19937_64 rng(43);
  const std::vector<float> input = RandomFloats(rng, 2 * 256 * 256);
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0}, ok{0}, explicit_errors{0};
  std::map<std::string, int> codes;
  std::mutex codes_mu;
  // Every call's start and outcome, to judge the ones the server had surely received.
  struct Call {
    std::chrono::steady_clock::time_point started, ended;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Call> calls;
  std::vector<std::thread> senders;
  for (int t = 0; t < 4; ++t) {
    senders.emplace_back([&] {
      // Its own client: calls after the server is gone fail fast instead of sharing a channel.
      ClientOptions options;
      options.target = server->target();
      options.timeout = std::chrono::milliseconds(20000);
      Client client(options);
      while (!stop) {
        ++sent;
        v1::ForwardResponse resp;
        const auto started = std::chrono::steady_clock::now();
        const grpc::Status st = client.Forward(Request("mid", input, {2, 256, 256}), &resp);
        {
          std::lock_guard<std::mutex> lock(codes_mu);
          calls.push_back({started, std::chrono::steady_clock::now(), st.error_code(), st.error_message()});
        }
        if (st.ok()) {
          ++ok;
        } else {
          ++explicit_errors;
          std::lock_guard<std::mutex> lock(codes_mu);
          ++codes[std::string(GrpcCodeName(st.error_code()))];
        }
      }
    });
  }
  // The load is running: some calls answered.
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
       ok.load() < 4 && std::chrono::steady_clock::now() < give_up;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(ok.load(), 4) << "the load was not answered";
  // The held call, queued until the drain runs it.
  const std::vector<float> one_token = RandomFloats(rng, 16);
  auto held = server->client().ForwardFuture(Request("held", one_token, {1, 1, 16}, v1::FORM_FACTORED));
  const std::string held_depth = "attnserve_queue_depth{form=\"factored\",layer=\"held\",math=\"fp32\"}";
  double depth = 0;
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(6);
       depth < 1 && std::chrono::steady_clock::now() < give_up;) {
    depth = testing::MetricSample(testing::ScrapeMetrics(metrics_port), held_depth);
    if (depth < 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(depth, 1) << "the held call never reached its queue";
  const auto signalled = std::chrono::steady_clock::now();
  const int status = server->Stop(SIGTERM, std::chrono::seconds(30));
  const auto exited = std::chrono::steady_clock::now();
  stop = true;
  for (auto& t : senders) t.join();
  EXPECT_EQ(status, 0) << server->Log();
  EXPECT_LT(exited - signalled, std::chrono::seconds(4)) << "drain timeout is 3 s\n" << server->Log();
  EXPECT_GT(ok.load(), 0);
  // In flight at the signal, and answered: the drain ran what it had accepted.
  const auto [held_status, held_response] = held.get();
  EXPECT_TRUE(held_status.ok()) << "the call queued at SIGTERM ended " << Describe(held_status);
  EXPECT_EQ(held_response.output().data().size(), 16 * sizeof(float));
  // Calls that reach a server already draining are refused: UNAVAILABLE from the service
  // ("draining") or from gRPC once the listener is closed, or CANCELLED when gRPC had taken
  // them in as it shut down but the handler never ran.
  for (const auto& [code, count] : codes) {
    EXPECT_THAT(code, ::testing::AnyOf("UNAVAILABLE", "CANCELLED")) << count << " calls ended " << code;
  }
  // A call sent 5 ms or more before SIGTERM was received by then (calls take tens of ms). It
  // is either answered OK or, when its handler ran only after the signal (a slow, sanitized
  // server), refused by the service as draining; never cancelled, never cut off mid-answer.
  for (const Call& c : calls) {
    if (c.started > signalled - std::chrono::milliseconds(5)) continue;
    const bool refused_as_draining =
        c.code == grpc::StatusCode::UNAVAILABLE && c.message.find("draining") != std::string::npos;
    EXPECT_TRUE(c.code == grpc::OK || refused_as_draining)
        << "a call received before SIGTERM ended " << GrpcCodeName(c.code) << ": " << c.message;
  }
  EXPECT_THAT(server->Log(), HasSubstr("draining"));
  EXPECT_THAT(server->Log(), HasSubstr("every accepted inference call is answered"));
  EXPECT_THAT(server->Log(), HasSubstr("stopped (0 queued requests abandoned"));
}

// Many calls in flight at SIGTERM, each on its own connection: every one the server had
// accepted (its in-flight gauge counted them all) gets its answer. Closing the listeners as
// soon as the last answer was handed to gRPC reset connections whose answers the clients had
// not yet read ("Socket closed"); the drain now waits for the answers and lingers.
TEST(DrainTest, EveryCallInFlightAtSigtermGetsItsAnswer) {
  TempDir dir;
  const std::string metrics_port_file = dir.File("metrics_port");
  // One batch of all of them, held by a long queue delay: at SIGTERM every call is accepted
  // and unanswered, and then all 48 answers are written at once.
  auto server = StartOrFail({"--drain-timeout-s", "30", "--workers", "1", "--max-batch-requests", "64",
                             "--max-batch-tokens", "65536", "--max-queue-delay-us", "4000000",
                             "--metrics-port-file", metrics_port_file, "--layer",
                             "mid=random:d_model=256,heads=8,seed=4"});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(metrics_port_file) >> metrics_port;
  ASSERT_GT(metrics_port, 0);
  constexpr int kCalls = 48;
  std::mt19937_64 rng(47);
  const std::vector<float> input = RandomFloats(rng, 1 * 128 * 256);
  std::vector<grpc::Status> statuses(kCalls);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    callers.emplace_back([&, i] {
      ClientOptions options;
      options.target = server->target();
      options.timeout = std::chrono::milliseconds(60000);
      Client client(options);
      v1::ForwardResponse resp;
      statuses[i] = client.Forward(Request("mid", input, {1, 128, 256}), &resp);
      if (statuses[i].ok() && resp.output().data().size() != 128 * 256 * sizeof(float)) {
        statuses[i] = grpc::Status(grpc::StatusCode::DATA_LOSS, "short output");
      }
    });
  }
  // SIGTERM once the server holds all of them.
  double inflight = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < give_up) {
    inflight = testing::MetricSample(testing::ScrapeMetrics(metrics_port), "attnserve_inflight_requests");
    if (inflight >= kCalls) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  // While the 48 wait for their answers: health says NOT_SERVING (balancers move on) and a new
  // call is refused at once, by the service, with a reason; the listener is still open.
  ClientOptions late_options;
  late_options.target = server->target();
  late_options.timeout = std::chrono::milliseconds(3000);
  Client late(late_options);
  bool serving = true;
  grpc::Status health;
  for (int i = 0; i < 100 && serving; ++i) {  // the signal is handled on another thread
    health = late.Health("", &serving);
    if (serving) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(health.ok()) << Describe(health);
  EXPECT_FALSE(serving) << "health must answer NOT_SERVING during the drain";
  v1::ForwardResponse refused_resp;
  const grpc::Status refused = late.Forward(Request("mid", input, {1, 128, 256}), &refused_resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(refused);
  EXPECT_THAT(refused.error_message(), HasSubstr("draining"));
  const int status = server->Stop(0, std::chrono::seconds(60));  // signal 0: wait for the exit
  for (auto& t : callers) t.join();
  ASSERT_EQ(inflight, kCalls) << "the calls were not all in flight at SIGTERM: the drain was not tested";
  EXPECT_EQ(status, 0) << server->Log();
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << "call " << i << " accepted before SIGTERM ended "
                                  << GrpcCodeName(statuses[i].error_code()) << ": " << statuses[i].error_message();
  }
}

// A request whose deadline passes while the batcher holds it, and one its client cancels while
// it waits for its batch, end with their own codes at the client and in the server's
// requests_total (never computed, never counted OK).
TEST(DeadlineAndCancelTest, QueueExpiryAndClientCancelAreCountedByTheirCodes) {
  TempDir dir;
  const std::string metrics_port_file = dir.File("metrics_port");
  // A batch waits up to 3 s for company: both calls end while they wait.
  auto server = StartOrFail({"--workers", "1", "--max-batch-requests", "64", "--max-queue-delay-us", "3000000",
                             "--metrics-port-file", metrics_port_file, "--layer",
                             std::string(kSmall.name) + "=" + kSmall.Source()});
  ASSERT_NE(server, nullptr);
  int metrics_port = 0;
  std::ifstream(metrics_port_file) >> metrics_port;
  ASSERT_GT(metrics_port, 0);
  std::mt19937_64 rng(53);
  const std::vector<float> input = RandomFloats(rng, 1 * 6 * 64);
  const v1::ForwardRequest req = Request("small", input, {1, 6, 64}, v1::FORM_FACTORED);
  const auto series = [](const char* code) {
    return std::string("attnserve_requests_total{code=\"") + code + "\",form=\"factored\",layer=\"small\",math=\"fp32\"}";
  };
  // Polls the server's count of `code` until it is 1 (the server answers after the client saw it).
  const auto count_of = [&](const char* code) {
    double n = -1;
    for (int i = 0; i < 500 && n < 1; ++i) {
      n = testing::MetricSample(testing::ScrapeMetrics(metrics_port), series(code));
      if (n < 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return n;
  };

  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(server->target(), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    v1::ForwardResponse resp;
    const grpc::Status st = stub->Forward(&context, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(st);
  }
  EXPECT_EQ(count_of("DEADLINE_EXCEEDED"), 1) << "an expiry in the queue is counted as such";
  EXPECT_EQ(testing::MetricSample(testing::ScrapeMetrics(metrics_port), series("CANCELLED")), -1);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardResponse resp;
    std::promise<grpc::Status> done;
    stub->async()->Forward(&context, &req, &resp, [&](grpc::Status st) { done.set_value(std::move(st)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    context.TryCancel();
    const grpc::Status st = done.get_future().get();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << Describe(st);
  }
  EXPECT_EQ(count_of("CANCELLED"), 1) << "a client's cancel while queued is counted as such";
  const std::string scrape = testing::ScrapeMetrics(metrics_port);
  EXPECT_EQ(testing::MetricSample(scrape, series("OK")), -1) << "neither request may have been computed";
  EXPECT_EQ(testing::MetricSample(scrape, series("DEADLINE_EXCEEDED")), 1);
  // The server still computes what comes next.
  v1::ForwardResponse resp;
  const grpc::Status st = server->client().Forward(req, &resp);
  ASSERT_TRUE(st.ok()) << Describe(st);
  EXPECT_LT(RelativeL2(Output(resp), Reference(kSmall.Weights(), input, 1, 6)), kTolerance);
}

// The low-rank form over gRPC: at full energy it is the layer (float64 reference), truncated to
// a rank budget it is measurably not, and `compare` reports its distance to the exact forms as
// measured here from their own answers.
TEST(LowRankServerTest, TheLowRankFormIsServedAndCompared) {
  auto server = StartOrFail({"--layer", "full=" + kSmall.Source() + ",lowrank=energy:1", "--layer",
                             "cut=" + kSmall.Source() + ",lowrank=budget:8"});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();
  const LayerWeights w = kSmall.Weights();
  std::mt19937_64 rng(59);
  const std::vector<float> input = RandomFloats(rng, 2 * 7 * 64);
  const std::vector<double> exact = Reference(w, input, 2, 7, nullptr, 0, true);
  std::map<std::string, double> error_to_exact;
  for (const std::string layer : {"full", "cut"}) {
    v1::ForwardRequest req = Request(layer, input, {2, 7, 64}, v1::FORM_LOWRANK);
    req.set_causal(true);
    req.set_compare(true);
    v1::ForwardResponse resp;
    const grpc::Status st = client.Forward(req, &resp);
    ASSERT_TRUE(st.ok()) << layer << ": " << Describe(st);
    EXPECT_EQ(resp.form(), v1::FORM_LOWRANK);
    const std::vector<float> lowrank = Output(resp);
    error_to_exact[layer] = RelativeL2(lowrank, exact);
    ASSERT_EQ(resp.divergence_size(), 2) << layer << ": compared with the factored and the summed form";
    for (const v1::Divergence& d : resp.divergence()) {
      v1::ForwardRequest alone = req;
      alone.set_form(d.form());
      alone.set_compare(false);
      v1::ForwardResponse other;
      ASSERT_TRUE(client.Forward(alone, &other).ok());
      const std::vector<float> b = Output(other);
      double num = 0, den = 0;
      for (size_t i = 0; i < lowrank.size(); ++i) {
        num += (static_cast<double>(b[i]) - lowrank[i]) * (static_cast<double>(b[i]) - lowrank[i]);
        den += static_cast<double>(lowrank[i]) * lowrank[i];
      }
      EXPECT_NEAR(d.rel_l2(), std::sqrt(num / den), 1e-3 * std::sqrt(num / den) + 1e-9) << layer;
    }
    v1::LayerInfo info;
    ASSERT_TRUE(client.GetLayer(layer, &info).ok());
    int64_t kept = 0;
    for (const v1::FormInfo& f : info.forms()) {
      if (f.form() != v1::FORM_LOWRANK) continue;
      EXPECT_EQ(f.ranks_size(), 4) << layer << ": one rank per head";
      for (int64_t r : f.ranks()) kept += r;
    }
    if (layer == "full") {
      EXPECT_EQ(kept, 4 * 16) << "full energy keeps every head's whole rank";
    }
    if (layer == "cut") {
      EXPECT_LE(kept, 8) << "the budget bounds the ranks kept";
    }
  }
  // Full energy keeps every singular value: the layer itself, up to float32 and SVD rounding.
  EXPECT_LT(error_to_exact["full"], 1e-4);
  // A budget of 8 ranks over 4 heads of 16 drops most of each head's spectrum.
  EXPECT_GT(error_to_exact["cut"], 1e-2);
  EXPECT_LT(error_to_exact["cut"], 1.0);
}

}  // namespace
}  // namespace attnserve
