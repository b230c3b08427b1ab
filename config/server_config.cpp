#include "config/server_config.hpp"

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include <toml++/toml.h>

namespace troupe::config {

namespace {

// One settable key: where it lives and how a TOML node becomes its value. `set` returns an error
// naming what was expected, or "".
struct key_spec {
  const char* section;
  const char* key;
  std::function<std::string(const toml::node&, server_config&)> set;
};

std::string type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    default: return "a date or time";
  }
}

template <class T>
auto int_key(T server_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<int64_t>();
    if (!v) return "expected an integer, got " + type_name(n);
    c.*field = (T)*v;
    if ((int64_t)(c.*field) != *v) return "integer out of range: " + std::to_string(*v);
    return {};
  };
}

template <class T>
auto engine_int_key(T engine_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<int64_t>();
    if (!v) return "expected an integer, got " + type_name(n);
    if (*v < INT32_MIN || *v > INT32_MAX) return "integer out of range: " + std::to_string(*v);
    c.engine.*field = (T)*v;
    return {};
  };
}

auto engine_bool_key(bool engine_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<bool>();
    if (!v) return "expected a boolean, got " + type_name(n);
    c.engine.*field = *v;
    return {};
  };
}

auto double_key(double server_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    if (!n.is_number()) return "expected a number, got " + type_name(n);
    c.*field = n.is_integer() ? (double)*n.value_exact<int64_t>() : *n.value_exact<double>();
    return {};
  };
}

auto string_key(std::string server_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<std::string>();
    if (!v) return "expected a string, got " + type_name(n);
    c.*field = *v;
    return {};
  };
}

auto engine_string_key(std::string engine_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<std::string>();
    if (!v) return "expected a string, got " + type_name(n);
    c.engine.*field = *v;
    return {};
  };
}

auto bool_key(bool server_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const auto v = n.value_exact<bool>();
    if (!v) return "expected a boolean, got " + type_name(n);
    c.*field = *v;
    return {};
  };
}

auto string_list_key(std::vector<std::string> server_config::*field) {
  return [field](const toml::node& n, server_config& c) -> std::string {
    const toml::array* a = n.as_array();
    if (!a) return "expected an array of strings, got " + type_name(n);
    std::vector<std::string> out;
    for (const toml::node& e : *a) {
      const auto v = e.value_exact<std::string>();
      if (!v) return "expected an array of strings, found " + type_name(e);
      out.push_back(*v);
    }
    c.*field = std::move(out);
    return {};
  };
}

