// The fused attention kernel (server/backend/cuda/fused_attention.cu) on the emulated device:
// the kernel alone against float64 over what the attention path covers (ragged ranges in one
// launch, causal from a block's first row on, GQA, key padding, cross-attention, values wider
// or narrower than d_head, more keys than one tile and more rows than one tile), rows whose
// scores overflow float32 recomputed in float64, and through the backend: one launch per 48
// sequences, no score or mix GEMM, and no score piece in the workspace.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
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

// x rounded to bfloat16 and widened back (to nearest even, as the device converts).
double Bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Head `head`'s answer for row r of `range` in float64: softmax(scale · q kᵀ) over the keys row r
// sees, times the values; with `bf16`, of q, k and the values rounded to bfloat16 first (the
// tensor-core kernel's operands: its rounding model but for the weights' rounding).
// `weight_rounding`, if given, gets the standard deviation of the answer's error (its L2 norm) when
// each weight p_j is rounded by an independent uniform share of u = 2^-8 and the row normalised by
// the rounded weights' sum: the answer moves by Σ_j p_j δ_j (v_j − answer), of variance
// u²/3 · Σ_j p_j² ‖v_j − answer‖².
std::vector<double> Expected(const HostRange& range, const cuda::FusedLayout& l, int64_t head, int64_t r,
                             bool bf16 = false, double* weight_rounding = nullptr) {
  const auto in = [&](float x) { return bf16 ? Bf16(x) : static_cast<double>(x); };
  const int64_t kv = head / l.group;
  const int64_t visible = range.causal ? std::min(range.visible, range.first_row + r + 1) : range.visible;
  std::vector<double> score(visible);
  double top = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    double dot = 0;
    for (int64_t t = 0; t < l.d_head; ++t) {
      dot += in(range.q[r * l.q_ld + head * l.d_head + t]) * in(range.k[j * l.k_ld + kv * l.d_head + t]);
    }
    score[j] = static_cast<double>(l.scale) * dot;
    top = std::max(top, score[j]);
  }
  double sum = 0;
  for (double& s : score) sum += (s = std::exp(s - top));
  std::vector<double> out(l.width, 0.0);
  for (int64_t j = 0; j < visible; ++j) {
    for (int64_t c = 0; c < l.width; ++c)
      out[c] += score[j] / sum * in(range.values[j * l.values_ld + head / l.value_group * l.value_stride + c]);
  }
  if (weight_rounding != nullptr) {
    double variance = 0;
    for (int64_t j = 0; j < visible; ++j) {
      const double p = score[j] / sum;
      for (int64_t c = 0; c < l.width; ++c) {
        const double dv = in(range.values[j * l.values_ld + head / l.value_group * l.value_stride + c]) - out[c];
        variance += p * p * dv * dv;
      }
    }
    *weight_rounding = 0x1p-8 * std::sqrt(variance / 3);
  }
  return out;
}

// What float32's scores add to an answer's error: a score q·k summed in float32 is off by up to
// about 2^-24·‖q‖‖k‖ (the products' magnitudes, not the sum's), the exponential's argument by
// its scale times that, and the softmax's weights by twice it; λ = 4 of that for the row's
// largest key. Large where the keys grow tile by tile (RandomRange), nothing at unit scores.
double ScoreTerm(const HostRange& range, const cuda::FusedLayout& l, int64_t head, int64_t r) {
  const int64_t kv = head / l.group;
  double q = 0, k = 0;
  for (int64_t t = 0; t < l.d_head; ++t) q += std::pow(range.q[r * l.q_ld + head * l.d_head + t], 2);
  for (int64_t j = 0; j < range.visible; ++j) {
    double kj = 0;
    for (int64_t t = 0; t < l.d_head; ++t) kj += std::pow(range.k[j * l.k_ld + kv * l.d_head + t], 2);
    k = std::max(k, kj);
  }
  return 4 * 2 * 0x1p-24 * l.scale * std::sqrt(q * k);
}

