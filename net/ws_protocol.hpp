// The WebSocket protocol of `troupe serve` (GET /v1/ws), without any socket: client messages
// (JSON text) become parsed requests, engine events become server messages. docs/websocket.md
// is the specification; ws_session.cpp moves the frames.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "actors/engine_handle.hpp"
#include "net/openai_api.hpp"

namespace troupe::net {

/// Limits of one WebSocket connection.
struct ws_options {
  size_t max_message_bytes = 1 << 20;  // largest client message (larger: close 1009)
  size_t max_queue_bytes = 1 << 20;    // outgoing queue: at this size the socket stops reading
                                       // client messages and stops taking engine events
  double send_timeout_s = 30;          // one frame write blocked this long (the client does not
                                       // read): close 1008, the socket dropped if that cannot be sent
  int max_generations = 64;            // live generations on one socket at most
  double idle_timeout_s = 300;         // nothing from the client this long: closed; a keep-alive
                                       // ping goes out at half of it (Beast's suggested settings)
  int send_buffer_bytes = 0;           // the socket's SO_SNDBUF; 0: the system's (auto-tuned)
};

/// Longest client id accepted.
inline constexpr size_t ws_max_id_bytes = 256;

/// A client message the server could not accept; answered with an error message.
class ws_protocol_error : public std::runtime_error {
 public:
  ws_protocol_error(std::string id, std::string code, const std::string& message)
      : std::runtime_error(message), id(std::move(id)), code(std::move(code)) {}
  std::string id;    // the message's id when it had a valid one, else empty (sent as null)
  std::string code;  // machine-readable: invalid_json, unknown_type, invalid_request, ...
  std::string param; // the offending field, when one is known
  std::string type;  // the message's type when it had a known one
};

/// One parsed client message.
struct ws_message {
  enum class kind : uint8_t { generate, cancel, priority };
  kind type = kind::generate;
  std::string id;
  completion_request req;  // generate: the generation (req.gen.cls holds the priority)
  actors::priority_class cls = actors::priority_class::normal;  // priority: the new class
};

/// Validates one client message, as json::parse(text, nullptr, false) returned it (discarded: the
/// text was not JSON), tokenizing a generate's prompt. Throws ws_protocol_error.
ws_message parse_ws_message(const json& j, const api_context& ctx);

/// Server messages, as JSON text.
std::string ws_token(const std::string& id, const actors::stream_event& ev, bool with_logprob);
std::string ws_done(const std::string& id, const actors::stream_event& done);
/// `id` empty: sent as null (the message had no usable id). `final`: this error is the last
/// message for generation `id` (a generate refused, or a generation failed); false when it only
/// rejects one client message and a generation with that id, if any, goes on.
std::string ws_error(const std::string& id, const std::string& code, const std::string& message, bool final,
                     const std::string& param = "");
/// An engine failure (the same table as HTTP: error_for) as an error message (final).
std::string ws_engine_error(const std::string& id, actors::gen_error e, const std::string& message);
/// The answer to a priority message; `applied` says whether the scheduler acted on it.
std::string ws_priority_ack(const std::string& id, actors::priority_class cls, bool applied);

}  // namespace troupe::net
