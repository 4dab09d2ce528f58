// The Open Inference Protocol's ModelInferRequest as the WireForwardRequest attnserve.v1 makes
// (server/service/inference_request.h): the same input decodes, through the one DecodeForward,
// to the same AttentionRequest whichever protocol carried it; raw and typed contents agree; the
// protocol's own mistakes are refused naming the input or parameter, what was expected and what
// came; every parameter attnserve does not use is ignored. Protobuf only, no gRPC.
#include "server/service/inference_request.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/service/wire_request.h"

namespace attnserve {
namespace {

using inference::ModelInferRequest;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kD = 8;

LayerConfig Config() {
  LayerConfig c;
  c.d_model = kD;
  c.heads = 2;
  return *CompleteConfig(c);
}

std::vector<float> Random(size_t count, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(count);
  for (float& f : v) f = dist(gen);
  return v;
}

std::string Bytes(const void* data, size_t size) { return std::string(static_cast<const char*>(data), size); }

enum class Contents { kRaw, kTyped };

// x [2, 3, kD], context [2, 5, kD], key_lengths [5, 2], as a client sends them.
struct Inputs {
  std::vector<float> x = Random(2 * 3 * kD, 1);
  std::vector<float> context = Random(2 * 5 * kD, 2);
  std::vector<int32_t> key_lengths = {5, 2};
};

ModelInferRequest InferRequest(const Inputs& in, Contents how) {
  ModelInferRequest r;
  r.set_model_name("demo");
  r.set_id("req-7");
  auto add = [&](const char* name, const char* datatype, std::vector<int64_t> shape, const void* data, size_t bytes) {
    auto* t = r.add_inputs();
    t->set_name(name);
    t->set_datatype(datatype);
    for (int64_t s : shape) t->add_shape(s);
    if (how == Contents::kRaw) {
      r.add_raw_input_contents(Bytes(data, bytes));
    } else if (std::string(datatype) == "FP32") {
      const float* f = static_cast<const float*>(data);
      t->mutable_contents()->mutable_fp32_contents()->Add(f, f + bytes / sizeof(float));
    } else {
      const int32_t* v = static_cast<const int32_t*>(data);
      t->mutable_contents()->mutable_int_contents()->Add(v, v + bytes / sizeof(int32_t));
    }
  };
  add("x", "FP32", {2, 3, kD}, in.x.data(), in.x.size() * sizeof(float));
  add("context", "FP32", {2, 5, kD}, in.context.data(), in.context.size() * sizeof(float));
  add("key_lengths", "INT32", {2}, in.key_lengths.data(), in.key_lengths.size() * sizeof(int32_t));
  return r;
}

v1::ForwardRequest ForwardRequest(const Inputs& in) {
  v1::ForwardRequest r;
  r.set_layer("demo");
  r.set_form(v1::FORM_SUMMED);
  auto fill = [](v1::Tensor* t, std::vector<int64_t> shape, const std::vector<float>& v) {
    t->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t s : shape) t->add_shape(s);
    t->set_data(Bytes(v.data(), v.size() * sizeof(float)));
  };
  fill(r.mutable_input(), {2, 3, kD}, in.x);
  fill(r.mutable_context(), {2, 5, kD}, in.context);
  for (int32_t k : in.key_lengths) r.add_key_lengths(k);
  r.set_causal(true);
  r.set_position_offset(4);
  r.set_request_key("user-1");
  r.set_compare(true);
  return r;
}

void SetParameters(ModelInferRequest* r) {
  auto& p = *r->mutable_parameters();
  p["form"].set_string_param("summed");
  p["causal"].set_bool_param(true);
  p["position_offset"].set_int64_param(4);
  p["request_key"].set_string_param("user-1");
  p["compare"].set_bool_param(true);
}

std::vector<float> Values(const RequestTensor& t) { return {t.values().begin(), t.values().end()}; }

TEST(InferRequestTest, DecodesToTheSameRequestAsAttnserveV1) {
  const Inputs in;
  const v1::ForwardRequest v1_request = ForwardRequest(in);
  const WireForwardRequest v1_wire = WireRequestOf(v1_request);
  StatusOr<DecodedForward> want = DecodeForward(Config(), v1_wire);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  for (Contents how : {Contents::kRaw, Contents::kTyped}) {
    SCOPED_TRACE(how == Contents::kRaw ? "raw_input_contents" : "typed contents");
    ModelInferRequest request = InferRequest(in, how);
    SetParameters(&request);
    InferForwardRequest converted;
    ConvertInferRequest(request, &converted);
    ASSERT_TRUE(converted.refused.ok()) << converted.refused.ToString();
    const WireForwardRequest& w = converted.wire;
    EXPECT_EQ(w.layer, "demo");
    EXPECT_EQ(w.form, v1_wire.form);
    EXPECT_EQ(w.causal, true);
    EXPECT_EQ(w.position_offset, 4);
    EXPECT_EQ(w.request_key, "user-1");
    EXPECT_TRUE(w.compare);
    StatusOr<DecodedForward> got = DecodeForward(Config(), w);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(Values(got->input), Values(want->input));
    ASSERT_TRUE(got->context.has_value());
    EXPECT_EQ(Values(*got->context), Values(*want->context));
    EXPECT_EQ(got->key_lengths, want->key_lengths);
    EXPECT_EQ(got->causal, want->causal);
    EXPECT_EQ(got->position_offset, want->position_offset);
    // Raw bytes and repeated floats are both views of the message: no copy of x.
    EXPECT_FALSE(got->input.owns_values());
  }
}

// "auto" is attnserve.v1's FORM_AUTO (4), which the call path resolves by cost.
TEST(InferRequestTest, FormAutoIsFormAutoOnTheWire) {
  ModelInferRequest request = InferRequest(Inputs(), Contents::kRaw);
  (*request.mutable_parameters())["form"].set_string_param("auto");
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  ASSERT_TRUE(converted.refused.ok()) << converted.refused.ToString();
  EXPECT_EQ(converted.wire.form, v1::FORM_AUTO);
  EXPECT_TRUE(CheckWireForm(converted.wire.form).ok());
}

TEST(InferRequestTest, RequestIdIsTheRoutingKeyUnlessOneIsGiven) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kRaw);
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  ASSERT_TRUE(converted.refused.ok());
  EXPECT_EQ(converted.wire.request_key, "req-7");
  EXPECT_EQ(converted.wire.echoed_bytes, 9);  // "req-7" and "demo" come back in the response
  EXPECT_EQ(converted.wire.form, static_cast<int>(WireForm::kUnspecified));  // the router decides
  EXPECT_FALSE(converted.wire.causal);
}

