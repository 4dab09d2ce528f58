#include "tests/unit/test_support.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "server/backend/cpu/cpu_backend.h"
#if defined(ATTNSERVE_CUDA_EMULATED)
#include "cuda_emulation.h"
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

double ScoreBound(const LayerWeights& w, const OwnedSequence& s) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model, dh = c.d_head;
  auto row_norms = [&](const std::vector<float>& x, int64_t rows, const std::vector<float>& wm,
                       const std::vector<float>& b, int64_t heads) {
    std::vector<double> best(heads, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        double sq = 0;
        for (int64_t t = 0; t < dh; ++t) {
          const int64_t col = h * dh + t;
          double v = b.empty() ? 0.0 : b[col];
          for (int64_t k = 0; k < d; ++k) v += static_cast<double>(x[r * d + k]) * wm[k * heads * dh + col];
          sq += v * v;
        }
        best[h] = std::max(best[h], std::sqrt(sq));
      }
    }
    return best;
  };
  const std::vector<double> q = row_norms(s.input, s.n, w.w_q, w.b_q, c.heads);
  const std::vector<double> k = row_norms(s.cross ? s.context : s.input, s.m, w.w_k, w.b_k, c.kv_heads);
  double bound = 0;
  for (int64_t h = 0; h < c.heads; ++h) bound = std::max(bound, q[h] * k[c.KvHeadOf(h)]);
  return c.SoftmaxScale() * bound;
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
  // Eigen's GEMMs on the row-major weights (the portable path: the default "cpu" packs them where
  // its own kernel runs), and the summed form's value rows projected and summed one sequence at
  // a time (the default groups hold 16 MiB of them: the whole batch at the suite's shapes).
  if (name == "cpu-eigen") {
    return std::make_unique<CpuBackend>(CpuBackendOptions{
        .gemm = GemmLibrary::kEigen, .weight_layout = WeightLayout::kPlain, .summed_value_group_bytes = 1});
  }
  // A 64 KiB bound on the summed form's working memory: every summed sequence then mixes first,
  // tiled, in parts of a few rows — the path a long sequence takes, at the suite's short shapes.
  if (name == "cpu-tiled") return std::make_unique<CpuBackend>(CpuBackendOptions{.max_score_scratch_bytes = 64 << 10});
#if defined(ATTNSERVE_CUDA_EMULATED) || defined(ATTNSERVE_CUDA_PLUGIN_FILE)
  if (name == "cuda" || name == "cuda-tf32") {
#ifdef ATTNSERVE_CUDA_EMULATED
    // The emulated backend is linked in: it maps no CUDA library.
    // With guard zones between the workspace's pieces: an overrun inside the one allocation,
    // which neither the emulation's bounds checks nor ASan see, fails the batch.
    // "cuda" runs attention in the fused kernel, "cuda-tf32" as GEMMs around the softmax kernel
    // (CudaBackendOptions::gemm_attention): the suite covers both paths.
    auto backend = MakeCudaBackend(
        {.device = 0,
         .math = name == "cuda-tf32" ? Math::kTf32 : Math::kFp32,
         .gemm_attention = name == "cuda-tf32",
         .guard_zones = true});
#else
    // The real one through the plugin the server loads, as the server loads it.
    auto backend = LoadCudaPlugin(ATTNSERVE_CUDA_PLUGIN_FILE,
                                  {.device = 0,
                                   .math = name == "cuda-tf32" ? Math::kTf32 : Math::kFp32,
                                   .gemm_attention = name == "cuda-tf32"});
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

namespace {

// [rows, cols] with orthonormal columns (rows ≥ cols): Q of the QR of a Gaussian matrix.
Eigen::MatrixXd RandomOrthonormal(std::mt19937_64& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Eigen::MatrixXd g(rows, cols);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) g(r, c) = normal(rng);
  return Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ() * Eigen::MatrixXd::Identity(rows, cols);
}

}  // namespace

LayerWeights LayerWithSpectra(const LayerConfig& c, const std::vector<std::vector<double>>& ov_sigma,
                              const std::vector<std::vector<double>>& qk_sigma, std::mt19937_64& rng) {
  LayerWeights w = RandomLayerWeights(c, rng());
  const int64_t d = c.d_model, dh = c.d_head, qc = c.heads * dh, kvc = c.kv_heads * dh;
  for (int64_t g = 0; g < c.kv_heads; ++g) {
    const Eigen::MatrixXd v = RandomOrthonormal(rng, d, dh), k = RandomOrthonormal(rng, d, dh);
    for (int64_t r = 0; r < d; ++r) {
      for (int64_t t = 0; t < dh; ++t) {
        w.w_v[r * kvc + g * dh + t] = static_cast<float>(v(r, t));
        w.w_k[r * kvc + g * dh + t] = static_cast<float>(k(r, t));
      }
    }
  }
  for (int64_t i = 0; i < c.heads; ++i) {
    const Eigen::MatrixXd right = RandomOrthonormal(rng, d, dh), left = RandomOrthonormal(rng, d, dh);
    for (int64_t t = 0; t < dh; ++t) {
      for (int64_t col = 0; col < d; ++col)
        w.w_o[(i * dh + t) * d + col] = static_cast<float>(ov_sigma[i][t] * right(col, t));
      for (int64_t r = 0; r < d; ++r) w.w_q[r * qc + i * dh + t] = static_cast<float>(left(r, t) * qk_sigma[i][t]);
    }
  }
  return w;
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
#if defined(ATTNSERVE_CUDA_EMULATED)
    cuda_emulation::SetScheduleSeed(s);  // the emulated device's block and thread orders, too
#endif
    return s;
  }();
  return seed;
}

}  // namespace attnserve::testing