// Runs `ranges` in one launch of `kernel` and compares every row and head with float64 (with
// `bf16`, of the operands rounded to bfloat16); returns the answers per range.
using Kernel = cudaError_t (*)(cuda::FusedRanges, const cuda::FusedLayout&, cudaStream_t);
std::vector<std::vector<float>> ExpectFloat64(const std::vector<HostRange>& ranges, const cuda::FusedLayout& l,
                                              double tolerance, const std::string& label,
                                              Kernel kernel = cuda::FusedAttention, bool bf16 = false) {
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
  std::vector<std::vector<float>> answers;
  EXPECT_EQ(kernel(launch, l, nullptr), cudaSuccess) << label;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << label << ": " << cuda_emulation::LastDiagnostic();
  EXPECT_EQ(cuda_emulation::ReadCounters().kernel_launches, 1) << label;
  for (size_t i = 0; i < ranges.size(); ++i) {
    answers.push_back(held[4 * i + 3]->Read());
    const std::vector<float>& got = answers.back();
    for (int64_t r = 0; r < ranges[i].rows; ++r) {
      for (int64_t h = 0; h < l.heads; ++h) {
        const std::vector<double> want = Expected(ranges[i], l, h, r, bf16);
        EXPECT_LT(RelativeL2(&got[r * l.out_ld + h * l.width], want), tolerance + ScoreTerm(ranges[i], l, h, r))
            << label << ": range " << i << " row " << r << " head " << h;
      }
    }
  }
  return answers;
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
// of each query head's own narrower than d_head (the low-rank form at one rank) — each with
// leading dimensions past its columns.
std::vector<cuda::FusedLayout> Layouts() {
  struct Shape {
    int32_t heads, group, d_head, width, value_stride, value_group;
  };
  std::vector<cuda::FusedLayout> layouts;
  for (const Shape& s : {Shape{4, 1, 16, 16, 16, 1}, Shape{6, 3, 24, 24, 24, 3}, Shape{3, 3, 8, 40, 0, 1},
                         Shape{2, 2, 128, 128, 0, 1}, Shape{2, 1, 5, 7, 7, 1}, Shape{4, 2, 12, 6, 6, 1}}) {
    const int32_t kv_heads = s.heads / s.group;
    layouts.push_back({.q_ld = s.heads * s.d_head + 3,
                       .k_ld = kv_heads * s.d_head + 1,
                       .values_ld = (s.heads / s.value_group - 1) * s.value_stride + s.width + 2,
                       .out_ld = s.heads * s.width + 5,
                       .heads = s.heads,
                       .group = s.group,
                       .d_head = s.d_head,
                       .width = s.width,
                       .value_stride = s.value_stride,
                       .value_group = s.value_group,
                       .scale = 1.0f / std::sqrt(static_cast<float>(s.d_head))});
  }
  return layouts;
}

std::string Label(const cuda::FusedLayout& l) {
  return "heads " + std::to_string(l.heads) + " group " + std::to_string(l.group) + " d_head " +
         std::to_string(l.d_head) + " width " + std::to_string(l.width);
}

// Ragged ranges for one launch: one row and one key; a causal sequence of 37 rows (three query
// tiles of the float32 kernel, two key tiles); a block of rows starting at row 30 of a causal
// sequence; a cross attention of 5 queries to 100 keys of which 70 are seen (padding); 16 rows
// and 33 keys (a second key tile of one key); and 70 causal rows over 131 keys (two query tiles
// and three key tiles of the tensor-core kernel, its second query tile's last key tile short).
std::vector<HostRange> RaggedRanges(std::mt19937_64& rng, const cuda::FusedLayout& l) {
  std::vector<HostRange> ranges;
  ranges.push_back(RandomRange(rng, l, 1, 1, 1, 0, false));
  ranges.push_back(RandomRange(rng, l, 37, 37, 37, 0, true));
  ranges.push_back(RandomRange(rng, l, 20, 50, 50, 30, true));
  ranges.push_back(RandomRange(rng, l, 5, 100, 70, 0, false));
  ranges.push_back(RandomRange(rng, l, 16, 33, 33, 0, false));
  ranges.push_back(RandomRange(rng, l, 70, 131, 131, 61, true));
  return ranges;
}

TEST_F(CudaFusedAttentionTest, MatchesFloat64OverRaggedCausalPaddedAndGroupedRanges) {
  for (const cuda::FusedLayout& l : Layouts()) ExpectFloat64(RaggedRanges(rng_, l), l, 1e-5, Label(l));
}

// The tensor-core kernel (--gpu-math bf16) over the same ranges and heads. Against float64 of
// its operands rounded to bfloat16 (q, k and the values), the one rounding left is the weights'
// (Expected's weight_rounding: its standard deviation for this row), held to λ = 4 of it plus
// float32's accumulation (1e-5 and the scores' ScoreTerm). A fragment loaded into the wrong lane or register mixes the wrong
// scores or columns, off by the answer's own size. And it really rounds: its answers are further
// from the float32 kernel's than float32's accumulation goes (at least u/16).
TEST_F(CudaFusedAttentionTest, Bf16KernelIsTheRoundingModelOfItsBfloat16Operands) {
  constexpr double kU = 0x1p-8, kLambda = 4;
  for (const cuda::FusedLayout& l : Layouts()) {
    const std::vector<HostRange> ranges = RaggedRanges(rng_, l);
    // Every row written and finite (within 1 of the model), then each against its own bound.
    const auto bf16 = ExpectFloat64(ranges, l, 1.0, Label(l) + " bf16", cuda::FusedAttentionBf16, true);
    const auto fp32 = ExpectFloat64(ranges, l, 1e-5, Label(l), cuda::FusedAttention);
    double distance = 0, worst = 0;  // to the float32 kernel; to the model, over the bound
    for (size_t i = 0; i < ranges.size(); ++i) {
      for (int64_t r = 0; r < ranges[i].rows; ++r) {
        for (int64_t h = 0; h < l.heads; ++h) {
          const int64_t at = r * l.out_ld + h * l.width;
          double spread = 0;
          const std::vector<double> model = Expected(ranges[i], l, h, r, true, &spread);
          double norm = 0;
          for (double v : model) norm += v * v;
          const double bound = kLambda * spread / std::sqrt(norm) + 1e-5 + ScoreTerm(ranges[i], l, h, r);
          const double error = RelativeL2(&bf16[i][at], model);
          EXPECT_LT(error, bound) << Label(l) << ": range " << i << " row " << r << " head " << h;
          worst = std::max(worst, error / bound);
          distance = std::max(distance, RelativeL2(&bf16[i][at], &fp32[i][at], l.width));
        }
      }
    }
    EXPECT_GT(distance, kU / 16) << Label(l) << ": no further from float32's answers than float32 goes";
    std::cout << "[ info     ] bf16 kernel, " << Label(l) << ": worst error / bound " << worst
              << ", distance to float32's " << distance << "\n";
  }
}

// Scores past float32's range (q·k of inputs ~1e20 is ~1e41): such a row is recomputed in
// float64 from Q, K and the values and must match the float64 answer, while the rows of
// ordinary scores in the same launch keep the float32 path; a query that itself overflowed
// gives a NaN row (the service's OUT_OF_RANGE), never an answer that looks right. Both kernels:
// the tensor-core one's ordinary rows against its rounding model, its float64 rows as exact.
TEST_F(CudaFusedAttentionTest, RowsWhoseScoresOverflowAreComputedInFloat64) {
  for (const bool bf16 : {false, true})
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
      // 13 rows: in the tensor-core kernel each lane holds two rows, r and r + 8, and rows of
      // both halves take the float64 path.
      HostRange r = RandomRange(rng_, l, 13, keys, keys, 2, causal);
      // Head 0 keeps unit-scale queries; the others' are ~1e20, as are all keys.
      for (int64_t row = 0; row < r.rows; ++row) {
        for (int64_t c = l.d_head; c < l.q_ld; ++c) r.q[row * l.q_ld + c] *= 1e20f;
      }
      for (float& v : r.k) v *= 1e20f;
      const int64_t nan_row = 11, nan_head = 3;
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
      ASSERT_EQ((bf16 ? cuda::FusedAttentionBf16 : cuda::FusedAttention)(launch, l, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cuda_emulation::LastDiagnostic();
      const std::vector<float> got = out.Read();
      for (int64_t row = 0; row < r.rows; ++row) {
        for (int64_t h = 0; h < l.heads; ++h) {
          const std::string where = std::string(bf16 ? "bf16 " : "") + "keys " + std::to_string(keys) +
                                    (causal ? " causal" : "") + " row " +
                                    std::to_string(row) + " head " + std::to_string(h);
          const float* answer = &got[row * l.out_ld + h * l.width];
          if (row == nan_row && h == nan_head) {
            for (int64_t c = 0; c < l.width; ++c) EXPECT_TRUE(std::isnan(answer[c])) << where << " column " << c;
            continue;
          }
          // Head 0's scores stay finite: the bfloat16 kernel's own path, its operands rounded.
          const bool rounded = bf16 && h == 0;
          EXPECT_LT(RelativeL2(answer, Expected(r, l, h, row, rounded)), rounded ? 0x1p-8 : 1e-5) << where;
        }
      }
    }
  }
}

// Which kernel a lane runs by its math: under bf16 the tensor-core kernel, whose roundings of Q,
// K, the weights and the values move the answer from the same lane's GEMM path (float32
// attention) by about u; under fp16 the float32 kernel, whose answers match the GEMM path's to
// float32's accumulation and the odd half rounding it tips (fp16's range would overflow scores
// and values float32 holds), 4 times closer than bfloat16's nearest.
TEST_F(CudaFusedAttentionTest, UnderBf16TheLaneRunsTheTensorCoreKernelAndUnderFp16TheFloat32One) {
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 64, .heads = 4, .kv_heads = 2}), rng_());
  const auto form = std::make_shared<const FormWeights>(MaterializeFactored(w));
  testing::OwnedSequence seq = RandomSequence(rng_, w.config.d_model, 40, 40, true, false, -1);
  for (const Math math : {Math::kBf16, Math::kFp16}) {
    std::vector<float> answers[2];
    for (const bool gemm : {false, true}) {
      auto made = MakeCudaBackend({.math = math, .gemm_attention = gemm});
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      auto resident = (*made)->Upload(form);
      ASSERT_TRUE(resident.ok()) << resident.status().ToString();
      const Sequence batch[] = {seq.View()};
      ASSERT_TRUE((*made)->Forward(**resident, batch).ok());
      answers[gemm] = seq.output;
    }
    const double apart = RelativeL2(answers[0].data(), answers[1].data(), answers[0].size());
    std::cout << "[ info     ] " << MathName(math) << ": fused against the GEMM path " << apart << "\n";
    if (math == Math::kBf16) {
      EXPECT_GT(apart, 0x1p-8 / 16) << "bf16: the fused answer is float32 attention's";
      EXPECT_LT(apart, 4 * 0x1p-8) << "bf16: the two attention paths are further apart than bfloat16 rounding goes";
    } else {
      // Float32 attention both, summed in different orders: O differs by float32's rounding,
      // which now and then tips one of O's half roundings before W_out (u = 2^-11 each).
      EXPECT_LT(apart, 0x1p-8 / 64) << "fp16: the fused kernel is not the float32 one";
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
