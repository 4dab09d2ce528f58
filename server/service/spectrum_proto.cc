#include "server/service/spectrum_proto.h"

namespace attnserve {

void ToProto(const HeadSpectrum& head, v1::HeadSpectrum* out) {
  out->mutable_singular_values()->Assign(head.singular_values.begin(), head.singular_values.end());
  out->set_frobenius(head.frobenius);
  out->set_stable_rank(head.stable_rank);
  out->set_effective_rank(head.effective_rank);
  out->set_rank_90(head.rank_90);
  out->set_rank_99(head.rank_99);
  out->set_rank_999(head.rank_999);
}

void FillLowRankInfo(const Layer& layer, v1::LayerInfo* info) {
  info->mutable_config()->set_rope_theta(layer.config.rope_theta);
  if (layer.live_calibration != nullptr) {
    v1::LiveCalibration* live = info->mutable_live_calibration();
    live->set_rank_selection(layer.lowrank_selection);
    live->set_rows_wanted(layer.live_calibration->rows_wanted());
    live->set_rows_seen(layer.live_calibration->rows_seen());
    live->set_error(layer.live_calibration->failure().message());
  }
  if (layer.lowrank_ranks.empty()) return;
  for (v1::FormInfo& f : *info->mutable_forms()) {
    if (f.form() != v1::FORM_LOWRANK) continue;
    f.mutable_ranks()->Assign(layer.lowrank_ranks.begin(), layer.lowrank_ranks.end());
    f.set_rank_selection(layer.lowrank_selection);
    f.set_kept_energy(layer.lowrank_kept_energy);
    f.mutable_head_kept_energy()->Assign(layer.lowrank_head_kept_energy.begin(), layer.lowrank_head_kept_energy.end());
    f.mutable_head_divergence()->Assign(layer.lowrank_head_divergence.begin(), layer.lowrank_head_divergence.end());
    f.set_calibration_divergence(layer.lowrank_calibration_divergence);
    f.set_calibration_rows(layer.lowrank_calibration_rows);
  }
}

void FillSpectrumInfo(const Layer& layer, v1::LayerInfo* info) {
  info->clear_ov_spectrum();
  info->clear_qk_spectrum();
  if (layer.spectrum == nullptr) return;
  for (const HeadSpectrum& h : layer.spectrum->ov) ToProto(h, info->add_ov_spectrum());
  for (const HeadSpectrum& h : layer.spectrum->qk) ToProto(h, info->add_qk_spectrum());
}

}  // namespace attnserve
