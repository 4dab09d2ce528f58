// Served variants (server/core/math.h): one form held in several maths side by side on one
// backend. The CPU backend's UploadIn (fp32, bf16 and fp16 resident at once, each computing in its
// own math, against float64) and what it refuses; the layer store holding every form in every math
// and counting the bytes of each; the executor running a job in the math it names, its observer
// hearing the variant.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <vector>

#include "server/backend/cpu/bf16_dot_gemm.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/skinny_gemm.h"
#include "server/batching/batching_executor.h"
#include "server/core/forms.h"
#include "server/core/math.h"
#include "server/core/reference.h"
#include "server/store/layer_store.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Runs `on` over one self-attention sequence of `input` ([n, d]) into `out`.
Status RunOne(Backend& backend, const ResidentForm& on, const std::vector<float>& input, int64_t n, int64_t d,
              std::vector<float>& out) {
  Sequence s;
  s.input = ConstMatrixView(input.data(), n, d);
  s.output = MatrixView(out.data(), n, d);
  return backend.Forward(on, std::span<const Sequence>(&s, 1));
}

TEST(MathTest, NamesParseBothWays) {
  for (Math m : kAllMaths) EXPECT_EQ(ParseMath(MathName(m)), m);
  EXPECT_EQ(ParseMath("fp64"), std::nullopt);
  EXPECT_EQ(ParseMath(""), std::nullopt);
  EXPECT_TRUE(HalfWeights(Math::kBf16) && HalfWeights(Math::kFp16));
  EXPECT_FALSE(HalfWeights(Math::kFp32) || HalfWeights(Math::kTf32));
}

// One CpuBackend holds the factored and summed forms in fp32, bf16 and fp16 at once; each
// resident form computes in its own math: fp32 to float32's rounding of float64, bf16 within
// bfloat16's (2^-9 per weight, and per input where vdpbf16ps runs) and measurably further than
// fp32, fp16 within IEEE half's (2^-12 per weight: at least 4 times closer than bf16 and still
// further than fp32); the 16-bit panels are half the bytes. d_model and the head width are whole
// panels, so every block is packed.
TEST(MathVariantsTest, TheCpuHoldsAFormInFp32Bf16AndFp16SideBySide) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: bf16 and fp16 need the backend's own kernel";
  const LayerConfig config = *CompleteConfig({.d_model = 128, .heads = 2});
  const LayerWeights weights = RandomLayerWeights(config, testing::TestSeed() + 7);
  CpuBackend backend({.threads = 2});
  EXPECT_EQ(backend.default_math(), Math::kFp32);
  std::mt19937_64 rng(testing::TestSeed());
  for (const FormWeights& materialized : {MaterializeFactored(weights), MaterializeSummed(weights)}) {
    const std::string form(FormName(materialized.form));
    auto f = std::make_shared<const FormWeights>(materialized);
    auto on32 = backend.UploadIn(f, Math::kFp32), on_bf16 = backend.UploadIn(f, Math::kBf16),
         on_fp16 = backend.UploadIn(f, Math::kFp16);
    ASSERT_TRUE(on32.ok() && on_bf16.ok() && on_fp16.ok()) << form;
    EXPECT_EQ((*on32)->math(), Math::kFp32) << form;
    EXPECT_EQ((*on_bf16)->math(), Math::kBf16) << form;
    EXPECT_EQ((*on_fp16)->math(), Math::kFp16) << form;
    EXPECT_EQ(2 * ((*on_bf16)->HostBytes() - f->Bytes()), (*on32)->HostBytes() - f->Bytes()) << form;
    EXPECT_EQ((*on_fp16)->HostBytes(), (*on_bf16)->HostBytes()) << form;
    for (int64_t n : {1, 40}) {
      const std::vector<float> input = testing::RandomVector(rng, n * config.d_model);
      std::vector<float> got32(input.size()), got_bf16(input.size()), got_fp16(input.size());
      ASSERT_TRUE(RunOne(backend, **on32, input, n, config.d_model, got32).ok()) << form;
      ASSERT_TRUE(RunOne(backend, **on_bf16, input, n, config.d_model, got_bf16).ok()) << form;
      ASSERT_TRUE(RunOne(backend, **on_fp16, input, n, config.d_model, got_fp16).ok()) << form;
      Sequence s;
      s.input = ConstMatrixView(input.data(), n, config.d_model);
      const std::vector<double> exact = ReferenceForward(weights, s);
      const double e32 = testing::RelativeL2(got32.data(), exact), e_bf16 = testing::RelativeL2(got_bf16.data(), exact),
                   e_fp16 = testing::RelativeL2(got_fp16.data(), exact);
      EXPECT_LT(e32, 1e-5) << form << " n=" << n;
      EXPECT_LT(e_bf16, 2e-2) << form << " n=" << n;
      EXPECT_GT(e_bf16, 10 * e32) << form << " n=" << n << ": the bf16 variant computed in float32?";
      EXPECT_LT(e_fp16, 3e-3) << form << " n=" << n;
      EXPECT_LT(4 * e_fp16, e_bf16) << form << " n=" << n << ": the fp16 variant rounded to bfloat16?";
      EXPECT_GT(e_fp16, 10 * e32) << form << " n=" << n << ": the fp16 variant computed in float32?";
    }
  }
}

