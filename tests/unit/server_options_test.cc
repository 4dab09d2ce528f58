// The attnserve binary's flags and YAML config (server/server_options.h).
#include "server/server_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "server/backend/cpu/skinny_gemm.h"  // PanelWidth: where packed-bf16 is accepted

namespace attnserve {
namespace {

using ::testing::HasSubstr;

StatusOr<ServerOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "attnserve");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return ParseServerOptions(static_cast<int>(argv.size()), argv.data());
}

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/attnserve_options_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  const ssize_t written = write(fd, text.data(), text.size());
  EXPECT_EQ(written, static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

TEST(ServerOptionsTest, DefaultsServeTheDemoLayer) {
  StatusOr<ServerOptions> o = Parse({});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->listen, "0.0.0.0:50051");
  EXPECT_EQ(o->max_message_mb, 64);
  ASSERT_EQ(o->layers.size(), 1u);
  EXPECT_EQ(o->layers[0].first, "demo");
  EXPECT_EQ(o->layers[0].second, "random:d_model=768,heads=12,seed=1");
}

TEST(ServerOptionsTest, FlagsInBothSpellings) {
  StatusOr<ServerOptions> o =
      Parse({"--listen", "127.0.0.1:0", "--layer=a=random:d_model=8,heads=2", "--layer", "b=safetensors:/x.st",
             "--threads=3", "--workers", "2", "--max-message-mb", "1", "--log-level=debug", "--log-json",
             "--admin-token", "s3cret-s3cret-s3cret", "--port-file", "/tmp/p", "--max-queue-requests=5", "--max-scores-m", "16"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->listen, "127.0.0.1:0");
  ASSERT_EQ(o->layers.size(), 2u);
  EXPECT_EQ(o->layers[0], std::make_pair(std::string("a"), std::string("random:d_model=8,heads=2")));
  EXPECT_EQ(o->layers[1].second, "safetensors:/x.st");
  EXPECT_EQ(o->backend.cpu.threads, 3);
  EXPECT_EQ(o->batching.workers, 2);
  EXPECT_EQ(o->max_message_mb, 1);
  EXPECT_EQ(o->log_level, "debug");
  EXPECT_TRUE(o->log_json);
  EXPECT_EQ(o->admin_token, "s3cret-s3cret-s3cret");
  EXPECT_EQ(o->port_file, "/tmp/p");
  EXPECT_EQ(o->batching.max_queue_requests, 5);
  EXPECT_EQ(o->max_scores_m, 16);
}

// Without a token the admin listener must be reachable from this machine only: a literal
// loopback address, or localhost. A name that merely starts like one resolves anywhere.
TEST(ServerOptionsTest, AdminListenWithoutATokenTakesOnlyLoopbackAddresses) {
  for (const char* host : {"127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]", "localhost"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"127.x.example", "127.example.com", "127.0.0.1.nip.io", "127.", "127.0.0.256", "10.0.0.1",
                           "192.168.1.1", "0.0.0.0", "::", "[::]", "::ffff:10.0.0.1", "", "localhost.example.com",
                           "[127.0.0.1]"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
  // Through the flags, as an operator meets it: the refusal names the field and what it got.
  for (const char* listen : {"127.x.example:9000", "127.example.com:9000", "10.0.0.1:9000", "192.168.1.1:9000",
                             "0.0.0.0:9000", "[::]:9000"}) {
    auto o = Parse({"--admin-listen", listen});
    ASSERT_FALSE(o.ok()) << listen;
    EXPECT_THAT(o.status().message(), HasSubstr("admin_listen")) << listen;
    EXPECT_THAT(o.status().message(), HasSubstr(listen));
    // With a token the operator chose the network: accepted.
    EXPECT_TRUE(Parse({"--admin-listen", listen, "--admin-token", "0123456789abcdef0123"}).ok()) << listen;
  }
  for (const char* listen : {"127.0.0.1:9000", "127.3.4.5:0", "[::1]:9000", "localhost:9000"}) {
    EXPECT_TRUE(Parse({"--admin-listen", listen}).ok()) << listen;
  }
}

TEST(ServerOptionsTest, YamlFileWithFlagsOverriding) {
  const std::string path = WriteTemp(
      "listen: 127.0.0.1:6000\n"
      "threads: 4\n"
      "max_message_mb: 8\n"
      "max_scores_m: 100\n"
      "log_level: warn\n"
      "log_json: true\n"
      "layers:\n"
      "  small: random:d_model=8,heads=2\n"
      "  big: random:d_model=64,heads=4\n");
  StatusOr<ServerOptions> o = Parse({"--config", path, "--threads", "2", "--layer", "big=random:d_model=16,heads=2"});
  std::remove(path.c_str());
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->listen, "127.0.0.1:6000");
  EXPECT_EQ(o->backend.cpu.threads, 2) << "the flag wins over the file";
  EXPECT_EQ(o->max_message_mb, 8);
  EXPECT_EQ(o->max_scores_m, 100);
  EXPECT_EQ(o->log_level, "warn");
  EXPECT_TRUE(o->log_json);
  ASSERT_EQ(o->layers.size(), 2u);
  EXPECT_EQ(o->layers[1], std::make_pair(std::string("big"), std::string("random:d_model=16,heads=2")));
}

TEST(ServerOptionsTest, ConfigIsReadFirstWhereverItStands) {
  const std::string path = WriteTemp("threads: 4\n");
  StatusOr<ServerOptions> o = Parse({"--threads", "2", "--config", path});
  std::remove(path.c_str());
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->backend.cpu.threads, 2);
}

TEST(ServerOptionsTest, Errors) {
  EXPECT_THAT(Parse({"--bogus"}).status().message(), HasSubstr("unknown flag '--bogus'"));
  EXPECT_THAT(Parse({"--threads"}).status().message(), HasSubstr("--threads: expected a value"));
  EXPECT_THAT(Parse({"--threads", "x"}).status().message(), HasSubstr("--threads: expected an integer"));
  EXPECT_THAT(Parse({"--max-message-mb", "0"}).status().message(), HasSubstr("[1, 2047]"));
  EXPECT_THAT(Parse({"--max-message-mb", "4096"}).status().message(), HasSubstr("got '4096'"));
  EXPECT_THAT(Parse({"--log-level", "loud"}).status().message(), HasSubstr("got 'loud'"));
  EXPECT_THAT(Parse({"--layer", "nosource"}).status().message(), HasSubstr("NAME=SOURCE"));
  EXPECT_THAT(Parse({"--layer", "=random:x"}).status().message(), HasSubstr("NAME=SOURCE"));
  EXPECT_THAT(Parse({"--layer", "bad name=random:x"}).status().message(), HasSubstr("layer name"));
  EXPECT_THAT(Parse({"--config", "/nonexistent/x.yaml"}).status().message(), HasSubstr("cannot read"));
  EXPECT_THAT(Parse({"--log-json=maybe"}).status().message(), HasSubstr("true or false"));
}

TEST(ServerOptionsTest, YamlErrorsNameTheKey) {
  ServerOptions o;
  EXPECT_THAT(ApplyYamlConfig("thraeds: 2\n", "f.yaml", &o).message(), HasSubstr("f.yaml: thraeds: unknown key"));
  EXPECT_THAT(ApplyYamlConfig("threads: many\n", "f.yaml", &o).message(), HasSubstr("f.yaml: threads"));
  EXPECT_THAT(ApplyYamlConfig("layers: [a, b]\n", "f.yaml", &o).message(), HasSubstr("NAME: SOURCE"));
  EXPECT_THAT(ApplyYamlConfig("- 1\n- 2\n", "f.yaml", &o).message(), HasSubstr("mapping"));
  EXPECT_THAT(ApplyYamlConfig("listen: [\n", "f.yaml", &o).message(), HasSubstr("not valid YAML"));
  EXPECT_TRUE(ApplyYamlConfig("", "f.yaml", &o).ok());
}

TEST(ServerOptionsTest, AdminTokenFromEnvironmentHasLowestPrecedence) {
  setenv("ATTNSERVE_ADMIN_TOKEN", "from-env-0123456789", 1);
  EXPECT_EQ(Parse({})->admin_token, "from-env-0123456789");
  EXPECT_EQ(Parse({"--admin-token", "from-flag-0123456789"})->admin_token, "from-flag-0123456789");
  unsetenv("ATTNSERVE_ADMIN_TOKEN");
}

TEST(ServerOptionsTest, HelpNamesEveryFlag) {
  const std::string usage = UsageText();
  for (const char* flag :
       {"--listen", "--port-file", "--layer", "--threads", "--workers", "--max-batch-requests", "--max-batch-tokens",
        "--max-queue-delay-us", "--max-queue-requests", "--drain-timeout-s", "--max-message-mb", "--max-scores-m",
        "--log-level", "--log-json", "--admin-token", "--config", "--help", "--version"}) {
    EXPECT_THAT(usage, HasSubstr(flag));
  }
  EXPECT_TRUE(Parse({"--help"})->help);
  EXPECT_TRUE(Parse({"--version"})->version);
}

TEST(ServerOptionsTest, BatchingSettingsFromFlagsAndYaml) {
  auto o = Parse({"--max-batch-requests", "1", "--max-batch-tokens=4096", "--max-queue-delay-us", "0",
                  "--drain-timeout-s", "5"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->batching.max_batch_requests, 1);
  EXPECT_EQ(o->batching.max_batch_tokens, 4096);
  EXPECT_EQ(o->batching.max_queue_delay.count(), 0);
  EXPECT_EQ(o->batching.max_queue_requests, 256);  // default
  EXPECT_EQ(o->drain_timeout_s, 5);
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("max_batch_requests: 7\nmax_queue_delay_us: 250\ndrain_timeout_s: 12\n", "test.yaml",
                              &from_yaml)
                  .ok());
  EXPECT_EQ(from_yaml.batching.max_batch_requests, 7);
  EXPECT_EQ(from_yaml.batching.max_queue_delay.count(), 250);
  EXPECT_EQ(from_yaml.drain_timeout_s, 12);
  EXPECT_THAT(Parse({"--max-batch-requests", "0"}).status().message(),
              HasSubstr("--max-batch-requests: expected an integer in [1, 4096], got '0'"));
  EXPECT_THAT(Parse({"--drain-timeout-s", "-1"}).status().message(), HasSubstr("--drain-timeout-s"));
  EXPECT_THAT(ApplyYamlConfig("max_queue_requests: 0\n", "c.yaml", &from_yaml).message(),
              HasSubstr("max_queue_requests"));
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// The GPU's device memory bound: 0 (the default) leaves it to the backend, 90 % of the card.
TEST(ServerOptionsTest, MaxDeviceMemoryFromFlagAndYaml) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_EQ(defaults->backend.cuda.max_device_bytes, 0);
  auto o = Parse({"--max-device-memory-mb", "40960"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backend.cuda.max_device_bytes, int64_t{40960} << 20);
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("max_device_memory_mb: 1234\n", "gpu.yaml", &from_yaml).ok());
  EXPECT_EQ(from_yaml.backend.cuda.max_device_bytes, int64_t{1234} << 20);
  EXPECT_THAT(Parse({"--max-device-memory-mb", "-5"}).status().message(),
              HasSubstr("--max-device-memory-mb: expected an integer in [0, 1073741824], got '-5'"));
  EXPECT_THAT(ApplyYamlConfig("max_device_memory_mb: lots\n", "gpu.yaml", &from_yaml).message(),
              HasSubstr("gpu.yaml: max_device_memory_mb"));
}

TEST(ServerOptionsTest, CpuWeightLayoutFromFlagAndYaml) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_EQ(defaults->backend.cpu.weight_layout, *ParseWeightLayout("auto"));
  auto o = Parse({"--cpu-weight-layout", "plain"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backend.cpu.weight_layout, WeightLayout::kPlain);
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("cpu_weight_layout: plain\n", "cpu.yaml", &from_yaml).ok());
  EXPECT_EQ(from_yaml.backend.cpu.weight_layout, WeightLayout::kPlain);
  if (PanelWidth() > 0) {  // the bfloat16 panels need the backend's own kernel
    ASSERT_TRUE(ApplyYamlConfig("cpu_weight_layout: packed-bf16\n", "cpu.yaml", &from_yaml).ok());
    EXPECT_EQ(from_yaml.backend.cpu.weight_layout, WeightLayout::kPackedBf16);
    ASSERT_TRUE(Parse({"--cpu-weight-layout", "packed-fp16"}).ok());
    EXPECT_EQ(Parse({"--cpu-weight-layout", "packed-fp16"})->backend.cpu.weight_layout, WeightLayout::kPackedFp16);
  }
  EXPECT_THAT(Parse({"--cpu-weight-layout", "blocked"}).status().message(),
              HasSubstr("--cpu-weight-layout: cpu weight layout: expected auto, packed, packed-bf16, packed-bf16-dot, "
                        "packed-fp16 or plain, got 'blocked'"));
}

