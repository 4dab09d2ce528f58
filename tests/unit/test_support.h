// Shared pieces of the unit tests: random draws, error measures, backends under test.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/layer.h"
#include "server/core/sequence.h"

namespace attnserve::testing {

// Random values from a normal distribution (never zeros).
std::vector<float> RandomVector(std::mt19937_64& rng, size_t count, float std_dev = 1.0f);

// ||got - want||_2 / ||want||_2, in float64.
double RelativeL2(const float* got, const std::vector<double>& want);
double RelativeL2(const float* got, const float* want, size_t count);

// A sequence with its own input, context and output storage.
struct OwnedSequence {
  std::vector<float> input, context, output;
  int64_t n = 0, m = 0;
  bool cross = false, causal = false;
  int64_t key_length = -1;
  int64_t d_model = 0;
  int64_t position_offset = 0;

  Sequence View();
};

OwnedSequence RandomSequence(std::mt19937_64& rng, int64_t d_model, int64_t n, int64_t m, bool cross,
                             bool causal, int64_t key_length);

// max over heads of scale · max_row ‖q‖ · max_key ‖k‖ for `s` on `w`, in double (RoPE keeps the
// norms): how far a relative error in Q and K can move a score (the TF32 and 16-bit tolerances).
double ScoreBound(const LayerWeights& w, const OwnedSequence& s);

// The backends this build can run: "cpu" (its defaults: oneDNN when built with it, the weights
// packed where its own kernel runs), "cpu-eigen" (Eigen on row-major weights) and "cpu-tiled" (the summed form always mixing first, tiled, in parts) always, "cuda" and "cuda-tf32" when compiled in. Returns nullptr and sets `why`
// when the backend cannot run here (the test then skips, saying why).
std::unique_ptr<Backend> MakeBackend(const std::string& name, std::string* why);

// What a suite parameterised over backends instantiates with, and its test-name suffix ("cpu-eigen"
// becomes cpu_eigen). The emulated CUDA binary runs only the CUDA backends: the plain one runs
// the CPU's.
#ifdef ATTNSERVE_CUDA_EMULATED
#define ATTNSERVE_BACKENDS_UNDER_TEST "cuda", "cuda-tf32"
#else
#define ATTNSERVE_BACKENDS_UNDER_TEST "cpu", "cpu-eigen", "cpu-tiled", "cuda", "cuda-tf32"
#endif
std::string BackendTestName(const std::string& backend);

// True when ATTNSERVE_REQUIRE_BACKENDS (a comma list, e.g. "cuda,cuda-tf32") names it: the
// test then fails instead of skipping when the backend cannot run.
bool BackendRequired(const std::string& name);

// The number of random cases a randomized test draws: ATTNSERVE_RANDOM_CASES or `fallback`.
int RandomCases(int fallback);

// A layer whose heads' spectra are known by construction: head i's OV product W_V_g(i) W_O_i has
// exactly the singular values ov_sigma[i] and its QK product W_Q_i W_K_g(i)^T exactly qk_sigma[i]
// (d_head of each, d_head ≤ d_model), before the weights are rounded to float32 (~1e-7
// relative). W_V_g and W_K_g are orthonormal bases, W_O_i = diag(σ_i) V_i^T and
// W_Q_i = P_i diag(τ_i) with orthonormal V_i, P_i; each basis is the Q of the QR of a Gaussian
// matrix drawn from rng, in float64. Biases, if the config has them, are random.
LayerWeights LayerWithSpectra(const LayerConfig& config, const std::vector<std::vector<double>>& ov_sigma,
                              const std::vector<std::vector<double>>& qk_sigma, std::mt19937_64& rng);

// Six heads of eight singular values for LayerWithSpectra, with their energy ranks worked out
// by hand (the smallest r whose leading σ² reach that share of Σ σ²). Every cumulative share lies
// at least 1.7e-4 from 0.9, 0.99 and 0.999, a thousand times float32's rounding of the weights:
//   head 0  Σσ² = 120.35  shares 0.6730 0.8808 0.9555 0.9888 0.9971 0.9992 0.9999 1
//   head 1  Σσ² =  54.68         0.3074 0.5444 0.7202 0.8438 0.9245 0.9713 0.9934 1
//   head 2  Σσ² = 101.86         0.9818 0.9959 0.9995 0.9999 …
//   head 3  Σσ² =  70.37         0.5116 0.7623 0.8851 0.9455 0.9749 0.9894 0.9966 1
//   head 4  Σσ² =   8.63         0.5607 0.9789 0.9908 0.9992 0.9996 …
//   head 5  Σσ² =  49.95         0.9809 0.9907 0.9957 0.9982 0.9994 …
// Across heads the 13th and 14th largest σ are 2.2 (head 4) and 2.1 (head 1), the 20th and
// 21st 1.2 (head 2) and 1.1 (head 1): a budget of 13 or 20 has no near-tie to break.
struct KnownSpectra {
  std::vector<std::vector<double>> sigma = {
      {9, 5, 3, 2, 1, 0.5, 0.3, 0.1},
      {4.1, 3.6, 3.1, 2.6, 2.1, 1.6, 1.1, 0.6},
      {10, 1.2, 0.6, 0.2, 0.11, 0.05, 0.02, 0.01},
      {6, 4.2, 2.94, 2.06, 1.44, 1.01, 0.71, 0.49},
      {2.2, 1.9, 0.32, 0.27, 0.055, 0.045, 0.035, 0.025},
      {7, 0.7, 0.5, 0.35, 0.25, 0.12, 0.09, 0.08},
  };
  std::vector<int64_t> rank_90 = {3, 5, 1, 4, 2, 1};
  std::vector<int64_t> rank_99 = {5, 7, 2, 7, 3, 2};
  std::vector<int64_t> rank_999 = {6, 8, 3, 8, 4, 5};
  // The largest σ of all heads first, and the share of the layer's Σσ² = 405.8363 they keep.
  std::vector<int64_t> budget_13 = {3, 4, 1, 3, 1, 1};  // keeps 377.26 / 405.84 = 0.92960
  std::vector<int64_t> budget_20 = {4, 6, 2, 5, 2, 1};  // keeps 399.60 / 405.84 = 0.98464
  double kept_budget_13 = 0.9295955043942593;
  double kept_budget_20 = 0.9846354305911028;
  double kept_energy_90 = 0.959813599719887;  // with rank_90
};

// The seed of this test process: ATTNSERVE_SEED when set, else a fresh one each run (drawn
// once per process); printed to stderr on first use, so a failure's output names it.
uint64_t TestSeed();

}  // namespace attnserve::testing
