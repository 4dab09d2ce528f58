// LayerInfo's spectrum and low-rank fields, from a loaded Layer (docs/spectra.md). Kept apart
// from service.cc so the conversion is tested without a server: the service calls
// FillLowRankInfo from FillLayerInfo (every LayerInfo it sends) and FillSpectrumInfo from
// GetLayer when the request sets include_spectrum.
// Thread-safety: pure functions of their arguments; a Layer is immutable once published.
#pragma once

#include "attnserve/v1/attention.pb.h"
#include "server/core/spectrum.h"
#include "server/layer/loaded_layer.h"

namespace attnserve {

void ToProto(const HeadSpectrum& head, v1::HeadSpectrum* out);

// config.rope_theta, and on the FORM_LOWRANK FormInfo already in `info` (FillLayerInfo adds one
// per held form) its ranks, rank_selection and kept_energy. Call after the forms are filled.
void FillLowRankInfo(const Layer& layer, v1::LayerInfo* info);

// ov_spectrum and qk_spectrum, one entry per query head, replacing any already there; nothing
// when the layer was loaded with spectrum=false. The spectra were computed once, at load.
void FillSpectrumInfo(const Layer& layer, v1::LayerInfo* info);

}  // namespace attnserve
