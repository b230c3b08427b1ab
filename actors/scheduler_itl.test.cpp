// Scheduler simulations, part 3: the inter-token latency target. Steps "take" a known time (a
// fixed part plus a part per token, like a step that reads all weights once and computes per
// token), reported to the scheduler as the executor's measurement.
#include "actors/scheduler_sim.test.hpp"

using namespace troupe::actors;
using namespace troupe::actors::sim;

namespace {

double cost(int32_t n_tokens) { return 0.010 + 0.0015 * n_tokens; }  // seconds
double cost_of(const step_plan& p) { return cost(p.n_tokens); }

scheduler_config itl_config(double target_ms) {
  scheduler_config c;
  c.max_batched_tokens = 256;
  c.max_num_seqs = 8;
  c.long_prompt_threshold = 100000;
  c.long_prefill_chunk = 0;
  c.aging_s = 0;
  c.priority_preempt_after_s = 0;
  c.max_bypass_wait_s = 0;
  c.target_itl_ms = target_ms;
  c.min_prefill_tokens = 4;
  return c;
}

}  // namespace

TEST_CASE("ITL target settings are validated", "[scheduler][itl]") {
  scheduler_config c;
  c.target_itl_ms = -1;
  CHECK(validate(c).find("target_itl_ms") != std::string::npos);
  c.target_itl_ms = std::numeric_limits<double>::infinity();
  CHECK_FALSE(validate(c).empty());
  c.target_itl_ms = 50;
  c.min_prefill_tokens = 0;
  CHECK(validate(c).find("min_prefill_tokens") != std::string::npos);
  c.min_prefill_tokens = 16;
  c.itl_stretch = 0.99;
  CHECK(validate(c).find("itl_stretch") != std::string::npos);
}

TEST_CASE("a step that carries decodes takes prefill tokens up to the ITL allowance", "[scheduler][itl]") {
  driver d(itl_config(50), 4, 1024, 0);
  d.step_seconds = cost_of;
  for (uint64_t id = 1; id <= 4; ++id) REQUIRE(d.add(id, prompt_of(8, (token_id)(10 * id)), 100).ok());
  d.step();  // nobody decodes yet: the prompts go whole
  REQUIRE(d.last.n_tokens == 32);
  REQUIRE(d.last.n_decodes == 0);
  CHECK(d.core.prefill_allowance(0) == std::numeric_limits<int32_t>::max());
  for (int i = 0; i < 3; ++i) d.step();  // decodes: the model has seen 4- and 32-token steps
  REQUIRE(d.last.n_decodes == 4);
  // 10 ms + 1.5 ms per token within 50 ms: 26 tokens, 4 of them the decodes.
  CHECK(d.core.step_times().tokens_within(0.050, 256) == 26);
  CHECK(d.core.prefill_allowance(4) == 22);

  REQUIRE(d.add(5, prompt_of(200, 7), 5).ok());
  int64_t pos = 0;
  int n_steps = 0;
  while (pos < 200) {
    d.step();
    ++n_steps;
    REQUIRE(d.last.n_decodes == 4);
    REQUIRE(d.last.batch.size() == 5);
    const auto [seq, pos0, n, last] = rows(d.last)[4];
    REQUIRE(seq == 5);
    REQUIRE(pos0 == pos);
    CHECK(n == std::min<size_t>(22, (size_t)(200 - pos)));
    CHECK(cost_of(d.last) <= 0.050);  // every decode's inter-token gap within the target
    pos += (int64_t)n;
  }
  CHECK(n_steps == 10);  // ceil(200 / 22)
  CHECK(d.core.stats().n_itl_capped == 9);  // the last chunk was the prompt's rest
  d.run_until_idle();
  for (uint64_t id = 1; id <= 5; ++id) d.require_reference(id);
  d.require_drained();

  // The same arrival without a target: one step of 252 prompt tokens stalls the four decodes.
  driver off(itl_config(0), 4, 1024, 0);
  off.step_seconds = cost_of;
  for (uint64_t id = 1; id <= 4; ++id) REQUIRE(off.add(id, prompt_of(8, (token_id)(10 * id)), 100).ok());
  for (int i = 0; i < 4; ++i) off.step();
  REQUIRE(off.add(5, prompt_of(200, 7), 5).ok());
  off.step();
  CHECK(off.last.n_tokens == 204);
  CHECK(cost_of(off.last) > 0.3);
  CHECK(off.core.stats().n_itl_capped == 0);
}

