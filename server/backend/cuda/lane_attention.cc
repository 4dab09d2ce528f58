// The lane's compute: the DeviceOps the attention skeleton runs a batch with, on the lane's stream
// — cuBLAS for every GEMM (CublasOps), kernels.cu for the softmax, RoPE and bias adds — in
// blocks of query rows under the batch's score bound, and short sequences in groups
// (docs/architecture.md, "The CUDA backend", steps 2–5).
#include <algorithm>
#include <string>
#include <vector>

#include "server/backend/cuda/errors.h"
#include "server/backend/cuda/fused_attention.h"
#include "server/backend/cuda/kernels.h"
#include "server/backend/cuda/lane.h"

namespace attnserve::cuda {
namespace {

DeviceBlock Block(ConstMatrixView v) { return {const_cast<float*>(v.data), v.rows, v.cols, v.ld}; }

}  // namespace

// The batch's groups under its score piece and the softmax launch's table.
std::vector<RangeGroup> Lane::Groups(const FormWeights& f, std::span<const AttentionRange> ranges) const {
  return GroupRanges(f, ranges, batch_.score_bytes, batch_.score_capacity, kSoftmaxMaxBlocks);
}

// Scores of every head for a block of one sequence's queries (q's rows, the first of them
// query `first_row`) against k's rows: S_i = scale · Q_i K_g(i)^T ([heads, n, keys] in `s`),
// then the masked softmax. In column-major terms S_i^T = K_g · Q_i^T: op(K) = T. Heads
// i = g·group + j share K_g, so each j is one strided batch over the kv heads.
Status Lane::Scores(const LayerConfig& c, DeviceBlock q, DeviceBlock k, int64_t first_row, bool causal, float* s,
                    float* a_cat) {
  const int64_t n = q.rows, keys = k.rows, dh = c.d_head, group = c.group_size();
  for (int64_t j = 0; j < group; ++j) {
    ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmStridedBatched(CUBLAS_OP_T, keys, n, dh, c.SoftmaxScale(), k.data, k.ld, dh,
                                                        q.data + j * dh, q.ld, group * dh, s + j * n * keys, keys,
                                                        group * n * keys, c.kv_heads));
  }
  const cuda::ScoreOperands operands{
      .q = q.data, .q_ld = q.ld, .k = k.data, .k_ld = k.ld, .d_head = dh, .group = group, .scale = c.SoftmaxScale()};
  CUDA_TRY(cuda::MaskedSoftmax(s, c.heads, n, first_row, keys, causal, operands, a_cat, stream_));
  return OkStatus();
}

// O_i = A_i · values_i into out's columns of head i (AttentionJob's columns). Column-major:
// O_i^T = values_i^T · A_i^T. Heads at fixed strides (AttentionJob::StridedHeadWidth: the
// factored form) run as strided batches; the others (the low-rank form's ragged widths, the
// context as every head's values) head by head.
Status Lane::Mix(const AttentionJob& job, DeviceBlock values, const float* s, int64_t n, int64_t keys,
                 DeviceBlock out) {
  const LayerConfig& c = job.form->config;
  const int64_t group = c.group_size(), w = job.StridedHeadWidth();
  if (w > 0) {
    for (int64_t j = 0; j < group; ++j) {
      ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmStridedBatched(CUBLAS_OP_N, w, n, keys, 1.0f, values.data, values.ld, w,
                                                          s + j * n * keys, keys, group * n * keys, out.data + j * w,
                                                          out.ld, group * w, c.kv_heads));
    }
    return OkStatus();
  }
  for (int64_t i = 0; i < c.heads; ++i) {
    const DeviceBlock a{const_cast<float*>(s) + i * n * keys, n, keys, keys};
    ATTNSERVE_RETURN_IF_ERROR(gemms_.Gemm(a, values.Cols(job.ValueColumn(i), job.Width(i)).Rows(0, keys),
                                          out.Cols(job.OutColumn(i), job.Width(i))));
  }
  return OkStatus();
}

