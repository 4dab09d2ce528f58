// forward_bench: both forms of the CPU backend at reference shapes, reported as GFLOP/s and as
// a ratio to the best SGEMM this machine has, measured in the same run (the machine is shared
// and noisy, so only ratios measured together mean much).
//
//   forward_bench [--device cpu|cuda[:N]] [--tf32 | --gpu-math MODE] [--threads 1,2] [--min-time-s 0.5]
//                 [--json FILE] [--shapes a,b] [--gemm auto,eigen,onednn] [--weight-layout auto,plain]
// --gemm runs the CPU backend with each GEMM library in turn (gemm.h), against one ceiling;
// --weight-layout with its weights packed (auto: where its own kernel runs; packed-bf16 as bfloat16;
// packed-bf16-dot with the projections' inputs in bfloat16 too, on vdpbf16ps; packed-fp16 as IEEE half)
// and row-major (plain) in turn (packed_weights.h; the JSON's `weights` says which ran);
// --summed-order auto,project-first,mix-first the summed form in each association order (the cross-*
// shapes sweep n/m); --value-group-mib N the summed form's value groups (CpuBackendOptions::
// summed_value_group_bytes; 0: one sequence a group). GFLOP/s count what the backend ran
// (Backend::Flops). --forms factored (or summed) runs one form; --idle-us N pauses N µs before
// each timed call, as a server idles between lone requests (the compute team's helpers sleep,
// the cores go idle, the caches cool), so that the in-process time can be compared with a
// served one on equal terms; --no-ceiling times the forwards alone (no SGEMM ceiling: ratios 0),
// in a second rather than ten, for a figure taken between served runs (serving_overhead.sh).
// --staging-slice-kib 4096,1048576 runs the CUDA backend with each size of copy slice in turn
// (CudaBackendOptions::staging_slice_bytes; a slice past the batch is one copy each way, as before
// slicing), --staging-threads 1,4 with each number of host threads packing and unpacking them
// (staging_threads); every pair of the two, labelled in the gemm column. --gemm-attention runs the
// CUDA backend's attention as GEMMs around the softmax kernel instead of the fused kernel
// (CudaBackendOptions::gemm_attention), labelled cublas-gemm-attention. --gpu-graphs N replays a
// CUDA graph for each batch of at most N rows (CudaBackendOptions::graph_rows; the warm-up call
// captures it), labelled cublas-graphs. Before a backend is timed, both forms answer a check batch
// against float64 (accuracy_check.h), within 10 units of the math's rounding or --accuracy-bound
// X; past it the benchmark stops, exit status 1, timing nothing.
// The CPU ceiling is the fastest of every SGEMM library the build found (Eigen always; oneDNN
// and BLIS when present), each on its own threading, at 2048³ and at each benchmarked layer's
// own projection shapes ([tokens, d]·[d, 3d] and [tokens, d]·[d, d]); `ceiling_source` names the
// library and shape. On a GPU the ceiling is a cuBLAS SGEMM and the times include the
// host-device copies; a second table splits each call (Backend::LastDeviceTimes: the inputs'
// copy, the compute, the outputs' copy, the host's share) and gives the compute's own GFLOP/s
// and ratio, which the JSON carries as device_ms, inputs_ms, outputs_ms, device_gflops and
// device_ratio_to_ceiling (compare.py sets device_ms beside PyTorch's device-only time).
//
//   forward_bench --sweep long [--lengths 512,2048,8192,16384] [--threads 2] [--json FILE] [--summed-order auto,mix-first]
// The long-sequence sweep: n = L for a BERT-base-width layer and a LLaMA-like one (d 2048, 16
// heads, 4 KV heads, causal, RoPE), both forms: time, GFLOP/s (the visible scores only, for a
// causal layer) and the peak RSS growth of one call, measured around a fresh backend's first
// call in a child process (the memory the tiled attention needs, against n · L · heads scores it
// never holds); the time is measured in this process, under glibc's default allocator.
#include <malloc.h>
#include <omp.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/accuracy_check.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/gemm.h"
#include "server/backend/cuda/cuda_backend.h"  // Math, CudaBackendOptions: no CUDA header
#include "server/core/forms.h"
#include "server/core/layer.h"
#ifdef ATTNSERVE_HAVE_CUDA
#include "bench/cuda_sgemm_ceiling.h"
#endif
#ifdef ATTNSERVE_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif
#ifdef ATTNSERVE_HAVE_BLIS
#include <blis.h>
#endif

