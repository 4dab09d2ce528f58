// The memory budget's footprint formula (ForwardScratchBytes, server/core/forms.h) against the
// peak RSS the CPU backend really reaches: each case runs in a child process of its own, which
// uploads the layer, draws the input, notes its peak RSS, runs one Forward and notes it again.
// The growth is the backend's scratch; the formula must cover it without wasting the budget.
// (A separate binary: the parent never starts OpenMP, so forking is safe.)
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <random>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/core/layer.h"

namespace attnserve {
namespace {

// A line "NAME:   N kB" of /proc/self/status, in bytes.
int64_t StatusBytes(const char* name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0) return std::stoll(line.substr(std::strlen(name) + 1)) * 1024;
  }
  return -1;
}

// Resets the peak (VmHWM) to the current RSS, so that the next peak is this step's alone.
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Case {
  const char* name;
  int64_t d_model, heads, n, m;
  bool summed, cross;
};

// In the child: {formula bytes, measured growth} written to `fd`.
void Measure(const Case& c, int fd) {
  // Large blocks always from mmap, returned at free: what earlier steps freed is not reused
  // unseen, so the peak's growth is what the Forward itself touched.
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 64 * 1024);
  const LayerConfig config = *CompleteConfig({.d_model = c.d_model, .heads = c.heads});
  const LayerWeights weights = RandomLayerWeights(config, 7);
  auto form = std::make_shared<const FormWeights>(c.summed ? MaterializeSummed(weights) : MaterializeFactored(weights));
  CpuBackend backend(CpuBackendOptions{.threads = 2});
  auto resident = backend.Upload(form);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> x(c.n * c.d_model), ctx(c.cross ? c.m * c.d_model : 0), y(c.n * c.d_model);
  for (float& v : x) v = normal(rng);
  for (float& v : ctx) v = normal(rng);
  for (float& v : y) v = 0.5f;  // touched now, so the output is not counted as growth
  Sequence s;
  s.input = ConstMatrixView(x.data(), c.n, c.d_model);
  if (c.cross) s.context = ConstMatrixView(ctx.data(), c.m, c.d_model);
  s.output = MatrixView(y.data(), c.n, c.d_model);
  const SequenceShape shape{c.n, c.cross ? c.m : c.n, -1};
  const int64_t formula = backend.ScratchBytes(*form, std::span<const SequenceShape>(&shape, 1), !c.cross);
  ResetPeakRss();
  const int64_t before = StatusBytes("VmRSS:");
  const Status st = backend.Forward(**resident, std::span<const Sequence>(&s, 1));
  const int64_t after = StatusBytes("VmHWM:");
  const int64_t out[2] = {st.ok() ? formula : -1, after - before};
  (void)!write(fd, out, sizeof out);
}

TEST(MemoryFootprintTest, FormulaCoversTheMeasuredPeakWithoutWaste) {
#if defined(ATTNSERVE_ASAN) || defined(ATTNSERVE_TSAN)
  // The sanitizers' allocators add redzones and hold freed blocks in quarantine: RSS no longer
  // measures what the program allocates. The plain build runs this test.
  GTEST_SKIP() << "RSS is not the program's allocations under a sanitizer's allocator";
#endif
  const Case cases[] = {
      {"factored, BERT-base width, 1x1024", 768, 12, 1024, 1024, false, false},
      {"summed, BERT-base width, 1x512", 768, 12, 512, 512, true, false},
      {"summed cross-attention, 64 queries over 2048 keys", 512, 8, 64, 2048, true, true},
      // Long sequences: tiled, so no [n, L] matrix per head (3 GiB at 8192 tokens) exists.
      {"factored, BERT-base width, 1x8192", 768, 12, 8192, 8192, false, false},
      {"summed, BERT-base width, 1x8192 (mixes first, in parts)", 768, 12, 8192, 8192, true, false},
  };
  for (const Case& c : cases) {
    int pipe_fd[2];
    ASSERT_EQ(pipe(pipe_fd), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      close(pipe_fd[0]);
      Measure(c, pipe_fd[1]);
      _exit(0);
    }
    close(pipe_fd[1]);
    int64_t got[2] = {0, 0};
    const ssize_t n = read(pipe_fd[0], got, sizeof got);
    close(pipe_fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_EQ(n, static_cast<ssize_t>(sizeof got)) << c.name;
    const double formula_mb = got[0] / 1048576.0, measured_mb = got[1] / 1048576.0;
    std::printf("%-52s formula %8.1f MiB, measured peak growth %8.1f MiB, ratio %.2f\n", c.name, formula_mb,
                measured_mb, measured_mb / formula_mb);
    ASSERT_GT(got[0], 0) << c.name;
    // Covered: the growth never exceeds the formula by more than the allocator's and thread
    // stacks' slack. Not wasteful: the formula is not more than 1.5x what is used.
    EXPECT_LE(measured_mb, formula_mb * 1.05 + 2) << c.name;
    EXPECT_GE(measured_mb * 1.5 + 8, formula_mb) << c.name;
    // Linear in the sequence: far below one n × L score matrix for every head.
    const double all_scores_mb = static_cast<double>(c.n) * static_cast<double>(c.m) * c.heads * 4 / 1048576.0;
    if (c.n >= 4096) {
      EXPECT_LT(measured_mb, all_scores_mb / 8) << c.name;
    }
  }
}

}  // namespace
}  // namespace attnserve
