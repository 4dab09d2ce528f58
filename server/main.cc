// attnserve: flags and config → backend, layer store, executor, gRPC server; runs until
// SIGTERM or SIGINT. Wiring only: every piece it starts lives in its own component.
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "server/backend/select.h"
#include "server/batching/batching_executor.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_endpoint.h"
#include "server/routing/router.h"
#include "server/routing/shadow.h"
#include "server/server_options.h"
#include "server/service/inference_service.h"
#include "server/service/service.h"
#include "server/store/layer_store.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// After the last accepted call is answered, how long the listeners stay open before Shutdown:
// time for clients to read their answers (Shutdown's socket close can reset a connection that
// still holds unread bytes) while new calls are refused UNAVAILABLE.
constexpr std::chrono::milliseconds kDrainLinger(300);

// Length of the valid UTF-8 sequence starting at text[i], or 0 when the bytes there are not one
// (overlong forms, surrogates and code points past U+10FFFF included).
size_t Utf8SequenceLength(std::string_view text, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  uint32_t cp = 0;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2, cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3, cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3f);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff))) {
    return 0;
  }
  return n;
}

// %v made safe for one log line: control characters and invalid UTF-8 never reach the log
// as they are (a request's text could otherwise forge lines or break a JSON reader). Text logs
// show such bytes as \xNN; JSON logs also escape '"' and '\\' and write U+FFFD for bad bytes.
template <bool kJson>
class SafeMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string_view text(msg.payload.data(), msg.payload.size());
    for (size_t i = 0; i < text.size();) {
      const size_t n = Utf8SequenceLength(text, i);
      const auto c = static_cast<unsigned char>(text[i]);
      char buf[8];
      if (n == 0) {
        if (kJson) {
          dest.append(std::string_view("\\ufffd"));
        } else {
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          dest.append(std::string_view(buf));
        }
        ++i;
        continue;
      }
      if (n > 1) {
        dest.append(text.substr(i, n));
      } else if (kJson && (c == '"' || c == '\\')) {
        dest.push_back('\\');
        dest.push_back(static_cast<char>(c));
      } else if (c < 0x20 || c == 0x7f) {
        std::snprintf(buf, sizeof buf, kJson ? "\\u%04x" : "\\x%02x", c);
        dest.append(std::string_view(buf));
      } else {
        dest.push_back(static_cast<char>(c));
      }
      i += n;
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<SafeMessageFlag>(); }
};

void ConfigureLogging(const ServerOptions& options) {
  // Logs go to stderr; stdout carries only the 'listening on' line that scripts read.
  auto logger = std::make_shared<spdlog::logger>("attnserve", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  if (options.log_json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    formatter->add_flag<SafeMessageFlag<true>>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","thread":%t,"msg":"%*"})");
    logger->set_formatter(std::move(formatter));
  } else {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<SafeMessageFlag<false>>('*').set_pattern("%Y-%m-%d %H:%M:%S.%e %^%-5l%$ %*");
    logger->set_formatter(std::move(formatter));
  }
  logger->set_level(spdlog::level::from_str(options.log_level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  // protobuf writes to stderr on its own, past --log-level and --log-json: one line for each
  // request whose strings are not UTF-8, which any client could send to fill the log. Its lines
  // go through our logger at debug level instead (gRPC answers such a call UNIMPLEMENTED before
  // any handler runs; docs/service.md).
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* /*file*/, int /*line*/, const std::string& message) {
        spdlog::log(level >= google::protobuf::LOGLEVEL_FATAL ? spdlog::level::critical : spdlog::level::debug,
                    "protobuf: {}", message);
      });
}

std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

StatusOr<std::string> ReadPem(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError(what + ": cannot read '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return InvalidArgumentError(what + ": '" + path + "' holds no PEM block");
  }
  return text.str();
}

// Plaintext, TLS, or mTLS (REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY) for every gRPC listener. The
// files are read once, at start-up: a renewed certificate takes a restart (docs/security.md).
StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerOptions& options) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  ATTNSERVE_ASSIGN_OR_RETURN(auto cert, ReadPem("--tls-cert", options.tls_cert));
  ATTNSERVE_ASSIGN_OR_RETURN(auto key, ReadPem("--tls-key", options.tls_key));
  ssl.pem_key_cert_pairs.push_back({key, cert});
  if (!options.tls_client_ca.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("--tls-client-ca", options.tls_client_ca));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// One gRPC server on `listen` with the defences the gRPC in use does not set itself