const std::vector<key_spec>& keys() {
  static const std::vector<key_spec> k = {
      {"server", "host", string_key(&server_config::host)},
      {"server", "port", int_key(&server_config::port)},
      {"server", "max_body_bytes", int_key(&server_config::max_body_bytes)},
      {"server", "max_header_bytes", int_key(&server_config::max_header_bytes)},
      {"server", "request_timeout_s", double_key(&server_config::request_timeout_s)},
      {"server", "idle_timeout_s", double_key(&server_config::idle_timeout_s)},
      {"server", "max_connections", int_key(&server_config::max_connections)},
      {"server", "shutdown_grace_s", double_key(&server_config::shutdown_grace_s)},
      {"server", "exit_on_device_loss", bool_key(&server_config::exit_on_device_loss)},
      {"server", "io_threads", int_key(&server_config::n_io_threads)},
      {"server", "max_n", int_key(&server_config::max_n)},
      {"websocket", "max_message_bytes", int_key(&server_config::ws_max_message_bytes)},
      {"websocket", "max_queue_bytes", int_key(&server_config::ws_max_queue_bytes)},
      {"websocket", "send_timeout_s", double_key(&server_config::ws_send_timeout_s)},
      {"websocket", "max_generations", int_key(&server_config::ws_max_generations)},
      {"websocket", "idle_timeout_s", double_key(&server_config::ws_idle_timeout_s)},
      {"websocket", "send_buffer_bytes", int_key(&server_config::ws_send_buffer_bytes)},
      {"reload", "drain_timeout_s", double_key(&server_config::reload_drain_timeout_s)},
      {"reload", "warmup_timeout_s", double_key(&server_config::reload_warmup_timeout_s)},
      {"reload", "max_models", int_key(&server_config::max_models)},
      {"engine", "model", engine_string_key(&engine_config::model_path)},
      {"engine", "load_format", engine_string_key(&engine_config::load_format)},
      {"engine", "dummy_seed", engine_int_key(&engine_config::dummy_seed)},
      {"engine", "threads", engine_int_key(&engine_config::n_threads)},
      {"engine", "ctx_size", engine_int_key(&engine_config::n_ctx)},
      {"engine", "kv_block_size", engine_int_key(&engine_config::kv_block_size)},
      {"engine", "batch_size", engine_int_key(&engine_config::n_batch)},
      {"engine", "tensor_parallel", engine_int_key(&engine_config::tensor_parallel)},
      {"engine", "pipeline_parallel", engine_int_key(&engine_config::pipeline_parallel)},
      {"engine", "expert_parallel", engine_int_key(&engine_config::expert_parallel)},
      {"engine", "kv_mb", int_key(&server_config::kv_mb)},
      {"engine", "swa_full", engine_bool_key(&engine_config::swa_full)},
      {"engine", "chat_template", string_key(&server_config::chat_template)},
      {"engine", "device", engine_string_key(&engine_config::device)},
      {"engine", "cuda_graphs", engine_bool_key(&engine_config::cuda_graphs)},
      {"engine", "cuda_fused_decode", engine_bool_key(&engine_config::cuda_fused_decode)},
      {"scheduler", "max_num_seqs", int_key(&server_config::max_num_seqs)},
      {"scheduler", "max_waiting", int_key(&server_config::max_waiting)},
      {"scheduler", "max_waiting_tokens", int_key(&server_config::max_waiting_tokens)},
      {"scheduler", "queue_timeout_s", double_key(&server_config::queue_timeout_s)},
      {"scheduler", "preemption", string_key(&server_config::preemption)},
      {"scheduler", "plan_ahead", bool_key(&server_config::plan_ahead)},
      {"scheduler", "target_itl_ms", double_key(&server_config::target_itl_ms)},
      {"scheduler", "itl_stretch", double_key(&server_config::itl_stretch)},
      {"scheduler", "min_prefill_tokens", int_key(&server_config::min_prefill_tokens)},
      {"scheduler", "step_timeout_s", double_key(&server_config::step_timeout_s)},
      {"scheduler", "executor_stop_timeout_s", double_key(&server_config::executor_stop_timeout_s)},
      {"scheduler", "max_restarts", int_key(&server_config::max_restarts)},
      {"scheduler", "restart_window_s", double_key(&server_config::restart_window_s)},
      {"scheduler", "circuit_reset_s", double_key(&server_config::circuit_reset_s)},
      {"replicas", "publish_port", int_key(&server_config::publish_port)},
      {"replicas", "publish_host", string_key(&server_config::publish_host)},
      {"replicas", "remote", string_list_key(&server_config::replicas)},
      {"replicas", "local", bool_key(&server_config::replica_local)},
      {"replicas", "retry_s", double_key(&server_config::replica_retry_s)},
      {"replicas", "timeout_s", double_key(&server_config::replica_timeout_s)},
      {"replicas", "heartbeat_s", double_key(&server_config::replica_heartbeat_s)},
      {"replicas", "dead_after_s", double_key(&server_config::replica_dead_after_s)},
      {"replicas", "routing", string_key(&server_config::replica_routing)},
      {"replicas", "max_imbalance", int_key(&server_config::replica_max_imbalance)},
      {"replicas", "affinity_blocks", int_key(&server_config::replica_affinity_blocks)},
      {"replicas", "tls_cert", string_key(&server_config::replica_tls_cert)},
      {"replicas", "tls_key", string_key(&server_config::replica_tls_key)},
      {"replicas", "tls_ca", string_key(&server_config::replica_tls_ca)},
      {"auth", "api_keys", string_list_key(&server_config::api_keys)},
      {"auth", "admin_api_keys", string_list_key(&server_config::admin_api_keys)},
  };
  return k;
}

