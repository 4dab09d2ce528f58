// The attention skeleton (server/backend/attention) on its own: the batch plan's rows, orders,
// parts and chunks worked out by hand, and RunAttention over a naive device of the test's own —
// scalar loops in float64, the whole score matrix at once, A_cat built explicitly — against the
// float64 reference, for every form and both of the summed form's orders. Neither backend is
// involved, so a fault here is the skeleton's (or the plan's), not a kernel's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "server/backend/attention/plan.h"
#include "server/backend/attention/skeleton.h"
#include "server/core/reference.h"
#include "server/core/rope.h"
#include "server/core/spectrum.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::OwnedSequence;
using testing::RandomSequence;
using testing::RelativeL2;

// A device that computes each operation from its definition: host vectors for buffers, float64
// accumulation, no tiling or blocking. It records the operations it was asked for.
class NaiveOps final : public DeviceOps {
 public:
  explicit NaiveOps(PlanPolicy policy) : policy_(policy) {}

  PlanPolicy Policy() const override { return policy_; }

  Status Prepare(const FormWeights& f, const BatchPlan& plan, std::span<const Sequence> batch,
                 ForwardBuffers& b) override {
    calls.push_back("Prepare");
    const int64_t d = f.config.d_model, tx = plan.rows.queries, tc = plan.rows.contexts;
    x_.assign(tx * d, 0);
    c_.assign(tc * d, 0);
    for (size_t r = 0; r < batch.size(); ++r) {
      Copy(batch[r].input, MatrixView(x_.data(), tx, d).RowBlock(plan.rows.x_row[r], batch[r].n()));
      Copy(batch[r].keys_source(), MatrixView(c_.data(), tc, d).RowBlock(plan.rows.c_row[r], batch[r].m()));
    }
    b.x = ConstMatrixView(x_.data(), tx, d);
    b.c = ConstMatrixView(c_.data(), tc, d);
    // NaN, not zeros: a buffer the skeleton forgets to fill shows in the answer.
    qk_.assign(plan.qk_floats + (plan.qkv_one_block ? plan.value_floats : 0), NAN);
    if (plan.qkv_one_block) {
      const MatrixView qkv(qk_.data(), tx, f.in_cols());
      b.q = qkv.ColBlock(0, f.q_cols);
      b.k = qkv.ColBlock(f.q_cols, f.k_cols);
      b.val = qkv.ColBlock(f.q_cols + f.k_cols, f.value_cols);
    } else if (plan.rows.all_self) {
      const MatrixView qk(qk_.data(), tx, f.q_cols + f.k_cols);
      b.q = qk.ColBlock(0, f.q_cols);
      b.k = qk.ColBlock(f.q_cols, f.k_cols);
    } else {
      b.q = MatrixView(qk_.data(), tx, f.q_cols);
      b.k = MatrixView(qk_.data() + tx * f.q_cols, tc, f.k_cols);
    }
    if (!plan.qkv_one_block) {
      val_.assign(plan.value_floats, NAN);
      b.val = MatrixView(val_.data(), plan.val_rows, f.value_cols);
    }
    o_.assign(plan.o_floats, NAN);
    b.o = MatrixView(o_.data(), tx, f.out_rows);
    y_.assign(tx * d, NAN);
    b.y = MatrixView(y_.data(), tx, d);
    for (size_t r = 0; r < batch.size(); ++r) b.outputs.push_back(b.y.RowBlock(plan.rows.x_row[r], batch[r].n()));
    return OkStatus();
  }

  StatusOr<float*> MixBuffer(const BatchPlan& plan) override {
    calls.push_back("MixBuffer");
    mixes_.assign(plan.mix_floats, NAN);
    return mixes_.data();
  }