// The two idle spins (the CPU backend's helpers, the batcher's workers): flag, YAML key, range.
TEST(ServerOptionsTest, IdleSpinsFromFlagAndYaml) {
  struct Spin {
    const char* flag;
    const char* key;
    int64_t (*us)(const ServerOptions&);
    int default_us;
  };
  for (const Spin& spin :
       {Spin{"--cpu-idle-spin-us", "cpu_idle_spin_us",
             [](const ServerOptions& o) -> int64_t { return o.backend.cpu.idle_spin.count(); }, 500},
        Spin{"--worker-idle-spin-us", "worker_idle_spin_us",
             [](const ServerOptions& o) -> int64_t { return o.batching.idle_spin.count(); }, 500}}) {
    SCOPED_TRACE(spin.flag);
    auto defaults = Parse({});
    ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
    EXPECT_EQ(spin.us(*defaults), spin.default_us);
    auto o = Parse({spin.flag, "0"});
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    EXPECT_EQ(spin.us(*o), 0);
    ServerOptions from_yaml;
    ASSERT_TRUE(ApplyYamlConfig(std::string(spin.key) + ": 300\n", "spin.yaml", &from_yaml).ok());
    EXPECT_EQ(spin.us(from_yaml), 300);
    EXPECT_THAT(Parse({spin.flag, "2000000"}).status().message(),
                AllOf(HasSubstr(spin.flag), HasSubstr("[0, 1000000]"), HasSubstr("got '2000000'")));
    EXPECT_THAT(Parse({spin.flag, "-1"}).status().message(), HasSubstr(spin.flag));
  }
  ServerOptions from_yaml;
  // The OpenMP spin count that --cpu-idle-spin-us replaced is gone with OpenMP's threads: refused, saying
  // what replaced it.
  EXPECT_THAT(Parse({"--omp-spin-count", "30000"}).status().message(),
              AllOf(HasSubstr("--omp-spin-count: removed"), HasSubstr("--cpu-idle-spin-us")));
  EXPECT_THAT(ApplyYamlConfig("omp_spin_count: 30000\n", "cpu.yaml", &from_yaml).message(),
              AllOf(HasSubstr("omp_spin_count: removed"), HasSubstr("cpu_idle_spin_us")));
}

