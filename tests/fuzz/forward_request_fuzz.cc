// libFuzzer target: bytes → attnserve.v1.ForwardRequest → the service's decode and validation
// path (server/service/validation.h), as AttentionServiceImpl::Forward runs it
// (server/service/service.cc), over a fixed random layer, and then the CPU backend on what
// DecodeForward accepted. Nothing may crash, and a request DecodeForward accepts must run:
// the executor batches requests together, so one the backend refused would fail the batch for
// every other request in it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include <google/protobuf/stubs/common.h>

#include "attnserve/v1/attention.pb.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/service/validation.h"
#include "server/service/wire_request.h"
#include "server/store/layer_store.h"
#include "tests/fuzz/request_fuzz_layer.h"

namespace {

namespace v1 = attnserve::v1;
using namespace attnserve;

using fuzz::kMaxRequestScores;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Never destroyed: no exit-time ordering.
  static fuzz::RequestFuzzLayer* const fixture = new fuzz::RequestFuzzLayer("forward_request");
  const Layer& layer = *fixture->layer;

  v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;

  StatusOr<Form> form = ChooseForm(request.form(), layer);
  if (!form.ok()) return 0;

  const WireForwardRequest wire = WireRequestOf(request);
  auto decoded = DecodeForward(layer.config, wire, ForwardLimits{.max_request_scores = kMaxRequestScores});
  if (!decoded.ok()) return 0;

  // Accepted: every held form must compute it (Forward with compare runs them all).
  std::vector<float> output(decoded->output_elements());
  const std::vector<Sequence> sequences = decoded->Sequences(output.data());
  for (const auto& [f, resident] : layer.forms) {
    const Status status = fixture->backend.Forward(*resident, sequences);
    if (!status.ok()) {
      std::fprintf(stderr, "forward_request fuzz: DecodeForward accepted a request the %s form refused: %s\n",
                   std::string(FormName(f)).c_str(), status.ToString().c_str());
      std::abort();
    }
  }
  return 0;
}
