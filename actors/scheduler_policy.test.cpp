// Scheduler simulations, part 1: batching, budgets, chunked prefill, queues, aging, admission.
#include "actors/scheduler_sim.test.hpp"

using namespace troupe::actors;
using namespace troupe::actors::sim;

namespace {

// Deterministic defaults for scripted tests: no aging, no priority preemption, no long queue.
scheduler_config base_config() {
  scheduler_config c;
  c.max_batched_tokens = 16;
  c.max_num_seqs = 4;
  c.long_prompt_threshold = 1000;
  c.aging_s = 0;
  c.priority_preempt_after_s = 0;
  c.max_bypass_wait_s = 0;
  return c;
}

}  // namespace

TEST_CASE("scheduler config is validated", "[scheduler]") {
  REQUIRE(validate(scheduler_config{}) == "");
  scheduler_config c;
  c.max_batched_tokens = 8;
  c.max_num_seqs = 9;
  REQUIRE_FALSE(validate(c).empty());
  troupe::engine::block_manager kv(4, 8, 0);
  REQUIRE_THROWS_AS(scheduler_core(c, kv), std::invalid_argument);
  c = {};
  c.max_long_prefills = 0;
  REQUIRE_FALSE(validate(c).empty());
  REQUIRE(std::string(to_string(admit_error::queue_full)) == "queue_full");
  REQUIRE(std::string(to_string(preempt_cause::priority)) == "priority");
}

TEST_CASE("a step takes running decodes first, then prefill chunks under the token budget", "[scheduler]") {
  driver d(base_config(), 4, 64, 0);
  REQUIRE(d.add(1, prompt_of(6, 10), 3).ok());
  REQUIRE(d.add(2, prompt_of(20, 100), 2).ok());

  d.step();
  REQUIRE(rows(d.last) == std::vector<row>{{1, 0, 6, true}, {2, 0, 10, false}});
  REQUIRE(d.last.n_tokens == 16);
  REQUIRE(d.last.n_decodes == 0);
  REQUIRE(d.last.batch[1].block_table.size() == 3);  // covers [0, 10)

  REQUIRE(d.add(3, prompt_of(9, 300), 1).ok());
  d.step();  // 1 decodes first; 2 finishes its prompt; 3 gets what is left of the budget
  REQUIRE(rows(d.last) == std::vector<row>{{1, 6, 1, true}, {2, 10, 10, true}, {3, 0, 5, false}});
  REQUIRE(d.last.n_decodes == 1);
  REQUIRE(d.last.n_tokens == 16);

  d.step();
  REQUIRE(rows(d.last) == std::vector<row>{{1, 7, 1, true}, {2, 20, 1, true}, {3, 5, 4, true}});
  REQUIRE(d.last.n_decodes == 2);
  REQUIRE(d.finished.size() == 3);  // max_tokens 3, 2 and 1 reached together
  for (uint64_t id : {1, 2, 3}) {
    d.require_reference(id);
    REQUIRE(d.finished[id].reason == finish_reason::length);
  }
  REQUIRE(d.core.stats().n_decode_tokens == 3);
  REQUIRE(d.core.stats().n_prefill_tokens == 35);
  d.require_drained();
}

TEST_CASE("a stop decided by the caller finishes the sequence", "[scheduler]") {
  driver d(base_config(), 4, 64, 0);
  const tokens_t want = reference(7, prompt_of(5, 1), 10);
  const token_id stop_at = want[3];
  d.stop = [&](uint64_t, token_id t) { return t == stop_at; };
  REQUIRE(d.add(7, prompt_of(5, 1), 10).ok());
  d.run_until_idle();
  REQUIRE(d.finished[7].reason == finish_reason::stop);
  REQUIRE(d.finished[7].generated.back() == stop_at);
  REQUIRE(d.finished[7].generated.size() <= 4);
  d.require_reference(7);
  d.require_drained();
}

