// The real attnserve binary on a GPU it cannot tell from a real one: `--device cuda` with the
// CUDA plugin built over the host emulation (tests/cuda_emulation). What the unit tests cannot
// reach runs here: the plugin's dlopen and C ABI, the device in LayerInfo and in the metrics'
// labels, both forms against float64 through gRPC, and a device fault turning into INTERNAL for
// the request, NOT_SERVING for the server and a device_errors_total sample.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/core/layer.h"
#include "server/core/reference.h"
#include "tests/integration/server_process.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::ServerProcess;
using testing::TempDir;

constexpr int64_t kDModel = 48, kHeads = 4;
constexpr uint64_t kSeed = 11;
const char kLayer[] = "tiny=random:d_model=48,heads=4,seed=11";

// A server on the emulated GPU, with `env` ("NAME=value") in its environment.
struct EmulatedGpuServer {
  TempDir dir;
  std::unique_ptr<ServerProcess> process;
  std::string error;
  int metrics_port = 0;

  EmulatedGpuServer(std::vector<std::string> args, std::vector<std::string> env) {
    env.push_back(std::string("ATTNSERVE_CUDA_PLUGIN_PATH=") + ATTNSERVE_EMULATED_PLUGIN);
    const std::string port_file = dir.File("metrics_port");
    args.insert(args.end(), {"--metrics-port-file", port_file});
    process = ServerProcess::Start(ATTNSERVE_BINARY, args, &error, std::chrono::seconds(60), env);
    std::ifstream in(port_file);
    in >> metrics_port;
  }
  Client& client() { return process->client(); }
};

// The environment that makes GEMM `k` fault, counted from when Arm(dir) has run: a test arms
// it once the server is up, after the warmup's GEMMs.
std::vector<std::string> ArmedFault(const TempDir& dir, int k) {
  return {"ATTNSERVE_CUDA_EMULATION_FAULT_AT_GEMM=" + std::to_string(k),
          "ATTNSERVE_CUDA_EMULATION_FAULT_ARMED_BY=" + dir.File("armed")};
}
void Arm(const TempDir& dir) { std::ofstream(dir.File("armed")) << "armed\n"; }

v1::ForwardRequest Request(v1::Form form, const std::vector<float>& x, int64_t batch, int64_t n) {
  v1::ForwardRequest req;
  req.set_layer("tiny");
  req.set_form(form);
  req.set_causal(true);
  *req.mutable_input() = MakeTensor(x, {batch, n, kDModel});
  return req;
}

class CudaEmulatedServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef ATTNSERVE_SERVER_LOADS_CUDA_PLUGIN
    GTEST_SKIP() << "this attnserve was built without the CUDA toolkit: --device cuda loads no plugin";
#endif
  }
};

TEST_F(CudaEmulatedServerTest, ServesBothFormsOnTheGpuAndLabelsTheDevice) {
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer}, {});
  ASSERT_NE(server.process, nullptr) << server.error;
  EXPECT_THAT(server.process->Log(), HasSubstr("cuda:0"));

  v1::LayerInfo info;
  ASSERT_TRUE(server.client().GetLayer("tiny", &info).ok());
  ASSERT_GE(info.forms_size(), 2);
  for (const v1::FormInfo& form : info.forms()) EXPECT_EQ(form.device(), "cuda:0");

  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = kDModel, .heads = kHeads}), kSeed);
  const int64_t batch = 3, n = 7;
  std::mt19937_64 rng(5);
  const std::vector<float> x = testing::RandomVector(rng, batch * n * kDModel);
  auto reference = [&](const std::vector<float>& input) {
    std::vector<double> want;
    for (int64_t b = 0; b < batch; ++b) {
      Sequence s;
      s.input = ConstMatrixView(input.data() + b * n * kDModel, n, kDModel);
      s.causal = true;
      const std::vector<double> y = ReferenceForward(w, s);
      want.insert(want.end(), y.begin(), y.end());
    }
    return want;
  };
  // ±1e20: finite inputs whose scores (~1e41) are not; the softmax kernel recomputes such rows
  // in float64, so the answer is still the reference's.
  std::vector<float> huge = x;
  for (float& v : huge) v = v < 0 ? -1e20f : 1e20f;
  const std::vector<float>* const inputs[] = {&x, &huge};
  for (const std::vector<float>* input : inputs) {
    const std::vector<double> want = reference(*input);
    for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
      v1::ForwardResponse resp;
      const grpc::Status st = server.client().Forward(Request(form, *input, batch, n), &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      std::vector<float> got;
      ASSERT_TRUE(TensorToFloats(resp.output(), &got).ok());
      ASSERT_EQ(got.size(), want.size());
      EXPECT_LT(testing::RelativeL2(got.data(), want), 1e-5) << v1::Form_Name(form) << " input[0] " << (*input)[0];
    }
  }
  // 3e38 everywhere overflows the projections themselves: OUT_OF_RANGE, not NaN answered OK.
  v1::ForwardResponse resp;
  const grpc::Status overflow =
      server.client().Forward(Request(v1::FORM_FACTORED, std::vector<float>(x.size(), 3e38f), batch, n), &resp);
  EXPECT_EQ(overflow.error_code(), grpc::OUT_OF_RANGE) << overflow.error_message();
  const std::string scrape = testing::ScrapeMetrics(server.metrics_port);
  EXPECT_THAT(scrape, HasSubstr("device=\"cuda:0\""));
  EXPECT_THAT(scrape, ::testing::Not(HasSubstr("device=\"cpu\"")));
}

