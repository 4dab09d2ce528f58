#include "server/backend/cpu/cpu_backend.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <memory>
#include <span>

#include "server/backend/attention/skeleton.h"
#include "server/backend/compute_team.h"
#include "server/backend/cpu/bf16_dot_gemm.h"
#include "server/backend/cpu/cpu_ops.h"

namespace attnserve {

namespace {

// The rule SummedMixesFirst applies for the options' order: auto mixes first past the scratch
// bound (and where n < m), mix-first past 0 bytes, project-first never.
SummedOrder OrderOf(const CpuBackendOptions& options) {
  switch (options.summed_order) {
    case CpuBackendOptions::SummedOrderChoice::kProjectFirst:
      return {.mix_first_allowed = false};
    case CpuBackendOptions::SummedOrderChoice::kMixFirst:
      return {.mix_first_allowed = true, .max_a_cat_bytes = 0};
    case CpuBackendOptions::SummedOrderChoice::kAuto:
      break;
  }
  return {.mix_first_allowed = true, .max_a_cat_bytes = options.max_score_scratch_bytes};
}

// Under fp16 each projection weight must round to a finite half (|w| < 65520): a layer with a
// larger one is refused by name rather than served with infinities.
Status CheckHalfRange(const FormWeights& f) {
  const auto check = [&](std::string_view name, std::span<const float> w, int64_t cols) -> Status {
    const size_t at = FirstBeyondHalf(w);
    if (at == w.size()) return OkStatus();
    return InvalidArgumentError("math: fp16 holds weights up to " + std::to_string(static_cast<int>(kLargestHalf)) +
                                " in magnitude, got " + std::to_string(w[at]) + " in the " +
                                std::string(FormName(f.form)) + " form's " + std::string(name) + " at [" +
                                std::to_string(static_cast<int64_t>(at) / cols) + ", " +
                                std::to_string(static_cast<int64_t>(at) % cols) + "]; hold this layer in fp32 or bf16");
  };
  ATTNSERVE_RETURN_IF_ERROR(check("w_in", f.w_in, f.in_cols()));
  return check("w_out", f.w_out, f.config.d_model);
}

}  // namespace

CpuBackend::CpuBackend(CpuBackendOptions options)
    : threads_(options.threads > 0 ? options.threads : omp_get_max_threads()),
      gemm_(options.gemm),
      weight_layout_(options.weight_layout),
      max_score_scratch_bytes_(options.max_score_scratch_bytes),
      max_retained_scratch_bytes_(options.max_retained_scratch_bytes),
      summed_value_group_bytes_(options.summed_value_group_bytes),
      summed_order_(OrderOf(options)),
      idle_spin_(options.idle_spin) {
  // Every GEMM here splits its own work across threads (SplitGemm, cpu_ops.cc); Eigen's own
  // split by output rows is pathological for few rows (slower on 2 threads than on 1:
  // docs/journal/benchmarks-journal.md, "Figures the CPU backend's comments held"), so it stays off.
  Eigen::setNbThreads(1);
}

CpuBackend::~CpuBackend() = default;

std::unique_ptr<ForwardScratch> CpuBackend::TakeScratch() {
  MutexLock lock(scratch_mu_);
  if (free_scratch_.empty()) return std::make_unique<ForwardScratch>();
  std::unique_ptr<ForwardScratch> scratch = std::move(free_scratch_.back());
  free_scratch_.pop_back();
  return scratch;
}

std::unique_ptr<ComputeTeam> CpuBackend::TakeTeam() {
  {
    MutexLock lock(team_mu_);
    if (!free_teams_.empty()) {
      std::unique_ptr<ComputeTeam> team = std::move(free_teams_.back());  // the last used: warmest
      free_teams_.pop_back();
      return team;
    }
  }
  return std::make_unique<ComputeTeam>(threads_, idle_spin_);
}

void CpuBackend::ReturnTeam(std::unique_ptr<ComputeTeam> team) {
  MutexLock lock(team_mu_);
  free_teams_.push_back(std::move(team));
}

void CpuBackend::ReturnScratch(std::unique_ptr<ForwardScratch> scratch) {
  if (scratch->Bytes() > max_retained_scratch_bytes_) return;  // a rare large batch: not kept
  MutexLock lock(scratch_mu_);
  free_scratch_.push_back(std::move(scratch));
}

int64_t CpuBackend::ScratchBytes(const FormWeights& f, std::span<const SequenceShape> batch,
                                 bool self_attention) const {
  const int64_t formula = ForwardScratchBytes(f, batch, self_attention, threads_, max_score_scratch_bytes_,
                                              summed_order_, summed_value_group_bytes_);
  if (gemm_ != GemmLibrary::kEigen) return formula;
  // The formula counts 4 MiB of packing per thread (oneDNN's, and Eigen's on small caches); Eigen's
  // panels grow with the product and the CPU's caches, so its largest GEMM of this forward, per
  // thread (SplitGemm splits the columns: a thread's share), replaces that figure.
  const int64_t d = f.config.d_model;
  const auto share = [&](int64_t cols) { return (cols + threads_ - 1) / threads_; };
  const auto packing = [&](int64_t rows, int64_t depth, int64_t cols) {
    return GemmPackingBytes(GemmLibrary::kEigen, rows, depth, share(cols));
  };
  int64_t tx = 0, tc = 0, largest = 0;
  for (const SequenceShape& s : batch) {
    tx += s.n;
    tc += s.m;
    const int64_t keys = s.keys < 0 ? s.m : s.keys;
    if (f.concat_then_project()) continue;
    largest = std::max(largest, SummedMixesFirst(f, s, summed_order_) ? packing(s.n, d, d)  // a head's W_M_i
                                                                      : packing(s.n, keys * f.config.heads, d));
  }
  largest = std::max({largest, packing(tx, d, f.q_cols + f.k_cols), packing(tc, d, f.value_cols)});
  if (f.concat_then_project()) largest = std::max(largest, packing(tx, f.out_rows, d));
  return formula + int64_t{threads_} * std::max<int64_t>(0, largest - (int64_t{4} << 20));
}

int64_t CpuBackend::RetainedScratchBytes() const {
  MutexLock lock(scratch_mu_);
  int64_t bytes = 0;
  for (const auto& s : free_scratch_) bytes += s->Bytes();
  return bytes;
}

StatusOr<std::shared_ptr<const ResidentForm>> CpuBackend::Upload(std::shared_ptr<const FormWeights> form) {
  return UploadIn(std::move(form), default_math());
}

Math CpuBackend::default_math() const {
  switch (weight_layout_) {
    case WeightLayout::kPackedBf16:
    case WeightLayout::kPackedBf16Dot: return Math::kBf16;
    case WeightLayout::kPackedFp16: return Math::kFp16;
    case WeightLayout::kPacked:
    case WeightLayout::kPlain: break;
  }
  return Math::kFp32;
}

Status CpuBackend::CheckMath(Math math) const {
  if (math == Math::kFp32) return OkStatus();
  if (!HalfWeights(math)) {
    return InvalidArgumentError("math: the CPU runs fp32, bf16 or fp16, got " + std::string(MathName(math)));
  }
  if (PanelWidth() <= 0) {
    return InvalidArgumentError("math: " + std::string(MathName(math)) +
                                " on the CPU needs the backend's own GEMM kernel (an x86-64 build and a CPU with "
                                "AVX2, FMA and F16C), which cannot run here; got " + std::string(MathName(math)));
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<const ResidentForm>> CpuBackend::UploadIn(std::shared_ptr<const FormWeights> form, Math math) {
  if (!form) return InvalidArgumentError("Upload: no form given");
  ATTNSERVE_RETURN_IF_ERROR(CheckHeadCombine(*form));
  ATTNSERVE_RETURN_IF_ERROR(CheckMath(math));
  int64_t panel_width = PanelWidth();
  PanelPrecision precision = PanelPrecision::kFloat32;
  if (math == Math::kFp32 && weight_layout_ == WeightLayout::kPlain) panel_width = 0;
  if (math == Math::kBf16) {
    // The inputs too where vdpbf16ps runs, as the GPU's bf16 does; the weights alone elsewhere
    // and under packed-bf16, which asked for that.
    precision = weight_layout_ != WeightLayout::kPackedBf16 && Bf16DotAvailable() ? PanelPrecision::kBfloat16Pairs
                                                                                  : PanelPrecision::kBfloat16;
  }
  if (math == Math::kFp16) {
    ATTNSERVE_RETURN_IF_ERROR(CheckHalfRange(*form));
    precision = PanelPrecision::kFloat16;  // the weights alone, widened by vcvtph2ps
  }
  return std::shared_ptr<const ResidentForm>(
      std::make_shared<CpuResidentForm>(std::move(form), panel_width, precision));
}

Status CpuBackend::Forward(const ResidentForm& resident, std::span<const Sequence> batch) {
  const FormWeights& f = resident.weights();
  if (batch.empty()) return OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(ValidateBatch(f.config, batch));
  // The team first: its helpers wake while the scratch and the inputs are made ready.
  // Both are returned to their pools however the forward ends.
  std::unique_ptr<ComputeTeam> team = TakeTeam();
  team->Hold();
  std::unique_ptr<ForwardScratch> scratch = TakeScratch();
  struct Return {
    CpuBackend* backend;
    std::unique_ptr<ComputeTeam>& team;
    std::unique_ptr<ForwardScratch>& scratch;
    ~Return() {
      team->Release();
      backend->ReturnTeam(std::move(team));
      backend->ReturnScratch(std::move(scratch));
    }
  } give_back{this, team, scratch};
  const Compute run{gemm_, threads_, summed_order_, team.get()};
  CpuOps ops(run, dynamic_cast<const CpuResidentForm*>(&resident), max_score_scratch_bytes_, summed_value_group_bytes_,
             *scratch);
  return RunAttention(ops, f, HostWeights(f), batch);
}

}  // namespace attnserve
