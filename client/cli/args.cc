#include "client/cli/args.h"

#include <cctype>
#include <charconv>
#include <climits>
#include <limits>
#include <string>
#include <utility>

namespace attnserve::cli {
namespace {

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

}  // namespace

void FlagParser::AddString(std::string name, std::string* dst, std::string metavar,
                           std::string help) {
  flags_.push_back({std::move(name), dst, nullptr, std::move(metavar), std::move(help)});
}

void FlagParser::AddBool(std::string name, bool* dst, std::string help) {
  flags_.push_back({std::move(name), nullptr, dst, "", std::move(help)});
}

const FlagParser::Flag* FlagParser::Find(std::string_view name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagParser::TakesSeparateValue(std::string_view arg) const {
  if (!arg.starts_with("--") || arg.find('=') != std::string_view::npos) return false;
  const Flag* f = Find(arg.substr(2));
  return f != nullptr && f->str != nullptr;
}

bool FlagParser::Seen(std::string_view name) const {
  for (const std::string& s : seen_) {
    if (s == name) return true;
  }
  return false;
}

bool FlagParser::Parse(const std::vector<std::string>& args, std::vector<std::string>* positionals,
                       bool* help, std::string* error) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      positionals->insert(positionals->end(), args.begin() + static_cast<long>(i) + 1, args.end());
      return true;
    }
    if (a == "-h" || a == "--help") {
      *help = true;
      continue;
    }
    // A lone "-" or a negative number is a positional, not a flag.
    if (a.size() < 3 || a[0] != '-' || a[1] != '-') {
      if (a.size() >= 2 && a[0] == '-' && !(a[1] >= '0' && a[1] <= '9')) {
        *error = "unknown flag " + Quote(a);
        return false;
      }
      positionals->push_back(a);
      continue;
    }
    std::string_view body = std::string_view(a).substr(2);
    std::optional<std::string> inline_value;
    if (size_t eq = body.find('='); eq != std::string_view::npos) {
      inline_value = std::string(body.substr(eq + 1));
      body = body.substr(0, eq);
    }
    const Flag* f = Find(body);
    if (f == nullptr) {
      *error = "unknown flag " + Quote("--" + std::string(body));
      return false;
    }
    seen_.push_back(f->name);
    if (f->boolean != nullptr) {
      if (inline_value) {
        *error = "--" + f->name + " takes no value, got " + Quote(*inline_value);
        return false;
      }
      *f->boolean = true;
      continue;
    }
    if (inline_value) {
      *f->str = *inline_value;
    } else if (i + 1 < args.size()) {
      *f->str = args[++i];
    } else {
      *error = "--" + f->name + " needs a value (" + f->metavar + ")";
      return false;
    }
    // An empty value is always a slip (an unset shell variable), never a meaningful setting.
    if (f->str->empty()) {
      *error = "--" + f->name + ": expected " + f->metavar + ", got ''";
      return false;
    }
  }
  return true;
}

std::string FlagParser::Describe() const {
  std::string out;
  for (const Flag& f : flags_) {
    std::string left = "  --" + f.name + (f.metavar.empty() ? "" : " " + f.metavar);
    if (left.size() < 28)
      left.resize(28, ' ');
    else
      left += "  ";
    out += left + f.help + "\n";
  }
  return out;
}

bool ParseInt64(std::string_view text, std::string_view what, int64_t* out, std::string* error) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size()) {
    *error = std::string(what) + ": expected an integer, got " + Quote(text);
    return false;
  }
  *out = v;
  return true;
}

bool ParseUint64(std::string_view text, std::string_view what, uint64_t* out, std::string* error) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size()) {
    *error = std::string(what) + ": expected an unsigned integer, got " + Quote(text);
    return false;
  }
  *out = v;
  return true;
}