TEST_F(CudaEmulatedServerTest, ADeviceFaultFailsTheRequestAndTakesTheServerOutOfRotation) {
  // The first GEMM of the first batch faults: counted once the server is up (its warmup runs
  // GEMMs before it reports ready).
  TempDir armed;
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer}, ArmedFault(armed, 0));
  ASSERT_NE(server.process, nullptr) << server.error;
  Arm(armed);
  std::mt19937_64 rng(6);
  const std::vector<float> x = testing::RandomVector(rng, 1 * 5 * kDModel);
  v1::ForwardResponse resp;
  const grpc::Status failed = server.client().Forward(Request(v1::FORM_FACTORED, x, 1, 5), &resp);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::INTERNAL) << failed.error_message();
  EXPECT_THAT(failed.error_message(), HasSubstr("cuBLAS error"));

  // The health watcher polls every 250 ms.
  ServingStatus status = ServingStatus::kServing;
  for (int i = 0; i < 40 && status != ServingStatus::kNotServing; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(server.client().HealthStatus("", &status).ok());
  }
  EXPECT_EQ(status, ServingStatus::kNotServing) << server.process->Log();
  EXPECT_EQ(testing::MetricSample(testing::ScrapeMetrics(server.metrics_port),
                                  "attnserve_device_errors_total{device=\"cuda:0\"}"),
            1);
  // Later requests fail fast without touching the device; the process stays up.
  const grpc::Status again = server.client().Forward(Request(v1::FORM_SUMMED, x, 1, 5), &resp);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(again.error_message(), HasSubstr("unhealthy"));
  EXPECT_EQ(server.process->Stop(SIGTERM), 0) << server.process->Log();
}

// An error the CUDA runtime calls process-fatal that the emulation never raises by itself
// (cudaErrorContained, 226, raised by the first GEMM's injected fault): the server must leave
// rotation, not stay SERVING and fail every request.
TEST_F(CudaEmulatedServerTest, AContainedErrorTakesTheServerOutOfRotation) {
  TempDir armed;
  std::vector<std::string> env = ArmedFault(armed, 0);
  env.push_back("ATTNSERVE_CUDA_EMULATION_FAULT_ERROR=226");
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer}, env);
  ASSERT_NE(server.process, nullptr) << server.error;
  Arm(armed);
  std::mt19937_64 rng(7);
  const std::vector<float> x = testing::RandomVector(rng, 1 * 5 * kDModel);
  v1::ForwardResponse resp;
  const grpc::Status failed = server.client().Forward(Request(v1::FORM_FACTORED, x, 1, 5), &resp);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::INTERNAL) << failed.error_message();
  ServingStatus status = ServingStatus::kServing;
  for (int i = 0; i < 40 && status != ServingStatus::kNotServing; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(server.client().HealthStatus("", &status).ok());
  }
  EXPECT_EQ(status, ServingStatus::kNotServing) << server.process->Log();
  EXPECT_EQ(server.process->Stop(SIGTERM), 0) << server.process->Log();
}

