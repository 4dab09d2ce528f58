// The CUDA backend's options as data (server/backend/cuda_options.h): every option survives the
// trip through the ABI's key=value struct, keys left out keep their defaults, and the decoder
// refuses a struct of another size or version, an unknown or repeated key and a bad value with a
// message naming the option, what it expects and what it got.
#include "server/backend/cuda_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Every field of CudaBackendOptions, written out here rather than read from the table: a field
// the table forgets fails the round trip.
void ExpectSameOptions(const CudaBackendOptions& a, const CudaBackendOptions& b) {
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.math, b.math);
  EXPECT_EQ(a.max_score_workspace_bytes, b.max_score_workspace_bytes);
  EXPECT_EQ(a.max_device_bytes, b.max_device_bytes);
  EXPECT_EQ(a.max_lane_workspace_bytes, b.max_lane_workspace_bytes);
  EXPECT_EQ(a.retain_workspace_bytes, b.retain_workspace_bytes);
  EXPECT_EQ(a.staging_slice_bytes, b.staging_slice_bytes);
  EXPECT_EQ(a.staging_threads, b.staging_threads);
  EXPECT_EQ(a.summed_mix_first, b.summed_mix_first);
  EXPECT_EQ(a.gemm_attention, b.gemm_attention);
  EXPECT_EQ(a.graph_rows, b.graph_rows);
  EXPECT_EQ(a.guard_zones, b.guard_zones);
}

// Options unlike the defaults in every field.
CudaBackendOptions RandomOptions(std::mt19937_64& rng) {
  auto bytes = [&rng] { return static_cast<int64_t>(rng() % (int64_t{1} << 40)) + 1; };
  CudaBackendOptions o;
  o.device = static_cast<int>(rng() % 8) + 1;
  o.math = static_cast<Math>(rng() % 3 + 1);  // tf32, bf16 or fp16
  o.max_score_workspace_bytes = bytes();
  o.max_device_bytes = bytes();
  o.max_lane_workspace_bytes = bytes();
  o.retain_workspace_bytes = bytes();
  o.staging_slice_bytes = bytes();
  o.staging_threads = static_cast<int>(rng() % 64) + 5;
  o.summed_mix_first = true;
  o.gemm_attention = true;
  o.graph_rows = static_cast<int>(rng() % 1000) + 1;
  o.guard_zones = true;
  return o;
}

StatusOr<CudaBackendOptions> Decode(const OptionPairs& pairs) {
  std::vector<AttnserveOption> items;
  const AttnserveOptions view = CudaOptionsView(pairs, &items);
  return DecodeCudaOptions(&view);
}

TEST(CudaOptionsTest, EveryOptionSurvivesTheRoundTrip) {
  std::mt19937_64 rng(47);
  for (int round = 0; round < 20; ++round) {
    const CudaBackendOptions sent = RandomOptions(rng);
    const OptionPairs pairs = EncodeCudaOptions(sent);
    std::set<std::string> keys;
    for (const auto& [key, value] : pairs) EXPECT_TRUE(keys.insert(key).second) << "key " << key << " twice";
    EXPECT_EQ(keys, (std::set<std::string>{"device", "math", "max_score_workspace_bytes", "max_device_bytes",
                                           "max_lane_workspace_bytes", "retain_workspace_bytes", "staging_slice_bytes",
                                           "staging_threads", "summed_mix_first", "gemm_attention", "graph_rows",
                                           "guard_zones"}));
    StatusOr<CudaBackendOptions> got = Decode(pairs);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ExpectSameOptions(*got, sent);
  }
  // The defaults too, and each field alone: no key's value lands in another's field.
  const CudaBackendOptions defaults;
  StatusOr<CudaBackendOptions> got = Decode(EncodeCudaOptions(defaults));
  ASSERT_TRUE(got.ok());
  ExpectSameOptions(*got, defaults);
  std::map<std::string, std::string> default_values;
  for (const auto& [key, value] : EncodeCudaOptions(defaults)) default_values[key] = value;
  for (const auto& pair : EncodeCudaOptions(RandomOptions(rng))) {
    SCOPED_TRACE(pair.first);
    StatusOr<CudaBackendOptions> one = Decode({pair});
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    for (const auto& [key, value] : EncodeCudaOptions(*one)) {
      EXPECT_EQ(value, key == pair.first ? pair.second : default_values[key]) << key;
    }
  }
}

