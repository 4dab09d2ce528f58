#include "server/store/safetensors.h"

#include "server/store/checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <utility>

namespace attnserve {

struct SafetensorsFile::Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

using Json = nlohmann::json;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// A header nests at most three deep (object > tensor > shape); a little slack for fields we
// ignore, and a hard stop before a hostile file can make the parser build a deep tree.
constexpr int kMaxJsonDepth = 8;

struct DtypeEntry {
  Dtype dtype;
  std::string_view name;
  int64_t size;
  bool is_float;
};

constexpr DtypeEntry kDtypes[] = {
    {Dtype::kF64, "F64", 8, true},         {Dtype::kF32, "F32", 4, true},
    {Dtype::kF16, "F16", 2, true},         {Dtype::kBF16, "BF16", 2, true},
    {Dtype::kI64, "I64", 8, false},        {Dtype::kI32, "I32", 4, false},
    {Dtype::kI16, "I16", 2, false},        {Dtype::kI8, "I8", 1, false},
    {Dtype::kU64, "U64", 8, false},        {Dtype::kU32, "U32", 4, false},
    {Dtype::kU16, "U16", 2, false},        {Dtype::kU8, "U8", 1, false},
    {Dtype::kBool, "BOOL", 1, false},      {Dtype::kF8E4M3, "F8_E4M3", 1, false},
    {Dtype::kF8E5M2, "F8_E5M2", 1, false},
};

const DtypeEntry& EntryOf(Dtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  return kDtypes[1];  // unreachable: every enumerator is in the table
}

const DtypeEntry* ParseDtype(std::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string KnownDtypes() {
  std::string s;
  for (const DtypeEntry& e : kDtypes) {
    if (!s.empty()) s += ", ";
    s += e.name;
  }
  return s;
}

std::string FilePrefix(const std::string& path) { return "safetensors file '" + path + "': "; }
std::string TensorPrefix(const std::string& path, std::string_view tensor) {
  return "safetensors file '" + path + "', tensor '" + std::string(tensor) + "': ";
}

// A JSON value as an error message shows it: short, and never throwing.
std::string Show(const Json& j) {
  try {
    std::string s = j.dump(-1, ' ', true, Json::error_handler_t::replace);
    if (s.size() > 60) s = s.substr(0, 57) + "...";
    return s;
  } catch (...) {
    return "(unprintable)";
  }
}

// Reads exactly `count` bytes at `offset`; false on error or end of file.
bool PreadAll(int fd, void* buffer, size_t count, int64_t offset) {
  auto* p = static_cast<unsigned char*>(buffer);
  while (count > 0) {
    const ssize_t got = ::pread(fd, p, count, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    count -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

uint64_t LoadLE(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The deepest nesting of objects and arrays in `text`, stopping once it passes `limit`.
int JsonDepth(std::string_view text, int limit) {
  bool in_string = false, escaped = false;
  int depth = 0, deepest = 0;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

// A JSON integer in [0, max]; otherwise an error message for `what`.
bool GetCount(const Json& j, int64_t max, int64_t* out, std::string* error, const std::string& what) {
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(max)) {
      *error = what + " must be at most " + std::to_string(max) + ", got " + Show(j);
      return false;
    }
    *out = static_cast<int64_t>(v);
    return true;
  }
  if (j.is_number_integer()) {  // signed and not unsigned: negative
    *error = what + " must be non-negative, got " + Show(j);
    return false;
  }
  *error = what + " must be a non-negative integer, got " + Show(j);
  return false;
}

// Checks one tensor entry of the header and fills `info` (all but the overlap check, which
// needs every entry).
Status ParseTensorEntry(const std::string& path, const std::string& name, const Json& entry,
                        int64_t data_bytes, TensorInfo* info) {
  const std::string at = TensorPrefix(path, name);
  if (!entry.is_object()) {
    return InvalidArgumentError(at + "expected an object with dtype, shape and data_offsets, got " + Show(entry));
  }
  info->name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return InvalidArgumentError(at + "expected a string field 'dtype', got " +
                                (dtype_it == entry.end() ? std::string("none") : Show(*dtype_it)));
  }
  const DtypeEntry* dtype = ParseDtype(dtype_it->get_ref<const std::string&>());
  if (dtype == nullptr) {
    return InvalidArgumentError(at + "unknown dtype " + Show(*dtype_it) + " (expected one of " + KnownDtypes() + ")");
  }
  info->dtype = dtype->dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return InvalidArgumentError(at + "expected an array field 'shape', got " +
                                (shape_it == entry.end() ? std::string("none") : Show(*shape_it)));
  }
  if (shape_it->size() > static_cast<size_t>(kMaxSafetensorsRank)) {
    return InvalidArgumentError(at + "shape has " + std::to_string(shape_it->size()) + " dimensions, at most " +
                                std::to_string(kMaxSafetensorsRank) + " supported");
  }
  // The element count is checked against int64 before it is multiplied, so that a lying
  // shape can neither overflow nor size an allocation.
  int64_t elements = 1;
  std::string error;
  for (size_t k = 0; k < shape_it->size(); ++k) {
    int64_t dim = 0;
    if (!GetCount((*shape_it)[k], kInt64Max, &dim, &error, "shape[" + std::to_string(k) + "]")) {
      return InvalidArgumentError(at + error);
    }
    info->shape.push_back(dim);
  }
  for (const int64_t dim : info->shape) {
    if (dim != 0 && elements > kInt64Max / dim) {
      return InvalidArgumentError(at + "shape " + ShapeString(info->shape) + " has more elements than fit in int64");
    }
    elements *= dim;
  }
  if (elements > kInt64Max / dtype->size) {
    return InvalidArgumentError(at + "shape " + ShapeString(info->shape) + " of " + std::string(dtype->name) +
                                " takes more bytes than fit in int64");
  }
  info->elements = elements;
  const int64_t bytes = elements * dtype->size;

  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return InvalidArgumentError(at + "expected 'data_offsets' as [begin, end], got " +
                                (offsets_it == entry.end() ? std::string("none") : Show(*offsets_it)));
  }
  if (!GetCount((*offsets_it)[0], kInt64Max, &info->begin, &error, "data_offsets[0]") ||
      !GetCount((*offsets_it)[1], kInt64Max, &info->end, &error, "data_offsets[1]")) {
    return InvalidArgumentError(at + error);
  }
  if (info->begin > info->end) {
    return InvalidArgumentError(at + "data_offsets [" + std::to_string(info->begin) + ", " +
                                std::to_string(info->end) + "] end before they begin");
  }
  if (info->end > data_bytes) {
    return InvalidArgumentError(at + "data_offsets [" + std::to_string(info->begin) + ", " +
                                std::to_string(info->end) + "] reach past the data region, which holds " +
                                std::to_string(data_bytes) + " bytes");
  }
  if (info->end - info->begin != bytes) {
    return InvalidArgumentError(at + "shape " + ShapeString(info->shape) + " of " + std::string(dtype->name) +
                                " needs " + std::to_string(bytes) + " bytes, but data_offsets [" +
                                std::to_string(info->begin) + ", " + std::to_string(info->end) + "] span " +
                                std::to_string(info->end - info->begin));
  }
  return OkStatus();
}

Status ParseHeader(const std::string& path, const std::string& text, int64_t data_bytes,
                   std::map<std::string, std::string>* metadata, std::vector<TensorInfo>* tensors) {
  const std::string at = FilePrefix(path);
  if (JsonDepth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return InvalidArgumentError(at + "header JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::parse_error& e) {
    // The parser's own message quotes the bytes it stopped at: say where, never what.
    return InvalidArgumentError(at + "header is not valid JSON (at byte " + std::to_string(e.byte) + " of it)");
  } catch (const Json::exception&) {
    return InvalidArgumentError(at + "header is not valid JSON");
  }
  if (!header.is_object()) {
    return InvalidArgumentError(at + "header must be a JSON object, got " + Show(header));
  }
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return InvalidArgumentError(at + "__metadata__ must be an object of strings, got " + Show(entry));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return InvalidArgumentError(at + "__metadata__ value of '" + key + "' must be a string, got " + Show(value));
        }
        (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    TensorInfo info;
    ATTNSERVE_RETURN_IF_ERROR(ParseTensorEntry(path, name, entry, data_bytes, &info));
    tensors->push_back(std::move(info));
  }
  // Names come from a JSON object, so they are unique and already ordered; byte ranges must
  // not share a byte (tensors with no bytes occupy none).
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : *tensors) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo& prev = *by_offset[k - 1];
    const TensorInfo& cur = *by_offset[k];
    if (cur.begin < prev.end) {
      return InvalidArgumentError(TensorPrefix(path, cur.name) + "data_offsets [" + std::to_string(cur.begin) + ", " +
                                  std::to_string(cur.end) + "] overlap tensor '" + prev.name + "' at [" +
                                  std::to_string(prev.begin) + ", " + std::to_string(prev.end) + "]");
    }
  }
  return OkStatus();
}

