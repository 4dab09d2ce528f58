// The metrics endpoint's security, read from a file in the format of Prometheus's own
// web.config.file (the exporter toolkit's): TLS, optional client certificates, and basic-auth
// users with bcrypt hashes. So a platform team configures attnserve's /metrics exactly as it
// configures every exporter it runs:
//
//   tls_server_config:
//     cert_file: /etc/attnserve/tls/tls.crt
//     key_file: /etc/attnserve/tls/tls.key
//     client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default)
//     client_ca_file: /etc/attnserve/tls/ca.crt
//   basic_auth_users:
//     prometheus: $2y$10$...                          # htpasswd -nBC 10 "" | tr -d ':\n'
//
// Relative paths are relative to the file's folder, as Prometheus reads them.
// Thread-safety: plain values and pure functions.
#pragma once

#include <map>
#include <string>

#include "server/core/status.h"

namespace attnserve {

struct MetricsWebConfig {
  std::string cert_pem, key_pem;  // empty: plain HTTP
  std::string client_ca_pem;      // set: clients must present a certificate it signed
  std::map<std::string, std::string> basic_auth_users;  // user → bcrypt hash; empty: no auth
  bool tls() const { return !cert_pem.empty(); }
};

// Reads and checks `path`: INVALID_ARGUMENT naming the key for unknown keys, settings this
// server does not implement, unreadable files and hashes that are not bcrypt.
StatusOr<MetricsWebConfig> ReadMetricsWebConfig(const std::string& path);

// True when `password` matches the bcrypt `hash` (crypt(3) of libxcrypt; constant-time compare).
bool BcryptMatches(const std::string& password, const std::string& hash);

}  // namespace attnserve
