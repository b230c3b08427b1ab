// The planning function: scheduler_core::decide(now), a const walk over the queues, the running
// set and the block manager's costs. The order of the walk is documented in scheduler_policy.hpp.
#include "actors/scheduler_policy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace troupe::actors {

const char* to_string(priority_class c) {
  switch (c) {
    case priority_class::interactive: return "interactive";
    case priority_class::normal: return "normal";
    case priority_class::batch: return "batch";
  }
  return "?";
}

const char* to_string(preemption_mode m) {
  switch (m) {
    case preemption_mode::swap: return "swap";
    case preemption_mode::recompute: return "recompute";
  }
  return "?";
}

const char* to_string(admit_error e) {
  switch (e) {
    case admit_error::none: return "none";
    case admit_error::invalid_request: return "invalid_request";
    case admit_error::too_long: return "too_long";
    case admit_error::duplicate_id: return "duplicate_id";
    case admit_error::queue_full: return "queue_full";
    case admit_error::queue_tokens_full: return "queue_tokens_full";
    case admit_error::unavailable: return "unavailable";
  }
  return "?";
}

const char* to_string(seq_state s) {
  switch (s) {
    case seq_state::waiting: return "waiting";
    case seq_state::swapped: return "swapped";
    case seq_state::running: return "running";
  }
  return "?";
}

const char* to_string(preempt_cause c) {
  switch (c) {
    case preempt_cause::kv_exhausted: return "kv_exhausted";
    case preempt_cause::priority: return "priority";
  }
  return "?";
}

const char* to_string(fail_reason r) {
  switch (r) {
    case fail_reason::queue_timeout: return "queue_timeout";
  }
  return "?";
}

const char* to_string(finish_reason r) {
  switch (r) {
    case finish_reason::stop: return "stop";
    case finish_reason::length: return "length";
  }
  return "?";
}

std::string validate(const scheduler_config& c) {
  if (c.max_num_seqs < 1) return "max_num_seqs must be >= 1";
  if (c.max_batched_tokens < c.max_num_seqs)
    return "max_batched_tokens must be >= max_num_seqs (every running decode gets its token each step)";
  if (c.long_prompt_threshold < 1) return "long_prompt_threshold must be >= 1";
  if (c.long_prefill_chunk < 0) return "long_prefill_chunk must be >= 0";
  if (c.max_long_prefills < 1) return "max_long_prefills must be >= 1";
  if (c.max_waiting < 1) return "max_waiting must be >= 1";
  if (c.max_waiting_tokens < 1) return "max_waiting_tokens must be >= 1";
  if (c.max_model_len < 0) return "max_model_len must be >= 0";
  if (c.kv_watermark_blocks < 0) return "kv_watermark_blocks must be >= 0";
  for (double v : {c.aging_s, c.priority_preempt_after_s, c.max_bypass_wait_s, c.queue_timeout_s})
    if (!std::isfinite(v)) return "time limits must be finite";
  if (c.queue_timeout_s < 0) return "queue_timeout_s must be >= 0";
  if (!std::isfinite(c.target_itl_ms) || c.target_itl_ms < 0) return "target_itl_ms must be >= 0 (0: off)";
  if (!std::isfinite(c.itl_stretch) || c.itl_stretch < 1) return "itl_stretch must be >= 1";
  if (c.min_prefill_tokens < 1) return "min_prefill_tokens must be >= 1";
  return {};
}

namespace {

int class_level(priority_class c) { return (int)c; }

using order_key = std::tuple<int64_t, int64_t, uint64_t>;  // smaller is served first

}  // namespace

// The mutable bookkeeping of one decide() call over the const core.
struct plan_context {
  using sequence = scheduler_core::sequence;

  const scheduler_core& core;
  const scheduler_config& cfg;
  const engine::block_manager& kv;
  double now;
  step_decision d;
  int32_t dev = 0;   // device blocks still available (free + evictable)
  int32_t host = 0;  // host blocks still free
  int32_t tokens_left = 0;
  std::vector<const sequence*> run;  // running, best first
  std::vector<uint8_t> gone;         // run[i] preempted in this step
  size_t n_alive = 0;
  bool kv_preempted = false;
  bool itl_bound = false;  // tokens_left was cut to the ITL allowance