namespace attnserve {
namespace {

struct BenchShape {
  std::string name;
  int64_t batch, n, d_model, heads;
  int64_t m = 0;  // keys of a separate context (cross-attention); 0: self-attention over the n
  bool by_default = true;
};

const BenchShape kShapes[] = {
    {"bert-base", 8, 128, 768, 12},
    {"gpt2-medium", 4, 256, 1024, 16},
    {"small-request", 1, 16, 768, 12},
    {"large", 32, 512, 1024, 16, 0, false},  // GPU-sized; on the CPU only when asked by --shapes
    // The batch a busy server forms from 1×16 requests at concurrency 32 (about 22 of them,
    // docs/journal/benchmarks-journal.md, "Serving overhead"): what that batch costs in-process.
    {"small-batch", 22, 16, 768, 12, 0, false},
    // A 1×16 request to gpt2-medium's layer: its weights' rows lie 4 KiB apart, where packing
    // them once pays most (docs/journal/benchmarks-journal.md, "Weights packed once"); asked by --shapes.
    {"gpt2-request", 1, 16, 1024, 16, 0, false},
    // The summed form's association order against n/m (cross-attention over 512 keys): asked by
    // --shapes, with --summed-order auto,project-first.
    {"cross-8x512", 1, 8, 768, 12, 512, false},
    {"cross-64x512", 1, 64, 768, 12, 512, false},
    {"cross-256x512", 1, 256, 768, 12, 512, false},
    {"cross-448x512", 1, 448, 768, 12, 512, false},
    {"cross-512x512", 1, 512, 768, 12, 512, false},
};

struct Record {
  std::string shape, form, device;
  int threads;
  double ms, gflops, ceiling_gflops;
  std::string ceiling_source, gemm;  // gemm: the backend's GEMM library (cublas on a GPU)
  std::string weights = "plain";     // packed or plain: how the CPU backend held the weights
  // On a GPU, the medians of each part of a call (Backend::LastDeviceTimes): the copies in and
  // out, and the compute alone, which is what PyTorch's device-only figure times.
  std::optional<DeviceTimes> split;
};

struct Options {
  std::vector<int> threads = {1, 2};
  double min_time_s = 0.5;
  double accuracy_bound = 0;  // --accuracy-bound; 0: AccuracyBound(the backend's math)
  std::string json;
  std::vector<std::string> shapes;
  std::string device = "cpu";
  std::vector<std::string> gemms = {"auto"};  // the CPU backend's GEMM libraries to run, in turn
  std::vector<std::string> summed_orders = {"auto"};  // auto, project-first, mix-first: in turn
  std::vector<std::string> weight_layouts = {"auto"};  // auto, packed, plain: in turn
  int64_t value_group_bytes = CpuBackendOptions{}.summed_value_group_bytes;  // --value-group-mib
  std::vector<Form> forms = {Form::kFactored, Form::kSummed};                 // --forms (a profile of one)
  int64_t idle_us = 0;  // --idle-us: a pause before each timed call, as between served requests
  bool ceiling = true;  // --no-ceiling: the forwards alone (ceiling 0), seconds instead of ten
  Math math = Math::kFp32;  // --gpu-math (--tf32: tf32): CudaBackendOptions::math
  bool gemm_attention = false;    // --gemm-attention: CudaBackendOptions::gemm_attention
  int graph_rows = 0;             // --gpu-graphs: CudaBackendOptions::graph_rows
  // --staging-slice-kib: the CUDA backend's staging slices (CudaBackendOptions::
  // staging_slice_bytes) to run in turn; empty: its default alone.
  std::vector<int64_t> staging_slice_kib;
  std::vector<int64_t> staging_threads;  // --staging-threads: CudaBackendOptions::staging_threads, in turn
  std::string sweep;                                     // "long": the long-sequence sweep
  std::vector<int64_t> lengths = {512, 2048, 8192, 16384};  // its n = L
  std::string rss_point;  // internal: one point's RSS growth in a child process (RssPointMain)
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

// "4096,1048576": whole numbers in [lo, hi], appended to `out`; false at the first that is not.
bool ParseCounts(const std::string& list, int64_t lo, int64_t hi, std::vector<int64_t>* out) {
  for (const std::string& item : Split(list)) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || v < lo || v > hi) return false;
    out->push_back(v);
  }
  return true;
}

// Median seconds of `fn` over repetitions lasting at least min_time_s (and 5 runs), with
// `idle_us` of sleep before each (untimed): a served request's pause between calls, in which
// the compute team's helpers go to sleep and the caches cool (--idle-us).
template <typename Fn>
double MedianSeconds(Fn fn, double min_time_s, int64_t idle_us = 0) {
  fn();  // warm caches, allocate scratch
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (times.size() < 5 || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < min_time_s) {
    if (idle_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// One SGEMM library on its own threading: c[m, n] = a[m, k] · b[k, n], row-major.
struct GemmLibraryUnderTest {
  std::string name;
  void (*multiply)(const RowMatrix& a, const RowMatrix& b, RowMatrix& c, int threads);
};

void EigenMultiply(const RowMatrix& a, const RowMatrix& b, RowMatrix& c, int threads) {
  // Eigen's own threading (it does well on large GEMMs), then back off: the backend splits its
  // GEMMs itself and expects Eigen single-threaded.
  const int previous = Eigen::nbThreads();
  Eigen::setNbThreads(threads);
  c.noalias() = a * b;
  Eigen::setNbThreads(previous);
}

#ifdef ATTNSERVE_HAVE_ONEDNN
void OneDnnMultiply(const RowMatrix& a, const RowMatrix& b, RowMatrix& c, int threads) {
  const int previous = omp_get_max_threads();
  omp_set_num_threads(threads);  // oneDNN's OpenMP threading reads the caller's setting
  dnnl_sgemm('N', 'N', a.rows(), b.cols(), a.cols(), 1.0f, a.data(), a.cols(), b.data(), b.cols(), 0.0f, c.data(),
             c.cols());
  omp_set_num_threads(previous);
}
#endif

#ifdef ATTNSERVE_HAVE_BLIS
void BlisMultiply(const RowMatrix& a, const RowMatrix& b, RowMatrix& c, int threads) {
  rntm_t rntm = BLIS_RNTM_INITIALIZER;
  bli_rntm_set_num_threads(threads, &rntm);
  float one = 1.0f, zero = 0.0f;
  bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, a.rows(), b.cols(), a.cols(), &one, const_cast<float*>(a.data()),
               a.cols(), 1, const_cast<float*>(b.data()), b.cols(), 1, &zero, c.data(), c.cols(), 1, nullptr, &rntm);
}
#endif

std::vector<GemmLibraryUnderTest> CeilingLibraries() {
  std::vector<GemmLibraryUnderTest> out = {{"eigen", EigenMultiply}};
#ifdef ATTNSERVE_HAVE_ONEDNN
  out.push_back({"onednn", OneDnnMultiply});
#endif
#ifdef ATTNSERVE_HAVE_BLIS
  out.push_back({"blis", BlisMultiply});
#endif
  return out;
}

struct GemmShape {
  int64_t m, k, n;
  std::string Label() const { return std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n); }
};

// A rate over the ceiling's; 0 when no ceiling was measured (--no-ceiling).
double Ratio(double gflops, double ceiling_gflops) { return ceiling_gflops > 0 ? gflops / ceiling_gflops : 0.0; }

struct Ceiling {
  double gflops = 0;
  std::string source;  // "onednn 2048x2048x2048"
  GemmShape shape;
  const GemmLibraryUnderTest* library = nullptr;
};

double GemmGflops(const GemmLibraryUnderTest& library, const GemmShape& shape, int threads, double min_time_s) {
  // Random operands: zeros would draw less power and flatter the figure.
  const RowMatrix a = RowMatrix::Random(shape.m, shape.k), b = RowMatrix::Random(shape.k, shape.n);
  RowMatrix c(shape.m, shape.n);
  const double s = MedianSeconds([&] { library.multiply(a, b, c, threads); }, min_time_s);
  return 2.0 * shape.m * shape.k * shape.n / s * 1e-9;
}

// The fastest of every library at every shape, printed as a table as it goes.
Ceiling BestGemm(const std::vector<GemmLibraryUnderTest>& libraries, const std::vector<GemmShape>& shapes, int threads,
                 double min_time_s) {
  Ceiling best;
  std::printf("SGEMM ceiling candidates, %d thread(s), GFLOP/s:\n  %-16s", threads, "M x K x N");
  for (const auto& library : libraries) std::printf(" %9s", library.name.c_str());
  std::printf("\n");
  for (const GemmShape& shape : shapes) {
    std::printf("  %-16s", shape.Label().c_str());
    for (const auto& library : libraries) {
      const double gflops = GemmGflops(library, shape, threads, min_time_s);
      std::printf(" %9.1f", gflops);
      if (gflops > best.gflops) best = {gflops, library.name + " " + shape.Label(), shape, &library};
    }
    std::printf("\n");
  }
  std::fflush(stdout);
  return best;
}

StatusOr<std::unique_ptr<Backend>> MakeBenchBackend(const Options& opt, int threads, const std::string& gemm,
                                                    const std::string& summed_order,
                                                    const std::string& weight_layout = "auto",
                                                    int64_t staging_slice_kib = 0, int64_t staging_threads = 0) {
  if (opt.device == "cpu") {
    ATTNSERVE_ASSIGN_OR_RETURN(const GemmLibrary library, ParseGemmLibrary(gemm));
    ATTNSERVE_ASSIGN_OR_RETURN(const WeightLayout layout, ParseWeightLayout(weight_layout));
    using Order = CpuBackendOptions::SummedOrderChoice;
    const Order order = summed_order == "project-first" ? Order::kProjectFirst
                        : summed_order == "mix-first"   ? Order::kMixFirst
                                                        : Order::kAuto;
    if (order == Order::kAuto && summed_order != "auto") {
      return InvalidArgumentError("--summed-order: expected auto, project-first or mix-first, got " + summed_order);
    }
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(CpuBackendOptions{
        .threads = threads,
        .gemm = library,
        .weight_layout = layout,
        .summed_order = order,
        .summed_value_group_bytes = opt.value_group_bytes}));
  }
#ifdef ATTNSERVE_HAVE_CUDA
  if (opt.device.rfind("cuda", 0) == 0) {
    const int device = opt.device.size() > 5 ? std::atoi(opt.device.c_str() + 5) : 0;
    CudaBackendOptions options{
        .device = device, .math = opt.math, .gemm_attention = opt.gemm_attention, .graph_rows = opt.graph_rows};
    if (staging_slice_kib > 0) options.staging_slice_bytes = staging_slice_kib << 10;
    if (staging_threads > 0) options.staging_threads = static_cast<int>(staging_threads);
    return MakeCudaBackend(options);
  }
#endif
  (void)staging_slice_kib;
  (void)staging_threads;
  return InvalidArgumentError("--device: expected cpu or cuda[:N] (when built with CUDA), got " + opt.device);
}

// The ceiling for `threads`: on the CPU the best library at 2048³ and at the projection shapes
// of the benchmarked layers; on a GPU a cuBLAS SGEMM.
StatusOr<Ceiling> MeasureCeiling(const Options& opt, int threads, const std::vector<GemmLibraryUnderTest>& libraries,
                                 const std::vector<GemmShape>& shapes) {
  if (opt.device == "cpu") return BestGemm(libraries, shapes, threads, opt.min_time_s);
#ifdef ATTNSERVE_HAVE_CUDA
  const int device = opt.device.size() > 5 ? std::atoi(opt.device.c_str() + 5) : 0;
  // The SGEMM's, in TF32 under tf32; under bf16 and fp16 still the float32 SGEMM (no 16-bit
  // ceiling is measured): their ratios say how far 16-bit weights move past float32's.
  const bool tf32 = opt.math == Math::kTf32;
  ATTNSERVE_ASSIGN_OR_RETURN(auto gflops, CudaSgemmGflops({.device = device, .math = opt.math}, 8192));
  std::string source = tf32 ? "cublas-tf32 8192x8192x8192" : "cublas 8192x8192x8192";
  if (HalfWeights(opt.math)) source += ", forwards in " + std::string(MathName(opt.math));
  return Ceiling{gflops, source, {8192, 8192, 8192}, nullptr};
#else
  (void)threads, (void)libraries, (void)shapes;
  return InvalidArgumentError("no CUDA in this build");
#endif
}

// One configuration of the backend the benchmark runs in turn: a GEMM library, a weight layout
// and a summed order (the CPU backend's), a copy slice and a number of packing threads (the CUDA
// backend's; 0: its default).
struct BackendVariant {
  std::string gemm, layout, order;
  int64_t staging_slice_kib = 0, staging_threads = 0;
};

// Every combination of the variants the flags ask for, in the order the tables list them.
std::vector<BackendVariant> BackendVariants(const Options& opt, bool on_cpu) {
  const std::vector<std::string> layouts = on_cpu ? opt.weight_layouts : std::vector<std::string>{"auto"};
  const auto or_default = [](const std::vector<int64_t>& asked) {
    return asked.empty() ? std::vector<int64_t>{0} : asked;
  };
  std::vector<BackendVariant> variants;
  for (const std::string& gemm : opt.gemms) {
    for (const std::string& layout : layouts) {
      for (const std::string& order : opt.summed_orders) {
        for (int64_t slice : or_default(opt.staging_slice_kib)) {
          for (int64_t threads : or_default(opt.staging_threads)) {
            variants.push_back({gemm, layout, order, slice, threads});
          }
        }
      }
    }
  }
  return variants;
}

// The median of one part over calls.
double MedianOf(std::vector<DeviceTimes> parts, double DeviceTimes::* part) {
  std::nth_element(parts.begin(), parts.begin() + parts.size() / 2, parts.end(),
                   [&](const DeviceTimes& a, const DeviceTimes& b) { return a.*part < b.*part; });
  return parts[parts.size() / 2].*part;
}

std::vector<Record> RunShape(const BenchShape& shape, Backend& backend, int threads, double ceiling,
                             double min_time_s, const std::vector<Form>& forms, int64_t idle_us) {
  const LayerConfig config = *CompleteConfig({.d_model = shape.d_model, .heads = shape.heads});
  const LayerWeights weights = RandomLayerWeights(config, 1);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> input(shape.batch * shape.n * shape.d_model), output(input.size());
  std::vector<float> context(shape.batch * shape.m * shape.d_model);
  for (float& x : input) x = normal(rng);
  for (float& x : context) x = normal(rng);
  std::vector<Sequence> batch;
  std::vector<SequenceShape> shapes;
  for (int64_t r = 0; r < shape.batch; ++r) {
    Sequence s;
    s.input = ConstMatrixView(input.data() + r * shape.n * shape.d_model, shape.n, shape.d_model);
    if (shape.m > 0) s.context = ConstMatrixView(context.data() + r * shape.m * shape.d_model, shape.m, shape.d_model);
    s.output = MatrixView(output.data() + r * shape.n * shape.d_model, shape.n, shape.d_model);
    batch.push_back(s);
    shapes.push_back({.n = shape.n, .m = shape.m > 0 ? shape.m : shape.n});
  }
  std::vector<Record> records;
  for (Form form : forms) {
    auto f = std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(weights)
                                                                         : MaterializeSummed(weights));
    auto resident = backend.Upload(f);
    if (!resident.ok()) {
      std::cerr << "forward_bench: upload: " << resident.status().ToString() << "\n";
      std::exit(1);
    }
    std::vector<DeviceTimes> parts;
    const double s = MedianSeconds(
        [&] {
          Status st = backend.Forward(**resident, batch);
          if (!st.ok()) {
            std::cerr << st.ToString() << "\n";
            std::exit(1);
          }
          if (auto t = backend.LastDeviceTimes()) parts.push_back(*t);
        },
        min_time_s, idle_us);
    const double gflops = backend.Flops(*f, shapes) / s * 1e-9;  // what this backend ran
    records.push_back({shape.name, std::string(FormName(form)), backend.DeviceName(), threads, s * 1e3, gflops, ceiling,
                       "", "", "plain", std::nullopt});
    if (parts.size() > 1) {
      parts.erase(parts.begin());  // the warm-up call's, as MedianSeconds drops its time
      records.back().split = DeviceTimes{.inputs_ms = MedianOf(parts, &DeviceTimes::inputs_ms),
                                          .compute_ms = MedianOf(parts, &DeviceTimes::compute_ms),
                                          .outputs_ms = MedianOf(parts, &DeviceTimes::outputs_ms)};
    }
  }
  return records;
}

