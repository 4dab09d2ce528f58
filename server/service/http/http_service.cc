#include "server/service/http/http_service.h"

#include <CivetServer.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "server/service/guarded.h"
#include "server/service/http/infer_json.h"
#include "server/service/inference_model.h"
#include "server/service/inference_request.h"

namespace attnserve {
namespace {

// A request's and a response's bytes may take this long on the socket: slow (or slowloris)
// clients cannot hold a thread for ever. An infer call's compute is not counted in it.
constexpr int kSocketTimeoutMs = 30000;
// How much of a body one read takes. civetweb runs handlers on threads with 100 KiB stacks
// (a constant compiled into the library) and glibc guards them with one page: a frame holding
// a buffer this size would step over the guard into the next thread's stack. Buffers live on
// the heap; the handlers' frames stay small.
constexpr size_t kReadStep = 64 * 1024;

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Internal Server Error";
  }
}

// One answer; every connection closes after it, so an idle client never holds one of the
// bounded threads.
void Send(mg_connection* conn, int status, std::string_view body, std::string_view content_type = "application/json",
          std::optional<size_t> header_length = std::nullopt) {
  std::string head = "HTTP/1.1 " + std::to_string(status) + " " + Reason(status) +
                     "\r\nContent-Type: " + std::string(content_type) +
                     "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  if (header_length) head += "Inference-Header-Content-Length: " + std::to_string(*header_length) + "\r\n";
  head += "Connection: close\r\n\r\n";
  mg_write(conn, head.data(), head.size());
  if (!body.empty()) mg_write(conn, body.data(), body.size());
}

void SendError(mg_connection* conn, const Status& status) {
  Send(conn, HttpStatusOf(status.code()), ErrorJson(status.message()));
}

// The path's segments after "/v2": "/v2/models/m/versions/1/infer" → {"models", "m", "versions",
// "1", "infer"}; nullopt for a path outside /v2.
std::optional<std::vector<std::string_view>> Segments(std::string_view uri) {
  if (uri != "/v2" && !uri.starts_with("/v2/")) return std::nullopt;
  std::vector<std::string_view> parts;
  std::string_view rest = uri.substr(3);
  while (!rest.empty()) {
    rest.remove_prefix(1);  // the '/'
    const size_t slash = rest.find('/');
    parts.push_back(rest.substr(0, slash));
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash);
  }
  return parts;
}

// A model route: models/{m}[/versions/{v}][/tail]. False when the segments are no such route.
bool ModelRoute(const std::vector<std::string_view>& s, std::string* model, std::string* version, std::string* tail) {
  if (s.size() < 2 || s[0] != "models" || s[1].empty()) return false;
  *model = std::string(s[1]);
  size_t next = 2;
  if (s.size() >= 4 && s[2] == "versions") {
    *version = std::string(s[3]);
    next = 4;
  }
  if (s.size() > next + 1) return false;
  *tail = s.size() == next + 1 ? std::string(s[next]) : std::string();
  return true;
}

// One infer call's meeting point: the pipeline's completion (a batch worker) and the civetweb
// thread that waits to write the answer.
struct PendingCall {
  inference::ModelInferResponse response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::optional<CallTimeline> served;
};

}  // namespace

class HttpService::Handler final : public CivetHandler {
 public:
  explicit Handler(HttpService* service) : service_(service) {}

  bool handleGet(CivetServer* /*server*/, mg_connection* conn) override { return Serve(conn, false); }
  bool handlePost(CivetServer* /*server*/, mg_connection* conn) override { return Serve(conn, true); }

 private:
  // No exception unwinds into civetweb's C threads.
  bool Serve(mg_connection* conn, bool post) {
    service_->serving_.fetch_add(1);
    struct Leave {
      std::atomic<int>& serving;
      ~Leave() { serving.fetch_sub(1); }
    } leave{service_->serving_};
    try {
      Route(conn, post);
    } catch (const std::exception& e) {
      spdlog::error("HTTP: unexpected exception: {}", e.what());
      SendError(conn, InternalError(std::string("HTTP: ") + e.what()));
    } catch (...) {
      SendError(conn, InternalError("HTTP: unexpected exception"));
    }
    return true;
  }

  bool Ready() const {
    const auto& healthy = service_->options_.device_healthy;
    return !service_->pipeline_->Draining() && (!healthy || healthy());
  }

