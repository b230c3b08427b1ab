// The scheduler actor: one per served model. Wraps scheduler_core (queues, running set, block
// manager, the per-step plan) and drives the executor one step at a time; talks to request
// actors for tokens and final states. All of its state is touched only by its own handlers.
#include <chrono>
#include <unordered_map>

#include "actors/runtime.hpp"

namespace troupe::actors {

struct scheduler_state {
  struct seq_entry {
    caf::actor request;
    std::shared_ptr<const engine::sampling_params> sampling;
    std::vector<engine::token_id> stop_tokens;
    bool penalties = false;
  };
  std::unique_ptr<engine::block_manager> kv;
  std::unique_ptr<scheduler_core> core;
  std::shared_ptr<const engine::model> model;
  caf::actor executor;
  caf::actor_addr supervisor;  // the executor's sender (weak: it holds us): told when one is stopped for a failed step
  double hang_next_s = 0;  // tests: the next step hangs this long (inject_executor_hang)
  uint64_t epoch = 0;  // bumped per executor: replies from an earlier one are ignored
  int32_t n_executors = 0;
  int n_in_flight = 0;  // steps sent and not answered (two when one was planned ahead)
  bool circuit_open = false, tick_pending = false, fault_next = false, fault_loses_device = false, draining = false;
  bool retired = false;  // a published version replaced: fronts' new requests go to its successor
  std::string circuit_reason;  // "the model is unavailable: ..." once the circuit is open
  std::string device_lost;     // why, once the executor's device is lost (the circuit is open for good)
  std::vector<caf::response_promise> drain_waiters;  // answered once nothing is left
  std::unordered_map<uint64_t, seq_entry> seqs;
  std::unordered_map<caf::actor_addr, uint64_t> by_addr;
  std::vector<engine::block_copy> carry;  // copies of plans that had no batch, run with the next step
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double step_timeout_s = 120;
  std::string fingerprint;  // model_fingerprint() of the model, once a front has asked
  int64_t n_steps = 0, n_ahead = 0;  // steps answered; steps planned ahead
  double sched_s = 0, executor_s = 0;

  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

namespace {

using self_ptr = caf::stateful_actor<scheduler_state>*;

void forget(self_ptr self, uint64_t id) {
  auto& st = self->state;
  auto it = st.seqs.find(id);
  if (it == st.seqs.end()) return;
  st.by_addr.erase(it->second.request.address());
  self->demonitor(it->second.request);
  st.seqs.erase(it);
}

void executor_lost(self_ptr self) {
  auto& st = self->state;
  st.n_in_flight = 0;
  st.carry.clear();
  st.core->on_executor_lost(st.now());
}

void maybe_step(self_ptr self);

void on_output(self_ptr self, const step_output& out) {
  auto& st = self->state;
  const auto t0 = std::chrono::steady_clock::now();
  ++st.n_steps;
  st.executor_s += out.compute_s;
  std::vector<token_result> results;
  results.reserve(out.tokens.size());
  for (const sampled& s : out.tokens) {
    auto it = st.seqs.find(s.seq);
    if (it == st.seqs.end()) continue;  // cancelled while the step ran
    bool stop = false;
    for (engine::token_id t : it->second.stop_tokens) stop |= t == s.r.token;
    results.push_back({s.seq, s.r.token, stop});
    if (!stop) self->send(it->second.request, token_atom::value, s.seq, token_event{s.r});
  }
  for (const finished_seq& f : st.core->on_step_done(results, st.now(), out.compute_s)) {
    auto it = st.seqs.find(f.seq);
    if (it == st.seqs.end()) continue;
    self->send(it->second.request, finished_atom::value, f.seq, f.reason, (int32_t)f.generated.size());
    forget(self, f.seq);
  }
  st.sched_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void fail_all(self_ptr self, gen_error e, const std::string& why) {
  auto& st = self->state;
  for (auto& [id, entry] : st.seqs) {
    st.core->cancel(id);
    self->send(entry.request, failed_atom::value, id, e, why);
    self->demonitor(entry.request);
  }
  st.seqs.clear();
  st.by_addr.clear();
}

void schedule_tick(self_ptr self) {
  auto& st = self->state;
  if (st.tick_pending) return;
  st.tick_pending = true;
  self->delayed_send(self, std::chrono::milliseconds(10), tick_atom::value);
}

void send_step(self_ptr self, step_plan plan);

// Plans and sends what can go now: a full plan when no step is in flight, then (pipelining) the
// next step planned ahead while one step is in flight.
void maybe_step(self_ptr self) {
  auto& st = self->state;
  if (st.draining && st.seqs.empty() && !st.drain_waiters.empty()) {
    for (auto& rp : st.drain_waiters) rp.deliver(true);
    st.drain_waiters.clear();
  }
  if (!st.executor || st.circuit_open) return;
  if (st.n_in_flight == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    step_plan plan = st.core->schedule(st.now());
    st.sched_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const failure_event& f : plan.failed) {
      auto it = st.seqs.find(f.seq);
      if (it == st.seqs.end()) continue;
      self->send(it->second.request, failed_atom::value, f.seq, gen_error::queue_timeout, f.message);
      forget(self, f.seq);
    }
    st.carry.insert(st.carry.end(), plan.copies.begin(), plan.copies.end());
    if (plan.batch.empty()) {
      if (st.core->n_waiting() > 0) schedule_tick(self);  // queue timeouts, blocked admissions
      return;
    }
    send_step(self, std::move(plan));
  }
  if (st.n_in_flight == 1) {
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<step_plan> plan = st.core->schedule_ahead(st.now());
    st.sched_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (plan) {
      st.carry.insert(st.carry.end(), plan->copies.begin(), plan->copies.end());
      send_step(self, std::move(*plan));
      ++st.n_ahead;
    }
  }
}

void send_step(self_ptr self, step_plan plan) {
  auto& st = self->state;
  step_work w;
  w.step = plan.step;
  w.copies = std::move(st.carry);
  st.carry.clear();
  for (const batch_entry& e : plan.batch) {
    if (!e.need_logits) continue;
    const auto& entry = st.seqs.at(e.seq);
    const auto info = st.core->find(e.seq);
    // A decode planned ahead samples the draw after the step in flight's; the executor appends
    // the token it fed in to the history. (A request joining an ahead step is not one.)
    const bool fed = e.tokens.size() == 1 && e.tokens[0] == ahead_token;
    sample_spec sp{e.seq, entry.sampling, (uint64_t)info->n_generated + (fed ? 1 : 0), {}, {}};
    if (entry.penalties) sp.history.assign(info->tokens.begin(), info->tokens.end());
    if (entry.sampling->grammar) sp.output.assign(info->tokens.end() - info->n_generated, info->tokens.end());
    w.sampling.push_back(std::move(sp));
  }
  w.batch = std::move(plan.batch);
  w.inject_fault = std::exchange(st.fault_next, false);
  w.inject_device_loss = w.inject_fault && st.fault_loses_device;
  w.inject_hang_s = std::exchange(st.hang_next_s, 0.0);
  ++st.n_in_flight;
  const uint64_t epoch = st.epoch;
  const auto timeout = std::chrono::milliseconds((int64_t)(st.step_timeout_s * 1000));
  self->request(st.executor, timeout, step_atom::value, std::move(w))
      .then(
          [=](step_output& out) {
            if (self->state.epoch != epoch) return;
            --self->state.n_in_flight;
            on_output(self, out);
            maybe_step(self);
          },
          [=](caf::error& err) {
            auto& s = self->state;
            if (s.epoch != epoch) return;
            // The executor failed or hung: its KV is gone. Kill it (the supervisor restarts it, or
            // gives it up if it does not stop: stuck) and requeue every sequence for recompute.
            self->send_exit(s.executor, caf::exit_reason::kill);
            if (auto sup = caf::actor_cast<caf::actor>(s.supervisor))
              self->send<caf::message_priority::high>(sup, stuck_atom::value, s.executor.address());
            self->demonitor(s.executor);
            s.executor = nullptr;
            ++s.epoch;
            executor_lost(self);
          });
}

}  // namespace

namespace {
caf::behavior scheduler_actor(self_ptr self, scheduler_config_msg cfg) {
  auto& st = self->state;
  st.model = cfg.model;
  st.step_timeout_s = cfg.step_timeout_s;
  st.kv = std::make_unique<engine::block_manager>(cfg.kv_block_size, cfg.n_device_blocks, cfg.n_host_blocks,
                                                  engine::kv_block_hash, cfg.kv_groups);
  st.core = std::make_unique<scheduler_core>(cfg.sched, *st.kv);
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& s = self->state;
    if (s.executor && dm.source == s.executor.address()) {
      s.executor = nullptr;
      ++s.epoch;
      executor_lost(self);
      return;
    }
    auto it = s.by_addr.find(dm.source);
    if (it == s.by_addr.end()) return;
    const uint64_t id = it->second;
    s.core->cancel(id);  // the client went away, or its deadline passed
    s.seqs.erase(id);
    s.by_addr.erase(it);
    maybe_step(self);
  });
  return {
      [=](submit_atom, request_msg& m) -> admission {
        auto& s = self->state;
        if (s.circuit_open) return {admit_error::unavailable, s.circuit_reason};
        if (s.draining) return {admit_error::unavailable, "the model is draining: no new requests are admitted"};
        if (s.retired && self->current_sender() && self->current_sender()->node() != self->node())
          return {admit_error::unavailable, "this replica's model version was replaced by a reload: its successor serves new requests"};
        const uint64_t id = m.spec.id;
        admission a = s.core->add(std::move(m.spec), s.now());
        if (!a.ok()) return a;
        auto req = caf::actor_cast<caf::actor>(self->current_sender());
        const auto& p = *m.sampling;
        const bool penalties = p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
        s.seqs[id] = {req, m.sampling, std::move(m.stop_tokens), penalties};
        s.by_addr[req.address()] = id;
        self->monitor(req);
        maybe_step(self);
        return a;
      },
      [=](cancel_atom, uint64_t id) {
        auto& s = self->state;
        s.core->cancel(id);
        forget(self, id);
        maybe_step(self);
      },
      [=](priority_atom, uint64_t id, priority_class cls, int32_t priority) {
        self->state.core->set_priority(id, cls, priority);
        maybe_step(self);
      },
      [=](executor_atom, caf::actor& e) {
        auto& s = self->state;
        if (s.executor) {  // a replacement while one is believed alive: the old one is gone
          self->demonitor(s.executor);
          executor_lost(self);
        }
        ++s.epoch;
        ++s.n_executors;
        s.executor = e;
        s.supervisor = caf::actor_cast<caf::actor_addr>(self->current_sender());
        self->monitor(e);
        maybe_step(self);
      },
      [=](circuit_atom, const std::string& why, bool device_lost) {
        auto& s = self->state;
        s.circuit_open = true;
        s.circuit_reason = "the model is unavailable: " + why;
        if (device_lost) s.device_lost = why;
        fail_all(self, gen_error::unavailable, s.circuit_reason);
      },
      [=](closed_atom) {  // a new executor is up after the circuit opened on restarts
        auto& s = self->state;
        if (!s.device_lost.empty()) return;
        s.circuit_open = false;
        s.circuit_reason.clear();
        maybe_step(self);
      },
      [=](hang_atom, double seconds) { self->state.hang_next_s = seconds; },
      [=](fault_atom, bool lose_device) {
        self->state.fault_next = true;
        self->state.fault_loses_device = lose_device;
      },
      [=](retire_atom) { self->state.retired = true; },
      // A front server asks what this (published) scheduler serves before routing to it.
      [=](info_atom) {
        auto& s = self->state;
        if (s.fingerprint.empty()) s.fingerprint = model_fingerprint(*s.model);  // on the first front's question only
        return s.fingerprint;
      },
      // Drain: refuse new work, finish what is admitted, answer true when nothing is left.
      [=](drain_atom) -> caf::result<bool> {
        auto& s = self->state;
        s.draining = true;
        if (s.seqs.empty()) return true;
        s.drain_waiters.push_back(self->make_response_promise());
        return s.drain_waiters.back();
      },
      [=](tick_atom) {
        self->state.tick_pending = false;
        maybe_step(self);
      },
      [=](stats_atom) -> stats_reply {
        auto& s = self->state;
        stats_reply r;
        r.s.sched = s.core->stats();
        r.s.kv = s.kv->stats();
        r.s.n_device_blocks = s.kv->n_device();
        r.s.max_positions = s.kv->max_positions();
        r.s.kv_groups = s.kv->groups();
        r.s.n_free_device = s.kv->n_free_device();
        r.s.n_cached = s.kv->n_cached();
        r.s.n_host_blocks = s.kv->n_host();
        r.s.n_free_host = s.kv->n_free_host();
        r.s.n_running = s.core->n_running();
        r.s.n_waiting = s.core->n_waiting();
        r.s.executor_restarts = s.n_executors > 0 ? s.n_executors - 1 : 0;
        r.s.executor_alive = (bool)s.executor;
        r.s.circuit_open = s.circuit_open;
        r.s.device_lost = s.device_lost;
        r.s.invariant_error = s.core->check();
        r.s.n_steps = s.n_steps;
        r.s.n_steps_ahead = s.n_ahead;
        r.s.sched_s = s.sched_s;
        r.s.executor_s = s.executor_s;
        return r;
      },
  };
}

}  // namespace

caf::actor spawn_scheduler(caf::actor_system& sys, scheduler_config_msg cfg) { return sys.spawn(scheduler_actor, std::move(cfg)); }

}  // namespace troupe::actors
