#include "server/metrics/metrics_endpoint.h"

#include <CivetServer.h>

#include <charconv>
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

}  // namespace

class MetricsEndpoint::Handler final : public CivetHandler {
 public:
  explicit Handler(const Metrics& metrics) : metrics_(metrics) {}

  bool handleGet(CivetServer* /*server*/, mg_connection* conn) override {
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
  const Metrics& metrics_;
};

StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen, const Metrics& metrics) {
  if (PortOf(listen) < 0) {
    return InvalidArgumentError("metrics_listen: expected HOST:PORT with PORT in [0, 65535] (e.g. 0.0.0.0:9464), got '" +
                                listen + "'");
  }
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->handler_ = std::make_unique<Handler>(metrics);
  try {
    // Two threads: one scrape at a time is the norm; the second keeps a slow client from
    // holding up Prometheus.
    const std::vector<std::string> options = {"listening_ports", listen, "num_threads", "2"};
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

MetricsEndpoint::~MetricsEndpoint() = default;

}  // namespace attnserve