  Status Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) override {
    calls.push_back("Gemm");
    EXPECT_EQ(x.cols, w.rows);
    EXPECT_EQ(x.rows, y.rows);
    EXPECT_EQ(w.cols, y.cols);
    for (int64_t i = 0; i < y.rows; ++i) {
      for (int64_t j = 0; j < y.cols; ++j) {
        double acc = accumulate ? y.at(i, j) : 0.0;
        for (int64_t t = 0; t < x.cols; ++t) acc += static_cast<double>(x.at(i, t)) * w.at(t, j);
        y.at(i, j) = static_cast<float>(acc + (bias != nullptr ? bias[j] : 0.0f));
      }
    }
    return OkStatus();
  }

  Status Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) override {
    calls.push_back("Rope");
    for (const RopeRun& run : runs) ApplyRope(m.RowBlock(run.row0, run.rows), heads, d_head, theta, run.position);
    return OkStatus();
  }

  Status Attend(const AttentionJob& job) override {
    calls.push_back(job.values == AttentionValues::kValueBlock ? "Attend(values)" : "Attend(context)");
    const LayerConfig& c = job.form->config;
    for (const AttentionRange& range : job.ranges) {
      for (int64_t i = 0; i < c.heads; ++i) {
        for (int64_t row = 0; row < range.rows; ++row) {
          const std::vector<double> a = SoftmaxRow(c, range, i, range.row0 + row);
          for (int64_t col = 0; col < job.Width(i); ++col) {
            double acc = 0;
            for (size_t j = 0; j < a.size(); ++j) acc += a[j] * range.values.at(j, job.ValueColumn(i) + col);
            range.out.at(row, job.OutColumn(i) + col) = static_cast<float>(acc);
          }
        }
      }
    }
    return OkStatus();
  }

  // A_cat [rows, L·h] with A_i[q, j] at column j·h + i, and the values read as [L·h, d_model].
  Status SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges,
                                 const float* bias) override {
    calls.push_back("SumHeadsProjectingFirst");
    const LayerConfig& c = f.config;
    for (const AttentionRange& range : ranges) {
      const int64_t keys = range.sequence->visible_keys();
      std::vector<float> a_cat(range.rows * keys * c.heads, 0.0f);
      for (int64_t i = 0; i < c.heads; ++i) {
        for (int64_t row = 0; row < range.rows; ++row) {
          const std::vector<double> a = SoftmaxRow(c, range, i, range.row0 + row);
          for (size_t j = 0; j < a.size(); ++j) a_cat[(row * keys + j) * c.heads + i] = static_cast<float>(a[j]);
        }
      }
      ATTNSERVE_RETURN_IF_ERROR(Gemm(ConstMatrixView(a_cat.data(), range.rows, keys * c.heads),
                                     ConstMatrixView(range.values.data, keys * c.heads, c.d_model), bias, range.out,
                                     false));
      calls.pop_back();  // the Gemm above is this operation's own
    }
    return OkStatus();
  }

  Status Finish(const BatchPlan& plan, std::span<const Sequence> batch, const ForwardBuffers& b, bool) override {
    calls.push_back("Finish");
    for (size_t r = 0; r < batch.size(); ++r) Copy(b.y.RowBlock(plan.rows.x_row[r], batch[r].n()), batch[r].output);
    return OkStatus();
  }

  std::vector<std::string> calls;

 private:
  static void Copy(ConstMatrixView from, MatrixView to) {
    for (int64_t i = 0; i < from.rows; ++i) {
      for (int64_t j = 0; j < from.cols; ++j) to.at(i, j) = from.at(i, j);
    }
  }

  // Row q of A_i = softmax(scale · Q_i K_g(i)^T + mask), over the keys the row sees.
  static std::vector<double> SoftmaxRow(const LayerConfig& c, const AttentionRange& range, int64_t head, int64_t q) {
    const int64_t keys = VisibleKeys(*range.sequence, q), dh = c.d_head, kv = c.KvHeadOf(head);
    std::vector<double> e(keys);
    double top = -INFINITY, sum = 0;
    for (int64_t j = 0; j < keys; ++j) {
      double dot = 0;
      for (int64_t t = 0; t < dh; ++t)
        dot += static_cast<double>(range.q.at(q, head * dh + t)) * range.k.at(j, kv * dh + t);
      top = std::max(top, e[j] = c.SoftmaxScale() * dot);
    }
    for (double& v : e) sum += (v = std::exp(v - top));
    for (double& v : e) v /= sum;
    return e;
  }

  PlanPolicy policy_;
  std::vector<float> x_, c_, qk_, val_, o_, y_, mixes_;
};

LayerConfig Config(int64_t d_model, int64_t heads, int64_t kv_heads, double rope_theta, bool bias) {
  return *CompleteConfig(
      {.d_model = d_model, .heads = heads, .kv_heads = kv_heads, .bias = bias, .rope_theta = rope_theta});
}

