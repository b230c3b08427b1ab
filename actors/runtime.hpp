// Internal to actors/: the atoms, message payloads and actor entry points of the runtime.
// Includes CAF; keep it out of headers that engine/ or net/ include.
//
// Mail (every arrow is one message; [h] = sent with high priority):
//   request  --submit(request_msg)-->           scheduler   replies admission (ok / error)
//   request  --[h] cancel(seq)-->               scheduler   client gone, deadline, stop string
//   scheduler --token(seq, token_event)-->      request     one per sampled token
//   scheduler --finished(seq, reason, n)-->     request
//   scheduler --failed(seq, gen_error, text)--> request     queue timeout, executor circuit open
//   scheduler --step(step_work)-->              executor    replies step_output (or error: lost)
//   supervisor --executor(actor)-->             scheduler   a fresh executor (start and restarts)
//   executor --up-->                            supervisor  its backend is built (weights, KV pools)
//   executor --[h] lost(why, error)-->          supervisor  just before dying of a failure that lost
//                                                           its device (a sticky CUDA error, a timeout)
//   supervisor --[h] circuit(why, lost)-->      scheduler   too many restarts, or the device lost (no
//                                                           restart can help): fail everything
//   supervisor --probe-->                       supervisor  circuit_reset_s after the circuit opened on
//                                                           restarts: a new executor (half open)
//   supervisor --closed-->                      scheduler   that executor is up: take work again
//   scheduler --[h] stuck(executor)-->          supervisor  a step failed or timed out: the executor is
//                                                           told to stop; one that has not within
//                                                           stop_timeout_s is wedged (the device lost)
//   engine_handle --ready-->                    supervisor  replies true once an executor is up, or
//                                                           the first executor's start error
//   anyone   --[h] stats-->                     scheduler   replies engine_stats
//   anyone   --[h] drain-->                     scheduler   refuse new work; replies true when empty
//   engine_handle --[h] retire-->               scheduler   refuse new work from other processes (a
//                                                           published version replaced by a reload)
//   client   --[h] priority(cls, p)-->          request --[h] priority(seq, cls, p)--> scheduler
// The scheduler monitors request actors (a down request = cancel) and treats a failed or timed
// out step as a lost executor: every sequence is requeued for recompute, none fails.
#pragma once

#include <caf/all.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "actors/engine_handle.hpp"
#include "actors/prefix_affinity.hpp"
#include "actors/scheduler_policy.hpp"
#include "actors/wire.hpp"
#include "engine/model.hpp"
#include "engine/sampling.hpp"