  plan_context(const scheduler_core& c, double t)
      : core(c), cfg(c.cfg_), kv(c.kv_), now(t), dev(c.kv_.n_available_device()),
        host(c.kv_.n_free_host()), tokens_left(c.cfg_.max_batched_tokens) {}

  order_key static_key(const sequence& s) const {
    return {class_level(s.req.cls), -(int64_t)s.req.priority, s.order};
  }
  order_key aged_key(const sequence& s) const {
    int64_t level = class_level(s.req.cls);
    if (cfg.aging_s > 0) level -= (int64_t)std::floor(std::max(0.0, now - s.arrival) / cfg.aging_s);
    return {level, -(int64_t)s.req.priority, s.order};
  }
  // Victims must rank strictly lower on (class, priority): arrival order never justifies it.
  static bool strictly_lower(const sequence& victim, const sequence& cand) {
    return std::make_pair(class_level(victim.req.cls), -victim.req.priority) >
           std::make_pair(class_level(cand.req.cls), -cand.req.priority);
  }
  int64_t remaining(const sequence& s) const { return (int64_t)s.tokens.size() - s.n_computed; }
  int32_t append_cost(const sequence& s) const {
    return kv.cost_append(s.req.id, (int64_t)s.tokens.size() - kv.n_positions(s.req.id));
  }
  // KV blocks a waiting or swapped sequence needs to join, and the prefill left after the cache.
  std::pair<int32_t, int64_t> join_cost(const sequence& s) const {
    if (s.state == seq_state::swapped)
      return {kv.cost_swap_in(s.req.id, (int64_t)s.tokens.size() - kv.n_positions(s.req.id)), remaining(s)};
    const auto c = kv.cost_allocate(s.tokens);
    return {c.n_blocks, (int64_t)s.tokens.size() - c.n_cached_positions};
  }
  int64_t chunk_cap(bool long_prefill) const {
    return long_prefill && cfg.long_prefill_chunk > 0 ? cfg.long_prefill_chunk : std::numeric_limits<int64_t>::max();
  }

  void preempt(size_t i, preempt_cause cause) {
    const sequence& s = *run[i];
    gone[i] = 1;
    --n_alive;
    dev += kv.n_exclusive(s.req.id);
    preemption_mode mode = cfg.preemption;
    if (mode == preemption_mode::swap) {
      const auto need = kv.n_held(s.req.id);
      if (need <= host) host -= need;
      else mode = preemption_mode::recompute;  // the host pool is short
    }
    d.preempt.push_back({s.req.id, mode, cause});
  }

  void timeouts(std::vector<const sequence*>& candidates) {
    for (uint64_t id : core.waiting_) {
      const sequence& s = core.seqs_.at(id);
      const double limit = core.timeout_of(s);
      if (limit > 0 && now - s.enqueued_at > limit) {
        d.timed_out.push_back(id);
        if (s.state == seq_state::swapped) host += kv.n_held(id);
      } else {
        candidates.push_back(&s);
      }
    }
  }