// A ragged batch: self-attention (causal, with a position offset), cross-attention to a longer
// context, padded keys, a single token.
std::vector<OwnedSequence> RaggedBatch(std::mt19937_64& rng, int64_t d) {
  std::vector<OwnedSequence> batch;
  batch.push_back(RandomSequence(rng, d, 9, 9, false, true, -1));
  batch.back().position_offset = 5;
  batch.push_back(RandomSequence(rng, d, 4, 13, true, false, -1));
  batch.push_back(RandomSequence(rng, d, 7, 7, false, false, 5));
  batch.push_back(RandomSequence(rng, d, 1, 1, false, false, -1));
  return batch;
}

struct FormCase {
  std::string name;
  FormWeights form;
  PlanPolicy policy;
};

std::vector<FormCase> EveryFormAndOrder(const LayerWeights& w) {
  const PlanPolicy project_first{};
  // Mix first wherever allowed (past 0 bytes of A_cat), in parts of 2 rows (the bound holds two
  // rows of mixes), so chunks and parts cut every sequence.
  const FormWeights summed = MaterializeSummed(w);
  const PlanPolicy mix_first{.summed_order = {.mix_first_allowed = true, .max_a_cat_bytes = 0},
                             .max_mix_bytes = 2 * summed.value_cols * int64_t{sizeof(float)}};
  const PlanPolicy by_shape{.summed_order = {.mix_first_allowed = true}};  // n < m mixes first
  std::vector<int64_t> full(w.config.heads, w.config.d_head);
  // Project first, each sequence's value rows a group of its own (a bound of 1 byte).
  const PlanPolicy one_by_one{.summed_order = {}, .max_value_group_bytes = 1};
  // Q, K and the value block as one matrix where the plan allows it (self-attention batches).
  const PlanPolicy one_block{.summed_order = {}, .qkv_one_block = true};
  return {{"factored", MaterializeFactored(w), project_first},
          {"factored, Q|K|V one block where allowed", MaterializeFactored(w), one_block},
          {"factored, the summed form's groups asked for", MaterializeFactored(w), one_by_one},
          {"summed, project first", summed, project_first},
          {"summed, project first one sequence at a time", summed, one_by_one},
          {"summed, mix first in parts", summed, mix_first},
          {"summed, each sequence by its shape", summed, by_shape},
          {"lowrank at full rank", *MaterializeLowRank(w, full), project_first},
          {"lowrank at full rank, Q|K|V one block where allowed", *MaterializeLowRank(w, full), one_block}};
}

TEST(AttentionSkeletonTest, EveryFormOverANaiveDeviceMatchesFloat64Reference) {
  std::mt19937_64 rng(testing::TestSeed());
  // With and without biases (the summed form folds the value bias into b_eff, so its
  // sequences may mix first either way), GQA with RoPE, and a single kv head.
  for (const LayerConfig& c :
       {Config(32, 4, 4, 0, true), Config(48, 6, 2, 10000.0, false), Config(24, 3, 1, 0, true)}) {
    const LayerWeights w = RandomLayerWeights(c, rng());
    for (FormCase& fc : EveryFormAndOrder(w)) {
      for (const bool self_only : {false, true}) {  // self-only: the batch Q|K|V one block may take
        std::vector<OwnedSequence> owned = RaggedBatch(rng, c.d_model);
        if (self_only) owned.erase(owned.begin() + 1);  // its one cross-attention sequence
        std::vector<Sequence> batch;
        for (auto& s : owned) batch.push_back(s.View());
        NaiveOps ops(fc.policy);
        ASSERT_TRUE(RunAttention(ops, fc.form, HostWeights(fc.form), batch).ok()) << fc.name;
        for (size_t r = 0; r < batch.size(); ++r) {
          EXPECT_LT(RelativeL2(owned[r].output.data(), ReferenceForward(w, batch[r])), 1e-5)
              << fc.name << (self_only ? ", self-attention only" : "") << ", sequence " << r << ", " << c.ToString();
        }
      }
    }
  }
}

