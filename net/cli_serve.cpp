// `troupe serve`: the OpenAI-compatible HTTP server over the in-process engine handle.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <functional>
#include <utility>
#include <stdexcept>

#include "actors/engine_handle.hpp"
#include "config/server_config.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "net/cli.hpp"
#include "net/http_server.hpp"
#include "net/model_slot.hpp"
#include "net/openai_api.hpp"

namespace troupe::cli {

namespace {

struct serve_opts {
  config::server_config flags;  // bound to the command line; only the flags given are applied
  std::string config_path;      // --config: the file's values replace the defaults
  CLI::App* cmd = nullptr;
};

// Every flag that maps to a server_config field: its name and how its value is applied.
using apply_fn = std::function<void(config::server_config& dst, const config::server_config& src)>;
template <class T>
std::pair<std::string, apply_fn> field(std::string flag, T config::server_config::*f) {
  return {std::move(flag), [f](config::server_config& d, const config::server_config& s) { d.*f = s.*f; }};
}
template <class T>
std::pair<std::string, apply_fn> engine_field(std::string flag, T config::engine_config::*f) {
  return {std::move(flag), [f](config::server_config& d, const config::server_config& s) { d.engine.*f = s.engine.*f; }};
}
const std::vector<std::pair<std::string, apply_fn>>& flag_fields() {
  using c = config::server_config;
  using e = config::engine_config;
  static const std::vector<std::pair<std::string, apply_fn>> v = {
      field("--host", &c::host), field("--port", &c::port), field("--max-body-bytes", &c::max_body_bytes),
      field("--request-timeout-s", &c::request_timeout_s), field("--idle-timeout-s", &c::idle_timeout_s),
      field("--max-header-bytes", &c::max_header_bytes), field("--max-connections", &c::max_connections),
      field("--shutdown-grace-s", &c::shutdown_grace_s), field("--exit-on-device-loss", &c::exit_on_device_loss), field("--io-threads", &c::n_io_threads), field("--max-n", &c::max_n),
      field("--ws-max-message-bytes", &c::ws_max_message_bytes), field("--ws-max-queue-bytes", &c::ws_max_queue_bytes),
      field("--ws-send-timeout-s", &c::ws_send_timeout_s), field("--ws-max-generations", &c::ws_max_generations),
      field("--ws-idle-timeout-s", &c::ws_idle_timeout_s), field("--ws-send-buffer-bytes", &c::ws_send_buffer_bytes),
      engine_field("--model", &e::model_path), engine_field("--load-format", &e::load_format), engine_field("--dummy-seed", &e::dummy_seed), engine_field("--threads", &e::n_threads), engine_field("--ctx-size", &e::n_ctx),
      engine_field("--kv-block-size", &e::kv_block_size), engine_field("--batch-size", &e::n_batch), engine_field("--device", &e::device), engine_field("--cuda-graphs", &e::cuda_graphs),
      engine_field("--cuda-fused-decode", &e::cuda_fused_decode), engine_field("--tensor-parallel", &e::tensor_parallel),
      engine_field("--pipeline-parallel", &e::pipeline_parallel), engine_field("--expert-parallel", &e::expert_parallel), engine_field("--swa-full", &e::swa_full), field("--kv-mb", &c::kv_mb),
      field("--max-num-seqs", &c::max_num_seqs), field("--max-waiting", &c::max_waiting),
      field("--max-waiting-tokens", &c::max_waiting_tokens), field("--queue-timeout-s", &c::queue_timeout_s),
      field("--preemption", &c::preemption), field("--plan-ahead", &c::plan_ahead),
      field("--target-itl-ms", &c::target_itl_ms), field("--itl-stretch", &c::itl_stretch),
      field("--min-prefill-tokens", &c::min_prefill_tokens), field("--step-timeout-s", &c::step_timeout_s),
      field("--executor-stop-timeout-s", &c::executor_stop_timeout_s), field("--max-restarts", &c::max_restarts),
      field("--restart-window-s", &c::restart_window_s), field("--circuit-reset-s", &c::circuit_reset_s), field("--reload-drain-timeout-s", &c::reload_drain_timeout_s),
      field("--reload-warmup-timeout-s", &c::reload_warmup_timeout_s), field("--chat-template", &c::chat_template),
      field("--max-models", &c::max_models), field("--api-key", &c::api_keys), field("--admin-api-key", &c::admin_api_keys),
      field("--publish-port", &c::publish_port), field("--publish-host", &c::publish_host), field("--replica", &c::replicas),
      field("--local-replica", &c::replica_local), field("--replica-retry-s", &c::replica_retry_s), field("--replica-timeout-s", &c::replica_timeout_s),
      field("--replica-heartbeat-s", &c::replica_heartbeat_s), field("--replica-dead-after-s", &c::replica_dead_after_s),
      field("--replica-routing", &c::replica_routing), field("--replica-max-imbalance", &c::replica_max_imbalance),
      field("--replica-affinity-blocks", &c::replica_affinity_blocks), field("--replica-tls-cert", &c::replica_tls_cert), field("--replica-tls-key", &c::replica_tls_key),
      field("--replica-tls-ca", &c::replica_tls_ca),
  };
  return v;
}

// The defaults, overlaid by the config file, overlaid by the flags given; validated.
config::server_config effective_config(const serve_opts& o) {
  config::server_config c = o.config_path.empty() ? config::server_config{} : config::load_toml(o.config_path);
  for (const auto& [flag, apply] : flag_fields())
    if (o.cmd->get_option(flag)->count() > 0) apply(c, o.flags);
  if (auto err = config::validate(c); !err.empty()) throw std::runtime_error(err);
  return c;
}

int run_serve(serve_opts& o) {
  // SIGHUP means "reload" to the running server (http_server.cpp); until it listens, a SIGHUP is
  // ignored rather than ending the process with its default action.
  std::signal(SIGHUP, SIG_IGN);
  config::server_config c = effective_config(o);
  config::engine_config& ec = c.engine;
  if (ec.model_path.empty()) ec.model_path = config::default_model_path();
  if (ec.model_path.empty())
    throw std::runtime_error("no model given and the default model is not installed: run scripts/setup.sh or pass --model FILE");
  if (ec.n_threads == 0) ec.n_threads = config::default_threads();
  std::fprintf(stderr, "troupe serve: effective configuration%s%s:\n%s", o.config_path.empty() ? "" : " (from ",
               o.config_path.empty() ? "" : (o.config_path + " and the flags)").c_str(), config::describe(c).c_str());

  net::server_options http;
  http.host = c.host;
  http.port = (uint16_t)c.port;
  http.max_body_bytes = (size_t)c.max_body_bytes;
  http.max_header_bytes = (uint32_t)c.max_header_bytes;
  http.request_timeout_s = c.request_timeout_s;
  http.idle_timeout_s = c.idle_timeout_s;
  http.max_connections = (int)c.max_connections;
  http.shutdown_grace_s = c.shutdown_grace_s;
  http.exit_on_device_loss = c.exit_on_device_loss;
  http.n_io_threads = (int)c.n_io_threads;
  http.ws.max_message_bytes = (size_t)c.ws_max_message_bytes;
  http.ws.max_queue_bytes = (size_t)c.ws_max_queue_bytes;
  http.ws.send_timeout_s = c.ws_send_timeout_s;
  http.ws.max_generations = (int)c.ws_max_generations;
  http.ws.idle_timeout_s = c.ws_idle_timeout_s;
  http.ws.send_buffer_bytes = (int)c.ws_send_buffer_bytes;
  http.auth.api_keys = c.api_keys;
  http.auth.admin_api_keys = c.admin_api_keys;

  actors::engine_options eo;
  eo.model_path = ec.model_path;
  eo.dummy_weights = ec.load_format == "dummy";
  eo.dummy_seed = (uint64_t)ec.dummy_seed;
  eo.on_device_lost = [notice = http.device_loss](const std::string& why) { notice->notify(why); };
  eo.n_threads = ec.n_threads;
  eo.cuda_device = config::parse_device(ec.device);
  eo.cuda_graphs = ec.cuda_graphs;
  eo.cuda_fused_decode = ec.cuda_fused_decode;
  eo.tensor_parallel = ec.tensor_parallel;
  eo.pipeline_parallel = ec.pipeline_parallel;
  eo.expert_parallel = ec.expert_parallel;
  eo.kv_block_size = ec.kv_block_size;
  eo.kv_window_groups = !ec.swa_full;
  eo.max_kv_bytes = c.kv_mb << 20;
  eo.sched.max_batched_tokens = ec.n_batch;
  eo.sched.max_num_seqs = (int32_t)c.max_num_seqs;
  eo.sched.max_waiting = (int32_t)c.max_waiting;
  eo.sched.max_waiting_tokens = c.max_waiting_tokens;
  eo.sched.queue_timeout_s = c.queue_timeout_s;
  eo.sched.preemption = c.preemption == "recompute" ? actors::preemption_mode::recompute : actors::preemption_mode::swap;
  eo.sched.plan_ahead = c.plan_ahead;
  eo.sched.target_itl_ms = c.target_itl_ms;
  eo.sched.itl_stretch = c.itl_stretch;
  eo.sched.min_prefill_tokens = (int32_t)c.min_prefill_tokens;
  eo.step_timeout_s = c.step_timeout_s;
  eo.executor_stop_timeout_s = c.executor_stop_timeout_s;
  eo.max_restarts = (int)c.max_restarts;
  eo.restart_window_s = c.restart_window_s;
  eo.circuit_reset_s = c.circuit_reset_s;
  eo.sched.max_model_len = ec.n_ctx;  // 0: the engine's limit (trained context, KV pool)

  // One version of the served model; a reload builds the next one the same way, from its file.
  const int64_t created = (int64_t)std::time(nullptr);
  auto load_with = [n_ctx = ec.n_ctx, max_n = (int32_t)c.max_n, created, family = c.chat_template](actors::engine_options o,
                                                                                                    const std::string& path) {
    auto v = std::make_unique<net::served_model>();
    o.model_path = path;
    v->engine = actors::engine_handle::start(o);
    const engine::model& m = v->engine->model();
    const engine::tokenizer& tok = m.vocab();
    net::api_context& api = v->api;
    api.tok = &tok;
    if (!m.hparams().name.empty()) api.aliases.push_back(m.hparams().name);
    api.created = created;
    const auto st = v->engine->stats();
    int64_t limit = std::min<int64_t>(m.hparams().n_ctx_train, st.max_positions);
    if (n_ctx > 0) limit = std::min<int64_t>(limit, n_ctx);
    api.max_model_len = limit;
    if (st.kv_groups.n > 1)
      std::fprintf(stderr,
                   "troupe serve: %s: KV cache of %d blocks in %d layer groups: the sliding-window layers keep their last %d "
                   "positions (--swa-full: every position); one sequence can reach %lld positions\n",
                   path.c_str(), (int)st.n_device_blocks, st.kv_groups.n, st.kv_groups.window, (long long)st.max_positions);
    api.max_n = max_n;
    const std::string src = m.chat_template();
    const std::string bos = tok.bos() >= 0 ? tok.token_text(tok.bos()) : "";
    const std::string eos = tok.eos() >= 0 ? tok.token_text(tok.eos()) : "";
    // A file without a template gets its architecture's format where that is known (Gemma 3's
    // GGUF carries none; a built-in architecture's vocabulary has ChatML's tokens); --chat-template
    // overrides either.
    const std::string arch_family = m.default_chat_family();
    if (!family.empty()) api.chat = engine::chat_template::from_name(family, bos, eos);
    else if (src.empty() && !arch_family.empty()) {
      api.chat = engine::chat_template::from_name(arch_family, bos, eos);
      std::fprintf(stderr, "troupe serve: %s: no chat template in the file: the %s format of its architecture\n", path.c_str(), arch_family.c_str());
    } else api.chat = engine::chat_template::detect(src, bos, eos);
    if (!api.chat)
      std::fprintf(stderr, "troupe serve: %s: %s; /v1/chat/completions will refuse requests (--chat-template names one)\n", path.c_str(),
                   src.empty() ? "the model has no chat template" : "the chat template is not recognized");
    return v;
  };
  auto load = [eo, load_with](const std::string& path) { return load_with(eo, path); };
  // The default model's versions also take part in data parallelism: the first is published for
  // fronts (--publish-port), and every version routes to the replicas (--replica).
  actors::engine_options default_eo = eo;
  default_eo.publish_port = (int)c.publish_port;
  default_eo.publish_host = c.publish_host;
  default_eo.replicas = c.replicas;
  default_eo.local_executor = c.replica_local;
  default_eo.replica_retry_s = c.replica_retry_s;
  default_eo.replica_timeout_s = c.replica_timeout_s;
  default_eo.replica_heartbeat_s = c.replica_heartbeat_s;
  default_eo.replica_dead_after_s = c.replica_dead_after_s;
  default_eo.replica_prefix_routing = c.replica_routing == "prefix";
  default_eo.replica_max_imbalance = c.replica_max_imbalance;
  default_eo.replica_affinity_blocks = c.replica_affinity_blocks;
  default_eo.replica_tls_cert = c.replica_tls_cert;
  default_eo.replica_tls_key = c.replica_tls_key;
  default_eo.replica_tls_ca = c.replica_tls_ca;
  // A reload of a published model hands the port over once the new version is current: the old
  // one stops accepting connections and refuses new generations from fronts (they move them),
  // finishes those it runs, and is unloaded when idle; the fronts reconnect to the new one.
  auto published_port = std::make_shared<int>(-1);
  auto load_default = [default_eo, load_with, published_port](const std::string& path) {
    actors::engine_options o = default_eo;
    o.publish_at_start = *published_port < 0;
    auto v = load_with(o, path);
    if (o.publish_port < 0) return v;
    v->serves_remote = true;
    const std::string& host = o.publish_host;
    if (o.publish_at_start) {
      *published_port = v->engine->published_port();
      if (host != "127.0.0.1" && host != "localhost" && host != "::1" && o.replica_tls_cert.empty())
        std::fprintf(stderr, "troupe serve: warning: the replica port on %s has no authentication or encryption: anyone who reaches it "
                             "can submit generations; keep it on a trusted network or name TLS files (--replica-tls-cert, "
                             "--replica-tls-key, --replica-tls-ca)\n", host.c_str());
      std::fprintf(stderr, "troupe serve: published for fronts at %s:%d (troupe serve --replica %s:%d)\n", host.c_str(), *published_port,
                   host.c_str(), *published_port);
      return v;
    }
    actors::engine_handle* next = v->engine.get();
    v->on_current = [next, host, published_port](net::served_model& old) {
      old.engine->retire_published();
      next->publish(host, *published_port);
      std::fprintf(stderr, "troupe serve: the new version is published for fronts at %s:%d\n", host.c_str(), *published_port);
    };
    return v;
  };
  net::model_slot_options so;
  so.drain_timeout_s = c.reload_drain_timeout_s;
  so.warmup_timeout_s = c.reload_warmup_timeout_s;
  net::model_registry models(load, ec.model_path, so, (size_t)c.max_models, load_default);
  const int rc = net::run_http_server(http, models);
  if (!http.device_loss->reason().empty()) {
    // After a lost device the executor's thread may be wedged in a step (a hung kernel) or in
    // freeing memory a hung kernel may touch: destroying the engines would wait for it forever.
    std::fprintf(stderr, "troupe serve: exiting without stopping the engines (the device is lost)\n");
    std::fflush(nullptr);
    std::_Exit(rc);
  }
  return rc;
}

}  // namespace

action add_serve(CLI::App& app) {
  auto o = std::make_shared<serve_opts>();
  config::server_config& f = o->flags;
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE)");
  o->cmd = cmd;
  cmd->add_option("--config", o->config_path, "TOML config file (see config/troupe.toml); flags override it")->check(CLI::ExistingFile);
  add_engine_options(*cmd, f.engine);
  cmd->add_option("--host", f.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", f.port, "TCP port (0: any free port)")->capture_default_str();
  cmd->add_option("--kv-mb", f.kv_mb, "device KV cache size in MiB")->capture_default_str();
  cmd->add_option("--device", f.engine.device, "executor device: cpu, cuda or cuda:N (a build with CUDA)")->capture_default_str();
  cmd->add_option("--cuda-graphs", f.engine.cuda_graphs, "device cuda: decode steps from CUDA graphs (false: eager launches) (true/false)")
      ->capture_default_str();
  cmd->add_option("--cuda-fused-decode", f.engine.cuda_fused_decode,
                  "device cuda: fused decode launches (GEMVs with SwiGLU, RoPE, RMSNorm; last-CTA attention merge) (true/false)")
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", f.max_num_seqs, "sequences decoded together at most")->capture_default_str();
  cmd->add_option("--max-waiting", f.max_waiting, "waiting requests at most (429 beyond)")->capture_default_str();
  cmd->add_option("--max-waiting-tokens", f.max_waiting_tokens, "prompt tokens of the waiting requests at most (429 beyond)")->capture_default_str();
  cmd->add_option("--queue-timeout-s", f.queue_timeout_s, "longest wait for the first step (0: none; 503 after)")->capture_default_str();
  cmd->add_option("--preemption", f.preemption, "when KV runs out: swap or recompute")->capture_default_str();
  cmd->add_option("--plan-ahead", f.plan_ahead, "pipelining: plan step n+1 (decodes, short prompts that fit whole) while n runs (true/false)")->capture_default_str();
  cmd->add_option("--target-itl-ms", f.target_itl_ms,
                  "inter-token latency target: steps that carry decodes take prefill tokens only while predicted to end within it (0: off)")
      ->capture_default_str();
  cmd->add_option("--itl-stretch", f.itl_stretch,
                  "under a load the ITL target cannot hold, a step may still take this x its decodes' own time (>= 1)")
      ->capture_default_str();
  cmd->add_option("--min-prefill-tokens", f.min_prefill_tokens, "prefill tokens such a step still takes whatever the target")->capture_default_str();
  cmd->add_option("--step-timeout-s", f.step_timeout_s, "an executor step longer than this fails: its sequences are requeued, the executor restarted")->capture_default_str();
  cmd->add_option("--executor-stop-timeout-s", f.executor_stop_timeout_s,
                  "an executor told to stop (failed or timed-out step) that has not within this is wedged: handled as a lost device")->capture_default_str();
  cmd->add_option("--max-restarts", f.max_restarts, "executor restarts within --restart-window-s; one more failure opens the circuit (503)")->capture_default_str();
  cmd->add_option("--restart-window-s", f.restart_window_s, "the window --max-restarts counts in")->capture_default_str();
  cmd->add_option("--circuit-reset-s", f.circuit_reset_s,
                  "after the circuit opened on restarts, a new executor this much later; the circuit closes once it is up (0: never)")
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", f.max_body_bytes, "largest request body accepted (413 beyond)")->capture_default_str();
  cmd->add_option("--request-timeout-s", f.request_timeout_s, "deadline of one generation")->capture_default_str();
  cmd->add_option("--idle-timeout-s", f.idle_timeout_s, "reading one request, or waiting for the next on a kept-alive connection")->capture_default_str();
  cmd->add_option("--max-header-bytes", f.max_header_bytes, "request line and headers at most (431 beyond)")->capture_default_str();
  cmd->add_option("--max-connections", f.max_connections, "open connections at most (503 beyond)")->capture_default_str();
  cmd->add_option("--shutdown-grace-s", f.shutdown_grace_s, "on SIGINT/SIGTERM, how long generations in flight may finish")->capture_default_str();
  cmd->add_option("--exit-on-device-loss", f.exit_on_device_loss,
                  "a lost device (a sticky CUDA error) stops the server as SIGTERM does, exit status 1, so a supervisor starts a "
                  "new process; false: it stays up refusing requests and /health answers 503 (true/false)")->capture_default_str();
  cmd->add_option("--io-threads", f.n_io_threads, "HTTP I/O threads")->capture_default_str();
  cmd->add_option("--max-n", f.max_n, "choices per request (\"n\") at most")->capture_default_str();
  cmd->add_option("--ws-max-message-bytes", f.ws_max_message_bytes, "WebSocket: largest client message (close 1009 beyond)")->capture_default_str();
  cmd->add_option("--ws-max-queue-bytes", f.ws_max_queue_bytes, "WebSocket: outgoing queue per socket before backpressure")->capture_default_str();
  cmd->add_option("--ws-send-timeout-s", f.ws_send_timeout_s, "WebSocket: a write blocked this long closes the socket (1008)")->capture_default_str();
  cmd->add_option("--ws-max-generations", f.ws_max_generations, "WebSocket: live generations per socket")->capture_default_str();
  cmd->add_option("--ws-idle-timeout-s", f.ws_idle_timeout_s, "WebSocket: idle socket closed after this long (ping at half)")->capture_default_str();
  cmd->add_option("--ws-send-buffer-bytes", f.ws_send_buffer_bytes, "WebSocket: SO_SNDBUF of the socket (0: the system's)")->capture_default_str();
  cmd->add_option("--chat-template", f.chat_template,
                  "chat format instead of the model's own template: chatml, llama3, gemma or mistral (\"\": the model's)")
      ->capture_default_str();
  cmd->add_option("--max-models", f.max_models, "models served at once: the default plus those added with POST /admin/models/load")
      ->capture_default_str();
  cmd->add_option("--reload-drain-timeout-s", f.reload_drain_timeout_s,
                  "hot reload: a replaced model version's generations still running after this long are ended")
      ->capture_default_str();
  cmd->add_option("--reload-warmup-timeout-s", f.reload_warmup_timeout_s, "hot reload: the new version's warm-up generation must finish within it")
      ->capture_default_str();
  cmd->add_option("--publish-port", f.publish_port,
                  "data parallel: publish the default model's engine at this port for fronts (0: any free; -1: off)")
      ->capture_default_str();
  cmd->add_option("--publish-host", f.publish_host, "data parallel: the address the engine is published on (trusted networks only)")
      ->capture_default_str();
  cmd->add_option("--replica", f.replicas, "data parallel: HOST:PORT of a published server of the same model to route to as well (repeatable)");
  cmd->add_option("--local-replica", f.replica_local,
                  "data parallel: false makes this server a router only (no executor of its own; needs --replica)")
      ->capture_default_str();
  cmd->add_option("--replica-retry-s", f.replica_retry_s, "data parallel: an unreachable, lost or mismatched replica is tried again this often")
      ->capture_default_str();
  cmd->add_option("--replica-timeout-s", f.replica_timeout_s, "data parallel: connecting to a replica and its first answer, at most")
      ->capture_default_str();
  cmd->add_option("--replica-heartbeat-s", f.replica_heartbeat_s, "data parallel: heartbeats on replica connections, this often")
      ->capture_default_str();
  cmd->add_option("--replica-dead-after-s", f.replica_dead_after_s, "data parallel: a replica connection silent this long is dropped")
      ->capture_default_str();
  cmd->add_option("--replica-routing", f.replica_routing,
                  "data parallel: prefix (to the replica that took the prompt's longest known prefix) or least_loaded")
      ->capture_default_str();
  cmd->add_option("--replica-max-imbalance", f.replica_max_imbalance,
                  "data parallel: prefix routing yields to the least loaded replica beyond this many more in flight")
      ->capture_default_str();
  cmd->add_option("--replica-affinity-blocks", f.replica_affinity_blocks, "data parallel: prompt prefixes (KV blocks) the router remembers")
      ->capture_default_str();
  cmd->add_option("--replica-tls-cert", f.replica_tls_cert,
                  "data parallel: TLS on replica connections, both ways: this server's certificate (PEM; with --replica-tls-key, --replica-tls-ca)");
  cmd->add_option("--replica-tls-key", f.replica_tls_key, "data parallel: the key of --replica-tls-cert (PEM, unencrypted)");
  cmd->add_option("--replica-tls-ca", f.replica_tls_ca,
                  "data parallel: the CA a peer's certificate must chain to (peers without one are refused)");
  cmd->add_option("--api-key", f.api_keys, "API key clients send as 'Authorization: Bearer KEY' (repeatable; none: open)");
  cmd->add_option("--admin-api-key", f.admin_api_keys, "key for operator endpoints such as /metrics (repeatable; none: the API keys)");
  return [o] { return run_serve(*o); };
}

}  // namespace troupe::cli