TEST(InferRequestTest, KeyLengthsShapedPerRowScalarAreAccepted) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kTyped);
  request.mutable_inputs(2)->clear_shape();
  request.mutable_inputs(2)->add_shape(2);
  request.mutable_inputs(2)->add_shape(1);
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  ASSERT_TRUE(converted.refused.ok()) << converted.refused.ToString();
  EXPECT_THAT(std::vector<int32_t>(converted.wire.key_lengths.begin(), converted.wire.key_lengths.end()),
              ::testing::ElementsAre(5, 2));
}

TEST(InferRequestTest, UnknownAndTritonParametersAreIgnored) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kRaw);
  auto& p = *request.mutable_parameters();
  p["triton_enable_empty_final_response"].set_bool_param(true);
  p["sequence_id"].set_int64_param(3);
  p["priority"].set_int64_param(1);
  p["timeout"].set_int64_param(100);
  p["binary_data_output"].set_bool_param(true);
  p["headers"].set_string_param("a: b");
  p["anything"].set_double_param(0.5);
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  EXPECT_TRUE(converted.refused.ok()) << converted.refused.ToString();
}

// Each mistake of the protocol's own, and what the refusal must say.
struct Refusal {
  const char* name;
  void (*spoil)(ModelInferRequest*);
  StatusCode code;
  std::vector<std::string> says;
};

class InferRequestRefusalTest : public ::testing::TestWithParam<Refusal> {};

TEST_P(InferRequestRefusalTest, NamesWhatWasExpectedAndWhatCame) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kRaw);
  GetParam().spoil(&request);
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  EXPECT_EQ(converted.refused.code(), GetParam().code) << converted.refused.ToString();
  for (const std::string& s : GetParam().says) EXPECT_THAT(converted.refused.message(), HasSubstr(s));
}