TEST_CASE("max_num_seqs bounds the running set, FIFO within a class", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_num_seqs = 2;
  c.max_batched_tokens = 64;
  driver d(c, 4, 64, 0);
  for (uint64_t id = 1; id <= 5; ++id) REQUIRE(d.add(id, prompt_of(4, (token_id)id * 10), 2).ok());
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{1, 2});
  REQUIRE(d.core.n_waiting() == 3);
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{1, 2});  // decodes; they finish
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{3, 4});
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{3, 4});
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{5});
  d.run_until_idle();
  for (uint64_t id = 1; id <= 5; ++id) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("classes, then integer priority, then arrival order", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_num_seqs = 1;
  driver d(c, 4, 64, 0);
  REQUIRE(d.add(10, prompt_of(4, 1), 1, priority_class::batch).ok());
  REQUIRE(d.add(11, prompt_of(4, 2), 1, priority_class::normal, 0).ok());
  REQUIRE(d.add(12, prompt_of(4, 3), 1, priority_class::normal, 5).ok());
  REQUIRE(d.add(13, prompt_of(4, 4), 1, priority_class::interactive, -3).ok());
  REQUIRE(d.add(14, prompt_of(4, 5), 1, priority_class::normal, 5).ok());
  std::vector<uint64_t> order;
  while (d.core.n_waiting() > 0) order.push_back(ids(d.step()).at(0));
  REQUIRE(order == std::vector<uint64_t>{13, 12, 14, 11, 10});
  d.require_drained();
}

TEST_CASE("chunked prefill never stalls a running decode", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_batched_tokens = 32;
  driver d(c, 4, 128, 0);
  REQUIRE(d.add(1, prompt_of(4, 1), 20).ok());
  d.step();
  REQUIRE(d.add(2, prompt_of(200, 7), 1).ok());
  int64_t pos = 0;
  while (pos < 200) {
    d.step();
    REQUIRE(d.last.batch.size() == 2);
    REQUIRE(d.last.n_decodes == 1);
    REQUIRE(d.last.batch[0].seq == 1);  // the decode every step, first
    const size_t chunk = std::min<int64_t>(31, 200 - pos);
    REQUIRE(rows(d.last)[1] == row{2, pos, chunk, pos + (int64_t)chunk == 200});
    pos += (int64_t)chunk;
  }
  REQUIRE(d.finished.count(2));
  d.run_until_idle();
  d.require_reference(1);
  d.require_reference(2);
  d.require_drained();
}

TEST_CASE("short prompts are not stuck behind long ones", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_batched_tokens = 32;
  c.long_prompt_threshold = 50;
  c.long_prefill_chunk = 16;
  c.max_long_prefills = 1;

  SECTION("one long prefill at a time; its chunk is capped while others compete") {
    driver d(c, 4, 128, 0);
    REQUIRE(d.add(1, prompt_of(100, 1), 1).ok());
    REQUIRE(d.add(2, prompt_of(100, 2), 1).ok());
    REQUIRE(d.add(3, prompt_of(10, 3), 2).ok());
    d.step();  // 1 capped at 16, 2 waits for the long slot, 3 passes it; 6 left go back to 1
    REQUIRE(rows(d.last) == std::vector<row>{{1, 0, 22, false}, {3, 0, 10, true}});
    d.step();  // 3 decodes; 1 gets 16 + the 15 nobody else wants
    REQUIRE(rows(d.last) == std::vector<row>{{3, 10, 1, true}, {1, 22, 31, false}});
    d.run_until_idle();
    for (uint64_t id : {1, 2, 3}) d.require_reference(id);
    d.require_drained();
  }
  SECTION("a long head short of KV blocks is bypassed, until it has waited too long") {
    c.long_prefill_chunk = 0;
    c.max_bypass_wait_s = 0.5;
    driver d(c, 4, 20, 0);
    REQUIRE(d.add(1, prompt_of(30, 1), 8).ok());  // holds 8 blocks, then 9
    d.step();
    d.step();
    REQUIRE(d.add(2, prompt_of(60, 2), 1).ok());  // needs 15 blocks: 11 are free
    REQUIRE(d.add(3, prompt_of(8, 3), 1).ok());   // short: 2 blocks
    d.step();
    REQUIRE(ids(d.last) == std::vector<uint64_t>{1, 3});
    d.now += 1.0;  // 2 has now waited past max_bypass_wait_s
    REQUIRE(d.add(4, prompt_of(8, 4), 1).ok());
    d.step();
    REQUIRE(ids(d.last) == std::vector<uint64_t>{1});  // 4 must not pass 2 any more
    while (d.core.find(1)) d.step();
    d.step();
    REQUIRE(ids(d.last) == std::vector<uint64_t>{2});  // 2 fits first (15 of 20), then 4
    d.run_until_idle();
    for (uint64_t id : {1, 2, 3, 4}) d.require_reference(id);
    d.require_drained();
  }
}

