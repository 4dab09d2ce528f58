// Writes the seed corpus of the forward_request fuzz target (tests/fuzz/corpus/forward_request):
// serialized attnserve.v1.ForwardRequest messages for its layer (d_model 8, 4 heads), valid ones
// over every dtype, form and option, and near-valid ones that DecodeForward refuses.
//   forward_request_seeds DIR
// Deterministic: the same files every run.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <string>

#include "attnserve/v1/attention.pb.h"

namespace {

namespace v1 = attnserve::v1;
constexpr int64_t kDModel = 8;  // the fuzz target's layer

// [b, n, d] of float32 (or float16 / bfloat16 bit patterns) with small deterministic values.
v1::Tensor MakeTensor(v1::DataType dtype, std::initializer_list<int64_t> shape, float scale = 0.25f) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t elements = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    elements *= d;
  }
  std::string data;
  for (int64_t i = 0; i < elements; ++i) {
    const float v = scale * static_cast<float>((i * 7) % 11 - 5);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (dtype == v1::DATA_TYPE_FLOAT32) {
      data.append(reinterpret_cast<const char*>(&bits), 4);
    } else if (dtype == v1::DATA_TYPE_BFLOAT16) {
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      data.append(reinterpret_cast<const char*>(&b), 2);
    } else {
      // float16 of these small multiples of 0.25 (exact): sign, exponent - 127 + 15, mantissa.
      uint16_t h = 0;
      if (v != 0.0f) {
        const uint32_t sign = bits >> 31, exp = (bits >> 23) & 0xff, mant = bits & 0x7fffff;
        h = static_cast<uint16_t>((sign << 15) | ((exp - 127 + 15) << 10) | (mant >> 13));
      }
      data.append(reinterpret_cast<const char*>(&h), 2);
    }
  }
  t.set_data(data);
  return t;
}

int failures = 0;

void Write(const std::string& dir, const std::string& name, const v1::ForwardRequest& request) {
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  if (!request.SerializeToOstream(&out)) {
    std::fprintf(stderr, "forward_request_seeds: cannot write %s/%s\n", dir.c_str(), name.c_str());
    ++failures;
  }
}

v1::ForwardRequest Base(std::initializer_list<int64_t> shape, v1::DataType dtype = v1::DATA_TYPE_FLOAT32) {
  v1::ForwardRequest r;
  r.set_layer("fuzz");
  *r.mutable_input() = MakeTensor(dtype, shape);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: forward_request_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];

  Write(dir, "self_f32", Base({1, 3, kDModel}));

  auto r = Base({2, 2, kDModel});
  r.set_form(v1::FORM_SUMMED);
  r.set_causal(true);
  r.add_key_lengths(1);
  r.add_key_lengths(2);
  Write(dir, "summed_causal_key_lengths", r);

  r = Base({2, 2, kDModel}, v1::DATA_TYPE_FLOAT16);
  r.set_form(v1::FORM_FACTORED);
  *r.mutable_context() = MakeTensor(v1::DATA_TYPE_FLOAT16, {2, 3, kDModel});
  r.add_key_lengths(3);
  r.add_key_lengths(1);
  r.set_position_offset(5);
  Write(dir, "cross_f16_offset", r);

  r = Base({1, 4, kDModel}, v1::DATA_TYPE_BFLOAT16);
  r.set_form(v1::FORM_LOWRANK);
  r.set_compare(true);
  r.set_request_key("user-1");
  Write(dir, "lowrank_bf16_compare", r);

  // Near-valid: each refused by one check of DecodeForward or ChooseForm.
  Write(dir, "bad_d_model", Base({1, 2, kDModel + 1}));
  r = Base({1, 2, kDModel});
  r.mutable_input()->mutable_data()->pop_back();
  Write(dir, "bad_byte_count", r);
  r = Base({1, 2, kDModel});
  const float nan = std::nanf("");
  r.mutable_input()->mutable_data()->replace(4, 4, reinterpret_cast<const char*>(&nan), 4);
  Write(dir, "bad_nan", r);
  r = Base({1, 2, kDModel});
  r.add_key_lengths(3);
  Write(dir, "bad_key_length", r);
  r = Base({1, 2, kDModel});
  *r.mutable_context() = MakeTensor(v1::DATA_TYPE_FLOAT32, {2, 2, kDModel});
  Write(dir, "bad_context_batch", r);
  r = Base({1, 2, kDModel});
  r.set_position_offset(-1);
  Write(dir, "bad_position_offset", r);
  r = Base({1, 2, kDModel});
  r.set_form(static_cast<v1::Form>(7));
  Write(dir, "bad_form", r);
  return failures == 0 ? 0 : 1;
}
