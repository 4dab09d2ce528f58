// The backend's options across the plugin boundary (server/backend/plugin_abi.h): LoadCudaPlugin
// sends every option as key=value data in a struct of this build's size and version (seen raw
// by a plugin that echoes them), and the CUDA plugin refuses one it cannot take with a message
// naming the option, what it expects and what it got.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "server/backend/plugin_abi.h"
#include "server/backend/select.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(PluginOptionsTest, EveryOptionCrossesAsKeyAndValue) {
  const CudaBackendOptions options{.device = 3,
                                   .math = Math::kBf16,
                                   .max_score_workspace_bytes = 123456789,
                                   .max_device_bytes = int64_t{5} << 30,
                                   .max_lane_workspace_bytes = 987654321,
                                   .retain_workspace_bytes = 7777,
                                   .staging_slice_bytes = 65536,
                                   .staging_threads = 11,
                                   .summed_mix_first = true,
                                   .gemm_attention = true,
                                   .graph_rows = 48,
                                   .guard_zones = true};
  StatusOr<std::unique_ptr<Backend>> echo = LoadCudaPlugin(ATTNSERVE_ECHO_PLUGIN, options);
  ASSERT_FALSE(echo.ok());
  // Written out by hand: what a plugin of this build must receive.
  EXPECT_EQ(echo.status().message(),
            "echo: struct_size=" + std::to_string(sizeof(AttnserveOptions)) +
                " version=" + std::to_string(ATTNSERVE_PLUGIN_OPTIONS_VERSION) +
                " device=3 math=bf16 max_score_workspace_bytes=123456789 max_device_bytes=5368709120"
                " max_lane_workspace_bytes=987654321 retain_workspace_bytes=7777 staging_slice_bytes=65536"
                " staging_threads=11 summed_mix_first=true gemm_attention=true graph_rows=48 guard_zones=true");
}

// The positional form the tests used before options crossed as data sends the same keys.
TEST(PluginOptionsTest, TheShortFormSendsTheDefaultsForTheRest) {
  StatusOr<std::unique_ptr<Backend>> echo = LoadCudaPlugin(ATTNSERVE_ECHO_PLUGIN, 1, Math::kFp32, int64_t{1} << 20);
  ASSERT_FALSE(echo.ok());
  EXPECT_THAT(echo.status().message(),
              AllOf(HasSubstr(" device=1 math=fp32 max_score_workspace_bytes=268435456 max_device_bytes=1048576 "
                              "max_lane_workspace_bytes=0 retain_workspace_bytes=268435456 "
                              "staging_slice_bytes=4194304 staging_threads=4 summed_mix_first=false "
                              "gemm_attention=false graph_rows=0 guard_zones=false")));
}

// The CUDA plugin (over the emulated device) takes every option, and refuses a value out of its
// range before making anything, naming it.
TEST(PluginOptionsTest, TheCudaPluginTakesEveryOptionAndRefusesABadOne) {
  CudaBackendOptions options{.math = Math::kFp16,
                             .max_score_workspace_bytes = int64_t{8} << 20,
                             .max_device_bytes = int64_t{512} << 20,
                             .max_lane_workspace_bytes = int64_t{128} << 20,
                             .retain_workspace_bytes = int64_t{16} << 20,
                             .staging_slice_bytes = int64_t{1} << 20,
                             .staging_threads = 2,
                             .summed_mix_first = true,
                             .gemm_attention = true,
                             .graph_rows = 16,
                             .guard_zones = true};
  StatusOr<std::unique_ptr<Backend>> backend = LoadCudaPlugin(ATTNSERVE_GOOD_PLUGIN, options);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_EQ((*backend)->DeviceName(), "cuda:0");

  options.staging_threads = 0;
  backend = LoadCudaPlugin(ATTNSERVE_GOOD_PLUGIN, options);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(backend.status().message(),
            "CUDA backend option 'staging_threads': expected an integer in [1, 1024], got '0'");
  options.staging_threads = 2;
  options.max_score_workspace_bytes = 0;
  EXPECT_THAT(LoadCudaPlugin(ATTNSERVE_GOOD_PLUGIN, options).status().message(),
              HasSubstr("CUDA backend option 'max_score_workspace_bytes': expected an integer in [1, "));
}

}  // namespace
}  // namespace attnserve