std::string ShapeLabel(const std::string& name);

// A GPU record's split: its compute's GFLOP/s (the record's FLOPs over the compute alone).
double DeviceGflops(const Record& r) { return r.split ? r.gflops * r.ms / r.split->compute_ms : 0.0; }

// On a GPU, where each call's time went (medians): the inputs' copy to the device, the compute,
// the outputs' copy back, the host's share (the call's median less the three), and the compute's
// own GFLOP/s against the same ceiling: the figure to set beside PyTorch's device-only time.
void PrintDeviceSplit(const std::vector<Record>& group) {
  if (group.empty() || !group.front().split) return;
  std::printf("\n%-38s %-9s %9s %9s %9s %9s %9s %9s %7s\n", "where the time went (ms)", "form", "call", "inputs",
              "compute", "outputs", "host", "GFLOP/s", "ratio");
  for (const Record& r : group) {
    if (!r.split) continue;
    const DeviceTimes& t = *r.split;
    std::printf("%-38s %-9s %9.3f %9.3f %9.3f %9.3f %9.3f %9.1f %7.3f\n", ShapeLabel(r.shape).c_str(), r.form.c_str(),
                r.ms, t.inputs_ms, t.compute_ms, t.outputs_ms, r.ms - t.inputs_ms - t.compute_ms - t.outputs_ms,
                DeviceGflops(r), Ratio(DeviceGflops(r), r.ceiling_gflops));
  }
}

