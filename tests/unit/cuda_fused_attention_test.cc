// The fused attention kernel (server/backend/cuda/fused_attention.cu) on the emulated device:
// the kernel alone against float64 over what the attention path covers (ragged ranges in one
// launch, causal from a block's first row on, GQA, key padding, cross-attention, values wider
// or narrower than d_head, more keys than one tile and more rows than one tile), rows whose
// scores overflow float32 recomputed in float64, and through the backend: one launch per 48
// sequences, no score or mix GEMM, and no score piece in the workspace.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/fused_attention.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "tests/unit/cuda_test_support.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using testing::DeviceVector;
using testing::RandomSequence;
using testing::RelativeL2;

class CudaFusedAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda_emulation::Reset();
    cudaGetLastError();
  }
  void TearDown() override { cuda_emulation::Reset(); }
  std::mt19937_64 rng_{testing::TestSeed()};
};

// One range of a launch, on the host: its queries [rows, q_ld], keys and values [m, ·] (keys
// [0, visible) seen), its answer [rows, out_ld].
struct HostRange {
  int64_t rows = 0, m = 0, visible = 0, first_row = 0;
  bool causal = false;
  std::vector<float> q, k, values;
};

// Head `head`'s answer for row r of `range` in float64: softmax(scale · q kᵀ) over the keys row r
// sees, times the values.
std::vector<double> Expected(const HostRange& range, const cuda::FusedLayout& l, int64_t head, int64_t r) {
  const int64_t kv = head / l.group;
  const int64_t visible = range.causal ? std::min(range.visible, range.first_row + r + 1) : range.visible;
  std::vector<double> score(visible);
  double top = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    double dot = 0;
    for (int64_t t = 0; t < l.d_head; ++t) {
      dot += static_cast<double>(range.q[r * l.q_ld + head * l.d_head + t]) * range.k[j * l.k_ld + kv * l.d_head + t];
    }
    score[j] = static_cast<double>(l.scale) * dot;
    top = std::max(top, score[j]);
  }
  double sum = 0;
  for (double& s : score) sum += (s = std::exp(s - top));
  std::vector<double> out(l.width, 0.0);
  for (int64_t j = 0; j < visible; ++j) {
    for (int64_t c = 0; c < l.width; ++c)
      out[c] += score[j] / sum * range.values[j * l.values_ld + head / l.value_group * l.value_stride + c];
  }
  return out;
}

// Runs `ranges` in one launch and compares every row and head with float64; returns the answers.
void ExpectFloat64(const std::vector<HostRange>& ranges, const cuda::FusedLayout& l, double tolerance,
                   const std::string& label) {
  std::vector<std::unique_ptr<DeviceVector>> held;
  cuda::FusedRanges launch;
  for (const HostRange& r : ranges) {
    held.push_back(std::make_unique<DeviceVector>(r.q));
    const float* q = held.back()->data;
    held.push_back(std::make_unique<DeviceVector>(r.k));
    const float* k = held.back()->data;
    held.push_back(std::make_unique<DeviceVector>(r.values));
    const float* v = held.back()->data;
    // Poisoned answers: a row or column the kernel should write and does not stays NaN.
    held.push_back(std::make_unique<DeviceVector>(std::vector<float>(r.rows * l.out_ld, std::nanf(""))));
    launch.range[launch.count++] = {.q = q,
                                    .k = k,
                                    .values = v,
                                    .out = held.back()->data,
                                    .first_row = r.first_row,
                                    .rows = static_cast<int32_t>(r.rows),
                                    .keys = static_cast<int32_t>(r.visible),
                                    .causal = r.causal};
  }
  cuda_emulation::ResetCounters();
  ASSERT_EQ(cuda::FusedAttention(launch, l, nullptr), cudaSuccess) << label;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << label << ": " << cuda_emulation::LastDiagnostic();
  EXPECT_EQ(cuda_emulation::ReadCounters().kernel_launches, 1) << label;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const std::vector<float> got = held[4 * i + 3]->Read();
    for (int64_t r = 0; r < ranges[i].rows; ++r) {
      for (int64_t h = 0; h < l.heads; ++h) {
        const std::vector<double> want = Expected(ranges[i], l, h, r);
        EXPECT_LT(RelativeL2(&got[r * l.out_ld + h * l.width], want), tolerance)
            << label << ": range " << i << " row " << r << " head " << h;
      }
    }
  }
}

