// HttpGet: one plain HTTP/1.0 GET on loopback, for the tests of the server's HTTP endpoints
// (server/web's listener, /metrics) that read a raw answer, headers included.
// Thread-safety: a pure function; call from any thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace attnserve::testing {

// GET http://127.0.0.1:port/path; the whole response, headers included; "" when nothing listens.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  return response;
}

}  // namespace attnserve::testing
