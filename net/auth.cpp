#include "net/auth.hpp"

#include <cctype>

namespace troupe::net {

namespace {

// True when `token` equals any key. Every key is compared (no early exit), so the time does not
// say which key matched or how long a prefix agreed.
bool any_key(const std::vector<std::string>& keys, std::string_view token) {
  unsigned ok = 0;
  for (const std::string& k : keys) ok |= (unsigned)constant_time_equal(token, k);
  return ok != 0;
}

api_error unauthorized(std::string message) {
  api_error e;
  e.status = 401;
  e.type = "invalid_request_error";
  e.code = "invalid_api_key";
  e.message = std::move(message);
  return e;
}

}  // namespace

access access_for(std::string_view path) {
  if (auto q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);
  if (path == "/health" || path == "/ready") return access::open;
  if (path == "/metrics" || path.starts_with("/admin/")) return access::admin;
  return access::api;
}

bool constant_time_equal(std::string_view given, std::string_view expected) {
  // Walk `expected` whole; bytes of `given` past its end read as 0 and the length difference is
  // folded in, so a shorter or longer `given` fails without a data-dependent branch.
  volatile unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? (unsigned char)given[i] : 0;
    diff = diff | (unsigned char)(g ^ (unsigned char)expected[i]);
  }
  return diff == 0;
}

std::optional<api_error> authorize(const auth_config& cfg, std::string_view path, std::string_view authorization) {
  const access need = access_for(path);
  if (need == access::open) return std::nullopt;
  const bool admin_only = need == access::admin && !cfg.admin_api_keys.empty();
  if (!admin_only && cfg.api_keys.empty() && (need == access::api || cfg.admin_api_keys.empty())) return std::nullopt;  // nothing configured

  // "Bearer <key>": the scheme is case-insensitive (RFC 9110 11.1), spaces around the key are not part of it.
  constexpr std::string_view bearer = "bearer ";
  bool is_bearer = authorization.size() > bearer.size();
  for (size_t i = 0; is_bearer && i < bearer.size(); ++i) is_bearer = (char)std::tolower((unsigned char)authorization[i]) == bearer[i];
  if (!is_bearer) return unauthorized("missing API key: send the header 'Authorization: Bearer <key>'");
  std::string_view token = authorization.substr(bearer.size());
  while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
  while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
  const bool admin_ok = any_key(cfg.admin_api_keys, token);
  const bool api_ok = any_key(cfg.api_keys, token);
  if (admin_only ? admin_ok : (admin_ok | api_ok)) return std::nullopt;
  return unauthorized(admin_only ? "this endpoint needs an admin API key (--admin-api-key)" : "invalid API key");
}

}  // namespace troupe::net