// Every head's scores and softmax for a group of single-block ranges: one pointer-array GEMM
// (entry (r, i): S_ri^T = K_g(i) Q_i^T of range r), one softmax launch; range r's scores at
// batch_.scores() + r·heads·rows·keys, and its A_cat (when a_cat is set) at a_cat + r·rows·keys·heads.
Status Lane::GroupScores(const LayerConfig& c, std::span<const AttentionRange* const> group, int64_t rows, int64_t keys,
                         float* a_cat) {
  const int64_t heads = c.heads, dh = c.d_head, per_range = heads * rows * keys;
  std::vector<const float*> a, b;
  std::vector<float*> out;
  cuda::SoftmaxBlocks blocks;
  for (size_t r = 0; r < group.size(); ++r) {
    const AttentionRange& range = *group[r];
    const float* q = range.q.row(range.row0);
    for (int64_t i = 0; i < heads; ++i) {
      a.push_back(range.k.data + c.KvHeadOf(i) * dh);
      b.push_back(q + i * dh);
      out.push_back(batch_.scores() + r * per_range + i * rows * keys);
    }
    blocks.block[blocks.count++] = {.scores = batch_.scores() + r * per_range,
                                    .a_cat = a_cat == nullptr ? nullptr : a_cat + r * per_range,
                                    .q = q,
                                    .k = range.k.data,
                                    .first_row = range.row0,
                                    .causal = range.sequence->causal};
  }
  const AttentionRange& first = *group.front();
  ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmPointerBatched(CUBLAS_OP_T, keys, rows, dh, c.SoftmaxScale(), a, first.k.ld, b,
                                                      first.q.ld, out, keys));
  const cuda::ScoreOperands shared{
      .q_ld = first.q.ld, .k_ld = first.k.ld, .d_head = dh, .group = c.group_size(), .scale = c.SoftmaxScale()};
  CUDA_TRY(cuda::MaskedSoftmaxBlocks(blocks, heads, rows, keys, shared, stream_));
  return OkStatus();
}

// The mixes of a group (after GroupScores): O_ri = A_ri · values_ri into range r's out columns
// of head i, one pointer-array GEMM per distinct head width (one for every form but the
// low-rank one, whose heads' ranks differ). Column-major: O^T = values^T · A^T.
Status Lane::GroupMix(const AttentionJob& job, std::span<const AttentionRange* const> group, int64_t rows,
                      int64_t keys) {
  const int64_t heads = job.form->config.heads, per_range = heads * rows * keys;
  std::vector<int64_t> widths;
  for (int64_t i = 0; i < heads; ++i) {
    if (std::find(widths.begin(), widths.end(), job.Width(i)) == widths.end()) widths.push_back(job.Width(i));
  }
  for (const int64_t width : widths) {
    if (width == 0) continue;
    std::vector<const float*> a, b;
    std::vector<float*> out;
    for (size_t r = 0; r < group.size(); ++r) {
      const AttentionRange& range = *group[r];
      for (int64_t i = 0; i < heads; ++i) {
        if (job.Width(i) != width) continue;
        a.push_back(range.values.data + job.ValueColumn(i));
        b.push_back(batch_.scores() + r * per_range + i * rows * keys);
        out.push_back(range.out.data + job.OutColumn(i));
      }
    }
    const AttentionRange& first = *group.front();
    ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmPointerBatched(CUBLAS_OP_N, width, rows, keys, 1.0f, a, first.values.ld, b,
                                                        keys, out, first.out.ld));
  }
  return OkStatus();
}

Status Lane::Gemm(ConstMatrixView x, ConstMatrixView w, const float* bias, MatrixView y, bool accumulate) {
  if (replaying()) return OkStatus();  // the batch's graph does it (LaunchGraph)
  ATTNSERVE_RETURN_IF_ERROR(gemms_.Gemm(Block(x), Block(w), Block(y), 1.0f, accumulate ? 1.0f : 0.0f));
  if (bias != nullptr) CUDA_TRY(cuda::AddRowBias(y.data, y.rows, y.cols, y.ld, bias, stream_));
  return OkStatus();
}

// Under 16-bit weights (Math kBf16, kFp16): the 16-bit block of the weights by its name, the
// activations as a 16-bit input (HalfOperand), one GEMM accumulating in float32 into float32 y:
// with a bias, cuBLASLt's with the bias in its epilogue where it has an algorithm for the
// operands (CublasOps::GemmHalfBias), else cublasGemmEx and the bias kernel.
Status Lane::GemmWeights(ConstMatrixView x, const WeightBlock& w, const float* bias, MatrixView y, bool accumulate) {
  if (replaying()) return OkStatus();  // the batch's graph does it (LaunchGraph)
  if (!HalfWeights(math())) return Gemm(x, w.view, bias, y, accumulate);
  if (resident_ == nullptr) return InternalError("GemmWeights: no form is running on this lane");
  ATTNSERVE_ASSIGN_OR_RETURN(const HalfBlock w16, resident_->HalfBlockOf(w));
  ATTNSERVE_ASSIGN_OR_RETURN(const HalfBlock x16, HalfOperand(x));
  const float beta = accumulate ? 1.0f : 0.0f;
  if (bias != nullptr) {
    ATTNSERVE_ASSIGN_OR_RETURN(const bool fused, gemms_.GemmHalfBias(x16, w16, bias, Block(y), beta));
    if (fused) return OkStatus();
  }
  ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmHalf(x16, w16, Block(y), beta));
  if (bias != nullptr) CUDA_TRY(cuda::AddRowBias(y.data, y.rows, y.cols, y.ld, bias, stream_));
  return OkStatus();
}

