// Scheduler simulations, part 2: preemption (swap, recompute, priority), queue timeout, cancel,
// protocol errors, and a random soak checked against the reference generation.
#include "actors/scheduler_sim.test.hpp"

#include <random>
#include <set>

using namespace troupe::actors;
using namespace troupe::actors::sim;

namespace {

scheduler_config preempt_config(preemption_mode mode) {
  scheduler_config c;
  c.max_batched_tokens = 64;
  c.max_num_seqs = 4;
  c.long_prompt_threshold = 1000;
  c.aging_s = 0;
  c.priority_preempt_after_s = 0;
  c.max_bypass_wait_s = 0;
  c.preemption = mode;
  return c;
}

// Runs to the end, checking that a sequence re-prefilled after a recompute preemption feeds
// prompt + generated tokens and continues with its next token.
void run_checking_resume(driver& d) {
  for (int i = 0; i < 2000 && (d.core.n_running() || d.core.n_waiting()); ++i) {
    std::map<uint64_t, seq_info> before;
    std::map<uint64_t, tokens_t> tokens;
    for (const auto& [id, r] : d.added)
      if (auto s = d.core.find(id)) {
        before[id] = *s;
        tokens[id].assign(s->tokens.begin(), s->tokens.end());
      }
    d.step();
    for (const auto& e : d.last.batch) {
      const seq_info& s = before.at(e.seq);
      if (s.state != seq_state::waiting || s.n_preempted == 0) continue;
      const tokens_t& t = tokens.at(e.seq);
      REQUIRE(e.pos0 % d.kv.block_size() == 0);  // the cached prefix is whole blocks
      REQUIRE(e.tokens == tokens_t(t.begin() + e.pos0, t.begin() + e.pos0 + (ptrdiff_t)e.tokens.size()));
    }
  }
  REQUIRE(d.core.n_running() == 0);
  REQUIRE(d.core.n_waiting() == 0);
}

}  // namespace

