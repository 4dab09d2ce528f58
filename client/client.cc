#include "client/client.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>

#include <bit>
#include <climits>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

namespace attnserve {

std::string ReadPemFile(const std::string& what, const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) text.clear();
  if (text.find("-----BEGIN ") == std::string::npos) {
    *error = what + ": cannot read a PEM file at '" + path + "'";
    return "";
  }
  return text;
}

namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const ClientOptions& o) {
  grpc::ChannelArguments args;
  // MiB -> bytes, saturating: gRPC takes an int, and -1 means unlimited.
  int bytes = -1;
  if (o.max_message_mb > 0 && o.max_message_mb <= INT_MAX / (1024 * 1024)) {
    bytes = o.max_message_mb * 1024 * 1024;
  }
  args.SetMaxReceiveMessageSize(bytes);
  args.SetMaxSendMessageSize(bytes);
  if (!o.load_balancing.empty()) {
    // The default service config, so the policy applies to every resolver (dns:///, ipv4:, ...)
    // unless the resolver itself supplies a service config.
    const nlohmann::json config = {{"loadBalancingConfig", {{{o.load_balancing, nlohmann::json::object()}}}}};
    args.SetServiceConfigJSON(config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  if (!o.tls()) return grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args);
  grpc::SslCredentialsOptions ssl;
  std::string error;  // the CLI read the files once already; a file gone since fails the handshake
  if (!o.tls_ca.empty()) ssl.pem_root_certs = ReadPemFile("tls_ca", o.tls_ca, &error);
  if (!o.tls_cert.empty()) {
    ssl.pem_cert_chain = ReadPemFile("tls_cert", o.tls_cert, &error);
    ssl.pem_private_key = ReadPemFile("tls_key", o.tls_key, &error);
  }
  if (!o.server_name.empty()) args.SetSslTargetNameOverride(o.server_name);
  return grpc::CreateCustomChannel(o.target, grpc::SslCredentials(ssl), args);
}

// The grpc.health.v1 messages are tiny and Debian ships no health.proto, so they are encoded by
// hand and sent through the generic stub. This also keeps a second copy of the health
// descriptors out of binaries that link both the client and a server with its own copy.
//   HealthCheckRequest  { string service = 1; }
//   HealthCheckResponse { ServingStatus status = 1; }
std::string EncodeHealthRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;  // proto3: the default value is not sent
  out += static_cast<char>(0x0a);   // field 1, wire type 2 (length-delimited)
  uint64_t n = service.size();
  while (n >= 0x80) {
    out += static_cast<char>((n & 0x7f) | 0x80);
    n >>= 7;
  }
  out += static_cast<char>(n);
  out += service;
  return out;
}

bool DecodeHealthResponse(const std::string& bytes, int* status) {
  namespace pb = google::protobuf;
  using WFL = pb::internal::WireFormatLite;
  pb::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                              static_cast<int>(bytes.size()));
  *status = 0;
  while (true) {
    uint32_t tag = in.ReadTag();
    if (tag == 0) return in.CurrentPosition() == static_cast<int>(bytes.size());  // else malformed
    if (WFL::GetTagFieldNumber(tag) == 1 && WFL::GetTagWireType(tag) == WFL::WIRETYPE_VARINT) {
      uint32_t v = 0;
      if (!in.ReadVarint32(&v)) return false;
      *status = static_cast<int>(v);
    } else if (!WFL::SkipField(&in, tag)) {
      return false;
    }
  }
}

// Runs `fn` and turns an escaping exception into a status: no exception leaves the client.
template <typename Fn>
grpc::Status Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string("client: ") + e.what());
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "client: unknown exception");
  }
}

}  // namespace

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

const char* ServingStatusName(ServingStatus s) {
  switch (s) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

Client::Client(ClientOptions options)
    : options_(std::move(options)),
      channel_(MakeChannel(options_)),
      stub_(v1::AttentionService::NewStub(channel_)) {}

Client::~Client() = default;

std::unique_ptr<grpc::ClientContext> Client::NewContext(bool admin) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (options_.timeout.count() > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  }
  if (admin && !options_.admin_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.admin_token);
  }
  return ctx;
}

