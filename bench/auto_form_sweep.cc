// auto_form_sweep: form auto's cost model against the clock. For each layer size it calibrates
// the model as the server does (AutoFormChooser: timed synthetic forwards, a fit per form), then
// times, interleaved in one run, the factored form, the summed form and auto (the model's choice
// plus the forward of the chosen form) on one sequence of n queries over m context rows for
// every (n, m) of the grid, and reports per cell the faster form, auto's pick, and auto's time
// over the faster form's (docs/benchmarks.md, "Form auto"); and, in the same run, how many cells
// the model would pick right without its residuals (the terms alone, CostResidual).
//
//   auto_form_sweep [--layers 384x12,768x12] [--n 1,4,16,64,256] [--m 16,64,256,1024,4096]
//                   [--reps 7] [--max-reps 200] [--min-ms 500] [--calibration-ms 1000] [--noise 0.03]
//                   [--threads 0]
//
// --layers D x H: d_model and heads (d_head = D / H, no GQA, with biases). Each variant's time is
// the best of --reps rounds (more for a short cell: up to --max-reps, until each form has run
// --min-ms) (a round runs the three in turn, in each of their 6 orders in turn,
// so that none always follows its twin's warm cache): on a shared machine the others' load only
// ever adds time, and the best is the cell's own cost, as the calibration's best of its passes
// is. A cell whose two forms differ by less than --noise (relative to the faster) is a tie: either pick is right there, and it is
// counted apart. --threads: the backend's (0: every core).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/form_cost.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/layer/loaded_layer.h"
#include "server/service/auto_form.h"

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int64_t> ParseList(const std::string& text, char sep = ',') {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(std::stoll(item));
  return out;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

double Best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

struct Args {
  std::vector<std::pair<int64_t, int64_t>> layers = {{384, 12}, {768, 12}};
  std::vector<int64_t> n = {1, 4, 16, 64, 256}, m = {16, 64, 256, 1024, 4096};
  int reps = 7;
  // Rounds a short cell may run, until each form has run min_ms: with 40 and 150 ms, a 0.2–1 ms
  // cell's best of 40 on two threads still came out 8–25 % apart for the same forward.
  int max_reps = 200;
  double min_ms = 500;
  int calibration_ms = 1000;
  double noise = 0.03;
  int threads = 0;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") {
      a.layers.clear();
      for (const std::string& item : [&] {
             std::vector<std::string> items;
             std::stringstream ss(value);
             std::string s;
             while (std::getline(ss, s, ',')) items.push_back(s);
             return items;
           }()) {
        const auto dh = ParseList(item, 'x');
        a.layers.emplace_back(dh.at(0), dh.at(1));
      }
    } else if (flag == "--n") {
      a.n = ParseList(value);
    } else if (flag == "--m") {
      a.m = ParseList(value);
    } else if (flag == "--reps") {
      a.reps = std::stoi(value);
    } else if (flag == "--max-reps") {
      a.max_reps = std::stoi(value);
    } else if (flag == "--min-ms") {
      a.min_ms = std::stod(value);
    } else if (flag == "--calibration-ms") {
      a.calibration_ms = std::stoi(value);
    } else if (flag == "--noise") {
      a.noise = std::stod(value);
    } else if (flag == "--threads") {
      a.threads = std::stoi(value);
    } else {
      std::fprintf(stderr, "auto_form_sweep: unknown flag %s (see the header of bench/auto_form_sweep.cc)\n",
                   flag.c_str());
      std::exit(2);
    }
  }
  return a;
}

struct Totals {
  int cells = 0, ties = 0, right = 0, strict_right = 0, within = 0, chosen_within = 0;
  int terms_alone_right = 0;  // the same model without its residuals (CostResidual), in the same run
  double worst = 0, worst_chosen = 0;
};

