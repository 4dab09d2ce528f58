#include "client/npy.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>

#include "format/npy.h"

namespace attnserve {
namespace {

using npy::Decode;
using npy::Dtype;
using npy::Layout;
using npy::ShapeString;

grpc::Status Invalid(std::string_view name, const std::string& msg) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name) + ": " + msg);
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
    Layout layout;
    std::string error;
    if (!npy::ParseLayout(bytes, name, &layout, &error)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, error);
    }
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
    const npy::ReadAt read = [&f](uint64_t off, size_t n, char* dst) {
      if (off > static_cast<uint64_t>(std::numeric_limits<long>::max())) return false;
      if (std::fseek(f.get(), static_cast<long>(off), SEEK_SET) != 0) return false;
      return std::fread(dst, 1, n, f.get()) == n;
    };
    Layout layout;
    std::string error;
    if (!npy::ParseLayout(read, size, path, &layout, &error)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, error);
    }
    if (auto st = Allocate(path, layout, out); !st.ok()) return st;
    if (std::fseek(f.get(), static_cast<long>(layout.data_offset), SEEK_SET) != 0) {
      return IoError(path, "cannot seek", errno);
    }
    if (layout.dtype == Dtype::kFloat32 && std::endian::native == std::endian::little) {
      // Straight into the result: no second copy of a large array.
      if (std::fread(out->data.data(), 4, layout.count, f.get()) != layout.count) {
        return Invalid(path, "truncated while reading the data");
      }
    } else {
      const uint64_t item = layout.dtype == Dtype::kFloat32 ? 4 : 8;
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
    bytes->append(npy::kMagic);
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
