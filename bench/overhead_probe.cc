// overhead_probe: the serving overhead of one small request, its three figures interleaved in
// bursts (docs/journal/benchmarks-journal.md, "Serving overhead"):
//   served      Forward on a real attnserve (--target), over gRPC on loopback;
//   in-process  the same forward on a CPU backend in this process, configured as the server's;
//   floor       Forward on `attnserve-cli noop-server` (--floor): gRPC and this client, nothing
//               computed;
// overhead = served − in-process − floor. serving_overhead.sh's rounds measure the three seconds
// apart, and what the shared machine gives drifts by more than the target within a minute; here
// each cycle runs a burst of each (the order rotating from cycle to cycle), a burst lasting
// milliseconds, so that the three meet the same machine. Each burst's first --warm calls are left
// out: they find the other side's threads still spinning down from the burst before. The figure
// is the median over cycles of each cycle's own difference of medians.
//
//   overhead_probe --target HOST:PORT --floor HOST:PORT [--layer demo] [--d-model 768] [--heads 12]
//                  [--seed 1] [--n 16] [--threads 2] [--weight-layout auto] [--burst 24] [--warm 4]
//                  [--cycles 80] [--json FILE]
// The in-process layer is the server's `random:d_model=D,heads=H,seed=S` (the same config and
// weights); --threads and --weight-layout must be the server's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/cli/args.h"
#include "client/client.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string target, floor, layer = "demo", weight_layout = "auto", json;
  int64_t d_model = 768, heads = 12, n = 16, threads = 2, burst = 24, warm = 4, cycles = 80;
  uint64_t seed = 1;
};

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

int Usage(const std::string& why) {
  std::cerr << "overhead_probe: " << why << "\n"
            << "usage: overhead_probe --target HOST:PORT --floor HOST:PORT [--layer demo] [--d-model 768]\n"
               "                      [--heads 12] [--seed 1] [--n 16] [--threads 2] [--weight-layout auto]\n"
               "                      [--burst 24] [--warm 4] [--cycles 80] [--json FILE]\n";
  return 2;
}

// The three targets of a cycle, each timed in microseconds a call.
enum Target { kServed, kInProcess, kFloor, kTargets };
constexpr const char* kNames[kTargets] = {"served", "in-process", "floor"};

