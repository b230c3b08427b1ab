// Message order where it matters, made deterministic with CAF's test coordinator: every message
// is delivered only when the test runs the scheduler, and the executor is a fake whose replies
// the test releases by hand.
#include <catch2/catch.hpp>

#include <caf/scheduler/test_coordinator.hpp>

#include <filesystem>

#include "actors/runtime.hpp"

using namespace troupe;
using namespace troupe::actors;

namespace {

step_output answer(const step_work& w, engine::token_id token) {
  step_output out;
  out.step = w.step;
  for (const auto& s : w.sampling) out.tokens.push_back({s.seq, {token, 0.0f, {}}});
  return out;
}

struct fake_executor_log {
  std::vector<caf::response_promise> pending;
  std::vector<step_work> steps;
};

caf::behavior fake_executor(caf::event_based_actor* self, std::shared_ptr<fake_executor_log> log) {
  return {
      [=](step_atom, const step_work& w) {
        log->steps.push_back(w);
        log->pending.push_back(self->make_response_promise());
        return log->pending.back();
      },
      // The test releases reply i with `token` (delivered from inside the actor's own context).
      [=](tick_atom, size_t i, engine::token_id token) { log->pending.at(i).deliver(answer(log->steps.at(i), token)); },
  };
}

struct fixture {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::scheduler::test_coordinator* sched = nullptr;
  std::shared_ptr<const engine::model> model;
  caf::actor scheduler;

  // Most tests here pin down the one-step protocol; the pipelining test turns planning ahead on.
  explicit fixture(bool plan_ahead = false) {
    cfg.set("scheduler.policy", caf::atom("testing"));
    sys = std::make_unique<caf::actor_system>(cfg);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(sys->scheduler());
    model = engine::model::load((std::filesystem::path(TROUPE_SOURCE_DIR) / "models" / "default.gguf").string());
    scheduler_config sc;
    sc.max_model_len = 512;
    sc.plan_ahead = plan_ahead;
    scheduler = spawn_scheduler(*sys, {sc, model, 16, 64, 64, 120});
  }
  ~fixture() {
    caf::anon_send_exit(scheduler, caf::exit_reason::user_shutdown);
    sched->run();
    sys->await_actors_before_shutdown(false);  // the fake executors live on; nothing runs them now
  }
  std::shared_ptr<generation_stream> submit(uint64_t id, int max_tokens) {
    generation_params p;
    p.prompt = model->vocab().encode("Hello there", true, false);
    p.sampling.temperature = 0;
    p.sampling.ignore_eos = true;
    p.max_tokens = max_tokens;
    auto s = std::make_shared<generation_stream>((size_t)max_tokens + 2);
    auto req = sys->spawn(request_actor, std::make_shared<replica_router>(scheduler, true), model, p, id, s);
    s->set_canceller([req] { caf::anon_send<caf::message_priority::high>(req, cancel_atom::value); }, id);
    return s;
  }
  engine_stats stats() {
    auto out = std::make_shared<engine_stats>();
    sys->spawn([this, out](caf::event_based_actor* self) {
      self->request(scheduler, caf::infinite, stats_atom::value).then([=](stats_reply& r) { *out = r.s; }, [](caf::error&) {});
    });
    sched->run();
    return *out;
  }
};

std::vector<stream_event> take_all(generation_stream& s) {
  std::vector<stream_event> evs;
  while (auto ev = s.next(std::chrono::milliseconds(0))) evs.push_back(*ev);
  return evs;
}

}  // namespace

TEST_CASE("a step reply from a replaced executor is ignored and the sequence is recomputed", "[actors][order]") {
  fixture f;
  auto log1 = std::make_shared<fake_executor_log>(), log2 = std::make_shared<fake_executor_log>();
  auto e1 = f.sys->spawn(fake_executor, log1);
  caf::anon_send(f.scheduler, executor_atom::value, e1);
  auto s = f.submit(1, 3);
  f.sched->run();
  REQUIRE(log1->steps.size() == 1);  // the prefill went to e1
  const int64_t n_prompt = (int64_t)log1->steps[0].batch[0].tokens.size();

  // The supervisor hands over a new executor while e1's step is still out.
  auto e2 = f.sys->spawn(fake_executor, log2);
  caf::anon_send(f.scheduler, executor_atom::value, e2);
  f.sched->run();
  REQUIRE(log2->steps.size() == 1);
  CHECK(log2->steps[0].batch[0].pos0 == 0);  // recomputed from scratch
  CHECK((int64_t)log2->steps[0].batch[0].tokens.size() == n_prompt);

  // e1 answers late: ignored, no token reaches the client.
  caf::anon_send(e1, tick_atom::value, size_t{0}, engine::token_id{42});
  f.sched->run();
  CHECK(take_all(*s).empty());

  // e2's answers drive the sequence to its end.
  for (int i = 0; i < 3; ++i) {
    REQUIRE(log2->pending.size() == (size_t)i + 1);
    caf::anon_send(e2, tick_atom::value, (size_t)i, engine::token_id{100 + i});
    f.sched->run();
  }
  auto evs = take_all(*s);
  REQUIRE(evs.size() == 4);
  for (int i = 0; i < 3; ++i) CHECK(evs[(size_t)i].token == 100 + i);
  CHECK(evs[3].type == stream_event::kind::done);
  const auto st = f.stats();
  CHECK(st.invariant_error.empty());
  CHECK(st.n_free_device + st.n_cached == st.n_device_blocks);
}

