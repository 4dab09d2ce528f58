#include "server/store/checkpoint_file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

namespace attnserve {
namespace {

constexpr int kReadFlags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;

Status RefusedBeneath(const std::string& path) {
  return NotFoundError("checkpoint '" + path + "': no readable regular file of that name beneath the model dirs");
}

// The walk for kernels without openat2 (before 5.6): one component at a time, never following
// a symlink, never going up.
int OpenByWalk(int dir, const std::string& path) {
  int current = ::dup(dir);
  if (current < 0) return -1;
  size_t start = 0;
  for (;;) {
    const size_t slash = path.find('/', start);
    const std::string part = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    const bool last = slash == std::string::npos;
    int next = -1;
    if (part.empty() || part == "." || part == "..") {
      errno = EXDEV;
    } else {
      next = ::openat(current, part.c_str(), last ? kReadFlags | O_NOFOLLOW : O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    const int saved = errno;
    ::close(current);
    errno = saved;
    if (next < 0 || last) return next;
    current = next;
    start = slash + 1;
  }
}

}  // namespace

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

StatusOr<FileDescriptor> OpenCheckpointFile(const std::string& beneath, const std::string& path) {
  if (beneath.empty()) {
    FileDescriptor fd(::open(path.c_str(), kReadFlags));
    if (fd.get() < 0) {
      const int err = errno;
      const std::string at = "checkpoint '" + path + "': ";
      if (err == ENOENT || err == ENOTDIR) return NotFoundError(at + "no such file");
      // FAILED_PRECONDITION, not PERMISSION_DENIED: the caller is allowed; the server's file is not.
      if (err == EACCES || err == EPERM) return FailedPreconditionError(at + "the server may not read it");
      return InvalidArgumentError(at + "cannot open it: " + std::strerror(err));
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return InvalidArgumentError("checkpoint '" + path + "': not a regular file");
    }
    return fd;
  }
  if (path.empty() || path[0] == '/') return RefusedBeneath(path);
  FileDescriptor dir(::open(beneath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) return RefusedBeneath(path);
  open_how how{};
  how.flags = kReadFlags;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  int raw = static_cast<int>(::syscall(SYS_openat2, dir.get(), path.c_str(), &how, sizeof how));
  if (raw < 0 && errno == ENOSYS) raw = OpenByWalk(dir.get(), path);
  FileDescriptor fd(raw);
  if (fd.get() < 0) return RefusedBeneath(path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return RefusedBeneath(path);
  return fd;
}

}  // namespace attnserve