std::string ShapeLabel(const std::string& name) {
  for (const auto& s : kShapes) {
    if (s.name == name) {
      return name + " (" + std::to_string(s.batch) + "x" + std::to_string(s.n) +
             (s.m > 0 ? " over " + std::to_string(s.m) : "") + ", d=" + std::to_string(s.d_model) +
             ", h=" + std::to_string(s.heads) + ")";
    }
  }
  return name;
}

// A JSON array of the records, one object a line, each written by `object(record, buffer, size)`.
template <typename R, typename WriteObject>
void WriteJsonArray(const std::string& path, const std::vector<R>& records, WriteObject object) {
  std::ofstream out(path);
  out << "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    char line[768];
    object(records[i], line, sizeof line);
    out << "  " << line << (i + 1 < records.size() ? ",\n" : "\n");
  }
  out << "]\n";
}

void WriteJson(const std::string& path, const std::vector<Record>& records, const std::string& isa) {
  WriteJsonArray(path, records, [&](const Record& r, char* line, size_t size) {
    char split[256] = "";
    if (r.split) {
      std::snprintf(split, sizeof split,
                    ", \"device_ms\": %.4f, \"inputs_ms\": %.4f, \"outputs_ms\": %.4f, \"device_gflops\": %.2f, "
                    "\"device_ratio_to_ceiling\": %.4f",
                    r.split->compute_ms, r.split->inputs_ms, r.split->outputs_ms, DeviceGflops(r),
                    Ratio(DeviceGflops(r), r.ceiling_gflops));
    }
    std::snprintf(line, size,
                  "{\"shape\": \"%s\", \"form\": \"%s\", \"device\": \"%s\", \"threads\": %d, \"ms\": %.4f, "
                  "\"gflops\": %.2f, \"ceiling_gflops\": %.2f, \"ratio_to_ceiling\": %.4f, \"ceiling_source\": \"%s\", "
                  "\"isa\": \"%s\", \"gemm\": \"%s\", \"weights\": \"%s\"%s}",
                  r.shape.c_str(), r.form.c_str(), r.device.c_str(), r.threads, r.ms, r.gflops, r.ceiling_gflops,
                  Ratio(r.gflops, r.ceiling_gflops), r.ceiling_source.c_str(), isa.c_str(), r.gemm.c_str(),
                  r.weights.c_str(), split);
  });
}