std::string quote(const std::string& s) {
  std::ostringstream o;
  o << toml::value<std::string>(s);
  return o.str();
}

std::string range_error(const char* key, const char* flag, const std::string& range, const std::string& got) {
  return std::string(key) + " (" + flag + ") must be " + range + ", got " + got;
}

std::string num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

server_config parse_toml(std::string_view text, std::string_view source) {
  const std::string src(source);
  toml::table root;
  try {
    root = toml::parse(text, src);
  } catch (const toml::parse_error& e) {
    throw config_error(src + ":" + std::to_string(e.source().begin.line) + ": " + std::string(e.description()));
  }
  server_config c;
  for (const auto& [section_key, section] : root) {
    const std::string section_name(section_key.str());
    const toml::table* t = section.as_table();
    bool known_section = false;
    for (const auto& k : keys()) known_section |= section_name == k.section;
    if (!known_section) throw config_error(src + ": unknown key '" + section_name + "' (sections: server, websocket, reload, replicas, engine, scheduler, auth)");
    if (!t) throw config_error(src + ": key '" + section_name + "': expected a table, got " + type_name(section));
    for (const auto& [key, value] : *t) {
      const std::string name = section_name + "." + std::string(key.str());
      const key_spec* spec = nullptr;
      for (const auto& k : keys())
        if (section_name == k.section && key.str() == k.key) spec = &k;
      if (!spec) throw config_error(src + ": unknown key '" + name + "'");
      if (std::string err = spec->set(value, c); !err.empty()) throw config_error(src + ": key '" + name + "': " + err);
    }
  }
  return c;
}

