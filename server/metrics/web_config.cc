#include "server/metrics/web_config.h"

#include <crypt.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <iterator>

namespace attnserve {
namespace {

StatusOr<std::string> ReadPem(const std::string& key, const std::filesystem::path& base, const std::string& file) {
  const std::filesystem::path path = std::filesystem::path(file).is_absolute() ? std::filesystem::path(file) : base / file;
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("-----BEGIN ") == std::string::npos) {
    return InvalidArgumentError(key + ": cannot read a PEM file at '" + path.string() + "'");
  }
  return text;
}

bool IsBcrypt(const std::string& hash) {
  return hash.size() == 60 && (hash.starts_with("$2a$") || hash.starts_with("$2b$") || hash.starts_with("$2y$"));
}

}  // namespace

StatusOr<MetricsWebConfig> ReadMetricsWebConfig(const std::string& path) {
  const std::string at = "metrics_web_config '" + path + "': ";
  const std::filesystem::path base = std::filesystem::path(path).parent_path();
  MetricsWebConfig config;
  try {
    std::ifstream in(path);
    if (!in) return InvalidArgumentError(at + "cannot read it");
    const YAML::Node root = YAML::Load(in);
    if (root.IsNull()) return config;
    if (!root.IsMap()) return InvalidArgumentError(at + "expected a mapping at the top level");
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      if (key == "tls_server_config") {
        std::string cert, key_file, ca, auth = "NoClientCert";
        for (const auto& t : kv.second) {
          const std::string k = t.first.as<std::string>();
          const std::string v = t.second.as<std::string>();
          if (k == "cert_file") {
            cert = v;
          } else if (k == "key_file") {
            key_file = v;
          } else if (k == "client_ca_file") {
            ca = v;
          } else if (k == "client_auth_type") {
            auth = v;
          } else {
            // min_version, cipher_suites, ...: refused rather than silently ignored.
            return InvalidArgumentError(at + "tls_server_config." + k +
                                        ": not supported (supported: cert_file, key_file, client_auth_type, "
                                        "client_ca_file)");
          }
        }
        if (cert.empty() || key_file.empty()) {
          return InvalidArgumentError(at + "tls_server_config: expected both cert_file and key_file");
        }
        auto c = ReadPem("tls_server_config.cert_file", base, cert);
        if (!c.ok()) return InvalidArgumentError(at + c.status().message());
        auto k = ReadPem("tls_server_config.key_file", base, key_file);
        if (!k.ok()) return InvalidArgumentError(at + k.status().message());
        config.cert_pem = *c;
        config.key_pem = *k;
        if (auth == "RequireAndVerifyClientCert") {
          if (ca.empty()) return InvalidArgumentError(at + "tls_server_config: RequireAndVerifyClientCert needs client_ca_file");
          auto a = ReadPem("tls_server_config.client_ca_file", base, ca);
          if (!a.ok()) return InvalidArgumentError(at + a.status().message());
          config.client_ca_pem = *a;
        } else if (auth != "NoClientCert") {
          return InvalidArgumentError(at + "tls_server_config.client_auth_type: expected NoClientCert or "
                                      "RequireAndVerifyClientCert, got '" + auth + "'");
        }
      } else if (key == "basic_auth_users") {
        if (!kv.second.IsMap()) return InvalidArgumentError(at + "basic_auth_users: expected a mapping USER: BCRYPT_HASH");
        for (const auto& u : kv.second) {
          const std::string user = u.first.as<std::string>(), hash = u.second.as<std::string>();
          if (!IsBcrypt(hash)) {
            return InvalidArgumentError(at + "basic_auth_users." + user +
                                        ": expected a bcrypt hash ($2y$..., 60 characters; htpasswd -nBC 10 USER)");
          }
          config.basic_auth_users[user] = hash;
        }
      } else {
        return InvalidArgumentError(at + key + ": unknown key (expected tls_server_config, basic_auth_users)");
      }
    }
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(at + "not valid YAML: " + e.what());
  }
  return config;
}

bool BcryptMatches(const std::string& password, const std::string& hash) {
  crypt_data data{};
  const char* got = crypt_r(password.c_str(), hash.c_str(), &data);
  if (got == nullptr || got[0] == '*') return false;
  const std::string_view computed(got);
  unsigned char diff = computed.size() == hash.size() ? 0 : 1;
  for (size_t i = 0; i < hash.size(); ++i) diff |= static_cast<unsigned char>(hash[i] ^ (i < computed.size() ? computed[i] : 0));
  return diff == 0;
}

}  // namespace attnserve
