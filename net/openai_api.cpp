#include "net/openai_api.hpp"

#include "net/json_schema.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <limits>

#include "engine/tokenizer.hpp"

namespace troupe::net {

namespace {

// --- typed field access ----------------------------------------------------------------------

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> get_number(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw bad_param(name, std::string("'") + name + "' must be a number");
  const double d = v->get<double>();
  if (!std::isfinite(d)) throw bad_param(name, std::string("'") + name + "' must be finite");
  return d;
}

std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_float()) {  // 16.0 is an integer; 16.5 is not
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) return (int64_t)d;
  }
  throw bad_param(name, std::string("'") + name + "' must be an integer");
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw bad_param(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

int32_t in_range(int64_t v, int64_t lo, int64_t hi, const char* name) {
  if (v < lo || v > hi)
    throw bad_param(name, std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                              "], got " + std::to_string(v));
  return (int32_t)v;
}

std::vector<engine::token_id> token_array(const json& arr, const char* name, int32_t n_vocab) {
  std::vector<engine::token_id> out;
  out.reserve(arr.size());
  for (const auto& t : arr) {
    if (!t.is_number_integer()) throw bad_param(name, std::string("'") + name + "' must hold token ids (integers)");
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= n_vocab)
      throw bad_param(name, "token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
    out.push_back((engine::token_id)id);
  }
  return out;
}

// The prompts of a completions request: a string, an array of token ids, or (batched) an array
// of strings or of token-id arrays.
std::vector<std::vector<engine::token_id>> completion_prompts(const json& body, const api_context& ctx) {
  const json* p = field(body, "prompt");
  if (!p) throw bad_param("prompt", "'prompt' is required");
  const engine::tokenizer& tok = *ctx.tok;
  if (p->is_string()) return {tok.encode(p->get<std::string>(), true, true)};
  if (p->is_array() && !p->empty() && (*p)[0].is_number()) return {token_array(*p, "prompt", tok.n_vocab())};
  if (p->is_array() && !p->empty()) {
    std::vector<std::vector<engine::token_id>> out;
    for (const auto& item : *p) {
      if (item.is_string()) out.push_back(tok.encode(item.get<std::string>(), true, true));
      else if (item.is_array()) out.push_back(token_array(item, "prompt", tok.n_vocab()));
      else throw bad_param("prompt", "a batch of prompts must hold only strings or only arrays of token ids");
    }
    return out;
  }
  throw bad_param("prompt", "'prompt' must be a string, an array of token ids, or an array of those");
}

std::string message_content(const json& m, size_t i) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {  // content parts: only text
    std::string out;
    for (const auto& part : *it) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        throw bad_param(param, "only text content parts are supported");
      out += part["text"].get<std::string>();
    }
    return out;
  }
  throw bad_param(param, "'" + param + "' must be a string or an array of text parts");
}

std::vector<engine::token_id> chat_prompt(const json& body, const api_context& ctx) {
  const json* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty()) throw bad_param("messages", "'messages' must be a non-empty array");
  if (!ctx.chat) throw bad_param("messages", "the served model has no chat template troupe can render: start the server with --chat-template (chatml, llama3, gemma, mistral), or use /v1/completions");
  std::vector<engine::chat_message> conv;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad_param("messages[" + std::to_string(i) + "].role", "each message needs a string 'role'");
    conv.push_back({m["role"].get<std::string>(), message_content(m, i)});
  }
  std::string text;
  try {
    text = ctx.chat->render(conv, true);
  } catch (const std::invalid_argument& e) {
    throw bad_param("messages", e.what());
  }
  const engine::tokenizer& tok = *ctx.tok;
  return tok.encode(text, tok.add_bos() && !ctx.chat->renders_bos(), true);
}

