#include "server/store/calibration_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <vector>

#include "server/store/checkpoint_file.h"

namespace attnserve {
namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr size_t kMaxHeader = 64 * 1024;

std::string Printable(std::string_view s, size_t max = 24) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return s.size() > max ? out + "..." : out;
}

// The header dict without its spaces: {'descr':'<f4','fortran_order':False,'shape':(R,D),}
// in any key order, each key once. Returns the three values as written.
Status ParseHeader(std::string_view text, const std::string& name, std::string* descr, std::string* fortran,
                   std::string* shape) {
  std::string s;
  for (char c : text) {
    if (c != ' ' && c != '\n' && c != '\t') s += c;
  }
  if (s.size() < 2 || s.front() != '{' || s.back() != '}') {
    return InvalidArgumentError(name + ": expected a header dict {...}, got '" + Printable(s) + "'");
  }
  s = s.substr(1, s.size() - 2);
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t colon = s.find(':', pos);
    if (colon == std::string::npos)
      return InvalidArgumentError(name + ": header: expected 'key': value, got '" + Printable(s.substr(pos)) + "'");
    const std::string key = s.substr(pos, colon - pos);
    size_t end = colon + 1;
    if (end < s.size() && s[end] == '(') {
      end = s.find(')', end);
      if (end == std::string::npos) return InvalidArgumentError(name + ": header: the shape's ')' is missing");
      ++end;
    } else {
      end = s.find(',', end);
      if (end == std::string::npos) end = s.size();
    }
    const std::string value = s.substr(colon + 1, end - colon - 1);
    std::string* slot = key == "'descr'"           ? descr
                        : key == "'fortran_order'" ? fortran
                        : key == "'shape'"         ? shape
                                                   : nullptr;
    if (slot == nullptr)
      return InvalidArgumentError(name + ": header: expected keys 'descr', 'fortran_order', 'shape', got " +
                                  Printable(key));
    if (!slot->empty()) return InvalidArgumentError(name + ": header: key " + key + " appears twice");
    *slot = value;
    pos = end;
    if (pos < s.size() && s[pos] == ',') ++pos;
  }
  if (descr->empty() || fortran->empty() || shape->empty()) {
    return InvalidArgumentError(name + ": header: expected keys 'descr', 'fortran_order' and 'shape'");
  }
  return OkStatus();
}

// "(R,D)" or "(R,D,)" into its two dimensions.
Status ParseShape(const std::string& shape, const std::string& name, int64_t* rows, int64_t* cols) {
  std::vector<int64_t> dims;
  std::string_view inner(shape);
  inner = inner.substr(1, inner.size() - 2);
  size_t pos = 0;
  while (pos < inner.size()) {
    size_t comma = inner.find(',', pos);
    if (comma == std::string_view::npos) comma = inner.size();
    int64_t v = -1;
    const auto [end, ec] = std::from_chars(inner.data() + pos, inner.data() + comma, v);
    if (ec != std::errc() || end != inner.data() + comma || v < 0) {
      return InvalidArgumentError(name + ": shape: expected whole numbers, got " + Printable(shape));
    }
    dims.push_back(v);
    pos = comma + 1;
  }
  if (dims.size() != 2) {
    return InvalidArgumentError(name + ": expected shape [rows, d_model] (2 dimensions), got " + Printable(shape));
  }
  *rows = dims[0];
  *cols = dims[1];
  return OkStatus();
}

}  // namespace

StatusOr<CalibrationSet> ParseCalibrationNpy(std::string_view bytes, const std::string& name) {
  if (bytes.size() < 10 || bytes.substr(0, kMagic.size()) != kMagic) {
    return InvalidArgumentError(name + ": expected a .npy file (magic \\x93NUMPY), got '" +
                                Printable(bytes.substr(0, 6)) + "'");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, header_at = 0;
  if (major == 1) {
    header_len =
        static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    header_at = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return InvalidArgumentError(name + ": the header length is cut off");
    for (int b = 3; b >= 0; --b) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[8 + b]);
    header_at = 12;
  } else {
    return InvalidArgumentError(name + ": expected .npy version 1, 2 or 3, got " + std::to_string(major));
  }
  if (header_len > kMaxHeader || header_at + header_len > bytes.size()) {
    return InvalidArgumentError(name + ": expected a header of at most " + std::to_string(kMaxHeader) +
                                " bytes within the file, got " + std::to_string(header_len));
  }
  std::string descr, fortran, shape;
  ATTNSERVE_RETURN_IF_ERROR(ParseHeader(bytes.substr(header_at, header_len), name, &descr, &fortran, &shape));
  if (descr != "'<f4'") return InvalidArgumentError(name + ": expected dtype '<f4' (float32), got " + Printable(descr));
  if (fortran != "False")
    return InvalidArgumentError(name + ": expected fortran_order False (C order), got " + Printable(fortran));
  CalibrationSet set;
  ATTNSERVE_RETURN_IF_ERROR(ParseShape(shape, name, &set.rows, &set.d_model));
  if (set.rows > kMaxCalibrationRows || set.d_model > kMaxDModel) {
    return InvalidArgumentError(name + ": expected at most " + std::to_string(kMaxCalibrationRows) +
                                " rows of at most " + std::to_string(kMaxDModel) + " values, got shape " +
                                Printable(shape));
  }
  const size_t data_bytes = static_cast<size_t>(set.rows * set.d_model) * sizeof(float);
  const size_t data_at = header_at + header_len;
  if (bytes.size() - data_at != data_bytes) {
    return InvalidArgumentError(name + ": expected " + std::to_string(data_bytes) + " bytes of data for shape " +
                                Printable(shape) + ", got " + std::to_string(bytes.size() - data_at));
  }
  set.x.resize(set.rows * set.d_model);
  // An empty array ([0, D] or [R, 0]) has no data, and memcpy's null destination is undefined
  // even for 0 bytes. Its row count is refused later, against the layer (ValidateCalibration).
  if (data_bytes > 0) std::memcpy(set.x.data(), bytes.data() + data_at, data_bytes);  // little-endian, as the server
  return set;
}

StatusOr<CalibrationSet> ReadCalibrationNpy(const std::string& model_dir, const std::string& path) {
  const std::string name = "calibration file '" + path + "'";
  ATTNSERVE_ASSIGN_OR_RETURN(FileDescriptor fd, OpenCheckpointFile(model_dir, path));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return InternalError(name + ": fstat: " + std::strerror(errno));
  const size_t limit = kMaxHeader + 16 + static_cast<size_t>(kMaxCalibrationRows) * 8192 * sizeof(float);
  if (static_cast<size_t>(st.st_size) > limit) {
    return InvalidArgumentError(name + ": expected at most " + std::to_string(limit) + " bytes, got " +
                                std::to_string(st.st_size));
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = pread(fd.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return InternalError(name + ": read: " + (got < 0 ? std::strerror(errno) : "unexpected end of file"));
    done += static_cast<size_t>(got);
  }
  return ParseCalibrationNpy(bytes, name);
}

}  // namespace attnserve
