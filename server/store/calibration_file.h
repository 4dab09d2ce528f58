// The calibration inputs of lowrank=divergence:EPS (calibration=PATH, docs/spectra.md): a NumPy
// .npy file of float32 (or float64, converted) rows, shape [rows, d_model], C order.
// The reader trusts nothing in the file: magic, version, header length, a strict parse of the
// header dict and the file size are checked by format/npy.h (the client's reader too), then the
// shape against kMaxCalibrationRows and kMaxDModel, before any data is allocated. Errors name
// the option, the file, expected and got.
// Thread-safety: free functions; call from any thread.
#pragma once

#include <string>
#include <string_view>

#include "server/core/calibrated_rank.h"
#include "server/core/status.h"

namespace attnserve {

// Parses a whole .npy image in memory; `name` leads every error.
StatusOr<CalibrationSet> ParseCalibrationNpy(std::string_view bytes, const std::string& name);

// Opens `path` as OpenCheckpointFile does (beneath `model_dir` when it is set) and parses it.
StatusOr<CalibrationSet> ReadCalibrationNpy(const std::string& model_dir, const std::string& path);

}  // namespace attnserve
