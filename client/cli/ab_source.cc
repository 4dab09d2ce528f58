#include "client/cli/ab_source.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace attnserve::cli::ab {
namespace {

constexpr char kRequests[] = "attnserve_requests_total";
constexpr char kLatency[] = "attnserve_request_duration_seconds_bucket";
constexpr char kDivergence[] = "attnserve_shadow_divergence_bucket";
constexpr char kFlops[] = "attnserve_flops_total";

bool ParseValue(std::string_view text, double* out) {
  if (text == "+Inf" || text == "Inf") {
    *out = std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "-Inf") {
    *out = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "NaN") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return !s.empty() && end == s.c_str() + s.size() && errno == 0;
}

// A socket closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

// Decodes a chunked transfer-encoded body.
bool Dechunk(std::string_view in, std::string* out) {
  out->clear();
  size_t pos = 0;
  while (true) {
    const size_t eol = in.find("\r\n", pos);
    if (eol == std::string_view::npos) return false;
    const std::string size_text(in.substr(pos, eol - pos));
    char* end = nullptr;
    const unsigned long size = std::strtoul(size_text.c_str(), &end, 16);
    if (end == size_text.c_str()) return false;
    pos = eol + 2;
    if (size == 0) return true;
    if (pos + size > in.size()) return false;
    out->append(in.substr(pos, size));
    pos += size + 2;
  }
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

bool HttpGet(const std::string& url, std::chrono::milliseconds timeout, std::string* body, std::string* error) {
  const auto fail = [&](const std::string& what) {
    *error = url + ": " + what;
    return false;
  };
  if (url.rfind("https://", 0) == 0) return fail("https is not supported yet; expected an http:// URL");
  if (url.rfind("http://", 0) != 0) return fail("expected an http://host[:port]/path URL");
  const std::string rest = url.substr(7);
  const size_t slash = rest.find('/');
  const std::string hostport = rest.substr(0, slash);
  const std::string path = slash == std::string::npos ? "/" : rest.substr(slash);
  std::string host = hostport, port = "80";
  if (!hostport.empty() && hostport[0] == '[') {  // [::1]:9090
    const size_t close_bracket = hostport.find(']');
    if (close_bracket == std::string::npos) return fail("unterminated '[' in the host");
    host = hostport.substr(1, close_bracket - 1);
    if (close_bracket + 1 < hostport.size() && hostport[close_bracket + 1] == ':') {
      port = hostport.substr(close_bracket + 2);
    }
  } else if (const size_t colon = hostport.rfind(':'); colon != std::string::npos) {
    host = hostport.substr(0, colon);
    port = hostport.substr(colon + 1);
  }
  if (host.empty()) return fail("expected a host after http://");

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addrs = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &addrs); rc != 0) {
    return fail(std::string("cannot resolve ") + host + ": " + gai_strerror(rc));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
  };
  Fd sock;
  std::string connect_error = "no address";
  for (addrinfo* a = addrs; a != nullptr && sock.fd < 0; a = a->ai_next) {
    Fd s;
    s.fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (s.fd < 0) continue;
    fcntl(s.fd, F_SETFL, fcntl(s.fd, F_GETFL) | O_NONBLOCK);
    int rc = connect(s.fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{s.fd, POLLOUT, 0};
      rc = poll(&p, 1, left_ms()) == 1 ? 0 : -1;
      int so_error = rc == 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof so_error;
      if (rc == 0) getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
      if (so_error != 0) {
        errno = so_error;
        rc = -1;
      }
    }
    if (rc == 0) {
      std::swap(sock.fd, s.fd);
    } else {
      connect_error = std::strerror(errno);
    }
  }
  freeaddrinfo(addrs);
  if (sock.fd < 0) return fail("cannot connect: " + connect_error);

  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: " + hostport +
                              "\r\nAccept: */*\r\nUser-Agent: attnserve-cli\r\nConnection: close\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    pollfd p{sock.fd, POLLOUT, 0};
    if (poll(&p, 1, left_ms()) != 1) return fail("timed out sending the request");
    const ssize_t n = send(sock.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) return fail(std::string("send: ") + std::strerror(errno));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[16384];
  while (true) {
    pollfd p{sock.fd, POLLIN, 0};
    if (poll(&p, 1, left_ms()) != 1) return fail("timed out reading the response");
    const ssize_t n = recv(sock.fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return fail(std::string("recv: ") + std::strerror(errno));
    }
    response.append(buf, static_cast<size_t>(n));
  }
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos || response.rfind("HTTP/1.", 0) != 0) {
    return fail("expected an HTTP/1.x response, got '" + response.substr(0, 40) + "'");
  }
  const std::string headers = Lower(response.substr(0, header_end));
  const int status = std::atoi(response.c_str() + response.find(' ') + 1);
  std::string content = response.substr(header_end + 4);
  if (headers.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
    std::string plain;
    if (!Dechunk(content, &plain)) return fail("malformed chunked body");
    content = std::move(plain);
  }
  if (status != 200) {
    return fail("expected HTTP status 200, got " + std::to_string(status) + ": " + content.substr(0, 200));
  }
  *body = std::move(content);
  return true;
}