// docs/service.md's flag table and the settings table in server_options.cc say the same thing:
// every flag and its YAML key in a row, and no row for a flag the server does not have.
TEST(ServerOptionsTest, TheDocumentedFlagTableIsTheCodes) {
  std::ifstream doc(std::string(ATTNSERVE_SOURCE_DIR) + "/docs/service.md");
  ASSERT_TRUE(doc.good());
  std::map<std::string, std::string> rows;  // flag → the whole row
  std::string line;
  while (std::getline(doc, line)) {
    if (!line.starts_with("| `--")) continue;
    const std::string first_cell = line.substr(2, line.find(" | ") - 2);
    for (size_t at = first_cell.find("`--"); at != std::string::npos; at = first_cell.find("`--", at + 1)) {
      const size_t end = first_cell.find_first_of(" `", at + 1);
      rows[first_cell.substr(at + 1, end - at - 1)] = line;
    }
  }
  std::set<std::string> flags;
  for (const SettingDoc& s : SettingDocs()) {
    if (s.flag.empty()) continue;
    flags.insert(s.flag);
    ASSERT_TRUE(rows.count(s.flag)) << s.flag << " is missing from docs/service.md's flag table";
    if (!s.key.empty()) {
      EXPECT_THAT(rows[s.flag], HasSubstr("`" + s.key)) << s.flag << ": YAML key " << s.key;
    }
    EXPECT_THAT(UsageText(), HasSubstr(s.flag));
  }
  for (const auto& [flag, row] : rows) EXPECT_TRUE(flags.count(flag)) << flag << " is documented but not a flag";
}


