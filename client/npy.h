// NumPy .npy files of float32 arrays, C order, any rank: the CLI's input and output format.
//
// The reader trusts nothing in the file: magic, version, header length, a strict parse of the
// header dict, the element-count overflow and the file size are all checked before any data is
// allocated (format/npy.h, the reader the server's calibration files use too: a header of at
// most 64 KiB, rank at most 32). '<f4' is read as is; '<f8' is converted to float32 (values outside float range
// become +-inf). Files are written as version 1.0, '<f4'.
// Thread-safety: pure functions of their arguments; no shared state.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace attnserve {

struct NpyArray {
  std::vector<int64_t> shape;  // empty = a scalar (one element)
  std::vector<float> data;     // row-major, product(shape) elements
};

// Reads `path`. Errors name the file and say expected/got: NOT_FOUND when the file does not
// exist, INVALID_ARGUMENT when its contents are not a supported .npy, other codes for I/O.
grpc::Status ReadNpy(const std::string& path, NpyArray* out);
// Parses a whole .npy image in memory; `name` is used in error messages.
grpc::Status ParseNpy(std::string_view bytes, std::string_view name, NpyArray* out);

// Writes `array` to `path` (replacing it). INVALID_ARGUMENT when data.size() != product(shape).
grpc::Status WriteNpy(const std::string& path, const NpyArray& array);
// The .npy image of `array` (version 1.0, '<f4'); INVALID_ARGUMENT as WriteNpy.
grpc::Status SerializeNpy(const NpyArray& array, std::string* bytes);

}  // namespace attnserve
