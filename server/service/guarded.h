// Runs `body` and turns anything it throws into INTERNAL (or RESOURCE_EXHAUSTED for memory):
// no exception crosses the service boundary. For the services and the call path.
// Thread-safety: a pure function of `body`.
#pragma once

#include <spdlog/spdlog.h>

#include <exception>
#include <new>
#include <string>

#include "server/core/status.h"

namespace attnserve {

template <typename Body>
Status Guarded(const char* what, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    spdlog::error("{}: unexpected exception: {}", what, e.what());
    return InternalError(std::string(what) + ": " + e.what());
  } catch (...) {
    spdlog::error("{}: unexpected exception", what);
    return InternalError(std::string(what) + ": unexpected exception");
  }
}

}  // namespace attnserve