grpc::Status Client::Forward(const v1::ForwardRequest& req, v1::ForwardResponse* resp) {
  return Guard([&] {
    auto ctx = NewContext();
    return stub_->Forward(ctx.get(), req, resp);
  });
}

void Client::ForwardAsync(v1::ForwardRequest req,
                          std::function<void(grpc::Status, v1::ForwardResponse)> done) {
  // Everything the call touches lives until the callback has run.
  struct Call {
    std::unique_ptr<grpc::ClientContext> ctx;
    v1::ForwardRequest req;
    v1::ForwardResponse resp;
    std::function<void(grpc::Status, v1::ForwardResponse)> done;
  };
  Call* call = nullptr;
  try {
    call = new Call{NewContext(), std::move(req), {}, std::move(done)};
    stub_->async()->Forward(call->ctx.get(), &call->req, &call->resp, [call](grpc::Status s) {
      // The call (and its context's reference to the channel) goes before the user's callback:
      // that callback may let the Client go, and the channel must not then die on gRPC's thread
      // while this call still holds it (gRPC 1.51 aborts on that).
      auto done = std::move(call->done);
      v1::ForwardResponse resp = std::move(call->resp);
      delete call;
      try {
        if (done) done(std::move(s), std::move(resp));
      } catch (...) {
        // A throwing user callback must not unwind into gRPC's threads; it is dropped.
      }
    });
  } catch (const std::exception& e) {
    // Only the steps before the call starts can throw (allocation), so the call never ran:
    // report through the callback all the same.
    auto cb = call != nullptr ? std::move(call->done) : std::move(done);
    delete call;
    try {
      if (cb) cb(grpc::Status(grpc::StatusCode::INTERNAL, std::string("client: ") + e.what()), {});
    } catch (...) {
    }
  }
}

std::future<std::pair<grpc::Status, v1::ForwardResponse>> Client::ForwardFuture(
    v1::ForwardRequest req) {
  auto promise = std::make_shared<std::promise<std::pair<grpc::Status, v1::ForwardResponse>>>();
  auto future = promise->get_future();
  ForwardAsync(std::move(req), [promise](grpc::Status s, v1::ForwardResponse r) {
    promise->set_value({std::move(s), std::move(r)});
  });
  return future;
}

grpc::Status Client::ListLayers(std::vector<v1::LayerInfo>* layers) {
  return Guard([&] {
    auto ctx = NewContext();
    v1::ListLayersResponse resp;
    grpc::Status s = stub_->ListLayers(ctx.get(), v1::ListLayersRequest(), &resp);
    if (!s.ok()) return s;
    layers->assign(resp.layers().begin(), resp.layers().end());
    return s;
  });
}

grpc::Status Client::GetLayer(const std::string& name, v1::LayerInfo* info, bool include_spectrum) {
  return Guard([&] {
    auto ctx = NewContext();
    v1::GetLayerRequest req;
    req.set_name(name);
    req.set_include_spectrum(include_spectrum);
    return stub_->GetLayer(ctx.get(), req, info);
  });
}

grpc::Status Client::LoadLayer(const std::string& name, const std::string& source,
                               v1::LayerInfo* info) {
  return Guard([&] {
    auto ctx = NewContext(/*admin=*/true);
    v1::LoadLayerRequest req;
    req.set_name(name);
    req.set_source(source);
    v1::LayerInfo ignored;
    return stub_->LoadLayer(ctx.get(), req, info != nullptr ? info : &ignored);
  });
}

grpc::Status Client::UnloadLayer(const std::string& name) {
  return Guard([&] {
    auto ctx = NewContext(/*admin=*/true);
    v1::UnloadLayerRequest req;
    req.set_name(name);
    v1::UnloadLayerResponse resp;
    return stub_->UnloadLayer(ctx.get(), req, &resp);
  });
}

grpc::Status Client::SetRouting(const v1::SetRoutingRequest& request, v1::RoutingInfo* info) {
  return Guard([&] {
    auto ctx = NewContext(/*admin=*/true);
    return stub_->SetRouting(ctx.get(), request, info);
  });
}

