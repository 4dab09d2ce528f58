#include "server/routing/routes_file.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

namespace attnserve {
namespace {

constexpr char kExpected[] =
    "expected a mapping 'routes:' of LAYER: FORM:WEIGHT,... (LAYER may be '*'), e.g. "
    "routes: {'*': 'factored:90,summed:10'}";

// What changes a mounted ConfigMap (the `..data` symlink swap), an editor's rename into place,
// a write in place, or the directory itself going away.
constexpr uint32_t kWatchMask =
    IN_CREATE | IN_MOVED_TO | IN_MOVED_FROM | IN_CLOSE_WRITE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;
// Events in a burst (a swap is several) read before the file is, at most: a writer that never
// stops must not starve the reload.
constexpr int kMaxSettleRounds = 20;

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string HeldForms(const Layer& layer) {
  std::string names;
  for (const auto& [form, _] : layer.forms) names += (names.empty() ? "" : ", ") + std::string(FormName(form));
  if (layer.maths.size() > 1) {
    std::string maths;
    for (Math m : layer.maths) maths += (maths.empty() ? "" : ", ") + std::string(MathName(m));
    names += " in " + maths;
  }
  return names;
}

// Whether `layer` can serve `target`: its form (any, for auto) in its math (the layer's
// default where the target names none).
bool Holds(const Layer& layer, const RouteTarget& target) {
  const Math math = target.math.value_or(layer.default_math());
  if (target.is_auto()) return layer.HoldsMath(math);
  return math == layer.default_math() ? layer.forms.contains(*target.form)
                                      : layer.other_maths.contains(Variant{*target.form, math});
}

}  // namespace

StatusOr<Routes> ParseRoutesFile(std::string_view text, std::string_view origin) {
  const std::string o(origin);
  Routes routes;
  try {
    const YAML::Node root = YAML::Load(std::string(text));
    if (!root.IsMap())
      return InvalidArgumentError(o + ": " + kExpected + ", got " + (root.IsNull() ? "nothing" : "no mapping"));
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      if (key != "routes") return InvalidArgumentError(o + ": " + kExpected + ", got the key '" + key + "'");
    }
    const YAML::Node map = root["routes"];
    if (map.IsNull()) return routes;
    if (!map.IsMap()) return InvalidArgumentError(o + ": routes: " + kExpected + ", got no mapping");
    std::set<std::string> seen;
    for (const auto& entry : map) {
      const std::string layer = entry.first.as<std::string>();
      const std::string what = o + ": routes: " + layer;
      if (layer.empty()) return InvalidArgumentError(o + ": routes: expected a layer name or '*', got an empty key");
      if (!entry.second.IsScalar()) return InvalidArgumentError(what + ": expected FORM:WEIGHT,... as one string");
      if (!seen.insert(layer).second) return InvalidArgumentError(what + ": expected each layer once, got it twice");
      ATTNSERVE_ASSIGN_OR_RETURN(RouteSplit split, ParseRouteSpec(entry.second.as<std::string>(), what));
      routes.emplace_back(layer, std::move(split));
    }
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(o + ": not valid YAML: " + e.what());
  }
  return routes;
}

Status CheckRoutesHeld(const Routes& routes, const std::vector<std::shared_ptr<const Layer>>& layers) {
  std::string loaded;
  for (const auto& layer : layers) loaded += (loaded.empty() ? "" : ", ") + layer->name;
  for (const auto& [name, split] : routes) {
    if (name == kDefaultRoute) {
      for (const auto& [target, _] : split) {
        if (target.is_auto() && !target.math) continue;  // every layer can serve auto
        bool held = layers.empty();  // nothing loaded: nothing to hold it against
        for (const auto& layer : layers) held = held || Holds(*layer, target);
        if (!held) {
          return FailedPreconditionError("routes: *: expected forms some loaded layer holds, got " + target.label() +
                                         " which none of " + loaded + " holds");
        }
      }
      continue;
    }
    const Layer* layer = nullptr;
    for (const auto& l : layers) {
      if (l->name == name) layer = l.get();
    }
    if (layer == nullptr) {
      return FailedPreconditionError("routes: " + name + ": expected a loaded layer (" +
                                     (loaded.empty() ? std::string("none is loaded") : "loaded: " + loaded) +
                                     "), got '" + name + "'");
    }
    for (const auto& [target, _] : split) {
      if (!Holds(*layer, target)) {
        return FailedPreconditionError("routes: " + name + ": expected forms the layer holds (" + HeldForms(*layer) +
                                       ") or auto, got " + target.label());
      }
    }
  }
  return OkStatus();
}

RoutesFile::RoutesFile(RoutesFileOptions options, Router* router, Validator validator, RoutingObserver* observer)
    : options_(std::move(options)), router_(router), validator_(std::move(validator)), observer_(observer) {}

StatusOr<std::unique_ptr<RoutesFile>> RoutesFile::Start(RoutesFileOptions options, Router* router, Validator validator,
                                                        RoutingObserver* observer) {
  if (options.path.empty()) return InvalidArgumentError("--routes-file: expected a file path, got an empty string");
  std::unique_ptr<RoutesFile> file(new RoutesFile(std::move(options), router, std::move(validator), observer));
  ATTNSERVE_RETURN_IF_ERROR(file->Reload(/*initial=*/true));
  file->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (file->stop_fd_ < 0) return InternalError(std::string("--routes-file: eventfd: ") + std::strerror(errno));
  if (!file->options_.use_inotify || !file->WatchDirectory()) {
    spdlog::warn("routes file {}: polling every {} ms (no inotify)", file->path(),
                 file->options_.poll_interval.count());
  }
  file->watcher_ = std::thread([f = file.get()] { f->Watch(); });
  return file;
}

