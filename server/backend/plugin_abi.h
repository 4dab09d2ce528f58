// The C boundary between the server and a backend plugin (the CUDA backend,
// libattnserve_cuda.so): one exported symbol returning a versioned table, after Triton's backend
// API. What crosses it is C++ (an attnserve::Backend*, FormWeights, Sequence), so a plugin is
// only safe with the server of its own build: the loader checks the ABI version and the build id
// before calling anything else, and refuses a mismatch with a message that says which
// (server/backend/select.cc).
// Thread-safety: the table is immutable; its functions are the backend's own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnserve {
class Backend;
}

// Bumped whenever this table, or anything passed through it, changes shape.
#define ATTNSERVE_PLUGIN_ABI_VERSION 3u

// This build's identity (the project version, commit and compiler, set by CMake); a plugin
// reports the id of the build that made it.
#ifndef ATTNSERVE_BUILD_ID
#define ATTNSERVE_BUILD_ID "unknown"
#endif

extern "C" {

struct AttnservePluginApi {
  uint32_t abi_version;  // ATTNSERVE_PLUGIN_ABI_VERSION of the plugin's build
  const char* build_id;  // ATTNSERVE_BUILD_ID of the plugin's build
  // Usable devices; 0 with the reason in `why`.
  int (*device_count)(char* why, size_t why_size);
  // A new backend the caller owns, or nullptr with the reason in `error`. max_device_bytes:
  // the device memory it may hold (0: its default share of the device).
  attnserve::Backend* (*make_backend)(int device, bool tf32, int64_t max_device_bytes, char* error,
                                      size_t error_size);
};

// The one symbol a plugin exports.
const AttnservePluginApi* AttnserveBackendPlugin();
using AttnserveBackendPluginFn = const AttnservePluginApi* (*)();
}
