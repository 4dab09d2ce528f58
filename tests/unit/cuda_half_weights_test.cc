// --gpu-math bf16 and fp16 on the emulated device (CudaBackendOptions::math): the weights held in
// 16 bits, the projections' inputs converted on the device, float32 accumulation; attention in
// float32, or under bf16 with the fused kernel on the tensor cores (bfloat16 operands).
// Answers against the float64 reference within the format's bound and against the rounding model
// (float64 with the device's roundings: to float32's accumulation) (docs/testing.md,
// "Tolerances"), answers that really are rounded (further from float32's than float32's own
// rounding), and the device budget counting the 16-bit bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cuda/cublas_ops.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/unit/cuda_test_support.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using testing::OwnedSequence;
using testing::RandomSequence;
using testing::RelativeL2;
using testing::ScoreBound;

// The unit roundoff of the 16-bit format: 2^-8 for bfloat16 (8 significant bits), 2^-11 for
// IEEE half (11).
double UnitRoundoff(Math math) { return math == Math::kBf16 ? 0x1p-8 : 0x1p-11; }

// The bound docs/testing.md derives ("Tolerances", 16-bit weights). A 16-bit product
// y = Σ_k x̂_k ŵ_k rounds each operand once (|δ| ≤ u): its error Σ_k x_k w_k (δ_k + ε_k) has
// random-signed terms of variance ≤ 2u²/3 · (x_k w_k)², so for the suite's independent inputs it
// is ≈ √(2/3)·u of |y| whatever the depth K; λ = 4 standard deviations of it per product. The
// value path has `products` such products (2: the values and W_out; the summed form's 1: C·W_M_i),
// and Q and K each one, which move a score by up to 2·λ√(2/3)u·scale‖q‖‖k‖ and the softmax's
// weights by twice that. The float32 accumulation's own part is the depth's: λ·2^-24·Σ√K over
// the chain (backend_test.cc's GemmChainTolerance), kept although it is far smaller.
constexpr double kLambda = 4;

// Float32's accumulation over the chain's depths: λ·2^-24·Σ√K (backend_test.cc's GemmChainTolerance).
double Fp32ChainTolerance(const LayerWeights& w, const OwnedSequence& s) {
  const LayerConfig& c = w.config;
  const int64_t keys = s.key_length < 0 ? s.m : s.key_length;
  return kLambda * 0x1p-24 *
         (std::sqrt(static_cast<double>(c.d_model)) + std::sqrt(static_cast<double>(c.d_head)) +
          std::sqrt(static_cast<double>(std::max<int64_t>(keys, 1))) + std::sqrt(static_cast<double>(c.heads * c.d_head)));
}

double HalfTolerance(Math math, const LayerWeights& w, const OwnedSequence& s, int products) {
  const double u = UnitRoundoff(math), per_product = kLambda * std::sqrt(2.0 / 3.0) * u;
  return Fp32ChainTolerance(w, s) + products * per_product + 4 * per_product * ScoreBound(w, s);
}

// What the fused kernel on the tensor cores (bf16, fused) rounds beyond float32 attention, for
// the forms that take it (fused_attention.h): Q and K again (the scores' term of HalfTolerance
// once more), and the weights and the values (a product's share each). The summed form projects
// first unless mixing first is allowed, and its mix-first parts over d_model > 128 take the GEMM
// path, so the concatenating forms alone are counted here.
double TensorCoreAttentionRounding(Math math, bool gemm_attention, const FormWeights& f, const LayerWeights& w,
                                   const OwnedSequence& s) {
  if (math != Math::kBf16 || gemm_attention || !f.concat_then_project()) return 0;
  const double per_product = kLambda * std::sqrt(2.0 / 3.0) * UnitRoundoff(math);
  return 2 * per_product + 4 * per_product * ScoreBound(w, s);
}

// x rounded to the 16-bit format and widened back (round to nearest even: the device's and the
// toolkit's conversion).
double Rounded(Math math, double x) {
  const float f = static_cast<float>(x);
  if (math == Math::kFp16) return __half2float(__float2half_rn(f));
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);  // finite inputs only: the tests' weights and rows
  bits &= 0xffff0000u;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// The rounding model in float64: the answer of `form` with every 16-bit operand the device