namespace troupe::actors {

using submit_atom = caf::atom_constant<caf::atom("submit")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
using token_atom = caf::atom_constant<caf::atom("token")>;
using finished_atom = caf::atom_constant<caf::atom("finished")>;
using failed_atom = caf::atom_constant<caf::atom("failed")>;
using step_atom = caf::atom_constant<caf::atom("step")>;
using executor_atom = caf::atom_constant<caf::atom("executor")>;
using circuit_atom = caf::atom_constant<caf::atom("circuit")>;
using stats_atom = caf::atom_constant<caf::atom("stats")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using fault_atom = caf::atom_constant<caf::atom("fault")>;
using deadline_atom = caf::atom_constant<caf::atom("deadline")>;
using drain_atom = caf::atom_constant<caf::atom("drain")>;
using priority_atom = caf::atom_constant<caf::atom("priority")>;
using up_atom = caf::atom_constant<caf::atom("up")>;
using retire_atom = caf::atom_constant<caf::atom("retire")>;
using ready_atom = caf::atom_constant<caf::atom("ready")>;
using lost_atom = caf::atom_constant<caf::atom("lost")>;
using stuck_atom = caf::atom_constant<caf::atom("stuck")>;
using wedged_atom = caf::atom_constant<caf::atom("wedged")>;
using hang_atom = caf::atom_constant<caf::atom("hang")>;
using probe_atom = caf::atom_constant<caf::atom("probe")>;
using closed_atom = caf::atom_constant<caf::atom("closed")>;

/// How to sample one sequence's next token in a step. Sampling is stateless across steps: the
/// draw uses seed mixed with the index of the token drawn, so a recomputed or restarted
/// sequence draws exactly what it would have drawn.
struct sample_spec {
  uint64_t seq = 0;
  std::shared_ptr<const engine::sampling_params> params;
  uint64_t draw_index = 0;
  std::vector<engine::token_id> history;  // for penalties (empty when none are active)
  std::vector<engine::token_id> output;   // generated so far, for a grammar (params->grammar) only
};

struct step_work {
  uint64_t step = 0;
  std::vector<engine::block_copy> copies;  // in order, before the forward
  std::vector<batch_entry> batch;
  std::vector<sample_spec> sampling;       // one per batch entry with need_logits, in order
  bool inject_fault = false;        // tests: the executor throws in the middle of the step ...
  bool inject_device_loss = false;  // ... and says its device is lost (as a sticky CUDA error would)
  double inject_hang_s = 0;         // tests: the step sleeps this long first (a hung kernel)
};

struct sampled {
  uint64_t seq = 0;
  engine::sample_result r;
};

struct step_output {
  uint64_t step = 0;
  std::vector<sampled> tokens;
  double compute_s = 0;
};

struct executor_config {
  std::shared_ptr<const engine::model> model;
  int n_threads = 1;
  engine::kv_shape kv;
  int32_t n_device_blocks = 0, n_host_blocks = 0;
  int cuda_device = -1;  // -1: the CPU backend; else the CUDA device index (a build with CUDA)
  int tensor_parallel = 1;  // CPU: ranks the forward is split over (n_threads shared among them)
  int pipeline_parallel = 1;  // CPU: stages the layers are split over (n_threads shared among them)
  int expert_parallel = 1;    // CPU: ranks a mixture of experts' experts are split over
  // The scheduler's limits, which size a device backend's step buffers: tokens and sequences per
  // step, positions per sequence.
  int32_t max_batch_tokens = 256, max_seqs = 64;
  int64_t max_context = 8192;
  std::string fail_start;  // tests: when not empty, building the backend throws this
  bool emulate_device_sampling = false;  // tests: the CPU backend takes the device-sampling path
  bool cuda_graphs = true;         // CUDA: decode steps from CUDA graphs
  bool cuda_fused_decode = false;  // CUDA: the fused decode launches
  double step_timeout_s = 120;     // CUDA: also the longest wait for the device (a hung kernel fails the step)
  // engine_options::on_backend_up.
  std::function<void(const std::vector<size_t>&)> on_backend_up;
};

/// Payload of the shared stats reply.
struct stats_reply {
  engine_stats s;
};

/// Builds its backend at start: on success tells `supervisor` up; on failure quits with an error
/// carrying the exception's text (so do failed steps), which the supervisor reports.
caf::behavior executor_actor(caf::event_based_actor* self, executor_config cfg, caf::actor supervisor);

/// The text of an actor's exit reason: an exception's what() where the actor put it there.
std::string exit_text(const caf::actor_system& sys, const caf::error& reason);

struct scheduler_config_msg {
  scheduler_config sched;
  std::shared_ptr<const engine::model> model;
  int kv_block_size = 16;
  int32_t n_device_blocks = 0, n_host_blocks = 0;
  double step_timeout_s = 120;
  engine::kv_groups kv_groups{};  // the executor's KV layer groups (kv_shape::n_groups, window)
};
/// Spawns the scheduler actor of one model.
caf::actor spawn_scheduler(caf::actor_system& sys, scheduler_config_msg cfg);

/// How the supervisor treats its executor's failures (engine_options has each).
struct supervision {
  int max_restarts = 3;         // restarts within window_s before the circuit opens
  double window_s = 60;
  double step_timeout_s = 120;  // for the wedged executor's message only (the scheduler times steps)
  double stop_timeout_s = 10;   // an executor told to stop that has not by then is wedged
  double circuit_reset_s = 30;  // after the circuit opened on restarts, a new executor this much later; 0: never
  std::function<void(const std::string&)> on_device_lost;
};

caf::behavior supervisor_actor(caf::event_based_actor* self, caf::actor scheduler, executor_config cfg, supervision sv);

/// How generations are spread over the replicas.
struct routing_options {
  bool prefix = true;           // prefix-aware: a prompt goes where its longest known prefix went ...
  int64_t max_imbalance = 4;    // ... unless that replica has more than this many in flight beyond the least loaded
  size_t affinity_blocks = 65536;  // prefixes (full KV blocks) remembered
  int block_size = 16;          // positions per KV block: the prefixes' unit
};

/// Where generations run: the local scheduler (index 0) and the remote replicas, schedulers of
/// other `troupe serve --publish-port` processes reached through the middleman. Thread-safe: the
/// engine handle and the request actors pick and release, the replica keeper marks replicas up
/// and down. Routing: the up replica with the fewest generations in flight (ties in turn), or,
/// prefix-aware, the one that took the prompt's longest known prefix while it is not busier than
/// that by more than max_imbalance (actors/prefix_affinity.hpp).
class replica_router {
 public:
  struct choice {
    size_t index = 0;
    caf::actor scheduler;
  };
  /// `local`: this engine's scheduler, routed to only when `local_serves` (it has an executor).
  replica_router(caf::actor local, bool local_serves, routing_options opts = {});
  /// Whether pick() uses prompt hashes (prefix routing with some remote replica).
  bool wants_prefix() const;
  /// The chain hashes of the prompt's full blocks, for pick().
  std::vector<uint64_t> prefix_hashes(std::span<const engine::token_id> prompt) const;
  /// Adds a remote replica (down until the keeper connects it); returns its index.
  size_t add_remote(std::string name);
  /// The least loaded up replica not in `tried` (by index), counted as one more in flight; none
  /// when every up replica was tried.
  std::optional<choice> pick(const std::vector<size_t>& tried, std::span<const uint64_t> prefix = {});
  /// A generation counted by pick() ended (or moved away).
  void release(size_t index);
  /// A generation lost its replica (the connection or the process died, or it did not answer).
  /// Counted only: marking the replica down is the keeper's, on its own monitor (a replica that
  /// was slow to answer one submit is not taken out of routing for good).
  void lost(size_t index);
  void set_up(size_t index, caf::actor scheduler);
  void set_down(size_t index, std::string status);
  bool is_local(size_t index) const { return index == 0; }
  std::string name(size_t index) const;
  std::vector<replica_stats> stats() const;
  /// Whether some replica can take a generation now.
  bool any_up() const;

