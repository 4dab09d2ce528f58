#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <poll.h>
#include <pthread.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "server/backend/select.h"
#include "server/batching/batching_executor.h"
#include "server/batching/memory_budget.h"
#include "server/device_watch.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_endpoint.h"
#include "server/metrics/web_config.h"
#include "server/routing/router.h"
#include "server/routing/routes_file.h"
#include "server/routing/shadow.h"
#include "server/service/admin_worker.h"
#include "server/service/auto_form.h"
#include "server/service/forward_pipeline.h"
#include "server/service/http/http_service.h"
#include "server/service/inference_service.h"
#include "server/service/live_calibration_build.h"
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

// After the drain, how long the HTTP listener waits for the requests it is serving (an answer
// being written, a body still arriving) before civetweb's stop cuts them.
constexpr std::chrono::seconds kHttpStopGrace(5);

// How often the monitor looks at the device's health, and refreshes its gauges, while it waits
// for a signal.
constexpr int kDeviceWatchMs = 250;

// After the drain, how long a layer load still running on an admin thread may take before the
// process ends without it (reads of a hung network file system do not return).
constexpr std::chrono::seconds kAdminGrace(1);
// Background work waiting at once (a layer's low-rank build from live rows, auto's fit of a
// layer): a call that finds the queue full leaves it to the next call.
constexpr int kBackgroundQueue = 16;

// `status` with `context` before its message: what the server was doing when it failed.
Status InContext(const std::string& context, const Status& status) {
  return Status(status.code(), context + status.message());
}

sigset_t ShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
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

}  // namespace

void BlockShutdownSignals() {
  const sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  std::unique_ptr<Server> server(new Server(options));
  ATTNSERVE_RETURN_IF_ERROR(server->Build());
  ATTNSERVE_RETURN_IF_ERROR(server->OpenListeners());
  server->LogListening();
  return server;
}

Server::Server(const ServerOptions& options) : options_(options) {}

