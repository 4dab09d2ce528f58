// Core: configs, weights, materialisation of the summed form, parameter and FLOP counts, and the
// request type every path turns into sequences.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/request.h"
#include "server/core/spectrum.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

TEST(LayerConfigTest, FillsDefaults) {
  auto c = CompleteConfig({.d_model = 768, .heads = 12});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->kv_heads, 12);
  EXPECT_EQ(c->d_head, 64);
  EXPECT_FLOAT_EQ(c->SoftmaxScale(), 0.125f);
  EXPECT_EQ(c->KvHeadOf(11), 11);
}

TEST(LayerConfigTest, DHeadNeedNotDivideDModel) {
  auto c = CompleteConfig({.d_model = 100, .heads = 3, .kv_heads = 1, .d_head = 48});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->group_size(), 3);
  EXPECT_EQ(c->KvHeadOf(2), 0);
}

TEST(LayerConfigTest, BadConfigsNameTheField) {
  struct Case {
    LayerConfig config;
    const char* field;
  } cases[] = {
      {{.d_model = 64, .heads = 0}, "heads"},
      {{.d_model = 0, .heads = 4}, "d_model"},
      {{.d_model = 64, .heads = 4, .kv_heads = 3}, "kv_heads must divide heads"},
      {{.d_model = 64, .heads = 4, .kv_heads = 8}, "kv_heads"},
      {{.d_model = 65, .heads = 4}, "d_head"},
      {{.d_model = 64, .heads = 4, .d_head = -2}, "d_head"},
      {{.d_model = 64, .heads = 4, .scale = -1.0f}, "scale"},
      {{.d_model = 64, .heads = 4, .scale = NAN}, "scale"},
      {{.d_model = 60, .heads = 4, .d_head = 15, .rope_theta = 10000.0}, "even d_head, got d_head=15"},
      {{.d_model = 64, .heads = 4, .rope_theta = -1.0}, "rope_theta"},
  };
  for (const Case& c : cases) {
    auto got = CompleteConfig(c.config);
    ASSERT_FALSE(got.ok()) << c.field;
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr(c.field));
  }
}

TEST(LayerWeightsTest, ValidatesSizesAndFiniteness) {
  auto c = CompleteConfig({.d_model = 32, .heads = 4, .kv_heads = 2});
  ASSERT_TRUE(c.ok());
  LayerWeights w = RandomLayerWeights(*c, 7);
  EXPECT_TRUE(ValidateWeights(w).ok());

  LayerWeights short_k = w;
  short_k.w_k.pop_back();
  Status st = ValidateWeights(short_k);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("w_k"));
  EXPECT_THAT(st.message(), HasSubstr("32x16"));

  LayerWeights nan_o = w;
  nan_o.w_o[5] = NAN;
  EXPECT_THAT(ValidateWeights(nan_o).message(), HasSubstr("w_o holds a non-finite value at index 5"));

  LayerWeights no_bias = w;
  no_bias.config.bias = false;
  EXPECT_THAT(ValidateWeights(no_bias).message(), HasSubstr("b_q"));
}

TEST(LayerWeightsTest, RandomWeightsAreSeededAndScaled) {
  auto c = CompleteConfig({.d_model = 256, .heads = 8});
  ASSERT_TRUE(c.ok());
  LayerWeights a = RandomLayerWeights(*c, 1), b = RandomLayerWeights(*c, 1), other = RandomLayerWeights(*c, 2);
  EXPECT_EQ(a.w_q, b.w_q);
  EXPECT_NE(a.w_q, other.w_q);
  double sq = 0;
  for (float x : a.w_q) sq += x * x;
  const double std_dev = std::sqrt(sq / a.w_q.size());
  EXPECT_NEAR(std_dev, 1.0 / 16.0, 0.002);  // fan-in scaling: 1 / sqrt(d_model)
}

TEST(FormsTest, NamesRoundTrip) {
  for (Form f : kAllForms) EXPECT_EQ(ParseForm(FormName(f)), f);
  EXPECT_FALSE(ParseForm("concat").has_value());
  EXPECT_EQ(FormName(Form::kSummed), "summed");
}