StatusOr<HalfBlock> Lane::HalfOperand(ConstMatrixView x) {
  const float* staged = batch_.piece[kInputs];
  const auto* staged16 = reinterpret_cast<const uint16_t*>(batch_.piece[kHalfInputs]);
  const int64_t first = x.data - staged;
  if (x.rows > 0 && first >= 0 && first + (x.rows - 1) * x.ld + x.cols <= batch_.staged_values) {
    return HalfBlock{staged16 + first, x.rows, x.cols, x.ld};
  }
  if (x.rows * x.cols > batch_.half_operand_capacity) {
    return InternalError("GemmWeights: a [" + std::to_string(x.rows) + ", " + std::to_string(x.cols) +
                         "] input past the 16-bit operand piece of " + std::to_string(batch_.half_operand_capacity) +
                         " values");
  }
  auto* dst = reinterpret_cast<uint16_t*>(batch_.piece[kHalfOperands]);
  CUDA_TRY(cuda::ConvertToHalf(x.data, x.rows, x.cols, x.ld, dst, std::max<int64_t>(x.cols, 1), HalfFormatOf(math()), stream_));
  return HalfBlock{dst, x.rows, x.cols, std::max<int64_t>(x.cols, 1)};
}

// One launch per kRopeMaxRuns sequences (a run that does not follow on from the one before
// starts a launch of its own).
Status Lane::Rope(MatrixView m, int64_t heads, int64_t d_head, double theta, std::span<const RopeRun> runs) {
  if (replaying()) return OkStatus();  // the batch's graph does it (LaunchGraph)
  cuda::RopeRuns launch;
  const auto flush = [&]() -> Status {
    if (launch.count > 0) CUDA_TRY(cuda::ApplyRope(m.data, heads, d_head, m.ld, theta, launch, stream_));
    launch = {};
    return OkStatus();
  };
  for (const RopeRun& run : runs) {
    if (run.rows == 0) continue;
    if (launch.count == cuda::kRopeMaxRuns || (launch.count > 0 && run.row0 != launch.end)) {
      ATTNSERVE_RETURN_IF_ERROR(flush());
    }
    launch.row0[launch.count] = run.row0;
    launch.position[launch.count] = run.position;
    ++launch.count;
    launch.end = run.row0 + run.rows;
  }
  return flush();
}

// Every range in the fused kernel: its table filled in range order, a launch each time it is full
// or the next range's leading dimensions differ (they do not within one batch's buffers).
Status Lane::FusedAttend(const AttentionJob& job, const FusedShape& shape) {
  const LayerConfig& c = job.form->config;
  cuda::FusedRanges launch;
  cuda::FusedLayout layout;
  const auto flush = [&]() -> Status {
    // Under bf16 the tensor cores' kernel; fp16's range (65504) would overflow scores and values
    // float32 holds, so fp16 and tf32 keep the float32 kernel.
    if (launch.count > 0) {
      CUDA_TRY(math() == Math::kBf16 ? cuda::FusedAttentionBf16(launch, layout, stream_)
                                        : cuda::FusedAttention(launch, layout, stream_));
    }
    launch.count = 0;
    return OkStatus();
  };
  for (const AttentionRange& range : job.ranges) {
    if (range.rows == 0) continue;
    const cuda::FusedLayout mine{.q_ld = range.q.ld,
                                 .k_ld = range.k.ld,
                                 .values_ld = range.values.ld,
                                 .out_ld = range.out.ld,
                                 .heads = static_cast<int32_t>(c.heads),
                                 .group = static_cast<int32_t>(c.group_size()),
                                 .d_head = static_cast<int32_t>(c.d_head),
                                 .width = static_cast<int32_t>(shape.width),
                                 .value_stride = static_cast<int32_t>(shape.value_stride),
                                 .value_group = static_cast<int32_t>(shape.value_group),
                                 .scale = c.SoftmaxScale()};
    const bool same = mine.q_ld == layout.q_ld && mine.k_ld == layout.k_ld && mine.values_ld == layout.values_ld &&
                      mine.out_ld == layout.out_ld;
    if (launch.count == cuda::kFusedMaxRanges || (launch.count > 0 && !same)) ATTNSERVE_RETURN_IF_ERROR(flush());
    layout = mine;
    launch.range[launch.count++] = {.q = range.q.row(range.row0),
                                    .k = range.k.data,
                                    .values = range.values.data,
                                    .out = range.out.data,
                                    .first_row = range.row0,
                                    .rows = static_cast<int32_t>(range.rows),
                                    .keys = static_cast<int32_t>(range.sequence->visible_keys()),
                                    .causal = range.sequence->causal};
  }
  return flush();
}

