// Layer: one loaded layer, its forms resident on a backend. The store (server/store) makes and
// publishes them; the executor, the router and the service only read them, so the type lives
// apart from the store and they need not depend on it.
// Thread-safety: immutable once published; readers hold a shared_ptr for a whole request.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/live_calibration.h"
#include "server/core/math.h"
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
  // The forms held, resident on the backend in its default math (maths[0]). The factored form
  // is always held.
  std::map<Form, std::shared_ptr<const ResidentForm>> forms;
  // The maths every held form is held in: the backend's default first, then --extra-maths in
  // their order. Empty: the default alone (a layer a test made by hand).
  std::vector<Math> maths;
  // The held forms in the other maths (maths[1], …): the same weights, resident again, each a
  // served variant of its own (routes' form@math, shadows between precisions).
  std::map<Variant, std::shared_ptr<const ResidentForm>> other_maths;
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

  // nullptr when the layer does not hold that form (in the default math).
  const ResidentForm* Find(Form form) const {
    auto it = forms.find(form);
    return it == forms.end() ? nullptr : it->second.get();
  }
  // nullptr when the layer does not hold that variant.
  const ResidentForm* Find(Variant v) const {
    if (v.math == default_math()) return Find(v.form);
    auto it = other_maths.find(v);
    return it == other_maths.end() ? nullptr : it->second.get();
  }
  Math default_math() const { return maths.empty() ? Math::kFp32 : maths.front(); }
  bool HoldsMath(Math m) const {
    return m == default_math() || std::find(maths.begin(), maths.end(), m) != maths.end();
  }
  // Every variant held: each held form in each math, the default math's first, in form order.
  std::vector<Variant> Variants() const {
    std::vector<Variant> held;
    for (const auto& [form, _] : forms) held.push_back({form, default_math()});
    for (const auto& [variant, _] : other_maths) held.push_back(variant);
    return held;
  }
  // Host bytes `v`'s resident form adds to the layer: all of its HostBytes in the default math;
  // in another, what it holds beyond the float32 weights it shares with the default math's form
  // (the CPU's packed copy; nothing for a GPU's). 0 when the variant is not held.
  int64_t HostBytesOf(Variant v) const {
    const ResidentForm* r = Find(v);
    if (r == nullptr) return 0;
    if (v.math == default_math()) return r->HostBytes();
    const ResidentForm* shared = Find(v.form);
    return shared != nullptr && &shared->weights() == &r->weights() ? r->HostBytes() - r->weights().Bytes()
                                                                    : r->HostBytes();
  }
  // Every resident form, the other maths' included: what the layer holds on its device.
  std::vector<const ResidentForm*> AllResident() const {
    std::vector<const ResidentForm*> all;
    for (const auto& [_, r] : forms) all.push_back(r.get());
    for (const auto& [_, r] : other_maths) all.push_back(r.get());
    return all;
  }
};

}  // namespace attnserve
