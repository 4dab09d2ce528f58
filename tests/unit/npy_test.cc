// Tests of client/npy: round trips, numpy's exact byte layout, and corrupt files refused.
#include "client/npy.h"
#include "tests/unit/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A .npy image with the given header dict text, padded the way numpy pads it.
std::string Image(const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const size_t pre = major == 1 ? 10 : 12;
  const size_t unpadded = pre + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t n = static_cast<uint32_t>(header.size());
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) {
    out += static_cast<char>((n >> 16) & 0xff);
    out += static_cast<char>((n >> 24) & 0xff);
  }
  return out + header + data;
}

std::string FloatBytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(v[i]);
    for (int b = 0; b < 4; ++b) s[i * 4 + b] = static_cast<char>((u >> (8 * b)) & 0xff);
  }
  return s;
}

std::string Dict(const std::string& descr, const std::string& fortran, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

using testing::TempDir;

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

NpyArray RandomArray(std::mt19937_64& rng, std::vector<int64_t> shape) {
  NpyArray a;
  a.shape = std::move(shape);
  size_t n = 1;
  for (int64_t d : a.shape) n *= static_cast<size_t>(d);
  std::normal_distribution<float> normal;
  a.data.resize(n);
  for (float& x : a.data) x = normal(rng);
  return a;
}

TEST(Npy, RoundTripInMemoryAndThroughFilesOfSeveralRanks) {
  std::mt19937_64 rng(7);
  TempDir dir;
  const std::vector<std::vector<int64_t>> shapes = {
      {}, {1}, {7}, {0}, {3, 5}, {2, 0, 4}, {2, 3, 4}, {1, 2, 3, 4, 5}, {2, 1, 1, 3, 1, 2}};
  int i = 0;
  for (const auto& shape : shapes) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    const NpyArray a = RandomArray(rng, shape);

    std::string bytes;
    ASSERT_TRUE(SerializeNpy(a, &bytes).ok());
    // numpy aligns the data to 64 bytes.
    const size_t header_len =
        static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    EXPECT_EQ((10 + header_len) % 64, 0u);
    NpyArray b;
    grpc::Status s = ParseNpy(bytes, "mem", &b);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(b.shape, a.shape);
    EXPECT_EQ(b.data, a.data);

    const std::string path = dir.File("a" + std::to_string(i++) + ".npy");
    ASSERT_TRUE(WriteNpy(path, a).ok());
    NpyArray c;
    s = ReadNpy(path, &c);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(c.shape, a.shape);
    EXPECT_EQ(c.data, a.data);
  }
}

TEST(Npy, WritesExactlyWhatNumpyWrites) {
  // np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)) writes this image.
  NpyArray a{{2, 3}, {0, 1, 2, 3, 4, 5}};
  std::string bytes;
  ASSERT_TRUE(SerializeNpy(a, &bytes).ok());
  const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string want = "\x93NUMPY\x01";
  want += '\0';
  want += "\x76";  // 118: 10 + 118 = 128
  want += '\0';
  want += header + std::string(128 - 10 - header.size() - 1, ' ') + "\n";
  want += FloatBytes(a.data);
  EXPECT_EQ(bytes, want);

  // A 1-D shape is written as a one-element tuple.
  ASSERT_TRUE(SerializeNpy(NpyArray{{3}, {1, 2, 3}}, &bytes).ok());
  EXPECT_THAT(bytes, HasSubstr("'shape': (3,), }"));
  ASSERT_TRUE(SerializeNpy(NpyArray{{}, {1}}, &bytes).ok());
  EXPECT_THAT(bytes, HasSubstr("'shape': (), }"));
}

