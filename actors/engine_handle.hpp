// The in-process serving engine: request, scheduler, executor and supervisor actors behind a
// plain C++ interface, so net/ and the tests submit generations without knowing CAF.
//
//   auto eng = engine_handle::start(opts);              // loads the model, spawns the actors
//   auto s = eng->submit(params);                        // never blocks
//   while (auto ev = s->next(std::chrono::seconds(5)))   // tokens, then one final event
//     ...
//   s->cancel();                                         // any time; frees its KV within a step
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "actors/scheduler_policy.hpp"
#include "engine/sampling.hpp"

namespace troupe::engine {
class model;
}

namespace troupe::actors {

/// Why a generation ended without finishing. The HTTP layer maps each to a status (one table in
/// net/): invalid 400, too_long 400, overloaded 429, queue_timeout 503, deadline 408,
/// cancelled 499 (client gone), unavailable 503, internal 500.
enum class gen_error : uint8_t { none, invalid, too_long, overloaded, queue_timeout, deadline, cancelled, unavailable, internal };
const char* to_string(gen_error e);

struct generation_params {
  std::vector<engine::token_id> prompt;
  engine::sampling_params sampling;
  int32_t max_tokens = 16;
  priority_class cls = priority_class::normal;
  int32_t priority = 0;
  double queue_timeout_s = 0;  // 0: the scheduler's default
  double deadline_s = 0;       // whole-request limit from submit; 0: none
};

/// One event of a generation's stream: a token, then exactly one final event (done or error).
struct stream_event {
  enum class kind : uint8_t { token, done, error };
  kind type = kind::token;
  engine::token_id token = -1;
  std::string text;  // text made complete by this token (valid UTF-8; stop strings removed)
  float logprob = 0;
  std::vector<engine::token_logprob> top;
  // done
  finish_reason finish = finish_reason::length;
  int32_t n_prompt = 0, n_generated = 0;
  // error
  gen_error error = gen_error::none;
  std::string message;
};

/// The client's end of one generation: a bounded, thread-safe queue the request actor fills.
/// Capacity is max_tokens + 2 events, so it never grows past what the request may produce.
class generation_stream {
 public:
  explicit generation_stream(size_t capacity) : capacity_(capacity) {}
  /// The next event, or nullopt after `timeout`. After the final event, nullopt at once.
  std::optional<stream_event> next(std::chrono::milliseconds timeout);
  /// Stops the generation (client gone); a final error event `cancelled` follows if none came.
  void cancel();
  /// Changes the generation's class and priority while it waits or runs (the scheduler orders and
  /// preempts by the new values from its next step on).
  void set_priority(priority_class cls, int32_t priority);
  /// Called (from an actor thread) after each push; set before events may arrive, i.e. right
  /// after submit() only if the caller tolerates a missed first wake-up — prefer next().
  void set_notify(std::function<void()> fn);
  bool finished() const;
  uint64_t id() const { return id_; }

