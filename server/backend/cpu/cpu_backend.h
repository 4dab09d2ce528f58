// The CPU backend: the attention skeleton (server/backend/attention) over the CPU's device
// operations (CpuOps, cpu_ops.h) — GEMMs (oneDNN or Eigen, gemm.h) split across the threads for
// the projections (one per batch over all stacked tokens), and attention as tasks on the compute
// team (a block of query rows of one sequence, for the heads sharing a K/V tile) that runs the
// scores and the mix tile by tile with an online softmax (tiled_attention.h): no n × L matrix
// exists, memory is linear in the sequence length. This file holds what lasts between forwards:
// the options, the pools of scratch and compute teams, Upload (packing the weights) and the
// memory figures.
// Thread-safety: Forward is reentrant: each call takes a scratch and a compute team of its own
// from pools (guarded by mutexes) and gives them back at the end, so concurrent calls never
// share one. Construction turns Eigen's own (process-wide) GEMM threading off: the backend
// splits GEMMs across its threads itself.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "server/backend/backend.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/core/thread_annotations.h"

namespace attnserve {

struct CpuBackendOptions {
  int threads = 0;  // 0: every core this process may run on (omp_get_max_threads: OMP_NUM_THREADS or the CPU affinity)
  // Which library computes the GEMMs (gemm.h): oneDNN when the build has it, else Eigen.
  GemmLibrary gemm = BuiltWithOneDnn() ? GemmLibrary::kOneDnn : GemmLibrary::kEigen;
  // kPacked: Upload packs each form's projection weights into panels (packed_weights.h), and
  // the projections run on the backend's own kernel where it beats the library (PanelGemmPays);
  // a second copy of the weights in host memory. kPlain: the library on the row-major weights.
  // The default packs where the kernel runs (ParseWeightLayout("auto")).
  WeightLayout weight_layout = *ParseWeightLayout("auto");
  // Upper bound on the summed form's working memory held at once: the A_cat [n, L·h] of the
  // sequences that project first, the mixes [rows, h·d] of those that mix first. A sequence
  // whose A_cat alone would pass it mixes first, tiled, in parts of rows under the bound
  // (SummedMixesFirst), so memory stays linear in the sequence length; batches run in chunks.
  int64_t max_score_scratch_bytes = int64_t{256} << 20;
  // A forward's scratch (projections, A_cat) is kept for the next call, one per concurrent
  // caller, unless it grew beyond this: then it is freed, so one large batch does not hold its
  // memory for good. The memory budget counts scratch only while a batch runs (ScratchBytes).
  int64_t max_retained_scratch_bytes = int64_t{256} << 20;
  // The summed form's association order (SummedMixesFirst): auto mixes a sequence's keys before
  // projecting them where it has fewer queries than keys or its A_cat would pass
  // max_score_scratch_bytes; project-first and mix-first force one order (for comparisons:
  // project-first holds each sequence's whole A_cat, however long).
  enum class SummedOrderChoice { kAuto, kProjectFirst, kMixFirst };
  SummedOrderChoice summed_order = SummedOrderChoice::kAuto;
  // The summed form projects the value rows of its project-first sequences (h·d columns each:
  // 16 MiB for one gpt2-medium sequence of 256 tokens) and sums their heads a group of
  // sequences at a time, at most this many bytes of value rows or one sequence
  // (PlanPolicy::max_value_group_bytes), so that a batch's value block does not grow with the
  // batch: the memory budget counts one group (ScratchBytes). Smaller groups measured no faster
  // (docs/journal/benchmarks-journal.md, "The summed form's value groups"): the head sum does 128 FLOPs per
  // byte of value rows it reads, so it does not wait for memory wherever they come from.
  int64_t summed_value_group_bytes = int64_t{64} << 20;
  // After a forward, how long its helper threads spin for the next one before they sleep
  // (ComputeTeam), giving way to any thread ready to run on their core: a forward that follows
  // at once, or a served request a round trip later, finds them awake on a vCPU that did not
  // go idle.
  std::chrono::microseconds idle_spin{500};
};

struct ForwardScratch;
class ComputeTeam;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuBackendOptions options = {});
  ~CpuBackend() override;

  std::string DeviceName() const override { return "cpu"; }
  StatusOr<std::shared_ptr<const ResidentForm>> Upload(std::shared_ptr<const FormWeights> form) override;
  // bf16 under --cpu-weight-layout packed-bf16 or packed-bf16-dot, fp16 under packed-fp16, else
  // fp32.
  Math default_math() const override;
  // fp32: the weight layout's float32 panels (or none: plain). bf16: the weights packed as
  // bfloat16, and where the CPU has AVX512_BF16 the projections' inputs too (vdpbf16ps), as
  // packed-bf16-dot; packed-bf16's weights-only rounding under that layout. fp16: the weights
  // packed as IEEE halves (INVALID_ARGUMENT, naming the weight, for one whose magnitude rounds
  // past 65504). bf16 and fp16 need the own GEMM kernel (AVX2, FMA and F16C). tf32:
  // INVALID_ARGUMENT (a GPU math).
  StatusOr<std::shared_ptr<const ResidentForm>> UploadIn(std::shared_ptr<const FormWeights> form, Math math) override;
  Status CheckMath(Math math) const override;
  Status Forward(const ResidentForm& form, std::span<const Sequence> batch) override;
  // ForwardScratchBytes, with Eigen's GEMM packing where Eigen computes (GemmPackingBytes).
  int64_t ScratchBytes(const FormWeights& form, std::span<const SequenceShape> batch,
                       bool self_attention) const override;
  // The summed form in the order it runs (SummedMixesFirst).
  SummedOrder summed_order() const override { return summed_order_; }
  double Flops(const FormWeights& form, std::span<const SequenceShape> batch) const override {
    return ForwardFlops(form, batch, summed_order_);
  }

  int threads() const { return threads_; }
  GemmLibrary gemm() const { return gemm_; }
  WeightLayout weight_layout() const { return weight_layout_; }
  // The scratch kept between calls, in bytes.
  int64_t RetainedScratchBytes() const override;

 private:
  std::unique_ptr<ForwardScratch> TakeScratch();
  void ReturnScratch(std::unique_ptr<ForwardScratch> scratch);
  std::unique_ptr<ComputeTeam> TakeTeam();
  void ReturnTeam(std::unique_ptr<ComputeTeam> team);

  int threads_;
  GemmLibrary gemm_;
  WeightLayout weight_layout_;
  int64_t max_score_scratch_bytes_;
  int64_t max_retained_scratch_bytes_;
  int64_t summed_value_group_bytes_;
  SummedOrder summed_order_;
  std::chrono::microseconds idle_spin_;
  mutable Mutex scratch_mu_;
  std::vector<std::unique_ptr<ForwardScratch>> free_scratch_ ATTNSERVE_GUARDED_BY(scratch_mu_);
  // A team per concurrent caller, kept (compute_team.h): helper threads, not memory.
  Mutex team_mu_;
  std::vector<std::unique_ptr<ComputeTeam>> free_teams_ ATTNSERVE_GUARDED_BY(team_mu_);
};

}  // namespace attnserve