 private:
  struct entry {
    std::string name;
    caf::actor scheduler;  // null while down
    std::string status;
    int64_t in_flight = 0, routed = 0, lost = 0, prefix_routed = 0;
  };
  routing_options opts_;
  mutable std::mutex mu_;
  std::vector<entry> entries_;
  size_t turn_ = 0;
  prefix_affinity affinity_;
};

struct replica_endpoint {
  size_t index = 0;
  std::string host;
  uint16_t port = 0;
};

/// Connects the remote replicas and keeps them connected: a replica is up once its scheduler
/// answers `info` with this model's fingerprint; a lost or refused one is retried every retry_s.
/// With `tls`, through the OpenSSL module's middleman (the actor system loaded it).
caf::behavior replica_keeper(caf::event_based_actor* self, std::shared_ptr<replica_router> router,
                             std::vector<replica_endpoint> endpoints, std::string fingerprint, double retry_s, double timeout_s,
                             bool tls);

/// Empty when the replica TLS files are usable (all three or none named; the certificate and key
/// load and match; the CA file loads), else what is wrong, naming the file.
std::string replica_tls_error(const std::string& cert, const std::string& key, const std::string& ca);

/// Parses "host:port" (throws std::invalid_argument naming the text).
replica_endpoint parse_endpoint(const std::string& text);

caf::behavior request_actor(caf::event_based_actor* self, std::shared_ptr<replica_router> router, std::shared_ptr<const engine::model> model,
                            generation_params params, uint64_t id, std::shared_ptr<generation_stream> stream);

}  // namespace troupe::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::step_work)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::step_output)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::stats_reply)