  // Step 2: the first waiting request (in aged order) that has waited past the threshold and
  // fits once running sequences of a strictly lower (class, priority) are preempted, lowest
  // first. Returns the request the preemption made room for, or null (nobody preempted).
  const sequence* priority_preemption(const std::vector<const sequence*>& candidates) {
    if (cfg.priority_preempt_after_s <= 0 || candidates.empty() || run.empty()) return nullptr;
    std::vector<const sequence*> order = candidates;
    std::sort(order.begin(), order.end(), [&](const sequence* a, const sequence* b) { return aged_key(*a) < aged_key(*b); });
    int64_t base_need = cfg.kv_watermark_blocks;
    for (const sequence* s : run) base_need += append_cost(*s);
    for (const sequence* c : order) {
      if (now - c->enqueued_at < cfg.priority_preempt_after_s || !strictly_lower(*run.back(), *c)) continue;
      int64_t need = base_need + join_cost(*c).first;
      int64_t avail = dev;
      size_t alive = n_alive;
      auto fits = [&] { return alive < (size_t)cfg.max_num_seqs && need <= avail; };
      if (fits()) return nullptr;  // it can be admitted without anyone leaving
      std::vector<size_t> victims;
      for (size_t i = run.size(); i-- > 0 && !fits();) {
        if (!strictly_lower(*run[i], *c)) break;  // run is sorted: nobody before is lower
        // Each admission runs at least priority_preempt_after_s before it can be preempted for
        // priority, so aging (which admits old low-class work) and this rule cannot thrash.
        if (now - run[i]->running_since < cfg.priority_preempt_after_s) continue;
        victims.push_back(i);
        avail += kv.n_exclusive(run[i]->req.id);
        need -= append_cost(*run[i]);
        --alive;
      }
      if (!fits()) continue;  // not enough even so: preempt nobody for this one
      for (size_t i : victims) preempt(i, preempt_cause::priority);
      return c;
    }
    return nullptr;
  }

  // Step 3: KV positions for the running set, preempting from the back when blocks run out.
  void grow_running() {
    for (size_t i = 0; i < run.size(); ++i) {
      if (gone[i]) continue;
      const int32_t need = append_cost(*run[i]);
      while (need > dev) {
        size_t j = run.size();
        while (j-- > i + 1 && gone[j]) {}
        kv_preempted = true;
        if (j <= i) {  // nobody lower is left: this one yields
          preempt(i, preempt_cause::kv_exhausted);
          break;
        }
        preempt(j, preempt_cause::kv_exhausted);
      }
      if (!gone[i]) dev -= need;
    }
  }

  // Step 4: decodes, then prefill chunks of the running set. Returns the capped long prefills'
  // (index in d.run, tokens still left after its chunk).
  void batch_running(std::vector<std::pair<size_t, int64_t>>& capped) {
    for (size_t i = 0; i < run.size(); ++i)
      if (!gone[i] && remaining(*run[i]) == 1) {
        d.run.push_back({run[i]->req.id, 1});
        --tokens_left;
      }
    if (const int32_t allowance = core.prefill_allowance((int32_t)d.run.size()); allowance < tokens_left) {
      tokens_left = allowance;
      itl_bound = true;
    }
    for (size_t i = 0; i < run.size(); ++i) {
      const sequence& s = *run[i];
      if (gone[i] || remaining(s) == 1 || tokens_left <= 0) continue;
      const int64_t chunk = std::min({remaining(s), (int64_t)tokens_left, chunk_cap(s.long_prefill)});
      if (chunk < remaining(s) && chunk == chunk_cap(s.long_prefill)) capped.push_back({d.run.size(), remaining(s) - chunk});
      d.run.push_back({s.req.id, (int32_t)chunk});
      tokens_left -= (int32_t)chunk;
    }
  }

  // Step 5: admissions from the short and long queues.
  enum class outcome { admitted, no_kv, no_long_slot };
  outcome try_admit(const sequence& s, bool long_queue, bool forced, int& n_long,
                    std::vector<std::pair<size_t, int64_t>>& capped) {
    if (long_queue && n_long >= cfg.max_long_prefills && !forced) return outcome::no_long_slot;
    const auto [cost, left] = join_cost(s);
    if (cost + cfg.kv_watermark_blocks > dev) return outcome::no_kv;
    const int64_t chunk = std::min({left, (int64_t)tokens_left, chunk_cap(long_queue)});
    if (chunk < left && chunk == chunk_cap(long_queue)) capped.push_back({d.run.size() + d.admit.size(), left - chunk});
    d.admit.push_back({s.req.id, (int32_t)chunk});
    dev -= cost;
    tokens_left -= (int32_t)chunk;
    n_long += long_queue;
    return outcome::admitted;
  }

