// The Open Inference Protocol's HTTP/REST bodies (server/service/http/infer_json.h): random
// tensors sent as flat or nested JSON, or as binary data behind Inference-Header-Content-Length,
// arrive as exactly the little-endian bytes a gRPC client would send in raw_input_contents, and
// go through the gRPC protocol's own conversion; an answer written as JSON parses back to the
// same float bits, and as binary data to the same bytes; FP16 and BF16 conversions round to
// nearest (checked against the store's independent decoders, every half value); every refusal
// names its field, what was expected and what came; random bytes never crash the parser.
#include "server/service/http/infer_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "server/service/inference_request.h"
#include "server/store/safetensors.h"

namespace attnserve {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<float> Random(size_t count, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(count);
  for (float& f : v) f = dist(gen);
  return v;
}

std::string Bytes(const void* data, size_t size) { return std::string(static_cast<const char*>(data), size); }

// [batch, n, d] floats as nested JSON arrays.
json Nested(const std::vector<float>& v, int64_t batch, int64_t n, int64_t d) {
  json out = json::array();
  for (int64_t b = 0; b < batch; ++b) {
    json rows = json::array();
    for (int64_t i = 0; i < n; ++i) {
      json row = json::array();
      for (int64_t k = 0; k < d; ++k) row.push_back(v[(b * n + i) * d + k]);
      rows.push_back(row);
    }
    out.push_back(rows);
  }
  return out;
}

Status Parse(const std::string& body, HttpInferRequest* out, std::optional<std::string> header = std::nullopt) {
  return ParseInferRequest(body, header ? std::optional<std::string_view>(*header) : std::nullopt, "demo", "", out);
}

TEST(InferJsonTest, FlatAndNestedJsonArriveAsTheFloatBytesAGrpcClientSends) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 gen(seed);
    const int64_t batch = 1 + gen() % 3, n = 1 + gen() % 5, m = 1 + gen() % 6, d = 4 * (1 + gen() % 4);
    const std::vector<float> x = Random(batch * n * d, seed), context = Random(batch * m * d, seed + 100);
    std::vector<int32_t> key_lengths(batch);
    for (auto& k : key_lengths) k = 1 + static_cast<int32_t>(gen() % m);
    const bool nested = seed % 2 == 0;
    json body = {
        {"id", "r" + std::to_string(seed)},
        {"parameters",
         {{"form", "summed"}, {"causal", true}, {"position_offset", 3}, {"request_key", "user-9"}, {"compare", false}}},
        {"inputs",
         {{{"name", "x"},
           {"datatype", "FP32"},
           {"shape", {batch, n, d}},
           {"data", nested ? Nested(x, batch, n, d) : json(x)}},
          {{"name", "context"},
           {"datatype", "FP32"},
           {"shape", {batch, m, d}},
           {"data", nested ? Nested(context, batch, m, d) : json(context)}},
          {{"name", "key_lengths"}, {"datatype", "INT32"}, {"shape", {batch}}, {"data", key_lengths}}}}};
    HttpInferRequest parsed;
    ASSERT_TRUE(Parse(body.dump(), &parsed).ok()) << Parse(body.dump(), &parsed).ToString();
    const auto& r = parsed.request;
    EXPECT_EQ(r.model_name(), "demo");
    EXPECT_EQ(r.id(), "r" + std::to_string(seed));
    ASSERT_EQ(r.inputs_size(), 3);
    ASSERT_EQ(r.raw_input_contents_size(), 3);
    EXPECT_EQ(r.raw_input_contents(0), Bytes(x.data(), x.size() * 4)) << "seed " << seed;
    EXPECT_EQ(r.raw_input_contents(1), Bytes(context.data(), context.size() * 4)) << "seed " << seed;
    EXPECT_EQ(r.raw_input_contents(2), Bytes(key_lengths.data(), key_lengths.size() * 4));
    EXPECT_THAT(std::vector<int64_t>(r.inputs(0).shape().begin(), r.inputs(0).shape().end()),
                ::testing::ElementsAre(batch, n, d));
    EXPECT_FALSE(parsed.binary_output);

    // The gRPC protocol's own conversion takes it, with every parameter.
    InferForwardRequest converted;
    ConvertInferRequest(r, &converted);
    ASSERT_TRUE(converted.refused.ok()) << converted.refused.ToString();
    EXPECT_EQ(converted.wire.form, 2);  // summed
    EXPECT_TRUE(converted.wire.causal);
    EXPECT_FALSE(converted.wire.compare);
    EXPECT_EQ(converted.wire.position_offset, 3);
    EXPECT_EQ(converted.wire.request_key, "user-9");
    EXPECT_THAT(converted.key_lengths, ::testing::ElementsAreArray(key_lengths));
  }
}

