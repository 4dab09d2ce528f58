// skinny_gemm_bench: the CPU backend's SkinnyGemm against Eigen's general GEMM on one thread,
// x of few rows times weights as wide as a layer's fused projections, as a time ratio measured
// in the same run (docs/journal/benchmarks-journal.md, "The skinny GEMM"): the measurements behind
// SkinnyGemmPays. With --tiles, attention's two products per tile instead (docs/journal/benchmarks-journal.md,
// "Attention's own kernel"): the scores S = scale · Q Kᵀ and the mix O += P V at the tile shapes
// of the bert-base, gpt2-medium, 1×16 and long-sequence layers (d_h = 64), oneDNN's GEMM against
// the kernel the backend runs (TransposeScaled and SkinnyGemm).
//
// With --packed, the projections on weights packed once (PanelGemm) against the library on the
// row-major weights, 1 to 1024 rows (docs/journal/benchmarks-journal.md, "Weights packed once").
//
//   skinny_gemm_bench [--tiles | --packed]
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

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

using attnserve::ConstMatrixView;
using attnserve::MatrixView;

// One attention tile at d_h = 64: `rows` query rows against `keys` keys, both products timed
// with the GEMM library (oneDNN where the build has it, else Eigen, as the backend chose before)
// and with the backend's own kernel, in GFLOP/s.
void TileProducts() {
  const attnserve::GemmLibrary library = *attnserve::ParseGemmLibrary("auto");  // the backend's default
  const std::string name(attnserve::GemmLibraryName(library));
  struct Tile {
    const char* layer;
    int64_t rows, keys;
  };
  const Tile tiles[] = {{"1x16", 16, 16}, {"bert-base", 128, 128}, {"gpt2-medium", 256, 256}, {"long", 256, 512}};
  constexpr int64_t kHead = 64, kLd = 2304;  // a head's columns of Q|K|V rows, as the backend reads them
  constexpr float kScale = 0.125f;
  std::printf("%-12s %5s %5s %16s %14s %10s %16s %14s %10s\n", "tile", "rows", "keys", ("scores " + name).c_str(),
              "scores own", "own/lib", ("mix " + name).c_str(), "mix own", "own/lib");
  for (const Tile& t : tiles) {
    const RowMatrix q = RowMatrix::Random(t.rows, kLd), k = RowMatrix::Random(t.keys, kLd), v = RowMatrix::Random(t.keys, kLd);
    RowMatrix s(t.rows, t.keys), kt(kHead, t.keys), o = RowMatrix::Random(t.rows, kHead);
    const ConstMatrixView qv(q.data(), t.rows, kHead, kLd), kv(k.data(), t.keys, kHead, kLd), vv(v.data(), t.keys, kHead, kLd);
    const MatrixView sv(s.data(), t.rows, t.keys), ov(o.data(), t.rows, kHead);
    const double lib_scores = BestMs([&] { attnserve::GemmOnThisThread(library, qv, kv, /*transpose_w=*/true, kScale, sv); });
    const double own_scores = BestMs([&] {
      attnserve::TransposeScaled(kv, kScale, MatrixView(kt.data(), kHead, t.keys));
      attnserve::SkinnyGemm(qv, ConstMatrixView(kt.data(), kHead, t.keys), sv);
    });
    const double lib_mix = BestMs([&] { attnserve::GemmOnThisThread(library, sv, vv, false, 1.0f, ov, /*accumulate=*/true); });
    const double own_mix = BestMs([&] { attnserve::SkinnyGemm(sv, vv, ov, /*accumulate=*/true); });
    const double mflop = 2.0 * static_cast<double>(t.rows * t.keys * kHead) * 1e-6;  // per product: / ms = GFLOP/s
    std::printf("%-12s %5ld %5ld %16.1f %14.1f %10.2f %16.1f %14.1f %10.2f\n", t.layer, static_cast<long>(t.rows),
                static_cast<long>(t.keys), mflop / lib_scores, mflop / own_scores, lib_scores / own_scores,
                mflop / lib_mix, mflop / own_mix, lib_mix / own_mix);
  }
}