// rounds — W_in, W_out and the rows the projections read — rounded here, and everything else
// exact. The summed form rounds nothing else, so the device must match it to float32's
// accumulation; the concatenating forms also round their heads' outputs before W_out, which
// this leaves out (HalfModelTolerance). Built from the form as uploaded: each head's value
// columns times its rows of W_out (the summed form: its value block alone), the value bias
// folded into the output bias, Q and K from the rounded inputs and weights.
std::vector<double> RoundingModelForward(Math math, const LayerWeights& w, const FormWeights& f,
                                         const OwnedSequence& s) {
  const LayerConfig& c = w.config;
  const int64_t d = c.d_model;
  LayerWeights qk = w;
  auto round_all = [&](std::vector<float>& v) {
    for (float& x : v) x = static_cast<float>(Rounded(math, x));
  };
  round_all(qk.w_q);
  round_all(qk.w_k);
  OwnedSequence rounded = s;
  round_all(rounded.input);
  round_all(rounded.context);
  auto in_at = [&](int64_t r, int64_t col) { return Rounded(math, f.w_in[r * f.in_cols() + col]); };
  auto out_at = [&](int64_t r, int64_t col) { return Rounded(math, f.w_out[r * d + col]); };
  std::vector<std::vector<double>> heads(c.heads, std::vector<double>(d * d, 0.0));
  std::vector<double> bias(f.b_out.begin(), f.b_out.end());
  if (bias.empty()) bias.assign(d, 0.0);
  for (int64_t i = 0; i < c.heads; ++i) {
    const int64_t v0 = f.q_cols + f.k_cols + f.value_offset[i], width = f.value_width[i];
    for (int64_t r = 0; r < d; ++r) {
      for (int64_t col = 0; col < d; ++col) {
        double m = 0;
        if (!f.concat_then_project()) {
          m = in_at(r, v0 + col);
        } else {
          for (int64_t t = 0; t < width; ++t) m += in_at(r, v0 + t) * out_at(f.mix_offset[i] + t, col);
        }
        heads[i][r * d + col] = m;
      }
    }
    // A value bias (the factored form's) reaches the output through W_out: rows of A sum to 1.
    if (static_cast<int64_t>(f.b_in.size()) > f.q_cols + f.k_cols && f.concat_then_project()) {
      for (int64_t col = 0; col < d; ++col) {
        for (int64_t t = 0; t < width; ++t) bias[col] += f.b_in[v0 + t] * out_at(f.mix_offset[i] + t, col);
      }
    }
  }
  return ReferenceForwardWithHeadMatrices(qk, heads, bias, rounded.View());
}

struct Case {
  Math math;
  bool gemm_attention;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(MathName(info.param.math)) + (info.param.gemm_attention ? "_gemm_attention" : "_fused");
}

class CudaHalfWeightsTest : public ::testing::TestWithParam<Case> {
 protected:
  static std::unique_ptr<Backend> Make(Math math, bool gemm_attention) {
    auto made = MakeCudaBackend(
        {.device = 0, .math = math, .gemm_attention = gemm_attention, .guard_zones = true});
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    return made.ok() ? std::move(made).value() : nullptr;
  }

  // A batch of GQA sequences of several kinds: causal self-attention, cross-attention, padded
  // keys, a single query; every input drawn from the test's seed (never zeros).
  static std::vector<OwnedSequence> Batch(std::mt19937_64& rng, int64_t d) {
    std::vector<OwnedSequence> seqs;
    seqs.push_back(RandomSequence(rng, d, 9, 9, false, true, -1));
    seqs.push_back(RandomSequence(rng, d, 5, 13, true, false, -1));
    seqs.push_back(RandomSequence(rng, d, 17, 17, false, false, 11));
    seqs.push_back(RandomSequence(rng, d, 1, 7, true, false, -1));
    return seqs;
  }

  // Runs `form` over a fresh batch on `backend`; the outputs are in the returned sequences.
  static std::vector<OwnedSequence> Run(Backend& backend, const FormWeights& form, std::vector<OwnedSequence> seqs) {
    auto resident = backend.Upload(std::make_shared<const FormWeights>(form));
    EXPECT_TRUE(resident.ok()) << resident.status().ToString();
    if (!resident.ok()) return seqs;
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    const Status st = backend.Forward(**resident, batch);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return seqs;
  }