TEST(Npy, AcceptsNumpyVariants) {
  const std::string data = FloatBytes({1, 2, 3, 4, 5, 6});
  NpyArray out;
  // Keys in another order, double quotes, no trailing comma, Python 2 longs, version 2.0.
  for (const std::string& img :
       {Image("{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", data),
        Image("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,3)}", data),
        Image("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", data),
        Image(Dict("<f4", "False", "(2, 3)"), data, 2)}) {
    grpc::Status s = ParseNpy(img, "v.npy", &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(out.data, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  }
}

TEST(Npy, ConvertsFloat64) {
  std::string data;
  for (double v : {0.5, -1.25, 1e300}) {
    const uint64_t u = std::bit_cast<uint64_t>(v);
    for (int b = 0; b < 8; ++b) data += static_cast<char>((u >> (8 * b)) & 0xff);
  }
  NpyArray out;
  grpc::Status s = ParseNpy(Image(Dict("<f8", "False", "(3,)"), data), "d.npy", &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(out.data.size(), 3u);
  EXPECT_EQ(out.data[0], 0.5f);
  EXPECT_EQ(out.data[1], -1.25f);
  EXPECT_TRUE(std::isinf(out.data[2]));

  // The same through a file (the chunked conversion path).
  TempDir dir;
  const std::string path = dir.File("d.npy");
  WriteBytes(path, Image(Dict("<f8", "False", "(3,)"), data));
  s = ReadNpy(path, &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(out.data[1], -1.25f);
}

struct Corrupt {
  std::string name;
  std::string bytes;
  std::string message;  // a substring of the error
};

std::vector<Corrupt> CorruptFiles() {
  const std::string six = FloatBytes({1, 2, 3, 4, 5, 6});
  const std::string good = Image(Dict("<f4", "False", "(2, 3)"), six);
  std::vector<Corrupt> c = {
      {"empty", "", "expected at least 10 bytes"},
      {"bad_magic", "\x93NUMPZ" + good.substr(6), "expected magic"},
      {"not_npy", "PK\x03\x04 this is a zip file", "expected magic"},
      {"bad_version", good.substr(0, 6) + "\x04" + good.substr(7), "version: expected 1.0"},
      {"truncated_preamble", good.substr(0, 9), "expected at least 10 bytes"},
      {"truncated_header", good.substr(0, 40), "truncated: header needs 128 bytes"},
      {"truncated_data", good.substr(0, good.size() - 1), "(truncated)"},
      {"trailing_bytes", good + "x", "(trailing bytes)"},
      {"shape_lies_bigger", Image(Dict("<f4", "False", "(3, 3)"), six), "expected 164 bytes"},
      {"shape_lies_smaller", Image(Dict("<f4", "False", "(2, 2)"), six), "(trailing bytes)"},
      {"fortran_order", Image(Dict("<f4", "True", "(2, 3)"), six), "fortran_order: expected False"},
      {"int32", Image(Dict("<i4", "False", "(2, 3)"), six), "got '<i4'"},
      {"big_endian", Image(Dict(">f4", "False", "(2, 3)"), six), "got '>f4'"},
      {"float16", Image(Dict("<f2", "False", "(2, 3)"), six), "expected '<f4' (float32)"},
      {"structured",
       Image("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", six),
       "expected a quoted string"},
      {"missing_shape", Image("{'descr': '<f4', 'fortran_order': False, }", six),
       "key 'shape' is missing"},
      {"duplicate_key",
       Image("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}", six),
       "'descr' appears twice"},
      {"unknown_key", Image("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}", six),
       "got 'x'"},
      {"shape_not_tuple", Image(Dict("<f4", "False", "(6)"), six), "expected a tuple like (5,)"},
      {"shape_negative", Image(Dict("<f4", "False", "(-6,)"), six),
       "expected a non-negative integer"},
      {"shape_float", Image(Dict("<f4", "False", "(6.0,)"), six), "expected ',' or ')'"},
      {"shape_overflow_dim", Image(Dict("<f4", "False", "(99999999999999999999,)"), six),
       "overflows int64"},
      {"shape_overflow_product",
       Image(Dict("<f4", "False", "(4294967296, 4294967296, 4294967296)"), six),
       "element count overflows"},
      {"shape_huge_but_short", Image(Dict("<f4", "False", "(1000000000000,)"), six), "(truncated)"},
      {"fortran_not_bool", Image(Dict("<f4", "0", "(2, 3)"), six), "expected True or False"},
      {"garbage_after_dict", Image(Dict("<f4", "False", "(2, 3)") + " x", six),
       "expected only padding"},
      {"escape_in_string",
       Image("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (6,)}", six),
       "expected a short plain string"},
  };
  // The header must end with a newline.
  std::string no_newline = good;
  no_newline[127] = ' ';
  c.push_back({"no_newline", no_newline, "expected to end with a newline"});
  // A version 2.0 header claiming a gigabyte is refused before it is read.
  std::string huge = "\x93NUMPY\x02";
  huge += '\0';
  huge += std::string("\x00\x00\x00\x40", 4);
  huge += "{'descr': '<f4'";
  c.push_back({"huge_header", huge, "header length: expected <= 65536 bytes, got 1073741824"});
  return c;
}

TEST(Npy, RefusesCorruptImages) {
  for (const Corrupt& c : CorruptFiles()) {
    SCOPED_TRACE(c.name);
    NpyArray out;
    grpc::Status s = ParseNpy(c.bytes, c.name + ".npy", &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.name + ".npy: "));
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
}

TEST(Npy, RefusesCorruptFilesNamingThem) {
  TempDir dir;
  for (const Corrupt& c : CorruptFiles()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.File(c.name + ".npy");
    WriteBytes(path, c.bytes);
    NpyArray out;
    grpc::Status s = ReadNpy(path, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(path + ": "));
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    // Nothing was allocated from a lying header.
    EXPECT_LE(out.data.size(), 6u);
  }
}

TEST(Npy, MissingFileIsNotFound) {
  TempDir dir;
  NpyArray out;
  const std::string path = dir.File("absent.npy");
  grpc::Status s = ReadNpy(path, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr(path));
}

TEST(Npy, WriteRefusesMismatchedData) {
  std::string bytes;
  grpc::Status s = SerializeNpy(NpyArray{{2, 3}, {1, 2, 3}}, &bytes);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expected 6 values"));
  EXPECT_THAT(s.error_message(), HasSubstr("got 3"));
  s = SerializeNpy(NpyArray{{-1}, {}}, &bytes);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  TempDir dir;
  s = WriteNpy(dir.File("no/such/dir/x.npy"), NpyArray{{1}, {1}});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.error_message(), HasSubstr("x.npy"));
}

}  // namespace
}  // namespace attnserve
