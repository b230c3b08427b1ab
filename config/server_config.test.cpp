#include "config/server_config.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <string>

using troupe::config::config_error;
using troupe::config::describe;
using troupe::config::load_toml;
using troupe::config::parse_toml;
using troupe::config::server_config;
using troupe::config::validate;

namespace {

// The config_error message of parse_toml(text), or "" when it parsed.
std::string parse_error(const std::string& text) {
  try {
    parse_toml(text, "t.toml");
  } catch (const config_error& e) {
    return e.what();
  }
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("server_config: an empty file gives the documented defaults, which validate", "[config]") {
  const server_config c = parse_toml("");
  CHECK(c.host == "127.0.0.1");
  CHECK(c.port == 8080);
  CHECK(c.max_body_bytes == (1 << 20));
  CHECK(c.request_timeout_s == 600);
  CHECK(c.max_connections == 256);
  CHECK(c.engine.n_threads == 0);
  CHECK(c.engine.kv_block_size == 16);
  CHECK(c.engine.n_batch == 256);
  CHECK(c.kv_mb == 256);
  CHECK(c.max_num_seqs == 64);
  CHECK(c.max_waiting == 1024);
  CHECK(c.queue_timeout_s == 0);
  CHECK(c.preemption == "swap");
  CHECK(c.max_n == 16);
  CHECK(c.ws_max_queue_bytes == (1 << 20));
  CHECK(c.ws_send_timeout_s == 30);
  CHECK(c.ws_max_generations == 64);
  CHECK(c.api_keys.empty());
  CHECK(c.admin_api_keys.empty());
  CHECK(validate(c).empty());
}

TEST_CASE("server_config: the shipped config/troupe.toml parses to the defaults", "[config]") {
  const server_config c = load_toml(std::string(TROUPE_SOURCE_DIR) + "/config/troupe.toml");
  CHECK(describe(c) == describe(server_config{}));
}

TEST_CASE("server_config: file values override the defaults, other keys keep theirs", "[config]") {
  const server_config c = parse_toml(R"(
[server]
host = "0.0.0.0"
port = 9001
max_body_bytes = 4096
request_timeout_s = 30        # an integer is accepted for a float key
[engine]
model = "/models/x.gguf"
threads = 3
kv_block_size = 32
[scheduler]
max_num_seqs = 8
queue_timeout_s = 2.5
preemption = "recompute"
target_itl_ms = 60
itl_stretch = 1.5
min_prefill_tokens = 32
[replicas]
tls_cert = "/etc/troupe/me.pem"
tls_key = "/etc/troupe/me.key"
tls_ca = "/etc/troupe/ca.pem"
[auth]
api_keys = ["k1", "k2"]
admin_api_keys = ["adm"]
)");
  CHECK(c.replica_tls_cert == "/etc/troupe/me.pem");
  CHECK(c.replica_tls_key == "/etc/troupe/me.key");
  CHECK(c.replica_tls_ca == "/etc/troupe/ca.pem");
  CHECK(c.host == "0.0.0.0");
  CHECK(c.port == 9001);
  CHECK(c.max_body_bytes == 4096);
  CHECK(c.request_timeout_s == 30.0);
  CHECK(c.engine.model_path == "/models/x.gguf");
  CHECK(c.engine.n_threads == 3);
  CHECK(c.engine.kv_block_size == 32);
  CHECK(c.max_num_seqs == 8);
  CHECK(c.queue_timeout_s == 2.5);
  CHECK(c.preemption == "recompute");
  CHECK(c.target_itl_ms == 60.0);
  CHECK(c.itl_stretch == 1.5);
  CHECK(c.min_prefill_tokens == 32);
  CHECK(c.api_keys == std::vector<std::string>{"k1", "k2"});
  CHECK(c.admin_api_keys == std::vector<std::string>{"adm"});
  // untouched
  CHECK(c.max_connections == 256);
  CHECK(c.engine.n_batch == 256);
  CHECK(c.max_waiting == 1024);
  CHECK(validate(c).empty());
}

TEST_CASE("server_config: an unknown key or section is named", "[config]") {
  CHECK(contains(parse_error("[server]\nprot = 1\n"), "unknown key 'server.prot'"));
  CHECK(contains(parse_error("[servre]\nport = 1\n"), "unknown key 'servre'"));
  CHECK(contains(parse_error("port = 1\n"), "unknown key 'port'"));
  CHECK(contains(parse_error("[engine]\nmax_num_seqs = 4\n"), "unknown key 'engine.max_num_seqs'"));
}

TEST_CASE("server_config: a value of the wrong type is named with what was expected", "[config]") {
  const std::string e1 = parse_error("[server]\nport = \"8080\"\n");
  CHECK(contains(e1, "key 'server.port'"));
  CHECK(contains(e1, "expected an integer, got a string"));
  CHECK(contains(parse_error("[server]\nport = 80.5\n"), "key 'server.port': expected an integer, got a float"));
  CHECK(contains(parse_error("[server]\nrequest_timeout_s = true\n"), "key 'server.request_timeout_s': expected a number"));
  CHECK(contains(parse_error("[auth]\napi_keys = \"k1\"\n"), "key 'auth.api_keys': expected an array of strings"));
  CHECK(contains(parse_error("[scheduler]\nplan_ahead = 1\n"), "key 'scheduler.plan_ahead': expected a boolean"));
  CHECK(contains(parse_error("[engine]\ncuda_fused_decode = \"yes\"\n"), "key 'engine.cuda_fused_decode': expected a boolean"));
  CHECK(contains(parse_error("[auth]\napi_keys = [\"k1\", 2]\n"), "key 'auth.api_keys': expected an array of strings, found an integer"));
  CHECK(contains(parse_error("server = 3\n"), "key 'server': expected a table"));
  CHECK(contains(parse_error("[engine]\nthreads = 99999999999\n"), "key 'engine.threads': integer out of range"));
}

TEST_CASE("server_config: a TOML syntax error names the file and line", "[config]") {
  const std::string e = parse_error("[server]\nport = 80\nhost = \n");
  CHECK(contains(e, "t.toml:3:"));
}

TEST_CASE("server_config: out-of-range values are named by validate()", "[config]") {
  struct bad_case {
    const char* toml;
    const char* key;
  };
  const bad_case cases[] = {
      {"[server]\nport = 70000", "server.port (--port) must be in [0, 65535], got 70000"},
      {"[server]\nport = -1", "server.port (--port)"},
      {"[server]\nmax_body_bytes = 0", "server.max_body_bytes (--max-body-bytes)"},
      {"[server]\nrequest_timeout_s = 0", "server.request_timeout_s (--request-timeout-s) must be > 0"},
      {"[server]\nrequest_timeout_s = nan", "server.request_timeout_s"},
      {"[server]\nmax_connections = 0", "server.max_connections"},
      {"[server]\nshutdown_grace_s = -1", "server.shutdown_grace_s"},
      {"[scheduler]\nstep_timeout_s = 0", "scheduler.step_timeout_s (--step-timeout-s) must be > 0"},
      {"[scheduler]\nexecutor_stop_timeout_s = inf", "scheduler.executor_stop_timeout_s (--executor-stop-timeout-s)"},
      {"[scheduler]\nmax_restarts = -1", "scheduler.max_restarts (--max-restarts) must be in [0, 1000]"},
      {"[scheduler]\nrestart_window_s = 0", "scheduler.restart_window_s (--restart-window-s)"},
      {"[scheduler]\ncircuit_reset_s = -1", "scheduler.circuit_reset_s (--circuit-reset-s) must be >= 0 (0: never)"},
      {"[engine]\nchat_template = \"jinja\"", "engine.chat_template (--chat-template)"},
      {"[engine]\nload_format = \"safetensors\"", "engine.load_format (--load-format) must be \"auto\" or \"dummy\""},
      {"[engine]\ndummy_seed = -1", "engine.dummy_seed (--dummy-seed) must be >= 0"},
      {"[reload]\nmax_models = 0", "reload.max_models (--max-models) must be in [1, 64]"},
      {"[reload]\ndrain_timeout_s = -1", "reload.drain_timeout_s (--reload-drain-timeout-s) must be >= 0"},
      {"[reload]\nwarmup_timeout_s = 0", "reload.warmup_timeout_s (--reload-warmup-timeout-s) must be > 0"},
      {"[server]\nio_threads = 0", "server.io_threads"},
      {"[server]\nhost = \"\"", "server.host"},
      {"[server]\nmax_header_bytes = 10", "server.max_header_bytes (--max-header-bytes)"},
      {"[server]\nidle_timeout_s = 0", "server.idle_timeout_s (--idle-timeout-s) must be > 0"},
      {"[server]\nmax_n = 0", "server.max_n (--max-n) must be in [1, 128], got 0"},
      {"[websocket]\nmax_queue_bytes = 10", "websocket.max_queue_bytes (--ws-max-queue-bytes)"},
      {"[websocket]\nsend_timeout_s = 0", "websocket.send_timeout_s (--ws-send-timeout-s) must be > 0"},
      {"[websocket]\nmax_generations = 0", "websocket.max_generations"},
      {"[websocket]\nidle_timeout_s = -1", "websocket.idle_timeout_s"},
      {"[websocket]\nmax_message_bytes = 1", "websocket.max_message_bytes"},
      {"[websocket]\nsend_buffer_bytes = -1", "websocket.send_buffer_bytes"},
      {"[engine]\nthreads = -2", "engine.threads (--threads)"},
      {"[engine]\nctx_size = -1", "engine.ctx_size"},
      {"[engine]\nkv_block_size = 24", "engine.kv_block_size (--kv-block-size) must be a power of two"},
      {"[engine]\nbatch_size = 0", "engine.batch_size"},
      {"[engine]\nkv_mb = 0", "engine.kv_mb (--kv-mb)"},
      {"[engine]\ndevice = \"gpu\"", "engine.device (--device) must be \"cpu\", \"cuda\" or \"cuda:N\", got \"gpu\""},
      {"[scheduler]\nmax_num_seqs = 0", "scheduler.max_num_seqs"},
      {"[scheduler]\nmax_waiting = -1", "scheduler.max_waiting"},
      {"[scheduler]\nmax_waiting_tokens = -1", "scheduler.max_waiting_tokens"},
      {"[scheduler]\nqueue_timeout_s = -0.5", "scheduler.queue_timeout_s"},
      {"[scheduler]\ntarget_itl_ms = -5", "scheduler.target_itl_ms (--target-itl-ms) must be >= 0 (0: off)"},
      {"[scheduler]\nitl_stretch = 0.5", "scheduler.itl_stretch (--itl-stretch) must be >= 1"},
      {"[scheduler]\nmin_prefill_tokens = 0", "scheduler.min_prefill_tokens (--min-prefill-tokens)"},
      {"[scheduler]\npreemption = \"drop\"", "scheduler.preemption (--preemption) must be \"swap\" or \"recompute\", got \"drop\""},
      {"[replicas]\ntls_cert = \"a.pem\"\ntls_key = \"a.key\"", "replicas.tls_cert, tls_key and tls_ca (--replica-tls-cert, --replica-tls-key, --replica-tls-ca): all three or none"},
      {"[auth]\napi_keys = [\"\"]", "auth.api_keys (--api-key): a key must not be empty"},
      {"[auth]\nadmin_api_keys = [\"has space\"]", "auth.admin_api_keys (--admin-api-key): a key must be printable"},
  };
  for (const auto& bc : cases) {
    INFO(bc.toml);
    const server_config c = parse_toml(bc.toml);  // types are right: parsing succeeds
    const std::string err = validate(c);
    CHECK(contains(err, bc.key));
    CHECK(err.find('\n') == std::string::npos);
  }
}

TEST_CASE("server_config: describe() redacts API keys and round-trips through parse_toml", "[config]") {
  server_config c = parse_toml("[server]\nport = 1234\n[websocket]\nsend_timeout_s = 2.5\n[engine]\ncuda_graphs = false\ncuda_fused_decode = true\nmodel = \"qwen2.5-7b\"\nload_format = \"dummy\"\ndummy_seed = 9\n[scheduler]\nplan_ahead = false\ntarget_itl_ms = 45.5\n[auth]\napi_keys = [\"secret-one\", \"secret-two\"]\nadmin_api_keys = [\"adm1n\"]\n");
  CHECK_FALSE(c.engine.cuda_graphs);
  CHECK(c.engine.cuda_fused_decode);
  const std::string d = describe(c);
  CHECK_FALSE(contains(d, "secret"));
  CHECK_FALSE(contains(d, "adm1n"));
  CHECK(contains(d, "api_keys = [\"***\", \"***\"]"));
  const server_config back = parse_toml(d);
  CHECK(back.port == 1234);
  CHECK(back.ws_send_timeout_s == 2.5);
  CHECK_FALSE(back.plan_ahead);
  CHECK_FALSE(back.engine.cuda_graphs);
  CHECK(back.engine.cuda_fused_decode);
  CHECK(back.engine.model_path == "qwen2.5-7b");
  CHECK(back.engine.load_format == "dummy");
  CHECK(back.engine.dummy_seed == 9);
  CHECK(back.target_itl_ms == 45.5);
  CHECK(back.api_keys.size() == 2);
}

TEST_CASE("server_config: load_toml reports an unreadable file", "[config]") {
  CHECK_THROWS_WITH(load_toml("/nonexistent/troupe.toml"), Catch::Contains("cannot read the config file /nonexistent/troupe.toml"));
}