TEST(MathVariantsTest, TheCpuRefusesTheGpuMathNamingIt) {
  CpuBackend backend({.threads = 1});
  const LayerConfig config = *CompleteConfig({.d_model = 32, .heads = 2});
  auto f = std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(config, 3)));
  const Status checked = backend.CheckMath(Math::kTf32);
  EXPECT_EQ(checked.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(checked.message(), "math: the CPU runs fp32, bf16 or fp16, got tf32");
  auto uploaded = static_cast<Backend&>(backend).UploadIn(f, Math::kTf32);
  ASSERT_FALSE(uploaded.ok());
  EXPECT_EQ(uploaded.status().message(), checked.message());
  EXPECT_TRUE(backend.CheckMath(Math::kFp32).ok());
  EXPECT_EQ(backend.CheckMath(Math::kBf16).ok(), PanelWidth() > 0);
  EXPECT_EQ(backend.CheckMath(Math::kFp16).ok(), PanelWidth() > 0);
}

// A weight that IEEE half cannot hold (its magnitude rounds past 65504) is refused in fp16,
// naming the math, the form, the matrix, the value and where, rather than served as an
// infinity; fp32 and bf16 (whose range is float32's) hold the same layer.
TEST(MathVariantsTest, Fp16RefusesAWeightPastHalfsRangeNamingIt) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: fp16 needs the backend's own kernel";
  CpuBackend backend({.threads = 1});
  const LayerConfig config = *CompleteConfig({.d_model = 32, .heads = 2});
  FormWeights big = MaterializeFactored(RandomLayerWeights(config, 5));
  big.w_in[3 * big.in_cols() + 5] = 70000.0f;
  auto f = std::make_shared<const FormWeights>(big);
  auto refused = backend.UploadIn(f, Math::kFp16);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("math: fp16 holds weights up to 65504"), HasSubstr("70000"),
                    HasSubstr("factored form's w_in at [3, 5]"), HasSubstr("fp32 or bf16")));
  EXPECT_TRUE(backend.UploadIn(f, Math::kFp32).ok());
  EXPECT_TRUE(backend.UploadIn(f, Math::kBf16).ok());
  big.w_in[3 * big.in_cols() + 5] = 65504.0f;  // the largest half: held exactly
  EXPECT_TRUE(backend.UploadIn(std::make_shared<const FormWeights>(big), Math::kFp16).ok());
}