bool IsAbSeries(std::string_view name) {
  return name == kRequests || name == kLatency || name == kDivergence || name == kFlops;
}

bool ParseExposition(std::string_view text, const std::string& origin, std::vector<Sample>* out, std::string* error) {
  size_t line_no = 0, pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;
    line.remove_prefix(first);
    const auto bad = [&](const std::string& what) {
      *error =
          origin + ": line " + std::to_string(line_no) + ": " + what + " in '" + std::string(line.substr(0, 120)) + "'";
      return false;
    };
    Sample s;
    s.origin = origin;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ' && line[i] != '\t') ++i;
    s.name = std::string(line.substr(0, i));
    if (s.name.empty()) return bad("expected a metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (true) {
        while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
        if (i < line.size() && line[i] == '}') {
          ++i;
          break;
        }
        const size_t eq = line.find('=', i);
        if (eq == std::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          return bad("expected label=\"value\"");
        }
        std::string key(line.substr(i, eq - i));
        std::string value;
        i = eq + 2;
        bool closed = false;
        for (; i < line.size(); ++i) {
          if (line[i] == '\\' && i + 1 < line.size()) {
            const char c = line[++i];
            value += c == 'n' ? '\n' : c;
          } else if (line[i] == '"') {
            closed = true;
            ++i;
            break;
          } else {
            value += line[i];
          }
        }
        if (!closed) return bad("unterminated label value");
        s.labels.emplace(std::move(key), std::move(value));
      }
    }
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    size_t end = i;
    while (end < line.size() && line[end] != ' ' && line[end] != '\t') ++end;
    if (!ParseValue(line.substr(i, end - i), &s.value)) return bad("expected a number after the series");
    if (IsAbSeries(s.name)) out->push_back(std::move(s));
  }
  return true;
}

std::vector<Sample> Difference(const std::vector<Sample>& before, const std::vector<Sample>& after) {
  std::map<std::tuple<std::string, std::string, std::map<std::string, std::string>>, double> old;
  for (const Sample& s : before) old[{s.origin, s.name, s.labels}] = s.value;
  std::vector<Sample> out;
  for (const Sample& s : after) {
    Sample d = s;
    auto it = old.find({s.origin, s.name, s.labels});
    if (it != old.end() && s.value >= it->second) d.value = s.value - it->second;
    out.push_back(std::move(d));
  }
  return out;
}

bool ParsePrometheusVector(std::string_view json, const std::string& name, std::vector<Sample>* out,
                           std::string* error) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    *error = "Prometheus answered with something other than JSON: '" + std::string(json.substr(0, 120)) + "'";
    return false;
  }
  if (j.value("status", "") != "success") {
    *error = "Prometheus: " + j.value("errorType", std::string("error")) + ": " + j.value("error", std::string("?"));
    return false;
  }
  const nlohmann::json& data = j["data"];
  if (!data.is_object() || data.value("resultType", "") != "vector" || !data["result"].is_array()) {
    *error = "Prometheus: expected data.resultType \"vector\" with a result array";
    return false;
  }
  for (const nlohmann::json& r : data["result"]) {
    Sample s;
    s.name = name;
    std::string origin;
    for (auto it = r["metric"].begin(); it != r["metric"].end(); ++it) {
      const std::string key = it.key(), value = it.value().get<std::string>();
      if (key == "__name__") continue;
      if (key == "layer" || key == "form" || key == "math" || key == "code" || key == "le") {
        s.labels.emplace(key, value);
      } else {
        origin += key + "=" + value + ",";
      }
    }
    s.origin = origin;
    if (!r["value"].is_array() || r["value"].size() != 2 || !ParseValue(r["value"][1].get<std::string>(), &s.value)) {
      *error = "Prometheus: expected \"value\": [time, \"number\"] in a result of " + name;
      return false;
    }
    if (std::isnan(s.value)) continue;  // increase() over a series with one sample in the window
    out->push_back(std::move(s));
  }
  return true;
}