void SweepLayer(CpuBackend& backend, const Args& args, int64_t d, int64_t heads, uint64_t serial, Totals& totals) {
  StatusOr<LayerConfig> config = CompleteConfig({.d_model = d, .heads = heads});
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    std::exit(2);
  }
  auto held = std::make_shared<Layer>();
  Layer& layer = *held;
  layer.name = std::to_string(d) + "x" + std::to_string(heads);
  layer.serial = serial;
  layer.config = *config;
  const LayerWeights w = RandomLayerWeights(*config, serial);
  for (FormWeights f : {MaterializeFactored(w), MaterializeSummed(w)}) {
    const Form form = f.form;
    layer.forms.emplace(form, *backend.Upload(std::make_shared<const FormWeights>(std::move(f))));
  }
  AutoFormChooser chooser(&backend, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(args.calibration_ms)});
  const Clock::time_point t0 = Clock::now();
  const FormCostModel& model = chooser.Calibrate(layer);
  const double calibration_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::printf("\nLayer d_model %lld, %lld heads (d_head %lld): calibrated in %.0f ms (%s)\n\n", static_cast<long long>(d),
              static_cast<long long>(heads), static_cast<long long>(config->d_head), calibration_ms,
              model.measured ? "fitted" : "flop count");
  std::printf("| n | m | factored ms | summed ms | predicted factored ms | predicted summed ms | faster | auto picks "
              "| auto ms | picked / faster | auto / faster |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(static_cast<uint32_t>(serial));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n : args.n) {
    for (int64_t m : args.m) {
      std::vector<float> x(static_cast<size_t>(n * d)), c(static_cast<size_t>(m * d)), y(x.size());
      for (float& v : x) v = normal(rng);
      for (float& v : c) v = normal(rng);
      Sequence s;
      s.input = ConstMatrixView(x.data(), n, d);
      s.context = ConstMatrixView(c.data(), m, d);
      s.output = MatrixView(y.data(), n, d);
      const SequenceShape shape{.n = n, .m = m};
      auto run = [&](Form form) {
        const Clock::time_point start = Clock::now();
        if (!backend.Forward(*layer.Find(form), std::span(&s, 1)).ok()) std::abort();
        return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      };
      run(Form::kFactored);  // warm-up: first touch of this cell's buffers
      run(Form::kSummed);
      std::vector<double> tf, ts, ta;
      ExactChoice choice;
      Form picked = Form::kFactored;
      // At least --reps rounds, more for short cells (up to --max-reps, until each form has run
      // --min-ms).
      // Each round runs the three in the next of their 6 orders: a forward right after one of the
      // other form reads its weights from a cache the other form's weights evicted (28 MB of
      // summed weights at d 768), right after its own form from a warm one, so a fixed order
      // would favour whichever variant follows its twin. Cycling through every order gives each
      // variant each predecessor alike.
      std::array<int, 3> order = {0, 1, 2};
      for (int r = 0; r < args.reps || (r < args.max_reps && std::min(Sum(tf), Sum(ts)) < args.min_ms); ++r) {
        for (int variant : order) {
          if (variant == 0) tf.push_back(run(Form::kFactored));
          if (variant == 1) ts.push_back(run(Form::kSummed));
          if (variant == 2) {
            const Clock::time_point start = Clock::now();
            choice = chooser.Choose(held, std::span(&shape, 1));
            picked = choice.form;
            const double choose_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
            ta.push_back(choose_ms + run(picked));
          }
        }
        if (!std::next_permutation(order.begin(), order.end())) order = {0, 1, 2};
      }
      const double f = Best(tf), sm = Best(ts), a = Best(ta);
      const double best = std::min(f, sm);
      const Form faster = sm < f ? Form::kSummed : Form::kFactored;
      const bool tie = std::abs(f - sm) < args.noise * best;
      const double ratio = a / best;
      const double chosen = (picked == Form::kSummed ? sm : f) / best;  // 1 when the pick is the faster
      // The choice the terms alone would make: what the residuals change, measured in this run.
      FormCostModel terms_alone = model;
      for (FormCostCoefficients& c : terms_alone.by_form) c.residuals.clear();
      const Form by_terms = ChooseExactForm(terms_alone, layer.Find(Form::kFactored)->weights(),
                                            &layer.Find(Form::kSummed)->weights(), std::span(&shape, 1),
                                            backend.summed_order())
                                .form;
      totals.terms_alone_right += tie || by_terms == faster;
      ++totals.cells;
      totals.ties += tie;
      totals.right += tie || picked == faster;
      totals.strict_right += picked == faster;
      totals.within += ratio <= 1.05;
      totals.chosen_within += chosen <= 1.05;
      totals.worst = std::max(totals.worst, ratio);
      totals.worst_chosen = std::max(totals.worst_chosen, chosen);
      std::printf("| %lld | %lld | %.3f | %.3f | %.3f | %.3f | %s%s | %s | %.3f | %.3f | %.3f |\n",
                  static_cast<long long>(n), static_cast<long long>(m), f, sm, choice.predicted_seconds[0] * 1e3,
                  choice.predicted_seconds[1] * 1e3, std::string(FormName(faster)).c_str(), tie ? " (tie)" : "",
                  std::string(FormName(picked)).c_str(), a, chosen, ratio);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  const Args args = Parse(argc, argv);
  CpuBackend backend(CpuBackendOptions{.threads = args.threads});
  std::printf("auto_form_sweep on %s, %s, %d threads; best of %d rounds a cell (up to %d until each form ran %.0f ms); "
              "ties within %.0f %%\n",
              CpuModel().c_str(), backend.DeviceName().c_str(), backend.threads(), args.reps, args.max_reps, args.min_ms,
              args.noise * 100);
  Totals totals;
  uint64_t serial = 1;
  for (const auto& [d, heads] : args.layers) SweepLayer(backend, args, d, heads, serial++, totals);
  std::printf("\nCells: %d, ties (forms within %.0f %%): %d\n", totals.cells, args.noise * 100, totals.ties);
  std::printf("auto picked the faster form (a tie counts as right): %d / %d = %.1f %%\n", totals.right, totals.cells,
              100.0 * totals.right / totals.cells);
  std::printf("the same model without its residuals would have (ties right): %d / %d = %.1f %%\n",
              totals.terms_alone_right, totals.cells, 100.0 * totals.terms_alone_right / totals.cells);
  std::printf("auto picked the faster form (ties counted by their measured order): %d / %d = %.1f %%\n",
              totals.strict_right, totals.cells, 100.0 * totals.strict_right / totals.cells);
  std::printf("the picked form's time within 5 %% of the faster form's: %d / %d cells; worst picked / faster: %.3f\n",
              totals.chosen_within, totals.cells, totals.worst_chosen);
  std::printf("auto's own time (the choice and a forward, timed apart) within 5 %% of the faster form's: %d / %d "
              "cells; worst auto / faster: %.3f\n",
              totals.within, totals.cells, totals.worst);
  return 0;
}
