// forward_bench: both forms of the CPU backend at reference shapes, reported as GFLOP/s and as
// a ratio to a large Eigen SGEMM of the same build measured in the same run (the machine is
// shared and noisy, so only ratios measured together mean much).
//
//   forward_bench [--device cpu|cuda[:N]] [--tf32] [--threads 1,2] [--min-time-s 0.5]
//                 [--json FILE] [--shapes a,b]
// On a GPU the ceiling is a cuBLAS SGEMM and the times include the host-device copies.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#ifdef ATTNSERVE_HAVE_CUDA
#include "server/backend/cuda/cuda_backend.h"
#endif

namespace attnserve {
namespace {

struct BenchShape {
  std::string name;
  int64_t batch, n, d_model, heads;
};

const BenchShape kShapes[] = {
    {"bert-base", 8, 128, 768, 12},
    {"gpt2-medium", 4, 256, 1024, 16},
    {"small-request", 1, 16, 768, 12},
    {"large", 32, 512, 1024, 16},  // GPU-sized; run on the CPU only when asked by --shapes
};

struct Record {
  std::string shape, form, device;
  int threads;
  double ms, gflops, ceiling_gflops;
};

struct Options {
  std::vector<int> threads = {1, 2};
  double min_time_s = 0.5;
  std::string json;
  std::vector<std::string> shapes;
  std::string device = "cpu";
  bool tf32 = false;
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

// Median seconds of `fn` over repetitions lasting at least min_time_s (and 5 runs).
template <typename Fn>
double MedianSeconds(Fn fn, double min_time_s) {
  fn();  // warm caches, allocate scratch
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (times.size() < 5 || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < min_time_s) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// The GEMM ceiling: a large square SGEMM through the same Eigen build and thread count.
double GemmCeilingGflops(int threads, double min_time_s) {
  // Eigen's own threading for a large square GEMM (where it does well), then back off: the
  // backend splits its GEMMs itself and expects Eigen single-threaded.
  struct RestoreThreads {
    int previous = Eigen::nbThreads();
    ~RestoreThreads() { Eigen::setNbThreads(previous); }
  } restore;
  Eigen::setNbThreads(threads);
  const int64_t k = 2048;
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMatrix a = RowMatrix::Random(k, k), b = RowMatrix::Random(k, k), c(k, k);
  const double s = MedianSeconds([&] { c.noalias() = a * b; }, min_time_s);
  return 2.0 * k * k * k / s * 1e-9;
}

StatusOr<std::unique_ptr<Backend>> MakeBenchBackend(const Options& opt, int threads) {
  if (opt.device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(CpuBackendOptions{.threads = threads}));
#ifdef ATTNSERVE_HAVE_CUDA
  if (opt.device.rfind("cuda", 0) == 0) {
    const int device = opt.device.size() > 5 ? std::atoi(opt.device.c_str() + 5) : 0;
    return MakeCudaBackend({.device = device, .tf32 = opt.tf32});
  }
#endif
  return InvalidArgumentError("--device: expected cpu or cuda[:N] (when built with CUDA), got " + opt.device);
}

StatusOr<double> CeilingGflops(const Options& opt, int threads) {
  if (opt.device == "cpu") return GemmCeilingGflops(threads, opt.min_time_s);
#ifdef ATTNSERVE_HAVE_CUDA
  const int device = opt.device.size() > 5 ? std::atoi(opt.device.c_str() + 5) : 0;
  return CudaSgemmGflops({.device = device, .tf32 = opt.tf32}, 8192);
#else
  return InvalidArgumentError("no CUDA in this build");
#endif
}

std::vector<Record> RunShape(const BenchShape& shape, Backend& backend, int threads, double ceiling,
                             double min_time_s) {
  const LayerConfig config = *CompleteConfig({.d_model = shape.d_model, .heads = shape.heads});
  const LayerWeights weights = RandomLayerWeights(config, 1);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> input(shape.batch * shape.n * shape.d_model), output(input.size());
  for (float& x : input) x = normal(rng);
  std::vector<Sequence> batch;
  std::vector<SequenceShape> shapes;
  for (int64_t r = 0; r < shape.batch; ++r) {
    Sequence s;
    s.input = ConstMatrixView(input.data() + r * shape.n * shape.d_model, shape.n, shape.d_model);
    s.output = MatrixView(output.data() + r * shape.n * shape.d_model, shape.n, shape.d_model);
    batch.push_back(s);
    shapes.push_back({.n = shape.n, .m = shape.n});
  }
  std::vector<Record> records;
  for (Form form : {Form::kFactored, Form::kSummed}) {
    auto f = std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(weights)
                                                                         : MaterializeSummed(weights));
    auto resident = backend.Upload(f);
    if (!resident.ok()) {
      std::cerr << "forward_bench: upload: " << resident.status().ToString() << "\n";
      std::exit(1);
    }
    const double s = MedianSeconds(
        [&] {
          Status st = backend.Forward(**resident, batch);
          if (!st.ok()) {
            std::cerr << st.ToString() << "\n";
            std::exit(1);
          }
        },
        min_time_s);
    const double gflops = ForwardFlops(*f, shapes) / s * 1e-9;
    records.push_back({shape.name, std::string(FormName(form)), backend.DeviceName(), threads, s * 1e3, gflops, ceiling});
  }
  return records;
}

std::string ShapeLabel(const std::string& name) {
  for (const auto& s : kShapes) {
    if (s.name == name) {
      return name + " (" + std::to_string(s.batch) + "x" + std::to_string(s.n) + ", d=" + std::to_string(s.d_model) +
             ", h=" + std::to_string(s.heads) + ")";
    }
  }
  return name;
}

void WriteJson(const std::string& path, const std::vector<Record>& records) {
  std::ofstream out(path);
  out << "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    char line[512];
    std::snprintf(line, sizeof line,
                  "  {\"shape\": \"%s\", \"form\": \"%s\", \"device\": \"%s\", \"threads\": %d, \"ms\": %.4f, "
                  "\"gflops\": %.2f, \"ceiling_gflops\": %.2f, \"ratio_to_ceiling\": %.4f}%s\n",
                  r.shape.c_str(), r.form.c_str(), r.device.c_str(), r.threads, r.ms, r.gflops, r.ceiling_gflops,
                  r.gflops / r.ceiling_gflops, i + 1 < records.size() ? "," : "");
    out << line;
  }
  out << "]\n";
}

int Usage(const char* why) {
  std::cerr << "forward_bench: " << why << "\n"
            << "usage: forward_bench [--device cpu|cuda[:N]] [--tf32] [--threads 1,2] [--min-time-s 0.5]\n"
               "                     [--json FILE] [--shapes bert-base,gpt2-medium,small-request,large]\n";
  return 2;
}

int Main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return Usage("both forms at reference shapes, as ratios to a GEMM ceiling");
    if (arg == "--tf32") {
      opt.tf32 = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(("missing value for " + arg).c_str());
    const std::string value = argv[++i];
    if (arg == "--threads") {
      opt.threads.clear();
      for (const auto& t : Split(value)) opt.threads.push_back(std::atoi(t.c_str()));
      if (std::any_of(opt.threads.begin(), opt.threads.end(), [](int t) { return t < 1; })) {
        return Usage("--threads: expected positive integers, e.g. 1,2");
      }
    } else if (arg == "--min-time-s") {
      opt.min_time_s = std::atof(value.c_str());
    } else if (arg == "--json") {
      opt.json = value;
    } else if (arg == "--device") {
      opt.device = value;
    } else if (arg == "--shapes") {
      opt.shapes = Split(value);
    } else {
      return Usage(("unknown flag " + arg).c_str());
    }
  }
  std::vector<Record> records;
  std::printf("%-38s %-9s %7s %9s %9s %9s %7s\n", "shape", "form", "threads", "ms", "GFLOP/s", "ceiling", "ratio");
  const bool on_cpu = opt.device == "cpu";
  if (!on_cpu) opt.threads = {1};  // host threads do not matter to a GPU
  for (int threads : opt.threads) {
    auto backend = MakeBenchBackend(opt, threads);
    if (!backend.ok()) {
      std::cerr << "forward_bench: " << backend.status().ToString() << "\n";
      return 1;
    }
    // The ceiling is taken before and after the cases; the larger is used, so drift in the
    // machine's load cannot flatter the ratios.
    auto before = CeilingGflops(opt, threads);
    if (!before.ok()) {
      std::cerr << "forward_bench: ceiling: " << before.status().ToString() << "\n";
      return 1;
    }
    std::vector<Record> group;
    for (const auto& shape : kShapes) {
      const bool asked = std::find(opt.shapes.begin(), opt.shapes.end(), shape.name) != opt.shapes.end();
      const bool by_default = shape.name != "large" || !on_cpu;
      if (opt.shapes.empty() ? !by_default : !asked) continue;
      for (auto& r : RunShape(shape, **backend, threads, *before, opt.min_time_s)) group.push_back(r);
    }
    const auto after = CeilingGflops(opt, threads);
    const double ceiling = std::max(*before, after.ok() ? *after : 0.0);
    for (auto& r : group) {
      r.ceiling_gflops = ceiling;
      std::printf("%-38s %-9s %7d %9.3f %9.1f %9.1f %7.3f\n", ShapeLabel(r.shape).c_str(), r.form.c_str(), r.threads,
                  r.ms, r.gflops, r.ceiling_gflops, r.gflops / r.ceiling_gflops);
      records.push_back(r);
    }
  }
  std::printf("\nsummed / factored time:\n");
  for (size_t i = 0; i + 1 < records.size(); i += 2) {
    std::printf("  %-14s threads=%d  %.2fx\n", records[i].shape.c_str(), records[i].threads,
                records[i + 1].ms / records[i].ms);
  }
  if (!opt.json.empty()) WriteJson(opt.json, records);
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
