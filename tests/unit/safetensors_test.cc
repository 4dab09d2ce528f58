// The safetensors reader: good files round-trip (F16/BF16 against IEEE bit patterns written out
// by hand), and every kind of corrupt file is refused with a message naming the file and the
// tensor, never a crash (this binary also runs under ASan + UBSan).
#include "server/store/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

namespace attnserve {
namespace {

namespace fs = std::filesystem;

uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

std::string LittleEndian(uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

std::string F32Bytes(const std::vector<float>& v) {
  std::string s;
  for (float f : v) s += LittleEndian(FloatBits(f), 4);
  return s;
}

std::string U16Bytes(const std::vector<uint16_t>& v) {
  std::string s;
  for (uint16_t b : v) s += LittleEndian(b, 2);
  return s;
}

// A whole file: the 8-byte length, the header, the data.
std::string FileBytes(const std::string& header, const std::string& data) {
  return LittleEndian(header.size(), 8) + header + data;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("attnserve_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  // Writes a file with this header and data and expects ReadSafetensors to refuse it with
  // INVALID_ARGUMENT and a message holding the path and every one of `words`.
  void ExpectRefused(const std::string& header, const std::string& data, const std::vector<std::string>& words) {
    const std::string path = Write("bad.safetensors", FileBytes(header, data));
    ExpectRefusedFile(path, words);
  }

  void ExpectRefusedFile(const std::string& path, const std::vector<std::string>& words,
                         StatusCode code = StatusCode::kInvalidArgument) {
    auto file = ReadSafetensors(path);
    ASSERT_FALSE(file.ok()) << "accepted " << path;
    EXPECT_EQ(file.status().code(), code) << file.status().ToString();
    EXPECT_NE(file.status().message().find(path), std::string::npos) << file.status().message();
    for (const auto& w : words) {
      EXPECT_NE(file.status().message().find(w), std::string::npos)
          << "message lacks '" << w << "': " << file.status().message();
    }
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, F32RoundTripWithMetadata) {
  const std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 1e-30f};
  const std::vector<float> s = {42.0f};
  const std::string header =
      R"({"__metadata__":{"format":"pt","note":"x"},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("empty":{"dtype":"F32","shape":[0,4],"data_offsets":[24,24]},)"
      R"("scalar":{"dtype":"F32","shape":[],"data_offsets":[24,28]}}   )";
  const std::string path = Write("good.safetensors", FileBytes(header, F32Bytes(a) + F32Bytes(s)));
  auto file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->path(), path);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->tensors()[0].name, "a");
  EXPECT_EQ(file->tensors()[1].name, "empty");
  EXPECT_EQ(file->tensors()[2].name, "scalar");
  EXPECT_EQ(file->Find("nope"), nullptr);

  auto ta = file->ReadFloat("a");
  ASSERT_TRUE(ta.ok()) << ta.status().ToString();
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(ta->values.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(FloatBits(ta->values[i]), FloatBits(a[i])) << i;

  auto te = file->ReadFloat("empty");
  ASSERT_TRUE(te.ok());
  EXPECT_TRUE(te->values.empty());
  auto ts = file->ReadFloat("scalar");
  ASSERT_TRUE(ts.ok());
  EXPECT_TRUE(ts->shape.empty());
  EXPECT_EQ(ts->values, s);

  auto missing = file->ReadFloat("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

// IEEE 754 binary16 → binary32, bit patterns worked out by hand from the two formats.
struct BitCase {
  uint16_t in;
  uint32_t out;
};
constexpr BitCase kHalfCases[] = {
    {0x0000, 0x00000000},  // +0
    {0x8000, 0x80000000},  // -0
    {0x3C00, 0x3F800000},  // 1
    {0xC000, 0xC0000000},  // -2
    {0x3555, 0x3EAAA000},  // 0.333251953125
    {0x7BFF, 0x477FE000},  // 65504, the largest finite half
    {0x0400, 0x38800000},  // 2^-14, the smallest normal
    {0x0001, 0x33800000},  // 2^-24, the smallest subnormal
    {0x8001, 0xB3800000},  // -2^-24
    {0x0200, 0x38000000},  // 2^-15, a subnormal
    {0x03FF, 0x387FC000},  // 1023 · 2^-24, the largest subnormal
    {0x7C00, 0x7F800000},  // +inf
    {0xFC00, 0xFF800000},  // -inf
};
constexpr BitCase kBFloatCases[] = {
    {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x3F80, 0x3F800000},  // 0, -0, 1
    {0xC040, 0xC0400000},                                              // -3
    {0x3EAB, 0x3EAB0000},                                              // 0.333984375
    {0x0001, 0x00010000},                                              // a float32 subnormal, 2^-133
    {0x7F7F, 0x7F7F0000},                                              // the largest finite bfloat16
    {0x7F80, 0x7F800000}, {0xFF80, 0xFF800000},                        // ±inf
};

TEST(HalfConversion, KnownBitPatterns) {
  for (const BitCase& c : kHalfCases) {
    EXPECT_EQ(FloatBits(HalfToFloat(c.in)), c.out) << std::hex << c.in;
  }
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xFE00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0xFE00)));
  for (const BitCase& c : kBFloatCases) {
    EXPECT_EQ(FloatBits(BFloat16ToFloat(c.in)), c.out) << std::hex << c.in;
  }
  EXPECT_EQ(BFloat16ToFloat(0xC040), -3.0f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(0x7FC0)));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(0xFF81)));
}

