// The OpenAI-compatible API's wire format, without any HTTP: request bodies (JSON) become
// engine generation parameters, engine events become response bodies and SSE chunks, and every
// failure becomes one `api_error` with its HTTP status, from one table (`error_for`).
// http_server.cpp moves the bytes; everything here is plain code, testable without a socket.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/engine_handle.hpp"
#include "engine/chat_template.hpp"

namespace troupe::engine {
class tokenizer;
}

namespace troupe::net {

using json = nlohmann::json;

/// An OpenAI error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
struct api_error {
  int status = 500;
  std::string type, message, param, code;
  /// Extra header (429: Retry-After).
  std::string retry_after;
};

/// Thrown while parsing a request; carries the error to send.
class api_exception : public std::runtime_error {
 public:
  explicit api_exception(api_error e) : std::runtime_error(e.message), err(std::move(e)) {}
  api_error err;
};

/// 400 invalid_request_error naming the parameter.
api_exception bad_param(std::string param, std::string message);

/// THE table: an engine refusal or failure -> HTTP status, OpenAI type and code.
api_error error_for(actors::gen_error e, std::string message);
/// A protocol-level error: 400 malformed JSON, 404 route or model, 405, 413.
api_error http_error(int status, std::string message, std::string code = "", std::string param = "");
/// The JSON body of an error.
std::string error_body(const api_error& e);

/// JSON text, invalid UTF-8 replaced by U+FFFD (token pieces may split a code point).
std::string dump(const json& j);

/// What the server knows about the model it serves.
struct api_context {
  const engine::tokenizer* tok = nullptr;
  std::optional<engine::chat_template> chat;  // nullopt: chat requests are refused
  std::string model_id;                       // served name (the file stem)
  std::vector<std::string> aliases;           // also accepted in "model": general.name, "default"
  int64_t max_model_len = 0;                  // prompt + max_tokens limit
  int64_t created = 0;                        // unix time the server started

  /// Throws api_exception 404 when `name` is neither the id nor an alias.
  void check_model(const std::string& name) const;
  json models_list() const;
};

enum class endpoint : uint8_t { completions, chat };

/// A parsed /v1/completions or /v1/chat/completions request.
struct completion_request {
  endpoint kind = endpoint::completions;
  actors::generation_params gen;
  bool stream = false, include_usage = false;
  bool logprobs = false;  // report per-token logprobs
  int32_t top_logprobs = 0;
};

/// Validates a request body (an object) and tokenizes its prompt. Throws api_exception.
completion_request parse_completion(const json& body, endpoint kind, const api_context& ctx);

/// /tokenize and /detokenize bodies -> response bodies. Throw api_exception.
json tokenize(const json& body, const api_context& ctx);
json detokenize(const json& body, const api_context& ctx);

/// Builds one request's responses: the full JSON (non-streaming) or its SSE events.
class response_builder {
 public:
  response_builder(const completion_request& req, const api_context& ctx);

  /// Streaming: the first event (chat: the assistant role delta; completions: empty string).
  std::string sse_start();
  /// Streaming: one token event -> an SSE event, or "" when it carries neither text nor logprobs.
  std::string sse_token(const actors::stream_event& ev);
  /// Streaming: the done event -> its finish chunk, the usage chunk (when asked) and [DONE].
  std::string sse_done(const actors::stream_event& done);
  /// Streaming: an error after the headers went out -> an error event and [DONE].
  static std::string sse_error(const api_error& e);

  /// Non-streaming: accumulate a token event.
  void add(const actors::stream_event& ev);
  /// Non-streaming: the response body once the done event arrived.
  json finish(const actors::stream_event& done);

 private:
  json chunk_base() const;
  json logprob_entry(const actors::stream_event& ev);  // chat: one content item
  void add_logprobs(json& completion_lp, const actors::stream_event& ev);  // completions style
  json usage(const actors::stream_event& done) const;

  const completion_request& req_;
  const api_context& ctx_;
  std::string id_, text_;
  int64_t created_ = 0;
  int64_t n_text_bytes_ = 0;  // completions text_offset
  json lp_;                    // accumulated logprobs (non-streaming)
};

}  // namespace troupe::net
