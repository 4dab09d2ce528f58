// skinny_gemm_bench: the CPU backend's SkinnyGemm against Eigen's general GEMM on one thread,
// x of few rows times weights as wide as a layer's fused projections, as a time ratio measured
// in the same run (docs/benchmarks.md, "The skinny GEMM"): the measurements behind
// SkinnyGemmPays.
//
//   skinny_gemm_bench
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "server/backend/cpu/skinny_gemm.h"

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Best of many runs: the machine is shared, the minimum is the least disturbed.
template <class F>
double BestMs(F f) {
  double best = 1e30;
  for (int r = 0; r < 150; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  using attnserve::ConstMatrixView;
  using attnserve::MatrixView;
  if (!attnserve::SkinnyGemmAvailable()) {
    std::printf("no SkinnyGemm here (not an x86-64 GCC build, or a CPU without AVX2 and FMA)\n");
    return 0;
  }
  std::printf("SkinnyGemm kernel: %s\n", std::string(attnserve::SkinnyGemmIsa()).c_str());
  Eigen::setNbThreads(1);
  // The weight blocks a request multiplies: fused W_Q|W_K|W_V and W_O of the factored form,
  // and the summed form's value block (h·d wide), at BERT-base and GPT-2-medium widths.
  struct Weights {
    const char* name;
    int64_t depth, cols, ld;
  };
  const Weights weights[] = {{"bert W_in", 768, 2304, 2304},       {"bert W_O", 768, 768, 768},
                             {"bert summed W_M", 768, 9216, 10752}, {"gpt2-m W_in", 1024, 3072, 3072},
                             {"gpt2-m W_O", 1024, 1024, 1024},      {"gpt2-m summed W_M", 1024, 16384, 18432}};
  const bool onednn = attnserve::BuiltWithOneDnn();
  std::printf("%-18s %5s %10s %10s %10s %14s %15s %5s\n", "weights", "rows", "eigen ms", "onednn ms", "skinny ms",
              "eigen/skinny", "onednn/skinny", "used");
  for (const Weights& wt : weights) {
    for (int64_t rows : {1, 2, 4, 8, 12, 16, 32}) {
      const RowMatrix x = RowMatrix::Random(rows, wt.depth), w = RowMatrix::Random(wt.depth, wt.ld);
      RowMatrix y1(rows, wt.cols), y2(rows, wt.cols);
      const ConstMatrixView wv(w.data(), wt.depth, wt.cols, wt.ld);
      const double eigen = BestMs([&] {
        y1.noalias() = x * Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>(w.data(), wt.depth, wt.cols,
                                                                                Eigen::OuterStride<>(wt.ld));
      });
      const double dnnl = onednn ? BestMs([&] {
        attnserve::GemmOnThisThread(attnserve::GemmLibrary::kOneDnn, ConstMatrixView(x.data(), rows, wt.depth), wv,
                                    /*transpose_w=*/false, 1.0f, MatrixView(y1.data(), rows, wt.cols));
      })
                                 : 0.0;
      const double skinny = BestMs([&] {
        attnserve::SkinnyGemm(ConstMatrixView(x.data(), rows, wt.depth), wv, MatrixView(y2.data(), rows, wt.cols));
      });
      // "used": whether the backend would run SkinnyGemm here with its default library.
      const bool used = attnserve::UseSkinnyGemm(onednn ? attnserve::GemmLibrary::kOneDnn : attnserve::GemmLibrary::kEigen,
                                                 rows, wt.cols);
      std::printf("%-18s %5ld %10.3f %10.3f %10.3f %14.2f %15.2f %5s\n", wt.name, static_cast<long>(rows), eigen, dnnl,
                  skinny, eigen / skinny, onednn ? dnnl / skinny : 0.0, used ? "yes" : "no");
    }
  }
  return 0;
}