// Every one of the 65536 halves against the definition, evaluated in double.
TEST(HalfConversion, AllHalvesMatchTheDefinition) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const int sign = (h >> 15) ? -1 : 1;
    const int exponent = static_cast<int>((h >> 10) & 0x1f);
    const int mantissa = static_cast<int>(h & 0x3ff);
    const float got = HalfToFloat(static_cast<uint16_t>(h));
    if (exponent == 31) {
      if (mantissa == 0) {
        EXPECT_TRUE(std::isinf(got) && std::signbit(got) == (sign < 0)) << h;
      } else {
        EXPECT_TRUE(std::isnan(got)) << h;
      }
      continue;
    }
    const double want = exponent == 0 ? sign * std::ldexp(static_cast<double>(mantissa), -24)
                                      : sign * std::ldexp(1024.0 + mantissa, exponent - 25);
    EXPECT_EQ(static_cast<double>(got), want) << h;
    EXPECT_EQ(std::signbit(got), sign < 0) << h;
  }
}

TEST_F(SafetensorsTest, F16AndBF16FilesConvert) {
  std::vector<uint16_t> half, bf;
  for (const BitCase& c : kHalfCases) half.push_back(c.in);
  for (const BitCase& c : kBFloatCases) bf.push_back(c.in);
  const int64_t nh = static_cast<int64_t>(half.size()), nb = static_cast<int64_t>(bf.size());
  const std::string header = R"({"b":{"dtype":"BF16","shape":[)" + std::to_string(nb) + R"(],"data_offsets":[)" +
                             std::to_string(2 * nh) + "," + std::to_string(2 * (nh + nb)) + R"(]},)" +
                             R"("h":{"dtype":"F16","shape":[1,)" + std::to_string(nh) +
                             R"(],"data_offsets":[0,)" + std::to_string(2 * nh) + "]}}";
  const std::string path = Write("half.safetensors", FileBytes(header, U16Bytes(half) + U16Bytes(bf)));
  auto file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->Find("h")->dtype, Dtype::kF16);
  EXPECT_EQ(file->Find("b")->dtype, Dtype::kBF16);
  auto h = file->ReadFloat("h");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->shape, (std::vector<int64_t>{1, nh}));
  for (size_t i = 0; i < half.size(); ++i) EXPECT_EQ(FloatBits(h->values[i]), kHalfCases[i].out) << i;
  auto b = file->ReadFloat("b");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  for (size_t i = 0; i < bf.size(); ++i) EXPECT_EQ(FloatBits(b->values[i]), kBFloatCases[i].out) << i;
}

TEST_F(SafetensorsTest, F64ConvertsAndIntegersOpenButDoNotConvert) {
  const double values[] = {0.1, -2.5, 1e300};
  std::string data;
  for (double v : values) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    data += LittleEndian(bits, 8);
  }
  data += LittleEndian(7, 8);  // an I64 position id, as real checkpoints carry
  const std::string header = R"({"d":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
                             R"("ids":{"dtype":"I64","shape":[1],"data_offsets":[24,32]}})";
  const std::string path = Write("f64.safetensors", FileBytes(header, data));
  auto file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto d = file->ReadFloat("d");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->values[0], 0.1f);
  EXPECT_EQ(d->values[1], -2.5f);
  EXPECT_TRUE(std::isinf(d->values[2]));
  auto ids = file->ReadFloat("ids");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ids.status().message().find("'ids'"), std::string::npos);
  EXPECT_NE(ids.status().message().find("I64"), std::string::npos);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  ExpectRefusedFile((dir_ / "absent.safetensors").string(), {"no such file"}, StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, DirectoryIsRefused) { ExpectRefusedFile(dir_.string(), {"not a regular file"}); }

