// The scheduler core's state changes: admission control, cancel, applying a decision to the
// block manager (schedule), and advancing sequences with a step's results (on_step_done).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <unordered_set>

#include "actors/scheduler_policy.hpp"

namespace troupe::actors {

namespace {

std::string seq_name(uint64_t id) { return "sequence " + std::to_string(id); }

std::string fmt_s(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

}  // namespace

scheduler_core::scheduler_core(const scheduler_config& cfg, engine::block_manager& kv) : cfg_(cfg), kv_(kv) {
  if (const std::string e = validate(cfg); !e.empty()) throw std::invalid_argument("scheduler config: " + e);
}

bool scheduler_core::is_long(const sequence& s) const {
  return (int64_t)s.tokens.size() - s.n_computed >= cfg_.long_prompt_threshold;
}

double scheduler_core::timeout_of(const sequence& s) const {
  return s.req.queue_timeout_s > 0 ? s.req.queue_timeout_s : cfg_.queue_timeout_s;
}

void scheduler_core::to_waiting(sequence& s, seq_state state, double now) {
  s.state = state;
  s.enqueued_at = now;
  waiting_.push_back(s.req.id);
  n_waiting_tokens_ += (int64_t)s.tokens.size();
}

void scheduler_core::leave_waiting(uint64_t id) {
  waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  n_waiting_tokens_ -= (int64_t)seqs_.at(id).tokens.size();
}

void scheduler_core::enter_running(sequence& s, double now, bool long_prefill) {
  leave_waiting(s.req.id);
  s.state = seq_state::running;
  s.running_since = now;
  s.long_prefill = long_prefill;
  running_.push_back(s.req.id);
  ++stats_.n_admitted;
}

void scheduler_core::leave_running(uint64_t id) { running_.erase(std::find(running_.begin(), running_.end(), id)); }

admission scheduler_core::add(request_spec req, double now) {
  auto refuse = [&](admit_error e, std::string msg) {
    ++stats_.n_refused;
    return admission{e, std::move(msg)};
  };
  if (req.prompt.empty()) return refuse(admit_error::invalid_request, "the prompt is empty");
  if (req.max_tokens < 1)
    return refuse(admit_error::invalid_request, "max_tokens must be at least 1, got " + std::to_string(req.max_tokens));
  if (!std::isfinite(req.queue_timeout_s) || req.queue_timeout_s < 0)
    return refuse(admit_error::invalid_request, "the queue timeout must be a finite number of seconds >= 0");
  if (seqs_.count(req.id)) return refuse(admit_error::duplicate_id, "request id " + std::to_string(req.id) + " is in use");
  const int64_t n_prompt = (int64_t)req.prompt.size();
  const int64_t total = n_prompt + req.max_tokens;
  if (cfg_.max_model_len > 0 && total > cfg_.max_model_len)
    return refuse(admit_error::too_long, "the prompt (" + std::to_string(n_prompt) + " tokens) plus max_tokens (" +
                                             std::to_string(req.max_tokens) + ") exceeds the model length of " +
                                             std::to_string(cfg_.max_model_len));
  // The last sampled token is never fed back: total - 1 positions at most.
  if (kv_.peak_blocks(total - 1) + cfg_.kv_watermark_blocks > kv_.n_device())
    return refuse(admit_error::too_long, "the prompt (" + std::to_string(n_prompt) + " tokens) plus max_tokens (" +
                                             std::to_string(req.max_tokens) + ") needs more KV cache than the " +
                                             std::to_string(kv_.n_device()) + " blocks of " +
                                             std::to_string(kv_.block_size()) + " positions can hold");
  if ((int64_t)waiting_.size() >= cfg_.max_waiting)
    return refuse(admit_error::queue_full, std::to_string(waiting_.size()) + " requests are waiting (limit " +
                                               std::to_string(cfg_.max_waiting) + ")");
  if (n_waiting_tokens_ + n_prompt > cfg_.max_waiting_tokens)
    return refuse(admit_error::queue_tokens_full, std::to_string(n_waiting_tokens_) + " tokens are waiting; " +
                                                      std::to_string(n_prompt) + " more would pass the limit of " +
                                                      std::to_string(cfg_.max_waiting_tokens));
  const uint64_t id = req.id;
  sequence s;
  s.tokens = std::move(req.prompt);
  s.n_prompt = n_prompt;
  s.req = std::move(req);
  s.arrival = now;
  s.order = next_order_++;
  auto& ref = seqs_.emplace(id, std::move(s)).first->second;
  to_waiting(ref, seq_state::waiting, now);
  ++stats_.n_added;
  return {};
}

bool scheduler_core::cancel(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  if (it->second.state == seq_state::running) leave_running(id);
  else leave_waiting(id);
  kv_.free(id);
  seqs_.erase(it);
  ++stats_.n_cancelled;
  return true;
}

std::vector<uint64_t> scheduler_core::on_executor_lost(double now) {
  pending_.clear();
  std::vector<uint64_t> lost;
  for (uint64_t id : std::vector<uint64_t>(running_)) {
    leave_running(id);
    lost.push_back(id);
  }
  for (uint64_t id : std::vector<uint64_t>(waiting_))
    if (seqs_.at(id).state == seq_state::swapped) {
      leave_waiting(id);
      lost.push_back(id);
    }
  for (uint64_t id : lost) {
    sequence& s = seqs_.at(id);
    kv_.free(id);
    s.n_computed = 0;
    s.long_prefill = false;
    to_waiting(s, seq_state::waiting, now);
  }
  kv_.clear_cache();
  return lost;
}

bool scheduler_core::set_priority(uint64_t id, priority_class cls, int32_t priority) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  it->second.req.cls = cls;
  it->second.req.priority = priority;
  return true;
}

batch_entry scheduler_core::make_entry(const sequence& s, int32_t n_tokens) const {
  batch_entry e;
  e.seq = s.req.id;
  e.pos0 = s.n_computed;
  const auto first = s.tokens.begin() + (ptrdiff_t)s.n_computed;
  e.tokens.assign(first, first + n_tokens);
  e.block_table = kv_.step_table(s.req.id, e.pos0 + n_tokens);
  e.need_logits = e.pos0 + n_tokens == (int64_t)s.tokens.size();
  return e;
}

step_plan scheduler_core::schedule(double now) {
  if (step_in_flight()) throw std::logic_error("scheduler_core::schedule: the previous step is still in flight");
  const step_decision d = decide(now);
  step_plan plan;
  plan.step = ++step_no_;
  ++stats_.n_steps;
  stats_.n_itl_capped += d.itl_capped;

  for (uint64_t id : d.timed_out) {
    const sequence& s = seqs_.at(id);
    plan.failed.push_back({id, fail_reason::queue_timeout,
                           "waited " + fmt_s(now - s.enqueued_at) + " in the queue (limit " + fmt_s(timeout_of(s)) + ")"});
    leave_waiting(id);
    kv_.free(id);  // host blocks of a swapped sequence too
    seqs_.erase(id);
    ++stats_.n_timed_out;
  }

  for (const preemption_event& p : d.preempt) {
    sequence& s = seqs_.at(p.seq);
    leave_running(p.seq);
    preemption_mode mode = p.mode;
    if (mode == preemption_mode::swap && !kv_.swap_out(p.seq, plan.copies)) mode = preemption_mode::recompute;
    if (mode == preemption_mode::recompute) {
      kv_.free(p.seq);  // computed full blocks stay in the prefix cache
      s.n_computed = 0;
      ++stats_.n_preempted_recompute;
    } else {
      ++stats_.n_preempted_swap;
    }
    to_waiting(s, mode == preemption_mode::swap ? seq_state::swapped : seq_state::waiting, now);
    s.long_prefill = false;
    ++s.n_preempted;
    plan.preempted.push_back({p.seq, mode, p.cause});
  }

  std::vector<scheduled_seq> batch;
  for (const scheduled_seq& r : d.run) {
    const sequence& s = seqs_.at(r.seq);
    if (!kv_.append(r.seq, (int64_t)s.tokens.size() - kv_.n_positions(r.seq), plan.copies))
      throw std::logic_error("scheduler_core: the planned KV growth of " + seq_name(r.seq) + " failed");
    batch.push_back(r);
    if ((int64_t)s.tokens.size() - s.n_computed == 1) ++plan.n_decodes;
  }

  for (const scheduled_seq& a : d.admit) {
    sequence& s = seqs_.at(a.seq);
    const bool long_prefill = is_long(s);
    if (s.state == seq_state::swapped) {
      const int64_t extra = (int64_t)s.tokens.size() - kv_.n_positions(a.seq);
      if (kv_.cost_swap_in(a.seq, extra) > kv_.n_available_device()) continue;  // stays swapped
      kv_.swap_in(a.seq, plan.copies);
      if (!kv_.append(a.seq, extra, plan.copies))
        throw std::logic_error("scheduler_core: KV growth after the swap-in of " + seq_name(a.seq) + " failed");
    } else {
      // The plan's estimate can be off when one admission evicts what the next one hoped to
      // hit; then the request just waits.
      const auto cached = kv_.allocate(a.seq, s.tokens);
      if (!cached) continue;
      s.n_computed = *cached;
    }
    enter_running(s, now, long_prefill);
    batch.push_back({a.seq, (int32_t)std::min<int64_t>(a.n_tokens, (int64_t)s.tokens.size() - s.n_computed)});
  }

  std::vector<pending_entry> entries;
  for (const scheduled_seq& b : batch) {
    batch_entry e = make_entry(seqs_.at(b.seq), b.n_tokens);
    plan.n_tokens += b.n_tokens;
    entries.push_back({b.seq, b.n_tokens, e.need_logits});
    plan.batch.push_back(std::move(e));
  }
  if (!entries.empty()) pending_.push_back(std::move(entries));
  stats_.n_decode_tokens += plan.n_decodes;
  stats_.n_prefill_tokens += plan.n_tokens - plan.n_decodes;
  return plan;
}

std::optional<step_plan> scheduler_core::schedule_ahead(double now) {
  if (!cfg_.plan_ahead || pending_.size() != 1) return std::nullopt;
  // Every running sequence must be sampling in the step in flight: one left out (a prefill chunk
  // that ends mid-prompt, or a decode the budget skipped) is the full planner's to schedule.
  std::vector<uint64_t> ids;
  size_t n_alive = 0;
  int32_t new_blocks = 0;
  for (const pending_entry& p : pending_.front()) {
    auto it = seqs_.find(p.seq);
    if (it == seqs_.end()) continue;  // cancelled while in flight
    const sequence& s = it->second;
    if (!p.need_logits || s.state != seq_state::running || s.n_computed + p.n_tokens != (int64_t)s.tokens.size())
      return std::nullopt;
    ++n_alive;
    if (s.n_generated + 1 >= s.req.max_tokens) continue;  // its last token comes with the step in flight
    new_blocks += kv_.cost_append(p.seq, 1);
    ids.push_back(p.seq);
  }
  if (n_alive != running_.size() || (int64_t)ids.size() > cfg_.max_batched_tokens) return std::nullopt;
  if (new_blocks + cfg_.kv_watermark_blocks > kv_.n_available_device()) return std::nullopt;  // preemption: the full planner's

  // Admissions: waiting requests in aged order, each whole (a short prompt, or a recomputed
  // sequence's prompt and tokens) in what the decodes leave of the budget, while slots and
  // blocks last. The first that cannot join stops the loop; when nobody joins while someone
  // waits, the full planner (timeouts, priority preemption, chunking, the long queue) takes over.
  int32_t tokens_left = std::min(cfg_.max_batched_tokens - (int32_t)ids.size(), prefill_allowance((int32_t)ids.size()));
  std::vector<scheduled_seq> admitted;
  for (uint64_t id : waiting_by_age(now)) {
    sequence& s = seqs_.at(id);
    if (running_.size() >= (size_t)cfg_.max_num_seqs || s.state != seq_state::waiting || is_long(s)) break;
    const double limit = timeout_of(s);
    if (limit > 0 && now - s.enqueued_at > limit) break;
    const engine::allocation_cost c = kv_.cost_allocate(s.tokens);
    const int64_t left = (int64_t)s.tokens.size() - c.n_cached_positions;
    if (left > tokens_left || c.n_blocks + new_blocks + cfg_.kv_watermark_blocks > kv_.n_available_device()) break;
    const auto cached = kv_.allocate(id, s.tokens);
    if (!cached) throw std::logic_error("scheduler_core: the ahead admission of " + seq_name(id) + " failed");
    s.n_computed = *cached;
    enter_running(s, now, false);
    ++stats_.n_admitted_ahead;
    tokens_left -= (int32_t)left;
    admitted.push_back({id, (int32_t)left});
  }
  if (ids.empty() && admitted.empty()) return std::nullopt;
  if (admitted.empty() && !waiting_.empty()) return std::nullopt;

  step_plan plan;
  plan.step = ++step_no_;
  ++stats_.n_steps;
  std::vector<pending_entry> entries;
  for (uint64_t id : ids) {
    const sequence& s = seqs_.at(id);
    if (!kv_.append(id, 1, plan.copies)) throw std::logic_error("scheduler_core: the ahead KV growth of " + seq_name(id) + " failed");
    batch_entry e;
    e.seq = id;
    e.pos0 = (int64_t)s.tokens.size();  // the position after the step in flight
    e.tokens = {ahead_token};
    e.block_table = kv_.step_table(id, e.pos0 + 1);
    e.need_logits = true;
    entries.push_back({id, 1, true});
    plan.batch.push_back(std::move(e));
  }
  plan.n_decodes = plan.n_tokens = (int32_t)plan.batch.size();
  for (const scheduled_seq& a : admitted) {
    batch_entry e = make_entry(seqs_.at(a.seq), a.n_tokens);
    entries.push_back({a.seq, a.n_tokens, e.need_logits});
    plan.n_tokens += a.n_tokens;
    plan.batch.push_back(std::move(e));
  }
  stats_.n_decode_tokens += plan.n_decodes;
  stats_.n_prefill_tokens += plan.n_tokens - plan.n_decodes;
  pending_.push_back(std::move(entries));
  return plan;
}

int32_t scheduler_core::prefill_allowance(int32_t n_decodes) const {
  constexpr int32_t unlimited = std::numeric_limits<int32_t>::max();
  if (cfg_.target_itl_ms <= 0 || n_decodes <= 0 || step_times_.n_observed() == 0) return unlimited;
  const double target = std::max(cfg_.target_itl_ms / 1000, cfg_.itl_stretch * *step_times_.predict(n_decodes));
  const int32_t n = step_times_.tokens_within(target, cfg_.max_batched_tokens);
  return std::max(cfg_.min_prefill_tokens, n - n_decodes);
}

std::vector<finished_seq> scheduler_core::on_step_done(std::span<const token_result> results, double now,
                                                       double step_seconds) {
  if (pending_.empty()) throw std::logic_error("scheduler_core::on_step_done: no step in flight");
  const std::vector<pending_entry>& step = pending_.front();
  // Validate everything before changing anything.
  std::unordered_map<uint64_t, const token_result*> by_seq;
  for (const token_result& r : results)
    if (!by_seq.emplace(r.seq, &r).second) throw std::invalid_argument("two results for " + seq_name(r.seq));
  size_t n_matched = 0;
  for (const pending_entry& p : step) {
    if (!p.need_logits) continue;
    if (by_seq.count(p.seq)) ++n_matched;
    else if (seqs_.count(p.seq)) throw std::invalid_argument("no sampled token for " + seq_name(p.seq));
  }
  if (n_matched != by_seq.size()) throw std::invalid_argument("a result for a sequence that asked for no token");

  int32_t n_step_tokens = 0;
  for (const pending_entry& p : step) n_step_tokens += p.n_tokens;
  if (step_seconds >= 0) step_times_.observe(n_step_tokens, step_seconds);
  std::vector<finished_seq> done;
  for (const pending_entry& p : step) {
    auto it = seqs_.find(p.seq);
    if (it == seqs_.end()) continue;  // cancelled while the step ran
    sequence& s = it->second;
    s.n_computed += p.n_tokens;
    std::optional<finish_reason> fin;
    if (p.need_logits) {
      const token_result& r = *by_seq.at(p.seq);
      s.tokens.push_back(r.token);
      ++s.n_generated;
      s.long_prefill = false;
      if (r.stop) fin = finish_reason::stop;
      else if (s.n_generated >= s.req.max_tokens) fin = finish_reason::length;
    }
    // Computed full blocks become prefix-cacheable (also for a finished sequence: a follow-up
    // request of the same conversation starts with them).
    kv_.commit(p.seq, std::span(s.tokens).first((size_t)s.n_computed));
    if (fin) {
      done.push_back({p.seq, *fin, std::vector<token_id>(s.tokens.end() - s.n_generated, s.tokens.end())});
      leave_running(p.seq);
      kv_.free(p.seq);
      seqs_.erase(it);
      ++stats_.n_finished;
    }
  }
  pending_.pop_front();
  return done;
}

std::optional<seq_info> scheduler_core::find(uint64_t id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return std::nullopt;
  const sequence& s = it->second;
  return seq_info{s.state, s.tokens, s.n_computed, s.n_generated, s.n_preempted};
}

std::string scheduler_core::check() const {
  if (std::string e = kv_.check(); !e.empty()) return "kv: " + e;
  if (running_.size() + waiting_.size() != seqs_.size()) return "a sequence is in no list or in two";
  if (running_.size() > (size_t)cfg_.max_num_seqs) return "more running sequences than max_num_seqs";
  std::unordered_set<uint64_t> seen;
  for (uint64_t id : running_) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.state != seq_state::running || !seen.insert(id).second)
      return seq_name(id) + ": listed as running";
    if (!kv_.has(id) || kv_.is_swapped(id) || kv_.n_positions(id) < it->second.n_computed)
      return seq_name(id) + ": running without its KV";
  }
  int64_t n_tokens = 0;
  for (uint64_t id : waiting_) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.state == seq_state::running || !seen.insert(id).second)
      return seq_name(id) + ": listed as waiting";
    const sequence& s = it->second;
    n_tokens += (int64_t)s.tokens.size();
    if (s.state == seq_state::waiting && (kv_.has(id) || s.n_computed != 0)) return seq_name(id) + ": waiting with KV";
    if (s.state == seq_state::swapped && (!kv_.has(id) || !kv_.is_swapped(id)))
      return seq_name(id) + ": swapped without host blocks";
  }
  if (n_tokens != n_waiting_tokens_) return "the waiting token count is off";
  for (const auto& [id, s] : seqs_) {
    if ((int64_t)s.tokens.size() != s.n_prompt + s.n_generated || s.n_generated >= s.req.max_tokens)
      return seq_name(id) + ": token count is off";
    if (s.n_computed >= (int64_t)s.tokens.size() && !step_in_flight())
      return seq_name(id) + ": nothing left to compute";
  }
  return {};
}

}  // namespace troupe::actors
