#include "server/store/calibration_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "format/npy.h"
#include "server/store/checkpoint_file.h"

namespace attnserve {

// A float64 file is converted as it is read (numpy's default dtype: np.save of a float64 array
// works as is); its size is bounded as a float32 file's, so it holds half as many values.
constexpr size_t kMaxCalibrationFileBytes =
    npy::kMaxHeaderBytes + 16 + static_cast<size_t>(kMaxCalibrationRows) * 8192 * sizeof(float);

StatusOr<CalibrationSet> ParseCalibrationNpy(std::string_view bytes, const std::string& name) {
  npy::Layout layout;
  std::string error;
  if (!npy::ParseLayout(bytes, name, &layout, &error)) return InvalidArgumentError(error);
  if (layout.shape.size() != 2) {
    return InvalidArgumentError(name + ": expected shape [rows, d_model] (2 dimensions), got " +
                                npy::ShapeString(layout.shape));
  }
  CalibrationSet set;
  set.rows = layout.shape[0];
  set.d_model = layout.shape[1];
  if (set.rows > kMaxCalibrationRows || set.d_model > kMaxDModel) {
    return InvalidArgumentError(name + ": expected at most " + std::to_string(kMaxCalibrationRows) +
                                " rows of at most " + std::to_string(kMaxDModel) + " values, got shape " +
                                npy::ShapeString(layout.shape));
  }
  set.x.resize(static_cast<size_t>(layout.count));
  // An empty array ([0, D] or [R, 0]) has no data. Its row count is refused later, against the
  // layer (ValidateCalibration).
  if (layout.count > 0) npy::Decode(bytes.data() + layout.data_offset, layout.count, layout.dtype, set.x.data());
  return set;
}

StatusOr<CalibrationSet> ReadCalibrationNpy(const std::string& model_dir, const std::string& path) {
  const std::string name = "calibration file '" + path + "'";
  ATTNSERVE_ASSIGN_OR_RETURN(FileDescriptor fd, OpenCheckpointFile(model_dir, path));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return InternalError(name + ": fstat: " + std::strerror(errno));
  const size_t limit = kMaxCalibrationFileBytes;
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
