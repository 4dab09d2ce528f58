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

namespace {

namespace v1 = attnserve::v1;
using namespace attnserve;

// A small grouped-query layer with rotary embedding (position_offset matters) holding every
// form, so each decoded request runs through the factored, summed and low-rank paths.
constexpr char kLayerSource[] = "random:d_model=8,heads=4,kv_heads=2,rope_theta=10000,seed=3,lowrank=budget:6";
// Small enough that a request near it still runs in milliseconds; the server's default is
// 2 GiB, which inputs of libFuzzer's sizes never approach.
constexpr int64_t kMaxScoreBytes = int64_t{4} << 20;

struct Fixture {
  CpuBackend backend{CpuBackendOptions{.threads = 1}};
  LayerStore store{&backend};
  std::shared_ptr<const Layer> layer;

  Fixture() {
#if GOOGLE_PROTOBUF_VERSION < 4022000
    // Protobuf logs every string field with invalid UTF-8 it refuses: millions of lines here.
    google::protobuf::SetLogHandler(nullptr);
#endif
    auto loaded = store.Load("fuzz", kLayerSource);
    if (!loaded.ok()) {
      std::fprintf(stderr, "forward_request fuzz: cannot load %s: %s\n", kLayerSource,
                   loaded.status().ToString().c_str());
      std::abort();
    }
    layer = *loaded;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* const fixture = new Fixture();  // never destroyed: no exit-time ordering
  const Layer& layer = *fixture->layer;

  v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;

  StatusOr<Form> form = ChooseForm(request.form(), layer);
  if (!form.ok()) return 0;

  const WireForwardRequest wire = WireRequestOf(request);
  auto decoded = DecodeForward(layer.config, wire, ForwardLimits{.max_score_bytes = kMaxScoreBytes});
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
