#include "client/npy.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>

namespace attnserve {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

grpc::Status Invalid(std::string_view name, const std::string& msg) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name) + ": " + msg);
}

// Printable form of a few untrusted bytes for an error message.
std::string Printable(std::string_view s, size_t max = 16) {
  std::string out;
  static const char kHex[] = "0123456789abcdef";
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

enum class Dtype { kF4, kF8 };

struct Layout {
  Dtype dtype = Dtype::kF4;
  std::vector<int64_t> shape;
  uint64_t count = 0;        // elements
  uint64_t data_offset = 0;  // bytes before the data
  uint64_t data_bytes = 0;
};

// A strict parser of the header dict numpy writes:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Python literal syntax, restricted to exactly what these three keys can hold.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string_view name) : s_(text), name_(name) {}

  grpc::Status Parse(std::string* descr, bool* fortran, std::vector<int64_t>* shape) {
    if (s_.empty() || s_.back() != '\n') {
      return Error("header: expected to end with a newline, got '" +
                   Printable(s_.substr(s_.size() > 8 ? s_.size() - 8 : 0)) + "'");
    }
    SkipSpace();
    if (!Eat('{')) return Error("header: expected '{', got " + Here());
    bool have_descr = false, have_fortran = false, have_shape = false;
    while (true) {
      SkipSpace();
      if (Eat('}')) break;
      std::string key;
      if (auto st = ParseString(&key); !st.ok()) return st;
      SkipSpace();
      if (!Eat(':')) return Error("header: expected ':' after '" + key + "', got " + Here());
      SkipSpace();
      if (key == "descr") {
        if (have_descr) return Error("header: key 'descr' appears twice");
        have_descr = true;
        if (auto st = ParseString(descr); !st.ok()) return st;
      } else if (key == "fortran_order") {
        if (have_fortran) return Error("header: key 'fortran_order' appears twice");
        have_fortran = true;
        if (auto st = ParseBool(fortran); !st.ok()) return st;
      } else if (key == "shape") {
        if (have_shape) return Error("header: key 'shape' appears twice");
        have_shape = true;
        if (auto st = ParseShape(shape); !st.ok()) return st;
      } else {
        return Error("header: expected keys 'descr', 'fortran_order', 'shape', got '" +
                     Printable(key) + "'");
      }
      SkipSpace();
      if (Eat(',')) continue;
      if (Eat('}')) break;
      return Error("header: expected ',' or '}', got " + Here());
    }
    for (; pos_ < s_.size(); ++pos_) {
      if (s_[pos_] != ' ' && s_[pos_] != '\n') {
        return Error("header: expected only padding after '}', got " + Here());
      }
    }
    if (!have_descr) return Error("header: key 'descr' is missing");
    if (!have_fortran) return Error("header: key 'fortran_order' is missing");
    if (!have_shape) return Error("header: key 'shape' is missing");
    return grpc::Status::OK;
  }

 private:
  grpc::Status Error(const std::string& msg) const { return Invalid(name_, msg); }

  std::string Here() const {
    if (pos_ >= s_.size()) return "end of header";
    return "'" + Printable(s_.substr(pos_, 12)) + "' at offset " + std::to_string(pos_);
  }

  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n')) ++pos_;
  }

  bool Eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  grpc::Status ParseString(std::string* out) {
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) {
      return Error("header: expected a quoted string, got " + Here());
    }
    const char q = s_[pos_++];
    out->clear();
    while (pos_ < s_.size() && s_[pos_] != q) {
      char c = s_[pos_++];
      // No escapes or control characters: nothing valid in these three keys needs them.
      if (c == '\\' || static_cast<unsigned char>(c) < 0x20 || out->size() >= 64) {
        return Error("header: expected a short plain string, got " + Here());
      }
      *out += c;
    }
    if (!Eat(q)) return Error("header: unterminated string");
    return grpc::Status::OK;
  }

  grpc::Status ParseBool(bool* out) {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      *out = true;
    } else if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      *out = false;
    } else {
      return Error("header: 'fortran_order': expected True or False, got " + Here());
    }
    return grpc::Status::OK;
  }

  grpc::Status ParseShape(std::vector<int64_t>* shape) {
    shape->clear();
    if (!Eat('(')) return Error("header: 'shape': expected a tuple, got " + Here());
    bool trailing_comma = false;
    while (true) {
      SkipSpace();
      if (Eat(')')) break;
      if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') {
        return Error("header: 'shape': expected a non-negative integer, got " + Here());
      }
      int64_t v = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
        int d = s_[pos_++] - '0';
        if (v > (std::numeric_limits<int64_t>::max() - d) / 10) {
          return Error("header: 'shape': dimension overflows int64");
        }
        v = v * 10 + d;
      }
      Eat('L');  // Python 2 numpy wrote long integers as 3L
      if (static_cast<int>(shape->size()) >= kNpyMaxRank) {
        return Error("header: 'shape': expected rank <= " + std::to_string(kNpyMaxRank) +
                     ", got more");
      }
      shape->push_back(v);
      SkipSpace();
      trailing_comma = Eat(',');
      if (trailing_comma) continue;
      if (Eat(')')) break;
      return Error("header: 'shape': expected ',' or ')', got " + Here());
    }
    // (5) is the integer 5 in Python, not a tuple; numpy always writes (5,).
    if (shape->size() == 1 && !trailing_comma) {
      return Error("header: 'shape': expected a tuple like (5,), got (" +
                   std::to_string((*shape)[0]) + ")");
    }
    return grpc::Status::OK;
  }

  std::string_view s_;
  std::string_view name_;
  size_t pos_ = 0;
};