TEST_CASE("aging: batch work runs under a steady stream of interactive work", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_num_seqs = 1;
  const double aging = GENERATE(0.0, 5.0);
  c.aging_s = aging;
  driver d(c, 4, 64, 0);
  d.dt = 1.0;
  REQUIRE(d.add(1000, prompt_of(4, 9), 1, priority_class::batch).ok());
  std::optional<double> batch_ran;
  for (uint64_t i = 0; i < 30; ++i) {
    REQUIRE(d.add(i, prompt_of(4, (token_id)i), 1, priority_class::interactive).ok());
    const double t = d.now;
    if (ids(d.step()) == std::vector<uint64_t>{1000}) batch_ran = t;
  }
  if (aging > 0) {
    // Level 2 - floor(waited / 5) reaches a fresh interactive request's 0 after 10 s; the
    // earlier arrival wins the tie.
    REQUIRE(batch_ran == 10.0);
  } else {
    REQUIRE_FALSE(batch_ran);  // starved: it is still waiting
    REQUIRE(d.core.find(1000)->state == seq_state::waiting);
  }
  d.run_until_idle();
  d.require_reference(1000);
  d.require_drained();
}

TEST_CASE("admission control refuses at once with a reason", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_waiting = 3;
  c.max_waiting_tokens = 40;
  c.max_model_len = 64;
  driver d(c, 4, 15, 0);
  REQUIRE(d.add(1, {}, 4).error == admit_error::invalid_request);
  REQUIRE(d.add(1, prompt_of(4, 1), 0).error == admit_error::invalid_request);
  REQUIRE(d.add(1, prompt_of(4, 1), 4, priority_class::normal, 0, -1).error == admit_error::invalid_request);
  REQUIRE(d.add(1, prompt_of(60, 1), 5).error == admit_error::too_long);  // 65 > max_model_len
  REQUIRE(d.add(1, prompt_of(50, 1), 14).error == admit_error::too_long);  // 63 positions > 15 blocks of 4
  REQUIRE(d.add(1, prompt_of(50, 1), 14).message.find("KV cache") != std::string::npos);
  REQUIRE(d.add(1, prompt_of(20, 1), 4).ok());
  REQUIRE(d.add(1, prompt_of(4, 1), 4).error == admit_error::duplicate_id);
  const auto a = d.add(2, prompt_of(21, 1), 4);
  REQUIRE(a.error == admit_error::queue_tokens_full);
  REQUIRE(a.message.find("40") != std::string::npos);
  REQUIRE(d.add(2, prompt_of(10, 1), 4).ok());
  REQUIRE(d.add(3, prompt_of(10, 1), 4).ok());
  REQUIRE(d.add(4, prompt_of(1, 1), 4).error == admit_error::queue_full);
  REQUIRE(d.core.n_waiting() == 3);
  REQUIRE(d.core.n_waiting_tokens() == 40);
  REQUIRE(d.core.stats().n_refused == 9);
  d.step();  // admitted requests leave the queue: room again
  REQUIRE(d.add(4, prompt_of(1, 1), 4).ok());
  d.run_until_idle();
  for (uint64_t id : {1, 2, 3, 4}) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("shared prefixes are served from the prefix cache", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_batched_tokens = 64;
  driver d(c, 4, 64, 0);
  const tokens_t sys = prompt_of(16, 500);
  auto with = [&](tokens_t user) { tokens_t p = sys; p.insert(p.end(), user.begin(), user.end()); return p; };
  REQUIRE(d.add(1, with(prompt_of(3, 1)), 4).ok());
  d.step();
  REQUIRE(d.add(2, with(prompt_of(5, 2)), 4).ok());
  d.step();
  REQUIRE(rows(d.last)[1] == row{2, 16, 5, true});  // only its own tokens are computed
  REQUIRE(d.last.batch[1].block_table[0] == d.last.batch[0].block_table[0]);
  REQUIRE(d.kv.stats().n_hit_tokens == 16);
  d.run_until_idle();
  // A follow-up turn of a finished conversation hits its whole history.
  tokens_t turn2 = with(prompt_of(3, 1));
  const tokens_t out1 = d.finished[1].generated;
  turn2.insert(turn2.end(), out1.begin(), out1.end() - 1);  // the last token's KV was never computed
  turn2.push_back(42);
  REQUIRE(d.add(3, turn2, 2).ok());
  d.step();
  REQUIRE(rows(d.last) == std::vector<row>{{3, 20, 3, true}});
  for (uint64_t id : {1, 2}) d.require_reference(id);
  d.run_until_idle();
  d.require_reference(3);
  d.require_drained();
}

TEST_CASE("only computed blocks are shared with a later request", "[scheduler]") {
  scheduler_config c = base_config();
  c.max_batched_tokens = 16;
  c.long_prompt_threshold = 32;
  c.long_prefill_chunk = 8;
  c.max_long_prefills = 2;
  driver d(c, 4, 64, 0);
  const tokens_t doc = prompt_of(64, 700);
  auto with = [&](token_id q) { tokens_t p = doc; p.push_back(q); return p; };
  REQUIRE(d.add(1, with(1), 2).ok());
  d.step();  // capped at 8, then the 8 nobody wanted
  REQUIRE(rows(d.last) == std::vector<row>{{1, 0, 16, false}});
  REQUIRE(d.add(2, with(2), 2).ok());
  d.step();  // 2 starts after 1's 16 computed positions, not after its 64 allocated ones
  REQUIRE(rows(d.last) == std::vector<row>{{1, 16, 8, false}, {2, 16, 8, false}});
  d.run_until_idle();
  d.require_reference(1);
  d.require_reference(2);
  d.require_drained();
}

TEST_CASE("set_priority reorders a waiting request", "[scheduler]") {
  troupe::engine::block_manager kv(4, 64, 0);
  scheduler_config cfg;
  cfg.max_num_seqs = 1;
  cfg.aging_s = 0;
  scheduler_core core(cfg, kv);
  auto req = [](uint64_t id, priority_class cls) {
    request_spec r;
    r.id = id;
    r.prompt = {1, 2, 3};
    r.max_tokens = 1;
    r.cls = cls;
    return r;
  };
  REQUIRE(core.add(req(1, priority_class::normal), 0).ok());
  REQUIRE(core.add(req(2, priority_class::batch), 0).ok());
  REQUIRE(core.add(req(3, priority_class::normal), 0).ok());
  REQUIRE(core.set_priority(2, priority_class::interactive, 0));
  REQUIRE_FALSE(core.set_priority(99, priority_class::interactive, 0));
  std::vector<uint64_t> order;
  for (int step = 0; step < 3; ++step) {
    auto plan = core.schedule(step);
    REQUIRE(plan.batch.size() == 1);
    order.push_back(plan.batch[0].seq);
    std::vector<token_result> res{{plan.batch[0].seq, 7, false}};
    core.on_step_done(res, step);
  }
  CHECK(order == std::vector<uint64_t>{2, 1, 3});  // the promoted batch request first, then FIFO
  CHECK(core.check().empty());
  CHECK(kv.n_free_device() + kv.n_cached() == kv.n_device());
}