  // The layers each case runs: with biases, GQA, and RoPE on every other.
  static LayerWeights Layer(std::mt19937_64& rng, int trial) {
    const LayerConfig c = *CompleteConfig({.d_model = 48,
                                           .heads = 4,
                                           .kv_heads = 2,
                                           .bias = true,
                                           .rope_theta = trial % 2 == 0 ? 0.0 : 10000.0});
    return RandomLayerWeights(c, rng());
  }
};

// Every form within the format's bound of float64, and further from the float32 backend's
// answer than float32 rounding goes: the weights and inputs really are rounded to 16 bits.
TEST_P(CudaHalfWeightsTest, EveryFormIsWithinTheFormatsBoundAndReallyRounded) {
  const auto [math, gemm_attention] = GetParam();
  auto half = Make(math, gemm_attention);
  auto fp32 = Make(Math::kFp32, gemm_attention);
  ASSERT_TRUE(half && fp32);
  std::mt19937_64 rng(testing::TestSeed());
  const double u = UnitRoundoff(math);
  for (int trial = 0; trial < 2; ++trial) {
    const LayerWeights w = Layer(rng, trial);
    const std::vector<OwnedSequence> inputs = Batch(rng, w.config.d_model);
    const std::vector<int64_t> full_rank(w.config.heads, w.config.d_head);
    struct Named {
      const char* name;
      FormWeights form;
      int products;  // 16-bit products on the value path (HalfTolerance)
    };
    const Named forms[] = {{"factored", MaterializeFactored(w), 2},
                           {"summed", MaterializeSummed(w), 1},
                           {"lowrank", *MaterializeLowRank(w, full_rank), 2}};
    for (const Named& f : forms) {
      const std::vector<OwnedSequence> got = Run(*half, f.form, inputs);
      const std::vector<OwnedSequence> exact32 = Run(*fp32, f.form, inputs);
      double rounded = 0;  // the largest relative distance to the float32 answer
      double worst = 0;    // the largest error over its bound: the bound's margin, reported
      double worst_model = 0;  // the same against the rounding model
      for (size_t r = 0; r < got.size(); ++r) {
        SCOPED_TRACE(std::string(f.name) + ", trial " + std::to_string(trial) + ", sequence " + std::to_string(r));
        OwnedSequence in = inputs[r];
        const std::vector<double> want = ReferenceForward(w, in.View());
        const double attention_rounding = TensorCoreAttentionRounding(math, gemm_attention, f.form, w, got[r]);
        const double bound = HalfTolerance(math, w, got[r], f.products) + attention_rounding;
        EXPECT_LT(RelativeL2(got[r].output.data(), want), bound);
        worst = std::max(worst, RelativeL2(got[r].output.data(), want) / bound);
        // Sharp: against float64 with exactly the device's roundings, the difference is float32's
        // accumulation (the summed form) plus, where heads concatenate, their outputs' rounding
        // before W_out: λ·u/√3 of the answer (each of O's values off by a uniform share of u),
        // and the tensor cores' roundings in attention, which the model keeps exact.
        const double model_bound = Fp32ChainTolerance(w, got[r]) +
                                   (f.form.concat_then_project() ? kLambda * u / std::sqrt(3.0) : 0.0) +
                                   attention_rounding;
        const double model_error = RelativeL2(got[r].output.data(), RoundingModelForward(math, w, f.form, inputs[r]));
        EXPECT_LT(model_error, model_bound) << "the device rounds what the model does not, or more than once";
        worst_model = std::max(worst_model, model_error / model_bound);
        rounded = std::max(rounded, RelativeL2(got[r].output.data(), exact32[r].output.data(), got[r].output.size()));
      }
      // Float32's own distance from float64 is under 1e-5 here; 16-bit rounding of the
      // weights and inputs moves the answers by about u (√(2/3)·u a product).
      EXPECT_GT(rounded, u / 8) << f.name << ": the answers are no further from float32's than float32 rounding goes";
      std::printf("%s %s, trial %d: worst error / bound %.3f, against the rounding model %.3f, distance to "
                  "float32 %.2e (u = %.2e)\n",
                  MathName(math).data(), f.name, trial, worst, worst_model, rounded, u);
    }
  }
}

