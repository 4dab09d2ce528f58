// What a Forward call is charged at admission (server/service/footprint.h), term by term,
// worked out here from the request's shape: the wire bytes, a float32 copy of each tensor the
// wire sent in half precision (input and context alike; a float32 wire is viewed, not copied),
// then per form its output and the backend's scratch.
#include "server/service/footprint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/service/validation.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

struct Wire {
  std::vector<int64_t> shape;
  std::string bytes;
  int dtype;
  WireTensor View() const { return WireTensor{true, dtype, shape, bytes}; }
};

// Random values of `shape` in the wire's dtype: float32, or half-precision bits with a random
// sign and exponent near 1 (finite in both FLOAT16 and BFLOAT16).
Wire RandomWire(std::mt19937_64& rng, std::vector<int64_t> shape, WireDtype dtype) {
  Wire w{std::move(shape), {}, static_cast<int>(dtype)};
  int64_t count = 1;
  for (int64_t d : w.shape) count *= d;
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  for (int64_t i = 0; i < count; ++i) {
    const float v = value(rng);
    if (dtype == WireDtype::kFloat32) {
      w.bytes.append(reinterpret_cast<const char*>(&v), 4);
    } else {
      uint32_t f;
      std::memcpy(&f, &v, 4);
      // BFLOAT16: the top half. FLOAT16: sign, a small exponent, 10 mantissa bits.
      const uint16_t bits = dtype == WireDtype::kBFloat16
                                ? static_cast<uint16_t>(f >> 16)
                                : static_cast<uint16_t>(((f >> 16) & 0x8000u) | 0x3C00u | ((f >> 13) & 0x3FFu));
      w.bytes.append(reinterpret_cast<const char*>(&bits), 2);
    }
  }
  return w;
}

class FootprintTest : public ::testing::TestWithParam<WireDtype> {};

TEST_P(FootprintTest, EachTermOfTheChargeIsTheRequestsOwn) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerConfig config = *CompleteConfig({.d_model = 24, .heads = 4, .kv_heads = 2});
  const LayerWeights weights = RandomLayerWeights(config, rng());
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  Layer layer;
  layer.name = "footprint";
  layer.config = config;
  layer.forms[Form::kFactored] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(weights)));
  layer.forms[Form::kSummed] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeSummed(weights)));
  const bool half = GetParam() != WireDtype::kFloat32;
  for (bool cross : {false, true}) {
    SCOPED_TRACE(cross ? "cross-attention" : "self-attention");
    const int64_t batch = 1 + static_cast<int64_t>(rng() % 3), n = 5 + static_cast<int64_t>(rng() % 20);
    const int64_t m = 30 + static_cast<int64_t>(rng() % 50), d = config.d_model;
    const Wire input = RandomWire(rng, {batch, n, d}, GetParam());
    const Wire context = RandomWire(rng, {batch, m, d}, GetParam());
    WireForwardRequest wire;
    wire.input = input.View();
    if (cross) wire.context = context.View();
    StatusOr<DecodedForward> decoded = DecodeForward(config, wire);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    const int64_t wire_bytes = static_cast<int64_t>(input.bytes.size() + (cross ? context.bytes.size() : 0));
    const int64_t float_bytes = 4, keys = cross ? m : n;
    const int64_t copies = half ? float_bytes * (batch * n * d + (cross ? batch * m * d : 0)) : 0;
    const int64_t output = float_bytes * batch * n * d;

    // Without a backend: the wire, the copies, an output per form.
    const Form one[] = {Form::kFactored}, both[] = {Form::kFactored, Form::kSummed};
    EXPECT_EQ(RequestFootprint(layer, *decoded, one, wire_bytes, nullptr), wire_bytes + copies + output);
    EXPECT_EQ(RequestFootprint(layer, *decoded, both, wire_bytes, nullptr), wire_bytes + copies + 2 * output);

    // With the backend: each form's scratch for these shapes, as the backend reports it.
    const std::vector<SequenceShape> shapes(batch, SequenceShape{.n = n, .m = keys, .keys = -1});
    const std::vector<SequenceShape> seen = ShapesOf(*decoded);
    ASSERT_EQ(seen.size(), shapes.size());
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i].m, keys);
    int64_t scratch = 0;
    for (Form f : both) scratch += backend.ScratchBytes(layer.Find(f)->weights(), shapes, !cross);
    EXPECT_GT(scratch, 0);
    EXPECT_EQ(RequestFootprint(layer, *decoded, both, wire_bytes, &backend),
              wire_bytes + copies + 2 * output + scratch);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FootprintTest,
                         ::testing::Values(WireDtype::kFloat32, WireDtype::kFloat16, WireDtype::kBFloat16),
                         [](const auto& info) {
                           return std::string(info.param == WireDtype::kFloat32   ? "float32"
                                              : info.param == WireDtype::kFloat16 ? "float16"
                                                                                  : "bfloat16");
                         });

}  // namespace
}  // namespace attnserve