// The projections on weights packed once (PackPanels, PanelGemm) against the GEMM library on
// the row-major weights (oneDNN where the build has it, else Eigen), one thread, at the weight
// blocks of bert-base and gpt2-medium and from 1 to 1024 rows: the measurement behind
// PanelGemmPays (docs/journal/benchmarks-journal.md, "Weights packed once"). Best of 150 for each, the two
// alternated over 3 rounds.
void PackedWeightsTable() {
  const attnserve::GemmLibrary library = *attnserve::ParseGemmLibrary("auto");  // the backend's default
  const std::string name(attnserve::GemmLibraryName(library));
  struct Weights {
    const char* name;
    int64_t depth, cols, max_rows = 1024;
  };
  // The summed form's projection is x · [W_M_1 … W_M_h]: d_model × h·d_model, its rows a
  // multiple of 4 KiB apart at both widths; to 64 rows (a request's, not a batch's: 150 calls
  // of a 1024-row product of that width take minutes).
  const Weights weights[] = {{"bert W_in", 768, 2304},         {"bert W_O", 768, 768},
                             {"gpt2-m W_in", 1024, 3072},      {"gpt2-m W_O", 1024, 1024},
                             {"bert [W_M]", 768, 9216, 64},    {"gpt2-m [W_M]", 1024, 16384, 64}};
  std::printf("%-12s %5s %12s %12s %10s %5s\n", "weights", "rows", (name + " ms").c_str(), "packed ms",
              "lib/packed", "used");
  for (const Weights& wt : weights) {
    const RowMatrix w = RowMatrix::Random(wt.depth, wt.cols);
    const ConstMatrixView wv(w.data(), wt.depth, wt.cols);
    const attnserve::PackedWeights packed = attnserve::PackPanels(wv, attnserve::PanelWidth());
    const attnserve::PackedBlock block = *packed.Block(0, 0, wv.rows, wv.cols);
    for (int64_t rows : {1, 4, 16, 64, 256, 1024}) {
      if (rows > wt.max_rows) break;
      const RowMatrix x = RowMatrix::Random(rows, wt.depth);
      RowMatrix y(rows, wt.cols);
      const ConstMatrixView xv(x.data(), rows, wt.depth);
      const MatrixView yv(y.data(), rows, wt.cols);
      double lib = 1e30, own = 1e30;
      for (int round = 0; round < 3; ++round) {
        lib = std::min(lib, BestMs([&] { attnserve::GemmOnThisThread(library, xv, wv, /*transpose_w=*/false, 1.0f, yv); }));
        own = std::min(own, BestMs([&] { attnserve::PanelGemm(xv, block, yv); }));
      }
      std::printf("%-12s %5ld %12.3f %12.3f %10.2f %5s\n", wt.name, static_cast<long>(rows), lib, own, lib / own,
                  attnserve::PanelGemmPays(rows, wt.cols) ? "yes" : "no");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool tiles = argc == 2 && std::strcmp(argv[1], "--tiles") == 0;
  const bool packed = argc == 2 && std::strcmp(argv[1], "--packed") == 0;
  if (argc > 2 || (argc == 2 && !tiles && !packed)) {
    std::fprintf(stderr, "usage: skinny_gemm_bench [--tiles | --packed]   (got '%s')\n", argv[1]);
    return 2;
  }
  if (!attnserve::SkinnyGemmAvailable()) {
    std::printf("no SkinnyGemm here (not an x86-64 GCC build, or a CPU without AVX2 and FMA)\n");
    return 0;
  }
  std::printf("SkinnyGemm kernel: %s\n", std::string(attnserve::SkinnyGemmIsa()).c_str());
  Eigen::setNbThreads(1);
  if (packed) {
    std::printf("projections on weights packed in panels of %ld, one thread (best of 3 rounds of 150):\n",
                static_cast<long>(attnserve::PanelWidth()));
    PackedWeightsTable();
    return 0;
  }
  if (tiles) {
    std::printf("attention's tile products, d_h = 64, one thread, GFLOP/s (best of 150):\n");
    TileProducts();
    return 0;
  }
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