// The device budget counts W_in and W_out at 2 bytes a value (whole floats: an odd count rounds
// up by 2 bytes), the biases at 4: what the uploads hold, half of float32's for the matrices.
TEST_P(CudaHalfWeightsTest, TheDeviceBudgetCountsTheSixteenBitBytes) {
  const auto [math, gemm_attention] = GetParam();
  std::mt19937_64 rng(testing::TestSeed());
  // d_model 9 with 3 heads of 3: W_in is 9 × 27 = 243 values, odd.
  const LayerWeights w =
      RandomLayerWeights(*CompleteConfig({.d_model = 9, .heads = 3, .kv_heads = 3, .bias = true}), rng());
  for (const FormWeights& f : {MaterializeFactored(w), MaterializeSummed(w)}) {
    auto half = Make(math, gemm_attention);
    auto fp32 = Make(Math::kFp32, gemm_attention);
    ASSERT_TRUE(half && fp32);
    ASSERT_EQ(half->DeviceMemory()->held_bytes, 0);
    auto form = std::make_shared<const FormWeights>(f);
    auto a = half->Upload(form);
    auto b = fp32->Upload(form);
    ASSERT_TRUE(a.ok() && b.ok());
    const auto halves = [](size_t n) { return static_cast<int64_t>((n + 1) / 2 * sizeof(float)); };
    const auto floats = [](size_t n) { return static_cast<int64_t>(n * sizeof(float)); };
    const int64_t biases = floats(f.b_in.size()) + floats(f.b_out.size());
    EXPECT_EQ(half->DeviceMemory()->held_bytes, halves(f.w_in.size()) + halves(f.w_out.size()) + biases);
    EXPECT_EQ(fp32->DeviceMemory()->held_bytes, floats(f.w_in.size()) + floats(f.w_out.size()) + biases);
    EXPECT_EQ(f.w_in.size() % 2, 1u) << "the case meant to have an odd count";
  }
}

// Served variants (--extra-maths): one backend, whose default math is fp32, holds a form in this
// case's 16-bit math, in TF32 and in fp32 side by side, and one lane runs them in turn. Each
// answer is bit for bit what a backend of that default math computes, so the lane's handle and
// plan follow the running form's math (CublasOps::SetMath), back and forth.
TEST_P(CudaHalfWeightsTest, OneBackendRunsEachFormInItsOwnMath) {
  const auto [math, gemm_attention] = GetParam();
  auto mixed = Make(Math::kFp32, gemm_attention);
  auto half = Make(math, gemm_attention), tf32 = Make(Math::kTf32, gemm_attention);
  auto fp32 = Make(Math::kFp32, gemm_attention);
  ASSERT_TRUE(mixed && half && tf32 && fp32);
  EXPECT_EQ(mixed->default_math(), Math::kFp32);
  EXPECT_TRUE(mixed->CheckMath(Math::kTf32).ok() && mixed->CheckMath(math).ok());
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = Layer(rng, 1);
  const std::vector<OwnedSequence> inputs = Batch(rng, w.config.d_model);
  for (const FormWeights& materialized : {MaterializeFactored(w), MaterializeSummed(w)}) {
    auto form = std::make_shared<const FormWeights>(materialized);
    auto in_half = mixed->UploadIn(form, math), in_tf32 = mixed->UploadIn(form, Math::kTf32);
    auto in_fp32 = mixed->UploadIn(form, Math::kFp32);
    ASSERT_TRUE(in_half.ok() && in_tf32.ok() && in_fp32.ok());
    EXPECT_EQ((*in_half)->math(), math);
    EXPECT_EQ((*in_tf32)->math(), Math::kTf32);
    const auto run = [&](Backend& backend, const ResidentForm& resident) {
      std::vector<OwnedSequence> seqs = inputs;
      std::vector<Sequence> batch;
      for (auto& s : seqs) batch.push_back(s.View());
      const Status st = backend.Forward(resident, batch);
      EXPECT_TRUE(st.ok()) << st.ToString();
      return seqs;
    };
    const auto same = [&](const std::vector<OwnedSequence>& got, const std::vector<OwnedSequence>& want,
                          const char* what) {
      for (size_t r = 0; r < got.size(); ++r) EXPECT_EQ(got[r].output, want[r].output) << what << ", sequence " << r;
    };
    const std::vector<OwnedSequence> want_half = Run(*half, materialized, inputs);
    const std::vector<OwnedSequence> want_tf32 = Run(*tf32, materialized, inputs);
    const std::vector<OwnedSequence> want_fp32 = Run(*fp32, materialized, inputs);
    // In turn on one backend (its one idle lane): 16 bits, fp32, TF32, fp32, 16 bits again.
    same(run(*mixed, **in_half), want_half, "16-bit first");
    same(run(*mixed, **in_fp32), want_fp32, "fp32 after 16 bits");
    same(run(*mixed, **in_tf32), want_tf32, "TF32 after fp32");
    same(run(*mixed, **in_fp32), want_fp32, "fp32 after TF32");
    same(run(*mixed, **in_half), want_half, "16 bits after fp32");
    EXPECT_NE(want_half[0].output, want_fp32[0].output) << "the case meant the maths to differ";
  }
}

