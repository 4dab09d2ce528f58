// NumPy's .npy format, read: the preamble, a strict parse of the header dict and the size of the
// data, checked before anything is sized from them; and the elements decoded to float32. The
// client's arrays (client/npy.h) and the server's calibration files (server/store/
// calibration_file.h) both read through here, so one parser, fuzzed by both, judges every file.
//
// Only what float arrays need is accepted: version 1.0, 2.0 or 3.0 (ASCII header), dtype '<f4'
// (read as is) or '<f8' (converted to float32; values beyond its range become ±inf), C order,
// any rank up to kMaxRank, a header of at most kMaxHeaderBytes. Every error starts with the
// name given (a path, an option) and says what was expected and what was found.
// Pure C++ and the standard library: no gRPC, no server type.
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace attnserve::npy {

inline constexpr std::string_view kMagic = "\x93NUMPY";
// The largest header accepted (numpy writes well under 1 KiB for any reasonable rank); a larger
// declared length is refused before it is read.
inline constexpr uint32_t kMaxHeaderBytes = 64 * 1024;
inline constexpr int kMaxRank = 32;

enum class Dtype { kFloat32, kFloat64 };

// Where an array's elements lie in its file, once the file has been checked.
struct Layout {
  Dtype dtype = Dtype::kFloat32;
  std::vector<int64_t> shape;  // empty: a scalar (one element)
  uint64_t count = 0;          // elements: the product of shape
  uint64_t data_offset = 0;    // bytes before the first element
  uint64_t data_bytes = 0;     // count × the element's size: the file ends there, exactly
};

// Reads `n` bytes at `offset` into `dst`; false when they are not all there.
using ReadAt = std::function<bool(uint64_t offset, size_t n, char* dst)>;

// Checks everything before the data, and that the file is exactly as long as the header says,
// reading through `read` a file of `total_size` bytes; the data itself is not read. False with
// `*error` ("NAME: ...") when anything is not as the format says or this reader accepts.
bool ParseLayout(const ReadAt& read, uint64_t total_size, std::string_view name, Layout* layout, std::string* error);
// The same over a whole file's bytes in memory.
bool ParseLayout(std::string_view bytes, std::string_view name, Layout* layout, std::string* error);

// Converts `n` little-endian elements of `dtype` at `src` to floats at `dst`.
void Decode(const char* src, uint64_t n, Dtype dtype, float* dst);

// "(2, 3)", "(5,)", "()": a shape as numpy writes it.
std::string ShapeString(const std::vector<int64_t>& shape);

// A few untrusted bytes, printable: control and non-ASCII bytes as \xNN, at most `max` of them.
std::string Printable(std::string_view s, size_t max = 16);

}  // namespace attnserve::npy
