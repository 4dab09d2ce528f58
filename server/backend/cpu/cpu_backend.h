// The CPU backend: GEMMs (oneDNN or Eigen, gemm.h) for the projections (one per batch over all
// stacked tokens) and an OpenMP loop over (sequence, head) for the scores and the mix.
// Thread-safety: Forward is reentrant (each call owns its scratch). Construction turns Eigen's
// own (process-wide) GEMM threading off: the backend splits GEMMs across its threads itself.
#pragma once

#include <memory>

#include "server/backend/backend.h"
#include "server/backend/cpu/gemm.h"

namespace attnserve {

struct CpuBackendOptions {
  int threads = 0;  // 0: all cores OpenMP sees
  // Which library computes the GEMMs (gemm.h): oneDNN when the build has it, else Eigen.
  GemmLibrary gemm = BuiltWithOneDnn() ? GemmLibrary::kOneDnn : GemmLibrary::kEigen;
  // Upper bound on the score scratch of the summed form held at once (its [n, h·m] matrix per
  // sequence); larger batches run in chunks so memory stays bounded. A single sequence larger
  // than the bound still runs whole: the service's size limits bound that case.
  int64_t max_score_scratch_bytes = int64_t{256} << 20;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuBackendOptions options = {});

  std::string DeviceName() const override { return "cpu"; }
  StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> form) override;
  Status Forward(const ResidentForm& form, std::span<const Sequence> batch) override;
  int64_t ScratchBytes(const FormWeights& form, std::span<const SequenceShape> batch,
                       bool self_attention) const override {
    return ForwardScratchBytes(form, batch, self_attention, threads_, max_score_scratch_bytes_);
  }

  int threads() const { return threads_; }
  GemmLibrary gemm() const { return gemm_; }

 private:
  int threads_;
  GemmLibrary gemm_;
  int64_t max_score_scratch_bytes_;
};

}  // namespace attnserve
