// API-key authorization of `troupe serve`: "Authorization: Bearer <key>" checked against the
// configured keys in constant time, from the request line and headers only (before the body is
// read). No Boost here.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "net/openai_api.hpp"

namespace troupe::net {

struct auth_config {
  std::vector<std::string> api_keys;        // empty: the API is open
  std::vector<std::string> admin_api_keys;  // operator endpoints; empty: they take api_keys
};

/// Which keys a path needs.
enum class access : uint8_t { open, api, admin };

/// /health and /ready are open (probes); /metrics and /admin/... are operator endpoints; everything else,
/// unknown paths included, is the API.
access access_for(std::string_view path);

/// Compares in time that depends only on `expected`'s length, never on where they differ.
bool constant_time_equal(std::string_view given, std::string_view expected);

/// nullopt when allowed, else the 401 to send. `authorization` is the header's value ("" when
/// absent). Admin keys are accepted wherever an API key is.
std::optional<api_error> authorize(const auth_config& cfg, std::string_view path, std::string_view authorization);

}  // namespace troupe::net