  // Producer side (the request actor).
  void push(stream_event ev);
  void set_canceller(std::function<void()> fn, uint64_t id);
  void set_reprioritizer(std::function<void(priority_class, int32_t)> fn);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<stream_event> q_;
  size_t capacity_;
  bool final_pushed_ = false, final_taken_ = false;
  std::function<void()> notify_, canceller_;
  std::function<void(priority_class, int32_t)> reprioritizer_;
  uint64_t id_ = 0;
};

struct engine_options {
  std::string model_path;
  // Random weights of the model's shapes (engine::load_options::dummy; model_path may name a
  // built-in architecture), held on the host for the CPU executor only (a CUDA device makes its own).
  bool dummy_weights = false;
  uint64_t dummy_seed = 0;
  int n_threads = 1;
  int kv_block_size = 16;
  // Sliding-window layers in their own KV groups, each keeping its window's blocks only (CPU or
  // CUDA backend without pipeline stages; with them every layer keeps every position: engine_kv_shape).
  bool kv_window_groups = true;
  int32_t n_device_blocks = 0;  // 0: derived from max_kv_bytes
  int32_t n_host_blocks = 0;    // swap space; 0: as many as device blocks
  int64_t max_kv_bytes = 256LL << 20;
  int cuda_device = -1;          // the executor's device: -1 the CPU, else a CUDA device (a build with CUDA)
  bool cuda_graphs = true;       // CUDA: decode steps from CUDA graphs (config::engine_config)
  bool cuda_fused_decode = false;  // CUDA: the fused decode launches (config::engine_config)
  int tensor_parallel = 1;       // CPU: the forward split over this many ranks (heads, feed-forward columns)
  int pipeline_parallel = 1;     // CPU: the layers split over this many stages (micro-batches flow through)
  int expert_parallel = 1;       // CPU: a mixture of experts' experts split over this many ranks
  scheduler_config sched;
  double step_timeout_s = 120;   // an executor step longer than this counts as a failure: it is told to stop ...
  double executor_stop_timeout_s = 10;  // ... and one that has not within this is wedged (as a lost device)
  int max_restarts = 3;          // executor restarts within restart_window_s before the circuit opens
  double restart_window_s = 60;
  // The circuit opened on restarts is half opened this long after: a new executor is started, and
  // the circuit closes once it is up (0: it stays open until a reload). Never after a lost device.
  double circuit_reset_s = 30;
  // Called once, on an actor thread, when the executor's device is lost (a sticky CUDA error: the
  // process can never use the device again) or the executor is wedged (a step that neither
  // finished nor stopped: its thread cannot be reclaimed, and destroying this handle would wait
  // for it), with the reason requests are refused with. Must not block. The circuit is open by
  // then, whether or not this is set.
  std::function<void(const std::string&)> on_device_lost;
  // Called on an actor thread each time a local executor has built its backend (a restart
  // included): element r - 1 is the weight bytes a step of r token rows reads there (r up to
  // max_num_seqs), in the form that device holds and multiplies them at r rows (a CUDA device
  // reads a quantized file's blocks in small steps, bf16 above). troupe bench's roofline.
  std::function<void(const std::vector<size_t>&)> on_backend_up;
  double start_timeout_s = 600;  // longest wait for the executor to build its backend (weights, KV)
  std::string fail_executor_start;  // tests: building the executor's backend throws this text
  // Data-parallel replicas (CAF middleman). Plain TCP unless the TLS files are named: bind and
  // reach plain ones on trusted networks only.
  int publish_port = -1;                   // >= 0: this engine's scheduler is published there for fronts (0: any free port)
  bool publish_at_start = true;            // false: ready to publish (publish()), e.g. once a reload makes it current
  std::string publish_host = "127.0.0.1";  // the address it is published on
  std::vector<std::string> replicas;       // "host:port" of published engines (same model) this one also routes to
  bool local_executor = true;              // false: a router only (no executor, no KV memory): every generation
                                           // goes to a replica; start waits (start_timeout_s) until one serves
  double replica_retry_s = 2;              // an unreachable, lost or mismatched replica is tried again this often
  double replica_timeout_s = 10;           // connecting to a replica and its first answer, at most
  double replica_heartbeat_s = 1;          // both ends of a replica connection send a heartbeat this often ...
  double replica_dead_after_s = 10;        // ... and drop a peer silent this long (hung, or its machine gone)
  bool replica_prefix_routing = true;      // prompts sharing a prefix go to the same replica (its KV cached there)
  int64_t replica_max_imbalance = 4;       // ... unless it has this many more in flight than the least loaded
  int64_t replica_affinity_blocks = 65536; // prompt prefixes (full KV blocks) the router remembers
  // TLS on replica connections, both ways (CAF's OpenSSL module): this end's certificate (chain)
  // and key (PEM, unencrypted), and the CA file a peer's certificate must chain to. All three or
  // none; a peer without a certificate of that CA is refused, as is a plain-TCP peer.
  std::string replica_tls_cert, replica_tls_key, replica_tls_ca;
  // Tests: the CPU executor takes the path of a device that samples (rows, seeds and penalty
  // windows handed to the backend, tokens back), sampling with the host sampler.
  bool emulate_device_sampling = false;
};

/// The KV shape an engine started with `o` builds for model m: its sliding-window layers in groups
/// of their own when o.kv_window_groups and the backend supports it (no pipeline stages).
engine::kv_shape engine_kv_shape(const engine::model& m, const engine_options& o);

struct engine_stats {
  scheduler_stats sched;
  engine::block_manager_stats kv;
  int32_t n_device_blocks = 0, n_free_device = 0, n_cached = 0, n_host_blocks = 0, n_free_host = 0;
  int64_t max_positions = 0;  // positions one sequence can reach in the device pool (kv_max_positions)
  engine::kv_groups kv_groups;  // the KV layer groups (sliding-window layers apart) the pool serves
  size_t n_running = 0, n_waiting = 0;
  int32_t executor_restarts = 0;
  bool executor_alive = false, circuit_open = false;
  std::string device_lost;  // empty; else why the executor's device is lost (the circuit stays open)
  std::string invariant_error;  // empty when the scheduler core's check() holds
  // Where a step's time goes: the scheduler's own work (plan + apply results) vs the executor's.
  int64_t n_steps = 0;
  int64_t n_steps_ahead = 0;  // of them, planned while the step before was in flight
  double sched_s = 0;     // total in scheduler_core::schedule and on_step_done
  double executor_s = 0;  // total compute reported by the executor
};

/// One place generations run: "local" (this engine's own executor) or a remote replica "host:port".
struct replica_stats {
  std::string name;
  bool up = false;
  std::string status;      // "serving", or why not ("unreachable: ...", "lost: ...", "another model: ...")
  int64_t in_flight = 0;   // generations running or queued there now
  int64_t routed = 0;      // generations sent there since start (a rerouted one counts at each)
  int64_t lost = 0;        // generations that lost it mid-way (the replica died or its connection broke)
  int64_t prefix_routed = 0;  // of `routed`, sent there for a prompt prefix it had taken before
};

class engine_handle {
 public:
  /// Loads the model, spawns the actors and waits (start_timeout_s at most) until the executor
  /// has built its backend. Throws gguf_error or std::invalid_argument on a bad model or option
  /// (a KV cache larger than this machine's memory among them), std::runtime_error naming the
  /// cause when the executor cannot start (out of device memory, a failed launch) or in time.
  static std::unique_ptr<engine_handle> start(const engine_options& opts);
  ~engine_handle();  // cancels what is left and stops every actor

