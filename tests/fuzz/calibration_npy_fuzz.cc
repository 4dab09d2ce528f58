// libFuzzer target: bytes → ParseCalibrationNpy (server/store/calibration_file.h), the reader of
// lowrank=divergence:'s calibration=PATH. Nothing may crash, and an accepted file must hold
// exactly rows × d_model values within the documented bounds.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "server/store/calibration_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  StatusOr<CalibrationSet> set = ParseCalibrationNpy(bytes, "fuzz.npy");
  if (!set.ok()) return 0;
  if (set->rows < 0 || set->rows > kMaxCalibrationRows || set->d_model < 0 || set->d_model > kMaxDModel ||
      static_cast<int64_t>(set->x.size()) != set->rows * set->d_model) {
    std::fprintf(stderr, "calibration npy fuzz: accepted [%lld, %lld] holding %zu values\n",
                 static_cast<long long>(set->rows), static_cast<long long>(set->d_model), set->x.size());
    std::abort();
  }
  return 0;
}
