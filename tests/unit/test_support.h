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

// The backends this build can run: "cpu" (its default GEMM library: oneDNN when built with it)
// and "cpu-eigen" always, "cuda" and "cuda-tf32" when compiled in. Returns nullptr and sets `why`
// when the backend cannot run here (the test then skips, saying why).
std::unique_ptr<Backend> MakeBackend(const std::string& name, std::string* why);

// What a suite parameterised over backends instantiates with, and its test-name suffix ("cpu-eigen"
// becomes cpu_eigen). The emulated CUDA binary runs only the CUDA backends: the plain one runs
// the CPU's.
#ifdef ATTNSERVE_CUDA_EMULATED
#define ATTNSERVE_BACKENDS_UNDER_TEST "cuda", "cuda-tf32"
#else
#define ATTNSERVE_BACKENDS_UNDER_TEST "cpu", "cpu-eigen", "cuda", "cuda-tf32"
#endif
std::string BackendTestName(const std::string& backend);

// True when ATTNSERVE_REQUIRE_BACKENDS (a comma list, e.g. "cuda,cuda-tf32") names it: the
// test then fails instead of skipping when the backend cannot run.
bool BackendRequired(const std::string& name);

// The number of random cases a randomized test draws: ATTNSERVE_RANDOM_CASES or `fallback`.
int RandomCases(int fallback);

// The seed of this test process: ATTNSERVE_SEED when set, else a fresh one each run (drawn
// once per process); printed to stderr on first use, so a failure's output names it.
uint64_t TestSeed();

}  // namespace attnserve::testing
