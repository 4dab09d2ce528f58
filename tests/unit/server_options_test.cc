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
  EXPECT_EQ(o->threads, 3);
  EXPECT_EQ(o->workers, 2);
  EXPECT_EQ(o->max_message_mb, 1);
  EXPECT_EQ(o->log_level, "debug");
  EXPECT_TRUE(o->log_json);
  EXPECT_EQ(o->admin_token, "s3cret-s3cret-s3cret");
  EXPECT_EQ(o->port_file, "/tmp/p");
  EXPECT_EQ(o->max_queue_requests, 5);
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
  EXPECT_EQ(o->threads, 2) << "the flag wins over the file";
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
  EXPECT_EQ(o->threads, 2);
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
  EXPECT_EQ(o->max_batch_requests, 1);
  EXPECT_EQ(o->max_batch_tokens, 4096);
  EXPECT_EQ(o->max_queue_delay_us, 0);
  EXPECT_EQ(o->max_queue_requests, 256);  // default
  EXPECT_EQ(o->drain_timeout_s, 5);
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("max_batch_requests: 7\nmax_queue_delay_us: 250\ndrain_timeout_s: 12\n", "test.yaml",
                              &from_yaml)
                  .ok());
  EXPECT_EQ(from_yaml.max_batch_requests, 7);
  EXPECT_EQ(from_yaml.max_queue_delay_us, 250);
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
  EXPECT_EQ(defaults->max_device_memory_mb, 0);
  auto o = Parse({"--max-device-memory-mb", "40960"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->max_device_memory_mb, 40960);
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("max_device_memory_mb: 1234\n", "gpu.yaml", &from_yaml).ok());
  EXPECT_EQ(from_yaml.max_device_memory_mb, 1234);
  EXPECT_THAT(Parse({"--max-device-memory-mb", "-5"}).status().message(),
              HasSubstr("--max-device-memory-mb: expected an integer in [0, 1073741824], got '-5'"));
  EXPECT_THAT(ApplyYamlConfig("max_device_memory_mb: lots\n", "gpu.yaml", &from_yaml).message(),
              HasSubstr("gpu.yaml: max_device_memory_mb"));
}

TEST(ServerOptionsTest, CpuWeightLayoutFromFlagAndYaml) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_EQ(defaults->cpu_weight_layout, "auto");
  auto o = Parse({"--cpu-weight-layout", "plain"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->cpu_weight_layout, "plain");
  ServerOptions from_yaml;
  ASSERT_TRUE(ApplyYamlConfig("cpu_weight_layout: plain\n", "cpu.yaml", &from_yaml).ok());
  EXPECT_EQ(from_yaml.cpu_weight_layout, "plain");
  if (PanelWidth() > 0) {  // the bfloat16 panels need the backend's own kernel
    ASSERT_TRUE(ApplyYamlConfig("cpu_weight_layout: packed-bf16\n", "cpu.yaml", &from_yaml).ok());
    EXPECT_EQ(from_yaml.cpu_weight_layout, "packed-bf16");
  }
  EXPECT_THAT(Parse({"--cpu-weight-layout", "blocked"}).status().message(),
              HasSubstr("--cpu-weight-layout: cpu weight layout: expected auto, packed, packed-bf16 or plain, "
                        "got 'blocked'"));
}

// The two idle spins (the CPU backend's helpers, the batcher's workers): flag, YAML key, range.
TEST(ServerOptionsTest, IdleSpinsFromFlagAndYaml) {
  struct Spin {
    const char* flag;
    const char* key;
    int ServerOptions::*member;
    int default_us;
  };
  for (const Spin& spin : {Spin{"--cpu-idle-spin-us", "cpu_idle_spin_us", &ServerOptions::cpu_idle_spin_us, 500},
                           Spin{"--worker-idle-spin-us", "worker_idle_spin_us", &ServerOptions::worker_idle_spin_us,
                                500}}) {
    SCOPED_TRACE(spin.flag);
    auto defaults = Parse({});
    ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
    EXPECT_EQ((*defaults).*spin.member, spin.default_us);
    auto o = Parse({spin.flag, "0"});
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    EXPECT_EQ((*o).*spin.member, 0);
    ServerOptions from_yaml;
    ASSERT_TRUE(ApplyYamlConfig(std::string(spin.key) + ": 300\n", "spin.yaml", &from_yaml).ok());
    EXPECT_EQ(from_yaml.*spin.member, 300);
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