// Q, K and the value block are one matrix only where one GEMM can project them: the device
// allows it, every sequence is self-attention, the form concatenates then projects, and b_in
// covers every column of W_in or none.
TEST(BatchPlanTest, QkvOneBlockOnlyWhereOneGemmProjectsAllThree) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights biased = RandomLayerWeights(Config(16, 2, 2, 0, true), rng());
  const LayerWeights plain = RandomLayerWeights(Config(16, 2, 2, 0, false), rng());
  std::vector<OwnedSequence> owned = RaggedBatch(rng, 16);
  std::vector<Sequence> ragged, self;
  for (size_t r = 0; r < owned.size(); ++r) {
    ragged.push_back(owned[r].View());
    if (r != 1) self.push_back(owned[r].View());  // all but the cross-attention sequence
  }
  const PlanPolicy allowed{.summed_order = {}, .qkv_one_block = true};
  std::vector<int64_t> full(2, 8);
  EXPECT_TRUE(PlanBatch(MaterializeFactored(biased), self, allowed).qkv_one_block);
  EXPECT_TRUE(PlanBatch(MaterializeFactored(plain), self, allowed).qkv_one_block);
  EXPECT_TRUE(PlanBatch(*MaterializeLowRank(plain, full), self, allowed).qkv_one_block);
  EXPECT_FALSE(PlanBatch(MaterializeFactored(biased), self, {}).qkv_one_block);        // the device's call
  EXPECT_FALSE(PlanBatch(MaterializeFactored(biased), ragged, allowed).qkv_one_block);  // a cross-attention sequence
  EXPECT_FALSE(PlanBatch(MaterializeSummed(biased), self, allowed).qkv_one_block);      // the head sum projects its own
  EXPECT_FALSE(PlanBatch(*MaterializeLowRank(biased, full), self, allowed).qkv_one_block);  // b_in: Q and K only
}

// The operations each head combine asks for, in order: the skeleton's shape, pinned.
TEST(AttentionSkeletonTest, EachHeadCombineCallsItsOperationsInOrder) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = RandomLayerWeights(Config(16, 2, 2, 10000.0, false), rng());
  std::vector<OwnedSequence> owned = {RandomSequence(rng, 16, 3, 3, false, false, -1),
                                      RandomSequence(rng, 16, 2, 6, true, false, -1)};
  std::vector<Sequence> batch = {owned[0].View(), owned[1].View()};
  const auto run = [&](const FormWeights& f, PlanPolicy policy) {
    NaiveOps ops(policy);
    EXPECT_TRUE(RunAttention(ops, f, HostWeights(f), batch).ok());
    return ops.calls;
  };
  // Cross-attention in the batch: Q and K in two GEMMs, each rotated in one call for the whole
  // batch, then one GEMM for the whole value block.
  EXPECT_THAT(run(MaterializeFactored(w), {}),
              ElementsAre("Prepare", "Gemm", "Gemm", "Rope", "Rope", "Gemm", "Attend(values)", "Gemm", "Finish"));
  // Summed by shape: the first sequence (n = m) projects first, the second (n < m) mixes first
  // (its value rows are not projected: the value block is the first sequence's, one GEMM), one
  // chunk, one GEMM per head.
  EXPECT_THAT(run(MaterializeSummed(w), {.summed_order = {.mix_first_allowed = true}}),
              ElementsAre("Prepare", "Gemm", "Gemm", "Rope", "Rope", "Gemm", "SumHeadsProjectingFirst", "MixBuffer",
                          "Attend(context)", "Gemm", "Gemm", "Finish"));
  // Summed, project first, a value group per sequence: each group's value rows, then its head
  // sum, before the next group's.
  EXPECT_THAT(run(MaterializeSummed(w), {.summed_order = {}, .max_value_group_bytes = 1}),
              ElementsAre("Prepare", "Gemm", "Gemm", "Rope", "Rope", "Gemm", "SumHeadsProjectingFirst", "Gemm",
                          "SumHeadsProjectingFirst", "Finish"));
}