RoutesFile::~RoutesFile() {
  Stop();
  if (inotify_fd_ >= 0) close(inotify_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

void RoutesFile::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  if (stop_fd_ >= 0) (void)!write(stop_fd_, &one, sizeof one);
  if (watcher_.joinable()) watcher_.join();
}

bool RoutesFile::WatchDirectory() {
  const std::string dir = DirectoryOf(options_.path);
  inotify_fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (inotify_fd_ < 0) {
    spdlog::warn("routes file {}: inotify_init1: {}", path(), std::strerror(errno));
    return false;
  }
  if (inotify_add_watch(inotify_fd_, dir.c_str(), kWatchMask) < 0) {
    spdlog::warn("routes file {}: cannot watch {}: {}", path(), dir, std::strerror(errno));
    close(inotify_fd_);
    inotify_fd_ = -1;
    return false;
  }
  inotify_active_.store(true, std::memory_order_relaxed);
  return true;
}

void RoutesFile::FallBackToPolling(const std::string& why) {
  spdlog::warn("routes file {}: {}; polling every {} ms from now on", path(), why, options_.poll_interval.count());
  close(inotify_fd_);
  inotify_fd_ = -1;
  inotify_active_.store(false, std::memory_order_relaxed);
}

bool RoutesFile::DrainEvents() {
  alignas(inotify_event) char buf[4096];
  bool gone = false;
  for (;;) {
    const ssize_t n = read(inotify_fd_, buf, sizeof buf);
    if (n <= 0) return gone;  // EAGAIN: drained
    for (ssize_t at = 0; at < n;) {
      const auto* event = reinterpret_cast<const inotify_event*>(buf + at);
      if ((event->mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW)) != 0) {
        gone = gone || (event->mask & IN_Q_OVERFLOW) == 0;
      }
      at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
    }
  }
}

void RoutesFile::Watch() {
  for (;;) {
    pollfd fds[2] = {{.fd = stop_fd_, .events = POLLIN, .revents = 0},
                     {.fd = inotify_fd_, .events = POLLIN, .revents = 0}};
    const int timeout = inotify_fd_ >= 0 ? -1 : static_cast<int>(options_.poll_interval.count());
    const int ready = poll(fds, 2, timeout);
    if (ready < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(options_.poll_interval);  // never a busy loop
      continue;
    }
    if ((fds[0].revents & POLLIN) != 0) return;
    if (inotify_fd_ >= 0 && (fds[1].revents & POLLIN) != 0) {
      // A swap is several events: let it finish, then read the file once.
      bool gone = DrainEvents();
      for (int round = 0; round < kMaxSettleRounds; ++round) {
        fds[1].revents = 0;
        if (poll(fds, 2, static_cast<int>(options_.settle.count())) <= 0) break;
        if ((fds[0].revents & POLLIN) != 0) return;
        gone = DrainEvents() || gone;
      }
      if (gone) FallBackToPolling("its directory went away");
    }
    (void)Reload(/*initial=*/false);
  }
}

Status RoutesFile::Reload(bool initial) {
  std::ifstream in(options_.path, std::ios::binary);
  if (!in) {
    const std::string why = std::strerror(errno);
    Status error = InvalidArgumentError("--routes-file '" + path() + "': cannot read it (" + why + ")");
    if (initial) return error;
    if (!read_failed_) {  // reported once, not at every poll
      read_failed_ = true;
      last_text_.reset();
      spdlog::error("{}; the routes stay as they were (generation {})", error.message(), router_->generation());
      if (observer_ != nullptr) observer_->RoutesFileLoaded(false);
    }
    return error;
  }
  read_failed_ = false;
  std::stringstream text;
  text << in.rdbuf();
  if (!initial && last_text_ == text.str()) return OkStatus();
  last_text_ = text.str();
  Status status = [&]() -> Status {
    ATTNSERVE_ASSIGN_OR_RETURN(Routes routes, ParseRoutesFile(*last_text_, "--routes-file '" + path() + "'"));
    if (validator_) {
      Status held = validator_(routes);
      if (!held.ok()) return Status(held.code(), "--routes-file '" + path() + "': " + held.message());
    }
    return router_->ReplaceRoutes(routes);
  }();
  if (!status.ok()) {
    if (initial) return status;
    spdlog::error("{}; refused whole, the routes stay as they were (generation {})", status.message(),
                  router_->generation());
    if (observer_ != nullptr) observer_->RoutesFileLoaded(false);
    return status;
  }
  std::string applied;
  for (const auto& [layer, split] : router_->AllRoutes()) {
    applied += (applied.empty() ? "" : "; ") + layer + "=" + FormatRouteSpec(split);
  }
  spdlog::info("routes file {}: applied {} (generation {})", path(), applied, router_->generation());
  if (observer_ != nullptr) observer_->RoutesFileLoaded(true);
  return OkStatus();
}

}  // namespace attnserve
