// Views of a layer's per-head spectra (LayerInfo.ov_spectrum / qk_spectrum) for
// `attnserve-cli layer NAME --spectrum` (a table) and `--plot FILE.svg` (a plain SVG file:
// one curve per head, log-scale y, labelled axes, a legend; no scripts, no external fonts or
// styles, so any browser shows it as is). No I/O here, so the unit tests check the text.
// Thread-safety: pure functions.
#pragma once

#include <string>

#include "attnserve/v1/attention.pb.h"

namespace attnserve::cli {

// Whether the LayerInfo carries spectra (the server fills them when asked and when the layer
// was not loaded with spectrum=false).
bool HasSpectrum(const v1::LayerInfo& info);

// Two tables, OV then QK, one row per head: HEAD SIGMA1 FROBENIUS STABLE_RANK EFFECTIVE_RANK
// R90 R99 R99.9, columns padded to the widest cell.
std::string SpectrumTable(const v1::LayerInfo& info);

// A complete SVG document: two panels (OV, QK) of σ_i against i, one coloured curve per head.
std::string SpectrumSvg(const v1::LayerInfo& info);

// One line on the low-rank form, when the layer holds it: its selection, the ranks, the energy
// kept, and its parameters and FLOPs per token as multiples of the factored form's (and, when
// chosen by divergence:, the calibration's divergence and rows); then a table of each head's
// rank, kept energy and (calibrated) divergence. Empty otherwise.
std::string LowRankSummary(const v1::LayerInfo& info);

}  // namespace attnserve::cli
