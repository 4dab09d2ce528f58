// prepacked_gemm_bench: oneDNN's matmul primitive with the weights reordered once into its own
// blocked layout and the bias fused, against the dnnl_sgemm call the CPU backend makes today
// (weights row-major, packed inside every call, bias not included), one thread, at the layers'
// projection shapes for a 1×16 request, a 64-token batch and a 1024-token batch
// (docs/journal/benchmarks-journal.md, "Attention's own kernel": the measurement behind the next step).
//
//   prepacked_gemm_bench
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <utility>
#include <vector>

namespace {

// Median of 400 calls after 20 to warm up, in ms: the machine is shared.
template <class F>
double MedianMs(F f) {
  for (int i = 0; i < 20; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < 400; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  using dnnl::memory;
  omp_set_num_threads(1);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);  // random: zeros would draw less power
  std::printf("%6s %6s %6s %14s %22s %10s  %s\n", "M", "K", "N", "sgemm ms", "prepacked+bias ms", "sgemm/pp", "kernel");
  for (int64_t m : {16, 64, 1024}) {
    for (const auto& [k, n] : {std::pair<int64_t, int64_t>{768, 2304}, {768, 768}, {1024, 3072}, {1024, 1024}}) {
      std::vector<float> a(m * k), b(k * n), c(m * n), bias(n);
      for (auto* v : {&a, &b, &bias}) {
        for (float& x : *v) x = uniform(rng);
      }
      const memory::desc a_desc({m, k}, memory::data_type::f32, memory::format_tag::ab);
      const memory::desc b_plain({k, n}, memory::data_type::f32, memory::format_tag::ab);
      const memory::desc b_any({k, n}, memory::data_type::f32, memory::format_tag::any);
      const memory::desc bias_desc({1, n}, memory::data_type::f32, memory::format_tag::ab);
      const memory::desc c_desc({m, n}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_desc, b_any, bias_desc, c_desc), engine);
      memory a_mem(a_desc, engine, a.data()), b_mem(b_plain, engine, b.data()), bias_mem(bias_desc, engine, bias.data());
      memory c_mem(c_desc, engine, c.data()), packed(pd.weights_desc(), engine);
      dnnl::reorder(b_mem, packed).execute(stream, b_mem, packed);  // once, as a load would
      stream.wait();
      const dnnl::matmul matmul(pd);
      const double sgemm = MedianMs([&] {
        dnnl_sgemm('N', 'N', m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
      });
      const double prepacked = MedianMs([&] {
        matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, packed}, {DNNL_ARG_BIAS, bias_mem},
                                {DNNL_ARG_DST, c_mem}});
        stream.wait();
      });
      std::printf("%6ld %6ld %6ld %14.3f %22.3f %10.2f  %s\n", static_cast<long>(m), static_cast<long>(k),
                  static_cast<long>(n), sgemm, prepacked, sgemm / prepacked, pd.impl_info_str());
    }
  }
  return 0;
}
