#include "server/server_options.h"

#include "server/backend/select.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string_view>

#include "server/routing/router.h"     // ParseRouteSpec, kDefaultRoute
#include "server/store/layer_store.h"  // ValidateLayerName

namespace attnserve {
namespace {

constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};

Status CheckInt(const std::string& what, const std::string& text, int min, int max, int* out) {
  int v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || p != end || v < min || v > max) {
    return InvalidArgumentError(what + ": expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                                "], got '" + text + "'");
  }
  *out = v;
  return OkStatus();
}

Status CheckBool(const std::string& what, const std::string& text, bool* out) {
  if (text == "true" || text == "1" || text == "yes") {
    *out = true;
  } else if (text == "false" || text == "0" || text == "no") {
    *out = false;
  } else {
    return InvalidArgumentError(what + ": expected true or false, got '" + text + "'");
  }
  return OkStatus();
}

Status CheckLogLevel(const std::string& what, const std::string& level) {
  for (const char* l : kLogLevels) {
    if (level == l) return OkStatus();
  }
  return InvalidArgumentError(what + ": expected one of trace, debug, info, warn, error, critical, off, got '" + level +
                              "'");
}

Status CheckFraction(const std::string& what, const std::string& text, double* out) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || !(v >= 0 && v <= 1)) {
    return InvalidArgumentError(what + ": expected a fraction in [0, 1], got '" + text + "'");
  }
  *out = v;
  return OkStatus();
}

// A route LAYER → SPEC, checked where it is given so the error names the flag or key.
Status AddRoute(const std::string& what, std::vector<std::pair<std::string, std::string>>& routes,
                const std::string& layer, const std::string& spec) {
  if (layer != kDefaultRoute) {
    Status name = ValidateLayerName(layer);
    if (!name.ok()) return InvalidArgumentError(what + ": " + name.message());
  }
  StatusOr<RouteSplit> split = ParseRouteSpec(spec, what + " " + layer);
  if (!split.ok()) return split.status();
  for (auto& r : routes) {
    if (r.first == layer) {
      r.second = spec;
      return OkStatus();
    }
  }
  routes.emplace_back(layer, spec);
  return OkStatus();
}

void AddLayer(std::vector<std::pair<std::string, std::string>>& layers, std::pair<std::string, std::string> layer) {
  for (auto& l : layers) {
    if (l.first == layer.first) {
      l.second = std::move(layer.second);
      return;
    }
  }
  layers.push_back(std::move(layer));
}

// The batcher's integer settings: one row gives the flag, the YAML key and the range.
struct IntSetting {
  std::string_view flag, key;
  int min, max;
  int ServerOptions::*field;
};
constexpr IntSetting kBatchingSettings[] = {
    {"--max-batch-requests", "max_batch_requests", 1, 4096, &ServerOptions::max_batch_requests},
    {"--max-batch-tokens", "max_batch_tokens", 1, 1 << 24, &ServerOptions::max_batch_tokens},
    {"--max-queue-delay-us", "max_queue_delay_us", 0, 10000000, &ServerOptions::max_queue_delay_us},
    {"--max-queue-requests", "max_queue_requests", 1, 1000000, &ServerOptions::max_queue_requests},
    {"--drain-timeout-s", "drain_timeout_s", 0, 3600, &ServerOptions::drain_timeout_s},
};

const IntSetting* FindSetting(std::string_view name, bool by_flag) {
  for (const IntSetting& s : kBatchingSettings) {
    if ((by_flag ? s.flag : s.key) == name) return &s;
  }
  return nullptr;
}

// The limits every setting must respect, wherever it came from.
Status CheckRanges(const ServerOptions& o) {
  if (o.listen.empty()) return InvalidArgumentError("--listen: expected HOST:PORT, got an empty string");
  if (o.threads < 0 || o.threads > 1024) {
    return InvalidArgumentError("threads: expected [0, 1024], got " + std::to_string(o.threads));
  }
  if (o.workers < 1 || o.workers > 256) {
    return InvalidArgumentError("workers: expected [1, 256], got " + std::to_string(o.workers));
  }
  for (const IntSetting& setting : kBatchingSettings) {
    const int v = o.*setting.field;
    if (v < setting.min || v > setting.max) {
      return InvalidArgumentError(std::string(setting.key) + ": expected [" + std::to_string(setting.min) + ", " +
                                  std::to_string(setting.max) + "], got " + std::to_string(v));
    }
  }
  // gRPC takes the limit as an int of bytes.
  if (o.max_message_mb < 1 || o.max_message_mb > 2047) {
    return InvalidArgumentError("max_message_mb: expected [1, 2047], got " + std::to_string(o.max_message_mb));
  }
  if (o.metrics_listen.empty()) {
    return InvalidArgumentError("metrics_listen: expected HOST:PORT (e.g. 0.0.0.0:9464), got an empty string");
  }
  if (o.max_scores_mb < 1 || o.max_scores_mb > 1048576) {
    return InvalidArgumentError("max_scores_mb: expected [1, 1048576], got " + std::to_string(o.max_scores_mb));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckLogLevel("log_level", o.log_level));
  ATTNSERVE_RETURN_IF_ERROR(ValidateDevice(o.device));
  if (o.gpu_math != "fp32" && o.gpu_math != "tf32") {
    return InvalidArgumentError("gpu_math: expected fp32 or tf32, got '" + o.gpu_math + "'");
  }
  for (const auto& [name, source] : o.layers) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateLayerName(name));
  }
  return OkStatus();
}

}  // namespace

