// attnserve: flags and config → backend, layer store, executor, gRPC server; runs until
// SIGTERM or SIGINT. Wiring only: every piece it starts lives in its own component.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/backend/select.h"
#include "server/batching/batching_executor.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_endpoint.h"
#include "server/routing/router.h"
#include "server/routing/shadow.h"
#include "server/server_options.h"
#include "server/service/service.h"
#include "server/store/layer_store.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// %v escaped for a JSON string, so that --log-json lines stay valid JSON whatever the message.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    for (char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        case '\r':
          dest.append(std::string_view("\\r"));
          break;
        case '\t':
          dest.append(std::string_view("\\t"));
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            dest.append(std::string_view(buf));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

void ConfigureLogging(const ServerOptions& options) {
  // Logs go to stderr; stdout carries only the 'listening on' line that scripts read.
  auto logger = std::make_shared<spdlog::logger>("attnserve", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  if (options.log_json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","thread":%t,"msg":"%*"})");
    logger->set_formatter(std::move(formatter));
  } else {
    logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%-5l%$ %v");
  }
  logger->set_level(spdlog::level::from_str(options.log_level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
}

std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
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
      DeviceChoice{.device = options.device, .cpu_threads = options.threads, .tf32 = options.gpu_math == "tf32"});
  if (!chosen.ok()) {
    spdlog::critical("cannot use the device: {}", chosen.status().message());
    return 1;
  }
  spdlog::info("backend {}", chosen->why);
  Backend& backend = *chosen->backend;
  Metrics metrics;
  metrics.SetBuildInfo(ATTNSERVE_VERSION, backend.DeviceName(),
                       backend.DeviceName() == "cpu" ? "eigen" : (options.gpu_math == "tf32" ? "cublas-tf32" : "cublas"));
  LayerStore store(&backend);
  for (const auto& [name, source] : options.layers) {
    StatusOr<std::shared_ptr<const Layer>> layer = store.Load(name, source);
    if (!layer.ok()) {
      spdlog::critical("cannot load layer '{}' from '{}': {}", name, source, layer.status().ToString());
      return 1;
    }
    std::string forms;
    for (const auto& [form, _] : (*layer)->forms) forms += (forms.empty() ? "" : ", ") + std::string(FormName(form));
    spdlog::info("layer '{}' from '{}': {} (forms: {})", name, source, (*layer)->config.ToString(), forms);
    ReportLayerMetrics(**layer, metrics);
  }

  // After the layers: a bad layer is reported as such whatever the state of the metrics port.
  StatusOr<std::unique_ptr<MetricsEndpoint>> metrics_endpoint = MetricsEndpoint::Start(options.metrics_listen, metrics);
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
  ShadowRunner shadow(&executor, ShadowOptions{.queue_capacity = options.shadow_queue}, &metrics);
  AttentionServiceImpl service(&store, &executor,
                               ServiceOptions{.admin_token = options.admin_token,
                                              .max_score_bytes = int64_t{options.max_scores_mb} << 20,
                                              .metrics = &metrics,
                                              .router = &router,
                                              .shadow = &shadow});

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and share
  // it silently. Refuse to start instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_mb << 20);
  builder.SetMaxSendMessageSize(options.max_message_mb << 20);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::critical("cannot listen on {} (address in use or invalid?)", options.listen);
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus("attnserve.v1.AttentionService", true);
  const std::string bound = HostOf(options.listen) + ":" + std::to_string(port);
  std::cout << "listening on " << bound << std::endl;
  spdlog::info(
      "attnserve {} listening on {} (backend {}, {} workers, batches of <= {} requests / {} tokens "
      "after <= {} us, queues of {}, max message {} MiB{})",
      ATTNSERVE_VERSION, bound, backend.DeviceName(), options.workers, options.max_batch_requests,
      options.max_batch_tokens, options.max_queue_delay_us, options.max_queue_requests, options.max_message_mb,
      options.admin_token.empty() ? "" : ", admin token required");
  std::string routes;
  for (const auto& [layer, split] : router.Routes()) {
    routes += (routes.empty() ? "" : "; ") + layer + "=" + FormatRouteSpec(split);
  }
  spdlog::info("metrics on {}:{}/metrics; routes {}; shadow rate {}", HostOf(options.metrics_listen),
               (*metrics_endpoint)->port(), routes, router.shadow_rate());
  if (!options.metrics_port_file.empty() && !WritePortFile(options.metrics_port_file, (*metrics_endpoint)->port())) {
    spdlog::critical("cannot write the metrics port file '{}'", options.metrics_port_file);
    server->Shutdown();
    return 1;
  }
  if (!options.port_file.empty() && !WritePortFile(options.port_file, port)) {
    spdlog::critical("cannot write the port file '{}'", options.port_file);
    server->Shutdown();
    return 1;
  }

  // Graceful drain: NOT_SERVING first (load balancers stop sending), then gRPC refuses new
  // calls (UNAVAILABLE) while the batcher finishes the accepted ones; calls still running at
  // the drain deadline are cancelled by gRPC, and their queued jobs fail with UNAVAILABLE.
  const auto drain_timeout = std::chrono::seconds(options.drain_timeout_s);
  std::thread signal_waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    spdlog::info("signal {}: draining ({} requests queued; accepted requests get {} s)", signal,
                 executor.QueueDepth(), options.drain_timeout_s);
    server->GetHealthCheckService()->Shutdown();  // health checks answer NOT_SERVING from now on
    server->Shutdown(std::chrono::system_clock::now() + drain_timeout);
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
  signal_waiter.join();
  {
    std::lock_guard<std::mutex> lock(health_mu);
    stopping = true;
  }
  health_cv.notify_all();
  device_watch.join();
  shadow.Shutdown();  // drops waiting mirrors; the running one needs the executor still
  const int abandoned = executor.Drain(std::chrono::milliseconds(0));
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
