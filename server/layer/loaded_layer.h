// Layer: one loaded layer, its forms resident on a backend. The store (server/store) makes and
// publishes them; the executor, the router and the service only read them, so the type lives
// apart from the store and they need not depend on it.
// Thread-safety: immutable once published; readers hold a shared_ptr for a whole request.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/live_calibration.h"
#include "server/core/spectrum.h"

namespace attnserve {

struct Layer {
  std::string name;
  // Unique per load in this process (a replaced layer and its successor differ): the name of a
  // queue in messages tells the two apart by it.
  uint64_t serial = 0;
  // The SOURCE string it was loaded from (docs/sources.md), with a checkpoint's path shown
  // relative to its model dir, or as its file name alone: no server path leaves the server.
  std::string source;
  LayerConfig config;  // complete
  std::string device;  // the backend's DeviceName()
  // The forms held, resident on the backend. The factored form is always held.
  std::map<Form, std::shared_ptr<const ResidentForm>> forms;
  // Per-head OV and QK spectra, computed once at load (server/core/spectrum.h); null when the
  // source said spectrum=false.
  std::shared_ptr<const LayerSpectrum> spectrum;
  // The low-rank form's selection as the source gave it ("energy:0.99", "budget:256"), the
  // rank r_i it chose per query head, and the share of Σ_i ‖W_M_i‖_F² those ranks keep.
  // Empty / 0 when the layer does not hold the low-rank form.
  std::string lowrank_selection;
  std::vector<int64_t> lowrank_ranks;
  double lowrank_kept_energy = 0;
  // Per query head: the share of its energy kept (energy:, budget: — of ‖W_M_i‖_F²;
  // divergence: — of its output's on the calibration inputs), and with divergence: its output
  // divergence there and the layer's (relative L2 against the factored form, float64), and
  // how many calibration rows it came from. Empty / 0 otherwise.
  std::vector<double> lowrank_head_kept_energy;
  std::vector<double> lowrank_head_divergence;
  double lowrank_calibration_divergence = 0;
  int64_t lowrank_calibration_rows = 0;
  // lowrank=divergence:EPS,calibration=live:ROWS while its rows are gathered or its build
  // failed: the rows served calls offer (lowrank_selection is set, the low-rank form is not yet
  // held). The layer published with the form has none. Internally synchronised.
  std::shared_ptr<LiveCalibration> live_calibration;

  // nullptr when the layer does not hold that form.
  const ResidentForm* Find(Form form) const {
    auto it = forms.find(form);
    return it == forms.end() ? nullptr : it->second.get();
  }
};

}  // namespace attnserve