TEST_CASE("running out of KV blocks preempts the lowest class first (recompute)", "[scheduler][preempt]") {
  driver d(preempt_config(preemption_mode::recompute), 4, 12, 0);
  REQUIRE(d.add(1, prompt_of(8, 1), 20, priority_class::batch).ok());  // first to arrive, lowest class
  REQUIRE(d.add(2, prompt_of(8, 2), 20).ok());
  REQUIRE(d.add(3, prompt_of(8, 3), 20).ok());
  run_checking_resume(d);
  REQUIRE(!d.preempted.empty());
  REQUIRE(d.preempted[0].seq == 1);
  REQUIRE(d.preempted[0].mode == preemption_mode::recompute);
  REQUIRE(d.preempted[0].cause == preempt_cause::kv_exhausted);
  REQUIRE(d.core.stats().n_preempted_recompute == (int64_t)d.preempted.size());
  for (uint64_t id : {1, 2, 3}) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("running out of KV blocks swaps the latest arrival out and back in", "[scheduler][preempt]") {
  driver d(preempt_config(preemption_mode::swap), 4, 12, 32);
  for (uint64_t id : {1, 2, 3}) REQUIRE(d.add(id, prompt_of(8, (token_id)id), 20).ok());
  bool saw_out = false, saw_in = false;
  while (d.core.n_running() || d.core.n_waiting()) {
    std::map<uint64_t, seq_state> state_before;
    for (uint64_t id : {1, 2, 3})
      if (auto s = d.core.find(id)) state_before[id] = s->state;
    d.step();
    size_t n_d2h = 0, n_h2d = 0, n_swapped_blocks = 0;
    for (const auto& c : d.last.copies) {
      n_d2h += c.dir == troupe::engine::block_copy::kind::device_to_host;
      n_h2d += c.dir == troupe::engine::block_copy::kind::host_to_device;
    }
    for (const auto& p : d.last.preempted) {
      if (!saw_out) REQUIRE(p.seq == 3);  // same class: the latest arrival goes first
      REQUIRE(p.mode == preemption_mode::swap);
      REQUIRE(d.core.find(p.seq)->state == seq_state::swapped);
      n_swapped_blocks += d.kv.table(p.seq).size();  // host ids now, one per device block
      saw_out = true;
    }
    REQUIRE(n_d2h == n_swapped_blocks);
    for (const auto& e : d.last.batch)
      if (state_before.at(e.seq) == seq_state::swapped) {
        REQUIRE(n_h2d > 0);
        REQUIRE(e.tokens.size() == 1);  // it resumes decoding where it stopped
        saw_in = true;
      }
  }
  REQUIRE(saw_out);
  REQUIRE(saw_in);
  REQUIRE(d.core.stats().n_preempted_recompute == 0);
  for (uint64_t id : {1, 2, 3}) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("swap preemption falls back to recompute when the host pool is full", "[scheduler][preempt]") {
  driver d(preempt_config(preemption_mode::swap), 4, 12, 1);
  for (uint64_t id : {1, 2, 3}) REQUIRE(d.add(id, prompt_of(8, (token_id)id), 20).ok());
  run_checking_resume(d);
  REQUIRE(!d.preempted.empty());
  for (const auto& p : d.preempted) REQUIRE(p.mode == preemption_mode::recompute);
  REQUIRE(d.core.stats().n_preempted_swap == 0);
  for (uint64_t id : {1, 2, 3}) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("a higher class that waited past the threshold preempts a lower one", "[scheduler][preempt]") {
  scheduler_config c = preempt_config(preemption_mode::swap);
  c.max_num_seqs = 2;
  c.priority_preempt_after_s = 1.0;
  driver d(c, 4, 64, 64);
  d.dt = 0.25;

  SECTION("interactive over batch") {
    REQUIRE(d.add(1, prompt_of(4, 1), 30, priority_class::batch).ok());
    REQUIRE(d.add(2, prompt_of(4, 2), 30, priority_class::batch).ok());
    d.step();
    REQUIRE(d.add(3, prompt_of(4, 3), 3, priority_class::interactive).ok());  // at 0.25
    for (int i = 0; i < 4; ++i) {  // 0.25 .. 1.0: not yet
      d.step();
      REQUIRE(d.last.preempted.empty());
      REQUIRE(ids(d.last) == std::vector<uint64_t>{1, 2});
    }
    d.step();  // 1.25: waited 1.0
    REQUIRE(d.last.preempted.size() == 1);
    REQUIRE(d.last.preempted[0].seq == 2);
    REQUIRE(d.last.preempted[0].cause == preempt_cause::priority);
    REQUIRE(ids(d.last) == std::vector<uint64_t>{1, 3});  // admitted in the same step
    d.run_until_idle();
    for (uint64_t id : {1, 2, 3}) d.require_reference(id);
  }
  SECTION("a new admission runs priority_preempt_after_s before it can be preempted again") {
    c.max_num_seqs = 1;
    c.aging_s = 0.5;
    driver d1(c, 4, 64, 64);
    d1.dt = 0.25;
    REQUIRE(d1.add(1, prompt_of(4, 1), 40, priority_class::batch).ok());
    d1.step();
    REQUIRE(d1.add(2, prompt_of(4, 2), 40, priority_class::interactive).ok());  // at 0.25
    while (d1.preempted.empty()) d1.step();
    REQUIRE(d1.last.preempted[0].seq == 1);
    REQUIRE(d1.now == 1.5);  // the step at 1.25 preempted it
    REQUIRE(d1.add(3, prompt_of(4, 3), 4, priority_class::interactive).ok());
    // 2 runs 40 steps; then aging puts 1 (waiting since 0) ahead of 3 (since 1.5) ...
    double readmitted = -1;
    while (d1.preempted.size() == 1) {
      const double t = d1.now;
      d1.step();
      if (readmitted < 0 && ids(d1.last) == std::vector<uint64_t>{1}) readmitted = t;
    }
    // ... and 3, which has waited far longer than 1.0 s, still lets it run 1.0 s.
    REQUIRE(readmitted == 11.25);
    REQUIRE(d1.last.preempted[0].seq == 1);
    REQUIRE(d1.now - d1.dt == readmitted + 1.0);
    d1.run_until_idle();
    for (uint64_t id : {1, 2, 3}) d1.require_reference(id);
    d1.require_drained();
  }
  SECTION("never between equals") {
    REQUIRE(d.add(1, prompt_of(4, 1), 12).ok());
    REQUIRE(d.add(2, prompt_of(4, 2), 12).ok());
    REQUIRE(d.add(3, prompt_of(4, 3), 3).ok());
    d.run_until_idle();
    REQUIRE(d.preempted.empty());
    for (uint64_t id : {1, 2, 3}) d.require_reference(id);
  }
  d.require_drained();
}

TEST_CASE("a request waiting past its queue timeout fails and frees what it held", "[scheduler]") {
  SECTION("waiting") {
    scheduler_config c = preempt_config(preemption_mode::swap);
    c.max_num_seqs = 1;
    driver d(c, 4, 64, 0);
    d.dt = 0.25;
    REQUIRE(d.add(1, prompt_of(4, 1), 20).ok());
    d.step();
    REQUIRE(d.add(2, prompt_of(4, 2), 5, priority_class::normal, 0, 0.5).ok());  // at 0.25
    d.step();  // 0.25
    d.step();  // 0.5
    d.step();  // 0.75: waited exactly the limit, still fine
    REQUIRE(d.failed.empty());
    d.step();  // 1.0
    REQUIRE(d.last.failed.size() == 1);
    REQUIRE(d.last.failed[0].seq == 2);
    REQUIRE(d.last.failed[0].reason == fail_reason::queue_timeout);
    REQUIRE(d.last.failed[0].message.find("limit 0.5 s") != std::string::npos);
    REQUIRE_FALSE(d.core.find(2));
    REQUIRE(d.core.stats().n_timed_out == 1);
    d.run_until_idle();
    d.require_reference(1);
    d.require_drained();
  }
  SECTION("swapped: its host blocks come back") {
    scheduler_config c = preempt_config(preemption_mode::swap);
    c.queue_timeout_s = 0.5;
    driver d(c, 4, 8, 16);
    d.dt = 0.25;
    REQUIRE(d.add(1, prompt_of(4, 1), 25).ok());
    REQUIRE(d.add(2, prompt_of(4, 2), 25, priority_class::batch).ok());
    while (d.preempted.empty()) d.step();
    REQUIRE(d.preempted[0].seq == 2);
    REQUIRE(d.core.find(2)->state == seq_state::swapped);
    REQUIRE(d.kv.n_free_host() < 16);
    while (d.failed.empty()) d.step();
    REQUIRE(d.failed.count(2));
    REQUIRE(d.kv.n_free_host() == 16);
    d.run_until_idle();
    d.require_reference(1);
    d.require_drained();
  }
}

TEST_CASE("cancel frees everything at once, in any state", "[scheduler]") {
  driver d(preempt_config(preemption_mode::swap), 4, 12, 32);
  for (uint64_t id : {1, 2, 3}) REQUIRE(d.add(id, prompt_of(8, (token_id)id), 20).ok());
  REQUIRE(d.add(4, prompt_of(8, 4), 20).ok());
  REQUIRE(d.core.cancel(4));  // waiting
  REQUIRE_FALSE(d.core.cancel(4));
  while (d.preempted.empty()) d.step();
  const uint64_t victim = d.preempted[0].seq;
  REQUIRE(d.core.find(victim)->state == seq_state::swapped);
  REQUIRE(d.core.cancel(victim));  // swapped: host blocks back now
  REQUIRE(d.kv.n_free_host() == 32);

  std::vector<uint64_t> alive;
  for (uint64_t id : {1, 2, 3})
    if (d.core.find(id)) alive.push_back(id);
  REQUIRE(alive.size() == 2);
  const int32_t avail = d.kv.n_available_device();
  REQUIRE(d.core.cancel(alive[0]));  // running, between steps
  REQUIRE(d.kv.n_available_device() > avail);
  REQUIRE(d.core.check() == "");
  REQUIRE(ids(d.step()) == std::vector<uint64_t>{alive[1]});

  // In flight: the step's result for it is ignored.
  const step_plan plan = d.core.schedule(d.now);
  const auto results = d.exec.run(plan, {});
  REQUIRE(d.core.cancel(alive[1]));
  REQUIRE(d.core.on_step_done(results, d.now).empty());
  REQUIRE(d.core.n_running() == 0);
  REQUIRE(d.core.stats().n_cancelled == 4);
  d.require_drained();
}

TEST_CASE("protocol errors are refused without changing anything", "[scheduler]") {
  driver d(preempt_config(preemption_mode::swap), 4, 16, 0);
  REQUIRE_THROWS_AS(d.core.on_step_done({}, 0), std::logic_error);
  REQUIRE(d.add(1, prompt_of(6, 1), 4).ok());
  REQUIRE(d.add(2, prompt_of(40, 2), 4).ok());
  const step_plan plan = d.core.schedule(0);
  REQUIRE(rows(plan) == std::vector<row>{{1, 0, 6, true}, {2, 0, 40, true}});
  REQUIRE_THROWS_AS(d.core.schedule(0), std::logic_error);
  const auto good = d.exec.run(plan, {});
  REQUIRE(good.size() == 2);
  std::vector<token_result> missing{good[0]};
  REQUIRE_THROWS_AS(d.core.on_step_done(missing, 0), std::invalid_argument);
  std::vector<token_result> twice{good[0], good[0], good[1]};
  REQUIRE_THROWS_AS(d.core.on_step_done(twice, 0), std::invalid_argument);
  std::vector<token_result> extra{good[0], good[1], {99, 5, false}};
  REQUIRE_THROWS_AS(d.core.on_step_done(extra, 0), std::invalid_argument);
  REQUIRE(d.core.find(1)->n_computed == 0);
  REQUIRE(d.core.check() == "");
  for (auto& f : d.core.on_step_done(good, 0)) d.finished[f.seq] = f;
  d.run_until_idle();
  for (uint64_t id : {1, 2}) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("random traffic: every output equals the reference, pools end full", "[scheduler][soak]") {
  const uint64_t seed = GENERATE(range(1, 9));
  std::mt19937_64 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  scheduler_config c;
  c.max_batched_tokens = 16 << uni(0, 2);
  c.max_num_seqs = 2 << uni(0, 2);
  c.long_prompt_threshold = 24;
  c.long_prefill_chunk = 8;
  c.max_long_prefills = uni(1, 2);
  c.max_waiting = 40;
  c.aging_s = 0.5;
  c.priority_preempt_after_s = 0.1;
  c.max_bypass_wait_s = 1.0;
  c.kv_watermark_blocks = uni(0, 2);
  c.preemption = seed % 2 ? preemption_mode::swap : preemption_mode::recompute;
  // Seeds 5-8: three KV groups, two of them sliding windows of 7 positions (Gemma 3's layout),
  // holding blocks a step's tokens ahead, over a pool three times as large.
  const troupe::engine::kv_groups groups =
      seed > 4 ? troupe::engine::kv_groups{3, 7, c.max_batched_tokens} : troupe::engine::kv_groups{};
  driver d(c, 4, uni(12, 28) * groups.n, (uni(0, 1) ? uni(0, 8) : 64) * groups.n, groups);
  d.stop = [](uint64_t, token_id t) { return t % 97 == 0; };
  std::vector<tokens_t> systems;
  for (int i = 0; i < 3; ++i) systems.push_back(prompt_of(uni(5, 20), (token_id)uni(0, 999)));

  std::set<uint64_t> cancelled;
  uint64_t next_id = 1;
  for (int step = 0; step < 600; ++step) {
    if (uni(0, 9) < 3) {
      tokens_t p = systems[(size_t)uni(0, 2)];
      for (int i = uni(1, 12); i > 0; --i) p.push_back(uni(0, 999));
      const double timeout = uni(0, 9) == 0 ? 0.5 + uni(0, 15) * 0.1 : 0;
      d.add(next_id++, p, uni(1, 24), (priority_class)uni(0, 2), uni(-2, 2), timeout);
    }
    if (uni(0, 99) < 3 && !d.added.empty()) {
      const uint64_t id = (uint64_t)uni(1, (int)next_id - 1);
      if (d.core.cancel(id)) cancelled.insert(id);
    }
    d.step();
  }
  d.run_until_idle(20000);
  size_t n_checked = 0;
  for (const auto& [id, r] : d.added) {
    INFO("seed " << seed << " id " << id);
    const bool gone = cancelled.count(id) || d.failed.count(id);
    REQUIRE(gone != (d.finished.count(id) == 1));
    if (!gone) {
      d.require_reference(id);
      ++n_checked;
    }
  }
  INFO("seed " << seed);
  CHECK(n_checked > 100);
  CHECK(d.preempted.size() > 0);
  d.require_drained();
}

TEST_CASE("pipelining: decodes planned ahead reproduce the reference, and the planner falls back when it must", "[scheduler][pipeline]") {
  scheduler_config c = preempt_config(preemption_mode::swap);
  c.max_batched_tokens = 32;
  c.max_num_seqs = 6;
  SECTION("steady decodes: nearly every step after the prefills is planned ahead") {
    driver d(c, 4, 64, 0);
    for (uint64_t id = 1; id <= 4; ++id) REQUIRE(d.add(id, prompt_of(6 + (int)id, (token_id)id * 7), 20).ok());
    const int n_ahead = d.run_pipelined(nullptr);
    for (uint64_t id = 1; id <= 4; ++id) d.require_reference(id);
    CHECK(n_ahead >= 15);
    d.require_drained();
  }
  SECTION("a short request arriving during steady decoding joins the next step planned ahead; a long one waits for the full planner") {
    c.long_prompt_threshold = 16;
    driver d(c, 4, 64, 0);
    REQUIRE(d.add(1, prompt_of(6, 7), 12).ok());
    step_plan first = d.core.schedule(d.now);
    std::optional<step_plan> second = d.core.schedule_ahead(d.now);
    REQUIRE(second);
    REQUIRE(d.add(2, prompt_of(9, 11), 8).ok());
    REQUIRE(d.core.on_step_done(d.exec.run(first, d.stop), d.now).empty());
    std::optional<step_plan> third = d.core.schedule_ahead(d.now);
    REQUIRE(third);
    REQUIRE(third->batch.size() == 2);
    CHECK(third->n_decodes == 1);
    CHECK(third->batch[0].tokens == std::vector<token_id>{ahead_token});
    const batch_entry& joined = third->batch[1];
    CHECK(joined.seq == 2);
    CHECK(joined.pos0 == 0);
    CHECK(joined.tokens == prompt_of(9, 11));
    CHECK(joined.need_logits);
    CHECK(third->n_tokens == 10);
    CHECK(d.core.n_waiting() == 0);
    CHECK(d.core.stats().n_admitted_ahead == 1);
    // A long prompt (16 tokens or more) is not planned ahead: the step in flight comes back first.
    REQUIRE(d.add(3, prompt_of(20, 3), 5).ok());
    REQUIRE(d.core.on_step_done(d.exec.run(*second, d.stop), d.now).empty());
    CHECK(!d.core.schedule_ahead(d.now));
    REQUIRE(d.core.on_step_done(d.exec.run(*third, d.stop), d.now).empty());
    d.run_pipelined(nullptr);
    for (uint64_t id = 1; id <= 3; ++id) d.require_reference(id);
    d.require_drained();
  }
  SECTION("arrivals, stop tokens, a tiny pool with swap and recompute preemption") {
    for (preemption_mode mode : {preemption_mode::swap, preemption_mode::recompute}) {
      c.preemption = mode;
      driver d(c, 4, 10, 24);
      d.stop = [](uint64_t seq, token_id t) { return seq % 3 == 0 && t % 17 == 0; };
      uint64_t next_id = 1;
      const int n_ahead = d.run_pipelined([&](int i) {
        if (i % 2 == 0 && next_id <= 12) {
          const uint64_t id = next_id++;
          REQUIRE(d.add(id, prompt_of(3 + (int)(id * 5 % 11), (token_id)id * 13), 10 + (int32_t)(id % 9)).ok());
        }
        return next_id <= 12;
      });
      for (uint64_t id = 1; id <= 12; ++id) d.require_reference(id);
      CHECK(n_ahead > 0);
      CHECK(!d.preempted.empty());
      d.require_drained();
    }
  }
  SECTION("sliding-window groups: steps planned ahead read their windows while the blocks behind go back") {
    for (preemption_mode mode : {preemption_mode::swap, preemption_mode::recompute}) {
      c.preemption = mode;
      driver d(c, 4, 3 * 12, 3 * 24, {3, 5, c.max_batched_tokens});
      uint64_t next_id = 1;
      const int n_ahead = d.run_pipelined([&](int i) {
        if (i % 3 == 0 && next_id <= 10) {
          const uint64_t id = next_id++;
          REQUIRE(d.add(id, prompt_of(3 + (int)(id * 7 % 13), (token_id)id * 11), 20 + (int32_t)(id % 7)).ok());
        }
        return next_id <= 10;
      });
      for (uint64_t id = 1; id <= 10; ++id) d.require_reference(id);
      CHECK(n_ahead > 20);
      CHECK(!d.preempted.empty());
      d.require_drained();
    }
  }
}
