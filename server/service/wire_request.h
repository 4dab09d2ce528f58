// attnserve.v1.ForwardRequest as validation.h's WireForwardRequest: views of the message's
// fields, no copies. One conversion for the service and the request fuzzer, so the fuzzer
// drives exactly what the service decodes. Header-only: it needs the generated message and
// validation.h, nothing of gRPC.
// Thread-safety: a pure function; the views live as long as the message.
#pragma once

#include <span>

#include "attnserve/v1/attention.pb.h"
#include "server/service/validation.h"

namespace attnserve {

inline WireTensor WireTensorOf(bool present, const v1::Tensor& t) {
  WireTensor w;
  w.present = present;
  w.dtype = static_cast<int>(t.dtype());
  w.shape = std::span<const int64_t>(t.shape().data(), t.shape().size());
  w.data = t.data();
  return w;
}

inline WireForwardRequest WireRequestOf(const v1::ForwardRequest& request) {
  WireForwardRequest wire;
  wire.layer = request.layer();
  wire.form = request.form();
  wire.input = WireTensorOf(request.has_input(), request.input());
  wire.context = WireTensorOf(request.has_context(), request.context());
  wire.causal = request.causal();
  wire.key_lengths = std::span<const int32_t>(request.key_lengths().data(), request.key_lengths().size());
  wire.position_offset = request.position_offset();
  wire.request_key = request.request_key();
  wire.compare = request.compare();
  wire.math = request.math();
  return wire;
}

}  // namespace attnserve