  void Route(mg_connection* conn, bool post) {
    const mg_request_info* info = mg_get_request_info(conn);
    const std::string_view uri = info->local_uri != nullptr ? info->local_uri : "";
    const auto segments = Segments(uri);
    auto not_found = [&] {
      SendError(conn, NotFoundError("path: expected /v2/health/live, /v2/health/ready, /v2/models/MODEL[/versions/V]"
                                    "[/ready|/infer] (docs/service.md, \"HTTP/REST\"), got " +
                                    QuoteUntrusted(uri.substr(0, 200))));
    };
    if (!segments) return not_found();
    const auto& s = *segments;
    std::string model, version, tail;
    const bool infer = ModelRoute(s, &model, &version, &tail) && tail == "infer";
    if (post != infer) {
      const std::string method = post ? "POST" : "GET";
      return Send(conn, 405,
                  ErrorJson("method: expected " + std::string(infer ? "POST" : "GET") + " for " +
                            QuoteUntrusted(uri.substr(0, 200)) + ", got " + method));
    }
    if (infer) return Infer(conn, info, model, version);
    if (s.empty() || (s.size() == 1 && s[0].empty())) {
      return Send(conn, 200,
                  "{\"name\":\"attnserve\",\"version\":\"" + service_->options_.version +
                      "\",\"extensions\":[\"model_configuration\",\"parameters\",\"binary_tensor_data\"]}");
    }
    if (s.size() == 2 && s[0] == "health" && s[1] == "live") return Send(conn, 200, "{\"live\":true}");
    if (s.size() == 2 && s[0] == "health" && s[1] == "ready") {
      const bool ready = Ready();
      return Send(conn, ready ? 200 : 503, ready ? "{\"ready\":true}" : "{\"ready\":false}");
    }
    if (!ModelRoute(s, &model, &version, &tail) || !(tail.empty() || tail == "ready")) return not_found();
    const StatusOr<std::shared_ptr<const Layer>> layer = FindInferModel(*service_->store_, model, version);
    if (!layer.ok()) return SendError(conn, layer.status());
    if (tail == "ready") {
      const bool ready = Ready();
      return Send(conn, ready ? 200 : 503, ready ? "{\"ready\":true}" : "{\"ready\":false}");
    }
    inference::ModelMetadataResponse metadata;
    FillModelMetadata(**layer, &metadata);
    Send(conn, 200, ModelMetadataJson(metadata));
  }

  // A client that sent "Expect: 100-continue" (curl does for bodies over 1 MiB) waits for this
  // line before it sends the body; without it every large call would stall for the client's
  // expect timeout (1 s in curl). False after answering 417 to an expectation we cannot meet.
  static bool ContinueIfExpected(mg_connection* conn) {
    const char* expect = mg_get_header(conn, "Expect");
    if (expect == nullptr) return true;
    if (mg_strcasecmp(expect, "100-continue") != 0) {
      Send(conn, 417, ErrorJson(std::string("Expect: expected '100-continue', got '") + expect + "'"));
      return false;
    }
    static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    mg_write(conn, kContinue.data(), kContinue.size());
    return true;
  }

  // Reads and drops what is left of a refused body, up to kDrainBytes: closing a socket with
  // unread bytes sends a reset, and the client would see the reset instead of the 413. A client
  // that waits for "100 Continue" sends nothing and closes after the answer, which ends the read.
  static void DrainRefusedBody(mg_connection* conn) {
    constexpr int64_t kDrainBytes = int64_t{64} << 20;
    std::vector<char> chunk(kReadStep);  // on the heap: see kReadStep
    for (int64_t dropped = 0; dropped < kDrainBytes;) {
      const int n = mg_read(conn, chunk.data(), chunk.size());
      if (n <= 0) return;
      dropped += n;
    }
  }

  // The body, or false after answering 413 (too large), 417 or 400 (cut short).
  bool ReadBody(mg_connection* conn, const mg_request_info* info, std::string* body) {
    const int64_t limit = service_->options_.max_body_bytes;
    auto too_large = [&](const std::string& got) {
      Send(conn, 413,
           ErrorJson("body: expected at most " + std::to_string(limit) + " bytes (--max-message-mb), got " + got));
      DrainRefusedBody(conn);
      return false;
    };
    if (info->content_length > limit) return too_large(std::to_string(info->content_length) + " (Content-Length)");
    if (!ContinueIfExpected(conn)) return false;
    if (info->content_length >= 0) body->reserve(static_cast<size_t>(info->content_length));
    for (;;) {
      // Straight into the body: see kReadStep.
      const size_t had = body->size();
      body->resize(had + kReadStep);
      const int n = mg_read(conn, body->data() + had, kReadStep);
      body->resize(had + static_cast<size_t>(std::max(n, 0)));
      if (n < 0) {
        SendError(conn, InvalidArgumentError("body: the connection ended before the body did"));
        return false;
      }
      if (n == 0) break;
      if (static_cast<int64_t>(body->size()) > limit) return too_large("more");
    }
    if (info->content_length >= 0 && static_cast<int64_t>(body->size()) != info->content_length) {
      SendError(conn, InvalidArgumentError("body: expected " + std::to_string(info->content_length) +
                                           " bytes (Content-Length), got " + std::to_string(body->size())));
      return false;
    }
    return true;
  }

