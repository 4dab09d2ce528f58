// Request checks of the gRPC service (server/service/validation.h), without gRPC: every bad
// input yields INVALID_ARGUMENT (or the code of docs/service.md) with a message naming the
// field, what was expected and what came; good input becomes sequences over the wire bytes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/service/validation.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kF32 = static_cast<int>(WireDtype::kFloat32);
constexpr int kF16 = static_cast<int>(WireDtype::kFloat16);
constexpr int kBF16 = static_cast<int>(WireDtype::kBFloat16);

LayerConfig Config(int64_t d_model = 8, int64_t heads = 2) {
  LayerConfig c;
  c.d_model = d_model;
  c.heads = heads;
  return *CompleteConfig(c);
}

// A wire tensor with its own storage (what a protobuf message would hold).
struct OwnedWire {
  std::vector<int64_t> shape;
  std::string bytes;
  int dtype = kF32;
  WireTensor View() const { return WireTensor{true, dtype, shape, bytes}; }
};

OwnedWire Floats(std::vector<int64_t> shape, float fill = 0.5f) {
  OwnedWire w;
  w.shape = std::move(shape);
  int64_t count = 1;
  for (int64_t d : w.shape) count *= d;
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i) v[i] = fill + 0.01f * static_cast<float>(i);
  w.bytes.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return w;
}

Status DecodeError(const LayerConfig& config, const OwnedWire& input, const OwnedWire* context = nullptr,
                   std::vector<int32_t> key_lengths = {}) {
  WireForwardRequest r;
  r.input = input.View();
  if (context) r.context = context->View();
  r.key_lengths = key_lengths;
  StatusOr<DecodedForward> d = DecodeForward(config, r);
  return d.status();
}

TEST(ValidationTest, Float32InputIsViewedInPlaceAndSplitIntoSequences) {
  const LayerConfig c = Config();
  OwnedWire in = Floats({2, 3, 8});
  WireForwardRequest r;
  r.input = in.View();
  r.causal = true;
  std::vector<int32_t> lengths = {3, 1};
  r.key_lengths = lengths;
  StatusOr<DecodedForward> d = DecodeForward(c, r);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->input.data(), reinterpret_cast<const float*>(in.bytes.data())) << "float32 input must not be copied";
  std::vector<float> out(d->output_elements());
  std::vector<Sequence> seqs = d->Sequences(out.data());
  ASSERT_EQ(seqs.size(), 2u);
  EXPECT_EQ(seqs[1].input.data, reinterpret_cast<const float*>(in.bytes.data()) + 3 * 8);
  EXPECT_EQ(seqs[1].output.data, out.data() + 3 * 8);
  EXPECT_EQ(seqs[1].n(), 3);
  EXPECT_TRUE(seqs[0].self_attention());
  EXPECT_TRUE(seqs[0].causal);
  EXPECT_EQ(seqs[0].key_length, 3);
  EXPECT_EQ(seqs[1].key_length, 1);
  for (const Sequence& s : seqs) EXPECT_TRUE(ValidateSequence(c, s).ok());
}

TEST(ValidationTest, ContextBecomesCrossAttention) {
  const LayerConfig c = Config();
  OwnedWire in = Floats({2, 3, 8}), ctx = Floats({2, 5, 8});
  WireForwardRequest r;
  r.input = in.View();
  r.context = ctx.View();
  std::vector<int32_t> lengths = {5, 4};
  r.key_lengths = lengths;
  StatusOr<DecodedForward> d = DecodeForward(c, r);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::vector<float> out(d->output_elements());
  std::vector<Sequence> seqs = d->Sequences(out.data());
  EXPECT_EQ(seqs[1].context.data, reinterpret_cast<const float*>(ctx.bytes.data()) + 5 * 8);
  EXPECT_EQ(seqs[1].m(), 5);
  EXPECT_EQ(seqs[1].key_length, 4);
}

TEST(ValidationTest, MissingInput) {
  WireForwardRequest r;
  EXPECT_THAT(DecodeForward(Config(), r).status().message(), AllOf(HasSubstr("input"), HasSubstr("got none")));
}