Server::~Server() {
  if (monitor_.joinable()) monitor_.join();
  if (signal_fd_ >= 0) close(signal_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

int Server::metrics_port() const { return metrics_endpoint_->port(); }

int Server::http_port() const { return http_ != nullptr ? http_->port() : 0; }

std::string Server::listening_on() const { return HostOf(options_.listen) + ":" + std::to_string(port_); }

// Everything below the listeners, in start-up order.
Status Server::Build() {
  const sigset_t signals = ShutdownSignals();
  signal_fd_ = signalfd(-1, &signals, SFD_CLOEXEC);
  stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (signal_fd_ < 0 || stop_fd_ < 0) return InternalError(std::string("cannot watch for signals: ") + std::strerror(errno));

  StatusOr<ChosenBackend> chosen = ChooseBackend(options_.backend);
  if (!chosen.ok()) return InContext("cannot use the device: ", chosen.status());
  chosen_ = std::make_unique<ChosenBackend>(std::move(chosen).value());
  backend_ = chosen_->backend.get();
  spdlog::info("backend {}", chosen_->why);
  metrics_ = std::make_unique<Metrics>();
  metrics_->SetBuildInfo(ATTNSERVE_VERSION, backend_->DeviceName(), chosen_->blas);
  for (const Math math : options_.store.extra_maths) {
    if (Status st = backend_->CheckMath(math); !st.ok()) return InContext("--extra-maths: ", st);
  }
  store_ = std::make_unique<LayerStore>(backend_, options_.store);
  for (const auto& [name, source] : options_.layers) {
    StatusOr<std::shared_ptr<const Layer>> layer = store_->Load(name, source);
    if (!layer.ok()) return InContext("cannot load layer '" + name + "': ", Status(layer.status().code(), layer.status().ToString()));
    std::string forms;
    for (const auto& [form, _] : (*layer)->forms) forms += (forms.empty() ? "" : ", ") + std::string(FormName(form));
    std::string maths;
    for (const Math m : (*layer)->maths) maths += (maths.empty() ? "" : ", ") + std::string(MathName(m));
    spdlog::info("layer '{}' from '{}': {} (forms: {}; maths: {})", name, (*layer)->source, (*layer)->config.ToString(),
                 forms, maths);
    ReportLayerMetrics(**layer, *metrics_);
  }

  // Before the listeners, which report ready as they open: a lane per worker, warm.
  device_watch_ = std::make_unique<DeviceWatch>(backend_, metrics_.get(), options_.nvml_library);
  ATTNSERVE_RETURN_IF_ERROR(device_watch_->Warm(*store_, options_.batching.workers));

  // After the layers: a bad layer is reported as such whatever the state of the metrics port.
  if (!options_.metrics_web_config.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(metrics_web_, ReadMetricsWebConfig(options_.metrics_web_config));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(metrics_endpoint_, MetricsEndpoint::Start(options_.metrics_listen, *metrics_, metrics_web_));
  executor_ = std::make_unique<BatchingExecutor>(backend_, options_.batching, metrics_.get());
  router_ = std::make_unique<Router>(metrics_.get(), backend_->default_math());
  for (const auto& [layer, spec] : options_.routes) {
    ATTNSERVE_ASSIGN_OR_RETURN(RouteSplit split, ParseRouteSpec(spec));  // checked by ParseServerOptions too
    ATTNSERVE_RETURN_IF_ERROR(router_->SetRoute(layer, split));
  }
  if (!options_.routes_file.empty()) {
    // A file naming a layer not loaded, or a form it does not hold, is refused whole.
    LayerStore* store = store_.get();
    auto held = [store](const Routes& routes) { return CheckRoutesHeld(routes, store->List()); };
    ATTNSERVE_ASSIGN_OR_RETURN(routes_file_, RoutesFile::Start(RoutesFileOptions{.path = options_.routes_file},
                                                               router_.get(), held, metrics_.get()));
  }
  ATTNSERVE_RETURN_IF_ERROR(router_->SetShadowRate(options_.shadow_rate));
  // One budget for what every admitted request and shadow run holds (docs/reliability.md).
  const int64_t memory_budget =
      options_.max_memory_mb > 0 ? int64_t{options_.max_memory_mb} << 20 : DefaultMemoryBudgetBytes();
  Metrics* metrics = metrics_.get();
  memory_ = std::make_unique<MemoryBudget>(memory_budget, "--max-memory-mb", [metrics, memory_budget](int64_t reserved) {
    metrics->SetMemory(reserved, memory_budget);
  });
  shadow_ = std::make_unique<ShadowRunner>(
      executor_.get(), ShadowOptions{.queue_capacity = options_.shadow_queue, .budget = memory_.get()}, metrics);

  background_ = std::make_unique<AdminWorker>(kBackgroundQueue);
  AdminWorker* background = background_.get();
  // A layer's first `auto` request is answered by the flop count while its fit runs here.
  auto_form_ = std::make_unique<AutoFormChooser>(
      backend_, AutoFormOptions{.calibration_budget = std::chrono::milliseconds(options_.auto_calibration_ms),
                                .schedule =
                                    [background](std::function<void()> fit) {
                                      return background->Post({.run = std::move(fit),
                                                               .refuse = [](const Status&) {},
                                                               .deadline = std::chrono::steady_clock::time_point::max()});
                                    },
                                .memory = memory_.get()});
  // One call path for every protocol and listener: one drain gate for all inference calls.
  pipeline_ = std::make_unique<ForwardPipeline>(
      store_.get(), executor_.get(),
      ForwardPipelineOptions{.max_request_scores = int64_t{options_.max_scores_m} * 1000000,
                             .metrics = metrics,
                             .router = router_.get(),
                             .shadow = shadow_.get(),
                             .memory = memory_.get(),
                             .backend = backend_,
                             .auto_form = auto_form_.get(),
                             .build_live_calibration = BuildLiveCalibrationOn(background, store_.get()),
                             .max_response_bytes = int64_t{options_.max_message_mb} << 20});
  auto service_options = [&](AdminAccess access) {
    return ServiceOptions{.admin_access = access,
                          .admin_token = options_.admin_token,
                          .admin_queue = options_.admin_queue,
                          .metrics = metrics,
                          .router = router_.get(),
                          .routes_file = options_.routes_file};
  };
  // The public listener opens the admin API only to token holders; the admin listener, which
  // can only bind loopback without a token (server_options.cc), to whoever reaches it.
  const bool token = !options_.admin_token.empty();
  service_ = std::make_unique<AttentionServiceImpl>(store_.get(), pipeline_.get(),
                                                    service_options(token ? AdminAccess::kToken : AdminAccess::kClosed));
  if (!options_.admin_listen.empty()) {
    admin_service_ = std::make_unique<AttentionServiceImpl>(
        store_.get(), pipeline_.get(), service_options(token ? AdminAccess::kToken : AdminAccess::kOpen));
  }
  // The Open Inference Protocol on the public listener, next to attnserve.v1: its ModelInfer
  // runs the same call path as Forward, so the drain and the device watch cover it too.
  Backend* backend = backend_;
  inference_service_ = std::make_unique<InferenceServiceImpl>(
      store_.get(), pipeline_.get(),
      InferenceServiceOptions{.version = ATTNSERVE_VERSION,
                              .device_healthy = [backend] { return backend->Healthy(); },
                              .max_queue_delay_us = options_.batching.max_queue_delay.count()});
  return OkStatus();
}

// The public listener, the optional admin listener, then the port files (written last, so a
// reader of a port file finds a server that answers).
Status Server::OpenListeners() {
  ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, ServerCredentials(options_));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  listener_ = BuildServer(options_, options_.listen, credentials, {service_.get(), inference_service_.get()}, &port_);
  if (listener_ == nullptr || port_ == 0) {
    return UnavailableError("cannot listen on " + options_.listen + " (address in use or invalid?)");
  }
  if (admin_service_ != nullptr) {
    admin_listener_ = BuildServer(options_, options_.admin_listen, credentials, {admin_service_.get()}, &admin_port_);
    if (admin_listener_ == nullptr || admin_port_ == 0) {
      return UnavailableError("cannot listen on --admin-listen " + options_.admin_listen + " (address in use or invalid?)");
    }
  }
  if (!options_.http_listen.empty()) {
    // The Open Inference Protocol over HTTP/REST, TLS by the same --tls-* files as gRPC.
    HttpServiceOptions http;
    http.listen = options_.http_listen;
    http.version = ATTNSERVE_VERSION;
    http.max_body_bytes = int64_t{options_.max_message_mb} << 20;
    if (!options_.tls_cert.empty()) {
      ATTNSERVE_ASSIGN_OR_RETURN(http.cert_pem, ReadPem("--tls-cert", options_.tls_cert));
      ATTNSERVE_ASSIGN_OR_RETURN(http.key_pem, ReadPem("--tls-key", options_.tls_key));
      if (!options_.tls_client_ca.empty()) {
        ATTNSERVE_ASSIGN_OR_RETURN(http.client_ca_pem, ReadPem("--tls-client-ca", options_.tls_client_ca));
      }
    }
    Backend* backend = backend_;
    http.device_healthy = [backend] { return backend->Healthy(); };
    ATTNSERVE_ASSIGN_OR_RETURN(http_, HttpService::Start(std::move(http), store_.get(), pipeline_.get()));
  }
  listener_->GetHealthCheckService()->SetServingStatus("attnserve.v1.AttentionService", true);
  listener_->GetHealthCheckService()->SetServingStatus("inference.GRPCInferenceService", true);
  struct PortFile {
    const char* what;
    const std::string& path;
    int port;
  };
  const PortFile port_files[] = {{"metrics port file", options_.metrics_port_file, metrics_port()},
                                 {"admin port file", options_.admin_port_file, admin_port_},
                                 {"HTTP port file", options_.http_port_file, http_port()},
                                 {"port file", options_.port_file, port_}};
  for (const PortFile& file : port_files) {
    if (!file.path.empty() && !WritePortFile(file.path, file.port)) {
      return InternalError(std::string("cannot write the ") + file.what + " '" + file.path + "'");
    }
  }
  return OkStatus();
}

void Server::LogListening() const {
  if (http_ != nullptr) {
    spdlog::info("Open Inference Protocol over HTTP/REST on {}://{}:{}/v2", http_->tls() ? "https" : "http",
                 HostOf(options_.http_listen), http_->port());
  }
  if (admin_listener_ != nullptr) {
    spdlog::info("admin listener on {}:{} ({})", HostOf(options_.admin_listen), admin_port_,
                 options_.admin_token.empty() ? "loopback, no token" : "admin token required");
  }
  spdlog::info(
      "attnserve {} listening on {} (backend {}, {} workers spinning {} us when idle, batches of <= {} requests / "
      "{} tokens after <= {} us, queues of {}, max message {} MiB, memory budget {} MiB, {}, admin API {})",
      ATTNSERVE_VERSION, listening_on(), backend_->DeviceName(), options_.batching.workers,
      options_.batching.idle_spin.count(), options_.batching.max_batch_requests, options_.batching.max_batch_tokens,
      options_.batching.max_queue_delay.count(), options_.batching.max_queue_requests, options_.max_message_mb,
      memory_->budget() >> 20,
      options_.tls_cert.empty() ? "plaintext" : (options_.tls_client_ca.empty() ? "TLS" : "mTLS"),
      options_.admin_token.empty() ? "closed on this listener" : "with the admin token");
  std::string routes;
  for (const auto& [layer, split] : router_->AllRoutes()) {
    routes += (routes.empty() ? "" : "; ") + layer + "=" + FormatRouteSpec(split);
  }
  spdlog::info("metrics on {}://{}:{}/metrics{}; routes {}; shadow rate {}", metrics_web_.tls() ? "https" : "http",
               HostOf(options_.metrics_listen), metrics_port(),
               metrics_web_.basic_auth_users.empty() ? "" : " (basic auth)", routes, router_->shadow_rate());
}

void Server::Stop() {
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof one);
}

// One thread for both: the signalfd and the eventfd wake it at once, and between wake-ups it
// looks at the device every kDeviceWatchMs. A device fault (Backend::Healthy() turning false)
// takes the server out of rotation: health answers NOT_SERVING for the whole server and the
// service, so probes and balancers move on; the server itself keeps answering until a signal.
void Server::Monitor() {
  bool device_reported = false;
  pollfd wake[2] = {{.fd = signal_fd_, .events = POLLIN, .revents = 0}, {.fd = stop_fd_, .events = POLLIN, .revents = 0}};
  for (;;) {
    const int ready = poll(wake, 2, kDeviceWatchMs);
    if (ready > 0 && (wake[0].revents & POLLIN) != 0) {
      signalfd_siginfo info{};
      (void)!read(signal_fd_, &info, sizeof info);
      return Drain(static_cast<int>(info.ssi_signo));
    }
    if (ready > 0 && (wake[1].revents & POLLIN) != 0) return Drain(0);
    device_watch_->Refresh();
    if (!device_reported && !backend_->Healthy()) {
      spdlog::error("device {} is unhealthy after a device error: health is NOT_SERVING", backend_->DeviceName());
      listener_->GetHealthCheckService()->SetServingStatus(false);
      device_reported = true;
      if (options_.exit_on_device_loss) {
        device_lost_.store(true);
        return Drain("device " + backend_->DeviceName() + " lost (--exit-on-device-loss)");
      }
    }
  }
}

// Graceful drain: NOT_SERVING first (load balancers stop sending); the service answers new
// Forward calls UNAVAILABLE while the batcher finishes the accepted ones; once every accepted
// call is answered (or at the drain deadline) and the clients have had a moment to read
// their answers, gRPC's Shutdown closes the listeners, cancelling whatever is still open.
// Shutdown is not the first step: it cancels calls gRPC has received but not yet handed to
// the service, and closing a socket with unread client frames resets the connection, which
// can discard answers the client's kernel holds but the client has not yet read.
void Server::Drain(int signal) {
  Drain(signal == 0 ? std::string("stop requested") : "signal " + std::to_string(signal));
}

void Server::Drain(const std::string& why) {
  const auto drain_timeout = std::chrono::seconds(options_.drain_timeout_s);
  spdlog::info("{}: draining ({} requests queued; accepted requests get {} s)", why, executor_->QueueDepth(),
               options_.drain_timeout_s);
  listener_->GetHealthCheckService()->Shutdown();  // health checks answer NOT_SERVING from now on
  if (admin_listener_ != nullptr) admin_listener_->GetHealthCheckService()->Shutdown();
  const auto deadline = std::chrono::system_clock::now() + drain_timeout;
  const auto steady_deadline = std::chrono::steady_clock::now() + drain_timeout;
  pipeline_->Close();
  // No call can bring company now: what waits out --max-queue-delay-us runs at once.
  executor_->StopWaitingForCompany();
  const bool answered = pipeline_->WaitIdle(steady_deadline);
  if (answered) {
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        kDrainLinger, std::max<std::chrono::steady_clock::duration>(steady_deadline - std::chrono::steady_clock::now(),
                                                                    std::chrono::seconds(0))));
  }
  spdlog::info("every accepted inference call {}; closing the listeners",
               answered ? "is answered" : "was not answered by the drain deadline");
  // gRPC cancels the calls still open at the deadline, but Shutdown waits for every callback
  // call to be answered, and a layer load holds its call until the load ends. At the deadline
  // such a call is answered UNAVAILABLE instead (the load itself gets kAdminGrace more, in Run).
  std::mutex abandon_mu;
  std::condition_variable abandon_cv;
  bool shut_down = false;
  std::thread abandoner([&] {
    std::unique_lock<std::mutex> lock(abandon_mu);
    if (abandon_cv.wait_until(lock, steady_deadline, [&] { return shut_down; })) return;
    service_->AbandonAdminCalls();
    if (admin_service_ != nullptr) admin_service_->AbandonAdminCalls();
  });
  listener_->Shutdown(deadline);
  if (admin_listener_ != nullptr) admin_listener_->Shutdown(deadline);
  spdlog::info("listeners closed");
  {
    std::lock_guard<std::mutex> lock(abandon_mu);
    shut_down = true;
  }
  abandon_cv.notify_all();
  abandoner.join();
}