// The packed-bf16 layouts make bf16 the CPU's default math, packed-fp16 fp16: Upload and
// UploadIn agree.
TEST(MathVariantsTest, A16BitLayoutMakesItsMathTheDefault) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: packed-bf16 and packed-fp16 are refused at start";
  for (const auto& [layout, math] :
       {std::pair{WeightLayout::kPackedBf16, Math::kBf16}, std::pair{WeightLayout::kPackedFp16, Math::kFp16}}) {
    CpuBackend backend({.threads = 1, .weight_layout = layout});
    EXPECT_EQ(backend.default_math(), math);
    const LayerConfig config = *CompleteConfig({.d_model = 64, .heads = 2});
    auto f = std::make_shared<const FormWeights>(MaterializeFactored(RandomLayerWeights(config, 4)));
    auto plain = backend.Upload(f), fp32 = backend.UploadIn(f, Math::kFp32);
    ASSERT_TRUE(plain.ok() && fp32.ok());
    EXPECT_EQ((*plain)->math(), math);
    EXPECT_EQ((*fp32)->math(), Math::kFp32);
    EXPECT_LT((*plain)->HostBytes(), (*fp32)->HostBytes());
  }
}

// --extra-maths: the store holds every form in the backend's default math and in each extra
// one (the default named again is not held twice), all from one load, and counts every
// resident copy against --max-layer-mb.
TEST(MathVariantsTest, TheStoreHoldsEveryFormInEveryMath) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: bf16 needs the backend's own kernel";
  CpuBackend backend({.threads = 1});
  LayerStore store(&backend, {.extra_maths = {Math::kBf16, Math::kFp32}});
  auto layer = store.Load("m", "random:d_model=128,heads=2,seed=3");
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  const Layer& l = **layer;
  EXPECT_EQ(l.maths, (std::vector<Math>{Math::kFp32, Math::kBf16}));
  EXPECT_EQ(l.default_math(), Math::kFp32);
  const std::vector<Variant> want = {{Form::kFactored, Math::kFp32},
                                     {Form::kSummed, Math::kFp32},
                                     {Form::kFactored, Math::kBf16},
                                     {Form::kSummed, Math::kBf16}};
  EXPECT_EQ(l.Variants(), want);
  for (const Variant& v : want) {
    ASSERT_NE(l.Find(v), nullptr) << FormName(v.form) << "@" << MathName(v.math);
    EXPECT_EQ(l.Find(v)->math(), v.math);
    EXPECT_EQ(l.Find(v)->weights().form, v.form);
  }
  EXPECT_EQ(l.Find(Variant{Form::kFactored, Math::kFp16}), nullptr);
  EXPECT_TRUE(l.HoldsMath(Math::kBf16));
  EXPECT_FALSE(l.HoldsMath(Math::kTf32));
  // The bf16 copies share the float32 weights (one host copy) and add their panels.
  EXPECT_EQ(&l.Find(Variant{Form::kSummed, Math::kBf16})->weights(), &l.Find(Form::kSummed)->weights());

  // The bytes: the default math's forms whole, the bf16 ones only their bfloat16 panels (half the
  // float32 panels' bytes: the weights are shared, not copied).
  int64_t one_math = 0, all = 0;
  for (const auto& [_, r] : l.forms) one_math += r->HostBytes();
  for (const Variant& v : l.Variants()) all += l.HostBytesOf(v);
  for (Form f : {Form::kFactored, Form::kSummed}) {
    const ResidentForm& fp32 = *l.Find(f);
    EXPECT_EQ(2 * l.HostBytesOf({f, Math::kBf16}), fp32.HostBytes() - fp32.weights().Bytes()) << FormName(f);
  }
  // The cap counts them: room for the layer in fp32 alone is not room for it in two maths.
  LayerStore tight(&backend, {.max_total_bytes = all - 1, .extra_maths = {Math::kBf16}});
  auto refused = tight.Load("m", "random:d_model=128,heads=2,seed=3");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("--max-layer-mb"));
  LayerStore exact(&backend, {.max_total_bytes = all, .extra_maths = {Math::kBf16}});
  EXPECT_TRUE(exact.Load("m", "random:d_model=128,heads=2,seed=3").ok());
  LayerStore one(&backend, {.max_total_bytes = one_math});
  EXPECT_TRUE(one.Load("m", "random:d_model=128,heads=2,seed=3").ok());
}

