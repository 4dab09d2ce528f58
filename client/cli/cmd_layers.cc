// attnserve-cli layers | layer NAME [--spectrum] [--plot FILE.svg] | load NAME SOURCE | unload NAME
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "client/cli/args.h"
#include "client/cli/commands.h"
#include "client/cli/spectrum_view.h"

namespace attnserve::cli {
namespace {

// Parses exactly `n` positional arguments (no flags) for `command`; false after a usage error.
bool Positionals(CommandContext& ctx, std::string_view command,
                 const std::vector<std::string>& args, const std::vector<std::string_view>& names,
                 std::vector<std::string>* out, int* exit_code) {
  FlagParser flags;
  bool help = false;
  std::string error;
  if (!flags.Parse(args, out, &help, &error)) {
    *exit_code = ctx.UsageError(command, error);
    return false;
  }
  if (out->size() < names.size()) {
    *exit_code = ctx.UsageError(command, "missing " + std::string(names[out->size()]));
    return false;
  }
  if (out->size() > names.size()) {
    *exit_code = ctx.UsageError(command, "unexpected argument '" + (*out)[names.size()] + "'");
    return false;
  }
  return true;
}

std::string Double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void PrintLayer(const v1::LayerInfo& info, std::ostream& out) {
  const v1::LayerConfig& c = info.config();
  out << "name: " << info.name() << "\n"
      << "source: " << info.source() << "\n"
      << "d_model: " << c.d_model() << "\n"
      << "heads: " << c.heads() << "\n"
      << "kv_heads: " << c.kv_heads() << "\n"
      << "d_head: " << c.d_head() << "\n"
      << "bias: " << (c.bias() ? "true" : "false") << "\n"
      << "scale: " << Double(c.scale()) << "\n"
      << "rope_theta: " << Double(c.rope_theta()) << "\n";
  for (const v1::FormInfo& f : info.forms()) {
    out << "form " << FormName(f.form()) << ": params=" << f.parameters() << " bytes=" << f.bytes()
        << " device=" << (f.device().empty() ? "-" : f.device())
        << " flops_per_token=" << Double(f.flops_per_token())
        << " flops_reference_length=" << f.flops_reference_length() << "\n";
  }
  out << LowRankSummary(info);
}

}  // namespace

int RunLayers(CommandContext& ctx, const std::vector<std::string>& args) {
  std::vector<std::string> pos;
  int code = 0;
  if (!Positionals(ctx, "layers", args, {}, &pos, &code)) return code;
  std::vector<v1::LayerInfo> layers;
  if (grpc::Status s = ctx.client().ListLayers(&layers); !s.ok()) return ctx.Fail(s);

  std::vector<std::vector<std::string>> rows = {
      {"NAME", "D_MODEL", "HEADS", "KV_HEADS", "D_HEAD", "BIAS", "FORMS"}};
  for (const v1::LayerInfo& l : layers) {
    const v1::LayerConfig& c = l.config();
    std::string forms;
    for (const v1::FormInfo& f : l.forms()) {
      if (!forms.empty()) forms += " ";
      forms += FormName(f.form()) + ":params=" + std::to_string(f.parameters()) +
               ",bytes=" + std::to_string(f.bytes()) +
               ",device=" + (f.device().empty() ? "-" : f.device());
    }
    rows.push_back({l.name(), std::to_string(c.d_model()), std::to_string(c.heads()),
                    std::to_string(c.kv_heads()), std::to_string(c.d_head()),
                    c.bias() ? "yes" : "no", forms.empty() ? "-" : forms});
  }
  // Columns padded to the widest cell; the last column is not padded.
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    ctx.out() << line << "\n";
  }
  return kExitOk;
}

int RunLayer(CommandContext& ctx, const std::vector<std::string>& args) {
  LayerArgs la;
  std::string error;
  if (!ParseLayerArgs(args, &la, &error)) return ctx.UsageError("layer", error);
  const bool want_spectrum = la.spectrum || !la.plot.empty();
  v1::LayerInfo info;
  if (grpc::Status s = ctx.client().GetLayer(la.name, &info, want_spectrum); !s.ok()) return ctx.Fail(s);
  PrintLayer(info, ctx.out());
  if (!want_spectrum) return kExitOk;
  if (!HasSpectrum(info)) {
    ctx.err() << "error: the server sent no spectra for layer '" << la.name
              << "' (loaded with spectrum=false, or a server that does not compute them)\n";
    return kExitFailure;
  }
  if (la.spectrum) ctx.out() << "\n" << SpectrumTable(info);
  if (!la.plot.empty()) {
    std::ofstream file(la.plot, std::ios::binary | std::ios::trunc);
    const std::string svg = SpectrumSvg(info);
    if (file) file.write(svg.data(), static_cast<std::streamsize>(svg.size()));
    if (file) file.close();
    if (!file) {
      ctx.err() << "error: --plot: cannot write '" << la.plot << "': " << std::strerror(errno) << "\n";
      return kExitFailure;
    }
    ctx.out() << "plot: " << la.plot << "\n";
  }
  return kExitOk;
}

int RunLoad(CommandContext& ctx, const std::vector<std::string>& args) {
  std::vector<std::string> pos;
  int code = 0;
  if (!Positionals(ctx, "load", args, {"NAME", "SOURCE"}, &pos, &code)) return code;
  v1::LayerInfo info;
  if (grpc::Status s = ctx.client().LoadLayer(pos[0], pos[1], &info); !s.ok()) {
    return ctx.Fail(s);
  }
  PrintLayer(info, ctx.out());
  return kExitOk;
}

int RunUnload(CommandContext& ctx, const std::vector<std::string>& args) {
  std::vector<std::string> pos;
  int code = 0;
  if (!Positionals(ctx, "unload", args, {"NAME"}, &pos, &code)) return code;
  if (grpc::Status s = ctx.client().UnloadLayer(pos[0]); !s.ok()) return ctx.Fail(s);
  ctx.out() << "unloaded: " << pos[0] << "\n";
  return kExitOk;
}

}  // namespace attnserve::cli