// W_M_i and b_eff against sums written out from their definitions, in float64.
TEST(FormsTest, SummedFormMatchesItsDefinition) {
  auto c = CompleteConfig({.d_model = 24, .heads = 6, .kv_heads = 2, .d_head = 5});
  ASSERT_TRUE(c.ok());
  const LayerWeights w = RandomLayerWeights(*c, 3);
  const FormWeights f = MaterializeSummed(w);
  const int64_t d = 24, dh = 5, kvc = 10, cols = f.in_cols();
  ASSERT_EQ(f.value_cols, 6 * d);
  ASSERT_EQ(f.in_cols(), 6 * dh + 2 * dh + 6 * d);
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t g = i / 3;
    for (int64_t r = 0; r < d; ++r) {
      for (int64_t col = 0; col < d; ++col) {
        double want = 0;
        for (int64_t t = 0; t < dh; ++t) want += double{w.w_v[r * kvc + g * dh + t]} * w.w_o[(i * dh + t) * d + col];
        EXPECT_NEAR(f.w_in[r * cols + f.q_cols + f.k_cols + i * d + col], want, 1e-6);
      }
    }
  }
  for (int64_t col = 0; col < d; ++col) {
    double want = w.b_o[col];
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t t = 0; t < dh; ++t) want += double{w.b_v[(i / 3) * dh + t]} * w.w_o[(i * dh + t) * d + col];
    }
    EXPECT_NEAR(f.b_out[col], want, 1e-6);
  }
  // Q and K columns are the layer's own.
  EXPECT_EQ(f.w_in[3 * cols + 7], w.w_q[3 * 30 + 7]);
  EXPECT_EQ(f.w_in[2 * cols + f.q_cols + 4], w.w_k[2 * kvc + 4]);
}

// Every form's weight matrices start on a cache line (AlignedFloats), whatever the allocator
// would have given: the CPU kernels' loads from their rows then never straddle two lines.
TEST(FormsTest, WeightMatricesStartOnACacheLine) {
  auto c = CompleteConfig({.d_model = 64, .heads = 4, .kv_heads = 4, .d_head = 16});
  ASSERT_TRUE(c.ok());
  const LayerWeights w = RandomLayerWeights(*c, 7);
  auto low_rank = MaterializeLowRank(w, {3, 1, 2, 4});
  ASSERT_TRUE(low_rank.ok()) << low_rank.status().ToString();
  for (const FormWeights& f : {MaterializeFactored(w), MaterializeSummed(w), *low_rank}) {
    SCOPED_TRACE(std::string(FormName(f.form)));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.w_in.data()) % 64, 0u);
    if (!f.w_out.empty()) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(f.w_out.data()) % 64, 0u);
    }
  }
  for (size_t floats : {1, 5, 4096, 1 << 20}) {  // small blocks and the large ones mmap serves
    AlignedFloats v(floats, 1.0f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 64, 0u) << floats << " floats";
  }
}

// Parameter counts of ARCHITECTURE §1: factored 2·d·h·d_h for V and O, summed h·d² instead.
TEST(FormsTest, ParameterCounts) {
  auto c = CompleteConfig({.d_model = 96, .heads = 6, .kv_heads = 3, .d_head = 20});
  ASSERT_TRUE(c.ok());
  const LayerWeights w = RandomLayerWeights(*c, 5);
  const int64_t d = 96, h = 6, hkv = 3, dh = 20;
  const int64_t qk = d * (h + hkv) * dh + (h + hkv) * dh;  // weights and biases of Q and K
  EXPECT_EQ(MaterializeFactored(w).Parameters(), qk + d * hkv * dh + hkv * dh + h * dh * d + d);
  EXPECT_EQ(MaterializeSummed(w).Parameters(), qk + h * d * d + d);
  EXPECT_EQ(MaterializeSummed(w).Bytes(), 4 * (qk + h * d * d + d));
}

// FLOPs against docs/architecture.md §1 (Costs), worked out by hand for one small shape:
// d = 16, h = 4, h_kv = 2, d_h = 4, n = 5 queries, m = 7 context rows, and L = 3 visible keys
// (key_length < m: the scores and the mix run over L keys, the projections over all m rows).
//   QK:  2·n·d·h·d_h    = 2·5·16·4·4 = 2560   (Q projection)
//        2·m·d·h_kv·d_h = 2·7·16·2·4 = 1792   (K projection)
//        2·h·n·L·d_h    = 2·4·5·3·4  =  480   (scores)                      QK = 4832
//   factored OV: 2·m·d·h_kv·d_h = 1792, 2·h·n·L·d_h = 480, 2·n·h·d_h·d = 2·5·4·4·16 = 2560
//                                                         = 4832, with QK  9664
//   summed OV:   2·m·d·h·d = 2·7·16·4·16 = 14336, 2·n·h·L·d = 2·5·4·3·16 = 1920
//                                                         = 16256, with QK 21088
//   low rank, ranks {4, 0, 2, 1} (the factored path with value widths r_i, R = Σ r_i = 7):
//                2·m·d·R = 2·7·16·7 = 1568, 2·n·L·R = 2·5·3·7 = 210, 2·n·R·d = 2·5·7·16 = 1120
//                                                         = 2898, with QK  7730
// With all m = 7 keys visible the scores and the mix grow by 7/3: 2·h·n·m·d_h = 2·4·5·7·4 = 1120,
// so factored = 2560 + 1792 + 1120 + 1792 + 1120 + 2560 = 10944.
TEST(FormsTest, FlopCountsFollowTheFormulas) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w =
      RandomLayerWeights(*CompleteConfig({.d_model = 16, .heads = 4, .kv_heads = 2, .d_head = 4}), rng());
  const SequenceShape masked{.n = 5, .m = 7, .keys = 3};
  EXPECT_EQ(ForwardFlops(MaterializeFactored(w), {&masked, 1}), 9664);
  EXPECT_EQ(ForwardFlops(MaterializeSummed(w), {&masked, 1}), 21088);
  auto lowrank = MaterializeLowRank(w, {4, 0, 2, 1});
  ASSERT_TRUE(lowrank.ok()) << lowrank.status().ToString();
  EXPECT_EQ(ForwardFlops(*lowrank, {&masked, 1}), 7730);

  const SequenceShape all_keys{.n = 5, .m = 7};
  EXPECT_EQ(ForwardFlops(MaterializeFactored(w), {&all_keys, 1}), 10944);
  // Two sequences cost the sum of each: 9664 + 10944 = 20608.
  const SequenceShape two[] = {masked, all_keys};
  EXPECT_EQ(ForwardFlops(MaterializeFactored(w), two), 20608);
}