bool ParseIntList(std::string_view text, std::string_view what, int64_t min_value,
                  std::vector<int64_t>* out, std::string* error) {
  out->clear();
  if (text.empty()) {
    *error = std::string(what) + ": expected a comma-separated list of integers, got ''";
    return false;
  }
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    int64_t v = 0;
    if (!ParseInt64(item, what, &v, error)) {
      *error = std::string(what) + ": expected a comma-separated list of integers, got " +
               Quote(text) + " (bad item " + Quote(item) + ")";
      return false;
    }
    if (v < min_value) {
      *error = std::string(what) + ": expected values >= " + std::to_string(min_value) + ", got " +
               std::to_string(v);
      return false;
    }
    out->push_back(v);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return true;
}

// A form's short name is its attnserve.v1.Form name without "FORM_", in lower case: the proto's
// enum is the client's table of forms, so a form the server adds is known here by rebuilding.
std::string FormName(v1::Form form) {
  if (!v1::Form_IsValid(form)) return "form_" + std::to_string(static_cast<int>(form));
  std::string name = v1::Form_Name(form).substr(std::string_view("FORM_").size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::vector<v1::Form> KnownForms() {
  std::vector<v1::Form> forms;
  const google::protobuf::EnumDescriptor* descriptor = v1::Form_descriptor();
  for (int i = 0; i < descriptor->value_count(); ++i) {
    const auto form = static_cast<v1::Form>(descriptor->value(i)->number());
    if (form != v1::FORM_UNSPECIFIED) forms.push_back(form);
  }
  return forms;
}

bool ParseForm(std::string_view text, v1::Form* out, std::string* error) {
  std::string expected;
  for (v1::Form form : KnownForms()) {
    if (text == FormName(form)) {
      *out = form;
      return true;
    }
    expected += FormName(form) + ", ";
  }
  expected.resize(expected.size() - 2);
  if (text == "routed") {
    *out = v1::FORM_UNSPECIFIED;
    return true;
  }
  *error = "--form: expected " + expected + " or routed, got " + Quote(text);
  return false;
}

bool ParseGlobalArgs(const std::vector<std::string>& args, const GlobalEnv& env, GlobalArgs* out,
                     std::string* error) {
  *out = GlobalArgs();
  if (env.target != nullptr && *env.target != '\0') out->client.target = env.target;
  if (env.admin_token != nullptr) out->client.admin_token = env.admin_token;
  std::string target, timeout_ms, max_mb, lb, token, tls_ca, tls_cert, tls_key, server_name;
  FlagParser flags;
  flags.AddString("target", &target, "ADDR", "");
  flags.AddString("timeout-ms", &timeout_ms, "MS", "");
  flags.AddString("max-message-mb", &max_mb, "MB", "");
  flags.AddString("load-balancing", &lb, "POLICY", "");
  flags.AddString("admin-token", &token, "TOKEN", "");
  flags.AddString("tls-ca", &tls_ca, "FILE", "");
  flags.AddString("tls-cert", &tls_cert, "FILE", "");
  flags.AddString("tls-key", &tls_key, "FILE", "");
  flags.AddString("server-name", &server_name, "NAME", "");
  flags.AddBool("version", &out->version, "");
  // Global flags end at the first positional (the subcommand); the rest belong to it.
  size_t i = 0;
  std::vector<std::string> globals;
  while (i < args.size()) {
    const std::string& a = args[i];
    if (a.empty() || a[0] != '-') break;
    globals.push_back(a);
    if (flags.TakesSeparateValue(a) && i + 1 < args.size()) globals.push_back(args[++i]);
    ++i;
  }
  std::vector<std::string> positionals;
  if (!flags.Parse(globals, &positionals, &out->help, error)) return false;
  if (flags.Seen("target")) out->client.target = target;
  if (flags.Seen("timeout-ms")) {
    int64_t v = 0;
    if (!ParseInt64(timeout_ms, "--timeout-ms", &v, error)) return false;
    if (v <= 0) {
      *error = "--timeout-ms: expected a positive number of milliseconds, got " + timeout_ms;
      return false;
    }
    out->client.timeout = std::chrono::milliseconds(v);
  }
  if (flags.Seen("max-message-mb")) {
    int64_t v = 0;
    if (!ParseInt64(max_mb, "--max-message-mb", &v, error)) return false;
    if (v <= 0 || v > 2047) {
      *error = "--max-message-mb: expected 1..2047, got " + max_mb;
      return false;
    }
    out->client.max_message_mb = static_cast<int>(v);
  }
  out->client.load_balancing = lb;
  if (flags.Seen("admin-token")) out->client.admin_token = token;
  if (tls_cert.empty() != tls_key.empty()) {
    *error = "--tls-cert and --tls-key: expected both or neither, got only " +
             std::string(tls_cert.empty() ? "--tls-key" : "--tls-cert");
    return false;
  }
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--tls-ca", tls_ca},
                                   {"--tls-cert", tls_cert}, {"--tls-key", tls_key}}) {
    if (!path.empty() && ReadPemFile(flag, path, error).empty()) return false;
  }
  if (!server_name.empty() && tls_ca.empty() && tls_cert.empty()) {
    *error = "--server-name: only with TLS (--tls-ca)";
    return false;
  }
  out->client.tls_ca = tls_ca;
  out->client.tls_cert = tls_cert;
  out->client.tls_key = tls_key;
  out->client.server_name = server_name;
  if (i < args.size()) {
    out->command = args[i];
    out->command_args.assign(args.begin() + static_cast<long>(i) + 1, args.end());
  }
  return true;
}