// The projections' biases ride in cuBLASLt's epilogue (CublasOps::GemmHalfBias): a batch of a
// layer with biases launches no more kernels than the same layer without them, and calls as many
// GEMMs, where float32 launches a bias kernel after each biased projection. The answers are the
// other tests' (EveryFormIsWithinTheFormatsBound… runs layers with biases).
TEST_P(CudaHalfWeightsTest, TheBiasRidesInTheProjectionsEpilogue) {
  const auto [math, gemm_attention] = GetParam();
  std::mt19937_64 rng(testing::TestSeed());
  const std::vector<OwnedSequence> inputs = Batch(rng, 48);
  const uint64_t seed = rng();
  // [math][bias]: kernel launches and GEMM calls of one batch of the factored form.
  cuda_emulation::Counters counted[2][2] = {};
  for (const bool half_math : {false, true}) {
    for (const bool bias : {false, true}) {
      const LayerWeights w = RandomLayerWeights(
          *CompleteConfig({.d_model = 48, .heads = 4, .kv_heads = 2, .bias = bias}), seed);
      auto backend = Make(half_math ? math : Math::kFp32, gemm_attention);
      ASSERT_TRUE(backend);
      auto resident = backend->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
      ASSERT_TRUE(resident.ok()) << resident.status().ToString();
      std::vector<OwnedSequence> seqs = inputs;
      std::vector<Sequence> batch;
      for (auto& s : seqs) batch.push_back(s.View());
      cuda_emulation::ResetCounters();
      ASSERT_TRUE(backend->Forward(**resident, batch).ok());
      counted[half_math][bias] = cuda_emulation::ReadCounters();
    }
  }
  std::printf("%s %s, 4 sequences, factored with biases: %d launches, %d GEMM calls (float32: %d, %d)\n",
              MathName(math).data(), gemm_attention ? "GEMM path" : "fused",
              static_cast<int>(counted[1][1].kernel_launches), static_cast<int>(counted[1][1].gemm_calls),
              static_cast<int>(counted[0][1].kernel_launches), static_cast<int>(counted[0][1].gemm_calls));
  EXPECT_EQ(counted[1][1].kernel_launches, counted[1][0].kernel_launches) << "a bias kernel beside the epilogue";
  EXPECT_EQ(counted[1][1].gemm_calls, counted[1][0].gemm_calls);
  EXPECT_GT(counted[0][1].kernel_launches, counted[0][0].kernel_launches)
      << "float32 was meant to add its biases by kernel, so that the count can tell";
}

