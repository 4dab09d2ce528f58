// The build of a low-rank form calibrated on live traffic (lowrank=divergence:EPS,
// calibration=live:ROWS; server/core/live_calibration.h), started by the served call whose rows
// completed the set and run on a background worker, so no serving thread waits for its float64
// SVDs. What ForwardPipelineOptions::build_live_calibration is in the server.
#pragma once

#include <functional>
#include <memory>

#include "server/layer/loaded_layer.h"
#include "server/service/admin_worker.h"
#include "server/store/layer_store.h"

namespace attnserve {

// Posts the build of a layer's calibrated low-rank form to `worker` (both not owned; they
// outlive every call of the function returned). The function returns false when the worker's
// queue is full. The outcome is logged; a failure is kept in the layer's live calibration for
// GetLayer.
std::function<bool(std::shared_ptr<const Layer>)> BuildLiveCalibrationOn(AdminWorker* worker, LayerStore* store);

}  // namespace attnserve