int Main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return Usage("the serving overhead, its figures interleaved in bursts");
    if (i + 1 >= argc) return Usage(arg + " needs a value");
    const std::string value = argv[++i];
    const auto number = [&](int64_t lo, int64_t hi, int64_t* out) {
      std::string error;
      if (cli::ParseInt64(value, arg, out, &error) && *out >= lo && *out <= hi) return true;
      std::cerr << "overhead_probe: " << arg << ": expected a whole number from " << lo << " to " << hi << ", got "
                << value << "\n";
      return false;
    };
    if (arg == "--target") {
      opt.target = value;
    } else if (arg == "--floor") {
      opt.floor = value;
    } else if (arg == "--layer") {
      opt.layer = value;
    } else if (arg == "--weight-layout") {
      opt.weight_layout = value;
    } else if (arg == "--json") {
      opt.json = value;
    } else if (arg == "--d-model") {
      if (!number(1, 1 << 16, &opt.d_model)) return 2;
    } else if (arg == "--heads") {
      if (!number(1, 1024, &opt.heads)) return 2;
    } else if (arg == "--seed") {
      std::string error;
      if (!cli::ParseUint64(value, arg, &opt.seed, &error)) return Usage(error);
    } else if (arg == "--n") {
      if (!number(1, 1 << 16, &opt.n)) return 2;
    } else if (arg == "--threads") {
      if (!number(1, 1024, &opt.threads)) return 2;
    } else if (arg == "--burst") {
      if (!number(2, 100000, &opt.burst)) return 2;
    } else if (arg == "--warm") {
      if (!number(0, 100000, &opt.warm)) return 2;
    } else if (arg == "--cycles") {
      if (!number(1, 1000000, &opt.cycles)) return 2;
    } else {
      return Usage("unknown flag " + arg);
    }
  }
  if (opt.target.empty() || opt.floor.empty()) return Usage("--target and --floor are required");
  if (opt.warm >= opt.burst) return Usage("--warm must leave some of --burst measured");
  const StatusOr<WeightLayout> layout = ParseWeightLayout(opt.weight_layout);
  if (!layout.ok()) return Usage("--weight-layout: " + layout.status().message());

  // The server's random layer: the same config and seed give the same weights.
  const StatusOr<LayerConfig> config = CompleteConfig({.d_model = opt.d_model, .heads = opt.heads});
  if (!config.ok()) return Usage(config.status().message());
  CpuBackend backend({.threads = static_cast<int>(opt.threads), .weight_layout = *layout});
  auto resident =
      backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(*config, opt.seed))));
  if (!resident.ok()) return Usage("upload: " + resident.status().ToString());

  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> input(opt.n * opt.d_model), output(input.size());
  for (float& x : input) x = normal(rng);
  Sequence seq;
  seq.input = ConstMatrixView(input.data(), opt.n, opt.d_model);
  seq.output = MatrixView(output.data(), opt.n, opt.d_model);
  v1::ForwardRequest request;
  request.set_layer(opt.layer);
  request.set_form(v1::FORM_FACTORED);
  *request.mutable_input() = MakeTensor(input, {1, opt.n, opt.d_model});

  const auto options_for = [](const std::string& target) {
    ClientOptions o;
    o.target = target;
    return o;
  };
  Client served(options_for(opt.target)), floor(options_for(opt.floor));
  // One call of a target, in microseconds; the run stops at the first failure, naming it.
  const auto call = [&](Target t) -> double {
    v1::ForwardResponse response;
    const auto start = Clock::now();
    if (t == kInProcess) {
      const Status st = backend.Forward(**resident, std::span<const Sequence>(&seq, 1));
      if (!st.ok()) {
        std::cerr << "overhead_probe: in-process forward: " << st.ToString() << "\n";
        std::exit(1);
      }
    } else {
      const grpc::Status st = (t == kServed ? served : floor).Forward(request, &response);
      if (!st.ok()) {
        std::cerr << "overhead_probe: " << kNames[t] << " Forward: " << st.error_message() << "\n";
        std::exit(1);
      }
    }
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  };
  for (Target t : {kServed, kInProcess, kFloor}) {
    for (int i = 0; i < 50; ++i) call(t);  // connections made, caches and the server's scratch warm
  }

  std::vector<double> all[kTargets], differences;
  for (int64_t cycle = 0; cycle < opt.cycles; ++cycle) {
    double median[kTargets];
    for (int k = 0; k < kTargets; ++k) {
      const Target t = static_cast<Target>((cycle + k) % kTargets);  // the order rotates
      std::vector<double> burst;
      for (int64_t i = 0; i < opt.burst; ++i) {
        const double us = call(t);
        if (i >= opt.warm) burst.push_back(us);
      }
      median[t] = Median(burst);
      all[t].insert(all[t].end(), burst.begin(), burst.end());
    }
    differences.push_back(median[kServed] - median[kInProcess] - median[kFloor]);
  }

  const double overhead = Median(differences);
  std::printf("overhead_probe: %lld cycles of %lld-call bursts (first %lld of each left out), 1x%lldx%lld, "
              "%lld threads\n",
              static_cast<long long>(opt.cycles), static_cast<long long>(opt.burst),
              static_cast<long long>(opt.warm), static_cast<long long>(opt.n), static_cast<long long>(opt.d_model),
              static_cast<long long>(opt.threads));
  for (int t = 0; t < kTargets; ++t) {
    std::printf("  %-10s p50 %7.1f us  (p10 %7.1f, p90 %7.1f)\n", kNames[t], Median(all[t]), Quantile(all[t], 0.1),
                Quantile(all[t], 0.9));
  }
  std::printf("  overhead = served - in-process - floor: median of the cycles' own %.1f us (cycles' p25 %.1f, "
              "p75 %.1f)\n",
              overhead, Quantile(differences, 0.25), Quantile(differences, 0.75));
  if (!opt.json.empty()) {
    std::ofstream out(opt.json);
    out << "{\"cycles\": " << opt.cycles << ", \"burst\": " << opt.burst << ", \"warm\": " << opt.warm
        << ", \"served_p50_us\": " << Median(all[kServed]) << ", \"in_process_p50_us\": " << Median(all[kInProcess])
        << ", \"floor_p50_us\": " << Median(all[kFloor]) << ", \"overhead_us\": " << overhead
        << ", \"overhead_p25_us\": " << Quantile(differences, 0.25)
        << ", \"overhead_p75_us\": " << Quantile(differences, 0.75) << "}\n";
  }
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