TEST_F(SafetensorsTest, TruncatedFiles) {
  ExpectRefusedFile(Write("empty.safetensors", ""), {"truncated", "0 bytes"});
  ExpectRefusedFile(Write("five.safetensors", std::string("\x10\x00\x00\x00\x00", 5)), {"truncated", "5 bytes"});
  // A good file cut inside its data: the header now claims bytes the file lacks.
  const std::string good = FileBytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                                     F32Bytes({1, 2, 3, 4}));
  ExpectRefusedFile(Write("cut.safetensors", good.substr(0, good.size() - 3)), {"'a'", "past the data region"});
  // Cut inside the header.
  ExpectRefusedFile(Write("cut_header.safetensors", good.substr(0, 20)), {"header length", "exceeds"});
}

TEST_F(SafetensorsTest, HeaderLengthLies) {
  ExpectRefusedFile(Write("long.safetensors", LittleEndian(1000, 8) + "{}" + std::string(20, ' ')),
                    {"header length field exceeds", "22 bytes"});
  ExpectRefusedFile(Write("huge.safetensors", LittleEndian(~uint64_t{0}, 8) + "{}"),
                    {"header length field exceeds the limit"});
  ExpectRefusedFile(Write("big.safetensors", LittleEndian(uint64_t{200} << 20, 8) + "{}"), {"limit"});
  ExpectRefusedFile(Write("zero.safetensors", LittleEndian(0, 8)), {"too short"});
  // One byte past the file's end, and exactly to it (a header and no tensors' data).
  ExpectRefusedFile(Write("one_past.safetensors", LittleEndian(23, 8) + "{}" + std::string(20, ' ')),
                    {"header length field exceeds", "22 bytes"});
  const std::string to_end = Write("to_end.safetensors", LittleEndian(22, 8) + "{}" + std::string(20, ' '));
  auto read = ReadSafetensors(to_end);
  EXPECT_TRUE(read.ok()) << read.status().ToString();
}

TEST_F(SafetensorsTest, BadJson) {
  ExpectRefused("{not json", "", {"not valid JSON"});
  ExpectRefused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", "abcd", {"not valid JSON"});
  ExpectRefused("[1,2]", "", {"JSON object"});
  ExpectRefused("\"str\"", "", {"JSON object"});
  ExpectRefused("{\"a\xff\":1}", "", {"not valid JSON"});  // invalid UTF-8 in a name
  ExpectRefused(std::string(5000, '[') + std::string(5000, ']'), "", {"nests deeper"});
  // At the limit: a field the reader ignores may nest to 8 levels with the object and the
  // tensor's, not to 9.
  auto nested = [](int levels) {
    return R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":)" + std::string(levels - 2, '[') +
           std::string(levels - 2, ']') + "}}";
  };
  const std::string path = Write("deep.safetensors", FileBytes(nested(8), F32Bytes({1})));
  auto read = ReadSafetensors(path);
  EXPECT_TRUE(read.ok()) << read.status().ToString();
  ExpectRefused(nested(9), F32Bytes({1}), {"nests deeper than 8 levels"});
  ExpectRefused(R"({"__metadata__":{"k":1}})", "", {"__metadata__", "'k'"});
  ExpectRefused(R"({"__metadata__":[1]})", "", {"__metadata__"});
}

TEST_F(SafetensorsTest, BadEntries) {
  const std::string four = F32Bytes({1, 2, 3, 4});
  ExpectRefused(R"({"w":3})", "", {"'w'", "expected an object"});
  ExpectRefused(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", four, {"'w'", "dtype"});
  ExpectRefused(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", four, {"'w'", "dtype"});
  ExpectRefused(R"({"w":{"dtype":"F17","shape":[1],"data_offsets":[0,4]}})", four, {"'w'", "unknown dtype", "F17"});
  ExpectRefused(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", four, {"'w'", "shape"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":"4","data_offsets":[0,4]}})", four, {"'w'", "shape"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", four, {"'w'", "data_offsets"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4]}})", four, {"'w'", "data_offsets"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,-16]}})", four, {"'w'", "non-negative"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", four, {"'w'", "end before"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0.0,16]}})", four, {"'w'", "integer"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})", four,
                {"'w'", "17 dimensions"});
}