HostRange RandomRange(std::mt19937_64& rng, const cuda::FusedLayout& l, int64_t rows, int64_t m, int64_t visible,
                      int64_t first_row, bool causal) {
  HostRange r;
  r.rows = rows, r.m = m, r.visible = visible, r.first_row = first_row, r.causal = causal;
  r.q = testing::RandomVector(rng, rows * l.q_ld, 1.5f);
  r.k = testing::RandomVector(rng, m * l.k_ld, 1.5f);
  r.values = testing::RandomVector(rng, m * l.values_ld);
  // Later keys score higher on the whole: each row's max grows from tile to tile, so a partial
  // sum or mix not rescaled to the new max is far off.
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t t = 0; t < l.k_ld; ++t) r.k[j * l.k_ld + t] *= 1.0f + static_cast<float>(j) / 24.0f;
  }
  return r;
}

// Shapes of heads — MHA, GQA (3 query heads a kv head), the values every head reads the same
// columns of and wider than d_head (the summed form mixing first), the kernel's bounds, values
// of each query head's own narrower than d_head (the low-rank form at one rank) — each
// over ragged ranges in one launch: one row and one key; a causal sequence of 37 rows (three
// query tiles, two key tiles); a block of rows starting at row 30 of a causal sequence; a cross
// attention of 5 queries to 100 keys of which 70 are seen (padding); 16 rows and 33 keys (a
// second key tile of one key).
TEST_F(CudaFusedAttentionTest, MatchesFloat64OverRaggedCausalPaddedAndGroupedRanges) {
  struct Shape {
    int32_t heads, group, d_head, width, value_stride, value_group;
  };
  for (const Shape& s : {Shape{4, 1, 16, 16, 16, 1}, Shape{6, 3, 24, 24, 24, 3}, Shape{3, 3, 8, 40, 0, 1},
                         Shape{2, 2, 128, 128, 0, 1}, Shape{2, 1, 5, 7, 7, 1}, Shape{4, 2, 12, 6, 6, 1}}) {
    const int32_t kv_heads = s.heads / s.group;
    cuda::FusedLayout l{.q_ld = s.heads * s.d_head + 3,
                        .k_ld = kv_heads * s.d_head + 1,
                        .values_ld = (s.heads / s.value_group - 1) * s.value_stride + s.width + 2,
                        .out_ld = s.heads * s.width + 5,
                        .heads = s.heads,
                        .group = s.group,
                        .d_head = s.d_head,
                        .width = s.width,
                        .value_stride = s.value_stride,
                        .value_group = s.value_group,
                        .scale = 1.0f / std::sqrt(static_cast<float>(s.d_head))};
    std::vector<HostRange> ranges;
    ranges.push_back(RandomRange(rng_, l, 1, 1, 1, 0, false));
    ranges.push_back(RandomRange(rng_, l, 37, 37, 37, 0, true));
    ranges.push_back(RandomRange(rng_, l, 20, 50, 50, 30, true));
    ranges.push_back(RandomRange(rng_, l, 5, 100, 70, 0, false));
    ranges.push_back(RandomRange(rng_, l, 16, 33, 33, 0, false));
    ExpectFloat64(ranges, l, 1e-5,
                  "heads " + std::to_string(s.heads) + " group " + std::to_string(s.group) + " d_head " +
                      std::to_string(s.d_head) + " width " + std::to_string(s.width));
  }
}

