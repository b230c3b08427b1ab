// The scheduler's core: waiting queues, the running set and the per-step plan, as plain code
// (no actor library). The scheduler actor wraps one; tests drive it directly with a fake executor.
//
// Protocol (up to two steps in flight):
//   add()/cancel() at any time; plan = schedule(now) with no step in flight; the executor performs
//   plan.copies in order, then runs plan.batch through the forward and samples; on_step_done(
//   results, now) once per step, in step order. A plan with an empty batch leaves no step in
//   flight (its copies, if any, still run before the next forward). Time is always a parameter:
//   nothing here reads a clock.
//   Pipelining: while exactly one step is in flight, schedule_ahead(now) may plan the next one
//   before its results are known, so the executor never waits for the scheduler. It does so only
//   when every running sequence samples in the step in flight and KV blocks are to spare: each
//   such sequence decodes one ahead_token at the position after the step in flight (the executor
//   feeds in the token it sampled there), and waiting requests join in aged order while they fit
//   whole (short prompts, or recomputed sequences, in the budget the decodes leave (ITL
//   allowance included), slots and
//   blocks to spare; the first that does not fit stops them). When someone waits and nobody can
//   join, or a step left someone out, nothing is planned ahead: the full planner (timeouts,
//   priority preemption, chunked and long prefills) runs once the step in flight is back.
//   A sequence that finishes with the step in flight has its ahead entry computed and ignored
//   (one wasted token; its blocks are freed when it finishes, and reused only by later steps,
//   which the executor runs after).
//
// Sequence states: waiting (no KV: never run, or preempted by recompute) -> running (resident
// KV) -> finished; running -> swapped (KV on host) -> running; running -> waiting (recompute).
// Finished, failed and cancelled sequences are removed and their blocks freed at once.
//
// One step (decide, then apply):
//   1. waiting/swapped requests past their queue timeout fail (host blocks freed);
//   2. priority preemption: for the first waiting request (aged order) that has waited
//      priority_preempt_after_s and does not fit, running sequences of a strictly lower
//      (class, priority) that have run priority_preempt_after_s since their admission are
//      preempted, lowest first, when that makes it fit; it is then admitted first;
//   3. running sequences, best first, get the KV positions they need; when blocks run out the
//      lowest-priority, latest-arrived running sequence is preempted (possibly the one asking);
//   4. the batch: every running decode (1 token), then running prefills' chunks, best first,
//      under max_batched_tokens and, when decodes run and target_itl_ms is set, under the
//      prefill allowance the step-time model gives (see prefill_allowance());
//   5. admissions (none in a step that preempted for KV): the short and long queues' heads by
//      aged key, while sequence slots, tokens and KV blocks last; a head that does not fit KV
//      blocks only its own queue (the other bypasses it) unless it has waited max_bypass_wait_s;
//   6. leftover tokens extend long prefills held to long_prefill_chunk.
// Aging: effective level = class level (interactive 0, normal 1, batch 2) - floor(waited since
// arrival / aging_s), unbounded below; waiting requests are served by (effective level, higher
// priority, earlier arrival). So a batch request that waited aging_s competes as normal,
// 2 aging_s as interactive, and later ahead of fresh interactive work: nothing starves.
// Preemption compares static (class, priority) only, so a preempted sequence never preempts back.
// Swap preemption falls back to recompute when the host pool is short; a recomputed sequence
// re-prefills prompt + generated tokens and continues where it was.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/step_time_model.hpp"
#include "engine/block_manager.hpp"