// Under 16-bit weights the inputs are rounded on the host as they are packed: 2 bytes a value
// cross to the device where float32 sends 4, and no conversion is launched. The summed form
// mixing first (CudaBackendOptions::summed_mix_first) reads the context rows themselves in
// float32, so its inputs cross in float32 and are converted on the device; its answers stay
// within the bound (a row the staging left out reads as NaN on the emulated device).
TEST_P(CudaHalfWeightsTest, InputsCrossInSixteenBitsUnlessTheFloat32RowsAreRead) {
  const auto [math, gemm_attention] = GetParam();
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = Layer(rng, 0);
  // Cross-attention with fewer queries than keys: the summed form mixes first where allowed.
  std::vector<OwnedSequence> inputs;
  inputs.push_back(RandomSequence(rng, w.config.d_model, 3, 20, true, false, -1));
  inputs.push_back(RandomSequence(rng, w.config.d_model, 2, 11, true, false, 9));
  int64_t values = 0;  // input and context values a batch stages
  for (const OwnedSequence& s : inputs) values += static_cast<int64_t>(s.input.size() + s.context.size());
  const auto staged_bytes = [&](Backend& backend, const FormWeights& form, std::vector<OwnedSequence>* seqs) {
    auto resident = backend.Upload(std::make_shared<const FormWeights>(form));
    EXPECT_TRUE(resident.ok()) << resident.status().ToString();
    std::vector<Sequence> batch;
    for (auto& s : *seqs) batch.push_back(s.View());
    cuda_emulation::ResetCounters();
    const Status st = backend.Forward(**resident, batch);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return cuda_emulation::ReadCounters().host_to_device_bytes;
  };
  // Copies besides the inputs (the GEMM path's pointer arrays) are the same under either math,
  // so the differences are the inputs'.
  auto fp32 = Make(Math::kFp32, gemm_attention), half = Make(math, gemm_attention);
  auto fp32_mix_first = MakeCudaBackend({.summed_mix_first = true, .gemm_attention = gemm_attention});
  auto mix_first = MakeCudaBackend({.math = math, .summed_mix_first = true, .gemm_attention = gemm_attention});
  ASSERT_TRUE(fp32 && half && fp32_mix_first.ok() && mix_first.ok());
  const FormWeights factored = MaterializeFactored(w), summed = MaterializeSummed(w);
  std::vector<OwnedSequence> a = inputs, b = inputs, c = inputs, e = inputs;
  EXPECT_EQ(staged_bytes(*fp32, factored, &a) - staged_bytes(*half, factored, &b), values * 2)
      << "16-bit weights: the inputs cross in 16 bits";
  EXPECT_EQ(staged_bytes(**fp32_mix_first, summed, &e), staged_bytes(**mix_first, summed, &c))
      << "the summed form mixing first reads float32 rows: they cross in float32";
  // Mixing first allowed, but no sequence of this batch has fewer queries than keys: every one
  // projects first, nothing reads the float32 rows, and the inputs cross in 16 bits.
  std::vector<OwnedSequence> project_first;
  project_first.push_back(RandomSequence(rng, w.config.d_model, 9, 4, true, false, -1));
  project_first.push_back(RandomSequence(rng, w.config.d_model, 5, 5, true, false, -1));
  int64_t project_first_values = 0;
  for (const OwnedSequence& s : project_first) {
    project_first_values += static_cast<int64_t>(s.input.size() + s.context.size());
  }
  std::vector<OwnedSequence> f32 = project_first, f16 = project_first;
  EXPECT_EQ(staged_bytes(**fp32_mix_first, summed, &f32) - staged_bytes(**mix_first, summed, &f16),
            project_first_values * 2)
      << "a batch where no sequence mixes first: the inputs cross in 16 bits";
  for (size_t r = 0; r < project_first.size(); ++r) {
    const std::vector<double> want = ReferenceForward(w, project_first[r].View());
    EXPECT_LT(RelativeL2(f16[r].output.data(), want),
              HalfTolerance(math, w, f16[r], 1) + TensorCoreAttentionRounding(math, gemm_attention, summed, w, f16[r]))
        << "summed projecting first, sequence " << r;
  }
  for (size_t r = 0; r < inputs.size(); ++r) {
    OwnedSequence in = inputs[r];
    const std::vector<double> want = ReferenceForward(w, in.View());
    EXPECT_LT(RelativeL2(b[r].output.data(), want),
              HalfTolerance(math, w, b[r], 2) + TensorCoreAttentionRounding(math, gemm_attention, factored, w, b[r]))
        << "factored, sequence " << r;
    EXPECT_LT(RelativeL2(c[r].output.data(), want), HalfTolerance(math, w, c[r], 1)) << "summed mixing first, sequence " << r;
  }
}

// GemmHalfBias on random bf16 operands: y = x·w + bias + beta·y in one cuBLASLt call where the
// epilogue can take the bias, checked against float64 of the operands' 16-bit values.
class CudaGemmHalfBiasTest : public ::testing::Test {
 protected:
  static constexpr int64_t kRows = 5, kInner = 24, kCols = 12;