TEST(FormsTest, ValueGroupsCutRunsUnderTheBound) {
  using Groups = std::vector<std::pair<size_t, size_t>>;
  const int64_t rows[] = {3, 4, 9, -1, 2, 2, 5};
  // 8 rows at most: 3 + 4, then 9 alone (over the bound), then 2 + 2 (a sequence with no
  // value rows is passed over: no group starts there), then 5 (2 + 2 + 5 > 8).
  EXPECT_EQ(ValueGroups(rows, 8), (Groups{{0, 2}, {2, 3}, {4, 6}, {6, 7}}));
  const int64_t gap[] = {3, -1, 4};
  EXPECT_EQ(ValueGroups(gap, 8), (Groups{{0, 3}}));
  EXPECT_EQ(ValueGroups(rows, INT64_MAX), (Groups{{0, 7}}));
  EXPECT_EQ(ValueGroups(rows, 1), (Groups{{0, 1}, {1, 2}, {2, 3}, {4, 5}, {5, 6}, {6, 7}}));
  const int64_t none[] = {-1, -1};
  EXPECT_TRUE(ValueGroups(none, 8).empty());
}

// The memory formula's value block is the largest group's: a summed batch of four sequences
// under a bound of one sequence's value rows needs 3/4 of the whole block less.
TEST(FormsTest, ScratchFormulaCountsOneValueGroup) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = RandomLayerWeights(*CompleteConfig({.d_model = 32, .heads = 4}), rng());
  const FormWeights summed = MaterializeSummed(w), factored = MaterializeFactored(w);
  const std::vector<SequenceShape> batch(4, SequenceShape{.n = 16, .m = 16});
  const int64_t row_bytes = summed.value_cols * 4, one_sequence = 16 * row_bytes;
  const int64_t whole = ForwardScratchBytes(summed, batch, true, 1, INT64_MAX);
  EXPECT_EQ(whole - ForwardScratchBytes(summed, batch, true, 1, INT64_MAX, {}, one_sequence), 3 * one_sequence);
  // Two sequences a group: half the block.
  EXPECT_EQ(whole - ForwardScratchBytes(summed, batch, true, 1, INT64_MAX, {}, 2 * one_sequence), 2 * one_sequence);
  // The factored form's value block is always whole.
  EXPECT_EQ(ForwardScratchBytes(factored, batch, true, 1, INT64_MAX),
            ForwardScratchBytes(factored, batch, true, 1, INT64_MAX, {}, one_sequence));
}