// Scores past float32's range (q·k of inputs ~1e20 is ~1e41): such a row is recomputed in
// float64 from Q, K and the values and must match the float64 answer, while the rows of
// ordinary scores in the same launch keep the float32 path; a query that itself overflowed
// gives a NaN row (the service's OUT_OF_RANGE), never an answer that looks right.
TEST_F(CudaFusedAttentionTest, RowsWhoseScoresOverflowAreComputedInFloat64) {
  for (const int64_t keys : {7, 33, 100}) {
    for (const bool causal : {false, true}) {
      const cuda::FusedLayout l{.q_ld = 4 * 8 + 3,
                                .k_ld = 2 * 8 + 5,
                                .values_ld = 2 * 8,
                                .out_ld = 4 * 8,
                                .heads = 4,
                                .group = 2,
                                .d_head = 8,
                                .width = 8,
                                .value_stride = 8,
                                .value_group = 2,
                                .scale = 1.0f / std::sqrt(8.0f)};
      HostRange r = RandomRange(rng_, l, 6, keys, keys, 2, causal);
      // Head 0 keeps unit-scale queries; the others' are ~1e20, as are all keys.
      for (int64_t row = 0; row < r.rows; ++row) {
        for (int64_t c = l.d_head; c < l.q_ld; ++c) r.q[row * l.q_ld + c] *= 1e20f;
      }
      for (float& v : r.k) v *= 1e20f;
      const int64_t nan_row = 5, nan_head = 3;
      r.q[nan_row * l.q_ld + nan_head * l.d_head + 1] = INFINITY;  // its projection overflowed
      DeviceVector q(r.q), k(r.k), v(r.values), out(std::vector<float>(r.rows * l.out_ld, std::nanf("")));
      cuda::FusedRanges launch;
      launch.count = 1;
      launch.range[0] = {.q = q.data,
                         .k = k.data,
                         .values = v.data,
                         .out = out.data,
                         .first_row = r.first_row,
                         .rows = static_cast<int32_t>(r.rows),
                         .keys = static_cast<int32_t>(keys),
                         .causal = causal};
      ASSERT_EQ(cuda::FusedAttention(launch, l, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cuda_emulation::LastDiagnostic();
      const std::vector<float> got = out.Read();
      for (int64_t row = 0; row < r.rows; ++row) {
        for (int64_t h = 0; h < l.heads; ++h) {
          const std::string where = "keys " + std::to_string(keys) + (causal ? " causal" : "") + " row " +
                                    std::to_string(row) + " head " + std::to_string(h);
          const float* answer = &got[row * l.out_ld + h * l.width];
          if (row == nan_row && h == nan_head) {
            for (int64_t c = 0; c < l.width; ++c) EXPECT_TRUE(std::isnan(answer[c])) << where << " column " << c;
            continue;
          }
          EXPECT_LT(RelativeL2(answer, Expected(r, l, h, row)), 1e-5) << where;
        }
      }
    }
  }
}

// Through the backend: 70 small GQA requests with RoPE (factored, no bias) of 5 shapes, causal
// and not, as CudaEmulationTest.LaunchesPerBatchArePinned sends them to the GEMM path. Fused:
// [Q | K] and the value block (2 GEMMs), Q and K rotated (2 · 2 launches), every sequence's
// attention in ⌈70 / 48⌉ = 2 launches, the output projection (1 GEMM): no score or mix GEMM,
// no softmax launch. Every answer against float64.
TEST_F(CudaFusedAttentionTest, ABatchCostsOneLaunchPer48SequencesAndNoAttentionGemm) {
  const cuda_emulation::Counters counters = testing::RunPinnedLaunchBatch({}, rng_);
  EXPECT_EQ(counters.kernel_launches, 2 * 2 + 2);
  EXPECT_EQ(counters.gemm_calls, 2 + 1);
}

// The scores never reach device memory: a causal sequence of 512 tokens, whose scores would
// be 4 MiB, holds a workspace of only its pieces linear in the tokens when fused; the same
// batch on the GEMM path holds its scores too. The factored form and the summed form mixing
// first (d_model 64: its heads read the whole context) both, against float64.
TEST_F(CudaFusedAttentionTest, TheWorkspaceHoldsNoScores) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 64, .heads = 4, .d_head = 16}), rng_());
  const LayerConfig& c = w.config;
  constexpr int64_t kTokens = 512, kContext = 640;
  const int64_t whole_scores = c.heads * kTokens * kContext * static_cast<int64_t>(sizeof(float));
  testing::OwnedSequence seq = RandomSequence(rng_, c.d_model, kTokens, kContext, true, false, 600);
  const std::vector<double> want = ReferenceForward(w, seq.View());
  for (const Form form : {Form::kFactored, Form::kSummed}) {
    auto weights =
        std::make_shared<const FormWeights>(form == Form::kFactored ? MaterializeFactored(w) : MaterializeSummed(w));
    int64_t workspace[2] = {};
    for (const bool gemm : {false, true}) {
      auto made = MakeCudaBackend({.summed_mix_first = true, .gemm_attention = gemm});
      ASSERT_TRUE(made.ok());
      auto resident = (*made)->Upload(weights);
      ASSERT_TRUE(resident.ok()) << resident.status().ToString();
      const int64_t before = cuda_emulation::LiveDeviceBytes();
      const Sequence batch[] = {seq.View()};
      std::fill(seq.output.begin(), seq.output.end(), std::nanf(""));
      ASSERT_TRUE((*made)->Forward(**resident, batch).ok());
      workspace[gemm] = cuda_emulation::LiveDeviceBytes() - before;
      EXPECT_LT(RelativeL2(seq.output.data(), want), 1e-5) << FormName(form) << (gemm ? " gemm" : " fused");
    }
    EXPECT_LT(workspace[0], workspace[1] - whole_scores / 2)
        << FormName(form) << ": fused " << workspace[0] << " bytes, GEMM path " << workspace[1];
    std::cout << "[ info     ] " << FormName(form) << ": device workspace fused " << workspace[0]
              << " bytes, GEMM path " << workspace[1] << " (the scores: " << whole_scores << ")\n";
  }
}

}  // namespace
}  // namespace attnserve