Stopped Server::Run() {
  if (ran_.exchange(true)) return Stopped::kDrained;
  monitor_ = std::thread([this] { Monitor(); });
  listener_->Wait();
  if (admin_listener_ != nullptr) admin_listener_->Wait();
  monitor_.join();
  if (routes_file_ != nullptr) routes_file_->Stop();  // the listeners are closed: no route matters now
  shadow_->Shutdown();  // drops waiting mirrors; the running one needs the executor still
  const int abandoned = executor_->Drain(std::chrono::milliseconds(0));
  spdlog::info("batch workers stopped");
  // The HTTP listener last: until now it answered new calls 503 (the pipeline is closed), and
  // a call of its still open at the drain deadline was answered as the executor failed it
  // above; civetweb's stop waits for those answers to be written.
  if (http_ != nullptr) {
    http_->Stop(kHttpStopGrace);
    spdlog::info("HTTP listener closed");
  }
  // gRPC cancelled every call still open at the drain deadline; a layer load (or a low-rank
  // build from live rows) can still be running on an admin thread. It gets kAdminGrace; then the caller ends without it rather
  // than hold the drain forever.
  const auto admin_grace = std::chrono::steady_clock::now() + kAdminGrace;
  background_->AbandonAll();  // a low-rank build from live rows is dropped with them
  if (!service_->WaitForAdminCalls(admin_grace) || !background_->WaitIdle(admin_grace) ||
      (admin_service_ != nullptr && !admin_service_->WaitForAdminCalls(admin_grace))) {
    spdlog::warn("stopped ({} queued requests abandoned); a layer load still running is abandoned too", abandoned);
    return Stopped::kLoadStillRunning;
  }
  spdlog::info("stopped ({} queued requests abandoned at the drain deadline)", abandoned);
  return device_lost_.load() ? Stopped::kDeviceLost : Stopped::kDrained;
}

}  // namespace attnserve
