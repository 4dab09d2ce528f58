// The low-rank form chosen by data (lowrank=divergence:EPS, docs/spectra.md): per head, the
// fewest directions whose output divergence on calibration inputs stays under EPS, with
// activation-aware truncation.
//
// Weight-only truncation (MaterializeLowRank) keeps the top singular directions of W_M_i, which
// minimises ‖W_M_i − W̃_i‖_F whatever the inputs look like. What a served layer loses is
// ‖X (W_M_i − W̃_i)‖ for the rows X it actually sees, so, as SVD-LLM and ASVD do, the product
// is whitened first: with S the Cholesky factor of the calibration inputs' second moment
// (XᵀX = SᵀS, so ‖X W‖_F = ‖S W‖_F), W̃_i = S⁻¹ · truncate_r(S W_M_i), which minimises
// ‖X (W_M_i − W̃_i)‖_F over all rank-r matrices.
//
// The ranks come from float64 arithmetic on the calibration rows, cut into self-attention
// sequences of kCalibrationSequence rows (non-causal, positions from 0): each head's output
// Z_i W_M_i (Z_i = A_i X, its attention-mixed rows) is measured exactly, r_i is the fewest
// directions whose head divergence ‖Z_i (W_M_i − W̃_i)‖_F / ‖Z_i W_M_i‖_F is at most a target
// t, and t starts at EPS and shrinks until the layer's output divergence (relative L2 of the
// low-rank output against the factored one, biases included: what the shadow measures) is at
// most EPS. With every rank full the form is exact, so the search always ends.
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/status.h"

namespace attnserve {

// Calibration inputs: rows of what the layer reads, [rows, d_model] row-major.
struct CalibrationSet {
  int64_t rows = 0, d_model = 0;
  std::vector<float> x;
};

// Rows per calibration sequence (the last may be shorter).
inline constexpr int64_t kCalibrationSequence = 128;
// At most this many rows are read (1 GiB of float32 at d_model 4096 would be 65536 rows).
inline constexpr int64_t kMaxCalibrationRows = 65536;

// The set fits the layer: d_model columns, at least d_model rows (fewer leave XᵀX singular:
// directions the data never visits would be cut for free), at most kMaxCalibrationRows, every
// value finite. Errors name `field` (the load option), expected and got.
Status ValidateCalibration(const CalibrationSet& set, const LayerConfig& config, const std::string& field);

struct CalibratedLowRank {
  FormWeights form;
  std::vector<int64_t> ranks;            // r_i per query head
  std::vector<double> head_divergence;   // ‖Z_i (W_M_i − W̃_i)‖_F / ‖Z_i W_M_i‖_F on the calibration rows
  std::vector<double> head_kept_energy;  // 1 − head_divergence²: the share of ‖Z_i W_M_i‖² kept
  double kept_energy = 0;                // the same over all heads: Σ kept / Σ ‖Z_i W_M_i‖²
  double divergence = 0;                 // the layer output's relative L2 against factored
};

// The form for `eps` in (0, 1); `set` must have passed ValidateCalibration.
StatusOr<CalibratedLowRank> MaterializeCalibratedLowRank(const LayerWeights& weights, const CalibrationSet& set,
                                                         double eps);

}  // namespace attnserve