server_config load_toml(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw config_error("cannot read the config file " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return parse_toml(s.str(), path);
}

std::string validate(const server_config& c) {
  if (c.host.empty()) return "server.host (--host) must not be empty";
  if (c.port < 0 || c.port > 65535) return range_error("server.port", "--port", "in [0, 65535]", std::to_string(c.port));
  if (c.max_body_bytes < 1 || c.max_body_bytes > (int64_t(1) << 32))
    return range_error("server.max_body_bytes", "--max-body-bytes", "in [1, 4294967296]", std::to_string(c.max_body_bytes));
  if (c.max_header_bytes < 1024 || c.max_header_bytes > (int64_t(1) << 24))
    return range_error("server.max_header_bytes", "--max-header-bytes", "in [1024, 16777216]", std::to_string(c.max_header_bytes));
  if (!(c.idle_timeout_s > 0) || !std::isfinite(c.idle_timeout_s))
    return range_error("server.idle_timeout_s", "--idle-timeout-s", "> 0", num(c.idle_timeout_s));
  if (!(c.request_timeout_s > 0) || !std::isfinite(c.request_timeout_s))
    return range_error("server.request_timeout_s", "--request-timeout-s", "> 0", num(c.request_timeout_s));
  if (c.max_connections < 1 || c.max_connections > 1000000)
    return range_error("server.max_connections", "--max-connections", "in [1, 1000000]", std::to_string(c.max_connections));
  if (!(c.shutdown_grace_s >= 0) || !std::isfinite(c.shutdown_grace_s))
    return range_error("server.shutdown_grace_s", "--shutdown-grace-s", ">= 0", num(c.shutdown_grace_s));
  if (!(c.reload_drain_timeout_s >= 0) || !std::isfinite(c.reload_drain_timeout_s))
    return range_error("reload.drain_timeout_s", "--reload-drain-timeout-s", ">= 0", num(c.reload_drain_timeout_s));
  if (!(c.reload_warmup_timeout_s > 0) || !std::isfinite(c.reload_warmup_timeout_s))
    return range_error("reload.warmup_timeout_s", "--reload-warmup-timeout-s", "> 0", num(c.reload_warmup_timeout_s));
  if (c.max_models < 1 || c.max_models > 64) return range_error("reload.max_models", "--max-models", "in [1, 64]", std::to_string(c.max_models));
  if (c.n_io_threads < 1 || c.n_io_threads > 256) return range_error("server.io_threads", "--io-threads", "in [1, 256]", std::to_string(c.n_io_threads));
  if (c.max_n < 1 || c.max_n > 128) return range_error("server.max_n", "--max-n", "in [1, 128]", std::to_string(c.max_n));

  if (c.ws_max_message_bytes < 64 || c.ws_max_message_bytes > (int64_t(1) << 30))
    return range_error("websocket.max_message_bytes", "--ws-max-message-bytes", "in [64, 1073741824]", std::to_string(c.ws_max_message_bytes));
  if (c.ws_max_queue_bytes < 1024 || c.ws_max_queue_bytes > (int64_t(1) << 30))
    return range_error("websocket.max_queue_bytes", "--ws-max-queue-bytes", "in [1024, 1073741824]", std::to_string(c.ws_max_queue_bytes));
  if (!(c.ws_send_timeout_s > 0) || !std::isfinite(c.ws_send_timeout_s))
    return range_error("websocket.send_timeout_s", "--ws-send-timeout-s", "> 0", num(c.ws_send_timeout_s));
  if (c.ws_max_generations < 1 || c.ws_max_generations > 65536)
    return range_error("websocket.max_generations", "--ws-max-generations", "in [1, 65536]", std::to_string(c.ws_max_generations));
  if (!(c.ws_idle_timeout_s > 0) || !std::isfinite(c.ws_idle_timeout_s))
    return range_error("websocket.idle_timeout_s", "--ws-idle-timeout-s", "> 0", num(c.ws_idle_timeout_s));
  if (c.ws_send_buffer_bytes < 0 || c.ws_send_buffer_bytes > (int64_t(1) << 30))
    return range_error("websocket.send_buffer_bytes", "--ws-send-buffer-bytes", "in [0, 1073741824] (0: the system's)", std::to_string(c.ws_send_buffer_bytes));

  const engine_config& e = c.engine;
  if (e.n_threads < 0 || e.n_threads > 1024) return range_error("engine.threads", "--threads", "in [0, 1024] (0: automatic)", std::to_string(e.n_threads));
  if (e.n_ctx < 0 || e.n_ctx > (1 << 20)) return range_error("engine.ctx_size", "--ctx-size", "in [0, 1048576] (0: the model's)", std::to_string(e.n_ctx));
  if (e.kv_block_size < 1 || e.kv_block_size > 1024 || (e.kv_block_size & (e.kv_block_size - 1)))
    return range_error("engine.kv_block_size", "--kv-block-size", "a power of two in [1, 1024]", std::to_string(e.kv_block_size));
  if (e.n_batch < 1 || e.n_batch > 65536) return range_error("engine.batch_size", "--batch-size", "in [1, 65536]", std::to_string(e.n_batch));
  if (e.tensor_parallel < 1 || e.tensor_parallel > 64)
    return range_error("engine.tensor_parallel", "--tensor-parallel", "in [1, 64]", std::to_string(e.tensor_parallel));
  if (e.pipeline_parallel < 1 || e.pipeline_parallel > 64)
    return range_error("engine.pipeline_parallel", "--pipeline-parallel", "in [1, 64]", std::to_string(e.pipeline_parallel));
  if (e.expert_parallel < 1 || e.expert_parallel > 64)
    return range_error("engine.expert_parallel", "--expert-parallel", "in [1, 64]", std::to_string(e.expert_parallel));
  if (e.expert_parallel > 1 && (e.tensor_parallel > 1 || e.pipeline_parallel > 1))
    return "engine.expert_parallel (--expert-parallel) > 1 cannot be combined with engine.tensor_parallel or pipeline_parallel > 1 yet";
  if (e.tensor_parallel * e.pipeline_parallel > 64)
    return range_error("engine.tensor_parallel x pipeline_parallel", "--tensor-parallel x --pipeline-parallel", "at most 64",
                       std::to_string(e.tensor_parallel * e.pipeline_parallel));
  try {
    parse_device(e.device);
  } catch (const std::invalid_argument&) {
    return range_error("engine.device", "--device", "\"cpu\", \"cuda\" or \"cuda:N\"", "\"" + e.device + "\"");
  }
  if (e.load_format != "auto" && e.load_format != "dummy")
    return range_error("engine.load_format", "--load-format", "\"auto\" or \"dummy\"", "\"" + e.load_format + "\"");
  if (e.dummy_seed < 0) return range_error("engine.dummy_seed", "--dummy-seed", ">= 0", std::to_string(e.dummy_seed));
  if (c.kv_mb < 1 || c.kv_mb > (int64_t(1) << 24)) return range_error("engine.kv_mb", "--kv-mb", "in [1, 16777216]", std::to_string(c.kv_mb));
  if (!c.chat_template.empty() && c.chat_template != "chatml" && c.chat_template != "llama3" && c.chat_template != "gemma" &&
      c.chat_template != "mistral")
    return range_error("engine.chat_template", "--chat-template", "\"\" (the model's own), \"chatml\", \"llama3\", \"gemma\" or \"mistral\"",
                       "\"" + c.chat_template + "\"");

  if (c.max_num_seqs < 1 || c.max_num_seqs > 65536) return range_error("scheduler.max_num_seqs", "--max-num-seqs", "in [1, 65536]", std::to_string(c.max_num_seqs));
  if (c.max_waiting < 0 || c.max_waiting > INT32_MAX) return range_error("scheduler.max_waiting", "--max-waiting", "in [0, 2147483647]", std::to_string(c.max_waiting));
  if (c.max_waiting_tokens < 0) return range_error("scheduler.max_waiting_tokens", "--max-waiting-tokens", ">= 0", std::to_string(c.max_waiting_tokens));
  if (!(c.queue_timeout_s >= 0) || !std::isfinite(c.queue_timeout_s))
    return range_error("scheduler.queue_timeout_s", "--queue-timeout-s", ">= 0 (0: none)", num(c.queue_timeout_s));
  if (!(c.target_itl_ms >= 0) || !std::isfinite(c.target_itl_ms))
    return range_error("scheduler.target_itl_ms", "--target-itl-ms", ">= 0 (0: off)", num(c.target_itl_ms));
  if (!(c.itl_stretch >= 1) || !std::isfinite(c.itl_stretch))
    return range_error("scheduler.itl_stretch", "--itl-stretch", ">= 1", num(c.itl_stretch));
  if (c.min_prefill_tokens < 1 || c.min_prefill_tokens > 65536)
    return range_error("scheduler.min_prefill_tokens", "--min-prefill-tokens", "in [1, 65536]", std::to_string(c.min_prefill_tokens));
  if (!(c.step_timeout_s > 0) || !std::isfinite(c.step_timeout_s))
    return range_error("scheduler.step_timeout_s", "--step-timeout-s", "> 0", num(c.step_timeout_s));
  if (!(c.executor_stop_timeout_s > 0) || !std::isfinite(c.executor_stop_timeout_s))
    return range_error("scheduler.executor_stop_timeout_s", "--executor-stop-timeout-s", "> 0", num(c.executor_stop_timeout_s));
  if (c.max_restarts < 0 || c.max_restarts > 1000)
    return range_error("scheduler.max_restarts", "--max-restarts", "in [0, 1000]", std::to_string(c.max_restarts));
  if (!(c.restart_window_s > 0) || !std::isfinite(c.restart_window_s))
    return range_error("scheduler.restart_window_s", "--restart-window-s", "> 0", num(c.restart_window_s));
  if (!(c.circuit_reset_s >= 0) || !std::isfinite(c.circuit_reset_s))
    return range_error("scheduler.circuit_reset_s", "--circuit-reset-s", ">= 0 (0: never)", num(c.circuit_reset_s));
  if (c.preemption != "swap" && c.preemption != "recompute")
    return range_error("scheduler.preemption", "--preemption", "\"swap\" or \"recompute\"", "\"" + c.preemption + "\"");

  if (c.publish_port < -1 || c.publish_port > 65535)
    return range_error("replicas.publish_port", "--publish-port", "in [-1, 65535] (-1: off, 0: any free port)", std::to_string(c.publish_port));
  if (c.publish_host.empty()) return "replicas.publish_host (--publish-host) must not be empty";
  for (const std::string& r : c.replicas) {
    const size_t colon = r.rfind(':');
    const std::string port = colon == std::string::npos ? "" : r.substr(colon + 1);
    if (colon == 0 || port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stol(port) < 1 || std::stol(port) > 65535)
      return "replicas.remote (--replica): '" + r + "' is not HOST:PORT with a port in [1, 65535]";
  }
  if (!c.replica_local && c.replicas.empty())
    return "replicas.local (--local-replica) false: a router only needs at least one replicas.remote (--replica)";
  if (!c.replica_local && c.publish_port >= 0)
    return "replicas.local (--local-replica) false: a router only has no engine to publish (replicas.publish_port, --publish-port)";
  if (!(c.replica_retry_s > 0) || !std::isfinite(c.replica_retry_s))
    return range_error("replicas.retry_s", "--replica-retry-s", "> 0", num(c.replica_retry_s));
  if (!(c.replica_timeout_s > 0) || !std::isfinite(c.replica_timeout_s))
    return range_error("replicas.timeout_s", "--replica-timeout-s", "> 0", num(c.replica_timeout_s));
  if (!(c.replica_heartbeat_s > 0) || !std::isfinite(c.replica_heartbeat_s))
    return range_error("replicas.heartbeat_s", "--replica-heartbeat-s", "> 0", num(c.replica_heartbeat_s));
  if (!(c.replica_dead_after_s > c.replica_heartbeat_s) || !std::isfinite(c.replica_dead_after_s))
    return range_error("replicas.dead_after_s", "--replica-dead-after-s", "> replicas.heartbeat_s", num(c.replica_dead_after_s));
  if (c.replica_routing != "prefix" && c.replica_routing != "least_loaded")
    return range_error("replicas.routing", "--replica-routing", "\"prefix\" or \"least_loaded\"", "\"" + c.replica_routing + "\"");
  if (c.replica_max_imbalance < 0 || c.replica_max_imbalance > 1000000)
    return range_error("replicas.max_imbalance", "--replica-max-imbalance", "in [0, 1000000]", std::to_string(c.replica_max_imbalance));
  if (c.replica_affinity_blocks < 1 || c.replica_affinity_blocks > (int64_t(1) << 26))
    return range_error("replicas.affinity_blocks", "--replica-affinity-blocks", "in [1, 67108864]", std::to_string(c.replica_affinity_blocks));
  if (const int n = !c.replica_tls_cert.empty() + !c.replica_tls_key.empty() + !c.replica_tls_ca.empty(); n != 0 && n != 3)
    return "replicas.tls_cert, tls_key and tls_ca (--replica-tls-cert, --replica-tls-key, --replica-tls-ca): all three or none";

  for (const auto* list : {&c.api_keys, &c.admin_api_keys})
    for (const std::string& k : *list) {
      const char* name = list == &c.api_keys ? "auth.api_keys (--api-key)" : "auth.admin_api_keys (--admin-api-key)";
      if (k.size() < 1) return std::string(name) + ": a key must not be empty";
      for (unsigned char ch : k)
        if (ch <= 0x20 || ch >= 0x7f) return std::string(name) + ": a key must be printable ASCII without spaces";
    }
  return {};
}

std::string describe(const server_config& c) {
  auto redacted = [](const std::vector<std::string>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += i ? ", \"***\"" : "\"***\"";
    return s + "]";
  };
  auto list = [](const std::vector<std::string>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quote(v[i]);
    return s + "]";
  };
  const engine_config& e = c.engine;
  std::ostringstream o;
  o << "[server]\n"
    << "host = " << quote(c.host) << "\nport = " << c.port << "\nmax_body_bytes = " << c.max_body_bytes
    << "\nmax_header_bytes = " << c.max_header_bytes << "\nrequest_timeout_s = " << num(c.request_timeout_s)
    << "\nidle_timeout_s = " << num(c.idle_timeout_s) << "\nmax_connections = " << c.max_connections
    << "\nshutdown_grace_s = " << num(c.shutdown_grace_s)
    << "\nexit_on_device_loss = " << (c.exit_on_device_loss ? "true" : "false") << "\nio_threads = " << c.n_io_threads << "\nmax_n = " << c.max_n << "\n"
    << "[websocket]\n"
    << "max_message_bytes = " << c.ws_max_message_bytes << "\nmax_queue_bytes = " << c.ws_max_queue_bytes
    << "\nsend_timeout_s = " << num(c.ws_send_timeout_s) << "\nmax_generations = " << c.ws_max_generations
    << "\nidle_timeout_s = " << num(c.ws_idle_timeout_s) << "\nsend_buffer_bytes = " << c.ws_send_buffer_bytes << "\n"
    << "[reload]\n"
    << "drain_timeout_s = " << num(c.reload_drain_timeout_s) << "\nwarmup_timeout_s = " << num(c.reload_warmup_timeout_s)
    << "\nmax_models = " << c.max_models << "\n"
    << "[replicas]\n"
    << "publish_port = " << c.publish_port << "\npublish_host = " << quote(c.publish_host) << "\nremote = " << list(c.replicas)
    << "\nlocal = " << (c.replica_local ? "true" : "false")
    << "\nretry_s = " << num(c.replica_retry_s) << "\ntimeout_s = " << num(c.replica_timeout_s)
    << "\nheartbeat_s = " << num(c.replica_heartbeat_s) << "\ndead_after_s = " << num(c.replica_dead_after_s)
    << "\nrouting = " << quote(c.replica_routing) << "\nmax_imbalance = " << c.replica_max_imbalance
    << "\naffinity_blocks = " << c.replica_affinity_blocks << "\ntls_cert = " << quote(c.replica_tls_cert)
    << "\ntls_key = " << quote(c.replica_tls_key) << "\ntls_ca = " << quote(c.replica_tls_ca) << "\n"
    << "[engine]\n"
    << "model = " << quote(e.model_path) << "\nload_format = " << quote(e.load_format) << "\ndummy_seed = " << e.dummy_seed << "\nthreads = " << e.n_threads << "\nctx_size = " << e.n_ctx
    << "\nkv_block_size = " << e.kv_block_size << "\nbatch_size = " << e.n_batch << "\ntensor_parallel = " << e.tensor_parallel << "\npipeline_parallel = " << e.pipeline_parallel << "\nexpert_parallel = " << e.expert_parallel << "\nkv_mb = " << c.kv_mb
    << "\nswa_full = " << (e.swa_full ? "true" : "false")
    << "\ndevice = " << quote(e.device) << "\ncuda_graphs = " << (e.cuda_graphs ? "true" : "false")
    << "\ncuda_fused_decode = " << (e.cuda_fused_decode ? "true" : "false") << "\nchat_template = " << quote(c.chat_template) << "\n"
    << "[scheduler]\n"
    << "max_num_seqs = " << c.max_num_seqs << "\nmax_waiting = " << c.max_waiting << "\nmax_waiting_tokens = " << c.max_waiting_tokens
    << "\nqueue_timeout_s = " << num(c.queue_timeout_s) << "\npreemption = " << quote(c.preemption)
    << "\nplan_ahead = " << (c.plan_ahead ? "true" : "false") << "\ntarget_itl_ms = " << num(c.target_itl_ms)
    << "\nitl_stretch = " << num(c.itl_stretch) << "\nmin_prefill_tokens = " << c.min_prefill_tokens
    << "\nstep_timeout_s = " << num(c.step_timeout_s) << "\nexecutor_stop_timeout_s = " << num(c.executor_stop_timeout_s)
    << "\nmax_restarts = " << c.max_restarts << "\nrestart_window_s = " << num(c.restart_window_s)
    << "\ncircuit_reset_s = " << num(c.circuit_reset_s) << "\n"
    << "[auth]\n"
    << "api_keys = " << redacted(c.api_keys) << "\nadmin_api_keys = " << redacted(c.admin_api_keys) << "\n";
  return o.str();
}

}  // namespace troupe::config
