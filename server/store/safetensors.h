// A reader for the safetensors checkpoint format (https://github.com/huggingface/safetensors)
// that trusts nothing in the file: every length, dtype, shape and offset is checked before it
// is used, and every failure is a Status naming the file (and the tensor) with what was
// expected and what came. Tensor bytes are read on demand, so opening a large checkpoint to
// take one layer reads only that layer's tensors.
// Thread-safety: a SafetensorsFile is immutable; ReadFloat may run on many threads (pread).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/status.h"

namespace attnserve {

// Every dtype the format defines: a file holding any of them opens (real checkpoints keep
// integer buffers such as BERT's position_ids next to the weights), but only the floating
// ones convert to float32.
enum class Dtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool, kF8E4M3, kF8E5M2 };

std::string_view DtypeName(Dtype dtype);  // "F32", "BF16", ... as the header spells it
int64_t DtypeSize(Dtype dtype);           // bytes per element
bool IsFloatDtype(Dtype dtype);           // F64, F32, F16, BF16: what ReadFloat converts

// IEEE 754 binary16 and bfloat16 bit patterns to float32; exact for every input (subnormals,
// signed zeros, infinities; NaNs stay NaN with their sign and payload's top bits).
float HalfToFloat(uint16_t bits);
float BFloat16ToFloat(uint16_t bits);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;  // empty: a scalar
  int64_t elements = 0;        // product of shape (1 for a scalar)
  int64_t begin = 0, end = 0;  // byte range in the data region (after the header)
};

struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major
};

// "[3, 4]": how errors and logs show a shape.
std::string ShapeString(const std::vector<int64_t>& shape);

// Bounds on what a header may claim (far beyond any real checkpoint, small enough that a
// lying file cannot make us allocate much).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
inline constexpr int kMaxSafetensorsRank = 16;

class SafetensorsFile {
 public:
  const std::string& path() const { return path_; }
  // The header's "__metadata__" (string to string); empty when absent.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Every tensor, ordered by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(std::string_view name) const;
  bool Has(std::string_view name) const { return Find(name) != nullptr; }
  // The tensor, if it is there and of a floating dtype: what ReadFloat can read. NOT_FOUND or
  // INVALID_ARGUMENT naming the file and the tensor otherwise.
  StatusOr<const TensorInfo*> FindFloat(std::string_view name) const;

  // The tensor converted to float32. NOT_FOUND when absent; INVALID_ARGUMENT when its dtype
  // is not a floating one; DATA_LOSS when the file shrank or cannot be read since it opened.
  StatusOr<FloatTensor> ReadFloat(std::string_view name) const;

 private:
  friend StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, const std::string& beneath);
  struct Fd;

  std::string path_;
  std::shared_ptr<const Fd> fd_;  // shared so that the file value copies cheaply
  int64_t data_start_ = 0;        // file offset of the data region: 8 + header length
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
};

// Opens `path` (beneath the model dir `beneath` when set: server/store/checkpoint_file.h),
// reads and checks its header. NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT for
// anything wrong in it. No error quotes the file's bytes before its header parsed as JSON.
StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, const std::string& beneath = "");

}  // namespace attnserve