StatusOr<std::pair<std::string, std::string>> ParseLayerFlag(const std::string& value) {
  const size_t eq = value.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == value.size()) {
    return InvalidArgumentError("--layer: expected NAME=SOURCE (e.g. demo=random:d_model=64,heads=4), got '" + value +
                                "'");
  }
  return std::make_pair(value.substr(0, eq), value.substr(eq + 1));
}

Status ApplyYamlConfig(const std::string& yaml_text, const std::string& origin, ServerOptions* o) {
  try {
    const YAML::Node root = YAML::Load(yaml_text);
    if (root.IsNull()) return OkStatus();
    if (!root.IsMap()) return InvalidArgumentError(origin + ": expected a mapping of settings at the top level");
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const YAML::Node& v = kv.second;
      const std::string what = origin + ": " + key;
      if (key == "layers") {
        if (!v.IsMap()) return InvalidArgumentError(what + ": expected a mapping NAME: SOURCE");
        for (const auto& layer : v) {
          AddLayer(o->layers, {layer.first.as<std::string>(), layer.second.as<std::string>()});
        }
        continue;
      }
      if (key == "routes") {
        if (!v.IsMap()) return InvalidArgumentError(what + ": expected a mapping LAYER: FORM:WEIGHT,... (LAYER may be '*')");
        for (const auto& route : v) {
          ATTNSERVE_RETURN_IF_ERROR(
              AddRoute(what, o->routes, route.first.as<std::string>(), route.second.as<std::string>()));
        }
        continue;
      }
      if (!v.IsScalar()) return InvalidArgumentError(what + ": expected a single value");
      const std::string s = v.as<std::string>();
      if (key == "listen") {
        o->listen = s;
      } else if (key == "port_file") {
        o->port_file = s;
      } else if (key == "threads") {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, 0, 1024, &o->threads));
      } else if (key == "workers") {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, 1, 256, &o->workers));
      } else if (const IntSetting* setting = FindSetting(key, /*by_flag=*/false)) {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, setting->min, setting->max, &(o->*setting->field)));
      } else if (key == "max_message_mb") {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, 1, 2047, &o->max_message_mb));
      } else if (key == "max_scores_mb") {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, 1, 1048576, &o->max_scores_mb));
      } else if (key == "log_level") {
        ATTNSERVE_RETURN_IF_ERROR(CheckLogLevel(what, s));
        o->log_level = s;
      } else if (key == "log_json") {
        ATTNSERVE_RETURN_IF_ERROR(CheckBool(what, s, &o->log_json));
      } else if (key == "admin_token") {
        o->admin_token = s;
      } else if (key == "device") {
        o->device = s;
      } else if (key == "gpu_math") {
        o->gpu_math = s;
      } else if (key == "metrics_listen") {
        o->metrics_listen = s;
      } else if (key == "metrics_port_file") {
        o->metrics_port_file = s;
      } else if (key == "shadow_rate") {
        ATTNSERVE_RETURN_IF_ERROR(CheckFraction(what, s, &o->shadow_rate));
      } else if (key == "shadow_queue") {
        ATTNSERVE_RETURN_IF_ERROR(CheckInt(what, s, 1, 100000, &o->shadow_queue));
      } else {
        // A misspelt key silently ignored would leave a setting at its default.
        return InvalidArgumentError(what +
                                    ": unknown key (expected listen, port_file, layers, threads, workers, "
                                    "max_batch_requests, max_batch_tokens, max_queue_delay_us, max_queue_requests, "
                                    "drain_timeout_s, max_message_mb, max_scores_mb, log_level, log_json, "
                                    "admin_token, metrics_listen, metrics_port_file, routes, shadow_rate, "
                                    "shadow_queue, device, gpu_math)");
      }
    }
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(origin + ": not valid YAML: " + e.what());
  }
  return OkStatus();
}