TEST_CASE("min_prefill_tokens keeps prompts moving under a target no step can meet", "[scheduler][itl]") {
  scheduler_config c = itl_config(1);  // 1 ms: even a lone decode takes 11.5
  c.itl_stretch = 1;                   // no slack past the decode's own time either
  c.min_prefill_tokens = 8;
  driver d(c, 4, 256, 0);
  d.step_seconds = cost_of;
  REQUIRE(d.add(1, prompt_of(4, 3), 50).ok());
  d.step();
  d.step();
  REQUIRE(d.add(2, prompt_of(40, 9), 3).ok());
  for (int64_t pos = 0; pos < 40; pos += 8) {
    d.step();
    REQUIRE(rows(d.last) == std::vector<row>{{1, 5 + pos / 8, 1, true}, {2, pos, 8, pos + 8 == 40}});
  }
  d.run_until_idle();
  d.require_reference(1);
  d.require_reference(2);
  d.require_drained();
}

TEST_CASE("under a load the target cannot hold, a step still stretches to itl_stretch x its decodes' time", "[scheduler][itl]") {
  driver d(itl_config(1), 4, 1024, 0);  // 1 ms: no step meets it; itl_stretch 2, floor 4
  d.step_seconds = cost_of;
  for (uint64_t id = 1; id <= 6; ++id) REQUIRE(d.add(id, prompt_of(8, (token_id)(10 * id)), 100).ok());
  for (int i = 0; i < 4; ++i) d.step();  // 48 prompt tokens, then decodes of 6
  REQUIRE(d.last.n_decodes == 6);
  // 6 decodes alone: 19 ms; twice that, 38 ms, holds 18 tokens: 12 of them prompt.
  CHECK(d.core.prefill_allowance(6) == 12);
  REQUIRE(d.add(7, prompt_of(100, 3), 2).ok());
  for (int64_t pos = 0; pos < 100; pos += 12) {
    d.step();
    REQUIRE(d.last.n_decodes == 6);
    CHECK(rows(d.last)[6] == row{7, pos, std::min<size_t>(12, (size_t)(100 - pos)), pos + 12 >= 100});
    CHECK(cost_of(d.last) <= 2 * cost(6) + 1e-12);
  }
  REQUIRE(d.core.find(7)->n_generated == 1);
  d.run_until_idle();
  for (uint64_t id = 1; id <= 7; ++id) d.require_reference(id);
  d.require_drained();
}

TEST_CASE("pipelined steps keep every decode's step within the ITL bound under mixed arrivals", "[scheduler][itl]") {
  // Requests of 10..150 prompt tokens arrive every few iterations while others decode; steps are
  // planned as the scheduler actor plans them (one ahead while one is in flight). The bound of a
  // step with decodes: 40 ms, or twice its decodes' own time when that is longer. Returns the
  // largest excess over it and the steps the target cut.
  auto run = [](double target_ms) {
    driver d(itl_config(target_ms), 4, 2048, 0);
    d.step_seconds = cost_of;
    uint64_t next = 1;
    int n_done = 0;
    double worst = -1;
    d.run_pipelined(
        [&](int i) {
          if (i % 4 == 0 && next <= 40) {
            const int len = 10 + (int)((next * 37) % 141);
            REQUIRE(d.add(next, prompt_of(len, (token_id)next), 12 + (int32_t)(next % 7)).ok());
            ++next;
          }
          return next <= 40;
        },
        20000,
        [&](const step_plan& p) {
          // Steps planned before the executor's first measurement came back are not judged.
          if (++n_done > 2 && p.n_decodes > 0)
            worst = std::max(worst, cost_of(p) - std::max(0.040, 2 * cost(p.n_decodes)));
        });
    for (uint64_t id = 1; id <= 40; ++id) d.require_reference(id);
    d.require_drained();
    return std::pair(worst, d.core.stats().n_itl_capped);
  };
  const auto [excess_on, capped_on] = run(40);
  CHECK(excess_on <= 1e-12);
  CHECK(capped_on > 0);
  const auto [excess_off, capped_off] = run(0);
  CHECK(excess_off > 0.060);  // without the target, a decode waits behind a whole prompt
  CHECK(capped_off == 0);
}
