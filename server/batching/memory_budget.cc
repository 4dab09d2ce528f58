#include "server/batching/memory_budget.h"

#include <unistd.h>

#include <fstream>
#include <string>

namespace attnserve {
namespace {

std::string MiB(int64_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

// A cgroup memory limit in bytes, or 0 when the file is absent or says there is none.
int64_t CgroupLimit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    const int64_t v = std::stoll(text);
    // cgroup v1 writes a page-rounded INT64_MAX for "no limit".
    return v > 0 && v < (int64_t{1} << 60) ? v : 0;
  } catch (...) {
    return 0;
  }
}

}  // namespace

MemoryBudget::MemoryBudget(int64_t budget_bytes, std::string flag, Observer observer)
    : budget_(budget_bytes), flag_(std::move(flag)), observer_(std::move(observer)) {
  if (observer_) observer_(0);
}

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
  }
  return *this;
}

void MemoryBudget::Reservation::Release() {
  if (budget_ != nullptr) budget_->Release(bytes_);
  budget_ = nullptr;
}

StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(int64_t bytes, const std::string& what) {
  if (bytes > budget_) {
    return InvalidArgumentError(what + " needs " + MiB(bytes) + " of server memory, more than the whole budget of " +
                                MiB(budget_) + " (" + flag_ + "); send less at once");
  }
  int64_t now = reserved_.load(std::memory_order_relaxed);
  do {
    if (now + bytes > budget_) {
      return ResourceExhaustedError(what + " needs " + MiB(bytes) + " of server memory; " + MiB(budget_ - now) +
                                    " of the " + MiB(budget_) + " budget (" + flag_ +
                                    ") is free now; retry later");
    }
  } while (!reserved_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  if (observer_) observer_(now + bytes);
  return Reservation(this, bytes);
}

void MemoryBudget::Release(int64_t bytes) {
  const int64_t after = reserved_.fetch_sub(bytes, std::memory_order_relaxed) - bytes;
  if (observer_) observer_(after);
}

int64_t DefaultMemoryBudgetBytes() {
  int64_t limit = CgroupLimit("/sys/fs/cgroup/memory.max");
  if (limit == 0) limit = CgroupLimit("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  // A container limit above the machine's memory limits nothing: the machine's applies.
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (limit == 0 || limit > physical) limit = physical;
  return limit / 2;
}

}  // namespace attnserve
