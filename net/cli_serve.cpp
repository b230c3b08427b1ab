// `troupe serve`: the OpenAI-compatible HTTP server over the in-process engine handle.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <stdexcept>

#include "actors/engine_handle.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "net/cli.hpp"
#include "net/http_server.hpp"
#include "net/openai_api.hpp"

namespace troupe::cli {

namespace {

struct serve_opts {
  config::engine_config engine;
  net::server_options http;
  int64_t kv_mb = 256;
  int max_num_seqs = 64;
};

int run_serve(serve_opts& o) {
  config::engine_config& ec = o.engine;
  if (auto err = config::validate(ec); !err.empty()) throw std::runtime_error(err);
  if (ec.model_path.empty()) ec.model_path = config::default_model_path();
  if (ec.model_path.empty())
    throw std::runtime_error("no model given and the default model is not installed: run scripts/setup.sh or pass --model FILE");
  if (ec.n_threads == 0) ec.n_threads = config::default_threads();
  if (o.kv_mb < 1) throw std::runtime_error("--kv-mb must be at least 1, got " + std::to_string(o.kv_mb));
  if (o.http.max_body_bytes < 1) throw std::runtime_error("--max-body-bytes must be at least 1");
  if (!(o.http.request_timeout_s > 0)) throw std::runtime_error("--request-timeout-s must be > 0");
  if (!(o.http.shutdown_grace_s >= 0)) throw std::runtime_error("--shutdown-grace-s must be >= 0");
  if (o.http.max_connections < 1) throw std::runtime_error("--max-connections must be at least 1");

  actors::engine_options eo;
  eo.model_path = ec.model_path;
  eo.n_threads = ec.n_threads;
  eo.kv_block_size = ec.kv_block_size;
  eo.max_kv_bytes = o.kv_mb << 20;
  eo.sched.max_batched_tokens = ec.n_batch;
  eo.sched.max_num_seqs = o.max_num_seqs;
  eo.sched.max_model_len = ec.n_ctx;  // 0: the engine's limit (trained context, KV pool)
  auto eng = actors::engine_handle::start(eo);
  const engine::model& m = eng->model();
  const engine::tokenizer& tok = m.vocab();

  net::api_context api;
  api.tok = &tok;
  api.model_id = std::filesystem::path(ec.model_path).stem().string();
  if (!m.hparams().name.empty()) api.aliases.push_back(m.hparams().name);
  api.aliases.push_back("default");
  api.created = (int64_t)std::time(nullptr);
  const auto st = eng->stats();
  int64_t limit = std::min<int64_t>(m.hparams().n_ctx_train, (int64_t)st.n_device_blocks * ec.kv_block_size);
  if (ec.n_ctx > 0) limit = std::min<int64_t>(limit, ec.n_ctx);
  api.max_model_len = limit;
  const std::string src = m.file().get_string("tokenizer.chat_template").value_or("");
  const std::string bos = tok.bos() >= 0 ? tok.token_text(tok.bos()) : "";
  const std::string eos = tok.eos() >= 0 ? tok.token_text(tok.eos()) : "";
  api.chat = engine::chat_template::detect(src, bos, eos);
  if (!api.chat)
    std::fprintf(stderr, "troupe serve: the model's chat template is not recognized; /v1/chat/completions will refuse requests\n");
  return net::run_http_server(o.http, *eng, api);
}

}  // namespace

action add_serve(CLI::App& app) {
  auto o = std::make_shared<serve_opts>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE)");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--host", o->http.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->http.port, "TCP port (0: any free port)")->capture_default_str();
  cmd->add_option("--kv-mb", o->kv_mb, "device KV cache size in MiB")->capture_default_str();
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "sequences decoded together at most")->capture_default_str();
  cmd->add_option("--max-body-bytes", o->http.max_body_bytes, "largest request body accepted (413 beyond)")->capture_default_str();
  cmd->add_option("--request-timeout-s", o->http.request_timeout_s, "deadline of one generation, and the idle read limit")->capture_default_str();
  cmd->add_option("--max-connections", o->http.max_connections, "open connections at most (503 beyond)")->capture_default_str();
  cmd->add_option("--shutdown-grace-s", o->http.shutdown_grace_s, "on SIGINT/SIGTERM, how long generations in flight may finish")->capture_default_str();
  return [o] { return run_serve(*o); };
}

}  // namespace troupe::cli