// A line "NAME:   N kB" of /proc/self/status, in MiB.
double StatusMb(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0) return std::stod(line.substr(std::strlen(name) + 1)) / 1024.0;
  }
  return -1;
}

struct LongLayer {
  std::string name;
  LayerConfig config;
  bool causal;
};

const LongLayer kLongLayers[] = {
    {"d768-h12", {.d_model = 768, .heads = 12}, false},
    {"llama-d2048-h16-kv4", {.d_model = 2048, .heads = 16, .kv_heads = 4, .bias = false, .rope_theta = 10000.0}, true},
};

struct LongRecord {
  std::string layer, form, order;  // order: the summed form's (--summed-order)
  int64_t n;
  int threads;
  double ms, gflops, ceiling_gflops, rss_growth_mb, all_scores_mb;
};

// FLOPs of one call on the visible scores: a causal layer's masked half is not work done (the
// tiled backend skips the tiles above the diagonal), so it is not counted either.
double UsefulFlops(const Backend& backend, const FormWeights& f, int64_t n, bool causal) {
  const SequenceShape all{.n = n, .m = n}, none{.n = n, .m = n, .keys = 0};
  const double without = backend.Flops(f, {&none, 1}), attention = backend.Flops(f, {&all, 1}) - without;
  return without + (causal ? attention * static_cast<double>(n + 1) / (2.0 * static_cast<double>(n)) : attention);
}

int Usage(const char* why);

// One (layer, n, form) point's backend, weights and one sequence, ready to call.
struct LongPoint {
  std::unique_ptr<Backend> backend;
  std::shared_ptr<const FormWeights> form;
  std::shared_ptr<const ResidentForm> resident;
  std::vector<float> input, output;
  Sequence sequence;

  void Call() {
    Status st = backend->Forward(*resident, {&sequence, 1});
    if (!st.ok()) {
      std::cerr << st.ToString() << "\n";
      std::exit(1);
    }
  }
};

std::unique_ptr<LongPoint> MakeLongPoint(const Options& opt, int threads, const LongLayer& layer,
                                         const LayerWeights& weights, int64_t n, Form form, const std::string& order) {
  auto point = std::make_unique<LongPoint>();
  auto backend = MakeBenchBackend(opt, threads, opt.gemms[0], order);
  if (!backend.ok()) {
    std::cerr << "forward_bench: " << backend.status().ToString() << "\n";
    std::exit(1);
  }
  point->backend = std::move(*backend);
  point->form = std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(weights)
                                                                           : MaterializeSummed(weights));
  auto resident = point->backend->Upload(point->form);
  if (!resident.ok()) {
    std::cerr << "forward_bench: " << resident.status().ToString() << "\n";
    std::exit(1);
  }
  point->resident = std::move(*resident);
  const int64_t d = layer.config.d_model;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  point->input.resize(n * d);
  point->output.assign(n * d, 0.5f);  // touched now: not counted as growth
  for (float& x : point->input) x = normal(rng);
  point->sequence.input = ConstMatrixView(point->input.data(), n, d);
  point->sequence.output = MatrixView(point->output.data(), n, d);
  point->sequence.causal = layer.causal;
  return point;
}

// The peak RSS growth of a fresh backend's first call, in MiB. Runs in a process of its own
// (this binary again, `--rss-point`, RssPointMain): there large blocks are mapped at malloc and
// returned at free (a 64 KiB mmap threshold), so the peak is the call's own and not memory an
// earlier point left in the allocator. The timing stays in this process, under glibc's default
// allocator as the server runs: under the 64 KiB threshold every oneDNN call mapped and faulted
// in its packing buffers again, and the d768 layer's factored form took 1.4–1.5× its time
// (n = 2048, 2 threads: 106 against 73 ms).
double RssGrowthInChildMb(const Options& opt, int threads, size_t layer, int64_t n, Form form, const std::string& order) {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return -1;
  self[len] = '\0';
  const std::string command = std::string(self) + " --gemm " + opt.gemms[0] + " --rss-point " + std::to_string(layer) +
                              "," + std::to_string(n) + "," + std::string(FormName(form)) + "," + order + "," +
                              std::to_string(threads);
  FILE* child = popen(command.c_str(), "r");
  if (child == nullptr) return -1;
  double growth = -1;
  if (std::fscanf(child, "rss_growth_mb %lf", &growth) != 1) growth = -1;
  return pclose(child) == 0 ? growth : -1;
}

