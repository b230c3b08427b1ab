// Internal to net/: one WebSocket connection of `troupe serve` (GET /v1/ws), upgraded from an
// HTTP request http_server.cpp has read. The protocol is docs/websocket.md.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include <boost/asio/awaitable.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/websocket/rfc6455.hpp>  // is_upgrade

#include "net/metrics.hpp"
#include "net/model_slot.hpp"
#include "net/ws_protocol.hpp"

namespace troupe::net {

/// What a WebSocket session needs from the server around it.
struct ws_context {
  const model_registry* models = nullptr;      // each generation takes the current version of the model it names
  ws_options opts;
  double request_timeout_s = 600;              // each generation's deadline
  const std::atomic<bool>* stopping = nullptr;  // the server refuses new work
  metrics_registry* metrics = nullptr;          // fed per generation as for HTTP; null: none
  /// Called for each generation submitted and, once, when the session lets go of it (so the
  /// server's shutdown can wait for and cancel WebSocket generations too).
  std::function<void(const std::shared_ptr<actors::generation_stream>&)> on_start, on_end;
};

/// Completes the handshake for `req` (a WebSocket upgrade) and serves the socket until it closes.
/// Every generation still running when it ends is cancelled. Runs on `stream`'s executor (a strand).
boost::asio::awaitable<void> run_ws_session(boost::beast::tcp_stream stream,
                                            boost::beast::http::request<boost::beast::http::string_body> req,
                                            ws_context ctx);

}  // namespace troupe::net