// (docs/security.md): streams per connection, ping abuse, connection age, header size.
std::unique_ptr<grpc::Server> BuildServer(const ServerOptions& options, const std::string& listen,
                                          const std::shared_ptr<grpc::ServerCredentials>& credentials,
                                          std::initializer_list<grpc::Service*> services, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, credentials, port);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and share
  // it silently. Refuse to start instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_mb << 20);
  builder.SetMaxSendMessageSize(options.max_message_mb << 20);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             options.keepalive_min_ping_interval_s * 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, options.keepalive_max_ping_strikes);
  if (options.max_connection_age_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, options.max_connection_age_s * 1000);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, options.max_connection_age_grace_s * 1000);
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, options.max_metadata_kb * 1024);
  for (grpc::Service* service : services) {
    if (service != nullptr) builder.RegisterService(service);
  }
  return builder.BuildAndStart();
}

bool WritePortFile(const std::string& path, int port) {
  // Written whole and then renamed: a reader never sees a half-written port.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

int Run(int argc, char** argv) {
  StatusOr<ServerOptions> parsed = ParseServerOptions(argc, argv);
  if (!parsed.ok()) {
    std::cerr << "attnserve: " << parsed.status().message() << "\n";
    return 2;
  }
  const ServerOptions& options = *parsed;
  if (options.help) {
    std::cout << UsageText();
    return 0;
  }
  if (options.version) {
    std::cout << "attnserve " << ATTNSERVE_VERSION << "\n";
    return 0;
  }
  ConfigureLogging(options);

  // Block the shutdown signals before any thread exists so that every thread inherits the
  // mask and only the waiter below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  StatusOr<ChosenBackend> chosen = ChooseBackend(
      DeviceChoice{.device = options.device,
                   .cpu_threads = options.threads,
                   .cpu_gemm = options.cpu_gemm,
                   .tf32 = options.gpu_math == "tf32",
                   .max_device_bytes = int64_t{options.max_device_memory_mb} << 20});
  if (!chosen.ok()) {
    spdlog::critical("cannot use the device: {}", chosen.status().message());
    return 1;
  }
  spdlog::info("backend {}", chosen->why);
  Backend& backend = *chosen->backend;
  Metrics metrics;
  metrics.SetBuildInfo(ATTNSERVE_VERSION, backend.DeviceName(), chosen->blas);
  LayerStore store(&backend, LayerStoreOptions{.max_layers = options.max_layers,
                                                .max_total_bytes = int64_t{options.max_layer_mb} << 20,
                                                .model_dirs = options.model_dirs});
  for (const auto& [name, source] : options.layers) {
    StatusOr<std::shared_ptr<const Layer>> layer = store.Load(name, source);
    if (!layer.ok()) {
      spdlog::critical("cannot load layer '{}': {}", name, layer.status().ToString());
      return 1;
    }
    std::string forms;
    for (const auto& [form, _] : (*layer)->forms) forms += (forms.empty() ? "" : ", ") + std::string(FormName(form));
    spdlog::info("layer '{}' from '{}': {} (forms: {})", name, (*layer)->source, (*layer)->config.ToString(), forms);
    ReportLayerMetrics(**layer, metrics);
  }

  // After the layers: a bad layer is reported as such whatever the state of the metrics port.
  MetricsWebConfig web;
  if (!options.metrics_web_config.empty()) {
    StatusOr<MetricsWebConfig> read = ReadMetricsWebConfig(options.metrics_web_config);
    if (!read.ok()) {
      spdlog::critical("{}", read.status().message());
      return 1;
    }
    web = std::move(read).value();
  }
  StatusOr<std::unique_ptr<MetricsEndpoint>> metrics_endpoint =
      MetricsEndpoint::Start(options.metrics_listen, metrics, web);
  if (!metrics_endpoint.ok()) {
    spdlog::critical("{}", metrics_endpoint.status().message());
    return 1;
  }
  BatchingExecutor executor(&backend, BatchPolicy{.max_batch_requests = options.max_batch_requests,
                                                  .max_batch_tokens = options.max_batch_tokens,
                                                  .max_queue_delay = std::chrono::microseconds(options.max_queue_delay_us),
                                                  .max_queue_requests = options.max_queue_requests,
                                                  .workers = options.workers},
                            &metrics);
  Router router(&metrics);
  for (const auto& [layer, spec] : options.routes) {
    (void)router.SetRoute(layer, ParseRouteSpec(spec).value());  // checked by ParseServerOptions
  }
  (void)router.SetShadowRate(options.shadow_rate);  // checked by ParseServerOptions
  // One budget for what every admitted request and shadow run holds (docs/reliability.md).
  const int64_t memory_budget =
      options.max_memory_mb > 0 ? int64_t{options.max_memory_mb} << 20 : DefaultMemoryBudgetBytes();
  MemoryBudget memory(memory_budget, "--max-memory-mb",
                      [&metrics, memory_budget](int64_t reserved) { metrics.SetMemory(reserved, memory_budget); });
  ShadowRunner shadow(&executor, ShadowOptions{.queue_capacity = options.shadow_queue, .budget = &memory}, &metrics);
  StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = ServerCredentials(options);
  if (!credentials.ok()) {
    spdlog::critical("{}", credentials.status().message());
    return 1;
  }
  auto service_options = [&](AdminAccess access) {
    return ServiceOptions{.admin_access = access,
                          .admin_token = options.admin_token,
                          .admin_queue = options.admin_queue,
                          .max_request_scores = int64_t{options.max_scores_m} * 1000000,
                          .metrics = &metrics,
                          .router = &router,
                          .shadow = &shadow,
                          .memory = &memory,
                          .backend = &backend,
                          .max_response_bytes = int64_t{options.max_message_mb} << 20};
  };
  // The public listener opens the admin API only to token holders; the admin listener, which
  // can only bind loopback without a token (server_options.cc), to whoever reaches it.
  const AdminAccess token_or_closed = options.admin_token.empty() ? AdminAccess::kClosed : AdminAccess::kToken;
  AttentionServiceImpl service(&store, &executor, service_options(token_or_closed));
  std::unique_ptr<AttentionServiceImpl> admin_service;
  if (!options.admin_listen.empty()) {
    admin_service = std::make_unique<AttentionServiceImpl>(
        &store, &executor, service_options(options.admin_token.empty() ? AdminAccess::kOpen : AdminAccess::kToken));
  }

  // The Open Inference Protocol on the public listener, next to attnserve.v1: its ModelInfer
  // runs the same call path as Forward, so the drain and the device watch below cover it too.
  InferenceServiceImpl inference_service(
      &store, &service,
      InferenceServiceOptions{.version = ATTNSERVE_VERSION,
                              .device_healthy = [&backend] { return backend.Healthy(); },
                              .max_queue_delay_us = options.max_queue_delay_us});

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  int port = 0;
  std::unique_ptr<grpc::Server> server =
      BuildServer(options, options.listen, *credentials, {&service, &inference_service}, &port);
  if (server == nullptr || port == 0) {
    spdlog::critical("cannot listen on {} (address in use or invalid?)", options.listen);
    return 1;
  }
  int admin_port = 0;
  std::unique_ptr<grpc::Server> admin_server;
  if (admin_service != nullptr) {
    admin_server = BuildServer(options, options.admin_listen, *credentials, {admin_service.get()}, &admin_port);
    if (admin_server == nullptr || admin_port == 0) {
      spdlog::critical("cannot listen on --admin-listen {} (address in use or invalid?)", options.admin_listen);
      server->Shutdown();
      return 1;
    }
    spdlog::info("admin listener on {}:{} ({})", HostOf(options.admin_listen), admin_port,
                 options.admin_token.empty() ? "loopback, no token" : "admin token required");
  }
  server->GetHealthCheckService()->SetServingStatus("attnserve.v1.AttentionService", true);
  server->GetHealthCheckService()->SetServingStatus("inference.GRPCInferenceService", true);
  const std::string bound = HostOf(options.listen) + ":" + std::to_string(port);
  std::cout << "listening on " << bound << std::endl;
  spdlog::info(
      "attnserve {} listening on {} (backend {}, {} workers, batches of <= {} requests / {} tokens "
      "after <= {} us, queues of {}, max message {} MiB, memory budget {} MiB, {}, admin API {})",
      ATTNSERVE_VERSION, bound, backend.DeviceName(), options.workers, options.max_batch_requests,
      options.max_batch_tokens, options.max_queue_delay_us, options.max_queue_requests, options.max_message_mb,
      memory.budget() >> 20,
      options.tls_cert.empty() ? "plaintext" : (options.tls_client_ca.empty() ? "TLS" : "mTLS"),
      options.admin_token.empty() ? "closed on this listener" : "with the admin token");
  std::string routes;
  for (const auto& [layer, split] : router.Routes()) {
    routes += (routes.empty() ? "" : "; ") + layer + "=" + FormatRouteSpec(split);
  }
  spdlog::info("metrics on {}://{}:{}/metrics{}; routes {}; shadow rate {}", web.tls() ? "https" : "http",
               HostOf(options.metrics_listen), (*metrics_endpoint)->port(),
               web.basic_auth_users.empty() ? "" : " (basic auth)", routes, router.shadow_rate());
  if (!options.metrics_port_file.empty() && !WritePortFile(options.metrics_port_file, (*metrics_endpoint)->port())) {
    spdlog::critical("cannot write the metrics port file '{}'", options.metrics_port_file);
    server->Shutdown();
    return 1;
  }
  if (!options.admin_port_file.empty() && !WritePortFile(options.admin_port_file, admin_port)) {
    spdlog::critical("cannot write the admin port file '{}'", options.admin_port_file);
    server->Shutdown();
    return 1;
  }
  if (!options.port_file.empty() && !WritePortFile(options.port_file, port)) {
    spdlog::critical("cannot write the port file '{}'", options.port_file);
    server->Shutdown();
    return 1;
  }

  // Graceful drain: NOT_SERVING first (load balancers stop sending); the service answers new
  // Forward calls UNAVAILABLE while the batcher finishes the accepted ones; once every accepted
  // call is answered (or at the drain deadline) and the clients have had a moment to read
  // their answers, gRPC's Shutdown closes the listeners, cancelling whatever is still open.
  // Shutdown is not the first step: it cancels calls gRPC has received but not yet handed to
  // the service, and closing a socket with unread client frames resets the connection, which
  // can discard answers the client's kernel holds but the client has not yet read.
  const auto drain_timeout = std::chrono::seconds(options.drain_timeout_s);
  std::thread signal_waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    spdlog::info("signal {}: draining ({} requests queued; accepted requests get {} s)", signal,
                 executor.QueueDepth(), options.drain_timeout_s);
    server->GetHealthCheckService()->Shutdown();  // health checks answer NOT_SERVING from now on
    if (admin_server != nullptr) admin_server->GetHealthCheckService()->Shutdown();
    const auto deadline = std::chrono::system_clock::now() + drain_timeout;
    const auto steady_deadline = std::chrono::steady_clock::now() + drain_timeout;
    service.StopAcceptingForwardCalls();
    if (admin_service != nullptr) admin_service->StopAcceptingForwardCalls();
    const bool answered = service.WaitForForwardCalls(steady_deadline) &&
                          (admin_service == nullptr || admin_service->WaitForForwardCalls(steady_deadline));
    if (answered) {
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          kDrainLinger, std::max<std::chrono::steady_clock::duration>(
                            steady_deadline - std::chrono::steady_clock::now(), std::chrono::seconds(0))));
    }
    spdlog::info("every accepted inference call {}; closing the listeners",
                 answered ? "is answered" : "was not answered by the drain deadline");
    // gRPC cancels the calls still open at the deadline, but Shutdown waits for every callback
    // call to be answered, and a layer load holds its call until the load ends. At the deadline
    // such a call is answered UNAVAILABLE instead (the load itself gets a second more, below).
    std::mutex abandon_mu;
    std::condition_variable abandon_cv;
    bool shut_down = false;
    std::thread abandoner([&] {
      std::unique_lock<std::mutex> lock(abandon_mu);
      if (abandon_cv.wait_until(lock, steady_deadline, [&] { return shut_down; })) return;
      service.AbandonAdminCalls();
      if (admin_service != nullptr) admin_service->AbandonAdminCalls();
    });
    server->Shutdown(deadline);
    if (admin_server != nullptr) admin_server->Shutdown(deadline);
    {
      std::lock_guard<std::mutex> lock(abandon_mu);
      shut_down = true;
    }
    abandon_cv.notify_all();
    abandoner.join();
  });
  // A device fault (Backend::Healthy() turning false) takes the server out of rotation: health
  // answers NOT_SERVING for the whole server and the service, so probes and balancers move on.
  std::mutex health_mu;
  std::condition_variable health_cv;
  bool stopping = false;
  std::thread device_watch([&] {
    std::unique_lock<std::mutex> lock(health_mu);
    while (!health_cv.wait_for(lock, std::chrono::milliseconds(250), [&] { return stopping; })) {
      if (backend.Healthy()) continue;
      spdlog::error("device {} is unhealthy after a device error: health is NOT_SERVING", backend.DeviceName());
      server->GetHealthCheckService()->SetServingStatus(false);
      return;
    }
  });
  server->Wait();
  if (admin_server != nullptr) admin_server->Wait();
  signal_waiter.join();
  {
    std::lock_guard<std::mutex> lock(health_mu);
    stopping = true;
  }
  health_cv.notify_all();
  device_watch.join();
  shadow.Shutdown();  // drops waiting mirrors; the running one needs the executor still
  const int abandoned = executor.Drain(std::chrono::milliseconds(0));
  // gRPC cancelled every call still open at the drain deadline; a layer load can still be
  // running on an admin thread (reads of a hung network file system do not return). It gets a
  // second; then the process ends without it rather than hold the drain forever.
  const auto admin_grace = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  if (!service.WaitForAdminCalls(admin_grace) ||
      (admin_service != nullptr && !admin_service->WaitForAdminCalls(admin_grace))) {
    spdlog::warn("stopped ({} queued requests abandoned); a layer load still running is abandoned too", abandoned);
    std::_Exit(0);
  }
  spdlog::info("stopped ({} queued requests abandoned at the drain deadline)", abandoned);
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  try {
    return attnserve::Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "attnserve: fatal: " << e.what() << "\n";
    return 1;
  }
}
