#include "net/ws_protocol.hpp"

namespace troupe::net {

namespace {

// The id of a message: a non-empty string of at most ws_max_id_bytes.
std::string parse_id(const json& j) {
  auto it = j.find("id");
  if (it == j.end()) throw ws_protocol_error("", "invalid_request", "the message has no 'id'");
  if (!it->is_string()) throw ws_protocol_error("", "invalid_request", "'id' must be a string");
  std::string id = it->get<std::string>();
  if (id.empty() || id.size() > ws_max_id_bytes)
    throw ws_protocol_error("", "invalid_request", "'id' must be 1 to " + std::to_string(ws_max_id_bytes) + " bytes");
  return id;
}

actors::priority_class parse_class(const json& j, const std::string& id) {
  auto it = j.find("priority");
  if (it == j.end()) throw ws_protocol_error(id, "invalid_request", "the priority message has no 'priority'");
  if (it->is_string()) {
    const auto s = it->get<std::string>();
    if (s == "interactive") return actors::priority_class::interactive;
    if (s == "normal") return actors::priority_class::normal;
    if (s == "batch") return actors::priority_class::batch;
  }
  throw ws_protocol_error(id, "invalid_request", "'priority' must be \"interactive\", \"normal\" or \"batch\"");
}

ws_protocol_error typed(ws_protocol_error e, const std::string& type) {
  e.type = type;
  return e;
}

ws_message parse_generate(const json& j, std::string id, const api_context& ctx) {
  const bool has_prompt = j.contains("prompt"), has_messages = j.contains("messages");
  if (has_prompt == has_messages)
    throw ws_protocol_error(id, "invalid_request", "a generate message needs exactly one of 'prompt' and 'messages'");
  if (auto p = j.find("priority"); p != j.end() && !p->is_string())
    throw ws_protocol_error(id, "invalid_request", "'priority' must be \"interactive\", \"normal\" or \"batch\"");
  json body = j;
  for (const char* k : {"type", "id", "stream", "stream_options"}) body.erase(k);  // every generation streams
  ws_message m;
  m.type = ws_message::kind::generate;
  try {
    m.req = parse_completion(body, has_messages ? endpoint::chat : endpoint::completions, ctx);
    if (n_choices(m.req) != 1)
      throw api_exception(api_error{400, "invalid_request_error",
                                    "one generate message is one generation: send n > 1 or several prompts as several messages",
                                    m.req.n != 1 ? "n" : "prompt", "invalid_value", ""});
  } catch (const api_exception& e) {
    ws_protocol_error err(id, e.err.code.empty() ? "invalid_request" : e.err.code, e.err.message);
    err.param = e.err.param;
    throw typed(err, "generate");
  }
  m.cls = m.req.gen.cls;
  m.id = std::move(id);
  return m;
}

std::string id_json(const std::string& id) { return id.empty() ? "null" : dump(json(id)); }

}  // namespace

ws_message parse_ws_message(const json& j, const api_context& ctx) {
  if (j.is_discarded()) throw ws_protocol_error("", "invalid_json", "the message is not valid JSON");
  if (!j.is_object()) throw ws_protocol_error("", "invalid_request", "the message must be a JSON object");
  auto t = j.find("type");
  if (t == j.end() || !t->is_string()) throw ws_protocol_error("", "invalid_request", "the message needs a string 'type'");
  const std::string type = t->get<std::string>();
  if (type != "generate" && type != "cancel" && type != "priority")
    throw ws_protocol_error(j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>() : "", "unknown_type",
                            "unknown message type '" + type + "' (generate, cancel, priority)");
  std::string id;
  try {
    id = parse_id(j);
    if (type == "generate") return parse_generate(j, id, ctx);
  } catch (const ws_protocol_error& e) {
    throw typed(e, type);
  }
  ws_message m;
  if (type == "cancel") {
    m.type = ws_message::kind::cancel;
  } else {
    m.type = ws_message::kind::priority;
    try {
      m.cls = parse_class(j, id);
    } catch (const ws_protocol_error& e) {
      throw typed(e, type);
    }
  }
  m.id = std::move(id);
  return m;
}

std::string ws_token(const std::string& id, const actors::stream_event& ev, bool with_logprob) {
  json j{{"type", "token"}, {"id", id}, {"text", ev.text}, {"token", ev.token}};
  if (with_logprob) j["logprob"] = ev.logprob;
  return dump(j);
}

std::string ws_done(const std::string& id, const actors::stream_event& done) {
  json j{{"type", "done"},
         {"id", id},
         {"finish_reason", actors::to_string(done.finish)},
         {"usage", {{"prompt_tokens", done.n_prompt}, {"completion_tokens", done.n_generated},
                    {"total_tokens", done.n_prompt + done.n_generated}}}};
  return dump(j);
}

std::string ws_error(const std::string& id, const std::string& code, const std::string& message, bool final,
                     const std::string& param) {
  json j{{"type", "error"}, {"id", id.empty() ? json(nullptr) : json(id)}, {"code", code}, {"message", message},
         {"final", final && !id.empty()}};
  if (!param.empty()) j["param"] = param;
  return dump(j);
}

std::string ws_engine_error(const std::string& id, actors::gen_error e, const std::string& message) {
  const api_error err = error_for(e, message);
  json j{{"type", "error"}, {"id", id}, {"code", err.code.empty() ? err.type : err.code}, {"message", err.message},
         {"final", true}, {"status", err.status}};
  return dump(j);
}

std::string ws_priority_ack(const std::string& id, actors::priority_class cls, bool applied) {
  return "{\"type\":\"priority\",\"id\":" + id_json(id) + ",\"priority\":\"" + actors::to_string(cls) +
         "\",\"applied\":" + (applied ? "true" : "false") + "}";
}

}  // namespace troupe::net