TEST_F(SafetensorsTest, BadShapes) {
  const std::string four = F32Bytes({1, 2, 3, 4});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", four, {"'w'", "shape[0]", "non-negative"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}})", four, {"'w'", "shape[0]", "integer"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[1e30],"data_offsets":[0,16]}})", four, {"'w'", "shape[0]"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,16]}})", four,
                {"'w'", "shape[0]", "at most"});
  // 2^32 · 2^32 = 2^64 elements: the product overflows int64.
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", four,
                {"'w'", "more elements than fit"});
  // 2^62 elements fit, 2^62 · 4 bytes do not.
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,16]}})", four,
                {"'w'", "more bytes than fit"});
  // A zero dimension keeps an overflowing product from mattering, but the span must be 0.
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,16]}})", four,
                {"'w'", "needs 0 bytes", "span 16"});
}

TEST_F(SafetensorsTest, LyingOffsets) {
  const std::string data = F32Bytes({1, 2, 3, 4, 5, 6});  // 24 bytes
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[6],"data_offsets":[0,28]}})", data,
                {"'w'", "[0, 28]", "past the data region", "24 bytes"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[9223372036854775800,9223372036854775807]}})",
                data, {"'w'", "past the data region"});
  ExpectRefused(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data,
                {"'w'", "needs 12 bytes", "span 16"});
  ExpectRefused(R"({"w":{"dtype":"F16","shape":[3],"data_offsets":[0,12]}})", data, {"'w'", "F16", "needs 6 bytes"});
  ExpectRefused(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                R"("b":{"dtype":"F32","shape":[3],"data_offsets":[12,24]}})",
                data, {"'b'", "overlap", "'a'"});
  ExpectRefused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                R"("b":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                data, {"overlap"});
  // Same range twice.
  ExpectRefused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                data, {"overlap"});
}

// Zero-length tensors occupy no bytes, so they may sit anywhere in the data region.
TEST_F(SafetensorsTest, EmptyTensorsDoNotOverlap) {
  const std::string path = Write(
      "empties.safetensors",
      FileBytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                F32Bytes({1, 2})));
  auto file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
}

// Random corruptions of a good file: each is refused or read, never a crash or a throw.
TEST_F(SafetensorsTest, RandomCorruptionsNeverCrash) {
  const std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"F16","shape":[4],"data_offsets":[16,24]},)"
                             R"("c":{"dtype":"BF16","shape":[2,1],"data_offsets":[24,28]}})";
  const std::string good = FileBytes(header, F32Bytes({1, 2, 3, 4}) + U16Bytes({0x3C00, 0x7C00, 0x0001, 0x8000}) +
                                                 U16Bytes({0x3F80, 0x7FC0}));
  ASSERT_TRUE(ReadSafetensors(Write("good.safetensors", good)).ok());
  std::mt19937_64 rng(20261129);
  int accepted = 0;
  const int rounds = 3000;
  for (int round = 0; round < rounds; ++round) {
    std::string bytes = good;
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {  // flip a few bytes anywhere
      for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    } else if (kind == 1) {  // truncate
      bytes.resize(rng() % bytes.size());
    } else if (kind == 2) {  // change a digit or a character of the header
      const size_t at = 8 + rng() % header.size();
      bytes[at] = "0123456789[]{},:\"-.eE9"[rng() % 22];
    } else {  // lie about the header length
      const uint64_t len = rng() % 2 ? rng() % (header.size() + 40) : rng();
      bytes.replace(0, 8, LittleEndian(len, 8));
    }
    auto file = ReadSafetensors(Write("fuzz.safetensors", bytes));
    if (!file.ok()) {
      EXPECT_FALSE(file.status().message().empty());
      continue;
    }
    ++accepted;
    for (const TensorInfo& t : file->tensors()) {
      auto v = file->ReadFloat(t.name);
      if (v.ok()) {
        EXPECT_EQ(static_cast<int64_t>(v->values.size()), t.elements);
      }
    }
  }
  std::cout << "corruptions accepted (still well-formed): " << accepted << " of " << rounds << "\n";
}

}  // namespace
}  // namespace attnserve