// Reads `n` bytes at `offset` into `dst`; false when they are not all there.
using ReadAt = std::function<bool(uint64_t offset, size_t n, char* dst)>;

// Validates everything before the data, and the total size, without touching the data.
grpc::Status ParseLayout(const ReadAt& read, uint64_t total_size, std::string_view name,
                         Layout* layout) {
  char pre[12];
  if (total_size < 10 || !read(0, 8, pre)) {
    return Invalid(name, "truncated: expected at least 10 bytes of preamble, got " +
                             std::to_string(total_size));
  }
  if (std::memcmp(pre, kMagic, kMagicLen) != 0) {
    return Invalid(name, "not a .npy file: expected magic '\\x93NUMPY', got '" +
                             Printable(std::string_view(pre, kMagicLen)) + "'");
  }
  const int major = static_cast<unsigned char>(pre[6]);
  const int minor = static_cast<unsigned char>(pre[7]);
  uint64_t header_len = 0;
  uint64_t preamble = 0;
  if (major == 1 && minor == 0) {
    if (!read(8, 2, pre + 8)) return Invalid(name, "truncated in the preamble");
    header_len = static_cast<unsigned char>(pre[8]) | (static_cast<unsigned char>(pre[9]) << 8);
    preamble = 10;
  } else if ((major == 2 || major == 3) && minor == 0) {
    // 2.0 only widens the length field; 3.0 allows a UTF-8 header, which this strict ASCII
    // parser refuses anyway if it uses anything beyond ASCII.
    if (total_size < 12 || !read(8, 4, pre + 8)) return Invalid(name, "truncated in the preamble");
    for (int i = 3; i >= 0; --i)
      header_len = (header_len << 8) | static_cast<unsigned char>(pre[8 + i]);
    preamble = 12;
  } else {
    return Invalid(name, "version: expected 1.0, 2.0 or 3.0, got " + std::to_string(major) + "." +
                             std::to_string(minor));
  }
  if (header_len > kNpyMaxHeaderBytes) {
    return Invalid(name, "header length: expected <= " + std::to_string(kNpyMaxHeaderBytes) +
                             " bytes, got " + std::to_string(header_len));
  }
  if (preamble + header_len > total_size) {
    return Invalid(name, "truncated: header needs " + std::to_string(preamble + header_len) +
                             " bytes, file has " + std::to_string(total_size));
  }
  std::string header(header_len, '\0');
  if (header_len > 0 && !read(preamble, header_len, header.data())) {
    return Invalid(name, "truncated in the header");
  }
  std::string descr;
  bool fortran = false;
  if (auto st = HeaderParser(header, name).Parse(&descr, &fortran, &layout->shape); !st.ok()) {
    return st;
  }
  uint64_t itemsize = 0;
  if (descr == "<f4") {
    layout->dtype = Dtype::kF4;
    itemsize = 4;
  } else if (descr == "<f8") {
    layout->dtype = Dtype::kF8;
    itemsize = 8;
  } else {
    return Invalid(name, "dtype: expected '<f4' (float32) or '<f8' (float64, converted), got '" +
                             Printable(descr) + "'");
  }
  if (fortran) {
    return Invalid(name,
                   "fortran_order: expected False (C order), got True; save with "
                   "numpy.ascontiguousarray first");
  }
  // Overflow check before anything is sized from the shape.
  uint64_t count = 1;
  for (int64_t d : layout->shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && count > std::numeric_limits<uint64_t>::max() / 8 / ud) {
      return Invalid(name, "shape " + ShapeString(layout->shape) + ": element count overflows");
    }
    count *= ud;
  }
  layout->count = count;
  layout->data_offset = preamble + header_len;
  layout->data_bytes = count * itemsize;
  const uint64_t expected = layout->data_offset + layout->data_bytes;
  if (total_size != expected) {
    return Invalid(name, "size: expected " + std::to_string(expected) + " bytes (header " +
                             std::to_string(layout->data_offset) + " + shape " +
                             ShapeString(layout->shape) + " x " + std::to_string(itemsize) +
                             "), got " + std::to_string(total_size) +
                             (total_size < expected ? " (truncated)" : " (trailing bytes)"));
  }
  if (count > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return Invalid(name, "shape " + ShapeString(layout->shape) + ": too large for this machine");
  }
  return grpc::Status::OK;
}

