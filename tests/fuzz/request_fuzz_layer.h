// The fixed layer both request fuzz targets (forward_request, infer_request) run what they
// decode on: small, grouped-query, rotary (position_offset matters) and holding every form, so
// each accepted request runs through the factored, summed and low-rank paths on the CPU.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <google/protobuf/stubs/common.h>

#include "server/backend/cpu/cpu_backend.h"
#include "server/store/layer_store.h"

namespace attnserve::fuzz {

inline constexpr char kLayerSource[] = "random:d_model=8,heads=4,kv_heads=2,rope_theta=10000,seed=3,lowrank=budget:6";
// Small enough that a request near it still runs in milliseconds; the server's default is
// 4096 M scores, which inputs of libFuzzer's sizes never approach.
inline constexpr int64_t kMaxRequestScores = int64_t{1} << 20;

struct RequestFuzzLayer {
  CpuBackend backend{CpuBackendOptions{.threads = 1}};
  LayerStore store{&backend};
  std::shared_ptr<const Layer> layer;

  // `target` names the fuzz target in the message when the layer does not load.
  explicit RequestFuzzLayer(const char* target) {
#if GOOGLE_PROTOBUF_VERSION < 4022000
    // Protobuf logs every string field with invalid UTF-8 it refuses: millions of lines here.
    google::protobuf::SetLogHandler(nullptr);
#endif
    auto loaded = store.Load("fuzz", kLayerSource);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s fuzz: cannot load %s: %s\n", target, kLayerSource, loaded.status().ToString().c_str());
      std::abort();
    }
    layer = *loaded;
  }
};

}  // namespace attnserve::fuzz