Status OpenError(const std::string& path, int err) {
  const std::string message = FilePrefix(path) + "cannot open: " + std::strerror(err);
  if (err == ENOENT || err == ENOTDIR) return NotFoundError(message);
  if (err == EACCES || err == EPERM) return Status(StatusCode::kPermissionDenied, message);
  return InvalidArgumentError(message);
}

void ConvertToFloat(Dtype dtype, const unsigned char* raw, int64_t count, float* out) {
  switch (dtype) {
    case Dtype::kF32:
      for (int64_t i = 0; i < count; ++i) {
        const auto bits = static_cast<uint32_t>(LoadLE(raw + 4 * i, 4));
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    case Dtype::kF16:
      for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(static_cast<uint16_t>(LoadLE(raw + 2 * i, 2)));
      break;
    case Dtype::kBF16:
      for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(static_cast<uint16_t>(LoadLE(raw + 2 * i, 2)));
      break;
    case Dtype::kF64:
      for (int64_t i = 0; i < count; ++i) {
        const uint64_t bits = LoadLE(raw + 8 * i, 8);
        double d;
        std::memcpy(&d, &bits, 8);
        // Out-of-range doubles become infinities explicitly (a plain cast would be undefined);
        // ValidateWeights then refuses them by name.
        constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
        constexpr float kInf = std::numeric_limits<float>::infinity();
        if (std::isnan(d)) {
          out[i] = std::signbit(d) ? -kNan : kNan;
        } else if (std::fabs(d) > static_cast<double>(std::numeric_limits<float>::max())) {
          out[i] = d < 0 ? -kInf : kInf;
        } else {
          out[i] = static_cast<float>(d);
        }
      }
      break;
    default:
      break;  // callers convert floating dtypes only
  }
}

}  // namespace