  /// Submits a generation to the replica (local executor or remote) with the fewest in flight.
  /// Refusals (invalid, too long, overloaded) arrive as the stream's single final error event. A
  /// generation whose replica is lost (or refuses it as unavailable) before its first token moves
  /// to another replica; one that loses its replica later ends with `unavailable`.
  std::shared_ptr<generation_stream> submit(generation_params p);

  /// A consistent snapshot from the scheduler (bounded wait; throws std::runtime_error on timeout).
  engine_stats stats(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  /// Stops admitting (new submits fail `unavailable`) and waits until every admitted generation
  /// has finished. True when drained within `timeout`.
  bool drain(std::chrono::milliseconds timeout);

  /// Ends every generation this engine holds, and refuses those submitted after, with
  /// `unavailable` and the message "the model is unavailable: <why>" (a retired model version
  /// past its drain time). The executor keeps running; destroy the handle to stop it.
  void fail_all(const std::string& why);

  /// The local executor and every remote replica, the local one first.
  std::vector<replica_stats> replicas() const;
  /// The port this engine's scheduler is published on; -1 when it is not.
  int published_port() const;
  /// Publishes the scheduler for fronts at host:port (an engine started with publish_port >= 0,
  /// i.e. with the middleman); returns the port. Throws std::runtime_error when it cannot.
  int publish(const std::string& host, int port);
  /// Hands the published port over: new connections are refused (existing ones stay) and new
  /// generations from other processes are refused as unavailable (their fronts move them); those
  /// running finish.
  void retire_published();
  /// Whether the scheduler runs or queues anything (bounded wait; true when it does not answer).
  bool busy(std::chrono::milliseconds timeout = std::chrono::seconds(2));

  /// Fault injection for tests: the executor throws in the middle of its next step; with
  /// `device_lost`, it reports its device lost first (as after a sticky CUDA error).
  void inject_executor_fault(bool device_lost = false);
  /// Fault injection for tests: the executor's next step sleeps `seconds` first (a hung kernel).
  void inject_executor_hang(double seconds);

  const engine::model& model() const;

  struct impl;

 private:
  explicit engine_handle(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::actors
