#include "format/npy.h"

#include <bit>
#include <cstring>
#include <limits>

namespace attnserve::npy {
namespace {

// A strict parser of the header dict numpy writes:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Python literal syntax, restricted to exactly what these three keys can hold.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string_view name, std::string* error)
      : s_(text), name_(name), error_(error) {}

  bool Parse(std::string* descr, bool* fortran, std::vector<int64_t>* shape) {
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
      if (!ParseString(&key)) return false;
      SkipSpace();
      if (!Eat(':')) return Error("header: expected ':' after '" + key + "', got " + Here());
      SkipSpace();
      if (key == "descr") {
        if (have_descr) return Error("header: key 'descr' appears twice");
        have_descr = true;
        if (!ParseString(descr)) return false;
      } else if (key == "fortran_order") {
        if (have_fortran) return Error("header: key 'fortran_order' appears twice");
        have_fortran = true;
        if (!ParseBool(fortran)) return false;
      } else if (key == "shape") {
        if (have_shape) return Error("header: key 'shape' appears twice");
        have_shape = true;
        if (!ParseShape(shape)) return false;
      } else {
        return Error("header: expected keys 'descr', 'fortran_order', 'shape', got '" + Printable(key) + "'");
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
    return true;
  }

 private:
  bool Error(const std::string& msg) const {
    *error_ = std::string(name_) + ": " + msg;
    return false;
  }

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

  bool ParseString(std::string* out) {
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
    return true;
  }

  bool ParseBool(bool* out) {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      *out = true;
    } else if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      *out = false;
    } else {
      return Error("header: 'fortran_order': expected True or False, got " + Here());
    }
    return true;
  }

  bool ParseShape(std::vector<int64_t>* shape) {
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
      if (static_cast<int>(shape->size()) >= kMaxRank) {
        return Error("header: 'shape': expected rank <= " + std::to_string(kMaxRank) + ", got more");
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
      return Error("header: 'shape': expected a tuple like (5,), got (" + std::to_string((*shape)[0]) + ")");
    }
    return true;
  }

  std::string_view s_;
  std::string_view name_;
  std::string* error_;
  size_t pos_ = 0;
};

}  // namespace

std::string Printable(std::string_view s, size_t max) {
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

bool ParseLayout(const ReadAt& read, uint64_t total_size, std::string_view name, Layout* layout, std::string* error) {
  const auto invalid = [&](const std::string& msg) {
    *error = std::string(name) + ": " + msg;
    return false;
  };
  char pre[12];
  if (total_size < 10 || !read(0, 8, pre)) {
    return invalid("truncated: expected at least 10 bytes of preamble, got " + std::to_string(total_size));
  }
  if (std::memcmp(pre, kMagic.data(), kMagic.size()) != 0) {
    return invalid("not a .npy file: expected magic '\\x93NUMPY', got '" +
                   Printable(std::string_view(pre, kMagic.size())) + "'");
  }
  const int major = static_cast<unsigned char>(pre[6]);
  const int minor = static_cast<unsigned char>(pre[7]);
  uint64_t header_len = 0;
  uint64_t preamble = 0;
  if (major == 1 && minor == 0) {
    if (!read(8, 2, pre + 8)) return invalid("truncated in the preamble");
    header_len = static_cast<unsigned char>(pre[8]) | (static_cast<unsigned char>(pre[9]) << 8);
    preamble = 10;
  } else if ((major == 2 || major == 3) && minor == 0) {
    // 2.0 only widens the length field; 3.0 allows a UTF-8 header, which this strict ASCII
    // parser refuses anyway if it uses anything beyond ASCII.
    if (total_size < 12 || !read(8, 4, pre + 8)) return invalid("truncated in the preamble");
    for (int i = 3; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(pre[8 + i]);
    preamble = 12;
  } else {
    return invalid("version: expected 1.0, 2.0 or 3.0, got " + std::to_string(major) + "." + std::to_string(minor));
  }
  if (header_len > kMaxHeaderBytes) {
    return invalid("header length: expected <= " + std::to_string(kMaxHeaderBytes) + " bytes, got " +
                   std::to_string(header_len));
  }
  if (preamble + header_len > total_size) {
    return invalid("truncated: header needs " + std::to_string(preamble + header_len) + " bytes, file has " +
                   std::to_string(total_size));
  }
  std::string header(header_len, '\0');
  if (header_len > 0 && !read(preamble, header_len, header.data())) {
    return invalid("truncated in the header");
  }
  std::string descr;
  bool fortran = false;
  if (!HeaderParser(header, name, error).Parse(&descr, &fortran, &layout->shape)) return false;
  uint64_t itemsize = 0;
  if (descr == "<f4") {
    layout->dtype = Dtype::kFloat32;
    itemsize = 4;
  } else if (descr == "<f8") {
    layout->dtype = Dtype::kFloat64;
    itemsize = 8;
  } else {
    return invalid("dtype: expected '<f4' (float32) or '<f8' (float64, converted), got '" + Printable(descr) + "'");
  }
  if (fortran) {
    return invalid(
        "fortran_order: expected False (C order), got True; save with "
        "numpy.ascontiguousarray first");
  }
  // Overflow check before anything is sized from the shape.
  uint64_t count = 1;
  for (int64_t d : layout->shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && count > std::numeric_limits<uint64_t>::max() / 8 / ud) {
      return invalid("shape " + ShapeString(layout->shape) + ": element count overflows");
    }
    count *= ud;
  }
  layout->count = count;
  layout->data_offset = preamble + header_len;
  layout->data_bytes = count * itemsize;
  const uint64_t expected = layout->data_offset + layout->data_bytes;
  if (total_size != expected) {
    return invalid("size: expected " + std::to_string(expected) + " bytes (header " +
                   std::to_string(layout->data_offset) + " + shape " + ShapeString(layout->shape) + " x " +
                   std::to_string(itemsize) + "), got " + std::to_string(total_size) +
                   (total_size < expected ? " (truncated)" : " (trailing bytes)"));
  }
  if (count > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return invalid("shape " + ShapeString(layout->shape) + ": too large for this machine");
  }
  return true;
}

bool ParseLayout(std::string_view bytes, std::string_view name, Layout* layout, std::string* error) {
  const ReadAt read = [bytes](uint64_t off, size_t n, char* dst) {
    if (off > bytes.size() || n > bytes.size() - off) return false;
    std::memcpy(dst, bytes.data() + off, n);
    return true;
  };
  return ParseLayout(read, bytes.size(), name, layout, error);
}

void Decode(const char* src, uint64_t n, Dtype dtype, float* dst) {
  if (dtype == Dtype::kFloat32) {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(dst, src, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t u = 0;
        for (int b = 0; b < 4; ++b) u |= uint32_t{static_cast<unsigned char>(src[i * 4 + b])} << (8 * b);
        dst[i] = std::bit_cast<float>(u);
      }
    }
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t u = 0;
      for (int b = 0; b < 8; ++b) u |= uint64_t{static_cast<unsigned char>(src[i * 8 + b])} << (8 * b);
      dst[i] = static_cast<float>(std::bit_cast<double>(u));
    }
  }
}

}  // namespace attnserve::npy
