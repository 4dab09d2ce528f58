#include "server/metrics/metrics_endpoint.h"

#include <CivetServer.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <charconv>
#include <map>
#include <exception>
#include <vector>

namespace attnserve {
namespace {

// The port part of HOST:PORT, [V6]:PORT or PORT; -1 when malformed.
int PortOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string_view port =
      colon == std::string::npos ? std::string_view(listen) : std::string_view(listen).substr(colon + 1);
  int value = -1;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || p != port.data() + port.size() || value < 0 || value > 65535) return -1;
  return value;
}

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

// An anonymous in-memory file holding `text`, readable at /proc/self/fd/N: civetweb takes its
// certificate and key as one file path, the operator's files are separate, and the root file
// system may be read-only. -1 when it cannot be made.
int InMemoryFile(const std::string& text) {
  const int fd = static_cast<int>(::syscall(SYS_memfd_create, "attnserve-metrics-tls", 0));
  if (fd < 0) return -1;
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) {
      ::close(fd);
      return -1;
    }
    done += static_cast<size_t>(n);
  }
  return fd;
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
  if (PortOf(listen) < 0) {
    return InvalidArgumentError("metrics_listen: expected HOST:PORT with PORT in [0, 65535] (e.g. 0.0.0.0:9464), got '" +
                                listen + "'");
  }
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->handler_ = std::make_unique<Handler>(metrics, web.basic_auth_users);
  try {
    // Four threads and a 10 s limit on every connection's request and response: a scrape at a
    // time is the norm, and a few slow (or slowloris) clients cannot starve Prometheus.
    std::vector<std::string> options = {"listening_ports", web.tls() ? listen + "s" : listen, "num_threads", "4",
                                        "request_timeout_ms", "10000"};
    if (web.tls()) {
      // civetweb loads OpenSSL at run time by symbol name. Debian bookworm's civetweb 1.15
      // asks for OpenSSL 1.1 names (SSL_get_peer_certificate, ...) that OpenSSL 3 no longer
      // exports, so its TLS cannot start there; a TLS port would then crash on the first
      // connection. Refuse instead (docs/security.md says what to do).
      if (mg_check_feature(MG_FEATURES_TLS) == 0 || mg_init_library(MG_FEATURES_TLS) == 0) {
        return UnavailableError(
            "metrics_web_config: tls_server_config: this build's civetweb cannot load the system's OpenSSL, so "
            "/metrics cannot serve TLS; serve it plain behind a NetworkPolicy or a TLS-terminating sidecar "
            "(docs/security.md), or drop tls_server_config (basic_auth_users works without it)");
      }
      const int pem = InMemoryFile(web.key_pem + "\n" + web.cert_pem);
      if (pem < 0) return UnavailableError("metrics_web_config: cannot hold the certificate in memory");
      endpoint->pem_fds_.push_back(pem);
      options.insert(options.end(), {"ssl_certificate", "/proc/self/fd/" + std::to_string(pem), "ssl_protocol_version",
                                     "4"});  // 4: TLS 1.2 and later
      if (!web.client_ca_pem.empty()) {
        const int ca = InMemoryFile(web.client_ca_pem);
        if (ca < 0) return UnavailableError("metrics_web_config: cannot hold the client CA in memory");
        endpoint->pem_fds_.push_back(ca);
        options.insert(options.end(), {"ssl_ca_file", "/proc/self/fd/" + std::to_string(ca), "ssl_verify_peer", "yes"});
      }
    }
    endpoint->server_ = std::make_unique<CivetServer>(options);
    endpoint->server_->addHandler("/metrics", endpoint->handler_.get());
    const std::vector<int> ports = endpoint->server_->getListeningPorts();
    if (ports.empty() || ports.front() <= 0) {
      return UnavailableError("metrics_listen: listening on '" + listen + "' reported no port");
    }
    endpoint->port_ = ports.front();
  } catch (const std::exception& e) {
    return UnavailableError("metrics_listen: cannot listen on '" + listen +
                            "' (address in use, or not an address of this machine): " + e.what());
  }
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  server_.reset();  // stops civetweb before its certificate files go
  for (int fd : pem_fds_) ::close(fd);
}

}  // namespace attnserve
