// The settings of `troupe serve`: every key of config/troupe.toml with its default, loading from
// TOML, and validation. Plain values only (no Boost, no actor types): net/cli_serve.cpp copies
// them into the engine and HTTP options, and the tests drive this directly.
//
//   server_config c = load_toml("troupe.toml");   // defaults, overlaid by the file; throws
//   ... command-line flags overwrite fields ...
//   if (auto err = validate(c); !err.empty()) fail(err);
//   std::puts(describe(c).c_str());               // API keys redacted
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "config/engine_config.hpp"

namespace troupe::config {

/// A config file that cannot be used: one line naming the file and the key (or the TOML syntax
/// error's line).
class config_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct server_config {
  // [server]
  std::string host = "127.0.0.1";
  int64_t port = 8080;                // 0: any free port
  int64_t max_body_bytes = 1 << 20;   // larger request bodies get 413
  int64_t max_header_bytes = 16384;   // request line + headers larger: 431
  double request_timeout_s = 600;     // whole-generation deadline
  double idle_timeout_s = 60;         // reading one request, or waiting for the next on a keep-alive connection
  int64_t max_connections = 256;      // open connections at most (503 beyond)
  double shutdown_grace_s = 5;        // generations in flight may finish this long on SIGTERM
  bool exit_on_device_loss = true;    // a lost device (sticky CUDA error) stops the server, exit status 1
  int64_t n_io_threads = 2;           // HTTP I/O threads
  int64_t max_n = 16;                 // choices per request ("n") at most

  // [websocket]  (GET /v1/ws, docs/websocket.md)
  int64_t ws_max_message_bytes = 1 << 20;  // largest client message (close 1009 beyond)
  int64_t ws_max_queue_bytes = 1 << 20;    // outgoing queue per socket: at this size it stops reading
  double ws_send_timeout_s = 30;           // a frame write blocked this long: close 1008
  int64_t ws_max_generations = 64;         // live generations per socket
  double ws_idle_timeout_s = 300;          // nothing from the client this long: closed (ping at half)
  int64_t ws_send_buffer_bytes = 0;        // SO_SNDBUF of the socket; 0: the system's

  // [reload]  (POST /admin/reload, SIGHUP: a new model version beside the serving one)
  double reload_drain_timeout_s = 600;     // a replaced version's generations are ended after this long
  double reload_warmup_timeout_s = 120;    // the new version's warm-up generation must finish within it
  int64_t max_models = 4;                  // models served at once (the default + /admin/models/load)

  // [replicas]  (data parallel: the default model also served by other `troupe serve` processes,
  // reached through CAF's middleman; plain TCP, for trusted networks only)
  int64_t publish_port = -1;               // >= 0: this server's default model is published at this port for fronts (0: any free); -1: off
  std::string publish_host = "127.0.0.1";  // the address it is published on
  std::vector<std::string> replicas;       // "host:port" of published servers of the same model this one routes to as well
  bool replica_local = true;               // false: a router only, no executor of its own (needs replicas)
  double replica_retry_s = 2;              // an unreachable, lost or mismatched replica is tried again this often
  double replica_timeout_s = 10;           // connecting to a replica and its first answer, at most
  double replica_heartbeat_s = 1;          // heartbeats on replica connections, this often
  double replica_dead_after_s = 10;        // a replica connection silent this long is dropped
  std::string replica_routing = "prefix";  // "prefix" (cache-aware) or "least_loaded"
  int64_t replica_max_imbalance = 4;       // prefix routing yields to the least loaded beyond this many more in flight
  int64_t replica_affinity_blocks = 65536; // prompt prefixes (full KV blocks) the router remembers
  std::string replica_tls_cert, replica_tls_key, replica_tls_ca;  // TLS both ways on replica connections: all three or none

  // [engine]  (model_path, n_threads, n_ctx, kv_block_size, n_batch; max_kv_bytes is unused:
  // the serve cache size is kv_mb)
  engine_config engine;
  int64_t kv_mb = 256;                // device KV cache size in MiB
  std::string chat_template;          // "": the model's own; else chatml, llama3, gemma or mistral

  // [scheduler]
  int64_t max_num_seqs = 64;          // sequences decoded together at most
  int64_t max_waiting = 1024;         // waiting requests at most (429 beyond)
  int64_t max_waiting_tokens = 1 << 20;  // prompt tokens of the waiting requests at most
  double queue_timeout_s = 0;         // longest wait before the first step (0: none; 503 after)
  std::string preemption = "swap";    // "swap" (to host blocks) or "recompute"
  bool plan_ahead = true;             // pipelining: decode step n+1 planned while n runs
  double target_itl_ms = 0;           // steps with decodes sized to end within this (0: off)
  double itl_stretch = 2.0;           // ...or within this x the decodes' own time, when longer
  int64_t min_prefill_tokens = 16;    // prefill tokens such a step still takes, whatever the target
  double step_timeout_s = 120;        // a step longer than this fails: the executor is told to stop ...
  double executor_stop_timeout_s = 10;  // ... and one that has not within this is wedged (the device lost)
  int64_t max_restarts = 3;           // executor restarts within restart_window_s before the circuit opens
  double restart_window_s = 60;
  double circuit_reset_s = 30;        // after the circuit opened on restarts, a new executor this much later (0: never)

  // [auth]
  std::vector<std::string> api_keys;        // empty: the API is open
  std::vector<std::string> admin_api_keys;  // operator endpoints (/metrics); empty: api_keys
};

/// Defaults overlaid with the TOML text. `source` names it in errors. Throws config_error on a
/// syntax error, an unknown section or key, or a value of the wrong type; ranges are validate()'s.
server_config parse_toml(std::string_view text, std::string_view source = "<string>");

/// parse_toml() of a file. Throws config_error when it cannot be read.
server_config load_toml(const std::string& path);

/// Empty when valid, else one line naming the key (as `section.key`, with its flag) and its
/// allowed range.
std::string validate(const server_config& c);

/// The effective configuration as TOML, API keys redacted ("***" per key).
std::string describe(const server_config& c);

}  // namespace troupe::config