// `--rss-point LAYER,N,FORM,ORDER,THREADS`: one point's first call under the 64 KiB mmap
// threshold, its peak RSS growth printed for RssGrowthInChildMb.
int RssPointMain(const Options& opt, const std::string& spec) {
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 64 * 1024);
  const std::vector<std::string> f = Split(spec);
  if (f.size() != 5) return Usage("--rss-point: expected LAYER,N,FORM,ORDER,THREADS");
  const size_t index = std::stoul(f[0]);
  if (index >= std::size(kLongLayers)) return Usage("--rss-point: no such layer");
  const LongLayer& layer = kLongLayers[index];
  const LayerConfig config = *CompleteConfig(layer.config);
  const LayerWeights weights = RandomLayerWeights(config, 1);
  const Form form = f[2] == FormName(Form::kFactored) ? Form::kFactored : Form::kSummed;
  const LongLayer complete{layer.name, config, layer.causal};
  // What a process pays once, not a call: the compute team's threads and oneDNN's JIT kernels,
  // made by a short call on a backend of its own, gone before the measured one.
  MakeLongPoint(opt, std::stoi(f[4]), complete, weights, 64, form, f[3])->Call();
  auto point = MakeLongPoint(opt, std::stoi(f[4]), complete, weights, std::stoll(f[1]), form, f[3]);
  std::ofstream("/proc/self/clear_refs") << "5";  // the peak (VmHWM) restarts from the current RSS
  const double before = StatusMb("VmRSS:");
  point->Call();
  std::printf("rss_growth_mb %.3f\n", StatusMb("VmHWM:") - before);
  return 0;
}

