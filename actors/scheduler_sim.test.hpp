// Test support for the scheduler simulations: a fake executor over fake paged KV memory, the
// reference generation it must reproduce, and a driver that runs steps and checks invariants.
#pragma once

#include <catch2/catch.hpp>

#include <deque>
#include <functional>
#include <map>
#include <tuple>

#include "actors/scheduler_policy.hpp"

namespace troupe::actors::sim {

using tokens_t = std::vector<token_id>;
constexpr token_id n_vocab = 1000;

/// The "model": the next token is a hash of the sequence id and the whole context, so a wrong
/// block table, copy, cache hit or position changes it.
inline token_id next_token(uint64_t seq, std::span<const token_id> context) {
  uint64_t h = 0x9e3779b97f4a7c15ULL ^ seq;
  for (token_id t : context) {
    h ^= (uint64_t)(uint32_t)t + 0x632be59bd9b4e019ULL;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 29;
  }
  return (token_id)(h % (uint64_t)n_vocab);
}

using stop_fn = std::function<bool(uint64_t seq, token_id t)>;

/// What a run without any scheduling effect produces: generated tokens, stop token included.
inline tokens_t reference(uint64_t seq, tokens_t context, int32_t max_tokens, const stop_fn& stop = {}) {
  const size_t n_prompt = context.size();
  for (int32_t i = 0; i < max_tokens; ++i) {
    const token_id t = next_token(seq, context);
    context.push_back(t);
    if (stop && stop(seq, t)) break;
  }
  return tokens_t(context.begin() + (ptrdiff_t)n_prompt, context.end());
}

/// Executes plans on fake KV memory: each slot holds the token whose KV would be there. The
/// context a sequence attends to is read back through its block table: group 0's (every
/// position), and with sliding-window groups each one's over the window of the chunk's rows,
/// which must hold the same tokens.
class fake_executor {
 public:
  fake_executor(int block_size, int32_t n_device, int32_t n_host, engine::kv_groups groups = {})
      : bs_(block_size), groups_(groups), device_((size_t)n_device * block_size, -1), host_((size_t)n_host * block_size, -1) {}

  std::vector<token_result> run(const step_plan& plan, const stop_fn& stop) {
    using kind = engine::block_copy::kind;
    for (const auto& c : plan.copies) {
      const auto& src = c.dir == kind::host_to_device ? host_ : device_;
      auto& dst = c.dir == kind::device_to_host ? host_ : device_;
      std::copy_n(src.begin() + (ptrdiff_t)c.src * bs_, bs_, dst.begin() + (ptrdiff_t)c.dst * bs_);
    }
    // Two entries writing one slot in a step would corrupt each other's KV.
    std::map<size_t, uint64_t> written;
    for (const auto& e : plan.batch) {
      REQUIRE(e.block_table.size() % (size_t)groups_.n == 0);
      for (size_t i = 0; i < e.tokens.size(); ++i) {
        token_id t = e.tokens[i];
        if (t == ahead_token) {  // a decode planned ahead: the token sampled in the step before
          REQUIRE(last_.count(e.seq));
          t = last_.at(e.seq);
        }
        for (int g = 0; g < groups_.n; ++g) {
          const size_t slot = slot_of(group_table(e, g), e.pos0 + (int64_t)i);
          const auto [it, fresh] = written.emplace(slot, e.seq);
          INFO("step " << plan.step << " seq " << e.seq << " pos " << e.pos0 + (int64_t)i << " group " << g);
          REQUIRE((fresh || it->second == e.seq));
          device_[slot] = t;
        }
      }
    }
    last_.clear();
    std::vector<token_result> out;
    for (const auto& e : plan.batch) {
      if (!e.need_logits) continue;
      const int64_t n = e.pos0 + (int64_t)e.tokens.size();
      tokens_t context((size_t)n);
      for (int64_t p = 0; p < n; ++p) context[(size_t)p] = device_[slot_of(group_table(e, 0), p)];
      for (int g = 1; g < groups_.n; ++g)
        for (int64_t p = std::max<int64_t>(0, e.pos0 - groups_.window + 1); p < n; ++p) {
          INFO("seq " << e.seq << " pos " << p << " sliding group " << g);
          REQUIRE(device_[slot_of(group_table(e, g), p)] == context[(size_t)p]);
        }
      const token_id t = next_token(e.seq, context);
      out.push_back({e.seq, t, stop && stop(e.seq, t)});
      last_[e.seq] = t;
    }
    return out;
  }

 private:
  std::span<const int32_t> group_table(const batch_entry& e, int g) const {
    const size_t n = e.block_table.size() / (size_t)groups_.n;
    return std::span(e.block_table).subspan((size_t)g * n, n);
  }
  size_t slot_of(std::span<const int32_t> table, int64_t p) const {
    const auto j = (size_t)(p / bs_);
    REQUIRE(j < table.size());
    REQUIRE(table[j] >= 0);
    return (size_t)table[j] * (size_t)bs_ + (size_t)(p % bs_);
  }
  int bs_;
  engine::kv_groups groups_;
  std::vector<int> device_, host_;
  std::map<uint64_t, token_id> last_;  // sampled by the last step with a batch
};

/// One scheduler over one block manager and a fake executor, with a clock.
struct driver {
  engine::block_manager kv;
  scheduler_core core;
  fake_executor exec;
  double now = 0;
  double dt = 0.01;
  stop_fn stop;
  // The executor's measured time of a step, reported to the scheduler (unset: not measured).
  std::function<double(const step_plan&)> step_seconds;
  std::map<uint64_t, finished_seq> finished;
  std::map<uint64_t, failure_event> failed;
  std::vector<preemption_event> preempted;
  std::map<uint64_t, request_spec> added;
  step_plan last;