std::string GlobalFlagsHelp() {
  return "  --target ADDR             server address (default $ATTNSERVE_TARGET, else\n"
         "                            localhost:50051); any gRPC target: host:port,\n"
         "                            dns:///host:port, ipv4:a:p,b:q\n"
         "  --timeout-ms MS           deadline of each call (default 30000)\n"
         "  --max-message-mb MB       largest message sent or received (default 64)\n"
         "  --load-balancing POLICY   gRPC policy, e.g. round_robin (default pick_first)\n"
         "  --admin-token TOKEN       sent on load, unload and route changes (default\n"
         "                            $ATTNSERVE_ADMIN_TOKEN, which keeps it out of ps)\n"
         "  --tls-ca FILE             speak TLS, trusting this CA (PEM)\n"
         "  --tls-cert FILE           client certificate for mTLS (PEM; with --tls-key)\n"
         "  --tls-key FILE            its private key (PEM)\n"
         "  --server-name NAME        the name the server's certificate must carry, when\n"
         "                            the target's host is not it (an IP address)\n"
         "  --version                 print the client's version and exit\n"
         "  -h, --help                this help\n";
}

namespace {

void AddForwardFlags(FlagParser* f, ForwardArgs* a, std::string* form, std::string* random,
                     std::string* key_lengths, std::string* seed) {
  f->AddString("layer", &a->layer, "L", "layer to run (required)");
  std::string forms;
  for (v1::Form known : KnownForms()) forms += FormName(known) + " | ";
  f->AddString("form", form, "F", forms + "routed (default: the server's routes decide; auto: its cost model)");
  f->AddString("input", &a->input, "X.npy", "input [batch, n, d_model] float32");
  f->AddString("random", random, "B,N[,M]",
               "random normal input [B, N, d_model] (and context [B, M, d_model])");
  f->AddString("context", &a->context, "C.npy", "context [batch, m, d_model] (cross-attention)");
  f->AddBool("causal", &a->causal, "query q sees keys j <= q");
  f->AddString("key-lengths", key_lengths, "L1,L2,..", "visible keys per batch row");
  f->AddString("output", &a->output, "Y.npy", "write the output here");
  f->AddBool("compare", &a->compare, "also run the other held forms, print divergence");
  f->AddString("seed", seed, "S", "seed of --random (default 1)");
  f->AddString("request-key", &a->request_key, "K", "sticky-routing key");
  f->AddString("math", &a->math, "M", "the math to run in, one the layer is held in (e.g. bf16; the server names its maths when it refuses one)");
}

}  // namespace