// A deployment that still sets the old score-memory bound learns why it went and what replaced
// it, as a flag and as a config key.
TEST(ServerOptionsTest, RemovedSettingsSayWhatReplacedThem) {
  Status flag = Parse({"--max-scores-mb", "16"}).status();
  EXPECT_EQ(flag.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(flag.message(), AllOf(HasSubstr("--max-scores-mb: removed"), HasSubstr("--max-scores-m")));
  const std::string path = WriteTemp("max_scores_mb: 100\n");
  Status key = Parse({"--config", path}).status();
  std::remove(path.c_str());
  EXPECT_EQ(key.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(key.message(), AllOf(HasSubstr("max_scores_mb: removed"), HasSubstr("max_scores_m")));
  EXPECT_THAT(Parse({"--max-scores-mbx", "1"}).status().message(), HasSubstr("unknown flag '--max-scores-mbx'"));
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// The CUDA backend's settings: each flag and key lands in BackendOptions::cuda in the backend's
// own units, the defaults are the backend's (what the server ran with before they were
// settings), and a bad value names the flag, the range and what was given.
TEST(ServerOptionsTest, GpuSettingsFromFlagAndYaml) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  const CudaBackendOptions backend_defaults;
  const CudaBackendOptions& d = defaults->backend.cuda;
  EXPECT_EQ(d.math, backend_defaults.math);
  EXPECT_EQ(d.max_device_bytes, backend_defaults.max_device_bytes);
  EXPECT_EQ(d.max_lane_workspace_bytes, backend_defaults.max_lane_workspace_bytes);
  EXPECT_EQ(d.max_score_workspace_bytes, int64_t{256} << 20);
  EXPECT_EQ(d.retain_workspace_bytes, int64_t{256} << 20);
  EXPECT_EQ(d.staging_slice_bytes, int64_t{4} << 20);
  EXPECT_EQ(d.staging_threads, 4);
  EXPECT_FALSE(d.summed_mix_first);
  EXPECT_FALSE(d.gemm_attention);
  EXPECT_EQ(d.graph_rows, 0) << "graphs are off until measured on a device";
  EXPECT_FALSE(d.guard_zones);

  auto o = Parse({"--gpu-math", "tf32", "--gpu-staging-threads", "7", "--gpu-summed-mix-first",
                  "--gpu-max-score-workspace-mb", "33", "--gpu-max-lane-workspace-mb=65", "--gpu-retain-workspace-mb",
                  "0", "--gpu-staging-slice-kb", "513", "--gpu-gemm-attention", "--gpu-graphs", "24"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const CudaBackendOptions& c = o->backend.cuda;
  EXPECT_EQ(c.math, Math::kTf32);
  for (const auto& [text, math] : {std::pair{"bf16", Math::kBf16}, std::pair{"fp16", Math::kFp16},
                                   std::pair{"fp32", Math::kFp32}}) {
    auto parsed = Parse({"--gpu-math", text});
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->backend.cuda.math, math) << text;
  }
  EXPECT_EQ(c.staging_threads, 7);
  EXPECT_TRUE(c.summed_mix_first);
  EXPECT_TRUE(c.gemm_attention);
  EXPECT_EQ(c.graph_rows, 24);
  EXPECT_EQ(c.max_score_workspace_bytes, int64_t{33} << 20);
  EXPECT_EQ(c.max_lane_workspace_bytes, int64_t{65} << 20);
  EXPECT_EQ(c.retain_workspace_bytes, 0);
  EXPECT_EQ(c.staging_slice_bytes, int64_t{513} << 10);

  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("gpu_staging_threads: 3\ngpu_summed_mix_first: true\ngpu_max_lane_workspace_mb: 9\n"
                              "gpu_math: tf32\n",
                              "gpu.yaml", &from_yaml)
                  .ok());
  EXPECT_EQ(from_yaml.backend.cuda.staging_threads, 3);
  EXPECT_TRUE(from_yaml.backend.cuda.summed_mix_first);
  EXPECT_EQ(from_yaml.backend.cuda.max_lane_workspace_bytes, int64_t{9} << 20);
  EXPECT_EQ(from_yaml.backend.cuda.math, Math::kTf32);
  auto off = Parse({"--gpu-summed-mix-first=false"});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->backend.cuda.summed_mix_first);

  struct Bad {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Bad& bad :
       {Bad{{"--gpu-staging-threads", "0"}, "--gpu-staging-threads: expected an integer in [1, 1024], got '0'"},
        Bad{{"--gpu-staging-threads", "many"}, "--gpu-staging-threads: expected an integer in [1, 1024], got 'many'"},
        Bad{{"--gpu-max-score-workspace-mb", "0"},
            "--gpu-max-score-workspace-mb: expected an integer in [1, 1073741824], got '0'"},
        Bad{{"--gpu-max-lane-workspace-mb", "-1"},
            "--gpu-max-lane-workspace-mb: expected an integer in [0, 1073741824], got '-1'"},
        Bad{{"--gpu-retain-workspace-mb", "2147483648"},
            "--gpu-retain-workspace-mb: expected an integer in [0, 1073741824], got '2147483648'"},
        Bad{{"--gpu-staging-slice-kb", "0"}, "--gpu-staging-slice-kb: expected an integer in [1, 1073741824], got '0'"},
        Bad{{"--gpu-summed-mix-first=maybe"}, "--gpu-summed-mix-first: expected true or false, got 'maybe'"},
        Bad{{"--gpu-math", "fp8"}, "--gpu-math: expected fp32, tf32, bf16 or fp16, got 'fp8'"},
        Bad{{"--gpu-math", "BF16"}, "--gpu-math: expected fp32, tf32, bf16 or fp16, got 'BF16'"}}) {
    SCOPED_TRACE(bad.args[0]);
    StatusOr<ServerOptions> got = Parse(bad.args);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(got.status().message(), bad.message);
  }
  EXPECT_THAT(ApplyYamlConfig("gpu_staging_threads: 0\n", "gpu.yaml", &from_yaml).message(),
              HasSubstr("gpu.yaml: gpu_staging_threads: expected an integer in [1, 1024], got '0'"));
}

// The enums are parsed once, at the settings: the CPU backend's GEMM library arrives typed, and
// the default every enum row shows ("auto", "fp32") is what its field holds when not set.
TEST(ServerOptionsTest, EnumsAreParsedOnceAndTheirShownDefaultsAreTheDefaults) {
  auto o = Parse({"--cpu-gemm", "eigen"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->backend.cpu.gemm, GemmLibrary::kEigen);
  EXPECT_THAT(Parse({"--cpu-gemm", "mkl"}).status().message(), AllOf(HasSubstr("--cpu-gemm: "), HasSubstr("'mkl'")));
  const ServerOptions defaults;
  for (const SettingDoc& s : SettingDocs()) {
    if (s.flag != "--cpu-gemm" && s.flag != "--cpu-weight-layout" && s.flag != "--gpu-math") continue;
    SCOPED_TRACE(s.flag);
    auto shown = Parse({s.flag, s.default_value});
    ASSERT_TRUE(shown.ok()) << shown.status().ToString();
    EXPECT_EQ(shown->backend.cpu.gemm, defaults.backend.cpu.gemm);
    EXPECT_EQ(shown->backend.cpu.weight_layout, defaults.backend.cpu.weight_layout);
    EXPECT_EQ(shown->backend.cuda.math, defaults.backend.cuda.math);
  }
}

// What the flags set is what the plugin receives: ChooseBackend loads the plugin that
// ATTNSERVE_CUDA_PLUGIN_PATH names, here one that answers with the options it was given.
TEST(ServerOptionsTest, TheGpuFlagsReachThePlugin) {
  if (!BuiltWithCuda()) GTEST_SKIP() << "this build's server loads no CUDA plugin";
  auto o = Parse({"--device", "cuda:2", "--gpu-math", "tf32", "--gpu-staging-threads", "6", "--gpu-summed-mix-first",
                  "--max-device-memory-mb", "3000", "--gpu-max-lane-workspace-mb", "700",
                  "--gpu-max-score-workspace-mb", "64", "--gpu-retain-workspace-mb", "32", "--gpu-staging-slice-kb",
                  "256", "--gpu-gemm-attention", "--gpu-graphs", "32"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  setenv("ATTNSERVE_CUDA_PLUGIN_PATH", ATTNSERVE_ECHO_PLUGIN, 1);
  StatusOr<ChosenBackend> chosen = ChooseBackend(o->backend);
  unsetenv("ATTNSERVE_CUDA_PLUGIN_PATH");
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(),
              HasSubstr(" device=2 math=tf32 max_score_workspace_bytes=67108864 max_device_bytes=3145728000 "
                        "max_lane_workspace_bytes=734003200 retain_workspace_bytes=33554432 staging_slice_bytes=262144 "
                        "staging_threads=6 summed_mix_first=true gemm_attention=true graph_rows=32 guard_zones=false"));
}

}  // namespace
}  // namespace attnserve
