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

// Bumped whenever this table, or anything passed through it, changes shape. 4: the backend's
// options cross as key=value data (AttnserveOptions) instead of positional arguments. 5: the
// Backend interface gained Warmup, DeviceMemory, PciBusId, ThisThreadsDeviceTimes and
// summed_order. 6: Backend gained default_math and UploadIn, ResidentForm math (served variants).
#define ATTNSERVE_PLUGIN_ABI_VERSION 6u

// The layout of AttnserveOptions; the plugin refuses another (and a struct of another size).
#define ATTNSERVE_PLUGIN_OPTIONS_VERSION 1u

// This build's identity (the project version, commit and compiler, set by CMake); a plugin
// reports the id of the build that made it.
#ifndef ATTNSERVE_BUILD_ID
#define ATTNSERVE_BUILD_ID "unknown"
#endif

extern "C" {

// One option: a key of the backend's options table (server/backend/cuda_options.h) and its value
// as text. Both NUL-terminated, owned by the caller for the duration of the call.
struct AttnserveOption {
  const char* key;
  const char* value;
};

// The backend's options as data: a new option is a new key, not a new parameter. The plugin
// refuses a struct of another size or version, an unknown key or a value it cannot take, with
// an error naming the option, what it expects and what it got; keys left out keep its defaults.
struct AttnserveOptions {
  uint32_t struct_size;  // sizeof(AttnserveOptions) in the caller's build
  uint32_t version;      // ATTNSERVE_PLUGIN_OPTIONS_VERSION of the caller's build
  const AttnserveOption* options;
  size_t count;
};

struct AttnservePluginApi {
  uint32_t abi_version;  // ATTNSERVE_PLUGIN_ABI_VERSION of the plugin's build
  const char* build_id;  // ATTNSERVE_BUILD_ID of the plugin's build
  // Usable devices; 0 with the reason in `why`.
  int (*device_count)(char* why, size_t why_size);
  // A new backend the caller owns, or nullptr with the reason in `error` (a refused option
  // among them).
  attnserve::Backend* (*make_backend)(const AttnserveOptions* options, char* error, size_t error_size);
};

// The one symbol a plugin exports.
const AttnservePluginApi* AttnserveBackendPlugin();
using AttnserveBackendPluginFn = const AttnservePluginApi* (*)();
}