TEST(ValidationTest, WrongRank) {
  const Status s = DecodeError(Config(), Floats({3, 8}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.shape"), HasSubstr("rank 3"), HasSubstr("got [3, 8] (rank 2)")));
}

TEST(ValidationTest, DModelMismatch) {
  const Status s = DecodeError(Config(), Floats({1, 3, 6}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.shape[2] (d_model)"), HasSubstr("expected 8"), HasSubstr("got 6")));
}

TEST(ValidationTest, NegativeAndZeroDims) {
  OwnedWire w = Floats({1, 2, 8});
  w.shape = {1, -2, 8};
  Status s = DecodeError(Config(), w);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.shape[1] (n)"), HasSubstr("expected >= 1"), HasSubstr("got -2")));
  w.shape = {0, 2, 8};
  s = DecodeError(Config(), w);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.shape[0] (batch)"), HasSubstr("got 0")));
}

TEST(ValidationTest, OverflowingDimsAreRefusedBeforeAnyAllocation) {
  OwnedWire w = Floats({1, 1, 8});
  w.shape = {int64_t{1} << 40, int64_t{1} << 40, 8};
  Status s = DecodeError(Config(), w);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.shape"), HasSubstr("overflows")));
  // A product that fits int64 but whose byte count (x4) does not.
  w.shape = {int64_t{1} << 30, int64_t{1} << 29, 8};
  s = DecodeError(Config(), w);
  EXPECT_THAT(s.message(), HasSubstr("overflows"));
  // A large product that does not overflow: caught by the byte length, nothing allocated.
  w.shape = {int64_t{1} << 20, int64_t{1} << 20, 8};
  s = DecodeError(Config(), w);
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("input.data"), HasSubstr("expected 35184372088832 bytes"), HasSubstr("got 32")));
}

TEST(ValidationTest, ByteLengthMismatch) {
  OwnedWire w = Floats({2, 3, 8});
  w.bytes.resize(w.bytes.size() - 4);
  const Status s = DecodeError(Config(), w);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("input.data"), HasSubstr("expected 192 bytes"), HasSubstr("got 188")));
}

TEST(ValidationTest, NonFiniteValues) {
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    OwnedWire w = Floats({2, 3, 8});
    std::memcpy(w.bytes.data() + 4 * (1 * 24 + 2 * 8 + 5), &bad, 4);
    const Status s = DecodeError(Config(), w);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("input.data"), HasSubstr("finite"), HasSubstr("at [1, 2, 5]")));
  }
}

// The scan that finds them works in blocks (FirstNonFinite): a non-finite value is found, and
// the first one named, at every position around a block's edges and in the last, partial block,
// with a second one later; finite values at the exponent's edges (the largest float, the
// smallest subnormal, negative zero) pass.
TEST(ValidationTest, NonFiniteValuesAreFoundAtEveryBlockEdge) {
  const std::vector<int64_t> shape = {2, 300, 8};  // 4800 values: 18 whole blocks of 256 and a part
  const float edges[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::denorm_min(), -0.0f};
  OwnedWire finite = Floats(shape);
  for (int64_t i = 0; i < 4800; i += 37) std::memcpy(finite.bytes.data() + 4 * i, &edges[i % 4], 4);
  EXPECT_TRUE(DecodeError(Config(), finite).ok());
  for (int64_t at : {0, 1, 254, 255, 256, 257, 511, 512, 4607, 4608, 4798, 4799}) {
    for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
      OwnedWire w = finite;
      std::memcpy(w.bytes.data() + 4 * at, &bad, 4);
      if (at + 300 < 4800) std::memcpy(w.bytes.data() + 4 * (at + 300), &bad, 4);  // only the first is named
      const Status s = DecodeError(Config(), w);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << at;
      const std::string where = "at [" + std::to_string(at / 2400) + ", " + std::to_string(at % 2400 / 8) + ", " +
                                std::to_string(at % 8) + "]";
      EXPECT_THAT(s.message(), HasSubstr(where)) << at << " " << bad;
    }
  }
}

// Large finite values are the client's to send: INVALID_ARGUMENT is for NaN and infinities
// only. Whether the result fits float32 is known after the computation (CheckOutputFinite).
TEST(ValidationTest, LargeFiniteValuesAreAccepted) {
  for (float big : {1e20f, -1e20f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()}) {
    OwnedWire in = Floats({2, 3, 8}), ctx = Floats({2, 4, 8});
    std::memcpy(in.bytes.data() + 4 * 7, &big, 4);
    std::memcpy(ctx.bytes.data() + 4 * 9, &big, 4);
    WireForwardRequest r;
    r.input = in.View();
    r.context = ctx.View();
    StatusOr<DecodedForward> d = DecodeForward(Config(), r);
    ASSERT_TRUE(d.ok()) << big << ": " << d.status().ToString();
    EXPECT_EQ(d->input.data()[7], big);
  }
  // The largest BFLOAT16 (0x7f7f, about 3.39e38) converts to a finite float32.
  OwnedWire w;
  w.dtype = kBF16;
  w.shape = {1, 1, 8};
  const std::vector<uint16_t> bits(8, 0x7f7f);
  w.bytes.assign(reinterpret_cast<const char*>(bits.data()), bits.size() * 2);
  WireForwardRequest r;
  r.input = w.View();
  EXPECT_TRUE(DecodeForward(Config(), r).ok());
}

