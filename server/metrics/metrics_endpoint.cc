#include "server/metrics/metrics_endpoint.h"

#include <CivetServer.h>

#include <map>
#include <exception>
#include <vector>

namespace attnserve {
namespace {

// Decodes standard base64; false for anything else.
bool DecodeBase64(std::string_view in, std::string* out) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

}  // namespace

class MetricsEndpoint::Handler final : public CivetHandler {
 public:
  Handler(const Metrics& metrics, std::map<std::string, std::string> users)
      : metrics_(metrics), users_(std::move(users)) {}

  bool handleGet(CivetServer* /*server*/, mg_connection* conn) override {
    if (!users_.empty() && !Authorized(mg_get_header(conn, "Authorization"))) {
      mg_printf(conn,
                "HTTP/1.1 401 Unauthorized\r\n"
                "WWW-Authenticate: Basic realm=\"attnserve metrics\", charset=\"UTF-8\"\r\n"
                "Content-Length: 0\r\n"
                "Connection: close\r\n\r\n");
      return true;
    }
    std::string body;
    try {
      body = metrics_.Scrape();
    } catch (const std::exception& e) {
      // No exception may unwind into civetweb's C threads.
      mg_send_http_error(conn, 500, "%s", e.what());
      return true;
    }
    mg_printf(conn,
              "HTTP/1.1 200 OK\r\n"
              "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: %zu\r\n"
              "Connection: close\r\n\r\n",
              body.size());
    mg_write(conn, body.data(), body.size());
    return true;
  }

 private:
  // "Basic base64(user:password)" of a configured user with the right password.
  bool Authorized(const char* header) const {
    if (header == nullptr) return false;
    const std::string_view value(header);
    if (!value.starts_with("Basic ")) return false;
    std::string decoded;
    if (!DecodeBase64(value.substr(6), &decoded)) return false;
    const size_t colon = decoded.find(':');
    if (colon == std::string::npos) return false;
    auto it = users_.find(decoded.substr(0, colon));
    // An unknown user still costs a bcrypt check, so timing does not tell users apart.
    static const std::string kDummy = "$2y$10$0000000000000000000000000000000000000000000000000000u";
    const bool match = BcryptMatches(decoded.substr(colon + 1), it == users_.end() ? kDummy : it->second);
    return match && it != users_.end();
  }

  const Metrics& metrics_;
  const std::map<std::string, std::string> users_;
};

StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen, const Metrics& metrics,
                                                                   const MetricsWebConfig& web) {
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->handler_ = std::make_unique<Handler>(metrics, web.basic_auth_users);
  WebListenerOptions options;
  options.field = "metrics_listen";
  options.listen = listen;
  options.example = "0.0.0.0:9464";
  // Four threads and a 10 s limit on every connection's request and response: a scrape at a
  // time is the norm, and a few slow (or slowloris) clients cannot starve Prometheus.
  options.threads = 4;
  options.request_timeout_ms = 10000;
  options.cert_pem = web.cert_pem;
  options.key_pem = web.key_pem;
  options.client_ca_pem = web.client_ca_pem;
  options.tls_field = "metrics_web_config";
  options.tls_unavailable =
      "metrics_web_config: tls_server_config: this build's civetweb cannot load the system's OpenSSL, so "
      "/metrics cannot serve TLS; serve it plain behind a NetworkPolicy or a TLS-terminating sidecar "
      "(docs/security.md), or drop tls_server_config (basic_auth_users works without it)";
  ATTNSERVE_ASSIGN_OR_RETURN(endpoint->listener_, WebListener::Start(options, {{"/metrics", endpoint->handler_.get()}}));
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() = default;

}  // namespace attnserve
