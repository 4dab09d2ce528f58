// The backend plugin boundary (server/backend/plugin_abi.h): the server loads a plugin of its
// own build, and refuses, before calling anything of it, one of another ABI version or another
// build, saying which. The plugins here are the CUDA plugin built over the emulated device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "server/backend/plugin_abi.h"
#include "server/backend/select.h"
#include "server/core/forms.h"
#include "server/core/layer.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(PluginAbiTest, ThePluginOfThisBuildLoads) {
  StatusOr<std::unique_ptr<Backend>> backend = LoadCudaPlugin(ATTNSERVE_GOOD_PLUGIN, 0, Math::kFp32);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_EQ((*backend)->DeviceName(), "cuda:0");
}

// The device memory bound crosses the boundary: a plugin backend given 1 MiB refuses weights
// that need more, naming the budget and the flag.
TEST(PluginAbiTest, TheDeviceMemoryBoundReachesThePlugin) {
  StatusOr<std::unique_ptr<Backend>> backend =
      LoadCudaPlugin(ATTNSERVE_GOOD_PLUGIN, 0, Math::kFp32, int64_t{1} << 20);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 512, .heads = 8}), 3);  // 4 MiB
  auto resident = (*backend)->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_FALSE(resident.ok());
  EXPECT_EQ(resident.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(resident.status().message(),
              AllOf(HasSubstr("device memory budget of 1.0 MiB"), HasSubstr("--max-device-memory-mb")));
}

TEST(PluginAbiTest, AnotherAbiVersionIsRefusedWithTheVersions) {
  StatusOr<std::unique_ptr<Backend>> backend = LoadCudaPlugin(ATTNSERVE_BAD_ABI_PLUGIN, 0, Math::kFp32);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(backend.status().message(),
              AllOf(HasSubstr("plugin ABI version 999"), HasSubstr("this server speaks version " + std::to_string(ATTNSERVE_PLUGIN_ABI_VERSION)),
                    HasSubstr("use the plugin built with this server")));
}

TEST(PluginAbiTest, AnotherBuildIsRefusedNamingBoth) {
  StatusOr<std::unique_ptr<Backend>> backend = LoadCudaPlugin(ATTNSERVE_BAD_BUILD_PLUGIN, 0, Math::kFp32);
  ASSERT_FALSE(backend.ok());
  EXPECT_THAT(backend.status().message(),
              AllOf(HasSubstr("plugin from build '0.0.1+someothercommit-GNU1.0'"), HasSubstr("this server is build '")));
}

TEST(PluginAbiTest, SomethingElseIsNotAPlugin) {
  StatusOr<std::unique_ptr<Backend>> backend = LoadCudaPlugin("libm.so.6", 0, Math::kFp32);
  ASSERT_FALSE(backend.ok());
  EXPECT_THAT(backend.status().message(), HasSubstr("not an attnserve backend plugin"));
  EXPECT_THAT(LoadCudaPlugin("/nonexistent/libattnserve_cuda.so", 0, Math::kFp32).status().message(),
              HasSubstr("cannot load the CUDA backend"));
}

}  // namespace
}  // namespace attnserve