namespace troupe::actors {

using engine::token_id;

enum class priority_class : uint8_t { interactive, normal, batch };
enum class preemption_mode : uint8_t { swap, recompute };

struct scheduler_config {
  int32_t max_batched_tokens = 256;     // tokens per step, decodes + prefill chunks
  int32_t max_num_seqs = 64;            // running sequences (so also batch entries per step)
  int32_t long_prompt_threshold = 256;  // a prefill of this many tokens or more is long
  int32_t long_prefill_chunk = 256;     // a long prefill's chunk while others compete (0: no cap)
  int32_t max_long_prefills = 1;        // long prefills running at once
  int32_t max_waiting = 1024;           // admission control: waiting requests ...
  int64_t max_waiting_tokens = 1 << 20; // ... and their tokens
  int64_t max_model_len = 0;            // prompt + max_tokens limit (0: the KV pool's size)
  int32_t kv_watermark_blocks = 0;      // device blocks admissions leave free for decodes
  preemption_mode preemption = preemption_mode::swap;
  double aging_s = 10.0;                  // one class level per aging_s waited (<= 0: no aging)
  double priority_preempt_after_s = 5.0;  // (<= 0: no priority preemption)
  double max_bypass_wait_s = 30.0;        // (<= 0: a blocked head is always bypassed)
  double queue_timeout_s = 0;             // default waiting limit (0: none)
  bool plan_ahead = true;                 // allow schedule_ahead (two steps in flight)
  // Inter-token latency target: a step that carries running decodes takes prefill tokens only
  // while the step-time model (fitted to the executor's measured steps) predicts it ends within
  // this. 0: off (only max_batched_tokens bounds a step). Where the decodes alone take longer
  // than target / itl_stretch (a load the target cannot hold), the step may still take up to
  // itl_stretch x their time, so prompts keep flowing instead of the running batch shrinking;
  // and at least min_prefill_tokens always go.
  double target_itl_ms = 0;
  double itl_stretch = 2.0;
  int32_t min_prefill_tokens = 16;
};

/// The token of a decode planned ahead: the executor substitutes the token it sampled for the
/// same sequence in the step before.
inline constexpr token_id ahead_token = -1;

/// Empty when valid, else one line naming the field and its allowed range.
std::string validate(const scheduler_config& c);

struct request_spec {
  uint64_t id = 0;
  std::vector<token_id> prompt;
  int32_t max_tokens = 16;  // tokens to generate at most (>= 1)
  priority_class cls = priority_class::normal;
  int32_t priority = 0;          // within its class: higher is served first
  double queue_timeout_s = 0;    // waiting limit for this request (0: the config's)
};

/// Why add() refused a request. The HTTP layer maps queue_full / queue_tokens_full to 429 and
/// invalid_request / too_long to 400.
/// `unavailable` is set by the scheduler actor (draining, or the executor circuit open), not by the core: 503.
enum class admit_error : uint8_t { none, invalid_request, too_long, duplicate_id, queue_full, queue_tokens_full, unavailable };

struct admission {
  admit_error error = admit_error::none;
  std::string message;
  bool ok() const { return error == admit_error::none; }
};

enum class seq_state : uint8_t { waiting, swapped, running };
enum class preempt_cause : uint8_t { kv_exhausted, priority };
enum class fail_reason : uint8_t { queue_timeout };
enum class finish_reason : uint8_t { stop, length };

const char* to_string(priority_class c);
const char* to_string(preemption_mode m);
const char* to_string(admit_error e);
const char* to_string(seq_state s);
const char* to_string(preempt_cause c);
const char* to_string(fail_reason r);
const char* to_string(finish_reason r);

/// One sequence's part of a step: tokens at positions [pos0, pos0 + tokens.size()).
struct batch_entry {
  uint64_t seq = 0;
  int64_t pos0 = 0;
  std::vector<token_id> tokens;
  std::vector<int32_t> block_table;  // device ids covering [0, pos0 + tokens.size())
  bool need_logits = false;          // true: sample a token after the last one
};

struct preemption_event {
  uint64_t seq = 0;
  preemption_mode mode = preemption_mode::swap;
  preempt_cause cause = preempt_cause::kv_exhausted;
};

struct failure_event {
  uint64_t seq = 0;
  fail_reason reason = fail_reason::queue_timeout;
  std::string message;
};

struct step_plan {
  uint64_t step = 0;
  std::vector<engine::block_copy> copies;   // run in order, before the forward
  std::vector<batch_entry> batch;           // decodes first, then prefill chunks
  int32_t n_decodes = 0;                    // batch[0, n_decodes) are running decodes
  int32_t n_tokens = 0;                     // tokens in the batch
  std::vector<preemption_event> preempted;  // their KV is gone (recompute) or on host (swap)
  std::vector<failure_event> failed;        // removed, every block freed
};

/// The planning function's output: what to do, before anything is done.
struct scheduled_seq {
  uint64_t seq = 0;
  int32_t n_tokens = 0;
};
struct step_decision {
  std::vector<uint64_t> timed_out;
  std::vector<preemption_event> preempt;  // in this order
  std::vector<scheduled_seq> run;         // running: decodes, then prefill chunks
  std::vector<scheduled_seq> admit;       // waiting or swapped sequences that join
  bool itl_capped = false;                // the ITL target's allowance bound the prefill tokens
};

/// The executor's answer for a batch entry with need_logits. `stop`: the caller decided that
/// this token ends the sequence (stop token or string).
struct token_result {
  uint64_t seq = 0;
  token_id token = 0;
  bool stop = false;
};

struct finished_seq {
  uint64_t seq = 0;
  finish_reason reason = finish_reason::length;
  std::vector<token_id> generated;
};

struct scheduler_stats {
  int64_t n_added = 0, n_refused = 0, n_admitted = 0, n_finished = 0, n_cancelled = 0;
  int64_t n_timed_out = 0, n_preempted_swap = 0, n_preempted_recompute = 0;
  int64_t n_steps = 0, n_prefill_tokens = 0, n_decode_tokens = 0;
  int64_t n_admitted_ahead = 0;  // admissions (of n_admitted) into a step planned ahead
  int64_t n_itl_capped = 0;      // steps whose prefill tokens the ITL target cut
};

struct seq_info {
  seq_state state = seq_state::waiting;
  std::span<const token_id> tokens;  // prompt then generated
  int64_t n_computed = 0;            // positions whose KV is computed
  int32_t n_generated = 0;
  int32_t n_preempted = 0;
};

class scheduler_core {
 public:
  /// Throws std::invalid_argument when the config is invalid. `kv` must outlive the core, and
  /// only the core allocates from it.
  scheduler_core(const scheduler_config& cfg, engine::block_manager& kv);

