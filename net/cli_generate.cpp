// `troupe generate`: one-shot or interactive generation with tokens streamed to the terminal.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "engine/chat_template.hpp"
#include "engine/generator.hpp"
#include "net/cli.hpp"
#ifdef TROUPE_HAVE_ACTORS  // the service build, which has nlohmann and net/json_schema
#include "engine/json_grammar.hpp"
#include "net/json_schema.hpp"
#endif

namespace troupe::cli {

namespace {

struct generate_opts {
  config::engine_config engine;
  engine::sampling_params sampling;
  std::string prompt, prompt_tokens, system, chat_template, json_schema;
  int32_t max_tokens = 256;
  bool chat = false, interactive = false, print_ids = false, quiet = false, json = false;
};

std::vector<engine::token_id> encode_chat(const engine::model& m, const std::vector<engine::chat_message>& msgs,
                                         const std::string& family) {
  const engine::tokenizer& tok = m.vocab();
  const std::string src = m.chat_template();
  const std::string bos = tok.bos() >= 0 ? tok.token_text(tok.bos()) : "";
  const std::string eos = tok.eos() >= 0 ? tok.token_text(tok.eos()) : "";
  // As troupe serve: a model without a template gets its architecture's format where known.
  const std::string fallback = src.empty() ? m.default_chat_family() : "";
  auto tmpl = !family.empty()     ? engine::chat_template::from_name(family, bos, eos)
              : !fallback.empty() ? engine::chat_template::from_name(fallback, bos, eos)
                                  : engine::chat_template::detect(src, bos, eos);
  if (!tmpl)
    throw std::runtime_error(family.empty() ? "the model's chat template is not one troupe recognizes: pass --chat-template chatml|llama3|gemma|mistral"
                                            : "unknown --chat-template '" + family + "' (chatml, llama3, gemma, mistral)");
  const std::string text = tmpl->render(msgs, true);
  return tok.encode(text, tok.add_bos() && !tmpl->renders_bos(), true);
}

void print_stats(const engine::generation_result& r, size_t n_prompt) {
  const double decode_s = r.total_s - r.prefill_s;
  const size_t n_gen = r.tokens.size();
  std::fprintf(stderr, "\n[troupe] prompt %zu tokens in %.3f s (%.1f tok/s); generated %zu tokens in %.3f s (%.1f tok/s); finish: %s\n",
               n_prompt, r.prefill_s, r.prefill_s > 0 ? n_prompt / r.prefill_s : 0.0, n_gen, decode_s,
               n_gen > 1 && decode_s > 0 ? (n_gen - 1) / decode_s : 0.0, engine::to_string(r.finish));
}

int run_generate(generate_opts& o) {
  if (o.interactive) o.chat = true;
  if (!o.interactive && o.prompt.empty() && o.prompt_tokens.empty())
    throw std::runtime_error("the prompt is empty: pass --prompt TEXT or --prompt-tokens IDS");
  if (o.max_tokens < 1) throw std::runtime_error("--max-tokens must be at least 1, got " + std::to_string(o.max_tokens));
  o.sampling.logprobs = o.sampling.top_logprobs > 0;
  if (auto err = o.sampling.validate(); !err.empty()) throw std::runtime_error(err);
#ifdef TROUPE_HAVE_ACTORS
  // Structured output, as llama-cli's --json-schema: the schema's text, or @FILE.
  if (o.json && !o.json_schema.empty()) throw std::runtime_error("--json and --json-schema: give one");
  if (o.json) o.sampling.grammar = engine::json_grammar::any_object();
  if (!o.json_schema.empty()) {
    std::string text = o.json_schema;
    if (text[0] == '@') {
      std::ifstream f(text.substr(1));
      if (!f) throw std::runtime_error("--json-schema: cannot read " + text.substr(1));
      std::ostringstream ss;
      ss << f.rdbuf();
      text = ss.str();
    }
    const auto schema = nlohmann::ordered_json::parse(text, nullptr, false);
    if (schema.is_discarded()) throw std::runtime_error("--json-schema: not JSON");
    try {
      o.sampling.grammar = net::compile_json_schema(schema);
    } catch (const net::schema_error& e) {
      throw std::runtime_error(std::string("--json-schema: ") + e.what());
    }
  }
#endif
  auto m = load_model(o.engine);
  engine::generator gen(*m, {o.engine.n_threads, o.engine.n_ctx, o.engine.kv_block_size, o.engine.n_batch, o.engine.tensor_parallel, o.engine.pipeline_parallel, o.engine.expert_parallel, !o.engine.swa_full});
  const engine::tokenizer& tok = m->vocab();

  auto stream = [&](size_t, engine::token_id, std::string_view text) {
    if (!o.print_ids) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  auto one = [&](std::vector<engine::token_id> prompt) {
    engine::generation_request req{std::move(prompt), o.sampling, o.max_tokens};
    auto res = gen.run(std::span(&req, 1), stream);
    if (o.print_ids) {
      for (size_t i = 0; i < res[0].tokens.size(); ++i) std::printf(i ? " %d" : "%d", res[0].tokens[i]);
      std::printf("\n");
    } else {
      std::printf("\n");
    }
    if (o.sampling.top_logprobs > 0)
      for (size_t i = 0; i < res[0].samples.size(); ++i) {
        const auto& s = res[0].samples[i];
        std::fprintf(stderr, "[%zu] %d %.4f:", i, s.token, s.logprob);
        for (const auto& t : s.top) std::fprintf(stderr, " %d=%.4f", t.token, t.logprob);
        std::fprintf(stderr, "\n");
      }
    if (!o.quiet) print_stats(res[0], req.prompt.size());
    return res[0];
  };

  if (!o.interactive) {
    if (!o.prompt_tokens.empty()) {
      one(parse_token_list(o.prompt_tokens));
    } else if (o.chat) {
      std::vector<engine::chat_message> msgs;
      if (!o.system.empty()) msgs.push_back({"system", o.system});
      msgs.push_back({"user", o.prompt});
      one(encode_chat(*m, msgs, o.chat_template));
    } else {
      one(tok.encode(o.prompt, true, false));
    }
    return 0;
  }

  std::vector<engine::chat_message> msgs;
  if (!o.system.empty()) msgs.push_back({"system", o.system});
  std::string line;
  std::fprintf(stderr, "troupe chat: %s. Type a message; an empty line or EOF quits.\n", m->hparams().name.c_str());
  for (;;) {
    std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line) || line.empty()) break;
    msgs.push_back({"user", line});
    auto res = one(encode_chat(*m, msgs, o.chat_template));
    msgs.push_back({"assistant", res.text});
  }
  return 0;
}

}  // namespace