grpc::Status Client::GetRouting(v1::RoutingInfo* info) {
  return Guard([&] {
    auto ctx = NewContext();
    return stub_->GetRouting(ctx.get(), v1::GetRoutingRequest(), info);
  });
}

grpc::Status Client::HealthStatus(const std::string& service, ServingStatus* status) {
  return Guard([&] {
    *status = ServingStatus::kUnknown;
    auto ctx = NewContext();
    std::string req_bytes = EncodeHealthRequest(service);
    grpc::Slice slice(req_bytes);
    grpc::ByteBuffer req(&slice, 1);
    grpc::ByteBuffer resp;
    grpc::GenericStub stub(channel_);
    // The generic stub's unary call is callback-only; wait for it here.
    std::promise<grpc::Status> done;
    auto finished = done.get_future();
    stub.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    grpc::Status s = finished.get();
    if (!s.ok()) return s;
    std::vector<grpc::Slice> slices;
    if (!resp.Dump(&slices).ok()) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "health: unreadable response");
    }
    std::string bytes;
    for (const auto& sl : slices)
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    int v = 0;
    if (!DecodeHealthResponse(bytes, &v)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "health: malformed HealthCheckResponse");
    }
    *status = (v >= 0 && v <= 3) ? static_cast<ServingStatus>(v) : ServingStatus::kUnknown;
    return grpc::Status::OK;
  });
}

grpc::Status Client::Health(const std::string& service, bool* serving) {
  ServingStatus st = ServingStatus::kUnknown;
  grpc::Status s = HealthStatus(service, &st);
  *serving = s.ok() && st == ServingStatus::kServing;
  return s;
}

v1::Tensor MakeTensor(std::span<const float> values, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  std::string* data = t.mutable_data();
  data->resize(values.size() * sizeof(float));
  if constexpr (std::endian::native == std::endian::little) {
    if (!values.empty()) std::memcpy(data->data(), values.data(), data->size());
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t u = std::bit_cast<uint32_t>(values[i]);
      for (int b = 0; b < 4; ++b) (*data)[i * 4 + b] = static_cast<char>((u >> (8 * b)) & 0xff);
    }
  }
  return t;
}

grpc::Status TensorToFloats(const v1::Tensor& t, std::vector<float>* values) {
  auto invalid = [](std::string m) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(m));
  };
  if (t.dtype() != v1::DATA_TYPE_FLOAT32) {
    return invalid("tensor dtype: expected DATA_TYPE_FLOAT32, got " + v1::DataType_Name(t.dtype()));
  }
  std::string shape_str = "[";
  int64_t count = 1;
  bool overflow = false;
  for (int i = 0; i < t.shape_size(); ++i) {
    int64_t d = t.shape(i);
    shape_str += (i ? "," : "") + std::to_string(d);
    if (d < 0) {
      return invalid("tensor shape: expected non-negative dimensions, got " + std::to_string(d) +
                     " at axis " + std::to_string(i));
    }
    if (d != 0 && count > std::numeric_limits<int64_t>::max() / 4 / d)
      overflow = true;
    else
      count *= d;
  }
  shape_str += "]";
  if (overflow) return invalid("tensor shape: element count of " + shape_str + " overflows");
  const uint64_t expected = static_cast<uint64_t>(count) * 4;
  if (t.data().size() != expected) {
    return invalid("tensor data: expected " + std::to_string(expected) + " bytes for shape " +
                   shape_str + " x float32, got " + std::to_string(t.data().size()));
  }
  try {
    values->resize(static_cast<size_t>(count));
  } catch (const std::exception&) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "tensor data: cannot allocate " + std::to_string(count) + " floats");
  }
  if constexpr (std::endian::native == std::endian::little) {
    if (count > 0) std::memcpy(values->data(), t.data().data(), expected);
  } else {
    const auto* p = reinterpret_cast<const unsigned char*>(t.data().data());
    for (int64_t i = 0; i < count; ++i) {
      uint32_t u = 0;
      for (int b = 0; b < 4; ++b) u |= static_cast<uint32_t>(p[i * 4 + b]) << (8 * b);
      (*values)[i] = std::bit_cast<float>(u);
    }
  }
  return grpc::Status::OK;
}

}  // namespace attnserve
