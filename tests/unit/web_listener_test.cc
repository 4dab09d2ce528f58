// WebListener (server/web/listener.h): the civetweb listener under /metrics and the REST endpoint.
// Both endpoints' own tests cover what they serve on it; these the listener's own rules: the
// address's check, the handlers by prefix, the stop, the TLS refusal and the errors' fields.
#include "server/web/listener.h"

#include <CivetServer.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/unit/http_get.h"

namespace attnserve {
namespace {

using ::attnserve::testing::HttpGet;
using ::testing::HasSubstr;

// Answers 200 with its own name and the URI asked for.
class NamedHandler final : public CivetHandler {
 public:
  explicit NamedHandler(std::string name) : name_(std::move(name)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    const std::string body = name_ + " " + mg_get_request_info(conn)->local_uri;
    mg_printf(conn, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s", body.size(), body.c_str());
    return true;
  }

 private:
  const std::string name_;
};

WebListenerOptions Loopback() {
  WebListenerOptions o;
  o.field = "test_listen";
  o.listen = "127.0.0.1:0";
  o.example = "127.0.0.1:9999";
  o.threads = 2;
  o.tls_field = "test_tls";
  o.tls_unavailable = "test_tls: this civetweb cannot serve TLS here";
  return o;
}

TEST(WebListenerTest, ListenPortReadsThePortOfEveryAddressForm) {
  EXPECT_EQ(ListenPort("127.0.0.1:0"), 0);
  EXPECT_EQ(ListenPort("0.0.0.0:9464"), 9464);
  EXPECT_EQ(ListenPort("[::1]:8080"), 8080);
  EXPECT_EQ(ListenPort("65535"), 65535);
  for (const char* bad : {"", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:65536", "127.0.0.1:-1", "1:80x", "[::1]"}) {
    EXPECT_EQ(ListenPort(bad), -1) << bad;
  }
}

TEST(WebListenerTest, ServesEachHandlerUnderItsPrefixAndStops) {
  NamedHandler a("a"), b("b");
  StatusOr<std::unique_ptr<WebListener>> listener = WebListener::Start(Loopback(), {{"/a", &a}, {"/b", &b}});
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  const int port = (*listener)->port();
  ASSERT_GT(port, 0);
  EXPECT_TRUE((*listener)->listening());
  EXPECT_THAT(HttpGet(port, "/a/x"), HasSubstr("\r\n\r\na /a/x"));
  EXPECT_THAT(HttpGet(port, "/b"), HasSubstr("\r\n\r\nb /b"));
  EXPECT_THAT(HttpGet(port, "/c"), HasSubstr("404"));
  // Every connection closes after its answer: the bounded threads are not held by idle clients.
  EXPECT_THAT(HttpGet(port, "/a"), HasSubstr("Connection: close"));

  (*listener)->Stop();
  EXPECT_FALSE((*listener)->listening());
  EXPECT_EQ((*listener)->port(), port);  // still known once stopped (the port files, the logs)
  EXPECT_EQ(HttpGet(port, "/a"), "");    // nothing listens
  (*listener)->Stop();                   // idempotent
}

TEST(WebListenerTest, ErrorsNameTheirField) {
  NamedHandler a("a");
  for (const char* bad : {"127.0.0.1:", "127.0.0.1:70000", ""}) {
    WebListenerOptions o = Loopback();
    o.listen = bad;
    StatusOr<std::unique_ptr<WebListener>> l = WebListener::Start(o, {{"/a", &a}});
    ASSERT_FALSE(l.ok()) << bad;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(l.status().message(),
              "test_listen: expected HOST:PORT with PORT in [0, 65535] (e.g. 127.0.0.1:9999), got '" +
                  std::string(bad) + "'");
  }

  StatusOr<std::unique_ptr<WebListener>> first = WebListener::Start(Loopback(), {{"/a", &a}});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  WebListenerOptions taken = Loopback();
  taken.listen = "127.0.0.1:" + std::to_string((*first)->port());
  StatusOr<std::unique_ptr<WebListener>> second = WebListener::Start(taken, {{"/a", &a}});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("test_listen: cannot listen on '" + taken.listen + "'"));
}

// Where civetweb cannot load the system's OpenSSL (Debian bookworm's 1.15 against OpenSSL 3), a
// TLS port would crash on its first connection: the listener refuses with the caller's words.
// Where it can, the listener serves TLS and refuses plain HTTP.
TEST(WebListenerTest, TlsStartsOnlyWhereCivetwebCanServeIt) {
  NamedHandler a("a");
  WebListenerOptions o = Loopback();
  o.cert_pem = "-----BEGIN CERTIFICATE-----\nnot checked before civetweb\n-----END CERTIFICATE-----\n";
  o.key_pem = "-----BEGIN PRIVATE KEY-----\nnot checked before civetweb\n-----END PRIVATE KEY-----\n";
  // Asked twice, the second answer the first's: civetweb's own second answer would be yes.
  for (int attempt = 0; attempt < 2; ++attempt) {
    StatusOr<std::unique_ptr<WebListener>> l = WebListener::Start(o, {{"/a", &a}});
    if (!CivetwebServesTls()) {
      ASSERT_FALSE(l.ok()) << attempt;
      EXPECT_EQ(l.status().code(), StatusCode::kUnavailable) << attempt;
      EXPECT_EQ(l.status().message(), o.tls_unavailable) << attempt;
    } else {
      // A malformed certificate: civetweb cannot start, and the error names the listen field.
      ASSERT_FALSE(l.ok()) << attempt;
      EXPECT_THAT(l.status().message(), HasSubstr("test_listen: ")) << attempt;
    }
  }
}

}  // namespace
}  // namespace attnserve
