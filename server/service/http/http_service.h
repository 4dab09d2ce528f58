// The Open Inference Protocol over HTTP/REST (KServe v2, with Triton's binary-data extension)
// on a listener of its own (--http-listen; docs/service.md, "HTTP/REST"). Every infer request
// becomes the gRPC protocol's ModelInferRequest (infer_json.h) and runs the one call path of
// every protocol (forward_pipeline.h): the same conversion, validation, router, batcher,
// memory budget, metrics, shadows and drain gate. civetweb serves it on a fixed number of
// threads; each waits for its call's answer. No math here.
// Thread-safety: Start and Stop from one thread (the server's); handlers run on civetweb's.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/service/forward_pipeline.h"
#include "server/store/layer_store.h"
#include "server/web/listener.h"

namespace attnserve {

struct HttpServiceOptions {
  std::string listen;                          // HOST:PORT; port 0 picks a free one
  std::string version;                         // the server metadata's (GET /v2)
  int64_t max_body_bytes = int64_t{64} << 20;  // larger request bodies: 413
  int threads = 8;                             // requests served at once; more wait for a thread
  // PEM texts: TLS when cert_pem is set, and mTLS with client_ca_pem (the gRPC listeners' own).
  std::string cert_pem, key_pem, client_ca_pem;
  // Whether the device computes (Backend::Healthy); null: always. With the drain, readiness.
  std::function<bool()> device_healthy;
};

class HttpService {
 public:
  // Listens, or says why not (INVALID_ARGUMENT / UNAVAILABLE naming --http-listen). `store` and
  // `pipeline` outlive the service.
  static StatusOr<std::unique_ptr<HttpService>> Start(HttpServiceOptions options, LayerStore* store,
                                                      ForwardPipeline* pipeline);
  ~HttpService();
  HttpService(const HttpService&) = delete;
  HttpService& operator=(const HttpService&) = delete;

  int port() const { return listener_ ? listener_->port() : 0; }
  bool tls() const { return !options_.cert_pem.empty(); }
  // Closes the listener (the drain, after the pipeline's): first waits until no request is being
  // served, or until `grace` has passed (civetweb's stop cuts the reads and writes in progress),
  // so that an answer being written, or a body still arriving (then answered 503), completes.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

 private:
  class Handler;
  HttpService(HttpServiceOptions options, LayerStore* store, ForwardPipeline* pipeline);

  const HttpServiceOptions options_;
  LayerStore* const store_;
  ForwardPipeline* const pipeline_;
  std::unique_ptr<Handler> handler_;
  std::unique_ptr<WebListener> listener_;  // after handler_: destroyed first
  std::atomic<int> serving_{0};  // requests inside a handler now
};

}  // namespace attnserve