void parse_priority(const json& body, actors::generation_params& g) {
  const json* p = field(body, "priority");
  if (!p) return;
  if (p->is_string()) {
    const auto s = p->get<std::string>();
    if (s == "interactive") g.cls = actors::priority_class::interactive;
    else if (s == "normal") g.cls = actors::priority_class::normal;
    else if (s == "batch") g.cls = actors::priority_class::batch;
    else throw bad_param("priority", "'priority' must be \"interactive\", \"normal\", \"batch\" or an integer");
  } else if (p->is_number_integer()) {
    g.priority = in_range(p->get<int64_t>(), -1000000, 1000000, "priority");
  } else {
    throw bad_param("priority", "'priority' must be \"interactive\", \"normal\", \"batch\" or an integer");
  }
}

void parse_stop(const json& body, engine::sampling_params& s) {
  const json* st = field(body, "stop");
  if (!st) return;
  if (st->is_string()) {
    s.stop.push_back(st->get<std::string>());
  } else if (st->is_array()) {
    for (const auto& x : *st) {
      if (!x.is_string()) throw bad_param("stop", "'stop' must be a string or an array of strings");
      s.stop.push_back(x.get<std::string>());
    }
  } else {
    throw bad_param("stop", "'stop' must be a string or an array of strings");
  }
}

std::string new_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t t = (uint64_t)std::chrono::system_clock::now().time_since_epoch().count();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%016llx%04llx", prefix, (unsigned long long)t, (unsigned long long)(counter++ & 0xffff));
  return buf;
}

const char* finish_name(actors::finish_reason r) { return r == actors::finish_reason::stop ? "stop" : "length"; }

json byte_list(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back((int)c);
  return b;
}

}  // namespace

api_exception bad_param(std::string param, std::string message) {
  return api_exception(api_error{400, "invalid_request_error", std::move(message), std::move(param), "invalid_value", ""});
}

api_error error_for(actors::gen_error e, std::string message) {
  using actors::gen_error;
  struct row {
    int status;
    const char* type;
    const char* code;
  };
  row r{500, "server_error", "internal_error"};
  switch (e) {
    case gen_error::invalid: r = {400, "invalid_request_error", "invalid_value"}; break;
    case gen_error::too_long: r = {400, "invalid_request_error", "context_length_exceeded"}; break;
    case gen_error::overloaded: r = {429, "rate_limit_error", "overloaded"}; break;
    case gen_error::queue_timeout: r = {503, "server_error", "queue_timeout"}; break;
    case gen_error::deadline: r = {408, "timeout_error", "deadline_exceeded"}; break;
    case gen_error::cancelled: r = {499, "invalid_request_error", "cancelled"}; break;
    case gen_error::unavailable: r = {503, "server_error", "unavailable"}; break;
    case gen_error::none:
    case gen_error::internal: break;
  }
  api_error out{r.status, r.type, std::move(message), "", r.code, ""};
  if (r.status == 429) out.retry_after = "1";
  return out;
}

api_error http_error(int status, std::string message, std::string code, std::string param) {
  const char* type = status >= 500 ? "server_error" : "invalid_request_error";
  return api_error{status, type, std::move(message), std::move(param), std::move(code), ""};
}