TEST(BatchPlanTest, RowsOrdersPartsAndChunksWorkedOutByHand) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = RandomLayerWeights(Config(16, 2, 2, 0, false), rng());
  const FormWeights summed = MaterializeSummed(w);                                      // value_cols = h · d = 32
  std::vector<OwnedSequence> owned = {RandomSequence(rng, 16, 5, 5, false, false, -1),  // projects first
                                      RandomSequence(rng, 16, 7, 9, true, false, -1),   // n < m: mixes first
                                      RandomSequence(rng, 16, 3, 3, false, true, -1),   // projects first
                                      RandomSequence(rng, 16, 1, 4, true, false, -1)};  // mixes first
  std::vector<Sequence> batch;
  for (auto& s : owned) batch.push_back(s.View());
  // The bound holds 4 rows of mixes (4 · 32 floats): sequence 1's 7 rows are parts of 4 and 3
  // rows, sequence 3 one part of 1 row; the 4-row part fills a chunk, the 3- and 1-row parts
  // share the next (3 + 1 = 4 rows).
  const PlanPolicy policy{.summed_order = {.mix_first_allowed = true}, .max_mix_bytes = 4 * 32 * 4};
  const BatchPlan plan = PlanBatch(summed, batch, policy);
  EXPECT_EQ(plan.combine, HeadCombine::kSumOfMixes);
  EXPECT_THAT(plan.rows.x_row, ElementsAre(0, 5, 12, 15));
  EXPECT_THAT(plan.rows.c_row, ElementsAre(0, 5, 14, 17));
  EXPECT_EQ(plan.rows.queries, 16);
  EXPECT_EQ(plan.rows.contexts, 21);
  EXPECT_FALSE(plan.rows.all_self);
  EXPECT_THAT(plan.mixes_first, ElementsAre(false, true, false, true));
  // Sequences 0 and 2 project first: one value group (no bound), which passes over sequence 1
  // (it mixes first, and has no value rows); 5 + 3 rows.
  ASSERT_EQ(plan.value_groups.size(), 1u);
  EXPECT_EQ(plan.value_groups[0].first, 0u);
  EXPECT_EQ(plan.value_groups[0].last, 3u);
  EXPECT_EQ(plan.value_groups[0].rows, 8);
  EXPECT_THAT(plan.val_row, ElementsAre(0, 0, 5, 0));
  EXPECT_EQ(plan.val_rows, 8);
  EXPECT_FALSE(plan.value_block_is_whole());
  ASSERT_EQ(plan.mix_parts.size(), 3u);
  const auto part = [&](size_t i) {
    const MixPart& p = plan.mix_parts[i];
    return std::vector<int64_t>{static_cast<int64_t>(p.sequence), p.row0, p.rows, p.offset};
  };
  EXPECT_THAT(part(0), ElementsAre(1, 0, 4, 0));
  EXPECT_THAT(part(1), ElementsAre(1, 4, 3, 0));
  EXPECT_THAT(part(2), ElementsAre(3, 0, 1, 3 * 32));
  ASSERT_EQ(plan.mix_chunks.size(), 2u);
  EXPECT_EQ(plan.mix_chunks[0].first, 0u);
  EXPECT_EQ(plan.mix_chunks[0].last, 1u);
  EXPECT_EQ(plan.mix_chunks[1].first, 1u);
  EXPECT_EQ(plan.mix_chunks[1].last, 3u);
  EXPECT_EQ(plan.mix_floats, 4 * 32);
  EXPECT_EQ(plan.qk_floats, 16 * 16 + 21 * 16);
  EXPECT_EQ(plan.value_floats, 8 * 32);
  EXPECT_EQ(plan.o_floats, 0);

  const BatchPlan factored = PlanBatch(MaterializeFactored(w), batch, policy);
  EXPECT_EQ(factored.combine, HeadCombine::kConcatThenProject);
  EXPECT_THAT(factored.mixes_first, ElementsAre(false, false, false, false));
  EXPECT_TRUE(factored.value_block_is_whole());
  EXPECT_TRUE(factored.mix_parts.empty());
  EXPECT_EQ(factored.o_floats, 16 * 16);
}

