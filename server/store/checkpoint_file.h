// Opening checkpoint files without trusting the path: O_NONBLOCK (a FIFO never blocks the
// open), O_CLOEXEC, and regular files only (no FIFO, device, socket or directory). Beneath a
// model dir, the path is resolved with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
// RESOLVE_NO_MAGICLINKS), or, where the kernel lacks openat2, by a walk that opens each
// component with O_NOFOLLOW and refuses "..": nothing outside the dir is reachable, not through
// a symlink, "..", or /proc's magic links.
// Thread-safety: free functions; call from any thread.
#pragma once

#include <string>

#include "server/core/status.h"

namespace attnserve {

// An open file descriptor, closed on destruction.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Opens `path` for reading. With `beneath` empty, `path` is used as given (the operator's own
// sources): NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT naming the path and errno's reason.
// With `beneath` set (a model dir), `path` must be relative and stay beneath it, and every
// refusal — missing, unreadable, not a regular file, a symlink, ".." — is the same NOT_FOUND,
// so that the answer tells a caller nothing about what exists outside.
StatusOr<FileDescriptor> OpenCheckpointFile(const std::string& beneath, const std::string& path);

}  // namespace attnserve
