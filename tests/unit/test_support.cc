#include "tests/unit/test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "server/backend/cpu/cpu_backend.h"
#if defined(ATTNSERVE_CUDA_EMULATED)
#include "server/backend/cuda/cuda_backend.h"
#elif defined(ATTNSERVE_CUDA_PLUGIN_FILE)
#include "server/backend/select.h"
#endif

namespace attnserve::testing {

std::vector<float> RandomVector(std::mt19937_64& rng, size_t count, float std_dev) {
  std::normal_distribution<float> dist(0.0f, std_dev);
  std::vector<float> v(count);
  for (auto& x : v) x = dist(rng);
  return v;
}

double RelativeL2(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    num += e * e;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

double RelativeL2(const float* got, const float* want, size_t count) {
  return RelativeL2(got, std::vector<double>(want, want + count));
}

Sequence OwnedSequence::View() {
  Sequence s;
  s.input = ConstMatrixView(input.data(), n, d_model);
  if (cross) s.context = ConstMatrixView(context.data(), m, d_model);
  s.causal = causal;
  s.key_length = key_length;
  s.position_offset = position_offset;
  s.output = MatrixView(output.data(), n, d_model);
  return s;
}

OwnedSequence RandomSequence(std::mt19937_64& rng, int64_t d_model, int64_t n, int64_t m, bool cross,
                             bool causal, int64_t key_length) {
  OwnedSequence s;
  s.d_model = d_model;
  s.n = n;
  s.m = cross ? m : n;
  s.cross = cross;
  s.causal = causal;
  s.key_length = key_length;
  s.input = RandomVector(rng, n * d_model);
  if (cross) s.context = RandomVector(rng, m * d_model);
  // Filled with NaN so that any element the backend fails to write shows up.
  s.output.assign(n * d_model, std::nanf(""));
  return s;
}

std::unique_ptr<Backend> MakeBackend(const std::string& name, std::string* why) {
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cpu-eigen") return std::make_unique<CpuBackend>(CpuBackendOptions{.gemm = GemmLibrary::kEigen});
#if defined(ATTNSERVE_CUDA_EMULATED) || defined(ATTNSERVE_CUDA_PLUGIN_FILE)
  if (name == "cuda" || name == "cuda-tf32") {
#ifdef ATTNSERVE_CUDA_EMULATED
    // The emulated backend is linked in: it maps no CUDA library.
    auto backend = MakeCudaBackend({.device = 0, .tf32 = name == "cuda-tf32"});
#else
    // The real one through the plugin the server loads, as the server loads it.
    auto backend = LoadCudaPlugin(ATTNSERVE_CUDA_PLUGIN_FILE, 0, name == "cuda-tf32");
#endif
    if (backend.ok()) return std::move(backend).value();
    *why = backend.status().message();
    return nullptr;
  }
#endif
  *why = "backend '" + name + "' is not compiled into this build";
  return nullptr;
}

std::string BackendTestName(const std::string& backend) {
  std::string name = backend;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

bool BackendRequired(const std::string& name) {
#ifdef ATTNSERVE_CUDA_EMULATED
  // The emulated CUDA backends always run: a skip would hide a broken emulation.
  if (name == "cuda" || name == "cuda-tf32") return true;
#endif
  const char* v = std::getenv("ATTNSERVE_REQUIRE_BACKENDS");
  if (v == nullptr) return false;
  const std::string list = std::string(",") + v + ",";
  return list.find("," + name + ",") != std::string::npos;
}

int RandomCases(int fallback) {
  const char* v = std::getenv("ATTNSERVE_RANDOM_CASES");
  return v ? std::max(1, std::atoi(v)) : fallback;
}

uint64_t TestSeed() {
  // One seed per process, fresh each run so that every run explores new cases; printed once so
  // that a failure's output says how to replay it.
  static const uint64_t seed = [] {
    const char* v = std::getenv("ATTNSERVE_SEED");
    uint64_t s = 0;
    if (v != nullptr && *v != '\0') {
      s = std::strtoull(v, nullptr, 10);
    } else {
      std::random_device device;
      s = (static_cast<uint64_t>(device()) << 32) ^ device();
    }
    std::fprintf(stderr, "[ seed     ] %llu (replay with ATTNSERVE_SEED=%llu)\n", static_cast<unsigned long long>(s),
                 static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

}  // namespace attnserve::testing
