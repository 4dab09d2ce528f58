// A backend plugin that makes no backend: its make_backend answers with the options it was given,
// raw ("echo: struct_size=N version=V key=value ..."), as its error, so that plugin_abi_test sees
// exactly what the server sends across the boundary. (How the CUDA plugin reads them is
// cuda_options_test's.)
#include <cstdio>
#include <string>

#include "server/backend/plugin_abi.h"

namespace {

int DeviceCount(char*, size_t) { return 1; }

attnserve::Backend* MakeBackend(const AttnserveOptions* options, char* error, size_t error_size) {
  std::string echo = "echo:";
  if (options != nullptr) {
    echo += " struct_size=" + std::to_string(options->struct_size) + " version=" + std::to_string(options->version);
    for (size_t n = 0; n < options->count; ++n) {
      echo += std::string(" ") + options->options[n].key + "=" + options->options[n].value;
    }
  }
  std::snprintf(error, error_size, "%s", echo.c_str());
  return nullptr;
}

const AttnservePluginApi kApi = {ATTNSERVE_PLUGIN_ABI_VERSION, ATTNSERVE_BUILD_ID, &DeviceCount, &MakeBackend};

}  // namespace

extern "C" const AttnservePluginApi* AttnserveBackendPlugin() { return &kApi; }