action add_generate(CLI::App& app) {
  auto o = std::make_shared<generate_opts>();
  // The command line's defaults are llama.cpp's (the API keeps OpenAI's: temperature 1, no cut-off).
  o->sampling.temperature = 0.8f;
  o->sampling.top_k = 40;
  o->sampling.top_p = 0.95f;
  o->sampling.min_p = 0.05f;
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt, streamed as it comes");
  add_engine_options(*cmd, o->engine);
  add_sampling_options(*cmd, o->sampling);
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "prompt as token ids (\"1,2,3\")");
  cmd->add_option("-n,--max-tokens", o->max_tokens, "max tokens to generate")->capture_default_str();
  cmd->add_flag("--chat", o->chat, "wrap the prompt in the model's chat template as a user message");
  cmd->add_option("--system", o->system, "system message (chat mode)");
  cmd->add_option("--chat-template", o->chat_template, "template family instead of the model's own: chatml, llama3, gemma, mistral");
  cmd->add_flag("-i,--interactive", o->interactive, "multi-turn chat on the terminal");
  cmd->add_flag("--print-token-ids", o->print_ids, "print generated token ids instead of text");
  cmd->add_flag("-q,--quiet", o->quiet, "no statistics line on stderr");
#ifdef TROUPE_HAVE_ACTORS
  cmd->add_option("--json-schema", o->json_schema, "constrain the output to this JSON Schema (its text, or @FILE)");
  cmd->add_flag("--json", o->json, "constrain the output to one JSON object");
#endif
  return [o] { return run_generate(*o); };
}

}  // namespace troupe::cli