std::string_view DtypeName(Dtype dtype) { return EntryOf(dtype).name; }
int64_t DtypeSize(Dtype dtype) { return EntryOf(dtype).size; }
bool IsFloatDtype(Dtype dtype) { return EntryOf(dtype).is_float; }

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: mantissa · 2^-24 is exact in float32 (a normal number there).
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf (mantissa 0) or NaN (payload kept)
  } else {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float BFloat16ToFloat(uint16_t b) {
  // bfloat16 is the top half of a float32, so widening is a shift for every class of value.
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t k = 0; k < shape.size(); ++k) {
    if (k) s += ", ";
    s += std::to_string(shape[k]);
  }
  return s + "]";
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

StatusOr<const TensorInfo*> SafetensorsFile::FindFloat(std::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) return NotFoundError(TensorPrefix(path_, name) + "no such tensor in the file");
  if (!IsFloatDtype(info->dtype)) {
    return InvalidArgumentError(TensorPrefix(path_, name) + "dtype " + std::string(DtypeName(info->dtype)) +
                                " is not a floating type (expected F32, F16, BF16 or F64)");
  }
  return info;
}

StatusOr<FloatTensor> SafetensorsFile::ReadFloat(std::string_view name) const {
  ATTNSERVE_ASSIGN_OR_RETURN(const TensorInfo* info, FindFloat(name));
  try {
    FloatTensor out;
    out.shape = info->shape;
    std::vector<unsigned char> raw(static_cast<size_t>(info->end - info->begin));
    if (!raw.empty() && !PreadAll(fd_->fd, raw.data(), raw.size(), data_start_ + info->begin)) {
      return Status(StatusCode::kDataLoss, TensorPrefix(path_, name) + "cannot read bytes [" +
                                               std::to_string(info->begin) + ", " + std::to_string(info->end) +
                                               ") of the data region: the file changed or is unreadable");
    }
    out.values.resize(static_cast<size_t>(info->elements));
    ConvertToFloat(info->dtype, raw.data(), info->elements, out.values.data());
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(TensorPrefix(path_, name) + "out of memory reading " +
                                  std::to_string(info->end - info->begin) + " bytes");
  }
}

StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, const std::string& beneath) {
  const std::string at = FilePrefix(path);
  ATTNSERVE_ASSIGN_OR_RETURN(FileDescriptor opened, OpenCheckpointFile(beneath, path));
  auto fd = std::make_shared<const SafetensorsFile::Fd>(opened.release());
  struct stat st {};
  if (::fstat(fd->fd, &st) != 0) return OpenError(path, errno);
  const int64_t file_size = st.st_size;

  unsigned char length_bytes[8];
  if (file_size < 8 || !PreadAll(fd->fd, length_bytes, 8, 0)) {
    return InvalidArgumentError(at + "truncated: " + std::to_string(file_size) +
                                " bytes, expected at least the 8-byte header length");
  }
  const uint64_t header_length = LoadLE(length_bytes, 8);
  if (header_length > kMaxSafetensorsHeaderBytes) {
    // The length's value is file content: never echoed (a non-checkpoint's first bytes).
    return InvalidArgumentError(at + "not a safetensors file: its header length field exceeds the limit of " +
                                std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (header_length > static_cast<uint64_t>(file_size - 8)) {
    return InvalidArgumentError(at + "not a safetensors file, or truncated: its header length field exceeds the " +
                                std::to_string(file_size - 8) + " bytes after it");
  }
  if (header_length < 2) {
    return InvalidArgumentError(at + "not a safetensors file: its header length field is too short for a JSON object");
  }

  SafetensorsFile file;
  try {
    std::string text(static_cast<size_t>(header_length), '\0');
    if (!PreadAll(fd->fd, text.data(), text.size(), 8)) {
      return InvalidArgumentError(at + "truncated: cannot read the " + std::to_string(header_length) +
                                  "-byte header");
    }
    const int64_t data_start = 8 + static_cast<int64_t>(header_length);
    ATTNSERVE_RETURN_IF_ERROR(ParseHeader(path, text, file_size - data_start, &file.metadata_, &file.tensors_));
    file.data_start_ = data_start;
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(at + "out of memory reading the header");
  } catch (const std::exception& e) {
    // Nothing above should throw but allocation; the JSON library is caught here as a last
    // resort so that no exception leaves the reader.
    return InvalidArgumentError(at + "cannot read the header: " + e.what());
  }
  file.path_ = path;
  file.fd_ = std::move(fd);
  return file;
}

}  // namespace attnserve