INSTANTIATE_TEST_SUITE_P(
    Protocol, InferRequestRefusalTest,
    ::testing::Values(
        Refusal{"MixedRawAndTyped",
                [](ModelInferRequest* r) { r->mutable_inputs(1)->mutable_contents()->add_fp32_contents(1.5f); },
                StatusCode::kInvalidArgument,
                {"inputs[1] ('context').contents", "got both"}},
        Refusal{"RawCount",
                [](ModelInferRequest* r) { r->mutable_raw_input_contents()->RemoveLast(); },
                StatusCode::kInvalidArgument,
                {"raw_input_contents: expected one entry per input (3), got 2"}},
        Refusal{"UnknownInput",
                [](ModelInferRequest* r) { r->mutable_inputs(1)->set_name("ctx"); },
                StatusCode::kInvalidArgument,
                {"inputs[1].name: expected 'x', 'context' or 'key_lengths'", "'ctx'"}},
        Refusal{"DuplicateInput",
                [](ModelInferRequest* r) { r->mutable_inputs(1)->set_name("x"); },
                StatusCode::kInvalidArgument,
                {"expected 'x' once, got it twice"}},
        Refusal{"Datatype",
                [](ModelInferRequest* r) { r->mutable_inputs(0)->set_datatype("FP64"); },
                StatusCode::kInvalidArgument,
                {"x.datatype: expected FP32, FP16 or BF16, got 'FP64'"}},
        Refusal{"KeyLengthsDatatype",
                [](ModelInferRequest* r) { r->mutable_inputs(2)->set_datatype("INT64"); },
                StatusCode::kInvalidArgument,
                {"key_lengths.datatype: expected INT32, got 'INT64'"}},
        Refusal{"KeyLengthsRank",
                [](ModelInferRequest* r) { r->mutable_inputs(2)->add_shape(2); },
                StatusCode::kInvalidArgument,
                {"key_lengths.shape: expected [batch] or [batch, 1], got [2, 2]"}},
        Refusal{"KeyLengthsEmpty",
                [](ModelInferRequest* r) {
                  r->mutable_inputs(2)->set_shape(0, 0);
                  r->set_raw_input_contents(2, "");
                },
                StatusCode::kInvalidArgument,
                {"key_lengths.shape[0]: expected the batch (>= 1), got 0"}},
        Refusal{"KeyLengthsBytes",
                [](ModelInferRequest* r) { r->mutable_raw_input_contents(2)->append("\1"); },
                StatusCode::kInvalidArgument,
                {"key_lengths: expected 2 4-byte INT32 values ([2]), got 9 bytes"}},
        Refusal{"KeyLengthsHugeCount",
                [](ModelInferRequest* r) { r->mutable_inputs(2)->set_shape(0, (int64_t{1} << 62) + 2); },
                StatusCode::kInvalidArgument,
                {"key_lengths: expected 4611686018427387906 4-byte INT32 values"}},
        Refusal{"Form",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["form"].set_string_param("SUMMED"); },
                StatusCode::kInvalidArgument,
                {"parameters['form']: expected 'factored', 'summed', 'lowrank' or 'auto'", "got 'SUMMED'"}},
        Refusal{"FormType",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["form"].set_int64_param(2); },
                StatusCode::kInvalidArgument,
                {"parameters['form']: expected a string, got an int64"}},
        Refusal{"CausalType",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["causal"].set_string_param("true"); },
                StatusCode::kInvalidArgument,
                {"parameters['causal']: expected a bool, got a string"}},
        // A string "true" is not a bool: a client that sent it would otherwise be answered
        // without the comparison it asked for (a missing bool reads as false).
        Refusal{"CompareType",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["compare"].set_string_param("true"); },
                StatusCode::kInvalidArgument,
                {"parameters['compare']: expected a bool, got a string"}},
        Refusal{"RequestKeyType",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["request_key"].set_int64_param(7); },
                StatusCode::kInvalidArgument,
                {"parameters['request_key']: expected a string, got an int64"}},
        Refusal{"OffsetType",
                [](ModelInferRequest* r) { (*r->mutable_parameters())["position_offset"].set_double_param(1); },
                StatusCode::kInvalidArgument,
                {"parameters['position_offset']: expected an int64, got a double"}},
        Refusal{"Output",
                [](ModelInferRequest* r) { r->add_outputs()->set_name("attn"); },
                StatusCode::kInvalidArgument,
                {"outputs[0].name: expected 'y', got 'attn'"}},
        Refusal{"Version",
                [](ModelInferRequest* r) { r->set_model_version("3"); },
                StatusCode::kNotFound,
                {"model_version: expected \"1\" or empty", "got '3'"}}),
    [](const ::testing::TestParamInfo<Refusal>& info) { return std::string(info.param.name); });

TEST(InferRequestTest, TypedHalfPrecisionIsRefused) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kTyped);
  request.mutable_inputs(0)->set_datatype("FP16");
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  EXPECT_EQ(converted.refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(converted.refused.message(),
              AllOf(HasSubstr("x: expected FP16 values in raw_input_contents"), HasSubstr("got typed contents")));
}

// Shapes and byte counts are DecodeForward's: the errors name the OIP's inputs.
TEST(InferRequestTest, DecodeErrorsNameTheProtocolsInputs) {
  const Inputs in;
  ModelInferRequest request = InferRequest(in, Contents::kRaw);
  request.mutable_raw_input_contents(0)->pop_back();
  InferForwardRequest converted;
  ConvertInferRequest(request, &converted);
  ASSERT_TRUE(converted.refused.ok());
  Status st = DecodeForward(Config(), converted.wire).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), AllOf(HasSubstr("x.data: expected 192 bytes"), HasSubstr("got 191")));

  ModelInferRequest no_x = InferRequest(in, Contents::kRaw);
  no_x.mutable_inputs()->DeleteSubrange(0, 1);
  no_x.mutable_raw_input_contents()->DeleteSubrange(0, 1);
  InferForwardRequest converted_no_x;
  ConvertInferRequest(no_x, &converted_no_x);
  ASSERT_TRUE(converted_no_x.refused.ok()) << converted_no_x.refused.ToString();
  st = DecodeForward(Config(), converted_no_x.wire).status();
  EXPECT_THAT(st.message(), HasSubstr("x: expected a [batch, n, d_model=8] tensor, got none"));

  ModelInferRequest bad_length = InferRequest(in, Contents::kTyped);
  bad_length.mutable_inputs(2)->mutable_contents()->set_int_contents(1, 6);
  InferForwardRequest converted_length;
  ConvertInferRequest(bad_length, &converted_length);
  ASSERT_TRUE(converted_length.refused.ok());
  st = DecodeForward(Config(), converted_length.wire).status();
  EXPECT_THAT(st.message(), HasSubstr("key_lengths[1]: expected a value in [1, 5] (m = context rows), got 6"));
}

}  // namespace
}  // namespace attnserve