TEST(InferJsonTest, BinaryInputsArriveByteForByte) {
  const std::vector<float> x = Random(2 * 3 * 8, 7);
  const std::vector<int32_t> key_lengths = {3, 1};
  json header = {{"inputs",
                  {{{"name", "x"},
                    {"datatype", "FP32"},
                    {"shape", {2, 3, 8}},
                    {"parameters", {{"binary_data_size", x.size() * 4}}}},
                   {{"name", "key_lengths"},
                    {"datatype", "INT32"},
                    {"shape", {2, 1}},
                    {"parameters", {{"binary_data_size", 8}}}}}},
                 {"outputs", {{{"name", "y"}, {"parameters", {{"binary_data", true}}}}}}};
  const std::string text = header.dump();
  const std::string body = text + Bytes(x.data(), x.size() * 4) + Bytes(key_lengths.data(), 8);
  HttpInferRequest parsed;
  ASSERT_TRUE(Parse(body, &parsed, std::to_string(text.size())).ok());
  EXPECT_EQ(parsed.request.raw_input_contents(0), Bytes(x.data(), x.size() * 4));
  EXPECT_EQ(parsed.request.raw_input_contents(1), Bytes(key_lengths.data(), 8));
  EXPECT_TRUE(parsed.binary_output);
  ASSERT_EQ(parsed.request.outputs_size(), 1);
  EXPECT_EQ(parsed.request.outputs(0).name(), "y");

  // With no outputs listed, the request's binary_data_output decides.
  json plain = {{"parameters", {{"binary_data_output", true}}},
                {"inputs", {{{"name", "x"}, {"datatype", "FP32"}, {"shape", {1}}, {"data", {1.5}}}}}};
  HttpInferRequest p2;
  ASSERT_TRUE(Parse(plain.dump(), &p2).ok());
  EXPECT_TRUE(p2.binary_output);
}

TEST(InferJsonTest, HalfAndBFloat16RoundToNearestEven) {
  // Every finite half and bfloat16 value converts back to itself (the decoders are the store's).
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) != 0x7c00u) {
      ASSERT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))), h) << h;
    }
    if ((h & 0x7f80u) != 0x7f80u) {
      ASSERT_EQ(FloatToBFloat16(BFloat16ToFloat(static_cast<uint16_t>(h))), h) << h;
    }
  }
  // Random floats in and around half's range go to a nearest neighbour, ties to the even one.
  std::mt19937 gen(11);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(gen);
    u = (u & 0x807fffffu) | ((100u + u % 60u) << 23);  // exponents 2^-27 .. 2^32
    float f;
    std::memcpy(&f, &u, 4);
    for (const bool half : {true, false}) {
      const uint16_t r = half ? FloatToHalf(f) : FloatToBFloat16(f);
      auto value = [&](uint16_t b) { return static_cast<double>(half ? HalfToFloat(b) : BFloat16ToFloat(b)); };
      const double got = value(r);
      if (std::isinf(got)) {
        ASSERT_GE(std::fabs(f), half ? 65520.0 : 3.38953139e38) << f;
        continue;
      }
      const double err = std::fabs(got - f);
      for (const uint16_t other : {static_cast<uint16_t>(r + 1), static_cast<uint16_t>(r - 1)}) {
        const double v = value(other);
        if (std::isnan(v) || std::isinf(v) || std::signbit(v) != std::signbit(got)) continue;
        const double e = std::fabs(v - f);
        ASSERT_TRUE(err < e || (err == e && (r & 1u) == 0)) << (half ? "half " : "bf16 ") << f << " -> " << got;
      }
    }
  }
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bffu);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00u);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000u);
}

TEST(InferJsonTest, HalfPrecisionJsonDataBecomesItsBits) {
  const std::vector<float> v = {0.5f, -1.25f, 3.0e-5f, 1000.1f};
  for (const char* type : {"FP16", "BF16"}) {
    json body = {{"inputs", {{{"name", "x"}, {"datatype", type}, {"shape", {1, 1, 4}}, {"data", v}}}}};
    HttpInferRequest parsed;
    ASSERT_TRUE(Parse(body.dump(), &parsed).ok());
    std::string want;
    for (float f : v) {
      const uint16_t b = std::string(type) == "FP16" ? FloatToHalf(f) : FloatToBFloat16(f);
      want += Bytes(&b, 2);
    }
    EXPECT_EQ(parsed.request.raw_input_contents(0), want) << type;
  }
}