TEST(BatchPlanTest, SummedValueGroupsStayUnderTheirBoundAndAOversizedSequenceIsAlone) {
  std::mt19937_64 rng(testing::TestSeed());
  const LayerWeights w = RandomLayerWeights(Config(16, 2, 2, 0, false), rng());
  const FormWeights summed = MaterializeSummed(w);  // value rows of 32 floats
  std::vector<OwnedSequence> owned = {RandomSequence(rng, 16, 3, 3, false, false, -1),
                                      RandomSequence(rng, 16, 4, 4, false, false, -1),
                                      RandomSequence(rng, 16, 9, 9, false, false, -1),
                                      RandomSequence(rng, 16, 2, 2, false, false, -1)};
  std::vector<Sequence> batch;
  for (auto& s : owned) batch.push_back(s.View());
  // 8 rows of 32 floats: 3 + 4 rows share a group, the 9-row sequence passes the bound alone,
  // the last 2 rows start a group of their own.
  const PlanPolicy policy{.summed_order = {}, .max_value_group_bytes = 8 * 32 * 4};
  const BatchPlan plan = PlanBatch(summed, batch, policy);
  ASSERT_EQ(plan.value_groups.size(), 3u);
  std::vector<std::vector<int64_t>> groups;
  for (const ValueGroup& g : plan.value_groups) {
    groups.push_back({static_cast<int64_t>(g.first), static_cast<int64_t>(g.last), g.rows});
  }
  EXPECT_THAT(groups, ElementsAre(ElementsAre(0, 2, 7), ElementsAre(2, 3, 9), ElementsAre(3, 4, 2)));
  EXPECT_THAT(plan.val_row, ElementsAre(0, 3, 0, 0));
  EXPECT_EQ(plan.val_rows, 9);
  EXPECT_EQ(plan.value_floats, 9 * 32);
  EXPECT_FALSE(plan.value_block_is_whole());
  // With no bound the batch is one group, the whole value block; the factored form ignores the
  // bound (its heads read their own columns of every row: one GEMM).
  EXPECT_TRUE(PlanBatch(summed, batch, {}).value_block_is_whole());
  const BatchPlan factored = PlanBatch(MaterializeFactored(w), batch, policy);
  EXPECT_TRUE(factored.value_block_is_whole());
  EXPECT_THAT(factored.val_row, ElementsAre(0, 3, 7, 16));
}

TEST(AttentionJobTest, HeadsAtFixedStridesAreTheFactoredFormsAndOneKvHeadsContext) {
  const LayerWeights gqa = RandomLayerWeights(Config(24, 6, 2, 0, false), 4);
  const FormWeights factored = MaterializeFactored(gqa), summed = MaterializeSummed(gqa);
  EXPECT_EQ((AttentionJob{.form = &factored, .values = AttentionValues::kValueBlock, .ranges = {}}).StridedHeadWidth(),
            4);
  // Every head mixes the whole context, but the heads of different kv heads read the same
  // columns: not the strides of a batch over kv heads.
  EXPECT_EQ((AttentionJob{.form = &summed, .values = AttentionValues::kContext, .ranges = {}}).StridedHeadWidth(), 0);
  const LayerWeights mqa = RandomLayerWeights(Config(24, 6, 1, 0, false), 5);
  const FormWeights summed_mqa = MaterializeSummed(mqa);
  EXPECT_EQ((AttentionJob{.form = &summed_mqa, .values = AttentionValues::kContext, .ranges = {}}).StridedHeadWidth(),
            24);
  const FormWeights ragged = *MaterializeLowRank(gqa, {4, 3, 4, 4, 2, 4});
  EXPECT_EQ((AttentionJob{.form = &ragged, .values = AttentionValues::kValueBlock, .ranges = {}}).StridedHeadWidth(),
            0);
}

TEST(HeadCombineTest, EveryFormChoosesAndTheWeightsMustAgree) {
  EXPECT_EQ(HeadCombineOf(Form::kFactored), HeadCombine::kConcatThenProject);
  EXPECT_EQ(HeadCombineOf(Form::kLowRank), HeadCombine::kConcatThenProject);
  EXPECT_EQ(HeadCombineOf(Form::kSummed), HeadCombine::kSumOfMixes);
  const LayerWeights w = RandomLayerWeights(Config(16, 2, 2, 0, true), 3);
  FormWeights factored = MaterializeFactored(w), summed = MaterializeSummed(w);
  EXPECT_TRUE(CheckHeadCombine(factored).ok());
  EXPECT_TRUE(CheckHeadCombine(summed).ok());
  factored.w_out.clear();
  const Status missing = CheckHeadCombine(factored);
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("w_out: the factored form projects its heads' outputs"));
  EXPECT_THAT(missing.message(), HasSubstr("16 x 16"));
  EXPECT_THAT(missing.message(), HasSubstr("got 0"));
  summed.w_out.assign(5, 1.0f);
  EXPECT_THAT(CheckHeadCombine(summed).message(), HasSubstr("has no output projection (0 floats), got 5"));
}

}  // namespace
}  // namespace attnserve
