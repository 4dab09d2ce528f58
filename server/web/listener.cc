#include "server/web/listener.h"

#include <CivetServer.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <charconv>
#include <exception>
#include <string_view>

namespace attnserve {
namespace {

// An anonymous in-memory file holding `text`, readable at /proc/self/fd/N. -1 when it cannot be
// made.
int InMemoryFile(const std::string& text) {
  const int fd = static_cast<int>(::syscall(SYS_memfd_create, "attnserve-web-tls", 0));
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

std::string FdPath(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

}  // namespace

int ListenPort(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string_view port =
      colon == std::string::npos ? std::string_view(listen) : std::string_view(listen).substr(colon + 1);
  int value = -1;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || p != port.data() + port.size() || value < 0 || value > 65535) return -1;
  return value;
}

bool CivetwebServesTls() {
  static const bool serves = mg_check_feature(MG_FEATURES_TLS) != 0 && mg_init_library(MG_FEATURES_TLS) != 0;
  return serves;
}

StatusOr<std::unique_ptr<WebListener>> WebListener::Start(
    const WebListenerOptions& o, const std::vector<std::pair<std::string, CivetHandler*>>& handlers) {
  if (ListenPort(o.listen) < 0) {
    return InvalidArgumentError(o.field + ": expected HOST:PORT with PORT in [0, 65535] (e.g. " + o.example +
                                "), got '" + o.listen + "'");
  }
  const bool tls = !o.cert_pem.empty();
  std::unique_ptr<WebListener> listener(new WebListener());
  // No keep-alive: every connection closes after its answer, so an idle client never holds one
  // of the bounded threads.
  std::vector<std::string> civet = {
      "listening_ports",    o.listen + (tls ? "s" : ""),          "num_threads",       std::to_string(o.threads),
      "request_timeout_ms", std::to_string(o.request_timeout_ms), "enable_keep_alive", "no"};
  if (tls) {
    // civetweb loads OpenSSL at run time by symbol name. Debian bookworm's civetweb 1.15 asks
    // for OpenSSL 1.1 names (SSL_get_peer_certificate, ...) that OpenSSL 3 no longer exports, so
    // its TLS cannot start there; a TLS port would then crash on the first connection. Refuse.
    if (!CivetwebServesTls()) {
      return UnavailableError(o.tls_unavailable);
    }
    const int pem = InMemoryFile(o.key_pem + "\n" + o.cert_pem);
    if (pem < 0) return UnavailableError(o.tls_field + ": cannot hold the certificate in memory");
    listener->pem_fds_.push_back(pem);
    civet.insert(civet.end(), {"ssl_certificate", FdPath(pem), "ssl_protocol_version", "4"});  // 4: TLS 1.2+
    if (!o.client_ca_pem.empty()) {
      const int ca = InMemoryFile(o.client_ca_pem);
      if (ca < 0) return UnavailableError(o.tls_field + ": cannot hold the client CA in memory");
      listener->pem_fds_.push_back(ca);
      civet.insert(civet.end(), {"ssl_ca_file", FdPath(ca), "ssl_verify_peer", "yes"});
    }
  }
  try {
    listener->server_ = std::make_unique<CivetServer>(civet);
    for (const auto& [uri, handler] : handlers) listener->server_->addHandler(uri, handler);
    const std::vector<int> ports = listener->server_->getListeningPorts();
    if (ports.empty() || ports.front() <= 0) {
      return UnavailableError(o.field + ": listening on '" + o.listen + "' reported no port");
    }
    listener->port_ = ports.front();
  } catch (const std::exception& e) {
    return UnavailableError(o.field + ": cannot listen on '" + o.listen +
                            "' (address in use, or not an address of this machine): " + e.what());
  }
  return listener;
}

void WebListener::Stop() {
  server_.reset();  // stops civetweb before its certificate files go
  for (int fd : pem_fds_) ::close(fd);
  pem_fds_.clear();
}

WebListener::~WebListener() { Stop(); }

}  // namespace attnserve
