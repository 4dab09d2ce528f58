// WebListener: a civetweb HTTP(S) server on one address, the listener both of the server's HTTP
// endpoints stand on (/metrics, server/metrics/metrics_endpoint.h; the Open Inference Protocol
// over REST, server/service/http/http_service.h). It owns what they had each written again: the
// address's check, civetweb's TLS with the certificate held in memory (the root file system may
// be read-only, and civetweb takes certificate and key as one file), the refusal to start TLS
// where civetweb cannot load the system's OpenSSL, and the order of the shutdown.
// Thread-safety: Start and Stop from one owner thread; handlers run on civetweb's threads.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/core/status.h"

class CivetHandler;
class CivetServer;

namespace attnserve {

struct WebListenerOptions {
  std::string field;               // the setting errors name: "metrics_listen", "http_listen"
  std::string listen;              // IPV4:PORT, [IPV6]:PORT or PORT; port 0 picks a free one
  std::string example;             // an address for the error's "e.g.": "0.0.0.0:9464"
  int threads = 4;                 // connections served at once; more wait
  int request_timeout_ms = 10000;  // per connection: slow (slowloris) clients cannot hold the threads
  // TLS when cert_pem is set (TLS 1.2 and later), client certificates when client_ca_pem is.
  std::string cert_pem, key_pem, client_ca_pem;
  std::string tls_field;        // the setting TLS errors name: "metrics_web_config"
  std::string tls_unavailable;  // the whole error when civetweb cannot serve TLS here
};

// The port of HOST:PORT, [V6]:PORT or PORT; -1 when malformed.
int ListenPort(const std::string& listen);

// Whether this process's civetweb can serve TLS: asked of civetweb once, the first time, and
// the answer kept. (civetweb 1.15 counts a failed OpenSSL load as a user of the library, so a
// second mg_init_library would report TLS that cannot work.)
bool CivetwebServesTls();

class WebListener {
 public:
  // Listens and serves each (URI prefix, handler) pair; the handlers outlive the listener.
  // INVALID_ARGUMENT for a malformed address; UNAVAILABLE when it cannot listen (address in use,
  // not a local address) or cannot serve the TLS asked for. Every error starts with `field`.
  static StatusOr<std::unique_ptr<WebListener>> Start(
      const WebListenerOptions& options, const std::vector<std::pair<std::string, CivetHandler*>>& handlers);
  ~WebListener();  // Stop()
  WebListener(const WebListener&) = delete;
  WebListener& operator=(const WebListener&) = delete;

  // The port it listens on (the chosen one when asked for port 0; still once stopped).
  int port() const { return port_; }
  bool listening() const { return server_ != nullptr; }
  // civetweb's stop: answers in progress finish, its threads end; then the certificate files
  // close. Idempotent.
  void Stop();

 private:
  WebListener() = default;
  std::unique_ptr<CivetServer> server_;
  std::vector<int> pem_fds_;  // in-memory PEM files civetweb reads by /proc/self/fd path
  int port_ = 0;
};

}  // namespace attnserve