TEST(CudaOptionsTest, KeysLeftOutKeepTheDefaults) {
  StatusOr<CudaBackendOptions> got = Decode({{"staging_threads", "9"}, {"summed_mix_first", "true"}});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  CudaBackendOptions expected;
  expected.staging_threads = 9;
  expected.summed_mix_first = true;
  ExpectSameOptions(*got, expected);
  StatusOr<CudaBackendOptions> none = Decode({});
  ASSERT_TRUE(none.ok());
  ExpectSameOptions(*none, CudaBackendOptions{});
}

TEST(CudaOptionsTest, AnUnknownKeyIsRefusedNamingItAndTheKnownOnes) {
  StatusOr<CudaBackendOptions> got = Decode({{"staging_threads", "2"}, {"stagging_threads", "3"}});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), AllOf(HasSubstr("CUDA backend option 'stagging_threads': unknown"),
                                            HasSubstr("expected one of device, math,"), HasSubstr("staging_threads")));
  EXPECT_THAT(Decode({{"math", "bf16"}, {"math", "fp32"}}).status().message(),
              HasSubstr("CUDA backend option 'math': expected once, got twice"));
}

TEST(CudaOptionsTest, BadValuesAreRefusedNamingOptionExpectedAndGot) {
  struct Bad {
    const char* key;
    const char* value;
    const char* expected;
  };
  for (const Bad& bad : {Bad{"staging_threads", "0", "an integer in [1, 1024]"},
                         Bad{"staging_threads", "four", "an integer in [1, 1024]"},
                         Bad{"staging_threads", "4 ", "an integer in [1, 1024]"},
                         Bad{"max_device_bytes", "-1", "an integer in [0, 1125899906842624]"},
                         Bad{"max_score_workspace_bytes", "0", "an integer in [1, 1125899906842624]"},
                         Bad{"staging_slice_bytes", "", "an integer in [1, 1125899906842624]"},
                         Bad{"device", "99999999999", "an integer in [0, 65536]"},
                         Bad{"summed_mix_first", "yes", "true or false"},
                         Bad{"math", "true", "fp32, tf32, bf16 or fp16"}, Bad{"math", "BF16", "fp32, tf32, bf16 or fp16"},
                         Bad{"math", "", "fp32, tf32, bf16 or fp16"}}) {
    SCOPED_TRACE(std::string(bad.key) + "=" + bad.value);
    StatusOr<CudaBackendOptions> got = Decode({{bad.key, bad.value}});
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(got.status().message(), std::string("CUDA backend option '") + bad.key + "': expected " + bad.expected +
                                          ", got '" + bad.value + "'");
  }
}

TEST(CudaOptionsTest, AStructOfAnotherSizeOrVersionIsRefused) {
  const OptionPairs pairs = EncodeCudaOptions(CudaBackendOptions{});
  std::vector<AttnserveOption> items;
  AttnserveOptions view = CudaOptionsView(pairs, &items);
  ASSERT_TRUE(DecodeCudaOptions(&view).ok());

  AttnserveOptions bigger = view;
  bigger.struct_size += 8;  // a caller whose struct grew a field
  EXPECT_THAT(DecodeCudaOptions(&bigger).status().message(),
              AllOf(HasSubstr("CUDA backend options: expected a struct of " + std::to_string(sizeof(AttnserveOptions)) +
                              " bytes, got " + std::to_string(sizeof(AttnserveOptions) + 8)),
                    HasSubstr("use the plugin built with this server")));
  AttnserveOptions newer = view;
  newer.version = ATTNSERVE_PLUGIN_OPTIONS_VERSION + 1;
  EXPECT_THAT(DecodeCudaOptions(&newer).status().message(),
              HasSubstr("CUDA backend options: expected version " + std::to_string(ATTNSERVE_PLUGIN_OPTIONS_VERSION) +
                        ", got version " + std::to_string(ATTNSERVE_PLUGIN_OPTIONS_VERSION + 1)));
  AttnserveOptions no_array = view;
  no_array.options = nullptr;
  EXPECT_THAT(DecodeCudaOptions(&no_array).status().message(), HasSubstr("got a null array"));
  EXPECT_THAT(DecodeCudaOptions(nullptr).status().message(), HasSubstr("expected an options struct, got none"));
}

}  // namespace
}  // namespace attnserve
