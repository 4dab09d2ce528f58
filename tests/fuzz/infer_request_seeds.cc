// Writes the seed corpus of the infer_request fuzz target (tests/fuzz/corpus/infer_request):
// serialized inference.ModelInferRequest messages for its layer (d_model 8), valid ones with raw
// and typed contents, FP16, context, key_lengths and every parameter, and near-valid ones that
// the conversion or DecodeForward refuses.
//   infer_request_seeds DIR
// Deterministic: the same files every run.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "inference/grpc_service.pb.h"

namespace {

using inference::ModelInferRequest;
constexpr int64_t kDModel = 8;  // the fuzz target's layer

std::vector<float> Values(int64_t count) {
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i) v[i] = 0.25f * static_cast<float>((i * 7) % 11 - 5);
  return v;
}

int64_t Count(std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A float input, raw (FP32 or FP16 bit patterns) or typed (fp32_contents).
void AddFloat(ModelInferRequest* r, const char* name, std::initializer_list<int64_t> shape, bool raw,
              bool half = false) {
  auto* t = r->add_inputs();
  t->set_name(name);
  t->set_datatype(half ? "FP16" : "FP32");
  for (int64_t d : shape) t->add_shape(d);
  const std::vector<float> v = Values(Count(shape));
  if (!raw) {
    for (float f : v) t->mutable_contents()->add_fp32_contents(f);
    return;
  }
  std::string bytes;
  for (float f : v) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (!half) {
      bytes.append(reinterpret_cast<const char*>(&bits), 4);
      continue;
    }
    // float16 of these small multiples of 0.25 (exact): sign, exponent - 127 + 15, mantissa.
    uint16_t h = 0;
    if (f != 0.0f) {
      const uint32_t sign = bits >> 31, exp = (bits >> 23) & 0xff, mant = bits & 0x7fffff;
      h = static_cast<uint16_t>((sign << 15) | ((exp - 127 + 15) << 10) | (mant >> 13));
    }
    bytes.append(reinterpret_cast<const char*>(&h), 2);
  }
  r->add_raw_input_contents(bytes);
}

void AddKeyLengths(ModelInferRequest* r, std::vector<int32_t> lengths, bool raw) {
  auto* t = r->add_inputs();
  t->set_name("key_lengths");
  t->set_datatype("INT32");
  t->add_shape(static_cast<int64_t>(lengths.size()));
  if (raw) {
    r->add_raw_input_contents(std::string(reinterpret_cast<const char*>(lengths.data()), lengths.size() * 4));
  } else {
    for (int32_t k : lengths) t->mutable_contents()->add_int_contents(k);
  }
}

ModelInferRequest Base() {
  ModelInferRequest r;
  r.set_model_name("fuzz");
  r.set_id("seed");
  return r;
}

int failures = 0;

void Write(const std::string& dir, const std::string& name, const ModelInferRequest& request) {
  // Deterministic serialization: map entries (parameters) in key order, not hash order.
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!request.SerializeToCodedStream(&coded)) ++failures;
  }
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out << bytes;
  if (!out.good()) {
    std::fprintf(stderr, "infer_request_seeds: cannot write %s/%s\n", dir.c_str(), name.c_str());
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: infer_request_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];

  ModelInferRequest r = Base();
  AddFloat(&r, "x", {1, 3, kDModel}, true);
  Write(dir, "raw_f32", r);

  r = Base();
  AddFloat(&r, "x", {2, 2, kDModel}, false);
  AddKeyLengths(&r, {1, 2}, false);
  (*r.mutable_parameters())["form"].set_string_param("summed");
  (*r.mutable_parameters())["causal"].set_bool_param(true);
  Write(dir, "typed_summed_causal_key_lengths", r);

  r = Base();
  AddFloat(&r, "x", {2, 2, kDModel}, true, /*half=*/true);
  AddFloat(&r, "context", {2, 3, kDModel}, true, /*half=*/true);
  AddKeyLengths(&r, {3, 1}, true);
  (*r.mutable_parameters())["form"].set_string_param("factored");
  (*r.mutable_parameters())["position_offset"].set_int64_param(5);
  r.add_outputs()->set_name("y");
  Write(dir, "raw_f16_cross_offset", r);

  r = Base();
  AddFloat(&r, "x", {1, 4, kDModel}, true);
  (*r.mutable_parameters())["form"].set_string_param("lowrank");
  (*r.mutable_parameters())["compare"].set_bool_param(true);
  (*r.mutable_parameters())["request_key"].set_string_param("user-1");
  (*r.mutable_parameters())["triton_enable_empty_final_response"].set_bool_param(true);
  (*r.mutable_parameters())["priority"].set_int64_param(1);
  Write(dir, "lowrank_compare_ignored_parameters", r);

  // Near-valid: each refused by one check of the conversion or DecodeForward.
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel}, true);
  r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1.0f);
  Write(dir, "bad_mixed_contents", r);
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel}, true);
  r.mutable_raw_input_contents(0)->pop_back();
  Write(dir, "bad_byte_count", r);
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel + 1}, false);
  Write(dir, "bad_d_model", r);
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel}, true);
  AddKeyLengths(&r, {3}, true);
  Write(dir, "bad_key_length", r);
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel}, true);
  r.mutable_inputs(0)->set_datatype("INT8");
  Write(dir, "bad_datatype", r);
  r = Base();
  AddFloat(&r, "x", {1, 2, kDModel}, true);
  (*r.mutable_parameters())["form"].set_string_param("fast");
  Write(dir, "bad_form", r);
  r = Base();
  AddFloat(&r, "context", {1, 2, kDModel}, true);
  Write(dir, "bad_no_x", r);
  return failures == 0 ? 0 : 1;
}
