// The HTTP front of `troupe serve`: Boost.Beast (HTTP/1.1, keep-alive, SSE over chunked
// transfer) on Asio C++20 coroutines. Beast stays inside http_server.cpp; this header names
// no Boost type.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "actors/engine_handle.hpp"
#include "net/auth.hpp"
#include "net/model_slot.hpp"
#include "net/openai_api.hpp"
#include "net/ws_protocol.hpp"

namespace troupe::net {

/// A model's device lost (actors::engine_options::on_device_lost) told to the server, which may
/// not be running yet when it happens (a load, a reload). Thread-safe.
class device_loss_notice {
 public:
  /// The first reason is kept; the server's handler runs once, now or when it is set.
  void notify(const std::string& why);
  void on_notice(std::function<void(const std::string&)> fn);
  /// Empty until notified.
  std::string reason() const;

 private:
  mutable std::mutex mu_;
  std::string why_;
  std::function<void(const std::string&)> fn_;
};

struct server_options {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;          // 0: any free port (the one chosen is printed)
  size_t max_body_bytes = 1 << 20;
  uint32_t max_header_bytes = 16384;  // request line + headers (431 beyond)
  double request_timeout_s = 600;  // whole-generation deadline
  double idle_timeout_s = 60;      // reading a request / waiting for the next on a kept-alive connection
  int max_connections = 256;
  double shutdown_grace_s = 5;     // on SIGINT/SIGTERM, generations in flight get this long
  // When a model's device is lost (device_loss, which the engines' on_device_lost notify): stop
  // as on SIGTERM and return 1, so that whatever supervises the process starts a new one (the
  // only one that can use the device); else stay up refusing requests, /health answering 503.
  bool exit_on_device_loss = true;
  std::shared_ptr<device_loss_notice> device_loss = std::make_shared<device_loss_notice>();
  int n_io_threads = 2;
  ws_options ws;                   // GET /v1/ws (docs/websocket.md)
  auth_config auth;                // API keys; checked from the headers, before the body is read
};

/// Listens, prints "troupe serve: listening on http://HOST:PORT" to stdout, and serves until
/// SIGINT or SIGTERM: then it accepts nothing new, lets generations in flight finish for
/// shutdown_grace_s, cancels the rest (their clients get a 503 error), and returns 0; so too after a
/// lost device (exit_on_device_loss), returning 1: the process exit code. Throws
/// std::runtime_error when it cannot bind. Each request runs on the
/// current version of the model it names (none: the default); POST /admin/reload and SIGHUP
/// reload a model, /admin/models/load and /unload add and remove models (model_slot.hpp).
/// `models` must outlive the call.
int run_http_server(const server_options& opts, model_registry& models);

}  // namespace troupe::net