TEST(MathVariantsTest, AMathTheDeviceCannotRunFailsTheLoadNamingIt) {
  CpuBackend backend({.threads = 1});
  LayerStore store(&backend, {.extra_maths = {Math::kTf32}});
  auto layer = store.Load("m", "random:d_model=32,heads=2,seed=3");
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(layer.status().message(), HasSubstr("uploading the factored form in tf32 to cpu"));
  EXPECT_THAT(layer.status().message(), HasSubstr("the CPU runs fp32, bf16 or fp16, got tf32"));
  EXPECT_EQ(store.Get("m"), nullptr);
}

class VariantObserver final : public BatchObserver {
 public:
  void JobQueued(std::string_view, Variant v) override { Record(v); }
  void JobDequeued(std::string_view, Variant v, double) override { Record(v); }
  void BatchStarted(std::string_view, Variant v, int32_t) override { Record(v); }
  void BatchDone(const BatchReport& report) override { Record(report.variant); }
  std::vector<Variant> Seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  void Record(Variant v) {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.push_back(v);
  }
  std::mutex mu_;
  std::vector<Variant> seen_;
};

// A job names its math: the executor runs that resident form (bit for bit what the backend
// computes with it), queues it apart from the other math's jobs and reports its variant; a job
// without one runs in the layer's default; a math the layer lacks is refused, named.
TEST(MathVariantsTest, TheExecutorRunsTheMathAJobNames) {
  if (PanelWidth() == 0) GTEST_SKIP() << "no AVX2 with FMA here: bf16 needs the backend's own kernel";
  CpuBackend backend({.threads = 1});
  LayerStore store(&backend, {.extra_maths = {Math::kBf16}});
  auto layer = store.Load("m", "random:d_model=128,heads=2,seed=9");
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  VariantObserver observer;
  BatchingExecutor executor(&backend, BatchPolicy{.max_queue_delay = std::chrono::microseconds(100)}, &observer);
  std::mt19937_64 rng(testing::TestSeed());
  const int64_t n = 6, d = 128;
  const std::vector<float> input = testing::RandomVector(rng, n * d);
  auto run = [&](std::optional<Math> math, std::vector<float>& out) {
    std::promise<Status> done;
    ForwardJob job;
    job.layer = *layer;
    job.form = Form::kFactored;
    job.math = math;
    Sequence s;
    s.input = ConstMatrixView(input.data(), n, d);
    s.output = MatrixView(out.data(), n, d);
    job.sequences = {s};
    job.done = [&](Status st, JobTimings) { done.set_value(std::move(st)); };
    executor.Submit(std::move(job));
    return done.get_future().get();
  };
  std::vector<float> bf16(n * d), fp32(n * d), fallback(n * d), want16(n * d), want32(n * d);
  ASSERT_TRUE(run(Math::kBf16, bf16).ok());
  ASSERT_TRUE(run(std::nullopt, fallback).ok());
  ASSERT_TRUE(run(Math::kFp32, fp32).ok());
  ASSERT_TRUE(RunOne(backend, *(*layer)->Find(Variant{Form::kFactored, Math::kBf16}), input, n, d, want16).ok());
  ASSERT_TRUE(RunOne(backend, *(*layer)->Find(Form::kFactored), input, n, d, want32).ok());
  EXPECT_EQ(bf16, want16);
  EXPECT_EQ(fp32, want32);
  EXPECT_EQ(fallback, want32) << "no math: the layer's default";
  EXPECT_NE(bf16, fp32);
  const std::vector<Variant> seen = observer.Seen();
  ASSERT_EQ(seen.size(), 12u);  // queued, dequeued, started, done per job
  for (int i = 0; i < 4; ++i) EXPECT_EQ(seen[i], (Variant{Form::kFactored, Math::kBf16})) << i;
  for (int i = 4; i < 12; ++i) EXPECT_EQ(seen[i], (Variant{Form::kFactored, Math::kFp32})) << i;

  std::vector<float> unused(n * d);
  const Status refused = run(Math::kFp16, unused);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(), "layer does not hold the factored form in fp16");
  executor.Drain(std::chrono::milliseconds(1000));
}

}  // namespace
}  // namespace attnserve