// Converts `n` little-endian elements of `src` to floats in `dst`.
void Decode(const char* src, uint64_t n, Dtype dtype, float* dst) {
  if (dtype == Dtype::kF4) {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(dst, src, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t u = 0;
        for (int b = 0; b < 4; ++b)
          u |= uint32_t{static_cast<unsigned char>(src[i * 4 + b])} << (8 * b);
        dst[i] = std::bit_cast<float>(u);
      }
    }
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t u = 0;
      for (int b = 0; b < 8; ++b)
        u |= uint64_t{static_cast<unsigned char>(src[i * 8 + b])} << (8 * b);
      dst[i] = static_cast<float>(std::bit_cast<double>(u));
    }
  }
}

grpc::Status Allocate(std::string_view name, const Layout& layout, NpyArray* out) {
  try {
    out->shape = layout.shape;
    out->data.resize(static_cast<size_t>(layout.count));
  } catch (const std::exception&) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        std::string(name) + ": cannot allocate " + std::to_string(layout.count) +
                            " floats for shape " + ShapeString(layout.shape));
  }
  return grpc::Status::OK;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

grpc::Status IoError(const std::string& path, const char* what, int err) {
  const auto code = err == ENOENT   ? grpc::StatusCode::NOT_FOUND
                    : err == EACCES ? grpc::StatusCode::PERMISSION_DENIED
                                    : grpc::StatusCode::UNKNOWN;
  return grpc::Status(code, path + ": " + what + ": " + std::strerror(err));
}

}  // namespace

grpc::Status ParseNpy(std::string_view bytes, std::string_view name, NpyArray* out) {
  try {
    ReadAt read = [bytes](uint64_t off, size_t n, char* dst) {
      if (off > bytes.size() || n > bytes.size() - off) return false;
      std::memcpy(dst, bytes.data() + off, n);
      return true;
    };
    Layout layout;
    if (auto st = ParseLayout(read, bytes.size(), name, &layout); !st.ok()) return st;
    if (auto st = Allocate(name, layout, out); !st.ok()) return st;
    if (layout.count > 0) {
      Decode(bytes.data() + layout.data_offset, layout.count, layout.dtype, out->data.data());
    }
    return grpc::Status::OK;
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(name) + ": " + e.what());
  }
}