TEST(StatusTest, CodesHaveGrpcNamesAndValues) {
  EXPECT_EQ(StatusCodeName(StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  Status st = FailedPreconditionError("layer 'x' does not hold form summed");
  EXPECT_EQ(st.ToString(), "FAILED_PRECONDITION: layer 'x' does not hold form summed");
  StatusOr<int> bad = NotFoundError("no layer");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
}

// A request whose every field differs from its default, viewing memory it does not own.
AttentionRequest ViewingRequest(const std::vector<float>& input, const std::vector<float>& context) {
  AttentionRequest r;
  r.input = RequestTensor::View(input.data(), 2, 3, 4);
  r.context = RequestTensor::View(context.data(), 2, 5, 4);
  r.causal = true;
  r.key_lengths = {5, 2};
  r.position_offset = 37;
  return r;
}

// The decode path, compare and the shadow all make their sequences here: each field must reach
// every sequence (a shadow's own conversion once dropped position_offset).
TEST(AttentionRequestTest, SequencesCarryEveryField) {
  const std::vector<float> input(2 * 3 * 4, 1.0f), context(2 * 5 * 4, 2.0f);
  const AttentionRequest r = ViewingRequest(input, context);
  std::vector<float> out(r.output_elements());
  const std::vector<Sequence> seqs = r.Sequences(out.data());
  ASSERT_EQ(seqs.size(), 2u);
  for (int64_t b = 0; b < 2; ++b) {
    const Sequence& s = seqs[b];
    EXPECT_EQ(s.input.data, input.data() + b * 3 * 4);
    EXPECT_EQ(s.n(), 3);
    EXPECT_EQ(s.context.data, context.data() + b * 5 * 4);
    EXPECT_EQ(s.m(), 5);
    EXPECT_TRUE(s.causal);
    EXPECT_EQ(s.key_length, r.key_lengths[b]);
    EXPECT_EQ(s.position_offset, 37);
    EXPECT_EQ(s.output.data, out.data() + b * 3 * 4);
    EXPECT_EQ(s.output.rows, 3);
    EXPECT_TRUE(ValidateSequence(*CompleteConfig({.d_model = 4, .heads = 2}), s).ok());
  }
  AttentionRequest self;
  self.input = RequestTensor::View(input.data(), 1, 3, 4);
  EXPECT_TRUE(self.Sequences(out.data())[0].self_attention());
  EXPECT_EQ(self.Sequences(out.data())[0].key_length, -1);
}

// A copy (what a shadow keeps after the call is answered) owns every value and keeps every
// field: it must give the same sequences once the memory the original viewed is gone.
TEST(AttentionRequestTest, CopyOwnsEveryValueAndKeepsEveryField) {
  std::vector<float> input(2 * 3 * 4), context(2 * 5 * 4);
  for (size_t i = 0; i < input.size(); ++i) input[i] = static_cast<float>(i);
  for (size_t i = 0; i < context.size(); ++i) context[i] = -static_cast<float>(i);
  const AttentionRequest original = ViewingRequest(input, context);
  EXPECT_FALSE(original.input.owns_values());
  const AttentionRequest copy = original;
  EXPECT_TRUE(copy.input.owns_values());
  ASSERT_TRUE(copy.context.has_value());
  EXPECT_TRUE(copy.context->owns_values());
  EXPECT_EQ(copy.Bytes(), (2 * 3 * 4 + 2 * 5 * 4) * 4 + 2 * 8);
  const std::vector<float> want_input = input, want_context = context;
  std::fill(input.begin(), input.end(), std::nanf(""));  // the wire message is gone
  std::fill(context.begin(), context.end(), std::nanf(""));
  std::vector<float> out(copy.output_elements());
  const std::vector<Sequence> seqs = copy.Sequences(out.data());
  ASSERT_EQ(seqs.size(), 2u);
  for (int64_t b = 0; b < 2; ++b) {
    const Sequence& s = seqs[b];
    for (int64_t i = 0; i < 3 * 4; ++i) ASSERT_EQ(s.input.data[i], want_input[b * 3 * 4 + i]) << b << " " << i;
    for (int64_t i = 0; i < 5 * 4; ++i) ASSERT_EQ(s.context.data[i], want_context[b * 5 * 4 + i]) << b << " " << i;
    EXPECT_TRUE(s.causal);
    EXPECT_EQ(s.key_length, original.key_lengths[b]);
    EXPECT_EQ(s.position_offset, 37);
  }
  // Assignment copies as well; a move keeps the view.
  AttentionRequest assigned;
  assigned = copy;
  EXPECT_NE(assigned.input.data(), copy.input.data());
  EXPECT_EQ(assigned.input.values()[5], want_input[5]);
  AttentionRequest viewing = ViewingRequest(input, context);
  const AttentionRequest moved = std::move(viewing);
  EXPECT_EQ(moved.input.data(), input.data());
}

// MutexLock::LockSpinning, what a worker that saw news by spinning takes the queue's lock with:
// given polls enough, it takes a held lock by polling the moment its holder lets go, without
// blocking; given none, it blocks; either way only once the holder has let go.
TEST(MutexTest, LockSpinningPollsForAHeldLockThenBlocks) {
  for (const int polls : {1 << 30, 0}) {
    Mutex mu;
    std::atomic<bool> released{false};
    std::atomic<bool> held{false};
    bool polled = !polls;
    std::thread taker([&] {
      MutexLock lock(mu);
      lock.Unlock();
      while (!held.load()) std::this_thread::yield();
      polled = lock.LockSpinning(polls);
      EXPECT_TRUE(released.load()) << "took the lock while it was held";
    });
    {
      MutexLock holder(mu);
      held.store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      released.store(true);
    }
    taker.join();
    EXPECT_EQ(polled, polls > 0) << polls << " polls";
  }
}

}  // namespace
}  // namespace attnserve