  /// Queues a request, or refuses it at once (nothing kept) with the reason.
  admission add(request_spec req, double now);
  /// Drops a request in any state and frees its blocks now. Its entry in a step in flight is
  /// ignored when the step returns. False when the id is unknown (finished or never added).
  bool cancel(uint64_t id);
  /// Changes a request's class and priority in any state; the next decide() orders it (and judges
  /// preemption) by the new values. False when the id is unknown.
  bool set_priority(uint64_t id, priority_class cls, int32_t priority);

  /// The planning function: what the next step would do, changing nothing.
  step_decision decide(double now) const;
  /// decide() then apply it: KV allocation, copies, the batch. Throws std::logic_error while
  /// a step is in flight.
  step_plan schedule(double now);
  /// With exactly one step in flight (see the header comment), plans the next step: every running
  /// sequence that can still generate after the step in flight decodes one ahead_token, then
  /// waiting requests that fit whole join with their prefill. nullopt (nothing changed) when the
  /// conditions do not hold; the caller then waits for the step in flight and calls schedule().
  std::optional<step_plan> schedule_ahead(double now);
  /// Advances the sequences of the oldest step in flight. results: one per batch entry with
  /// need_logits (entries of cancelled sequences may be missing). Returns the sequences that
  /// finished (removed, blocks freed). Throws std::invalid_argument (nothing changed) when a
  /// result is missing, unexpected or duplicated. step_seconds: the executor's measured time for
  /// the step (negative: not measured), which teaches the step-time model.
  std::vector<finished_seq> on_step_done(std::span<const token_result> results, double now, double step_seconds = -1);

  /// The executor died: the step in flight is void and every KV block it held (device, host,
  /// prefix cache) is lost. Running and swapped sequences go back to waiting, to be recomputed
  /// from their prompt and the tokens generated so far; their queue timeout restarts at `now`.
  /// Returns their ids.
  std::vector<uint64_t> on_executor_lost(double now);

  bool step_in_flight() const { return !pending_.empty(); }
  size_t n_steps_in_flight() const { return pending_.size(); }
  size_t n_running() const { return running_.size(); }
  size_t n_waiting() const { return waiting_.size(); }  // swapped ones included
  int64_t n_waiting_tokens() const { return n_waiting_tokens_; }
  std::optional<seq_info> find(uint64_t id) const;
  const scheduler_config& config() const { return cfg_; }
  const scheduler_stats& stats() const { return stats_; }
  const engine::block_manager& kv() const { return kv_; }
  const step_time_model& step_times() const { return step_times_; }
  /// Prefill tokens a step with n_decodes running decodes may take under the ITL target, or
  /// under itl_stretch x the decodes' own predicted time when that is longer (INT32_MAX when the
  /// target is off, nothing has been measured yet, or n_decodes is 0).
  int32_t prefill_allowance(int32_t n_decodes) const;

  /// Empty when the core's and the block manager's invariants hold, else the first violation.
  std::string check() const;

 private:
  struct sequence {
    request_spec req;        // its prompt moved into tokens
    int64_t n_prompt = 0;
    double arrival = 0;      // add(): aging and FIFO order
    double enqueued_at = 0;  // last entry into the waiting state: queue timeout
    double running_since = 0;  // last admission: shields it from priority preemption for a while
    uint64_t order = 0;      // arrival rank
    seq_state state = seq_state::waiting;
    std::vector<token_id> tokens;  // prompt then generated
    int64_t n_computed = 0;
    int32_t n_generated = 0;
    int32_t n_preempted = 0;
    bool long_prefill = false;  // admitted as a long prefill that is not finished yet
  };
  struct pending_entry {
    uint64_t seq;
    int32_t n_tokens;
    bool need_logits;
  };
  friend struct plan_context;

  bool is_long(const sequence& s) const;
  double timeout_of(const sequence& s) const;
  void to_waiting(sequence& s, seq_state state, double now);
  void leave_waiting(uint64_t id);
  void leave_running(uint64_t id);
  void enter_running(sequence& s, double now, bool long_prefill);  // admitted: waiting -> running
  batch_entry make_entry(const sequence& s, int32_t n_tokens) const;
  std::vector<uint64_t> waiting_by_age(double now) const;  // aged order (best first)

  scheduler_config cfg_;
  engine::block_manager& kv_;
  std::unordered_map<uint64_t, sequence> seqs_;
  std::vector<uint64_t> running_;  // admission order
  std::vector<uint64_t> waiting_;  // waiting and swapped (decide() orders them)
  int64_t n_waiting_tokens_ = 0;
  uint64_t next_order_ = 0;
  uint64_t step_no_ = 0;
  std::deque<std::vector<pending_entry>> pending_;  // the steps in flight, oldest first
  scheduler_stats stats_;
  step_time_model step_times_;
};

}  // namespace troupe::actors
