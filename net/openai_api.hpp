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

using json = nlohmann::ordered_json;  // keeps members in order (a schema's properties, responses)

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
  int32_t max_n = 16;                         // choices per request ("n") at most
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
  int32_t n = 1;          // choices per prompt
  std::vector<std::vector<engine::token_id>> more_prompts;  // a batched /v1/completions: prompts 2..k
};

/// Choices of a request: (1 + more_prompts) prompts x n, at most api_context::max_n.
int32_t n_choices(const completion_request& req);

/// The generation parameters of choice i (OpenAI's numbering: prompt i / n, sample i % n). Choice
/// 0 is the request's own; with a seed, sample j draws from seed + j, so each choice is
/// reproducible alone and the samples of one prompt differ from one another.
actors::generation_params choice_params(const completion_request& req, int32_t i);

/// Validates a request body (an object) and tokenizes its prompt. Throws api_exception.
completion_request parse_completion(const json& body, endpoint kind, const api_context& ctx);

/// /tokenize and /detokenize bodies -> response bodies. Throw api_exception.
json tokenize(const json& body, const api_context& ctx);
json detokenize(const json& body, const api_context& ctx);

/// Builds one request's responses, its req.n choices together: the full JSON (non-streaming) or
/// its SSE events. Choice i's events carry "index": i; chunks of different choices may interleave.
class response_builder {
 public:
  response_builder(const completion_request& req, const api_context& ctx);

  /// Streaming: the first events (chat: the assistant role delta of each choice; completions: "").
  std::string sse_start();
  /// Streaming: one token event of choice i -> an SSE event, or "" when it carries neither text
  /// nor logprobs.
  std::string sse_token(int32_t i, const actors::stream_event& ev);
  /// Streaming: choice i's done event -> its finish chunk.
  std::string sse_done(int32_t i, const actors::stream_event& done);
  /// Streaming: after every choice's done event -> the usage chunk (when asked) and [DONE].
  std::string sse_end();
  /// Streaming: an error after the headers went out -> an error event and [DONE].
  static std::string sse_error(const api_error& e);

  /// Non-streaming: accumulate a token event of choice i.
  void add(int32_t i, const actors::stream_event& ev);
  /// Non-streaming: choice i's done event.
  void done(int32_t i, const actors::stream_event& done);
  /// Non-streaming: the response body once every choice is done.
  json finish() const;

 private:
  struct choice {
    std::string text;
    int64_t n_text_bytes = 0;  // completions text_offset
    json lp;                   // accumulated logprobs (non-streaming)
    actors::finish_reason finish = actors::finish_reason::length;
  };
  json chunk_base() const;
  json logprob_entry(const actors::stream_event& ev) const;  // chat: one content item
  void add_logprobs(choice& c, json& completion_lp, const actors::stream_event& ev) const;  // completions style
  json usage() const;
  void count(int32_t i, const actors::stream_event& done);

  const completion_request& req_;
  const api_context& ctx_;
  std::string id_;
  int64_t created_ = 0;
  std::vector<choice> choices_;
  int64_t n_prompt_ = 0, n_generated_ = 0;  // usage: the prompt once, the completions summed
};

}  // namespace troupe::net