std::string error_body(const api_error& e) {
  json err{{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return dump(json{{"error", err}});
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// --- api_context -------------------------------------------------------------------------------

void api_context::check_model(const std::string& name) const {
  if (name == model_id) return;
  for (const auto& a : aliases)
    if (name == a) return;
  throw api_exception(http_error(404, "the model '" + name + "' does not exist; this server serves '" + model_id + "'",
                                 "model_not_found", "model"));
}

json api_context::models_list() const {
  json m{{"id", model_id}, {"object", "model"}, {"created", created}, {"owned_by", "troupe"}, {"max_model_len", max_model_len}};
  return json{{"object", "list"}, {"data", json::array({m})}};
}

// --- requests ----------------------------------------------------------------------------------

// Structured output, as the three APIs ask for it:
//   OpenAI's response_format: {"type": "text"}, {"type": "json_object"} (one JSON object;
//   llama.cpp's "schema" member beside it is honoured too) or {"type": "json_schema",
//   "json_schema": {"name", "schema", "strict"}};
//   llama.cpp's top-level "json_schema": a schema;
//   vLLM's "guided_json" (a schema, or the schema as a JSON string) and "guided_choice" (a list of
//   strings: the output is exactly one of them, unquoted).
// At most one of them (response_format "text" counts as none). Null for free text.
static std::shared_ptr<const engine::json_grammar> compile_schema_param(const json& schema, const char* param) {
  try {
    return compile_json_schema(schema);
  } catch (const schema_error& e) {
    throw bad_param(param, std::string(param) + " schema: " + e.what());
  }
}

static std::shared_ptr<const engine::json_grammar> parse_response_format(const json& rf) {
  if (!rf.is_object()) throw bad_param("response_format", "'response_format' must be an object");
  const json* type = field(rf, "type");
  if (!type || !type->is_string()) throw bad_param("response_format", "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
  const std::string t = type->get<std::string>();
  if (t == "text") return nullptr;
  if (t == "json_object") {
    const json* schema = field(rf, "schema");
    return schema ? compile_schema_param(*schema, "response_format") : engine::json_grammar::any_object();
  }
  if (t != "json_schema")
    throw bad_param("response_format", "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", not \"" + t + "\"");
  const json* js = field(rf, "json_schema");
  if (!js || !js->is_object()) throw bad_param("response_format", "'response_format.json_schema' must be an object with a 'schema'");
  const json* schema = field(*js, "schema");
  if (!schema) throw bad_param("response_format", "'response_format.json_schema.schema' is missing");
  return compile_schema_param(*schema, "response_format");
}

static std::shared_ptr<const engine::json_grammar> parse_guided_choice(const json& choices) {
  if (!choices.is_array() || choices.empty())
    throw bad_param("guided_choice", "'guided_choice' must be a non-empty array of strings");
  auto g = std::make_shared<engine::json_grammar>();
  engine::json_node lit;
  lit.k = engine::json_node::kind::literal;
  for (const auto& c : choices) {
    if (!c.is_string() || c.get<std::string>().empty())
      throw bad_param("guided_choice", "'guided_choice' must be a non-empty array of non-empty strings");
    lit.literals.push_back(c.get<std::string>());  // raw: the output is the text itself
  }
  g->set_root(g->add(std::move(lit)));
  g->set_bare(true);
  if (auto err = g->finalize(); !err.empty()) throw bad_param("guided_choice", "guided_choice: " + err);
  return g;
}

static std::shared_ptr<const engine::json_grammar> parse_structured(const json& body) {
  std::shared_ptr<const engine::json_grammar> g;
  const char* from = nullptr;
  const auto take = [&](const char* param, std::shared_ptr<const engine::json_grammar> next) {
    if (!next) return;
    if (g) throw bad_param(param, std::string("'") + param + "' and '" + from + "' both constrain the output: give one");
    g = std::move(next), from = param;
  };
  if (const json* rf = field(body, "response_format"); rf && !rf->is_null()) take("response_format", parse_response_format(*rf));
  if (const json* js = field(body, "json_schema"); js && !js->is_null()) take("json_schema", compile_schema_param(*js, "json_schema"));
  if (const json* gj = field(body, "guided_json"); gj && !gj->is_null()) {
    json schema = *gj;
    if (gj->is_string()) {
      schema = json::parse(gj->get<std::string>(), nullptr, false);
      if (schema.is_discarded()) throw bad_param("guided_json", "'guided_json' is a string that is not JSON");
    }
    take("guided_json", compile_schema_param(schema, "guided_json"));
  }
  if (const json* gc = field(body, "guided_choice"); gc && !gc->is_null()) take("guided_choice", parse_guided_choice(*gc));
  return g;
}

completion_request parse_completion(const json& body, endpoint kind, const api_context& ctx) {
  if (!body.is_object()) throw bad_param("", "the request body must be a JSON object");
  completion_request r;
  r.kind = kind;
  const bool chat = kind == endpoint::chat;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) throw bad_param("model", "'model' must be a string");
    ctx.check_model(m->get<std::string>());
  }
  if (auto n = get_int(body, "n")) r.n = in_range(*n, 1, ctx.max_n, "n");
  if (!chat) {
    if (get_bool(body, "echo").value_or(false)) throw bad_param("echo", "'echo' is not supported yet");
    if (const json* s = field(body, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
      throw bad_param("suffix", "'suffix' is not supported");
    if (auto b = get_int(body, "best_of"); b && *b != 1) throw bad_param("best_of", "best_of > 1 is not supported");
  }

  auto& g = r.gen;
  auto& s = g.sampling;
  s = engine::sampling_params{};  // OpenAI defaults: temperature 1, top_p 1, no top-k / min-p
  if (auto v = get_number(body, "temperature")) s.temperature = (float)*v;
  if (auto v = get_number(body, "top_p")) s.top_p = (float)*v;
  if (auto v = get_int(body, "top_k")) s.top_k = *v < 0 ? 0 : in_range(*v, 0, std::numeric_limits<int32_t>::max(), "top_k");
  if (auto v = get_number(body, "min_p")) s.min_p = (float)*v;
  if (auto v = get_number(body, "presence_penalty")) s.presence_penalty = (float)*v;
  if (auto v = get_number(body, "frequency_penalty")) s.frequency_penalty = (float)*v;
  if (auto v = get_number(body, "repetition_penalty")) s.repetition_penalty = (float)*v;
  if (auto v = get_int(body, "seed")) {
    s.seed = (uint64_t)*v;
    s.has_seed = true;
  }
  parse_stop(body, s);
  s.ignore_eos = get_bool(body, "ignore_eos").value_or(false);  // vLLM's extension
  s.grammar = parse_structured(body);
  if (chat) {
    r.logprobs = get_bool(body, "logprobs").value_or(false);
    if (auto v = get_int(body, "top_logprobs")) {
      r.top_logprobs = in_range(*v, 0, engine::max_top_logprobs, "top_logprobs");
      if (!r.logprobs && r.top_logprobs > 0) throw bad_param("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
  } else if (auto v = get_int(body, "logprobs")) {
    r.logprobs = true;
    r.top_logprobs = in_range(*v, 0, engine::max_top_logprobs, "logprobs");
  }
  s.logprobs = r.logprobs;
  s.top_logprobs = r.top_logprobs;
  if (auto err = s.validate(); !err.empty()) throw bad_param("", err);

  r.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw bad_param("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad_param("stream_options", "'stream_options' is only allowed with 'stream': true");
    r.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  parse_priority(body, g);

  if (chat) {
    g.prompt = chat_prompt(body, ctx);
  } else {
    auto prompts = completion_prompts(body, ctx);
    g.prompt = std::move(prompts[0]);
    r.more_prompts.assign(std::make_move_iterator(prompts.begin() + 1), std::make_move_iterator(prompts.end()));
    if ((int64_t)prompts.size() * r.n > ctx.max_n)
      throw bad_param("n", std::to_string(prompts.size()) + " prompts x n = " + std::to_string(r.n) + " exceeds the " +
                               std::to_string(ctx.max_n) + " choices a request may have (--max-n)");
  }
  if (g.prompt.empty()) throw bad_param(chat ? "messages" : "prompt", "the prompt is empty");
  for (const auto& mp : r.more_prompts)
    if (mp.empty()) throw bad_param("prompt", "a prompt of the batch is empty");
  std::optional<int64_t> max_tokens;
  if (chat) max_tokens = get_int(body, "max_completion_tokens");
  if (!max_tokens) max_tokens = get_int(body, "max_tokens");
  const int64_t n_prompt = (int64_t)g.prompt.size();
  if (max_tokens) {
    g.max_tokens = in_range(*max_tokens, 1, std::numeric_limits<int32_t>::max() - 2, chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens");
  } else if (!chat) {
    g.max_tokens = 16;  // OpenAI's default for completions
  } else {  // chat: up to the end of the context
    const int64_t left = ctx.max_model_len - n_prompt;
    if (left < 1)
      throw api_exception(error_for(actors::gen_error::too_long, "the prompt (" + std::to_string(n_prompt) +
                                                                     " tokens) leaves no room to generate within the model length of " +
                                                                     std::to_string(ctx.max_model_len)));
    g.max_tokens = (int32_t)std::min<int64_t>(left, std::numeric_limits<int32_t>::max() - 2);
  }
  return r;
}

json tokenize(const json& body, const api_context& ctx) {
  if (!body.is_object()) throw bad_param("", "the request body must be a JSON object");
  const json* c = field(body, "content");
  if (!c) c = field(body, "prompt");
  if (!c || !c->is_string()) throw bad_param("content", "'content' (or 'prompt') must be a string");
  const bool add_special = get_bool(body, "add_special").value_or(true);
  return json{{"tokens", ctx.tok->encode(c->get<std::string>(), add_special, true)}};
}

json detokenize(const json& body, const api_context& ctx) {
  if (!body.is_object()) throw bad_param("", "the request body must be a JSON object");
  const json* t = field(body, "tokens");
  if (!t || !t->is_array()) throw bad_param("tokens", "'tokens' must be an array of token ids");
  const auto ids = token_array(*t, "tokens", ctx.tok->n_vocab());
  return json{{"content", ctx.tok->decode(ids, false)}};
}

// --- responses ---------------------------------------------------------------------------------

int32_t n_choices(const completion_request& req) { return (int32_t)(1 + req.more_prompts.size()) * req.n; }

actors::generation_params choice_params(const completion_request& req, int32_t i) {
  actors::generation_params g = req.gen;
  if (const int32_t p = i / req.n; p > 0) g.prompt = req.more_prompts.at((size_t)p - 1);
  if (g.sampling.has_seed) g.sampling.seed += (uint64_t)(i % req.n);
  return g;
}

response_builder::response_builder(const completion_request& req, const api_context& ctx)
    : req_(req), ctx_(ctx), id_(new_id(req.kind == endpoint::chat ? "chatcmpl" : "cmpl")), created_((int64_t)std::time(nullptr)) {
  choices_.resize((size_t)n_choices(req));
  for (auto& c : choices_) {
    if (req_.kind == endpoint::chat) c.lp = json{{"content", json::array()}};
    else c.lp = json{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()}, {"text_offset", json::array()}};
  }
}

json response_builder::chunk_base() const {
  const bool chat = req_.kind == endpoint::chat;
  json j{{"id", id_}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created_}, {"model", ctx_.model_id}};
  if (req_.include_usage) j["usage"] = nullptr;
  return j;
}

json response_builder::logprob_entry(const actors::stream_event& ev) const {
  const std::string piece = ctx_.tok->decode(std::span(&ev.token, 1), false);
  json top = json::array();
  for (const auto& t : ev.top) {
    const std::string p = ctx_.tok->decode(std::span(&t.token, 1), false);
    top.push_back(json{{"token", p}, {"logprob", t.logprob}, {"bytes", byte_list(p)}});
  }
  return json{{"token", piece}, {"logprob", ev.logprob}, {"bytes", byte_list(piece)}, {"top_logprobs", top}};
}

void response_builder::add_logprobs(choice& c, json& lp, const actors::stream_event& ev) const {
  const std::string piece = ctx_.tok->decode(std::span(&ev.token, 1), false);
  json top = json::object();
  for (const auto& t : ev.top) top[ctx_.tok->decode(std::span(&t.token, 1), false)] = t.logprob;
  lp["tokens"].push_back(piece);
  lp["token_logprobs"].push_back(ev.logprob);
  lp["top_logprobs"].push_back(top);
  lp["text_offset"].push_back(c.n_text_bytes);
  c.n_text_bytes += (int64_t)ev.text.size();
}

json response_builder::usage() const {
  return json{{"prompt_tokens", n_prompt_}, {"completion_tokens", n_generated_}, {"total_tokens", n_prompt_ + n_generated_}};
}

std::string response_builder::sse_start() {
  if (req_.kind != endpoint::chat) return "";
  std::string out;
  for (size_t i = 0; i < choices_.size(); ++i) {
    json j = chunk_base();
    j["choices"] = json::array({json{{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
    out += "data: " + dump(j) + "\n\n";
  }
  return out;
}

std::string response_builder::sse_token(int32_t i, const actors::stream_event& ev) {
  if (ev.text.empty() && !req_.logprobs) return "";
  choice& c = choices_.at((size_t)i);
  json ch{{"index", i}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (req_.kind == endpoint::chat) {
    ch["delta"] = json{{"content", ev.text}};
    if (req_.logprobs) ch["logprobs"] = json{{"content", json::array({logprob_entry(ev)})}};
  } else {
    ch["text"] = ev.text;
    if (req_.logprobs) {
      json lp{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()}, {"text_offset", json::array()}};
      add_logprobs(c, lp, ev);
      ch["logprobs"] = lp;
    }
  }
  json j = chunk_base();
  j["choices"] = json::array({ch});
  return "data: " + dump(j) + "\n\n";
}

void response_builder::count(int32_t i, const actors::stream_event& done) {
  if (i % req_.n == 0) n_prompt_ += done.n_prompt;  // each prompt once, whatever n
  n_generated_ += done.n_generated;
}

std::string response_builder::sse_done(int32_t i, const actors::stream_event& done) {
  count(i, done);
  json ch{{"index", i}, {"logprobs", nullptr}, {"finish_reason", finish_name(done.finish)}};
  if (req_.kind == endpoint::chat) ch["delta"] = done.text.empty() ? json::object() : json{{"content", done.text}};
  else ch["text"] = done.text;
  json j = chunk_base();
  j["choices"] = json::array({ch});
  return "data: " + dump(j) + "\n\n";
}

std::string response_builder::sse_end() {
  std::string out;
  if (req_.include_usage) {
    json u = chunk_base();
    u["choices"] = json::array();
    u["usage"] = usage();
    out += "data: " + dump(u) + "\n\n";
  }
  return out + "data: [DONE]\n\n";
}

std::string response_builder::sse_error(const api_error& e) { return "data: " + error_body(e) + "\n\ndata: [DONE]\n\n"; }

void response_builder::add(int32_t i, const actors::stream_event& ev) {
  choice& c = choices_.at((size_t)i);
  if (req_.logprobs) {
    if (req_.kind == endpoint::chat) c.lp["content"].push_back(logprob_entry(ev));
    else add_logprobs(c, c.lp, ev);
  }
  c.text += ev.text;
}

void response_builder::done(int32_t i, const actors::stream_event& done) {
  choice& c = choices_.at((size_t)i);
  c.text += done.text;
  c.finish = done.finish;
  count(i, done);
}

json response_builder::finish() const {
  const bool chat = req_.kind == endpoint::chat;
  json out = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const choice& c = choices_[i];
    json ch{{"index", i}, {"finish_reason", finish_name(c.finish)}, {"logprobs", req_.logprobs ? c.lp : json(nullptr)}};
    if (chat) ch["message"] = json{{"role", "assistant"}, {"content", c.text}};
    else ch["text"] = c.text;
    out.push_back(std::move(ch));
  }
  return json{{"id", id_},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created_},
              {"model", ctx_.model_id},
              {"choices", std::move(out)},
              {"usage", usage()}};
}

}  // namespace troupe::net
