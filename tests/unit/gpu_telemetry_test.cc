// GPU telemetry through NVML loaded at run time (server/metrics/gpu_telemetry.h), against a
// fake libnvidia-ml.so.1 with known readings (tests/cuda_emulation/fake_nvml.cc) and against
// none; the device gauges as a scrape shows them (server/metrics/device_gauges.h), and the
// split of a GPU batch as device_time_seconds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "server/metrics/device_gauges.h"
#include "server/metrics/gpu_telemetry.h"
#include "server/metrics/metrics.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr const char kFakeNvml[] = ATTNSERVE_FAKE_NVML;  // the fake library's path
constexpr const char kBusId[] = "0000:10:00.0";          // the one device it knows

TEST(GpuTelemetryTest, ReadsTheDeviceByItsBusId) {
  std::string why;
  auto telemetry = GpuTelemetry::Open(kFakeNvml, kBusId, &why);
  ASSERT_NE(telemetry, nullptr) << why;
  const GpuSample s = telemetry->Sample();
  // The fake's readings, converted: percent to a ratio, milliwatts to watts.
  EXPECT_EQ(s.utilization, 0.37);
  EXPECT_EQ(s.memory_total, static_cast<double>(80ull << 30));
  EXPECT_EQ(s.memory_used, static_cast<double>((3ull << 30) + (5ull << 20)));
  EXPECT_EQ(s.temperature_c, 61.0);
  EXPECT_EQ(s.power_w, 212.345);
}

TEST(GpuTelemetryTest, NoLibraryNoDeviceOrNoBusIdIsNoTelemetryWithTheReason) {
  std::string why;
  EXPECT_EQ(GpuTelemetry::Open("/nonexistent/libnvidia-ml.so.1", kBusId, &why), nullptr);
  EXPECT_THAT(why, HasSubstr("cannot load /nonexistent/libnvidia-ml.so.1"));
  EXPECT_EQ(GpuTelemetry::Open(kFakeNvml, "0000:99:00.0", &why), nullptr);
  EXPECT_THAT(why, HasSubstr("does not know the device at PCI bus id 0000:99:00.0"));
  EXPECT_EQ(GpuTelemetry::Open(kFakeNvml, "", &why), nullptr);
  EXPECT_THAT(why, HasSubstr("no PCI bus id"));
  // A library without NVML's functions (this process's own C library) is refused, not called.
  EXPECT_EQ(GpuTelemetry::Open("libc.so.6", kBusId, &why), nullptr);
  EXPECT_THAT(why, HasSubstr("lacks an NVML function"));
}

// The gauges appear with their first value, labelled with the device; quantities NVML did not
// report stay absent.
TEST(GpuTelemetryTest, TheGaugesAppearWithTheirFirstValue) {
  Metrics metrics;
  DeviceGauges gauges(metrics, "cuda:1");
  EXPECT_THAT(metrics.Scrape(), Not(HasSubstr("attnserve_gpu_")));
  EXPECT_THAT(metrics.Scrape(), Not(HasSubstr("attnserve_device_memory")));
  gauges.SetDeviceMemory(int64_t{3} << 20, int64_t{7} << 30, 4);
  gauges.SetGpuSample({.utilization = 0.25, .temperature_c = 55});
  const std::string text = metrics.Scrape();
  EXPECT_THAT(text, HasSubstr("attnserve_device_memory_held_bytes{device=\"cuda:1\"} 3145728\n"));
  EXPECT_THAT(text, HasSubstr("attnserve_device_memory_limit_bytes{device=\"cuda:1\"} 7516192768\n"));
  EXPECT_THAT(text, HasSubstr("attnserve_device_lanes{device=\"cuda:1\"} 4\n"));
  EXPECT_THAT(text, HasSubstr("attnserve_gpu_utilization_ratio{device=\"cuda:1\"} 0.25\n"));
  EXPECT_THAT(text, HasSubstr("attnserve_gpu_temperature_celsius{device=\"cuda:1\"} 55\n"));
  EXPECT_THAT(text, Not(HasSubstr("attnserve_gpu_power_watts{")));
  EXPECT_THAT(text, Not(HasSubstr("attnserve_gpu_memory_used_bytes{")));
}

// A GPU batch's split lands in device_time_seconds by part; a CPU batch (no split) adds none.
TEST(GpuTelemetryTest, AGpuBatchsSplitIsObservedByPart) {
  Metrics metrics;
  metrics.BatchDone({.layer = "l", .variant = Variant{Form::kSummed}, .device = "cpu", .requests = 1, .tokens = 4,
                     .compute_seconds = 1e-3});
  EXPECT_THAT(metrics.Scrape(), Not(HasSubstr("attnserve_device_time_seconds")));
  metrics.BatchDone({.layer = "l", .variant = Variant{Form::kSummed}, .device = "cuda:0", .requests = 1, .tokens = 4,
                     .compute_seconds = 1e-3, .device_seconds = {{2e-4, 7e-4, 1e-4}}});
  const std::string text = metrics.Scrape();
  const std::string series = "attnserve_device_time_seconds_sum{device=\"cuda:0\",form=\"summed\",layer=\"l\",math=\"fp32\",part=\"";
  EXPECT_THAT(text, HasSubstr(series + "inputs\"} 0.0002\n"));
  EXPECT_THAT(text, HasSubstr(series + "compute\"} 0.0007\n"));
  EXPECT_THAT(text, HasSubstr(series + "outputs\"} 0.0001\n"));
  // A failed batch's split (none is reported) changes nothing.
  metrics.BatchDone({.layer = "l", .variant = Variant{Form::kSummed}, .device = "cuda:0", .requests = 1,
                     .code = StatusCode::kInternal, .device_seconds = {{1, 1, 1}}});
  EXPECT_THAT(metrics.Scrape(), HasSubstr(series + "compute\"} 0.0007\n"));
}

}  // namespace
}  // namespace attnserve