std::vector<std::pair<std::string, std::string>> PrometheusQueries(const std::string& window) {
  std::vector<std::pair<std::string, std::string>> q;
  for (const char* name : {kRequests, kLatency, kDivergence, kFlops}) {
    q.emplace_back(name, window.empty() ? std::string(name) : "increase(" + std::string(name) + "[" + window + "])");
  }
  return q;
}

std::string PrometheusQueryUrl(const std::string& base, const std::string& promql) {
  std::string escaped;
  for (unsigned char c : promql) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      escaped += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      escaped += hex;
    }
  }
  std::string b = base;
  while (!b.empty() && b.back() == '/') b.pop_back();
  return b + "/api/v1/query?query=" + escaped;
}

namespace {

std::string Label(const Sample& s, const char* key) {
  auto it = s.labels.find(key);
  return it == s.labels.end() ? std::string() : it->second;
}

// Per-origin cumulative histograms merged on the bounds every origin has.
Buckets Merge(const std::vector<std::map<double, double>>& origins) {
  Buckets b;
  if (origins.empty()) return b;
  std::set<double> common;
  for (const auto& [le, _] : origins[0]) common.insert(le);
  for (size_t i = 1; i < origins.size(); ++i) {
    std::set<double> keep;
    for (double le : common) {
      if (origins[i].count(le)) keep.insert(le);
    }
    common = std::move(keep);
  }
  if (!common.count(std::numeric_limits<double>::infinity())) return b;  // not a complete histogram
  for (double le : common) {
    double sum = 0;
    for (const auto& o : origins) sum += o.at(le);
    b.upper.push_back(le);
    b.cumulative.push_back(sum);
  }
  // increase() extrapolates each bucket on its own: keep the cumulative counts monotone.
  for (size_t i = 1; i < b.cumulative.size(); ++i) b.cumulative[i] = std::max(b.cumulative[i], b.cumulative[i - 1]);
  return b;
}

}  // namespace

LayerCounts Aggregate(const std::vector<Sample>& samples) {
  LayerCounts out;
  // A layer served in more than one math is compared variant by variant: its arms are
  // FORM@MATH ("factored@bf16"); a layer in one math keeps the bare form names.
  std::map<std::string, std::set<std::string>> maths;
  for (const Sample& s : samples) {
    if (const std::string math = Label(s, "math"); !math.empty() && math != "none") maths[Label(s, "layer")].insert(math);
  }
  const auto arm = [&](const Sample& s, const std::string& layer) {
    const std::string form = Label(s, "form"), math = Label(s, "math");
    return maths[layer].size() > 1 && !math.empty() && math != "none" ? form + "@" + math : form;
  };
  // (layer, arm), and per origin: le -> cumulative count.
  using Key = std::pair<std::string, std::string>;
  std::map<Key, std::map<std::string, std::map<double, double>>> latency, divergence;
  for (const Sample& s : samples) {
    const std::string layer = Label(s, "layer");
    const std::string form = Label(s, "form").empty() ? std::string() : arm(s, layer);
    if (layer.empty() || form.empty()) continue;
    if (s.name == kRequests) {
      FormCounts& c = out[layer][form];
      c.requests += s.value;
      if (Label(s, "code") != "OK") c.errors += s.value;
    } else if (s.name == kFlops) {
      out[layer][form].flops += s.value;
    } else if (s.name == kLatency || s.name == kDivergence) {
      double le = 0;
      if (!ParseValue(Label(s, "le"), &le)) continue;
      if (s.name == kLatency) {
        const auto code = s.labels.find("code");
        if (code == s.labels.end()) {
          out[layer][form].latency_includes_failures = true;
        } else if (code->second != "OK") {
          continue;
        }
        latency[{layer, form}][s.origin][le] += s.value;
      } else {
        out[layer][form];
        divergence[{layer, form}][s.origin][le] += s.value;
      }
    }
  }
  const auto merge_into = [&out](const auto& histograms, Buckets FormCounts::*member) {
    for (const auto& [key, by_origin] : histograms) {
      std::vector<std::map<double, double>> origins;
      for (const auto& [_, h] : by_origin) origins.push_back(h);
      out[key.first][key.second].*member = Merge(origins);
    }
  };
  merge_into(latency, &FormCounts::latency);
  merge_into(divergence, &FormCounts::divergence);
  return out;
}

}  // namespace attnserve::cli::ab