TEST(InferJsonTest, AJsonAnswerParsesBackToTheSameFloatBits) {
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    std::vector<float> y = Random(2 * 3 * 16, seed);
    y[0] = 1.0e-38f;  // a subnormal-adjacent float and one with all 24 bits of mantissa
    y[1] = 16777215.0f;
    inference::ModelInferResponse response;
    response.set_model_name("demo");
    response.set_model_version("1");
    response.set_id("q");
    auto* t = response.add_outputs();
    t->set_name("y");
    t->set_datatype("FP32");
    for (int64_t s : {2, 3, 16}) t->add_shape(s);
    response.add_raw_output_contents(Bytes(y.data(), y.size() * 4));
    (*response.mutable_parameters())["form"].set_string_param("factored");
    (*response.mutable_parameters())["queue_us"].set_int64_param(12);

    const HttpBody text = WriteInferResponse(response, false);
    EXPECT_FALSE(text.json_length);
    const json j = json::parse(text.bytes);
    EXPECT_EQ(j["model_name"], "demo");
    EXPECT_EQ(j["id"], "q");
    EXPECT_EQ(j["parameters"]["form"], "factored");
    EXPECT_EQ(j["parameters"]["queue_us"], 12);
    EXPECT_EQ(j["outputs"][0]["shape"], json({2, 3, 16}));
    std::vector<float> back;
    for (const auto& v : j["outputs"][0]["data"]) back.push_back(static_cast<float>(v.get<double>()));
    ASSERT_EQ(back.size(), y.size());
    EXPECT_EQ(Bytes(back.data(), back.size() * 4), Bytes(y.data(), y.size() * 4)) << "seed " << seed;

    const HttpBody bin = WriteInferResponse(response, true);
    ASSERT_TRUE(bin.json_length);
    const json h = json::parse(bin.bytes.substr(0, *bin.json_length));
    EXPECT_EQ(h["outputs"][0]["parameters"]["binary_data_size"], y.size() * 4);
    EXPECT_FALSE(h["outputs"][0].contains("data"));
    EXPECT_EQ(bin.bytes.substr(*bin.json_length), Bytes(y.data(), y.size() * 4));
  }
}

struct Refusal {
  std::string body;
  // Inference-Header-Content-Length; "tail:N": the body's length less N (N binary bytes).
  std::optional<std::string> header;
  std::vector<std::string> says;  // the field, what was expected, what came
};

