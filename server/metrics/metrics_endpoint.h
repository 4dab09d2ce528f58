// MetricsEndpoint: serves a Metrics registry over HTTP at /metrics for Prometheus to scrape,
// in the text exposition format 0.0.4 ("text/plain; version=0.0.4"). It uses civetweb (the
// HTTP server prometheus-cpp's own exposer wraps) directly, so that the answer carries the
// format's version and holds only attnserve's families, without the exposer's own; its
// listener (address, TLS, threads) is the one the REST endpoint stands on too (server/web).
// Thread-safety: Start and the destructor from one owner thread; civetweb answers scrapes on
// its own threads, and recording into Metrics meanwhile is safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/metrics/metrics.h"
#include "server/metrics/web_config.h"
#include "server/web/listener.h"

namespace attnserve {

class MetricsEndpoint {
 public:
  // Listens on `listen` (IPV4:PORT, [IPV6]:PORT or PORT; port 0 picks a free port) and serves
  // `metrics`, which must outlive the endpoint. INVALID_ARGUMENT for a malformed address,
  // UNAVAILABLE when it cannot listen (address in use, not a local address).
  // `web` adds TLS (and client certificates) and basic auth (docs/security.md). Every
  // connection gets 10 s to send its request, so slow clients cannot hold the threads.
  static StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen, const Metrics& metrics,
                                                          const MetricsWebConfig& web = {});
  ~MetricsEndpoint();  // stops listening; waits for scrapes in progress
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The port it listens on (the chosen one when asked for port 0).
  int port() const { return listener_->port(); }

 private:
  class Handler;
  MetricsEndpoint() = default;
  std::unique_ptr<Handler> handler_;
  std::unique_ptr<WebListener> listener_;  // after handler_: destroyed first, so no scrape outlives it
};

}  // namespace attnserve