// One (layer, n, form) point: its RSS growth from a child process, then here a fresh backend's
// first call (scratch allocated, pages touched) and the time of the calls after it.
LongRecord RunLongPoint(const Options& opt, int threads, size_t layer_index, const LongLayer& layer,
                        const LayerWeights& weights, int64_t n, Form form, const std::string& order) {
  const double growth = RssGrowthInChildMb(opt, threads, layer_index, n, form, order);
  auto point = MakeLongPoint(opt, threads, layer, weights, n, form, order);
  point->Call();
  // Long points take seconds a call: time one more; short ones as everywhere else.
  double seconds = 0;
  if (n > 2048) {
    const auto t0 = std::chrono::steady_clock::now();
    point->Call();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else {
    seconds = MedianSeconds([&] { point->Call(); }, opt.min_time_s);
  }
  const double scores_mb = static_cast<double>(n) * static_cast<double>(n) * layer.config.heads * 4 / 1048576.0;
  return {layer.name, std::string(FormName(form)), order, n, threads, seconds * 1e3,
          UsefulFlops(*point->backend, *point->form, n, layer.causal) / seconds * 1e-9, 0, growth, scores_mb};
}

int RunLongSweep(const Options& opt) {
  const std::vector<GemmLibraryUnderTest> libraries = CeilingLibraries();
  const std::string isa(CpuIsa());
  std::vector<LongRecord> records;
  for (int threads : opt.threads) {
    auto ceiling = MeasureCeiling(opt, threads, libraries, {{2048, 2048, 2048}});
    if (!ceiling.ok()) return 1;
    std::printf("\n%-22s %-24s %6s %7s %10s %9s %7s %12s %14s %12s   (ceiling %.1f GFLOP/s: %s; CPU kernels: %s)\n",
                "layer", "form", "n", "threads", "ms", "GFLOP/s", "ratio", "RSS growth", "MiB per 1k tok",
                "n·L·h scores", ceiling->gflops, ceiling->source.c_str(), isa.c_str());
    for (size_t layer_index = 0; layer_index < std::size(kLongLayers); ++layer_index) {
      const LongLayer& layer = kLongLayers[layer_index];
      const LayerConfig config = *CompleteConfig(layer.config);
      const LayerWeights weights = RandomLayerWeights(config, 1);
      for (int64_t n : opt.lengths) {
        std::vector<std::pair<Form, std::string>> runs = {{Form::kFactored, "auto"}};
        for (const std::string& order : opt.summed_orders) runs.emplace_back(Form::kSummed, order);
        for (const auto& [form, order] : runs) {
          LongRecord r = RunLongPoint(opt, threads, layer_index, {layer.name, config, layer.causal}, weights, n, form, order);
          r.ceiling_gflops = ceiling->gflops;
          const std::string label = form == Form::kSummed && order != "auto" ? r.form + "/" + order : r.form;
          std::printf("%-22s %-24s %6lld %7d %10.1f %9.1f %7.3f %8.1f MiB %14.2f %8.0f MiB\n", r.layer.c_str(),
                      label.c_str(), static_cast<long long>(r.n), r.threads, r.ms, r.gflops, r.gflops / r.ceiling_gflops,
                      r.rss_growth_mb, r.rss_growth_mb / (static_cast<double>(n) / 1024.0), r.all_scores_mb);
          std::fflush(stdout);
          records.push_back(r);
        }
      }
    }
  }
  if (!opt.json.empty()) {
    WriteJsonArray(opt.json, records, [&](const LongRecord& r, char* line, size_t size) {
      std::snprintf(line, size,
                    "{\"sweep\": \"long\", \"layer\": \"%s\", \"form\": \"%s\", \"order\": \"%s\", \"n\": %lld, "
                    "\"threads\": %d, \"ms\": %.3f, \"gflops\": %.2f, \"ceiling_gflops\": %.2f, \"rss_growth_mb\": %.1f, "
                    "\"all_scores_mb\": %.1f, \"isa\": \"%s\"}",
                    r.layer.c_str(), r.form.c_str(), r.order.c_str(), static_cast<long long>(r.n), r.threads, r.ms,
                    r.gflops, r.ceiling_gflops, r.rss_growth_mb, r.all_scores_mb, isa.c_str());
    });
  }
  return 0;
}

int Usage(const char* why) {
  std::cerr << "forward_bench: " << why << "\n"
            << "usage: forward_bench [--device cpu|cuda[:N]] [--tf32 | --gpu-math fp32|tf32|bf16|fp16]\n"
               "                     [--threads 1,2] [--min-time-s 0.5]\n"
               "                     [--json FILE] [--shapes bert-base,gpt2-medium,small-request,large]\n"
               "                     [--gemm auto,eigen,onednn]   (the CPU backend's GEMM libraries, in turn)\n"
               "                     [--summed-order auto,project-first,mix-first]   (the summed form's association order)\n"
               "                     [--weight-layout auto,plain]   (the CPU backend's weights packed or row-major,\n"
               "                                                    in turn; packed-bf16: packed as bfloat16;\n"
               "                                                    packed-bf16-dot: inputs too, vdpbf16ps;\n"
               "                                                    packed-fp16: packed as IEEE half)\n"
               "                     [--forms factored,summed]   (one form alone: for a profile)\n"
               "                     [--idle-us 0]   (a pause before each timed call, as between served requests)\n"
               "                     [--no-ceiling]   (time the forwards only: no SGEMM ceiling, ratios 0)\n"
               "                     [--value-group-mib 64]   (the summed form's value groups; 0: a sequence each)\n"
               "                     [--staging-slice-kib 4096,1048576]   (the CUDA backend's copy slices, in turn)\n"
               "                     [--staging-threads 1,4]   (the CUDA backend's packing threads, in turn)\n"
               "                     [--gemm-attention]   (the CUDA backend's attention as GEMMs, not fused)\n"
               "                     [--gpu-graphs 1024]   (batches of up to this many rows replay CUDA graphs)\n"
               "                     [--accuracy-bound X]   (the check against float64 before timing; default by math)\n"
               "       forward_bench --sweep long [--lengths 512,2048,8192,16384] [--threads 2] [--json FILE]\n"
               "                     [--summed-order auto,mix-first]\n";
  return 2;
}

int Main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return Usage("both forms at reference shapes, as ratios to a GEMM ceiling");
    if (arg == "--tf32") {
      opt.math = Math::kTf32;
      continue;
    }
    if (arg == "--gpu-math") {
      const std::optional<Math> math = i + 1 < argc ? ParseMath(argv[i + 1]) : std::nullopt;
      if (!math) return Usage("--gpu-math: expected fp32, tf32, bf16 or fp16");
      opt.math = *math;
      ++i;
      continue;
    }
    if (arg == "--no-ceiling") {
      opt.ceiling = false;
      continue;
    }
    if (arg == "--gemm-attention") {
      opt.gemm_attention = true;
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
    } else if (arg == "--accuracy-bound") {
      opt.accuracy_bound = std::atof(value.c_str());
      if (!(opt.accuracy_bound > 0)) return Usage("--accuracy-bound: expected a positive relative L2 bound");
    } else if (arg == "--json") {
      opt.json = value;
    } else if (arg == "--device") {
      opt.device = value;
    } else if (arg == "--shapes") {
      opt.shapes = Split(value);
    } else if (arg == "--gemm") {
      opt.gemms = Split(value);
    } else if (arg == "--weight-layout") {
      opt.weight_layouts = Split(value);
      for (const std::string& l : opt.weight_layouts) {
        if (!ParseWeightLayout(l).ok()) {
          return Usage(("--weight-layout: " + ParseWeightLayout(l).status().message()).c_str());
        }
      }
    } else if (arg == "--summed-order") {
      opt.summed_orders = Split(value);
    } else if (arg == "--staging-slice-kib") {
      if (!ParseCounts(value, 1, int64_t{1} << 30, &opt.staging_slice_kib)) {
        return Usage(("--staging-slice-kib: expected whole numbers of KiB from 1, got " + value).c_str());
      }
    } else if (arg == "--gpu-graphs") {
      std::vector<int64_t> rows;
      if (!ParseCounts(value, 1, int64_t{1} << 20, &rows) || rows.size() != 1) {
        return Usage(("--gpu-graphs: expected one whole number of rows from 1, got " + value).c_str());
      }
      opt.graph_rows = static_cast<int>(rows[0]);
    } else if (arg == "--staging-threads") {
      if (!ParseCounts(value, 1, 256, &opt.staging_threads)) {
        return Usage(("--staging-threads: expected whole numbers from 1 to 256, got " + value).c_str());
      }
    } else if (arg == "--forms") {
      opt.forms.clear();
      for (const auto& name : Split(value)) {
        const std::optional<Form> form = ParseForm(name);
        if (!form || *form == Form::kLowRank) {
          return Usage(("--forms: expected factored and/or summed, got " + name).c_str());
        }
        opt.forms.push_back(*form);
      }
    } else if (arg == "--idle-us") {
      opt.idle_us = std::atoll(value.c_str());
      if (opt.idle_us < 0 || opt.idle_us > 1000000) return Usage(("--idle-us: expected 0 to 1000000, got " + value).c_str());
    } else if (arg == "--value-group-mib") {
      char* end = nullptr;
      const long long mib = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || mib < 0 || mib > (int64_t{1} << 40)) {
        return Usage(("--value-group-mib: expected a whole number of MiB from 0, got " + value).c_str());
      }
      opt.value_group_bytes = mib == 0 ? 1 : mib << 20;
    } else if (arg == "--rss-point") {
      opt.rss_point = value;
    } else if (arg == "--sweep") {
      if (value != "long") return Usage(("--sweep: expected long, got " + value).c_str());
      opt.sweep = value;
    } else if (arg == "--lengths") {
      opt.lengths.clear();
      for (const auto& n : Split(value)) opt.lengths.push_back(std::atoll(n.c_str()));
      if (std::any_of(opt.lengths.begin(), opt.lengths.end(), [](int64_t n) { return n < 1; })) {
        return Usage("--lengths: expected positive integers, e.g. 512,2048");
      }
    } else {
      return Usage(("unknown flag " + arg).c_str());
    }
  }
  const bool on_cpu = opt.device == "cpu";
  if (on_cpu && opt.gemm_attention) return Usage("--gemm-attention sets the CUDA backend's attention; it needs --device cuda");
  if (on_cpu && opt.graph_rows > 0) return Usage("--gpu-graphs sets the CUDA backend's graphs; it needs --device cuda");
  if (on_cpu && (!opt.staging_slice_kib.empty() || !opt.staging_threads.empty())) {
    return Usage("--staging-slice-kib and --staging-threads set the CUDA backend's staging; they need --device cuda");
  }
  if (!opt.rss_point.empty()) return RssPointMain(opt, opt.rss_point);
  if (opt.sweep == "long") {
    if (!on_cpu) return Usage("--sweep long: the CPU backend only (it measures the process's RSS)");
    return RunLongSweep(opt);
  }
  if (!on_cpu) opt.threads = {1};  // host threads do not matter to a GPU
  std::vector<const BenchShape*> chosen;
  for (const auto& shape : kShapes) {
    const bool asked = std::find(opt.shapes.begin(), opt.shapes.end(), shape.name) != opt.shapes.end();
    const bool by_default = shape.by_default || (!on_cpu && shape.name == "large");
    if (opt.shapes.empty() ? by_default : asked) chosen.push_back(&shape);
  }
  // The ceiling's shapes: 2048³ and each chosen layer's projections over all its tokens.
  std::vector<GemmShape> gemm_shapes = {{2048, 2048, 2048}};
  for (const BenchShape* shape : chosen) {
    const int64_t tokens = shape->batch * shape->n, d = shape->d_model;
    gemm_shapes.push_back({tokens, d, 3 * d});
    gemm_shapes.push_back({tokens, d, d});
  }
  const std::vector<GemmLibraryUnderTest> libraries = CeilingLibraries();
  const std::string isa(on_cpu ? CpuIsa() : "gpu");
  std::vector<Record> records;
  if (!on_cpu) {
    opt.gemms = {std::string(opt.gemm_attention ? "cublas-gemm-attention" : "cublas") +
                 (opt.graph_rows > 0 ? "-graphs" : "")};
  }
  for (int threads : opt.threads) {
    // The ceiling is taken before the cases (every candidate) and after them (the winner again);
    // the larger is used, so drift in the machine's load cannot flatter the ratios.
    Ceiling none;
    none.source = "none (--no-ceiling)";
    auto before = opt.ceiling ? MeasureCeiling(opt, threads, libraries, gemm_shapes) : StatusOr<Ceiling>(none);
    if (!before.ok()) {
      std::cerr << "forward_bench: ceiling: " << before.status().ToString() << "\n";
      return 1;
    }
    std::vector<Record> group;
    for (const BackendVariant& v : BackendVariants(opt, on_cpu)) {
      auto backend = MakeBenchBackend(opt, threads, v.gemm, v.order, v.layout, v.staging_slice_kib, v.staging_threads);
      if (!backend.ok()) {
        std::cerr << "forward_bench: " << backend.status().ToString() << "\n";
        return 1;
      }
      // What is timed must be attention: both forms against float64 first (accuracy_check.h).
      const AccuracyCheck accuracy = CheckAgainstFloat64(**backend, (*backend)->default_math(), opt.accuracy_bound);
      std::printf("accuracy (%s):\n%s", v.gemm.c_str(), accuracy.report.c_str());
      if (!accuracy.passed) {
        std::cerr << "forward_bench: the backend's answers are not attention's (above); nothing timed\n";
        return 1;
      }
      std::string library = on_cpu ? std::string(GemmLibraryName(static_cast<CpuBackend&>(**backend).gemm())) : v.gemm;
      if (v.order != "auto") library += "/" + v.order;
      if (v.staging_slice_kib > 0) library += "/slice=" + std::to_string(v.staging_slice_kib) + "k";
      if (v.staging_threads > 0) library += "/t=" + std::to_string(v.staging_threads);
      const std::string_view weights =
          on_cpu ? WeightLayoutName(static_cast<CpuBackend&>(**backend).weight_layout()) : "plain";
      for (const BenchShape* shape : chosen) {
        for (auto& r : RunShape(*shape, **backend, threads, before->gflops, opt.min_time_s, opt.forms, opt.idle_us)) {
          r.gemm = library;
          r.weights = std::string(weights);
          group.push_back(r);
        }
      }
    }
    Ceiling ceiling = *before;
    if (ceiling.library != nullptr) {
      ceiling.gflops = std::max(ceiling.gflops, GemmGflops(*ceiling.library, ceiling.shape, threads, opt.min_time_s));
    }
    std::printf("\n%-38s %-9s %-20s %-7s %7s %9s %9s %9s %7s   (ceiling: %s; CPU kernels: %s)\n", "shape", "form",
                "gemm", "weights", "threads", "ms", "GFLOP/s", "ceiling", "ratio", ceiling.source.c_str(), isa.c_str());
    for (auto& r : group) {
      r.ceiling_gflops = ceiling.gflops;
      r.ceiling_source = ceiling.source;
      std::printf("%-38s %-9s %-20s %-7s %7d %9.3f %9.1f %9.1f %7.3f\n", ShapeLabel(r.shape).c_str(), r.form.c_str(),
                  r.gemm.c_str(), r.weights.c_str(), r.threads, r.ms, r.gflops, r.ceiling_gflops,
                  Ratio(r.gflops, r.ceiling_gflops));
      records.push_back(r);
    }
    PrintDeviceSplit(group);
    std::printf("\n");
  }
  if (opt.forms.size() == 2 && opt.forms[0] == Form::kFactored) std::printf("\nsummed / factored time:\n");
  for (size_t i = 0; opt.forms.size() == 2 && opt.forms[0] == Form::kFactored && i + 1 < records.size(); i += 2) {
    std::printf("  %-14s %-7s threads=%d  %.2fx\n", records[i].shape.c_str(), records[i].gemm.c_str(),
                records[i].threads, records[i + 1].ms / records[i].ms);
  }
  if (!opt.json.empty()) WriteJson(opt.json, records, isa);
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
