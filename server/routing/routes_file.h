// RoutesFile: the routes of every replica as one declarative file (--routes-file), read at start
// and followed while the server runs. The file is YAML, the config file's `routes:` key alone:
//
//   routes:
//     "*": factored:90,summed:10
//     encoder: factored:50,summed:50
//
// (the grammar of --route: LAYER, or "*" for every layer without its own, → FORM:WEIGHT,...).
// A change is applied whole through Router::ReplaceRoutes, or refused whole: a file that does
// not parse, or that the validator refuses (a layer not loaded, a form it does not hold), is
// logged and counted (RoutingObserver::RoutesFileLoaded(false)) and the last good routes stay.
//
// Watching: inotify on the file's directory, not on the file, because Kubernetes updates a
// mounted ConfigMap by swapping the `..data` symlink (the file's inode never changes; the
// directory sees IN_MOVED_TO / IN_CREATE / IN_DELETE) and editors rename a new file into place.
// Any event re-reads the file through its path after a short settle; content equal to the last
// one read is ignored. Without inotify (or when the directory goes away) it polls every
// poll_interval instead.
// Thread-safety: one watcher thread; Stop() and the destructor may be called from any thread
// (not from the callbacks), once or more.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "server/core/status.h"
#include "server/layer/loaded_layer.h"
#include "server/routing/router.h"
#include "server/routing/routing_observer.h"

namespace attnserve {

// Parses a routes file's text; INVALID_ARGUMENT naming `origin`, the key, expected and got.
// An empty mapping (`routes: {}`) is valid: every layer back to factored:100.
StatusOr<Routes> ParseRoutesFile(std::string_view text, std::string_view origin);

// Refuses routes that name a layer not among `layers` or give a positive share to a form that
// layer does not hold; for "*", a form no layer holds. FAILED_PRECONDITION naming the route.
Status CheckRoutesHeld(const Routes& routes, const std::vector<std::shared_ptr<const Layer>>& layers);

struct RoutesFileOptions {
  std::string path;
  std::chrono::milliseconds poll_interval{2000};  // without inotify
  std::chrono::milliseconds settle{50};           // after an event, for the rest of a swap
  bool use_inotify = true;                        // false: poll only
};

class RoutesFile {
 public:
  // Checks routes against what the server holds before they are applied.
  using Validator = std::function<Status(const Routes&)>;

  // Reads, validates and applies the file once, then starts watching it. A file that cannot be
  // read or is refused is an error naming the file and the problem (nothing applied, no thread).
  // `router` and `observer` (may be null) outlive the RoutesFile.
  static StatusOr<std::unique_ptr<RoutesFile>> Start(RoutesFileOptions options, Router* router, Validator validator,
                                                     RoutingObserver* observer);
  ~RoutesFile();
  RoutesFile(const RoutesFile&) = delete;
  RoutesFile& operator=(const RoutesFile&) = delete;

  // Stops watching and joins the thread; the routes applied stay.
  void Stop();
  const std::string& path() const { return options_.path; }
  // False once it has fallen back to polling (or was asked to poll).
  bool inotify() const { return inotify_active_.load(std::memory_order_relaxed); }

 private:
  RoutesFile(RoutesFileOptions options, Router* router, Validator validator, RoutingObserver* observer);
  // Reads the file; applies it when its text changed since the last read. Start-up: `initial`.
  Status Reload(bool initial);
  void Watch();
  // inotify on the file's directory; false (and polling) when that is not possible.
  bool WatchDirectory();
  // Reads every pending event; true when the directory itself went away (then: poll).
  bool DrainEvents();
  void FallBackToPolling(const std::string& why);

  const RoutesFileOptions options_;
  Router* const router_;
  const Validator validator_;
  RoutingObserver* const observer_;
  // The watcher thread's own (and Start's, before the thread): the last text read, or nullopt
  // after a read failed.
  std::optional<std::string> last_text_;
  bool read_failed_ = false;
  int inotify_fd_ = -1;  // the watcher thread's; -1 when polling
  int stop_fd_ = -1;
  std::atomic<bool> inotify_active_{false};
  std::atomic<bool> stopped_{false};
  std::thread watcher_;
};

}  // namespace attnserve