// The fused kernel where it takes the job (CudaBackendOptions::gemm_attention, FusedShapeOf);
// else per range, blocks of query rows: every head's scores and softmax in the score piece,
// then the mix into the block's rows of out.
Status Lane::Attend(const AttentionJob& job) {
  if (replaying()) return OkStatus();  // the batch's graph does it (LaunchGraph)
  const LayerConfig& c = job.form->config;
  if (!options_.gemm_attention) {
    const FusedShape shape = FusedShapeOf(*job.form, job.values);
    if (shape.width > 0) return FusedAttend(job, shape);
  }
  for (const RangeGroup& g : Groups(*job.form, job.ranges)) {
    if (g.ranges.size() > 1) {
      ATTNSERVE_RETURN_IF_ERROR(GroupScores(c, g.ranges, g.rows, g.keys, nullptr));
      ATTNSERVE_RETURN_IF_ERROR(GroupMix(job, g.ranges, g.rows, g.keys));
      continue;
    }
    const AttentionRange& range = *g.ranges.front();
    ATTNSERVE_RETURN_IF_ERROR(
        ForEachBlock(*job.form, range, batch_.score_bytes, [&](int64_t row0, int64_t rows, int64_t keys) {
          ATTNSERVE_RETURN_IF_ERROR(Scores(c, Block(range.q).Rows(row0, rows), Block(range.k).Rows(0, keys), row0,
                                           range.sequence->causal, batch_.scores()));
          return Mix(job, Block(range.values), batch_.scores(), rows, keys,
                     Block(range.out).Rows(row0 - range.row0, rows));
        }));
  }
  return OkStatus();
}

// Per range, blocks of query rows: the scores, their softmax written straight into the block's
// A_cat (a second score piece), and the head sum as one GEMM into the block's rows of out;
// then the bias.
Status Lane::SumHeadsProjectingFirst(const FormWeights& f, std::span<const AttentionRange> ranges, const float* bias) {
  if (replaying()) return OkStatus();  // the batch's graph does it (LaunchGraph)
  const LayerConfig& c = f.config;
  for (const RangeGroup& g : Groups(f, ranges)) {
    if (g.ranges.size() > 1) {
      // Each range's A_cat [rows, keys·h] by the group's softmax, then every range's head sum
      // out_r = A_cat_r · [M_1; …; M_h] in one pointer-array GEMM.
      ATTNSERVE_RETURN_IF_ERROR(GroupScores(c, g.ranges, g.rows, g.keys, batch_.a_cat()));
      const int64_t inner = g.keys * c.heads;
      std::vector<const float*> m, a;
      std::vector<float*> out;
      for (size_t r = 0; r < g.ranges.size(); ++r) {
        m.push_back(g.ranges[r]->values.data);
        a.push_back(batch_.a_cat() + r * g.rows * inner);
        out.push_back(g.ranges[r]->out.data);
      }
      ATTNSERVE_RETURN_IF_ERROR(gemms_.GemmPointerBatched(CUBLAS_OP_N, c.d_model, g.rows, inner, 1.0f, m, c.d_model, a,
                                                          inner, out, g.ranges.front()->out.ld));
      continue;
    }
    const AttentionRange& range = *g.ranges.front();
    ATTNSERVE_RETURN_IF_ERROR(ForEachBlock(f, range, batch_.score_bytes, [&](int64_t row0, int64_t rows, int64_t keys) {
      ATTNSERVE_RETURN_IF_ERROR(Scores(c, Block(range.q).Rows(row0, rows), Block(range.k).Rows(0, keys), row0,
                                       range.sequence->causal, batch_.scores(), batch_.a_cat()));
      const MatrixView a_cat(batch_.a_cat(), rows, keys * c.heads);
      const ConstMatrixView m(range.values.data, keys * c.heads, c.d_model);
      return Gemm(a_cat, m, nullptr, range.out.RowBlock(row0 - range.row0, rows), /*accumulate=*/false);
    }));
  }
  // The bias once over the outputs, not once a block or a range: the ranges' rows follow each
  // other in y, so one launch covers each run of adjacent ones (all of them, here).
  if (bias == nullptr) return OkStatus();
  for (size_t first = 0; first < ranges.size();) {
    MatrixView rows = ranges[first].out;
    size_t last = first + 1;
    for (; last < ranges.size(); ++last) {
      const MatrixView next = ranges[last].out;
      if (next.data != rows.row(rows.rows) || next.ld != rows.ld || next.cols != rows.cols) break;
      rows.rows += next.rows;
    }
    CUDA_TRY(cuda::AddRowBias(rows.data, rows.rows, rows.cols, rows.ld, bias, stream_));
    first = last;
  }
  return OkStatus();
}

}  // namespace attnserve::cuda
