// spectrum_report: what the heads of real layers look like through their spectra, and what
// the low-rank form buys on them, as the markdown tables of docs/spectra.md.
//
//   spectrum_report [--source TEMPLATE] [--layers 0,1,2] [--energies 0.99,0.9] [--batch 4]
//                   [--n 128] [--repeats 15] [--threads 1] [--seed 1] [--plot-dir DIR]
//
// TEMPLATE is a layer SOURCE (docs/sources.md) with {I} standing for the layer index; the
// default is all-MiniLM-L6-v2 as scripts/fetch-model caches it. Each layer is loaded through
// the LayerStore on the CPU backend, once as it is (factored and summed forms, spectrum) and
// once per energy with lowrank=energy:E. The error of the low-rank form is measured against
// the factored form on N(0, 1) inputs (self-attention and causal, batch × n tokens). Times are
// the fastest of --repeats forwards per form on --threads CPU threads, the forms taking turns
// round by round so that a busy machine slows them alike. --plot-dir also writes each layer's
// spectra as DIR/layer-I.svg (the CLI's `layer NAME --plot` view).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "client/cli/spectrum_view.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/service/spectrum_proto.h"
#include "server/store/layer_store.h"

namespace attnserve {
namespace {

struct Args {
  std::string source;
  std::vector<int> layers = {0, 1, 2, 3, 4, 5};
  std::vector<std::string> energies = {"0.99", "0.9"};
  int64_t batch = 4, n = 128;
  int repeats = 15;
  int threads = 1;
  uint64_t seed = 1;
  std::string plot_dir;
};

std::string DefaultSource() {
  std::filesystem::path cache;
  if (const char* c = std::getenv("ATTNSERVE_CACHE"); c != nullptr && *c != '\0') {
    cache = c;
  } else {
    const char* home = std::getenv("HOME");
    cache = std::filesystem::path(home != nullptr ? home : "/root") / ".cache" / "attnserve";
  }
  return "safetensors:" + (cache / "all-minilm-l6-v2" / "model.safetensors").string() + ",arch=bert,index={I}";
}

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

[[noreturn]] void Usage(const std::string& error) {
  std::cerr << "spectrum_report: " << error << "\n"
            << "usage: spectrum_report [--source TEMPLATE] [--layers 0,1,2] [--energies 0.99,0.9] [--batch B]\n"
            << "                       [--n N] [--repeats R] [--threads T] [--seed S] [--plot-dir DIR]\n";
  std::exit(2);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  a.source = DefaultSource();
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") Usage("prints markdown tables; see bench/spectrum_report.cc");
    if (i + 1 >= argc) Usage(flag + " needs a value");
    const std::string v = argv[++i];
    try {
      if (flag == "--source") {
        a.source = v;
      } else if (flag == "--layers") {
        a.layers.clear();
        for (const auto& s : SplitComma(v)) a.layers.push_back(std::stoi(s));
      } else if (flag == "--energies") {
        a.energies = SplitComma(v);
      } else if (flag == "--batch") {
        a.batch = std::stoll(v);
      } else if (flag == "--n") {
        a.n = std::stoll(v);
      } else if (flag == "--repeats") {
        a.repeats = std::stoi(v);
      } else if (flag == "--threads") {
        a.threads = std::stoi(v);
      } else if (flag == "--seed") {
        a.seed = std::stoull(v);
      } else if (flag == "--plot-dir") {
        a.plot_dir = v;
      } else {
        Usage("unknown flag " + flag);
      }
    } catch (const std::exception&) {
      Usage(flag + ": cannot parse '" + v + "'");
    }
  }
  if (a.layers.empty() || a.energies.empty() || a.batch < 1 || a.n < 1 || a.repeats < 1 || a.threads < 1) {
    Usage("empty or non-positive value");
  }
  return a;
}

std::string SourceFor(const std::string& tmpl, int layer) {
  std::string s = tmpl;
  for (size_t at = s.find("{I}"); at != std::string::npos; at = s.find("{I}")) s.replace(at, 3, std::to_string(layer));
  return s;
}

std::string F(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::shared_ptr<const Layer> MustLoad(LayerStore& store, const std::string& name, const std::string& source) {
  auto layer = store.Load(name, source);
  if (!layer.ok()) {
    std::cerr << "spectrum_report: " << layer.status().ToString() << "\n"
              << "(for the default model, run scripts/fetch-model first)\n";
    std::exit(1);
  }
  return *layer;
}

// The inputs every form runs on: `batch` self-attention sequences of n tokens, N(0, 1), once
// without and once with the causal mask.
struct Workload {
  std::vector<std::vector<float>> inputs;
  int64_t n = 0, d = 0;
};

Workload MakeWorkload(const Args& args, int64_t d) {
  Workload w;
  w.n = args.n;
  w.d = d;
  std::mt19937_64 rng(args.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t b = 0; b < args.batch; ++b) {
    std::vector<float> x(static_cast<size_t>(args.n * d));
    for (float& v : x) v = normal(rng);
    w.inputs.push_back(std::move(x));
  }
  return w;
}

// Runs the form over the workload (causal or not); returns the outputs, one per sequence.
std::vector<std::vector<float>> Run(Backend& backend, const ResidentForm& form, const Workload& w, bool causal) {
  std::vector<std::vector<float>> outs(w.inputs.size(), std::vector<float>(w.inputs[0].size()));
  std::vector<Sequence> batch;
  for (size_t b = 0; b < w.inputs.size(); ++b) {
    Sequence s;
    s.input = ConstMatrixView(w.inputs[b].data(), w.n, w.d);
    s.causal = causal;
    s.output = MatrixView(outs[b].data(), w.n, w.d);
    batch.push_back(s);
  }
  const Status st = backend.Forward(form, batch);
  if (!st.ok()) {
    std::cerr << "spectrum_report: forward failed: " << st.ToString() << "\n";
    std::exit(1);
  }
  return outs;
}

double RelL2(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want) {
  double diff = 0, norm = 0;
  for (size_t b = 0; b < want.size(); ++b) {
    for (size_t i = 0; i < want[b].size(); ++i) {
      const double d = static_cast<double>(got[b][i]) - want[b][i];
      diff += d * d;
      norm += static_cast<double>(want[b][i]) * want[b][i];
    }
  }
  return std::sqrt(diff / norm);
}

// The fastest of `repeats` forwards of each form, in ms; the forms take turns every round.
std::vector<double> FastestMs(Backend& backend, const std::vector<const ResidentForm*>& forms, const Workload& w,
                              int repeats) {
  std::vector<double> best(forms.size(), INFINITY);
  for (const ResidentForm* f : forms) Run(backend, *f, w, false);  // warm-up
  for (int r = 0; r < repeats; ++r) {
    for (size_t i = 0; i < forms.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      Run(backend, *forms[i], w, false);
      best[i] = std::min(best[i], std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return best;
}

double FlopsPerToken(const FormWeights& f, int64_t n) {
  const SequenceShape shape{n, n, -1};
  return ForwardFlops(f, std::span<const SequenceShape>(&shape, 1)) / static_cast<double>(n);
}

std::string Triple(const HeadSpectrum& h) {
  return std::to_string(h.rank_90) + " / " + std::to_string(h.rank_99) + " / " + std::to_string(h.rank_999);
}

double Mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()); }

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  CpuBackend backend({.threads = args.threads});
  LayerStore store(&backend);
  std::vector<std::shared_ptr<const Layer>> exact;
  for (int l : args.layers) exact.push_back(MustLoad(store, "layer-" + std::to_string(l), SourceFor(args.source, l)));
  const LayerConfig& c0 = exact[0]->config;
  const int64_t k = std::min(c0.d_model, c0.d_head);

  std::cout << "<!-- spectrum_report --source '" << args.source << "' --batch " << args.batch << " --n " << args.n
            << " --seed " << args.seed << " -->\n\n";
  std::cout << "Layers: " << args.layers.size() << ", d_model " << c0.d_model << ", " << c0.heads << " heads ("
            << c0.kv_heads << " key/value), d_head " << c0.d_head << ": each head's products have " << k
            << " singular values.\n\n";

  // Per layer: the heads' ranks and stable / effective ranks, summarised.
  std::cout << "### Per layer (mean over heads; min–max in brackets)\n\n"
            << "| layer | OV r90 | OV r99 | OV r99.9 | OV stable rank | OV effective rank | QK r90 | QK r99 | QK r99.9 | "
               "QK stable rank | QK effective rank |\n"
            << "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (size_t li = 0; li < exact.size(); ++li) {
    const LayerSpectrum& s = *exact[li]->spectrum;
    std::cout << "| " << args.layers[li];
    for (const auto* side : {&s.ov, &s.qk}) {
      std::vector<double> r90, r99, r999, stable, eff;
      for (const HeadSpectrum& h : *side) {
        r90.push_back(static_cast<double>(h.rank_90));
        r99.push_back(static_cast<double>(h.rank_99));
        r999.push_back(static_cast<double>(h.rank_999));
        stable.push_back(h.stable_rank);
        eff.push_back(h.effective_rank);
      }
      for (const auto* v : {&r90, &r99, &r999, &stable, &eff}) {
        const auto [lo, hi] = std::minmax_element(v->begin(), v->end());
        std::cout << " | " << F("%.1f", Mean(*v)) << " (" << F("%.3g", *lo) << "–" << F("%.3g", *hi) << ")";
      }
    }
    std::cout << " |\n";
  }

  std::cout << "\n### Per head\n\n"
            << "r90 / r99 / r99.9: the fewest of the " << k
            << " singular directions that keep 90 / 99 / 99.9 % of Σσ². Stable rank ‖W‖_F²/σ₁²; effective rank "
               "exp(entropy of σ²/Σσ²).\n\n"
            << "| layer | head | OV σ₁ | OV ‖W‖_F | OV stable | OV effective | OV r90 / r99 / r99.9 | QK σ₁ | QK stable | "
               "QK effective | QK r90 / r99 / r99.9 |\n"
            << "|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|:---:|\n";
  for (size_t li = 0; li < exact.size(); ++li) {
    const LayerSpectrum& s = *exact[li]->spectrum;
    for (size_t i = 0; i < s.ov.size(); ++i) {
      const HeadSpectrum &ov = s.ov[i], &qk = s.qk[i];
      std::cout << "| " << args.layers[li] << " | " << i << " | " << F("%.3g", ov.singular_values[0]) << " | "
                << F("%.3g", ov.frobenius) << " | " << F("%.2f", ov.stable_rank) << " | " << F("%.1f", ov.effective_rank)
                << " | " << Triple(ov) << " | " << F("%.3g", qk.singular_values[0]) << " | "
                << F("%.2f", qk.stable_rank) << " | " << F("%.1f", qk.effective_rank) << " | " << Triple(qk) << " |\n";
    }
  }

  // The low-rank form at each energy, against the exact forms of the same layer.
  std::cout << "\n### The low-rank form\n\n"
            << "Against the factored form of the same layer: parameters, FLOPs per token (self-attention, n = "
            << args.n << "), the relative L2 error of the output on N(0, 1) inputs (" << args.batch << " × " << args.n
            << " tokens, without and with the causal mask: the worse), and the CPU time of one forward of that batch "
               "(the fastest of "
            << args.repeats << ", " << args.threads << " thread" << (args.threads > 1 ? "s" : "") << ").\n\n"
            << "| energy | layer | R = Σ r_i (of " << c0.heads * k << ") | energy kept | params vs factored | "
               "FLOPs/token vs factored | rel L2 vs factored | ms factored | ms summed | ms lowrank |\n"
            << "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (size_t li = 0; li < exact.size(); ++li) {
    const int l = args.layers[li];
    const Workload w = MakeWorkload(args, exact[li]->config.d_model);
    const ResidentForm& factored = *exact[li]->Find(Form::kFactored);
    const ResidentForm* summed = exact[li]->Find(Form::kSummed);
    const auto want_plain = Run(backend, factored, w, false), want_causal = Run(backend, factored, w, true);
    std::vector<std::shared_ptr<const Layer>> lowrank;
    std::vector<const ResidentForm*> timed = {&factored};
    if (summed != nullptr) timed.push_back(summed);
    for (const std::string& e : args.energies) {
      lowrank.push_back(MustLoad(store, "layer-" + std::to_string(l) + "-e" + e,
                                 SourceFor(args.source, l) + ",summed=false,lowrank=energy:" + e));
      timed.push_back(lowrank.back()->Find(Form::kLowRank));
    }
    const std::vector<double> ms = FastestMs(backend, timed, w, args.repeats);
    const size_t first_lowrank = summed != nullptr ? 2 : 1;
    for (size_t ei = 0; ei < args.energies.size(); ++ei) {
      const Layer& lr = *lowrank[ei];
      const ResidentForm& form = *lr.Find(Form::kLowRank);
      const double err = std::max(RelL2(Run(backend, form, w, false), want_plain), RelL2(Run(backend, form, w, true), want_causal));
      const int64_t total = std::accumulate(lr.lowrank_ranks.begin(), lr.lowrank_ranks.end(), int64_t{0});
      std::cout << "| " << args.energies[ei] << " | " << l << " | " << total << " | " << F("%.4f", lr.lowrank_kept_energy)
                << " | " << F("%.3f", static_cast<double>(form.weights().Parameters()) / factored.weights().Parameters())
                << " | " << F("%.3f", FlopsPerToken(form.weights(), args.n) / FlopsPerToken(factored.weights(), args.n))
                << " | " << F("%.3g", err) << " | " << F("%.2f", ms[0]) << " | "
                << (summed != nullptr ? F("%.2f", ms[1]) : std::string("-")) << " | " << F("%.2f", ms[first_lowrank + ei])
                << " |\n";
    }
    for (const auto& lr : lowrank) (void)store.Unload(lr->name);  // frees their forms before the next layer
  }

  if (!args.plot_dir.empty()) {
    std::filesystem::create_directories(args.plot_dir);
    for (size_t li = 0; li < exact.size(); ++li) {
      const Layer& layer = *exact[li];
      v1::LayerInfo info;
      info.set_name(layer.name);
      info.set_source(layer.source);
      info.mutable_config()->set_d_model(layer.config.d_model);
      info.mutable_config()->set_heads(layer.config.heads);
      info.mutable_config()->set_kv_heads(layer.config.kv_heads);
      info.mutable_config()->set_d_head(layer.config.d_head);
      FillSpectrumInfo(layer, &info);
      const std::string path = (std::filesystem::path(args.plot_dir) / (layer.name + ".svg")).string();
      std::ofstream(path, std::ios::binary) << cli::SpectrumSvg(info);
      std::cerr << "spectrum_report: wrote " << path << "\n";
    }
  }
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
