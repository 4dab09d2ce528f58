// lowrank_timing: the low-rank form against the factored form of one layer, on given inputs —
// divergence and CPU time per rank selection (docs/spectra.md, "Ranks chosen by data").
//
//   lowrank_timing --source SOURCE --inputs ROWS.npy --selection SEL [--selection SEL ...]
//                  [--n 128] [--repeats 15] [--threads 1]
//
// SOURCE is a layer SOURCE without lowrank= (docs/sources.md); each SEL is what follows
// "lowrank=" (e.g. "energy:0.9", "budget:200", "divergence:0.05,calibration=c.npy"). ROWS.npy,
// float32 [rows, d_model], is cut into self-attention sequences of n rows (the held-out inputs:
// never the calibration rows). Each selection is loaded through the LayerStore on the CPU
// backend; its output is compared with the factored form's on ROWS (relative L2 over all rows),
// and both forms are timed on the same batch (the fastest of --repeats, taking turns). Prints
// one JSON object per selection.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "client/npy.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/store/layer_store.h"

namespace attnserve {
namespace {

[[noreturn]] void Fail(const std::string& why) {
  std::cerr << "lowrank_timing: " << why << "\n"
            << "usage: lowrank_timing --source SOURCE --inputs ROWS.npy --selection SEL [--selection SEL ...]\n"
            << "                      [--n N] [--repeats R] [--threads T]\n";
  std::exit(2);
}

std::vector<float> Forward(Backend& backend, const ResidentForm& form, const std::vector<float>& x, int64_t rows,
                           int64_t d, int64_t n) {
  std::vector<float> out(x.size());
  std::vector<Sequence> batch;
  for (int64_t start = 0; start + n <= rows; start += n) {
    Sequence s;
    s.input = ConstMatrixView(x.data() + start * d, n, d);
    s.output = MatrixView(out.data() + start * d, n, d);
    batch.push_back(s);
  }
  const Status st = backend.Forward(form, batch);
  if (!st.ok()) Fail("forward: " + st.ToString());
  return out;
}

int Main(int argc, char** argv) {
  std::string source, inputs;
  std::vector<std::string> selections;
  int64_t n = 128;
  int repeats = 15, threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--source")
      source = v;
    else if (flag == "--inputs")
      inputs = v;
    else if (flag == "--selection")
      selections.push_back(v);
    else if (flag == "--n")
      n = std::stoll(v);
    else if (flag == "--repeats")
      repeats = std::stoi(v);
    else if (flag == "--threads")
      threads = std::stoi(v);
    else
      Fail("unknown flag " + flag);
  }
  if (source.empty() || inputs.empty() || selections.empty() || n < 1 || repeats < 1) Fail("missing flags");
  NpyArray rows_npy;
  if (grpc::Status st = ReadNpy(inputs, &rows_npy); !st.ok()) Fail(st.error_message());
  if (rows_npy.shape.size() != 2) Fail("--inputs: expected [rows, d_model]");
  const int64_t d = rows_npy.shape[1];
  const int64_t rows = rows_npy.shape[0] / n * n;
  if (rows == 0) Fail("--inputs: fewer rows than --n");

  CpuBackend backend({.threads = threads});
  LayerStore store(&backend);
  auto exact = store.Load("exact", source + ",summed=false");
  if (!exact.ok()) Fail(exact.status().ToString());
  const ResidentForm& factored = *(*exact)->Find(Form::kFactored);
  const std::vector<float> want = Forward(backend, factored, rows_npy.data, rows, d, n);
  for (size_t si = 0; si < selections.size(); ++si) {
    auto layer =
        store.Load("lowrank-" + std::to_string(si), source + ",summed=false,spectrum=true,lowrank=" + selections[si]);
    if (!layer.ok()) Fail(layer.status().ToString());
    const Layer& l = **layer;
    const ResidentForm& lowrank = *l.Find(Form::kLowRank);
    const std::vector<float> got = Forward(backend, lowrank, rows_npy.data, rows, d, n);
    double diff = 0, norm = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      diff += (double{got[j]} - want[j]) * (double{got[j]} - want[j]);
      norm += double{want[j]} * want[j];
    }
    double best[2] = {INFINITY, INFINITY};
    const ResidentForm* forms[2] = {&factored, &lowrank};
    for (int r = 0; r <= repeats; ++r) {
      for (int f = 0; f < 2; ++f) {
        const auto t0 = std::chrono::steady_clock::now();
        Forward(backend, *forms[f], rows_npy.data, rows, d, n);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) best[f] = std::min(best[f], ms);  // round 0 warms up
      }
    }
    const int64_t total = std::accumulate(l.lowrank_ranks.begin(), l.lowrank_ranks.end(), int64_t{0});
    std::string ranks;
    for (int64_t r : l.lowrank_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    std::printf(
        "{\"selection\": \"%s\", \"ranks\": [%s], \"total_rank\": %lld, \"kept_energy\": %.6g, "
        "\"calibration_divergence\": %.9g, \"divergence\": %.9g, \"ms_factored\": %.4f, \"ms_lowrank\": %.4f, "
        "\"rows\": %lld, \"n\": %lld}\n",
        l.lowrank_selection.c_str(), ranks.c_str(), static_cast<long long>(total), l.lowrank_kept_energy,
        l.lowrank_calibration_divergence, std::sqrt(diff / norm), best[0], best[1], static_cast<long long>(rows),
        static_cast<long long>(n));
    (void)store.Unload(l.name);
  }
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
