// Per-head spectra of a layer's rank-limited products, and the low-rank form built from them.
//
// Each head's OV product W_M_i = W_V_g(i) · W_O_i and QK product W_Q_i · W_K_g(i)^T is a d×d
// matrix of rank ≤ d_h. Its singular values come from two thin QRs and one small SVD, without
// forming the d×d matrix: A·B^T with A = Q1 R1 and B = Q2 R2 is Q1 (R1 R2^T) Q2^T, and the SVD
// of the k×k middle (k = min(d, d_h)) gives A·B^T = (Q1 U) S (Q2 V)^T in O(d·d_h²).
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/status.h"

namespace attnserve {

struct HeadSpectrum {
  std::vector<double> singular_values;  // descending, min(d_model, d_head) of them
  double frobenius = 0;                 // sqrt(Σ σ²)
  double stable_rank = 0;               // ‖W‖_F² / σ₁²
  double effective_rank = 0;            // exp(entropy of σ² / Σ σ²)
  int64_t rank_90 = 0, rank_99 = 0, rank_999 = 0;  // smallest r keeping that share of Σ σ²
};

struct LayerSpectrum {
  std::vector<HeadSpectrum> ov;  // W_V_g(i) · W_O_i, one per query head
  std::vector<HeadSpectrum> qk;  // W_Q_i · W_K_g(i)^T, one per query head
};

LayerSpectrum ComputeSpectrum(const LayerWeights& weights);

// The smallest r whose leading singular values keep at least `energy` (in (0, 1]) of Σ σ².
int64_t RankForEnergy(const std::vector<double>& singular_values, double energy);

// How the low-rank form chooses each head's rank r_i.
struct RankSelection {
  enum class Kind { kEnergy, kBudget, kFixed, kDivergence } kind = Kind::kEnergy;
  double energy = 0.99;        // kEnergy: per head, keep this share of the head's Σ σ²
  // kDivergence: the layer's output divergence on calibration inputs stays under this
  // (server/core/calibrated_rank.h); SelectRanks refuses it, having no calibration inputs.
  double divergence = 0;
  int64_t budget = 0;          // kBudget: Σ r_i, filled by the largest σ across all heads
  std::vector<int64_t> ranks;  // kFixed: r_i per head
};

// Per-head ranks for the selection, each in [0, min(d_model, d_head)]; errors name the field.
StatusOr<std::vector<int64_t>> SelectRanks(const LayerSpectrum& spectrum, const RankSelection& selection);

// The low-rank form: W_M_i ≈ P_i Q_i with P_i = U_r sqrt(S_r) [d, r_i] and Q_i = sqrt(S_r) V_r^T
// [r_i, d]; value block [P_1 | … | P_h], output [Q_1; …; Q_h], b_out = b_eff as in the summed
// form. With every r_i = min(d, d_h) it is exact.
StatusOr<FormWeights> MaterializeLowRank(const LayerWeights& weights, const std::vector<int64_t>& ranks);

}  // namespace attnserve