// A NaN or an infinity in a computed output, after finite inputs: OUT_OF_RANGE naming the first
// such element as [batch, row, col], the form, and the inputs' largest magnitude.
TEST(ValidationTest, NonFiniteOutputIsOutOfRange) {
  std::vector<float> input(2 * 3 * 8, 1.0f), context(2 * 4 * 8, -2.0f);
  input[11] = 3e38f;
  context[5] = -4e37f;
  AttentionRequest request;
  request.input = RequestTensor::View(input.data(), 2, 3, 8);
  request.context = RequestTensor::View(context.data(), 2, 4, 8);
  std::vector<float> output(2 * 3 * 8, 0.5f);
  EXPECT_TRUE(CheckOutputFinite(request, Form::kFactored, output).ok());
  struct Case {
    float value;
    const char* got;
  };
  for (const Case& c : {Case{std::nanf(""), "got NaN"}, Case{std::numeric_limits<float>::infinity(), "got inf"},
                        Case{-std::numeric_limits<float>::infinity(), "got -inf"}}) {
    std::vector<float> bad = output;
    bad[1 * 24 + 2 * 8 + 5] = c.value;
    bad.back() = c.value;  // only the first is named
    const Status s = CheckOutputFinite(request, Form::kSummed, bad);
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << c.got;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("output: expected finite values"), HasSubstr(c.got),
                                   HasSubstr("at [1, 2, 5]"), HasSubstr("summed form"),
                                   HasSubstr("overflowed float32"), HasSubstr("largest magnitude 3e+38")));
  }
}

TEST(ValidationTest, UnsupportedDtype) {
  for (int dtype : {0, 4, -1}) {
    OwnedWire w = Floats({1, 1, 8});
    w.dtype = dtype;
    const Status s = DecodeError(Config(), w);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("input.dtype"), HasSubstr("FLOAT32, FLOAT16 or BFLOAT16")));
  }
}

TEST(ValidationTest, KeyLengths) {
  const LayerConfig c = Config();
  OwnedWire in = Floats({2, 3, 8});
  Status s = DecodeError(c, in, nullptr, {3});
  EXPECT_THAT(s.message(), AllOf(HasSubstr("key_lengths"), HasSubstr("expected 2 values"), HasSubstr("got 1")));
  s = DecodeError(c, in, nullptr, {3, 0});
  EXPECT_THAT(s.message(), AllOf(HasSubstr("key_lengths[1]"), HasSubstr("[1, 3]"), HasSubstr("got 0")));
  s = DecodeError(c, in, nullptr, {4, 1});
  EXPECT_THAT(s.message(), AllOf(HasSubstr("key_lengths[0]"), HasSubstr("got 4")));
  // With a context, m is the context's rows.
  OwnedWire ctx = Floats({2, 6, 8});
  EXPECT_TRUE(DecodeError(c, in, &ctx, {6, 5}).ok());
  s = DecodeError(c, in, &ctx, {7, 5});
  EXPECT_THAT(s.message(), AllOf(HasSubstr("[1, 6]"), HasSubstr("context rows")));
}

TEST(ValidationTest, ContextMismatch) {
  const LayerConfig c = Config();
  OwnedWire in = Floats({2, 3, 8});
  OwnedWire ctx = Floats({3, 5, 8});
  Status s = DecodeError(c, in, &ctx);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("context.shape[0] (batch)"), HasSubstr("expected 2"), HasSubstr("got 3")));
  ctx = Floats({2, 5, 4});
  s = DecodeError(c, in, &ctx);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("context.shape[2] (d_model)"), HasSubstr("got 4")));
  ctx = Floats({10, 8});
  s = DecodeError(c, in, &ctx);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("context.shape"), HasSubstr("rank 2")));
  ctx = Floats({2, 5, 8});
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(ctx.bytes.data() + 8, &inf, 4);
  s = DecodeError(c, in, &ctx);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("context.data"), HasSubstr("finite")));
}

// The work bound counts every sequence of the request: 3 × 16 × 16 × 2 heads fits exactly.
TEST(ValidationTest, AttentionScoresAreBoundedPerRequest) {
  const LayerConfig c = Config(8, 2);
  const ForwardLimits limits{.max_request_scores = 3 * 16 * 16 * 2};
  WireForwardRequest r;
  OwnedWire fits = Floats({3, 16, 8});
  r.input = fits.View();
  EXPECT_TRUE(DecodeForward(c, r, limits).ok());
  OwnedWire over = Floats({4, 16, 8});
  r.input = over.View();
  Status s = DecodeForward(c, r, limits).status();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("4 sequence(s)"), HasSubstr("n=16"), HasSubstr("m=16"),
                                 HasSubstr("--max-scores-m")));
  // Cross-attention: m is the context's length.
  OwnedWire q = Floats({1, 2, 8}), ctx = Floats({1, 400, 8});
  r.input = q.View();
  r.context = ctx.View();
  s = DecodeForward(c, r, limits).status();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("n=2"), HasSubstr("m=400")));
}