bool ParseForwardArgs(const std::vector<std::string>& args, ForwardArgs* out, std::string* error) {
  *out = ForwardArgs();
  std::string form, random, key_lengths, seed;
  FlagParser flags;
  AddForwardFlags(&flags, out, &form, &random, &key_lengths, &seed);
  std::vector<std::string> positionals;
  if (!flags.Parse(args, &positionals, &out->help, error)) return false;
  if (out->help) return true;
  if (!positionals.empty()) {
    *error = "unexpected argument '" + positionals[0] + "'";
    return false;
  }
  if (out->layer.empty()) {
    *error = "--layer is required";
    return false;
  }
  if (!form.empty() && !ParseForm(form, &out->form, error)) return false;
  if (out->input.empty() == random.empty()) {
    *error = out->input.empty() ? "one of --input or --random is required"
                                : "--input and --random exclude each other";
    return false;
  }
  if (!random.empty()) {
    if (!ParseIntList(random, "--random", 1, &out->random, error)) return false;
    if (out->random.size() != 2 && out->random.size() != 3) {
      *error = "--random: expected B,N or B,N,M, got '" + random + "'";
      return false;
    }
    if (out->random.size() == 3 && !out->context.empty()) {
      *error = "--context and a random context (--random B,N,M) exclude each other";
      return false;
    }
  }
  if (!key_lengths.empty()) {
    std::vector<int64_t> v;
    if (!ParseIntList(key_lengths, "--key-lengths", 0, &v, error)) return false;
    for (int64_t x : v) {
      if (x > INT32_MAX) {
        *error = "--key-lengths: expected values <= " + std::to_string(INT32_MAX) + ", got " +
                 std::to_string(x);
        return false;
      }
      out->key_lengths.push_back(static_cast<int32_t>(x));
    }
  }
  if (!seed.empty() && !ParseUint64(seed, "--seed", &out->seed, error)) return false;
  return true;
}

std::string ForwardFlagsHelp() {
  ForwardArgs a;
  std::string form, random, key_lengths, seed;
  FlagParser flags;
  AddForwardFlags(&flags, &a, &form, &random, &key_lengths, &seed);
  return flags.Describe();
}

namespace {

void AddLayerFlags(FlagParser* flags, LayerArgs* out) {
  flags->AddBool("spectrum", &out->spectrum,
                 "also print each head's OV and QK spectrum: sigma1, Frobenius norm, stable and effective "
                 "rank, and the ranks keeping 90/99/99.9 % of the energy");
  flags->AddString("plot", &out->plot, "FILE.svg",
                   "also write the spectra as an SVG plot (one curve per head, log scale)");
}

}  // namespace

bool ParseLayerArgs(const std::vector<std::string>& args, LayerArgs* out, std::string* error) {
  *out = LayerArgs();
  FlagParser flags;
  AddLayerFlags(&flags, out);
  std::vector<std::string> positionals;
  if (!flags.Parse(args, &positionals, &out->help, error)) return false;
  if (out->help) return true;
  if (flags.Seen("plot") && out->plot.empty()) {
    *error = "--plot: expected a file name, got ''";
    return false;
  }
  if (positionals.empty()) {
    *error = "missing NAME";
    return false;
  }
  if (positionals.size() > 1) {
    *error = "unexpected argument '" + positionals[1] + "'";
    return false;
  }
  out->name = positionals[0];
  return true;
}

std::string LayerFlagsHelp() {
  LayerArgs unused;
  FlagParser flags;
  AddLayerFlags(&flags, &unused);
  return flags.Describe();
}

}  // namespace attnserve::cli