  void admit(const std::vector<const sequence*>& candidates, const sequence* reserved,
             std::vector<std::pair<size_t, int64_t>>& capped) {
    auto has_room = [&] { return n_alive + d.admit.size() < (size_t)cfg.max_num_seqs && tokens_left > 0; };
    int n_long = 0;
    for (size_t i = 0; i < run.size(); ++i) n_long += !gone[i] && run[i]->long_prefill;
    // The request a priority preemption made room for goes first.
    if (reserved && has_room()) try_admit(*reserved, core.is_long(*reserved), true, n_long, capped);
    std::vector<const sequence*> q[2];  // short, long
    for (const sequence* s : candidates)
      if (s != reserved) q[core.is_long(*s) ? 1 : 0].push_back(s);
    for (auto& v : q)
      std::sort(v.begin(), v.end(), [&](const sequence* a, const sequence* b) { return aged_key(*a) < aged_key(*b); });
    size_t head[2] = {0, 0};
    bool blocked[2] = {false, false};
    while (has_room()) {
      int k = -1;
      for (int c = 0; c < 2; ++c) {
        if (blocked[c] || head[c] >= q[c].size()) continue;
        if (k < 0 || aged_key(*q[c][head[c]]) < aged_key(*q[k][head[k]])) k = c;
      }
      if (k < 0) break;
      const sequence& s = *q[k][head[k]];
      switch (try_admit(s, k == 1, false, n_long, capped)) {
        case outcome::admitted:
          ++head[k];
          break;
        case outcome::no_long_slot:
          blocked[k] = true;  // waits for a long-prefill slot: the short queue passes freely
          break;
        case outcome::no_kv:
          // A head short of blocks holds its queue; the other queue passes it, unless it has
          // waited max_bypass_wait_s: then everyone waits until it fits.
          if (cfg.max_bypass_wait_s > 0 && now - s.enqueued_at >= cfg.max_bypass_wait_s) return;
          blocked[k] = true;
          break;
      }
    }
  }

  // Step 6: tokens nobody else wanted go to the long prefills that were held back.
  void extend(const std::vector<std::pair<size_t, int64_t>>& capped) {
    for (const auto& [idx, left] : capped) {
      if (tokens_left <= 0) break;
      const auto extra = (int32_t)std::min<int64_t>(left, tokens_left);
      scheduled_seq& e = idx < d.run.size() ? d.run[idx] : d.admit[idx - d.run.size()];
      e.n_tokens += extra;
      tokens_left -= extra;
    }
  }
};

std::vector<uint64_t> scheduler_core::waiting_by_age(double now) const {
  plan_context p(*this, now);
  std::vector<const sequence*> order;
  for (uint64_t id : waiting_) order.push_back(&seqs_.at(id));
  std::sort(order.begin(), order.end(), [&](const sequence* a, const sequence* b) { return p.aged_key(*a) < p.aged_key(*b); });
  std::vector<uint64_t> ids;
  for (const sequence* s : order) ids.push_back(s->req.id);
  return ids;
}

step_decision scheduler_core::decide(double now) const {
  plan_context p(*this, now);
  for (uint64_t id : running_) p.run.push_back(&seqs_.at(id));
  std::sort(p.run.begin(), p.run.end(),
            [&](const sequence* a, const sequence* b) { return p.static_key(*a) < p.static_key(*b); });
  p.gone.assign(p.run.size(), 0);
  p.n_alive = p.run.size();

  std::vector<const sequence*> candidates;
  p.timeouts(candidates);
  const sequence* reserved = p.priority_preemption(candidates);
  p.grow_running();
  std::vector<std::pair<size_t, int64_t>> capped;
  p.batch_running(capped);
  if (!p.kv_preempted) p.admit(candidates, reserved, capped);
  p.extend(capped);
  p.d.itl_capped = p.itl_bound && p.tokens_left == 0;
  return std::move(p.d);
}

}  // namespace troupe::actors