grpc::Status ReadNpy(const std::string& path, NpyArray* out) {
  try {
    std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) return IoError(path, "cannot open", errno);
    if (std::fseek(f.get(), 0, SEEK_END) != 0) return IoError(path, "cannot seek", errno);
    const long end = std::ftell(f.get());
    if (end < 0) return IoError(path, "cannot tell size (not a regular file?)", errno);
    const auto size = static_cast<uint64_t>(end);
    ReadAt read = [&f](uint64_t off, size_t n, char* dst) {
      if (off > static_cast<uint64_t>(std::numeric_limits<long>::max())) return false;
      if (std::fseek(f.get(), static_cast<long>(off), SEEK_SET) != 0) return false;
      return std::fread(dst, 1, n, f.get()) == n;
    };
    Layout layout;
    if (auto st = ParseLayout(read, size, path, &layout); !st.ok()) return st;
    if (auto st = Allocate(path, layout, out); !st.ok()) return st;
    if (std::fseek(f.get(), static_cast<long>(layout.data_offset), SEEK_SET) != 0) {
      return IoError(path, "cannot seek", errno);
    }
    if (layout.dtype == Dtype::kF4 && std::endian::native == std::endian::little) {
      // Straight into the result: no second copy of a large array.
      if (std::fread(out->data.data(), 4, layout.count, f.get()) != layout.count) {
        return Invalid(path, "truncated while reading the data");
      }
    } else {
      const uint64_t item = layout.dtype == Dtype::kF4 ? 4 : 8;
      constexpr uint64_t kChunk = 1 << 16;
      std::vector<char> buf(kChunk * item);
      for (uint64_t done = 0; done < layout.count;) {
        const uint64_t n = std::min(kChunk, layout.count - done);
        if (std::fread(buf.data(), item, n, f.get()) != n) {
          return Invalid(path, "truncated while reading the data");
        }
        Decode(buf.data(), n, layout.dtype, out->data.data() + done);
        done += n;
      }
    }
    return grpc::Status::OK;
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, path + ": " + e.what());
  }
}

grpc::Status SerializeNpy(const NpyArray& array, std::string* bytes) {
  try {
    uint64_t count = 1;
    for (int64_t d : array.shape) {
      if (d < 0) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "npy: shape " + ShapeString(array.shape) + ": negative dimension");
      }
      const auto ud = static_cast<uint64_t>(d);
      if (ud != 0 && count > std::numeric_limits<uint64_t>::max() / 4 / ud) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "npy: shape " + ShapeString(array.shape) + ": overflows");
      }
      count *= ud;
    }
    if (count != array.data.size()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "npy: data: expected " + std::to_string(count) + " values for shape " +
                              ShapeString(array.shape) + ", got " +
                              std::to_string(array.data.size()));
    }
    std::string header =
        "{'descr': '<f4', 'fortran_order': False, 'shape': " + ShapeString(array.shape) + ", }";
    // Pad with spaces and a final newline so the data start is 64-byte aligned, as numpy does.
    const size_t unpadded = 10 + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    if (header.size() > 0xffff) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "npy: header too long for v1.0");
    }
    bytes->clear();
    bytes->reserve(10 + header.size() + count * 4);
    bytes->append(kMagic, kMagicLen);
    bytes->push_back('\x01');
    bytes->push_back('\x00');
    bytes->push_back(static_cast<char>(header.size() & 0xff));
    bytes->push_back(static_cast<char>(header.size() >> 8));
    *bytes += header;
    const size_t at = bytes->size();
    bytes->resize(at + count * 4);
    for (uint64_t i = 0; i < count; ++i) {
      const uint32_t u = std::bit_cast<uint32_t>(array.data[i]);
      for (int b = 0; b < 4; ++b)
        (*bytes)[at + i * 4 + b] = static_cast<char>((u >> (8 * b)) & 0xff);
    }
    return grpc::Status::OK;
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string("npy: ") + e.what());
  }
}

grpc::Status WriteNpy(const std::string& path, const NpyArray& array) {
  std::string bytes;
  if (auto st = SerializeNpy(array, &bytes); !st.ok()) {
    return grpc::Status(st.error_code(), path + ": " + st.error_message());
  }
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "wb"));
  if (!f) return IoError(path, "cannot create", errno);
  if (std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    return IoError(path, "cannot write", errno);
  }
  if (std::fclose(f.release()) != 0) return IoError(path, "cannot close", errno);
  return grpc::Status::OK;
}

}  // namespace attnserve