  driver(const scheduler_config& cfg, int block_size, int32_t n_device, int32_t n_host, engine::kv_groups groups = {})
      : kv(block_size, n_device, n_host, engine::kv_block_hash, groups), core(cfg, kv), exec(block_size, n_device, n_host, groups) {}

  admission add(uint64_t id, tokens_t prompt, int32_t max_tokens, priority_class cls = priority_class::normal,
                int32_t priority = 0, double timeout = 0) {
    request_spec r{id, std::move(prompt), max_tokens, cls, priority, timeout};
    admission a = core.add(r, now);
    if (a.ok()) added[id] = std::move(r);
    return a;
  }

  /// One step: plan, execute, report. Checks every invariant afterwards.
  const step_plan& step() {
    last = core.schedule(now);
    REQUIRE(last.n_tokens <= core.config().max_batched_tokens);
    REQUIRE((int32_t)last.batch.size() <= core.config().max_num_seqs);
    int32_t n_tokens = 0;
    for (size_t i = 0; i < last.batch.size(); ++i) {
      const auto& e = last.batch[i];
      REQUIRE(!e.tokens.empty());
      n_tokens += (int32_t)e.tokens.size();
      if ((int32_t)i < last.n_decodes) REQUIRE((e.tokens.size() == 1 && e.need_logits));  // decodes first
    }
    REQUIRE(n_tokens == last.n_tokens);
    for (const auto& f : last.failed) failed[f.seq] = f;
    preempted.insert(preempted.end(), last.preempted.begin(), last.preempted.end());
    if (!last.batch.empty()) {
      const auto results = exec.run(last, stop);
      for (auto& f : core.on_step_done(results, now, seconds_of(last))) finished[f.seq] = f;
    }
    INFO("step " << last.step);
    REQUIRE(core.check() == "");
    now += dt;
    return last;
  }

  void run_until_idle(int max_steps = 10000) {
    for (int i = 0; i < max_steps && (core.n_running() > 0 || core.n_waiting() > 0); ++i) step();
    REQUIRE(core.n_running() == 0);
    REQUIRE(core.n_waiting() == 0);
  }

  double seconds_of(const step_plan& p) const { return step_seconds ? step_seconds(p) : -1; }

  /// Runs to idle as the scheduler actor does with pipelining: a full plan when no step is in
  /// flight, then a plan ahead while one is; the executor takes the steps in order.
  /// `arrivals(i)` is called before iteration i (to add requests) and says whether more will come.
  /// Returns the steps planned ahead.
  int run_pipelined(const std::function<bool(int)>& arrivals, int max_iters = 20000,
                    const std::function<void(const step_plan&)>& on_done = {}) {
    std::deque<step_plan> q;
    int n_ahead = 0;
    bool more = true;
    for (int i = 0; i < max_iters; ++i) {
      more = arrivals && arrivals(i);
      if (!core.step_in_flight()) {
        step_plan p = core.schedule(now);
        for (const auto& f : p.failed) failed[f.seq] = f;
        preempted.insert(preempted.end(), p.preempted.begin(), p.preempted.end());
        if (p.batch.empty()) exec.run(p, stop);  // copies only
        else q.push_back(std::move(p));
      }
      if (core.n_steps_in_flight() == 1)
        if (auto a = core.schedule_ahead(now)) {
          REQUIRE(a->n_tokens <= core.config().max_batched_tokens);
          ++n_ahead;
          q.push_back(std::move(*a));
        }
      REQUIRE(core.n_steps_in_flight() == q.size());
      if (!q.empty()) {
        const step_plan p = std::move(q.front());
        q.pop_front();
        const auto results = exec.run(p, stop);
        for (auto& f : core.on_step_done(results, now, seconds_of(p))) finished[f.seq] = f;
        if (on_done) on_done(p);
      }
      INFO("iteration " << i);
      REQUIRE(core.check() == "");
      now += dt;
      if (q.empty() && core.n_running() == 0 && core.n_waiting() == 0 && !more) break;
    }
    REQUIRE(core.n_running() == 0);
    REQUIRE(core.n_waiting() == 0);
    return n_ahead;
  }

  /// The finished sequence generated exactly what a run alone would have.
  void require_reference(uint64_t id) {
    REQUIRE(finished.count(id));
    const request_spec& r = added.at(id);
    REQUIRE(finished.at(id).generated == reference(id, r.prompt, r.max_tokens, stop));
  }

  /// Every test ends here: invariants hold and both pools are back to full.
  void require_drained() {
    REQUIRE(core.check() == "");
    kv.clear_cache();
    REQUIRE(kv.check() == "");
    REQUIRE(kv.n_free_device() == kv.n_device());
    REQUIRE(kv.n_free_host() == kv.n_host());
  }
};

/// A plan's batch as (seq, pos0, n_tokens, need_logits) rows.
using row = std::tuple<uint64_t, int64_t, size_t, bool>;
inline std::vector<row> rows(const step_plan& p) {
  std::vector<row> r;
  for (const auto& e : p.batch) r.emplace_back(e.seq, e.pos0, e.tokens.size(), e.need_logits);
  return r;
}

inline std::vector<uint64_t> ids(const step_plan& p) {
  std::vector<uint64_t> r;
  for (const auto& e : p.batch) r.push_back(e.seq);
  return r;
}

inline tokens_t prompt_of(int n, token_id first) {
  tokens_t t((size_t)n);
  for (int i = 0; i < n; ++i) t[(size_t)i] = (first + i) % n_vocab;
  return t;
}

}  // namespace troupe::actors::sim
