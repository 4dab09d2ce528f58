// attnserve's C++ client: a typed wrapper over one gRPC channel to an attnserve server.
//
// The client shares only proto/ with the server (no server library is linked), so it reports
// errors as grpc::Status. No exception escapes a public function.
// Thread-safety: Client is thread-safe (one channel and stub, calls from any thread);
// the free tensor helpers are pure functions.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// grpc.health.v1.HealthCheckResponse.ServingStatus, with the same numeric values.
enum class ServingStatus : int { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
// "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN".
const char* ServingStatusName(ServingStatus s);

struct ClientOptions {
  // Any gRPC target: "host:port", "dns:///host:port", "ipv4:127.0.0.1:1,127.0.0.1:2", ...
  std::string target = "localhost:50051";
  // Deadline of every call, measured from the moment it starts; <= 0 means no deadline.
  std::chrono::milliseconds timeout{30000};
  // Maximum send and receive message size in MiB; tensors travel inline, so the default is
  // large. <= 0 means unlimited.
  int max_message_mb = 64;
  // gRPC load-balancing policy ("round_robin", "pick_first"); empty = gRPC's default
  // (pick_first). With round_robin, multi-address targets balance over all backends.
  std::string load_balancing;
  // When set, LoadLayer, UnloadLayer and SetRouting send "authorization: Bearer <admin_token>"
  // (servers started with --admin-token require it). Other calls never carry it.
  std::string admin_token;
  // TLS (all PEM file paths; read when the Client is made). With tls_ca set the channel speaks
  // TLS and trusts that CA; with tls_cert and tls_key it also presents a client certificate
  // (mTLS). server_name overrides the name checked against the server's certificate (for a
  // target that is an IP address or a name the certificate does not carry).
  std::string tls_ca, tls_cert, tls_key, server_name;
  bool tls() const { return !tls_ca.empty() || !tls_cert.empty(); }
};

// Reads a PEM file for ClientOptions' TLS fields: "" and `error` set when it cannot.
std::string ReadPemFile(const std::string& what, const std::string& path, std::string* error);

class Client {
 public:
  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return options_; }
  // The underlying channel, for callers that want their own stubs (benchmarks, routing).
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  grpc::Status Forward(const v1::ForwardRequest& req, v1::ForwardResponse* resp);
  // Async: the callback runs on a gRPC thread when the call ends. It must not block for long.
  void ForwardAsync(v1::ForwardRequest req,
                    std::function<void(grpc::Status, v1::ForwardResponse)> done);
  std::future<std::pair<grpc::Status, v1::ForwardResponse>> ForwardFuture(v1::ForwardRequest req);

  grpc::Status ListLayers(std::vector<v1::LayerInfo>* layers);
  grpc::Status GetLayer(const std::string& name, v1::LayerInfo* info,
                        bool include_spectrum = false);
  // `info` may be null when the caller does not need the loaded layer's description.
  grpc::Status LoadLayer(const std::string& name, const std::string& source, v1::LayerInfo* info);
  grpc::Status UnloadLayer(const std::string& name);
  // The A/B split and the shadow rate (docs/metrics.md). SetRouting is an admin call (it sends
  // the admin token); both return the routing in force afterwards.
  grpc::Status SetRouting(const v1::SetRoutingRequest& request, v1::RoutingInfo* info);
  grpc::Status GetRouting(v1::RoutingInfo* info);

  // grpc.health.v1.Health/Check; service "" = the whole server. Sets *serving to whether the
  // reported status is SERVING. A service the server does not know returns NOT_FOUND.
  grpc::Status Health(const std::string& service, bool* serving);
  // The same call, reporting the exact serving status.
  grpc::Status HealthStatus(const std::string& service, ServingStatus* status);

 private:
  // A context with this client's deadline, and the admin token when `admin`.
  std::unique_ptr<grpc::ClientContext> NewContext(bool admin = false) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// Tensor helpers: float32 little-endian bytes <-> floats.
// The data are copied into a FLOAT32 tensor of the given shape. The caller is responsible for
// values.size() == product(shape); a mismatch is caught by TensorToFloats and by the server.
v1::Tensor MakeTensor(std::span<const float> values, std::vector<int64_t> shape);
// Fails (INVALID_ARGUMENT, message names expected/got) when dtype is not FLOAT32, a dimension is
// negative, or bytes != product(shape)*4.
grpc::Status TensorToFloats(const v1::Tensor& t, std::vector<float>* values);

// The canonical name of a gRPC status code ("NOT_FOUND"), as the CLI prints it.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace attnserve