  void SetUp() override {
    cuda_emulation::Reset();
    std::mt19937_64 rng(testing::TestSeed());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x_.resize(kRows * kInner);
    w_.resize(kInner * kCols);
    for (uint16_t& v : x_) v = __bfloat16_as_ushort(__float2bfloat16_rn(normal(rng)));
    for (uint16_t& v : w_) v = __bfloat16_as_ushort(__float2bfloat16_rn(normal(rng)));
    bias_.resize(kCols + 1);
    y0_.resize(kRows * kCols);
    for (float& b : bias_) b = normal(rng);
    for (float& v : y0_) v = normal(rng);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dx_), x_.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dw_), w_.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dx_, x_.data(), x_.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dw_, w_.data(), w_.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    dbias_ = std::make_unique<testing::DeviceVector>(bias_);
    dy_ = std::make_unique<testing::DeviceVector>(y0_);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_TRUE(ops_.Init(stream_, Math::kBf16).ok());
  }

  void TearDown() override {
    ops_.Destroy();
    cudaStreamDestroy(stream_);
    dbias_.reset();
    dy_.reset();
    cudaFree(dx_);
    cudaFree(dw_);
    cuda_emulation::Reset();
  }

  StatusOr<bool> GemmHalfBias(const float* bias) {
    const cuda::HalfBlock hx{dx_, kRows, kInner, kInner}, hw{dw_, kInner, kCols, kCols};
    return ops_.GemmHalfBias(hx, hw, bias, cuda::DeviceBlock{dy_->data, kRows, kCols, kCols}, 1.0f);
  }
  const float* AlignedBias() const { return dbias_->data; }

  // y after one GemmHalfBias of the aligned bias, against float64.
  void ExpectOneProductWithBias() {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << cuda_emulation::LastDiagnostic();
    const std::vector<float> got = dy_->Read();
    const auto widen = [](uint16_t v) { return static_cast<double>(__bfloat162float(__ushort_as_bfloat16(v))); };
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        double want = y0_[r * kCols + c] + bias_[c];
        for (int64_t t = 0; t < kInner; ++t) want += widen(x_[r * kInner + t]) * widen(w_[t * kCols + c]);
        EXPECT_NEAR(got[r * kCols + c], want, 1e-4) << "row " << r << " column " << c;
      }
    }
  }

 private:
  std::vector<uint16_t> x_, w_;
  std::vector<float> bias_, y0_;
  uint16_t *dx_ = nullptr, *dw_ = nullptr;
  std::unique_ptr<testing::DeviceVector> dbias_, dy_;
  cudaStream_t stream_ = nullptr;
  cuda::CublasOps ops_;
};

// Where the epilogue cannot take the bias (a bias not 16-byte aligned, as a slice of a bias
// vector may start), GemmHalfBias queues nothing and says so, and the caller's GemmHalf and bias
// kernel run; where it can, one call does it all.
TEST_F(CudaGemmHalfBiasTest, TheEpilogueTakesAnAlignedBiasAndDeclinesAnotherWithNothingQueued) {
  cuda_emulation::ResetCounters();
  auto declined = GemmHalfBias(AlignedBias() + 1);  // 4 bytes past an aligned start
  ASSERT_TRUE(declined.ok()) << declined.status().ToString();
  EXPECT_FALSE(*declined);
  EXPECT_EQ(cuda_emulation::ReadCounters().gemm_calls, 0);
  auto taken = GemmHalfBias(AlignedBias());
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_TRUE(*taken);
  EXPECT_EQ(cuda_emulation::ReadCounters().gemm_calls, 1);
  ExpectOneProductWithBias();
}

// A plan whose making failed halfway (cuBLASLt out of memory for a layout, after the matmul's
// descriptor was made) is not kept: the call fails with RESOURCE_EXHAUSTED naming the status, and
// the next call of that shape makes the plan again and takes the epilogue, rather than finding
// "no algorithm" and leaving the shape on the slower path. (Under ASan, the half-made
// descriptors are checked for leaks.)
TEST_F(CudaGemmHalfBiasTest, APlanWhoseMakingFailedIsNotKeptAndTheNextCallMakesIt) {
  cuda_emulation::InjectFault(cuda_emulation::Fault::kLtLayoutAllocFailed);
  cuda_emulation::ResetCounters();
  auto failed = GemmHalfBias(AlignedBias());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kResourceExhausted) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos)
      << failed.status().ToString();
  EXPECT_EQ(cuda_emulation::ReadCounters().gemm_calls, 0);
  auto taken = GemmHalfBias(AlignedBias());
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_TRUE(*taken) << "the shape's plan was made again, not remembered as having no algorithm";
  EXPECT_EQ(cuda_emulation::ReadCounters().gemm_calls, 1);
  ExpectOneProductWithBias();
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaHalfWeightsTest,
                         ::testing::Values(Case{Math::kBf16, false}, Case{Math::kBf16, true},
                                           Case{Math::kFp16, false}, Case{Math::kFp16, true}),
                         CaseName);

}  // namespace
}  // namespace attnserve