  void Infer(mg_connection* conn, const mg_request_info* info, const std::string& model, const std::string& version) {
    const auto arrived = std::chrono::steady_clock::now();
    std::string body;
    if (!ReadBody(conn, info, &body)) return;
    const char* header_length = mg_get_header(conn, "Inference-Header-Content-Length");
    HttpInferRequest parsed;
    InferForwardRequest converted;
    // A refusal of the HTTP body is answered like the gRPC conversion's own: through the
    // pipeline, so that it is counted under the layer as every refusal of a request is.
    Status refused = ParseInferRequest(
        body, header_length != nullptr ? std::optional<std::string_view>(header_length) : std::nullopt, model, version,
        &parsed);
    if (refused.ok()) {
      ConvertInferRequest(parsed.request, &converted);
    } else {
      converted.wire.layer = model;
    }
    auto call = std::make_shared<PendingCall>();
    auto answer = std::make_unique<InferAnswer>(&call->response, model, parsed.request.id());
    ForwardDone done = [call](const Status& status, const CallTimeline* served) {
      {
        std::lock_guard<std::mutex> lock(call->mu);
        call->status = status;
        if (served != nullptr) call->served = *served;
        call->done = true;
      }
      call->cv.notify_all();
    };
    // `parsed` and `converted` (which the wire request views) live on this thread until the
    // call is done: it waits below.
    service_->pipeline_->Start(converted.wire, std::move(answer), std::move(done), CallControl{}, arrived,
                               refused.ok() ? converted.refused : refused);
    {
      std::unique_lock<std::mutex> lock(call->mu);
      call->cv.wait(lock, [&] { return call->done; });
    }
    if (!call->status.ok()) return SendError(conn, call->status);
    const HttpBody out = WriteInferResponse(call->response, parsed.binary_output);
    Send(conn, 200, out.bytes, out.json_length ? "application/octet-stream" : "application/json", out.json_length);
    if (call->served) service_->pipeline_->ReportStages(*call->served, std::chrono::steady_clock::now());
  }

  HttpService* const service_;
};

HttpService::HttpService(HttpServiceOptions options, LayerStore* store, ForwardPipeline* pipeline)
    : options_(std::move(options)), store_(store), pipeline_(pipeline) {}

HttpService::~HttpService() { Stop(); }

void HttpService::Stop(std::chrono::milliseconds grace) {
  const auto until = std::chrono::steady_clock::now() + grace;
  if (listener_ == nullptr) return;
  while (listener_->listening() && serving_.load() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  listener_->Stop();
}

StatusOr<std::unique_ptr<HttpService>> HttpService::Start(HttpServiceOptions options, LayerStore* store,
                                                          ForwardPipeline* pipeline) {
  std::unique_ptr<HttpService> service(new HttpService(std::move(options), store, pipeline));
  const HttpServiceOptions& o = service->options_;
  service->handler_ = std::make_unique<Handler>(service.get());
  WebListenerOptions web;
  web.field = "http_listen";
  web.listen = o.listen;
  web.example = "0.0.0.0:8080";
  web.threads = o.threads;
  web.request_timeout_ms = kSocketTimeoutMs;
  web.cert_pem = o.cert_pem;
  web.key_pem = o.key_pem;
  web.client_ca_pem = o.client_ca_pem;
  web.tls_field = "http_listen";
  web.tls_unavailable =
      "http_listen: --tls-cert asks every listener for TLS, and this build's civetweb cannot load the "
      "system's OpenSSL, so the HTTP listener cannot serve TLS; put it behind a TLS-terminating proxy or "
      "sidecar and leave --http-listen on loopback, or serve the Open Inference Protocol over gRPC "
      "(docs/service.md, \"HTTP/REST\")";
  ATTNSERVE_ASSIGN_OR_RETURN(service->listener_, WebListener::Start(web, {{"/v2", service->handler_.get()}}));
  return service;
}

}  // namespace attnserve