StatusOr<ServerOptions> ParseServerOptions(int argc, const char* const* argv) {
  struct Flag {
    std::string name, value;
    bool has_value;
  };
  std::vector<Flag> flags;
  static const std::string_view kBoolFlags[] = {"--help", "-h", "--version", "--log-json"};
  static const std::string_view kValueFlags[] = {
      "--listen",         "--port-file",     "--layer",     "--threads",     "--workers",
      "--max-message-mb", "--max-scores-mb", "--log-level", "--admin-token", "--config",
      "--metrics-listen", "--metrics-port-file", "--route", "--shadow-rate", "--shadow-queue",
      "--device", "--gpu-math"};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    Flag f;
    const size_t eq = arg.find('=');
    f.name = arg.substr(0, eq);
    f.has_value = eq != std::string::npos;
    if (f.has_value) f.value = arg.substr(eq + 1);
    bool is_bool = false, is_value = false;
    for (auto b : kBoolFlags) is_bool = is_bool || f.name == b;
    for (auto v : kValueFlags) is_value = is_value || f.name == v;
    is_value = is_value || FindSetting(f.name, /*by_flag=*/true) != nullptr;
    if (!is_bool && !is_value) return InvalidArgumentError("unknown flag '" + arg + "' (see --help)");
    if (is_value && !f.has_value) {
      if (i + 1 >= argc) return InvalidArgumentError(f.name + ": expected a value after it");
      f.value = argv[++i];
      f.has_value = true;
    }
    flags.push_back(std::move(f));
  }

  ServerOptions o;
  if (const char* token = std::getenv("ATTNSERVE_ADMIN_TOKEN")) o.admin_token = token;
  for (const Flag& f : flags) {
    if (f.name != "--config") continue;
    o.config_file = f.value;
    std::ifstream in(f.value);
    if (!in) return InvalidArgumentError("--config: cannot read '" + f.value + "'");
    std::stringstream text;
    text << in.rdbuf();
    ATTNSERVE_RETURN_IF_ERROR(ApplyYamlConfig(text.str(), f.value, &o));
  }
  for (const Flag& f : flags) {
    const std::string& v = f.value;
    if (f.name == "--help" || f.name == "-h") {
      o.help = true;
    } else if (f.name == "--version") {
      o.version = true;
    } else if (f.name == "--log-json") {
      if (f.has_value) {
        ATTNSERVE_RETURN_IF_ERROR(CheckBool("--log-json", v, &o.log_json));
      } else {
        o.log_json = true;
      }
    } else if (f.name == "--listen") {
      o.listen = v;
    } else if (f.name == "--port-file") {
      o.port_file = v;
    } else if (f.name == "--layer") {
      StatusOr<std::pair<std::string, std::string>> layer = ParseLayerFlag(v);
      if (!layer.ok()) return layer.status();
      AddLayer(o.layers, std::move(layer).value());
    } else if (f.name == "--threads") {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt("--threads", v, 0, 1024, &o.threads));
    } else if (f.name == "--workers") {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt("--workers", v, 1, 256, &o.workers));
    } else if (const IntSetting* setting = FindSetting(f.name, /*by_flag=*/true)) {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt(f.name, v, setting->min, setting->max, &(o.*setting->field)));
    } else if (f.name == "--max-message-mb") {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt("--max-message-mb", v, 1, 2047, &o.max_message_mb));
    } else if (f.name == "--max-scores-mb") {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt("--max-scores-mb", v, 1, 1048576, &o.max_scores_mb));
    } else if (f.name == "--log-level") {
      ATTNSERVE_RETURN_IF_ERROR(CheckLogLevel("--log-level", v));
      o.log_level = v;
    } else if (f.name == "--admin-token") {
      o.admin_token = v;
    } else if (f.name == "--device") {
      o.device = v;
    } else if (f.name == "--gpu-math") {
      o.gpu_math = v;
    } else if (f.name == "--metrics-listen") {
      o.metrics_listen = v;
    } else if (f.name == "--metrics-port-file") {
      o.metrics_port_file = v;
    } else if (f.name == "--route") {
      const size_t eq = v.find('=');
      if (eq == std::string::npos || eq == 0) {
        return InvalidArgumentError("--route: expected LAYER=FORM:WEIGHT,... (LAYER may be '*'), e.g. "
                                    "'*=factored:90,summed:10', got '" + v + "'");
      }
      ATTNSERVE_RETURN_IF_ERROR(AddRoute("--route", o.routes, v.substr(0, eq), v.substr(eq + 1)));
    } else if (f.name == "--shadow-rate") {
      ATTNSERVE_RETURN_IF_ERROR(CheckFraction("--shadow-rate", v, &o.shadow_rate));
    } else if (f.name == "--shadow-queue") {
      ATTNSERVE_RETURN_IF_ERROR(CheckInt("--shadow-queue", v, 1, 100000, &o.shadow_queue));
    }
  }
  if (o.help || o.version) return o;
  ATTNSERVE_RETURN_IF_ERROR(CheckRanges(o));
  if (o.layers.empty()) o.layers.emplace_back(kDemoLayerName, kDemoLayerSource);
  return o;
}

