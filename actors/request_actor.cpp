// The request actor: one per generation. Holds the sampling parameters, the deadline and the
// client's bounded stream; turns tokens into streamed text (valid UTF-8, stop strings cut).
// It knows nothing of batching. Its end — client cancel, deadline, stop string, final state —
// is how the scheduler learns to drop the sequence (a high-priority cancel, and its down message).
#include <random>

#include "actors/runtime.hpp"

namespace troupe::actors {

namespace {

struct request_state {
  std::shared_ptr<generation_stream> stream;
  engine::stream_decoder dec;
  engine::stop_matcher stops;
  int32_t n_prompt = 0, n_generated = 0;
  bool logprobs = false;
  // Where it runs: the replica's index in the router and its scheduler (null between replicas).
  size_t index = 0;
  caf::actor scheduler;
  std::vector<size_t> tried;  // replicas it was submitted to, in order
  bool released = true;       // the router does not count it at `index`
  std::function<void(const std::string&)> on_lost;
  request_state(const engine::tokenizer& tok, std::vector<std::string> stop_strings)
      : dec(tok, false), stops(std::move(stop_strings)) {}
};

stream_event error_event(gen_error e, std::string msg) {
  stream_event ev;
  ev.type = stream_event::kind::error;
  ev.error = e;
  ev.message = std::move(msg);
  return ev;
}

gen_error from_admit(admit_error e) {
  switch (e) {
    case admit_error::none: return gen_error::none;
    case admit_error::invalid_request: return gen_error::invalid;
    case admit_error::duplicate_id: return gen_error::internal;
    case admit_error::too_long: return gen_error::too_long;
    case admit_error::queue_full: return gen_error::overloaded;
    case admit_error::queue_tokens_full: return gen_error::overloaded;
    case admit_error::unavailable: return gen_error::unavailable;
  }
  return gen_error::internal;
}

}  // namespace

caf::behavior request_actor(caf::event_based_actor* self, std::shared_ptr<replica_router> router, std::shared_ptr<const engine::model> model,
                            generation_params params, uint64_t id, std::shared_ptr<generation_stream> stream) {
  const engine::tokenizer& tok = model->vocab();
  auto st = std::make_shared<request_state>(tok, params.sampling.stop);
  st->stream = stream;
  st->n_prompt = (int32_t)params.prompt.size();
  st->logprobs = params.sampling.logprobs || params.sampling.top_logprobs > 0;

  auto finish_with = [=](stream_event ev) {
    // Out of the router's count before the client sees the end (the actor's cleanup comes later).
    if (!st->released) router->release(st->index);
    st->released = true;
    st->stream->push(std::move(ev));
    // Drop the monitor on the scheduler explicitly: a long-lived scheduler must not collect one
    // attachment per request that ever ran (whether CAF 0.17 removes it when this actor ends was
    // not checked).
    if (st->scheduler) self->demonitor(st->scheduler);
    self->quit();
  };
  auto cancel_and_finish = [=](stream_event ev) {
    if (st->scheduler) self->send<caf::message_priority::high>(st->scheduler, cancel_atom::value, id);
    finish_with(std::move(ev));
  };

  // Validate what the scheduler cannot: sampling values and token ids.
  std::string err = params.sampling.validate();
  for (engine::token_id t : params.prompt)
    if (err.empty() && (t < 0 || t >= model->hparams().n_vocab))
      err = "prompt token " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(model->hparams().n_vocab) + ")";
  if (!std::isfinite(params.deadline_s) || params.deadline_s < 0) err = "the deadline must be a finite number of seconds >= 0";
  if (!err.empty()) {
    finish_with(error_event(gen_error::invalid, err));
    return {};
  }

  // Prefix-aware routing: the chain hashes of the prompt's full blocks (only with remote replicas).
  auto prefix = std::make_shared<const std::vector<uint64_t>>(router->wants_prefix() ? router->prefix_hashes(params.prompt)
                                                                                     : std::vector<uint64_t>{});
  auto m = std::make_shared<request_msg>();
  m->spec = {id, std::move(params.prompt), params.max_tokens, params.cls, params.priority, params.queue_timeout_s};
  auto sp = std::make_shared<engine::sampling_params>(params.sampling);
  if (!sp->has_seed) {  // stateless sampling needs a seed: draw one per request
    sp->seed = std::random_device{}() * 0x100000001ULL ^ std::random_device{}();
    sp->has_seed = true;
  }
  m->sampling = sp;
  if (!params.sampling.ignore_eos)
    for (engine::token_id t : tok.eog_ids()) m->stop_tokens.push_back(t);
  for (engine::token_id t : params.sampling.stop_tokens) m->stop_tokens.push_back(t);

  // Submits to the least loaded replica not tried yet. One lost before the first token (or that
  // refuses the request as unavailable: draining, its circuit open) leaves it to another; the
  // seeded, stateless sampling makes the moved generation draw what it would have drawn.
  auto leave = [=] {
    if (st->scheduler) self->demonitor(st->scheduler);
    st->scheduler = nullptr;
    if (!st->released) router->release(st->index);
    st->released = true;
  };
  auto submit = std::make_shared<std::function<void(const std::string&)>>();
  *submit = [=](const std::string& why_moved) {
    auto c = router->pick(st->tried, *prefix);
    if (!c) {
      finish_with(error_event(gen_error::unavailable, why_moved.empty() ? "no replica is serving this model" : why_moved));
      return;
    }
    st->index = c->index;
    st->scheduler = c->scheduler;
    st->released = false;
    st->tried.push_back(c->index);
    self->monitor(st->scheduler);
    const caf::actor sched = st->scheduler;
    self->request(sched, std::chrono::seconds(60), submit_atom::value, *m)
        .then(
            [=](const admission& a) {
              if (a.ok() || sched != st->scheduler) return;
              if (a.error != admit_error::unavailable) return finish_with(error_event(from_admit(a.error), a.message));
              leave();
              (*submit)(a.message);
            },
            [=](caf::error& e) {
              if (sched == st->scheduler) st->on_lost(self->system().render(e));
            });
  };
  st->on_lost = [=](const std::string& why) {
    const size_t index = st->index;
    router->lost(index);
    leave();
    const std::string text = "the replica " + router->name(index) + " serving this generation was lost: " + why;
    // The local scheduler goes only when the engine stops: nothing moves then.
    if (st->n_generated == 0 && !router->is_local(index)) (*submit)(text);
    else finish_with(error_event(gen_error::unavailable, text));
  };
  self->attach_functor([=] {
    if (!st->released) router->release(st->index);
    st->on_lost = nullptr;  // break the cycles through the captures
    *submit = nullptr;
  });
  self->set_down_handler([=](caf::down_msg& dm) {
    if (st->scheduler && dm.source == st->scheduler.address()) st->on_lost(self->system().render(dm.reason));
  });
  (*submit)("");

  if (params.deadline_s > 0)
    self->delayed_send(self, std::chrono::microseconds((int64_t)(params.deadline_s * 1e6)), deadline_atom::value);

  return {
      [=](token_atom, uint64_t, const token_event& t) {
        ++st->n_generated;
        auto piece = st->stops.push(st->dec.push(t.r.token));
        stream_event ev;
        ev.token = t.r.token;
        ev.text = std::move(piece.text);
        if (st->logprobs) {
          ev.logprob = t.r.logprob;
          ev.top = t.r.top;
        }
        st->stream->push(std::move(ev));
        if (piece.stopped) {
          stream_event done;
          done.type = stream_event::kind::done;
          done.finish = finish_reason::stop;
          done.n_prompt = st->n_prompt;
          done.n_generated = st->n_generated;
          cancel_and_finish(std::move(done));
        }
      },
      [=](finished_atom, uint64_t, finish_reason r, int32_t n_generated) {
        stream_event done;
        done.type = stream_event::kind::done;
        done.finish = r;
        done.text = st->stops.push(st->dec.flush()).text;
        done.text += st->stops.flush();
        done.n_prompt = st->n_prompt;
        done.n_generated = n_generated;
        finish_with(std::move(done));
      },
      [=](failed_atom, uint64_t, gen_error e, const std::string& why) { finish_with(error_event(e, why)); },
      [=](priority_atom, priority_class cls, int32_t priority) {
        if (st->scheduler) self->send<caf::message_priority::high>(st->scheduler, priority_atom::value, id, cls, priority);
      },
      [=](cancel_atom) { cancel_and_finish(error_event(gen_error::cancelled, "cancelled by the client")); },
      [=](deadline_atom) { cancel_and_finish(error_event(gen_error::deadline, "the request deadline passed")); },
  };
}

}  // namespace troupe::actors
