// attnserve-cli bench against the real attnserve binary on loopback: a short run of two forms at
// two concurrency levels with every output file, and the refusals (a form the layer lacks, a
// layer that does not exist). Each run is bounded to about a second.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/server_process.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::RunToExit;
using testing::ServerProcess;
using testing::TempDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class BenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    server_ = ServerProcess::Start(ATTNSERVE_BINARY,
                                   {"--threads", "1", "--layer", "small=random:d_model=64,heads=4,seed=5", "--layer",
                                    "factored-only=random:d_model=32,heads=4,seed=3,summed=false"},
                                   &error)
                  .release();
    ASSERT_NE(server_, nullptr) << error;
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  // attnserve-cli --target <server> bench ARGS; returns the exit status.
  static int Bench(std::vector<std::string> args, std::string* output) {
    args.insert(args.begin(), {"--target", server_->target(), "bench"});
    return RunToExit(ATTNSERVE_CLI_BINARY, args, output, std::chrono::seconds(60));
  }

  static ServerProcess* server_;
};

ServerProcess* BenchTest::server_ = nullptr;

TEST_F(BenchTest, ShortRunWritesEveryFile) {
  TempDir dir;
  std::string out;
  const int code = Bench({"--layer",       "small",
                          "--forms",       "factored,summed",
                          "--shape",       "2,8",
                          "--concurrency", "1,4",
                          "--duration",    "600ms",
                          "--warmup",      "100ms",
                          "--slice",       "50ms",
                          "--json",        dir.File("b.json"),
                          "--csv",         dir.File("b.csv"),
                          "--plot",        dir.File("b.svg")},
                         &out);
  ASSERT_EQ(code, 0) << out << server_->Log();
  EXPECT_THAT(out, HasSubstr("layer=small shape=[2, 8, 64]"));
  EXPECT_THAT(out, HasSubstr("requests_per_s"));
  EXPECT_THAT(out, HasSubstr("ratio summed/factored: requests_per_s c1="));
  // stdout is a file here, not a terminal: no progress line.
  EXPECT_THAT(out, ::testing::Not(HasSubstr("\r")));

  const nlohmann::json j = nlohmann::json::parse(ReadFile(dir.File("b.json")));
  ASSERT_EQ(j.size(), 4u) << j.dump(1);
  for (const auto& rec : j) {
    EXPECT_EQ(rec["layer"], "small");
    EXPECT_EQ(rec["batch"], 2);
    EXPECT_EQ(rec["n"], 8);
    EXPECT_EQ(rec["errors"], 0) << rec;
    EXPECT_GT(rec["requests"].get<int64_t>(), 0) << rec;
    EXPECT_GT(rec["requests_per_s"].get<double>(), 0) << rec;
    EXPECT_NEAR(rec["tokens_per_s"].get<double>() / rec["requests_per_s"].get<double>(), 16, 1e-6) << rec;
    // The server's own split: it computed something, and batches hold at least one request.
    EXPECT_GT(rec["compute_us"].get<double>(), 0) << rec;
    EXPECT_GE(rec["batch_requests"].get<double>(), 1) << rec;
    EXPECT_GT(rec["p50_ms"].get<double>(), 0) << rec;
    EXPECT_LE(rec["p50_ms"].get<double>(), rec["p99_ms"].get<double>()) << rec;
    EXPECT_LE(rec["p99_ms"].get<double>(), rec["max_ms"].get<double>()) << rec;
    // Client latency includes the server's compute.
    EXPECT_GE(rec["max_ms"].get<double>() * 1000, rec["compute_us"].get<double>()) << rec;
  }
  const std::string csv = ReadFile(dir.File("b.csv"));
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5) << csv;
  EXPECT_EQ(csv.rfind("layer,form,batch,n,m,causal,concurrency,requests,errors,", 0), 0u) << csv;

  std::string svg_check;
  EXPECT_EQ(RunToExit(ATTNSERVE_PYTHON,
                      {std::string(ATTNSERVE_TEST_TOOLS_DIR) + "/check_bench_svg.py", dir.File("b.svg"),
                       "factored,summed", "2"},
                      &svg_check),
            0)
      << svg_check;
}

TEST_F(BenchTest, CrossAttentionCausalByCount) {
  TempDir dir;
  std::string out;
  const int code = Bench({"--layer", "small", "--forms", "summed", "--shape", "1,4,6", "--causal", "--requests", "20",
                          "--warmup", "0", "--interleave", "request", "--json", dir.File("b.json")},
                         &out);
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(ReadFile(dir.File("b.json")));
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["form"], "summed");
  EXPECT_EQ(j[0]["m"], 6);
  EXPECT_GE(j[0]["requests"].get<int64_t>(), 20);
  EXPECT_EQ(j[0]["errors"], 0);
}

TEST_F(BenchTest, FormTheLayerLacksIsRefusedUpFront) {
  std::string out;
  EXPECT_EQ(Bench({"--layer", "factored-only", "--shape", "1,4", "--requests", "5"}, &out), 1) << out;
  EXPECT_THAT(out, HasSubstr("error: FAILED_PRECONDITION: layer 'factored-only' does not hold the summed form"));
}

TEST_F(BenchTest, UnknownLayerIsNotFound) {
  std::string out;
  EXPECT_EQ(Bench({"--layer", "nope", "--shape", "1,4", "--requests", "5"}, &out), 1) << out;
  EXPECT_THAT(out, HasSubstr("error: NOT_FOUND"));
}

}  // namespace
}  // namespace attnserve