TEST(InferJsonTest, EveryRefusalNamesTheFieldTheExpectationAndWhatCame) {
  const std::string x = R"({"name":"x","datatype":"FP32","shape":[1,1,2],"data":[1,2]})";
  const std::vector<Refusal> cases = {
      {"{not json", {}, {"body", "expected a JSON object", "not JSON"}},
      {"[1,2]", {}, {"body", "expected a JSON object", "got an array"}},
      {R"({"inputs":3})", {}, {"inputs", "expected an array of input tensors", "got an integer 3"}},
      {R"({})", {}, {"inputs", "expected an array", "got null"}},
      {R"({"inputs":[7]})", {}, {"inputs[0]", "expected an object", "got an integer"}},
      {R"({"inputs":[{"datatype":"FP32","shape":[1],"data":[1]}]})",
       {},
       {"inputs[0].name", "expected a string", "null"}},
      {R"({"inputs":[{"name":"x","shape":[1],"data":[1]}]})", {}, {"inputs[0].datatype", "expected a string", "null"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","data":[1]}]})",
       {},
       {"inputs[0].shape", "expected an array", "null"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,-2],"data":[1]}]})",
       {},
       {"inputs[0].shape[1]", "expected a non-negative integer", "-2"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,"a"],"data":[1]}]})",
       {},
       {"inputs[0].shape[1]", "expected a non-negative integer", "a string"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[4294967296,4294967296],"data":[1]}]})",
       {},
       {"inputs[0].shape", "expected at most", "larger product"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,1,3],"data":[1,2]}]})",
       {},
       {"inputs[0].data", "expected 3 values (shape [1, 1, 3])", "got 2"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,1,1],"data":[1,2]}]})",
       {},
       {"inputs[0].data", "expected 1 values", "got more"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,"2"]}]})",
       {},
       {"inputs[0].data", "expected a number or an array of numbers", "a string"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}]})",
       {},
       {"inputs[0].data", "nested at most 16 deep", "deeper"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2]}]})",
       {},
       {"inputs[0].data", "expected the tensor's 2 values", "got none"}},
      {R"({"inputs":[{"name":"k","datatype":"INT32","shape":[2],"data":[1,2.5]}]})",
       {},
       {"inputs[0].data[1]", "expected an INT32 integer", "2.5"}},
      {R"({"inputs":[{"name":"k","datatype":"INT32","shape":[1],"data":[3000000000]}]})",
       {},
       {"inputs[0].data[0]", "expected an INT32 integer", "3000000000"}},
      {R"({"inputs":[{"name":"x","datatype":"FP64","shape":[1],"data":[1]}]})",
       {},
       {"inputs[0].data", "expected the datatype FP32, FP16, BF16 or INT32", "'FP64'"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":8}}]})",
       "",
       {"Inference-Header-Content-Length", "expected the JSON header's length", "got ''"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":8}}]})"
       "abcd",
       "tail:4",
       {"inputs[0].parameters.binary_data_size", "expected at most the 4 bytes left", "got 8"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":-1}}]})",
       {},
       {"inputs[0].parameters.binary_data_size", "expected a non-negative integer", "-1"}},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1],"parameters":{"binary_data_size":4}}]})"
       "abcd",
       "tail:4",
       {"inputs[0]", "expected either data or parameters.binary_data_size", "got both"}},
      {"{\"inputs\":[" + x + "]}" + "junk", "tail:4", {"body", "expected 0 bytes of binary data", "got 4"}},
      {"{\"inputs\":[]}",
       "999",
       {"Inference-Header-Content-Length", "expected at most the body's 13 bytes", "got 999"}},
      {"{\"inputs\":[]}", "12x", {"Inference-Header-Content-Length", "expected the JSON header's length", "'12x'"}},
      {"{\"id\":5,\"inputs\":[" + x + "]}", {}, {"id", "expected a string", "got an integer 5"}},
      {"{\"parameters\":{\"form\":[1]},\"inputs\":[" + x + "]}",
       {},
       {"parameters['form']", "expected a bool, a number or a string", "got an array"}},
      {"{\"parameters\":7,\"inputs\":[" + x + "]}", {}, {"parameters", "expected an object", "got an integer"}},
      {"{\"outputs\":{},\"inputs\":[" + x + "]}", {}, {"outputs", "expected an array", "got an object"}},
      {"{\"outputs\":[{\"name\":1}],\"inputs\":[" + x + "]}",
       {},
       {"outputs[0].name", "expected a string", "an integer"}},
      {"{\"outputs\":[{\"name\":\"y\",\"parameters\":{\"binary_data\":1}}],\"inputs\":[" + x + "]}",
       {},
       {"outputs[0].parameters.binary_data", "expected a bool", "an integer"}},
      {"{\"parameters\":{\"binary_data_output\":\"yes\"},\"inputs\":[" + x + "]}",
       {},
       {"parameters['binary_data_output']", "expected a bool"}},
  };
  for (const Refusal& c : cases) {
    HttpInferRequest parsed;
    std::optional<std::string> header = c.header;
    if (header && header->starts_with("tail:")) header = std::to_string(c.body.size() - std::stoul(header->substr(5)));
    const Status s = Parse(c.body, &parsed, header);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.body;
    for (const std::string& part : c.says) EXPECT_THAT(s.message(), HasSubstr(part)) << c.body;
  }
}

TEST(InferJsonTest, TheGrpcConversionRefusesWhatIsItsToRefuseWithTheSameWords) {
  // A JSON-valid request the protocol refuses: an unknown input name, a wrong output name.
  json body = {{"inputs", {{{"name", "q"}, {"datatype", "FP32"}, {"shape", {1}}, {"data", {1.0}}}}}};
  HttpInferRequest parsed;
  ASSERT_TRUE(Parse(body.dump(), &parsed).ok());
  InferForwardRequest converted;
  ConvertInferRequest(parsed.request, &converted);
  EXPECT_THAT(converted.refused.message(),
              AllOf(HasSubstr("inputs[0].name"), HasSubstr("expected 'x'"), HasSubstr("'q'")));
}

TEST(InferJsonTest, RandomBytesAreRefusedOrReadNeverCrash) {
  std::mt19937 gen(5);
  const std::string seed =
      R"({"id":"a","parameters":{"form":"factored"},"inputs":[{"name":"x","datatype":"FP32","shape":[1,1,2],"data":[1,2]}],"outputs":[{"name":"y"}]})";
  for (int i = 0; i < 20000; ++i) {
    std::string body = seed;
    const int edits = 1 + gen() % 4;
    for (int e = 0; e < edits; ++e) body[gen() % body.size()] = static_cast<char>(gen() % 128);
    HttpInferRequest parsed;
    const Status s =
        Parse(body, &parsed, i % 3 == 0 ? std::optional<std::string>(std::to_string(gen() % 200)) : std::nullopt);
    if (!s.ok()) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    }
  }
}

TEST(InferJsonTest, RefusalsMapToKServesHttpStatuses) {
  EXPECT_EQ(HttpStatusOf(StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusOf(StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusOf(StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusOf(StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusOf(StatusCode::kInternal), 500);
  EXPECT_EQ(json::parse(ErrorJson("x: expected \"1\", got 2"))["error"], "x: expected \"1\", got 2");
}

}  // namespace
}  // namespace attnserve
