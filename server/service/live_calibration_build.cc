#include "server/service/live_calibration_build.h"

#include <spdlog/spdlog.h>

#include <chrono>

namespace attnserve {

std::function<bool(std::shared_ptr<const Layer>)> BuildLiveCalibrationOn(AdminWorker* worker, LayerStore* store) {
  return [worker, store](std::shared_ptr<const Layer> layer) {
    AdminWorker::Task task;
    task.run = [store, layer] {
      const auto start = std::chrono::steady_clock::now();
      auto built = store->CompleteLiveCalibration(layer);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (!built.ok()) {
        spdlog::warn("layer '{}': no low-rank form from live traffic: {}", layer->name, built.status().ToString());
        return;
      }
      int64_t total = 0;
      for (int64_t r : (*built)->lowrank_ranks) total += r;
      spdlog::info("layer '{}': low-rank form ({}) built from {} live rows in {:.0f} ms: total rank {}, divergence {:.3g}",
                   layer->name, layer->lowrank_selection, (*built)->lowrank_calibration_rows, ms, total,
                   (*built)->lowrank_calibration_divergence);
    };
    // At shutdown: the build is dropped, like the rows.
    task.refuse = [layer](const Status&) { layer->live_calibration->Unclaim(); };
    task.deadline = std::chrono::steady_clock::time_point::max();
    return worker->Post(std::move(task));
  };
}

}  // namespace attnserve
