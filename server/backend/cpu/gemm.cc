#include "server/backend/cpu/gemm.h"

#include <omp.h>

#include <Eigen/Core>
#include <cstdlib>
#include <cstring>

#ifdef ATTNSERVE_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

namespace attnserve {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Stride = Eigen::OuterStride<>;
using ConstMap = Eigen::Map<const RowMatrix, 0, Stride>;
using MutableMap = Eigen::Map<RowMatrix, 0, Stride>;

ConstMap AsEigen(ConstMatrixView v) { return ConstMap(v.data, v.rows, v.cols, Stride(v.ld)); }
MutableMap AsEigen(MatrixView v) { return MutableMap(v.data, v.rows, v.cols, Stride(v.ld)); }

}  // namespace

int64_t GemmPackingBytes(GemmLibrary library, int64_t rows, int64_t depth, int64_t cols) {
  if (library == GemmLibrary::kOneDnn) return int64_t{4} << 20;
  // A row-major product is Eigen's column-major yᵀ = wᵀ xᵀ: its lhs is wᵀ [cols, depth] (blocks
  // of kc × mc), its rhs xᵀ [depth, rows] (panels of kc × nc).
  Eigen::Index kc = depth, mc = cols, nc = rows;
  Eigen::internal::computeProductBlockingSizes<float, float, 1, Eigen::Index>(kc, mc, nc, 1);
  return static_cast<int64_t>((kc * mc + kc * nc) * sizeof(float));
}

namespace {

void EigenGemm(ConstMatrixView x, ConstMatrixView w, bool transpose_w, float alpha, MatrixView y, bool accumulate) {
  // The scale on the left: Eigen folds it into the GEMM's alpha (on the right it evaluates the
  // product into a temporary of its own first).
  auto out = AsEigen(y);
  if (transpose_w && accumulate) {
    out.noalias() += alpha * AsEigen(x) * AsEigen(w).transpose();
  } else if (transpose_w) {
    out.noalias() = alpha * AsEigen(x) * AsEigen(w).transpose();
  } else if (accumulate) {
    out.noalias() += alpha * AsEigen(x) * AsEigen(w);
  } else {
    out.noalias() = alpha * AsEigen(x) * AsEigen(w);
  }
}

struct IsaCap {
  bool avx512;
  const char* name;
};

IsaCap ReadIsaCap() {
  const char* cap = std::getenv("ATTNSERVE_CPU_ISA");
  const bool capped = cap != nullptr && std::strcmp(cap, "avx2") == 0;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = !capped && __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
#else
  const bool avx512 = false, avx2 = false;
#endif
#ifdef ATTNSERVE_HAVE_ONEDNN
  // Before oneDNN's first kernel: its dispatch is fixed from then on.
  if (capped) dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx2);
#endif
  return {avx512, avx512 ? "avx512" : avx2 ? "avx2" : "generic"};
}

const IsaCap& Cap() {
  static const IsaCap cap = ReadIsaCap();
  return cap;
}

#ifdef ATTNSERVE_HAVE_ONEDNN
// oneDNN runs its GEMM on as many OpenMP threads as the calling thread's ICV allows when it is
// not inside an active parallel region. Callers here split the work themselves, so the call is
// held to this thread.
bool OneDnnGemm(ConstMatrixView x, ConstMatrixView w, bool transpose_w, float alpha, MatrixView y, bool accumulate) {
  const int outer = omp_in_parallel() ? 0 : omp_get_max_threads();
  if (outer > 1) omp_set_num_threads(1);
  const dnnl_status_t status = dnnl_sgemm('N', transpose_w ? 'T' : 'N', y.rows, y.cols, x.cols, alpha, x.data,
                                          x.ld, w.data, w.ld, accumulate ? 1.0f : 0.0f, y.data, y.ld);
  if (outer > 1) omp_set_num_threads(outer);
  return status == dnnl_success;
}
#endif

}  // namespace

std::string_view GemmLibraryName(GemmLibrary library) {
  return library == GemmLibrary::kOneDnn ? "onednn" : "eigen";
}

bool BuiltWithOneDnn() {
#ifdef ATTNSERVE_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

StatusOr<GemmLibrary> ParseGemmLibrary(std::string_view name) {
  if (name == "auto") return BuiltWithOneDnn() ? GemmLibrary::kOneDnn : GemmLibrary::kEigen;
  if (name == "eigen") return GemmLibrary::kEigen;
  if (name == "onednn") {
    if (BuiltWithOneDnn()) return GemmLibrary::kOneDnn;
    return InvalidArgumentError("cpu gemm: onednn asked, but this build has no oneDNN (configure with libdnnl-dev "
                                "installed, ATTNSERVE_ONEDNN=AUTO or ON); use auto or eigen");
  }
  return InvalidArgumentError("cpu gemm: expected auto, eigen or onednn, got '" + std::string(name) + "'");
}

std::string_view CpuIsa() { return Cap().name; }
bool CpuIsaAllowsAvx512() { return Cap().avx512; }

void GemmOnThisThread(GemmLibrary library, ConstMatrixView x, ConstMatrixView w, bool transpose_w, float alpha,
                      MatrixView y, bool accumulate) {
  if (y.rows == 0 || y.cols == 0) return;
  if (x.cols == 0) {
    if (!accumulate) AsEigen(y).setZero();
    return;
  }
#ifdef ATTNSERVE_HAVE_ONEDNN
  Cap();  // the ISA cap is set before oneDNN's first kernel
  // oneDNN refuses only malformed arguments (a stride below a row), which the views rule out;
  // should it ever refuse, Eigen computes the same product.
  // oneDNN's fixed cost per call (checks, dispatch: 2–6 µs measured for a 16×64·64×16 score
  // block, which Eigen multiplies in 0.5 µs) outweighs its speed below about 64K multiply-adds.
  constexpr int64_t kOneDnnMinMultiplyAdds = int64_t{1} << 16;
  if (library == GemmLibrary::kOneDnn && y.rows * y.cols * x.cols >= kOneDnnMinMultiplyAdds &&
      OneDnnGemm(x, w, transpose_w, alpha, y, accumulate)) {
    return;
  }
#else
  (void)library;
#endif
  EigenGemm(x, w, transpose_w, alpha, y, accumulate);
}

}  // namespace attnserve