TEST_CASE("a high-priority cancel overtakes the step reply queued before it", "[actors][order]") {
  fixture f;
  auto log = std::make_shared<fake_executor_log>();
  auto e = f.sys->spawn(fake_executor, log);
  caf::anon_send(f.scheduler, executor_atom::value, e);
  auto s = f.submit(7, 10);
  f.sched->run();
  REQUIRE(log->steps.size() == 1);
  // Queue the step's reply in the scheduler's mailbox, then a cancel at high priority, before
  // the scheduler runs again.
  caf::anon_send(e, tick_atom::value, size_t{0}, engine::token_id{5});
  f.sched->run_jobs_filtered([&](caf::resumable* r) { return dynamic_cast<caf::abstract_actor*>(r) == caf::actor_cast<caf::abstract_actor*>(e); });
  // The cancel a request actor sends when its client goes away, queued behind the reply.
  caf::anon_send<caf::message_priority::high>(f.scheduler, cancel_atom::value, uint64_t{7});
  f.sched->run();
  s->cancel();  // and the client's own end
  f.sched->run();
  // The token of the cancelled sequence never reached the client, and nothing is left running.
  auto evs = take_all(*s);
  REQUIRE(evs.size() == 1);
  CHECK(evs[0].type == stream_event::kind::error);
  CHECK(evs[0].error == gen_error::cancelled);
  const auto st = f.stats();
  CHECK(st.n_running == 0);
  CHECK(st.sched.n_cancelled == 1);
  CHECK(st.n_free_device + st.n_cached == st.n_device_blocks);
  CHECK(log->steps.size() == 1);  // no further step was planned for it
}

TEST_CASE("a request actor that dies frees its sequence through its down message", "[actors][order]") {
  fixture f;
  auto log = std::make_shared<fake_executor_log>();
  auto e = f.sys->spawn(fake_executor, log);
  caf::anon_send(f.scheduler, executor_atom::value, e);
  generation_params p;
  p.prompt = f.model->vocab().encode("Hi", true, false);
  p.sampling.temperature = 0;
  p.max_tokens = 50;
  auto s = std::make_shared<generation_stream>(52);
  auto req = f.sys->spawn(request_actor, std::make_shared<replica_router>(f.scheduler, true), f.model, p, 9, s);
  f.sched->run();
  REQUIRE(f.stats().n_running == 1);
  caf::anon_send_exit(req, caf::exit_reason::kill);  // no cancel message: only the down message
  f.sched->run();
  caf::anon_send(e, tick_atom::value, size_t{0}, engine::token_id{5});
  f.sched->run();
  const auto st = f.stats();
  CHECK(st.n_running == 0);
  CHECK(st.n_waiting == 0);
  CHECK(st.n_free_device + st.n_cached == st.n_device_blocks);
  CHECK(st.invariant_error.empty());
}

TEST_CASE("pipelining: the next decode is planned while a step runs, a finished sequence's ahead token is dropped", "[actors][order]") {
  fixture f(true);
  auto log = std::make_shared<fake_executor_log>();
  auto e = f.sys->spawn(fake_executor, log);
  caf::anon_send(f.scheduler, executor_atom::value, e);
  auto s = f.submit(3, 3);
  f.sched->run();
  // The prefill went out, and at once the decode after it, before any result came back.
  REQUIRE(log->steps.size() == 2);
  const int64_t n_prompt = (int64_t)log->steps[0].batch[0].tokens.size();
  const batch_entry& ahead = log->steps[1].batch.at(0);
  CHECK(ahead.pos0 == n_prompt);
  CHECK(ahead.tokens == std::vector<engine::token_id>{ahead_token});
  CHECK(ahead.need_logits);
  REQUIRE(log->steps[1].sampling.size() == 1);
  CHECK(log->steps[1].sampling[0].draw_index == 1);  // the draw after the prefill's

  // The prefill's token: the third step (the last token, max_tokens 3) is planned ahead in turn.
  caf::anon_send(e, tick_atom::value, size_t{0}, engine::token_id{10});
  f.sched->run();
  REQUIRE(log->steps.size() == 3);
  CHECK(log->steps[2].batch.at(0).pos0 == n_prompt + 1);
  // The second token: nothing more is planned (the third is the sequence's last).
  caf::anon_send(e, tick_atom::value, size_t{1}, engine::token_id{11});
  f.sched->run();
  CHECK(log->steps.size() == 3);
  caf::anon_send(e, tick_atom::value, size_t{2}, engine::token_id{12});
  f.sched->run();
  auto evs = take_all(*s);
  REQUIRE(evs.size() == 4);
  CHECK(evs[0].token == 10);
  CHECK(evs[1].token == 11);
  CHECK(evs[2].token == 12);
  CHECK(evs[3].type == stream_event::kind::done);

  // A sequence that stops (its stop token) while its ahead decode is out: that token is dropped,
  // and every block comes back.
  generation_params p;
  p.prompt = f.model->vocab().encode("Stop here", true, false);
  p.sampling.temperature = 0;
  p.max_tokens = 50;
  auto s2 = std::make_shared<generation_stream>(52);
  f.sys->spawn(request_actor, std::make_shared<replica_router>(f.scheduler, true), f.model, p, 4, s2);
  f.sched->run();
  REQUIRE(log->steps.size() == 5);  // its prefill and the decode ahead
  const engine::token_id eos = f.model->vocab().eos();
  caf::anon_send(e, tick_atom::value, size_t{3}, eos);
  f.sched->run();
  caf::anon_send(e, tick_atom::value, size_t{4}, engine::token_id{77});
  f.sched->run();
  auto evs2 = take_all(*s2);
  REQUIRE(evs2.size() == 1);
  CHECK(evs2[0].type == stream_event::kind::done);
  CHECK(evs2[0].finish == finish_reason::stop);
  const auto st = f.stats();
  CHECK(st.n_running == 0);
  CHECK(st.invariant_error.empty());
  CHECK(st.n_free_device + st.n_cached == st.n_device_blocks);
  CHECK(st.n_steps_ahead == 3);
}

