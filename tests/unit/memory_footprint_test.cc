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
#include "server/service/footprint.h"
#include "server/service/validation.h"

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

// Runs `measure` (which writes {formula bytes, measured growth} to its fd) in a child process
// and returns what it wrote; {-1, -1} when the child wrote nothing.
template <typename F>
std::pair<int64_t, int64_t> InChild(F measure) {
  int pipe_fd[2];
  if (pipe(pipe_fd) != 0) return {-1, -1};
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fd[0]);
    measure(pipe_fd[1]);
    _exit(0);
  }
  close(pipe_fd[1]);
  int64_t got[2] = {-1, -1};
  const ssize_t n = read(pipe_fd[0], got, sizeof got);
  close(pipe_fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (n != static_cast<ssize_t>(sizeof got)) return {-1, -1};
  return {got[0], got[1]};
}

// A whole request as the service admits it: half-precision wire tensors decoded into float32
// copies, the outputs, then one Forward of every batch row on a grouped-query layer.
struct RequestCase {
  const char* name;
  int64_t d_model, heads, kv_heads, batch, n, m;
  bool summed, cross, bf16;  // bf16: BFLOAT16 on the wire, else FLOAT16
};

// float32 → the wire's half-precision bits. BFLOAT16 keeps the top 16 bits; FLOAT16 rebiases
// the exponent and keeps 10 mantissa bits (values under 2^-14 flush to zero, those over 65504
// saturate): all the test needs of its values, and no compiler's _Float16.
std::string HalfBytes(const std::vector<float>& v, bool bf16) {
  std::string bytes(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t f;
    std::memcpy(&f, &v[i], 4);
    uint16_t bits = static_cast<uint16_t>(f >> 16);
    if (!bf16) {
      const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
      const int exponent = static_cast<int>((f >> 23) & 0xFFu) - 127 + 15;
      if (exponent <= 0) {
        bits = sign;
      } else if (exponent >= 31) {
        bits = static_cast<uint16_t>(sign | 0x7BFFu);
      } else {
        bits = static_cast<uint16_t>(sign | (exponent << 10) | ((f >> 13) & 0x3FFu));
      }
    }
    std::memcpy(&bytes[2 * i], &bits, 2);
  }
  return bytes;
}

// In the child: {RequestFootprint less the wire bytes (already resident), measured growth from
// before the decode to the Forward's end} written to `fd`.
void MeasureRequest(const RequestCase& c, int fd) {
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 64 * 1024);
  const LayerConfig config = *CompleteConfig({.d_model = c.d_model, .heads = c.heads, .kv_heads = c.kv_heads});
  const LayerWeights weights = RandomLayerWeights(config, 7);
  CpuBackend backend(CpuBackendOptions{.threads = 2});
  Layer layer;
  layer.name = "footprint";
  layer.config = config;
  const Form form = c.summed ? Form::kSummed : Form::kFactored;
  layer.forms[form] = *backend.Upload(
      std::make_shared<const FormWeights>(c.summed ? MaterializeSummed(weights) : MaterializeFactored(weights)));
  std::mt19937_64 rng(13);
  std::normal_distribution<float> normal;
  std::vector<float> x(c.batch * c.n * c.d_model), ctx(c.cross ? c.batch * c.m * c.d_model : 0);
  for (float& v : x) v = normal(rng);
  for (float& v : ctx) v = normal(rng);
  const std::string x_wire = HalfBytes(x, c.bf16), ctx_wire = HalfBytes(ctx, c.bf16);
  x.clear();
  x.shrink_to_fit();
  ctx.clear();
  ctx.shrink_to_fit();
  const int dtype = static_cast<int>(c.bf16 ? WireDtype::kBFloat16 : WireDtype::kFloat16);
  const std::vector<int64_t> x_shape = {c.batch, c.n, c.d_model}, ctx_shape = {c.batch, c.m, c.d_model};
  std::vector<int32_t> key_lengths;
  for (int64_t b = 0; b < c.batch; ++b) key_lengths.push_back(static_cast<int32_t>((c.cross ? c.m : c.n) - 7 * b));
  WireForwardRequest wire;
  wire.input = WireTensor{true, dtype, x_shape, x_wire};
  if (c.cross) wire.context = WireTensor{true, dtype, ctx_shape, ctx_wire};
  wire.key_lengths = key_lengths;
  ResetPeakRss();
  const int64_t before = StatusBytes("VmRSS:");
  StatusOr<DecodedForward> decoded = DecodeForward(config, wire);
  if (!decoded.ok()) return;
  std::vector<float> y(decoded->output_elements());  // the job's output, as the service allocates it
  const std::vector<Sequence> sequences = decoded->Sequences(y.data());
  const Status st = backend.Forward(*layer.forms[form], sequences);
  const int64_t after = StatusBytes("VmHWM:");
  const Form forms[] = {form};
  const int64_t wire_bytes = static_cast<int64_t>(x_wire.size() + ctx_wire.size());
  const int64_t formula = RequestFootprint(layer, *decoded, forms, wire_bytes, &backend) - wire_bytes;
  const int64_t out[2] = {st.ok() ? formula : -1, after - before};
  (void)!write(fd, out, sizeof out);
}

// The admission charge (RequestFootprint: the float32 copies of half-precision inputs and
// contexts, the outputs, the backend's scratch by ForwardScratchBytes) against the peak RSS of
// the real decode and Forward, on grouped-query layers (whose heads the tiled attention stacks,
// kQueryTile rows at most) with several batch rows. A tile that stacked a group's heads past
// kQueryTile rows (16 MiB more per thread at 32 heads a group) is caught; the exact charge of
// each term, the context's float32 copy included, is held by footprint_test.
TEST(MemoryFootprintTest, RequestFootprintCoversHalfPrecisionGqaBatches) {
#if defined(ATTNSERVE_ASAN) || defined(ATTNSERVE_TSAN)
  GTEST_SKIP() << "RSS is not the program's allocations under a sanitizer's allocator";
#endif
  const RequestCase cases[] = {
      {"factored MQA (32 heads a group), 3 rows of 600 tokens, fp16", 256, 32, 1, 3, 600, 600, false, false, false},
      {"factored GQA cross-attention, 2 rows of 300 over 4000 keys, bf16", 256, 8, 2, 2, 300, 4000, false, true, true},
      {"summed MQA, 2 rows of 600 tokens, fp16", 128, 8, 1, 2, 600, 600, true, false, false},
  };
  for (const RequestCase& c : cases) {
    const auto [formula, measured] = InChild([&](int fd) { MeasureRequest(c, fd); });
    ASSERT_GT(formula, 0) << c.name << ": the child could not decode or run the request";
    const double formula_mb = formula / 1048576.0, measured_mb = measured / 1048576.0;
    std::printf("%-66s formula %7.1f MiB, measured peak growth %7.1f MiB, ratio %.2f\n", c.name, formula_mb,
                measured_mb, measured_mb / formula_mb);
    EXPECT_LE(measured_mb, formula_mb * 1.05 + 2) << c.name;
    // The charge is conservative for factored batches (about twice the peak: it counts stacked
    // copies of inputs and outputs that a decoded request's contiguous rows never need, and Q,
    // K, V and the heads' outputs as if all were live at once): within 2.5x.
    EXPECT_GE(measured_mb * 2.5 + 8, formula_mb) << c.name;
  }
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
    const auto [formula, measured] = InChild([&](int fd) { Measure(c, fd); });
    ASSERT_NE(measured, -1) << c.name << ": the child wrote nothing";
    const int64_t got[2] = {formula, measured};
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
