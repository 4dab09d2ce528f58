// Built against an installed attnserve_client package (tests/install/install_test.sh): asks a
// real server for a layer's shape, runs the same random input through the factored and the
// summed forms (two computations that share no weights), and checks they agree.
//   consumer TARGET LAYER   -> prints "consumer: ok ..." and exits 0, else names what failed
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "client/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consumer TARGET LAYER\n");
    return 2;
  }
  attnserve::ClientOptions options;
  options.target = argv[1];
  attnserve::Client client(options);
  attnserve::v1::LayerInfo info;
  grpc::Status status = client.GetLayer(argv[2], &info);
  if (!status.ok()) {
    std::fprintf(stderr, "consumer: GetLayer: %s: %s\n", attnserve::GrpcCodeName(status.error_code()),
                 status.error_message().c_str());
    return 1;
  }
  const int64_t d = info.config().d_model(), n = 8;
  std::vector<float> x(static_cast<size_t>(n * d));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  std::vector<float> outputs[2];
  const attnserve::v1::Form forms[2] = {attnserve::v1::FORM_FACTORED, attnserve::v1::FORM_SUMMED};
  for (int f = 0; f < 2; ++f) {
    attnserve::v1::ForwardRequest request;
    request.set_layer(argv[2]);
    request.set_form(forms[f]);
    *request.mutable_input() = attnserve::MakeTensor(x, {1, n, d});
    attnserve::v1::ForwardResponse response;
    status = client.Forward(request, &response);
    if (status.ok()) status = attnserve::TensorToFloats(response.output(), &outputs[f]);
    if (!status.ok() || response.form() != forms[f] || outputs[f].size() != x.size()) {
      std::fprintf(stderr, "consumer: Forward (%s): %s: %s\n", attnserve::v1::Form_Name(forms[f]).c_str(),
                   attnserve::GrpcCodeName(status.error_code()), status.error_message().c_str());
      return 1;
    }
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff += std::pow(double(outputs[0][i]) - outputs[1][i], 2);
    norm += std::pow(double(outputs[0][i]), 2);
  }
  const double rel_l2 = std::sqrt(diff / norm);
  if (!(rel_l2 < 1e-5) || norm == 0) {
    std::fprintf(stderr, "consumer: the forms disagree: rel_l2 %g, |factored|^2 %g\n", rel_l2, norm);
    return 1;
  }
  std::printf("consumer: ok d_model=%lld forms agree rel_l2=%.3g\n", static_cast<long long>(d), rel_l2);
  return 0;
}
