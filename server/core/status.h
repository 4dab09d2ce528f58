// Status and StatusOr: how errors cross component boundaries in attnserve.
//
// The core cannot depend on abseil (the core-only build runs where only a compiler, Eigen and
// GoogleTest exist), so it carries this small equivalent. Codes have the numeric values of
// gRPC's canonical codes, so the service converts them with a cast.
// Thread-safety: plain values; copy freely.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace attnserve {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// The gRPC name of a code ("INVALID_ARGUMENT"), as metrics and logs show it.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }

// A caller-supplied string as an error message or log line may show it: quoted, at most
// `max_bytes` of it (the rest counted, not shown), every byte outside printable ASCII, the
// quote and the backslash escaped as \xNN, so that no message carries a newline, a terminal
// escape or invalid UTF-8 from the network.
std::string QuoteUntrusted(std::string_view text, size_t max_bytes = 128);
inline Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status PermissionDeniedError(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status UnauthenticatedError(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
inline Status FailedPreconditionError(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status AlreadyExistsError(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }

// A value or the Status saying why there is none. Never holds an OK status without a value.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  StatusOr(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).ok() && "StatusOr built from an OK status");
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "StatusOr built from OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? OkStatus() : std::get<Status>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace attnserve

// Returns early with the status when it is not OK.
#define ATTNSERVE_RETURN_IF_ERROR(expr)            \
  do {                                             \
    ::attnserve::Status _st = (expr);              \
    if (!_st.ok()) return _st;                     \
  } while (0)

// `ATTNSERVE_ASSIGN_OR_RETURN(const T x, StatusOrExpr);` declares x from the value, or returns
// the error from the enclosing function.
#define ATTNSERVE_STATUS_CONCAT_INNER(a, b) a##b
#define ATTNSERVE_STATUS_CONCAT(a, b) ATTNSERVE_STATUS_CONCAT_INNER(a, b)
#define ATTNSERVE_ASSIGN_OR_RETURN(decl, expr) \
  ATTNSERVE_ASSIGN_OR_RETURN_IMPL(ATTNSERVE_STATUS_CONCAT(_status_or_, __LINE__), decl, expr)
#define ATTNSERVE_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return tmp.status();                    \
  decl = std::move(tmp).value()