// Half-precision bit patterns of exact values.
TEST(ValidationTest, Float16AndBFloat16AreConvertedOnArrival) {
  const std::vector<uint16_t> f16 = {0x3c00, 0xc100, 0x3800, 0x7bff, 0x0001, 0x8000, 0x0000, 0x3555};
  const std::vector<float> f16_want = {1.0f,  -2.5f, 0.5f,           65504.0f, std::ldexp(1.0f, -24),
                                       -0.0f, 0.0f,  0.333251953125f};
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc020, 0x3f00, 0x7f7f, 0x0001, 0x8000, 0x4049, 0xbe80};
  const std::vector<float> bf16_want = {1.0f,  -2.5f,     0.5f,  3.3895313892515355e38f, std::ldexp(1.0f, -133),
                                        -0.0f, 3.140625f, -0.25f};
  for (int dtype : {kF16, kBF16}) {
    const auto& bits = dtype == kF16 ? f16 : bf16;
    const auto& want = dtype == kF16 ? f16_want : bf16_want;
    OwnedWire w;
    w.dtype = dtype;
    w.shape = {1, 1, 8};
    w.bytes.assign(reinterpret_cast<const char*>(bits.data()), bits.size() * 2);
    WireForwardRequest r;
    r.input = w.View();
    StatusOr<DecodedForward> d = DecodeForward(Config(), r);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(d->input.data()[i], want[i]) << WireDtypeName(dtype) << " element " << i;
      EXPECT_EQ(std::signbit(d->input.data()[i]), std::signbit(want[i]));
    }
    // The byte length follows the dtype's size.
    w.bytes.resize(30);
    EXPECT_THAT(DecodeError(Config(), w).message(), AllOf(HasSubstr("expected 16 bytes"), HasSubstr("2-byte")));
    // Infinity after conversion is still refused.
    w.bytes.resize(16);
    const uint16_t inf = dtype == kF16 ? 0x7c00 : 0x7f80;
    std::memcpy(w.bytes.data() + 6, &inf, 2);
    EXPECT_THAT(DecodeError(Config(), w).message(), HasSubstr("finite"));
  }
}

TEST(ValidationTest, MisalignedFloat32IsCopiedNotReadInPlace) {
  OwnedWire src = Floats({1, 2, 8});
  std::string storage = "x" + src.bytes;  // data starts at an odd address
  WireForwardRequest r;
  r.input = WireTensor{true, kF32, src.shape, std::string_view(storage).substr(1)};
  StatusOr<DecodedForward> d = DecodeForward(Config(), r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(std::memcmp(d->input.data(), src.bytes.data(), src.bytes.size()), 0);
}

TEST(ValidationTest, FormChoice) {
  for (int f : {0, 1, 2, 3, 4}) EXPECT_TRUE(CheckWireForm(f).ok()) << f;  // 4: FORM_AUTO
  for (int f : {5, -1, 100}) {
    const Status s = CheckWireForm(f);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("form"), HasSubstr("got " + std::to_string(f))));
  }
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  const LayerConfig c = Config();
  Layer layer;
  layer.name = "l";
  layer.config = c;
  layer.forms[Form::kFactored] =
      *backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(c, 3))));
  EXPECT_EQ(*ChooseForm(0, layer), Form::kFactored) << "FORM_UNSPECIFIED serves the factored form";
  EXPECT_EQ(*ChooseForm(1, layer), Form::kFactored);
  StatusOr<Form> summed = ChooseForm(2, layer);
  EXPECT_EQ(summed.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(summed.status().message(), AllOf(HasSubstr("summed"), HasSubstr("holds: factored")));
  EXPECT_EQ(ChooseForm(9, layer).status().code(), StatusCode::kInvalidArgument);
  // A low-rank form still gathering its live calibration rows: retryable, with how far it is.
  layer.lowrank_selection = "divergence:0.05";
  layer.live_calibration = std::make_shared<LiveCalibration>(64, c.d_model, 0.05);
  StatusOr<Form> gathering = ChooseForm(3, layer);
  EXPECT_EQ(gathering.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(gathering.status().message(),
              AllOf(HasSubstr("layer 'l'"), HasSubstr("divergence:0.05"), HasSubstr("0 of 64 rows")));
  layer.live_calibration->Fail(ResourceExhaustedError("too big"));
  StatusOr<Form> failed = ChooseForm(3, layer);
  EXPECT_EQ(failed.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(failed.status().message(), AllOf(HasSubstr("build from live traffic failed"), HasSubstr("too big")));
}

}  // namespace
}  // namespace attnserve