// The CUDA backend's flags reach the backend through the plugin's options: the start-up line
// names them, small requests are still answered as float64 answers them, and a 1 MiB bound on a
// lane's workspace refuses a 4096-token sequence, naming that bound.
TEST_F(CudaEmulatedServerTest, TheGpuFlagsReachTheBackend) {
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer, "--gpu-staging-threads", "2",
                            "--gpu-summed-mix-first", "--gpu-max-lane-workspace-mb", "1",
                            "--gpu-max-score-workspace-mb", "1", "--gpu-staging-slice-kb", "16"},
                           {});
  ASSERT_NE(server.process, nullptr) << server.error;
  EXPECT_THAT(server.process->Log(), HasSubstr("2 staging threads, summed mix-first"));

  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = kDModel, .heads = kHeads}), kSeed);
  std::mt19937_64 rng(8);
  const int64_t n = 9;
  const std::vector<float> x = testing::RandomVector(rng, n * kDModel);
  Sequence s;
  s.input = ConstMatrixView(x.data(), n, kDModel);
  s.causal = true;
  const std::vector<double> want = ReferenceForward(w, s);
  for (v1::Form form : {v1::FORM_FACTORED, v1::FORM_SUMMED}) {
    v1::ForwardResponse resp;
    const grpc::Status st = server.client().Forward(Request(form, x, 1, n), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    std::vector<float> got;
    ASSERT_TRUE(TensorToFloats(resp.output(), &got).ok());
    EXPECT_LT(testing::RelativeL2(got.data(), want), 1e-5) << v1::Form_Name(form);
  }

  const int64_t long_n = 4096;  // its inputs, projections and outputs alone pass 1 MiB
  v1::ForwardResponse resp;
  const grpc::Status refused = server.client().Forward(
      Request(v1::FORM_FACTORED, testing::RandomVector(rng, long_n * kDModel), 1, long_n), &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("1.0 MiB is one lane's bound (--gpu-max-lane-workspace-mb)"));
}

TEST_F(CudaEmulatedServerTest, NoGpuAutoFallsBackToTheCpuAndCudaRefusesToStart) {
  EmulatedGpuServer fallback({"--device", "auto", "--layer", kLayer}, {"ATTNSERVE_CUDA_EMULATION_DEVICES=0"});
  ASSERT_NE(fallback.process, nullptr) << fallback.error;
  EXPECT_THAT(fallback.process->Log(), HasSubstr("no usable GPU"));
  v1::LayerInfo info;
  ASSERT_TRUE(fallback.client().GetLayer("tiny", &info).ok());
  EXPECT_EQ(info.forms(0).device(), "cpu");

  EmulatedGpuServer refused({"--device", "cuda", "--layer", kLayer}, {"ATTNSERVE_CUDA_EMULATION_DEVICES=0"});
  EXPECT_EQ(refused.process, nullptr);
  EXPECT_THAT(refused.error, HasSubstr("no usable GPU"));
}

// Readiness comes after warmup: by the time health answers SERVING (ServerProcess::Start waits
// for it) every worker's lane exists and the gauges say so; the log's warmup line comes before
// the listening line. Requests then keep to those lanes.
TEST_F(CudaEmulatedServerTest, EveryWorkersLaneIsWarmBeforeTheServerIsReady) {
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer, "--workers", "3"}, {});
  ASSERT_NE(server.process, nullptr) << server.error;
  const std::string log = server.process->Log();
  const size_t warmed = log.find("cuda:0 warmed: 3 lanes over 2 forms");
  ASSERT_NE(warmed, std::string::npos) << log;
  EXPECT_LT(warmed, log.find("listening on")) << log;
  const std::string scrape = testing::ScrapeMetrics(server.metrics_port);
  EXPECT_EQ(testing::MetricSample(scrape, "attnserve_device_lanes{device=\"cuda:0\"}"), 3) << scrape;
  // The weights of both forms and three warm workspaces, under the default limit (90 % of the
  // emulated 80 GiB).
  const double held = testing::MetricSample(scrape, "attnserve_device_memory_held_bytes{device=\"cuda:0\"}");
  const double limit = testing::MetricSample(scrape, "attnserve_device_memory_limit_bytes{device=\"cuda:0\"}");
  EXPECT_GT(held, 2.0 * 4 * (4 * kDModel * kDModel)) << scrape;
  EXPECT_NEAR(limit, 0.9 * static_cast<double>(int64_t{80} << 30), 1 << 20) << scrape;

  std::mt19937_64 rng(9);
  std::vector<std::vector<float>> inputs;
  for (int t = 0; t < 6; ++t) inputs.push_back(testing::RandomVector(rng, 2 * 9 * kDModel));
  std::vector<std::thread> callers;
  std::vector<grpc::Status> got(6);
  for (int t = 0; t < 6; ++t) {
    callers.emplace_back([&, t] {
      v1::ForwardResponse resp;
      got[t] = server.client().Forward(Request(t % 2 == 0 ? v1::FORM_FACTORED : v1::FORM_SUMMED, inputs[t], 2, 9), &resp);
    });
    if (t % 3 == 2) {
      for (auto& c : callers) c.join();
      callers.clear();
    }
  }
  for (const grpc::Status& st : got) EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(testing::MetricSample(testing::ScrapeMetrics(server.metrics_port), "attnserve_device_lanes{device=\"cuda:0\"}"),
            3);
  // Each answered batch's split, by part.
  const std::string after = testing::ScrapeMetrics(server.metrics_port);
  for (const char* part : {"inputs", "compute", "outputs"}) {
    EXPECT_GE(testing::MetricSample(after, std::string("attnserve_device_time_seconds_count{device=\"cuda:0\",form=\"factored\","
                                                       "layer=\"tiny\",math=\"fp32\",part=\"") + part + "\"}"),
              1)
        << part;
  }
}

