// libFuzzer target: bytes → ApplyYamlConfig (server/server_options.h), the server's --config
// YAML (keys: docs/service.md), onto default options, and → ParseRoutesFile
// (server/routing/routes_file.h), the --routes-file grammar. Nothing may crash or escape as an
// exception: every bad document must come back as a Status.
#include <cstdint>
#include <string>

#include "server/routing/routes_file.h"
#include "server/server_options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  attnserve::ServerOptions options;
  (void)attnserve::ApplyYamlConfig(text, "fuzz.yaml", &options);
  (void)attnserve::ParseRoutesFile(text, "fuzz.yaml");
  return 0;
}
