// attnserve-cli forward --layer L (--input X.npy | --random B,N[,M]) ...
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "client/cli/args.h"
#include "client/cli/commands.h"
#include "client/npy.h"

namespace attnserve::cli {
namespace {

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::string s = "[";
  for (int i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

grpc::Status Invalid(std::string m) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(m));
}

// A [b, n, d] tensor of N(0, 1) values drawn from `rng`, refused locally when it could not be
// sent anyway (so a typo does not allocate gigabytes first).
grpc::Status RandomTensor(int64_t b, int64_t n, int64_t d, const ClientOptions& options,
                          std::mt19937_64* rng, v1::Tensor* out) {
  const double bytes = static_cast<double>(b) * static_cast<double>(n) * static_cast<double>(d) * 4;
  const double limit = options.max_message_mb > 0
                           ? static_cast<double>(options.max_message_mb) * 1024 * 1024
                           : static_cast<double>(std::numeric_limits<int32_t>::max());
  if (bytes > limit) {
    return Invalid("--random: a [" + std::to_string(b) + ", " + std::to_string(n) + ", " +
                   std::to_string(d) + "] float32 tensor needs " + Num(bytes) +
                   " bytes, more than the message limit of " + Num(limit) + " (--max-message-mb)");
  }
  std::vector<float> v(static_cast<size_t>(b * n * d));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : v) x = normal(*rng);
  *out = MakeTensor(v, {b, n, d});
  return grpc::Status::OK;
}

grpc::Status NpyTensor(const std::string& path, v1::Tensor* out) {
  NpyArray a;
  if (grpc::Status s = ReadNpy(path, &a); !s.ok()) return s;
  *out = MakeTensor(a.data, a.shape);
  return grpc::Status::OK;
}

}  // namespace

int RunForward(CommandContext& ctx, const std::vector<std::string>& args) {
  ForwardArgs fa;
  std::string error;
  if (!ParseForwardArgs(args, &fa, &error)) return ctx.UsageError("forward", error);

  v1::ForwardRequest req;
  req.set_layer(fa.layer);
  req.set_form(fa.form);
  req.set_causal(fa.causal);
  req.set_compare(fa.compare);
  req.set_request_key(fa.request_key);
  req.set_math(fa.math);
  for (int32_t k : fa.key_lengths) req.add_key_lengths(k);

  if (!fa.input.empty()) {
    if (grpc::Status s = NpyTensor(fa.input, req.mutable_input()); !s.ok()) return ctx.Fail(s);
  } else {
    // The random input needs the layer's width.
    v1::LayerInfo info;
    if (grpc::Status s = ctx.client().GetLayer(fa.layer, &info); !s.ok()) return ctx.Fail(s);
    const int64_t d = info.config().d_model();
    std::mt19937_64 rng(fa.seed);
    if (grpc::Status s =
            RandomTensor(fa.random[0], fa.random[1], d, ctx.options(), &rng, req.mutable_input());
        !s.ok()) {
      return ctx.Fail(s);
    }
    if (fa.random.size() == 3) {
      if (grpc::Status s = RandomTensor(fa.random[0], fa.random[2], d, ctx.options(), &rng,
                                        req.mutable_context());
          !s.ok()) {
        return ctx.Fail(s);
      }
    }
  }
  if (!fa.context.empty()) {
    if (grpc::Status s = NpyTensor(fa.context, req.mutable_context()); !s.ok()) return ctx.Fail(s);
  }

  v1::ForwardResponse resp;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s = ctx.client().Forward(req, &resp);
  const double client_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) return ctx.Fail(s);

  std::vector<float> y;
  if (grpc::Status st = TensorToFloats(resp.output(), &y); !st.ok()) {
    return ctx.Fail(grpc::Status(st.error_code(), "response output: " + st.error_message()));
  }
  std::ostream& out = ctx.out();
  out << "form: " << FormName(resp.form()) << "\n"
      << "math: " << resp.math() << "\n"
      << "queue_us: " << resp.queue_us() << "\n"
      << "decode_us: " << resp.decode_us() << "\n"
      << "compute_us: " << resp.compute_us() << "\n"
      << "encode_us: " << resp.encode_us() << "\n"
      << "batch_requests: " << resp.batch_requests() << "\n"
      << "client_ms: " << Num(client_ms) << "\n"
      << "output_shape: " << ShapeText(resp.output().shape()) << "\n";
  if (!y.empty()) {
    // Accumulated in double: float sums over large outputs lose the digits printed here.
    double sum = 0, sum2 = 0, lo = std::numeric_limits<double>::infinity(), hi = -lo;
    size_t nonfinite = 0, finite = 0;
    for (float v : y) {
      if (!std::isfinite(v)) {
        ++nonfinite;
        continue;
      }
      ++finite;
      sum += v;
      sum2 += static_cast<double>(v) * v;
      lo = std::min(lo, static_cast<double>(v));
      hi = std::max(hi, static_cast<double>(v));
    }
    if (finite > 0) {
      const double mean = sum / static_cast<double>(finite);
      const double var = std::max(0.0, sum2 / static_cast<double>(finite) - mean * mean);
      out << "mean: " << Num(mean) << "\n"
          << "std: " << Num(std::sqrt(var)) << "\n"
          << "min: " << Num(lo) << "\n"
          << "max: " << Num(hi) << "\n";
    }
    out << "nonfinite: " << nonfinite << "\n"
        << "first:";
    for (size_t i = 0; i < y.size() && i < 6; ++i) out << " " << Num(y[i]);
    out << "\n";
  }
  for (const v1::Divergence& d : resp.divergence()) {
    out << "divergence: form=" << FormName(d.form()) << " max_abs=" << Num(d.max_abs())
        << " rel_l2=" << Num(d.rel_l2()) << "\n";
  }
  if (!fa.output.empty()) {
    NpyArray a;
    a.shape.assign(resp.output().shape().begin(), resp.output().shape().end());
    a.data = std::move(y);
    if (grpc::Status st = WriteNpy(fa.output, a); !st.ok()) return ctx.Fail(st);
    out << "output_file: " << fa.output << "\n";
  }
  return kExitOk;
}

}  // namespace attnserve::cli