std::string UsageText() {
  return std::string(
             "Usage: attnserve [flags]\n"
             "Serves multi-head attention layers over gRPC (attnserve.v1.AttentionService, grpc.health.v1,\n"
             "server reflection). Flags override the --config file; see docs/service.md.\n"
             "\n"
             "  --listen ADDR          address to listen on (default 0.0.0.0:50051); port 0 picks a free\n"
             "                         port, printed as 'listening on HOST:PORT'\n"
             "  --port-file FILE       also write the bound port to FILE once listening\n"
             "  --layer NAME=SOURCE    load a layer at start-up (repeatable); SOURCE is random:... or\n"
             "                         safetensors:... (docs/sources.md). Without any layer the server\n"
             "                         serves '") +
         kDemoLayerName + "' = " + kDemoLayerSource +
         "\n"
         "  --device DEV           auto, cpu, cuda or cuda:N (default auto: a usable GPU when there is\n"
         "                         one, else the CPU); an explicit cuda without a usable GPU refuses to start\n"
         "  --gpu-math MODE        fp32 (default) or tf32 (TF32 tensor-core GEMMs on the GPU)\n"
         "  --threads N            CPU backend threads per Forward (default 0 = every core)\n"
         "  --workers N            batches computed side by side (default 1)\n"
         "  --max-batch-requests N requests in one batch at most (default 32; 1 = no batching)\n"
         "  --max-batch-tokens N   query + context rows in one batch at most (default 8192)\n"
         "  --max-queue-delay-us N how long the oldest queued request waits for others (default 0:\n"
         "                         take what queued while the device was busy, never wait)\n"
         "  --max-queue-requests N requests waiting per (layer, form) queue; beyond: RESOURCE_EXHAUSTED\n"
         "                         at once (default 256)\n"
         "  --drain-timeout-s N    on SIGTERM/SIGINT: NOT_SERVING, refuse new calls, give accepted ones\n"
         "                         N seconds to finish, then exit 0 (default 30)\n"
         "  --max-message-mb N     largest request and response in MiB (default 64)\n"
         "  --max-scores-mb N      largest attention scores one sequence may need, n*m*heads*4 bytes,\n"
         "                         in MiB (default 2048); beyond: RESOURCE_EXHAUSTED\n"
         "  --log-level LEVEL      trace, debug, info, warn, error, critical or off (default info)\n"
         "  --log-json             log one JSON object per line\n"
         "  --admin-token TOKEN    require 'authorization: Bearer TOKEN' on LoadLayer, UnloadLayer and\n"
         "                         SetRouting (or set ATTNSERVE_ADMIN_TOKEN, which keeps it out of ps)\n"
         "  --metrics-listen ADDR  serve Prometheus metrics at http://ADDR/metrics (default 0.0.0.0:9464);\n"
         "                         port 0 picks a free port (docs/metrics.md)\n"
         "  --metrics-port-file FILE  also write the metrics port to FILE once listening\n"
         "  --route LAYER=SPEC     split requests to LAYER that leave the form unspecified, SPEC =\n"
         "                         FORM:WEIGHT,... e.g. factored:90,summed:10; LAYER '*' = every layer\n"
         "                         without its own route (repeatable; default *=factored:100)\n"
         "  --shadow-rate R        also run this fraction of requests by another held form, off the\n"
         "                         request path, and record the divergence (default 0)\n"
         "  --shadow-queue N       shadow runs waiting at most; beyond: dropped and counted (default 16)\n"
         "  --config FILE          YAML file with the same settings: listen, port_file, layers\n"
         "                         {NAME: SOURCE}, threads, workers, max_batch_requests,\n"
         "                         max_batch_tokens, max_queue_delay_us, max_queue_requests,\n"
         "                         drain_timeout_s, max_message_mb, max_scores_mb, log_level, log_json,\n"
         "                         admin_token, metrics_listen, metrics_port_file, routes {LAYER: SPEC},\n"
         "                         shadow_rate, shadow_queue, device, gpu_math\n"
         "  --help, -h             print this help and exit\n"
         "  --version              print the version and exit\n"
         "\n"
         "Exit status: 0 after a clean shutdown on SIGTERM or SIGINT; 1 when start-up fails (bad layer,\n"
         "address in use); 2 for bad flags or configuration.\n";
}

}  // namespace attnserve
