// The attnserve process as one object: the backend, the layer store, the executor, routing, the
// services, the listeners and the monitor that drains them, built from ServerOptions.
//
// Its members are declared in start-up order, so C++ destroys them in shutdown order: the
// monitor first, then the listeners, the services, the shadow runner, the executor, the store,
// and the backend last. Run() performs the drain itself (docs/architecture.md, "Batching";
// the exit status: docs/service.md, "Exit status"); the destructor only releases what is left.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "server/core/status.h"
#include "server/metrics/web_config.h"
#include "server/server_options.h"

namespace grpc {
class Server;
}

namespace attnserve {

class AdminWorker;
class AutoFormChooser;
class Backend;
class BatchingExecutor;
class InferenceServiceImpl;
class LayerStore;
class MemoryBudget;
class Metrics;
class MetricsEndpoint;
class Router;
class RoutesFile;
class ShadowRunner;
class AttentionServiceImpl;
class ForwardPipeline;
class HttpService;
class DeviceWatch;
struct ChosenBackend;

// How Run() ended. kLoadStillRunning: a layer load outlived the drain on an admin thread (a hung
// network file system); destroying the Server would wait for it, so the process should end
// without destructors (std::_Exit), as main does.
// kDeviceLost: the device was lost under --exit-on-device-loss and the server drained; the
// process should exit with kExitDeviceLost.
enum class Stopped { kDrained, kLoadStillRunning, kDeviceLost };
inline constexpr int kExitDeviceLost = 3;

// Blocks SIGTERM and SIGINT in the calling thread. Call it before any thread exists (before
// Server::Start) so that every thread inherits the mask and only the monitor receives them.
void BlockShutdownSignals();

class Server {
 public:
  // Chooses the device, loads the layers, opens the metrics endpoint and the listeners, and
  // writes the port files. A failure names what could not start; nothing is left listening.
  static StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }              // the public listener's bound port
  int admin_port() const { return admin_port_; }  // 0 without --admin-listen
  int http_port() const;                          // 0 without --http-listen
  int metrics_port() const;
  // "HOST:PORT" of the public listener, as the 'listening on' line prints it.
  std::string listening_on() const;

  // Serves until SIGTERM, SIGINT or Stop(), drains (NOT_SERVING; new calls refused UNAVAILABLE;
  // accepted calls answered within --drain-timeout-s; listeners closed), and returns. Once.
  Stopped Run();
  // Begins the drain as SIGTERM would. Any thread, any time after Start; idempotent.
  void Stop();

 private:
  explicit Server(const ServerOptions& options);
  Status Build();
  Status OpenListeners();
  void LogListening() const;
  // The monitor: one thread waits for a shutdown signal or Stop() and watches the device's
  // health meanwhile; on a signal it drains the listeners and returns.
  void Monitor();
  void Drain(int signal);
  void Drain(const std::string& why);

  const ServerOptions options_;
  // Start-up order; destroyed in reverse, which is the shutdown order (see the file comment).
  std::unique_ptr<ChosenBackend> chosen_;
  Backend* backend_ = nullptr;  // chosen_->backend
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<DeviceWatch> device_watch_;  // the device's warmup and gauges
  std::unique_ptr<LayerStore> store_;
  MetricsWebConfig metrics_web_;  // --metrics-web-config's TLS and basic auth; empty without it
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unique_ptr<BatchingExecutor> executor_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<RoutesFile> routes_file_;  // with --routes-file only
  std::unique_ptr<MemoryBudget> memory_;
  std::unique_ptr<ShadowRunner> shadow_;
  std::unique_ptr<AutoFormChooser> auto_form_;  // what form auto resolves to, per layer
  // Slow work a served call starts but must not wait for (a live calibration's low-rank form):
  // destroyed before the store and the chooser it uses, after the pipeline that posts to it.
  std::unique_ptr<AdminWorker> background_;
  std::unique_ptr<ForwardPipeline> pipeline_;  // every protocol's inference calls, one drain gate
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<AttentionServiceImpl> admin_service_;  // with --admin-listen only
  std::unique_ptr<InferenceServiceImpl> inference_service_;
  std::unique_ptr<grpc::Server> listener_;
  std::unique_ptr<grpc::Server> admin_listener_;
  std::unique_ptr<HttpService> http_;  // with --http-listen only
  int port_ = 0;
  int admin_port_ = 0;
  // Wakes the monitor: a signalfd for SIGTERM and SIGINT, an eventfd for Stop().
  int signal_fd_ = -1;
  int stop_fd_ = -1;
  std::atomic<bool> ran_{false};
  std::atomic<bool> device_lost_{false};  // drained for --exit-on-device-loss
  std::thread monitor_;
};

}  // namespace attnserve