// NVML's readings as gauges, from the fake libnvidia-ml.so.1 (tests/cuda_emulation/fake_nvml.cc)
// found by --nvml-library and by LD_LIBRARY_PATH; without one the gauges are absent, one info
// line says why, and the server serves.
TEST_F(CudaEmulatedServerTest, NvmlReadingsAreGaugesAndNoNvmlIsNoGauges) {
  const std::string fake = ATTNSERVE_FAKE_NVML;
  const std::string fake_dir = fake.substr(0, fake.rfind('/'));
  struct Case {
    std::vector<std::string> args, env;
  };
  for (const Case& c : {Case{{"--nvml-library", fake}, {}}, Case{{}, {"LD_LIBRARY_PATH=" + fake_dir}}}) {
    std::vector<std::string> args = {"--device", "cuda", "--layer", kLayer};
    args.insert(args.end(), c.args.begin(), c.args.end());
    EmulatedGpuServer server(args, c.env);
    ASSERT_NE(server.process, nullptr) << server.error;
    const std::string scrape = testing::ScrapeMetrics(server.metrics_port);
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_gpu_utilization_ratio{device=\"cuda:0\"}"), 0.37) << scrape;
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_gpu_memory_total_bytes{device=\"cuda:0\"}"),
              static_cast<double>(int64_t{80} << 30));
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_gpu_memory_used_bytes{device=\"cuda:0\"}"),
              static_cast<double>((int64_t{3} << 30) + (int64_t{5} << 20)));
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_gpu_temperature_celsius{device=\"cuda:0\"}"), 61);
    EXPECT_EQ(testing::MetricSample(scrape, "attnserve_gpu_power_watts{device=\"cuda:0\"}"), 212.345);
    EXPECT_EQ(server.process->Stop(SIGTERM), 0) << server.process->Log();
  }
  EmulatedGpuServer none({"--device", "cuda", "--layer", kLayer, "--nvml-library", "/nonexistent/libnvidia-ml.so.1"}, {});
  ASSERT_NE(none.process, nullptr) << none.error;
  EXPECT_THAT(none.process->Log(), HasSubstr("no GPU telemetry for cuda:0 (the attnserve_gpu_* gauges are absent)"));
  const std::string scrape = testing::ScrapeMetrics(none.metrics_port);
  EXPECT_THAT(scrape, ::testing::Not(HasSubstr("attnserve_gpu_")));
  EXPECT_GT(testing::MetricSample(scrape, "attnserve_device_lanes{device=\"cuda:0\"}"), 0) << "the budget's are there";
  std::mt19937_64 rng(10);
  v1::ForwardResponse resp;
  const grpc::Status st =
      none.client().Forward(Request(v1::FORM_FACTORED, testing::RandomVector(rng, 5 * kDModel), 1, 5), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(none.process->Stop(SIGTERM), 0) << none.process->Log();
}

// --exit-on-device-loss: a fatal device error answers the request it failed (INTERNAL), then the
// server drains and the process exits with status 3 by itself, for an orchestrator to restart
// it. Without the flag the same fault leaves it up, NOT_SERVING (the tests above).
TEST_F(CudaEmulatedServerTest, ExitOnDeviceLossExitsNonZeroAfterAnsweringTheFailedRequest) {
  TempDir armed;
  EmulatedGpuServer server({"--device", "cuda", "--layer", kLayer, "--exit-on-device-loss", "--drain-timeout-s", "5"},
                           ArmedFault(armed, 0));
  ASSERT_NE(server.process, nullptr) << server.error;
  Arm(armed);
  std::mt19937_64 rng(12);
  v1::ForwardResponse resp;
  const grpc::Status failed =
      server.client().Forward(Request(v1::FORM_FACTORED, testing::RandomVector(rng, 5 * kDModel), 1, 5), &resp);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::INTERNAL) << failed.error_message();
  // Signal 0 sends nothing: Stop only waits for the exit the server makes by itself.
  EXPECT_EQ(server.process->Stop(0, std::chrono::seconds(20)), 3) << server.process->Log();
  EXPECT_THAT(server.process->Log(), HasSubstr("lost (--exit-on-device-loss): draining"));
}

}  // namespace
}  // namespace attnserve
