#include "server/core/reference.h"

#include <algorithm>
#include <cmath>

#include "server/core/rope.h"

namespace attnserve {
namespace {

// y = x W + b for x [rows, d] (float views) and W [d, cols]; all in double.
std::vector<double> Project(ConstMatrixView x, const std::vector<float>& w, const std::vector<float>& b,
                            int64_t cols) {
  const int64_t rows = x.rows, d = x.cols;
  std::vector<double> y(rows * cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < d; ++k) {
      const double xv = x.at(r, k);
      for (int64_t c = 0; c < cols; ++c) y[r * cols + c] += xv * w[k * cols + c];
    }
    if (!b.empty()) {
      for (int64_t c = 0; c < cols; ++c) y[r * cols + c] += b[c];
    }
  }
  return y;
}

// A_i for every query head, [n, m] each (zero beyond the visible keys), from the definition:
// projections, rotary embedding, scaled scores, masks and a row-wise softmax, all in double.
std::vector<std::vector<double>> AttentionWeights(const LayerWeights& w, const Sequence& seq) {
  const LayerConfig& c = w.config;
  const int64_t n = seq.n(), m = seq.m(), dh = c.d_head;
  const int64_t qc = c.heads * dh, kvc = c.kv_heads * dh;
  std::vector<double> q = Project(seq.input, w.w_q, w.b_q, qc);
  std::vector<double> k = Project(seq.keys_source(), w.w_k, w.b_k, kvc);
  if (c.rope_theta > 0) {
    // Rotary embedding from its definition: pair (t, t + d_h/2) turned by p · θ^(−2t/d_h).
    auto rotate = [&](std::vector<double>& x, int64_t rows, int64_t heads, int64_t first) {
      const int64_t cols = heads * dh;
      ApplyRopeFloat64([&](int64_t r, int64_t col) -> double& { return x[r * cols + col]; }, rows, heads, dh,
                       c.rope_theta, first);
    };
    rotate(q, n, c.heads, seq.position_offset);
    rotate(k, m, c.kv_heads, seq.self_attention() ? seq.position_offset : 0);
  }
  const double scale = c.scale != 0.0f ? c.scale : 1.0 / std::sqrt(static_cast<double>(dh));

  std::vector<std::vector<double>> a(c.heads, std::vector<double>(n * m, 0.0));
  for (int64_t i = 0; i < c.heads; ++i) {
    const int64_t g = i / (c.heads / c.kv_heads);
    for (int64_t r = 0; r < n; ++r) {
      // Written out here rather than shared with the backends, so a mask bug cannot hide.
      int64_t keys = seq.key_length < 0 ? m : seq.key_length;
      if (seq.causal) keys = std::min(keys, r + 1);
      double* p = a[i].data() + r * m;
      double top = -INFINITY;
      for (int64_t j = 0; j < keys; ++j) {
        double s = 0;
        for (int64_t t = 0; t < dh; ++t) s += q[r * qc + i * dh + t] * k[j * kvc + g * dh + t];
        p[j] = s * scale;
        top = std::max(top, p[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - top));
      for (int64_t j = 0; j < keys; ++j) p[j] /= sum;
    }
  }
  return a;
}

}  // namespace

std::vector<double> ReferenceForward(const LayerWeights& w, const Sequence& seq) {
  const LayerConfig& c = w.config;
  const int64_t n = seq.n(), m = seq.m(), d = c.d_model, dh = c.d_head;
  const int64_t qc = c.heads * dh, kvc = c.kv_heads * dh;
  const std::vector<std::vector<double>> a = AttentionWeights(w, seq);
  const std::vector<double> v = Project(seq.keys_source(), w.w_v, w.b_v, kvc);

  std::vector<double> concat(n * qc, 0.0);
  for (int64_t i = 0; i < c.heads; ++i) {
    const int64_t g = i / (c.heads / c.kv_heads);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < m; ++j) {
        const double p = a[i][r * m + j];
        for (int64_t t = 0; t < dh; ++t) concat[r * qc + i * dh + t] += p * v[j * kvc + g * dh + t];
      }
    }
  }
  std::vector<double> y(n * d, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t t = 0; t < qc; ++t) {
      const double o = concat[r * qc + t];
      for (int64_t col = 0; col < d; ++col) y[r * d + col] += o * w.w_o[t * d + col];
    }
    if (!w.b_o.empty()) {
      for (int64_t col = 0; col < d; ++col) y[r * d + col] += w.b_o[col];
    }
  }
  return y;
}

std::vector<double> ReferenceForwardWithHeadMatrices(const LayerWeights& w,
                                                     const std::vector<std::vector<double>>& head_matrices,
                                                     const std::vector<double>& output_bias, const Sequence& seq) {
  const LayerConfig& c = w.config;
  const int64_t n = seq.n(), m = seq.m(), d = c.d_model;
  const std::vector<std::vector<double>> a = AttentionWeights(w, seq);
  const ConstMatrixView ctx = seq.keys_source();
  std::vector<double> y(n * d, 0.0), cm(m * d);
  for (int64_t i = 0; i < c.heads; ++i) {
    // C M_i, then A_i (C M_i).
    const std::vector<double>& mi = head_matrices[i];
    std::fill(cm.begin(), cm.end(), 0.0);
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        const double x = ctx.at(j, k);
        for (int64_t col = 0; col < d; ++col) cm[j * d + col] += x * mi[k * d + col];
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < m; ++j) {
        const double p = a[i][r * m + j];
        if (p == 0) continue;
        for (int64_t col = 0; col < d; ++col) y[r * d + col] += p * cm[j * d + col];
      }
    }
  }
  if (!output_bias.empty()) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t col = 0; col < d; ++col) y[r * d + col] += output_bias[col];
    }
  }
  return y;
}

}  // namespace attnserve
