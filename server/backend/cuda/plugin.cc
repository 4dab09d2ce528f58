// The CUDA backend as a plugin the server loads with dlopen only when it wants a GPU.
// cuBLAS carries a large static TLS block; linked into the server it would be in every thread,
// and thread pools that set small stacks (civetweb's, behind /metrics) then fail to start
// threads at all. Loaded with dlopen, its TLS is allocated per thread on demand instead.
#include <cstring>
#include <string>

#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda_options.h"
#include "server/backend/plugin_abi.h"

namespace {
void CopyMessage(const std::string& message, char* out, size_t size) {
  if (out == nullptr || size == 0) return;
  std::strncpy(out, message.c_str(), size - 1);
  out[size - 1] = '\0';
}
}  // namespace

namespace {

// Usable devices; 0 with the reason in `why`.
int DeviceCount(char* why, size_t why_size) {
  std::string reason;
  const int count = attnserve::CudaDeviceCount(&reason);
  CopyMessage(reason, why, why_size);
  return count;
}

// A new CUDA backend the caller owns, or nullptr with the reason in `error`: a refused option
// (cuda_options.h names it) or a device that cannot be used.
attnserve::Backend* MakeBackend(const AttnserveOptions* options, char* error, size_t error_size) {
  auto decoded = attnserve::DecodeCudaOptions(options);
  if (!decoded.ok()) {
    CopyMessage(decoded.status().message(), error, error_size);
    return nullptr;
  }
  auto backend = attnserve::MakeCudaBackend(*decoded);
  if (!backend.ok()) {
    CopyMessage(backend.status().message(), error, error_size);
    return nullptr;
  }
  return std::move(backend).value().release();
}

// Tests build plugins that lie about these, to see them refused.
#ifndef ATTNSERVE_PLUGIN_ABI_VERSION_REPORTED
#define ATTNSERVE_PLUGIN_ABI_VERSION_REPORTED ATTNSERVE_PLUGIN_ABI_VERSION
#endif
#ifndef ATTNSERVE_PLUGIN_BUILD_ID_REPORTED
#define ATTNSERVE_PLUGIN_BUILD_ID_REPORTED ATTNSERVE_BUILD_ID
#endif

const AttnservePluginApi kApi = {ATTNSERVE_PLUGIN_ABI_VERSION_REPORTED, ATTNSERVE_PLUGIN_BUILD_ID_REPORTED,
                                 &DeviceCount, &MakeBackend};

}  // namespace

extern "C" const AttnservePluginApi* AttnserveBackendPlugin() { return &kApi; }
