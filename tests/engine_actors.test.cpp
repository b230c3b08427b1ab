// The actor runtime with the real default model, through the in-process engine handle: outputs
// must equal the plain engine's (tests/engine_batch.test.cpp checks that one against references)
// under concurrency, preemption, prefix reuse, cancellation and executor faults; every test ends
// with the scheduler's invariants holding and every KV pool back to full.
#include <catch2/catch.hpp>

#include <filesystem>
#include <atomic>
#include <mutex>
#include <thread>

#include "actors/engine_handle.hpp"
#include "engine/generator.hpp"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

std::string model_path() { return (std::filesystem::path(TROUPE_SOURCE_DIR) / "models" / "default.gguf").string(); }

const engine::model& plain_model() {
  static auto m = engine::model::load(model_path());
  return *m;
}

std::vector<engine::token_id> tokens(const std::string& text) { return plain_model().vocab().encode(text, true, false); }

actors::generation_params greedy(const std::string& text, int n) {
  actors::generation_params p;
  p.prompt = tokens(text);
  p.sampling.temperature = 0;
  p.sampling.ignore_eos = true;
  p.max_tokens = n;
  return p;
}

// Reference: the plain engine, one sequence at a time.
std::vector<engine::token_id> alone(const actors::generation_params& p) {
  engine::generator g(plain_model(), {2, 512, 16, 512});
  engine::generation_request r{p.prompt, p.sampling, p.max_tokens};
  return g.run(std::span(&r, 1))[0].tokens;
}

struct outcome {
  std::vector<engine::token_id> tokens;
  std::string text;
  actors::stream_event final;
};

outcome drain(actors::generation_stream& s, std::chrono::milliseconds limit = 120s) {
  outcome o;
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    auto ev = s.next(1s);
    if (!ev) continue;
    if (ev->type == actors::stream_event::kind::token) {
      o.tokens.push_back(ev->token);
      o.text += ev->text;
      continue;
    }
    o.text += ev->text;
    o.final = *ev;
    return o;
  }
  FAIL("stream did not finish within the limit");
  return o;
}

// Every pool back to full once nothing runs (cached prefix blocks count as available).
void require_no_leak(actors::engine_handle& eng) {
  actors::engine_stats s;
  for (int i = 0; i < 200; ++i) {  // the last cancel may still be in the scheduler's mailbox
    s = eng.stats();
    if (s.n_running == 0 && s.n_waiting == 0 && s.n_free_device + s.n_cached == s.n_device_blocks) break;
    std::this_thread::sleep_for(10ms);
  }
  INFO(s.invariant_error);
  REQUIRE(s.invariant_error.empty());
  REQUIRE(s.n_running == 0);
  REQUIRE(s.n_waiting == 0);
  REQUIRE(s.n_free_device + s.n_cached == s.n_device_blocks);
  REQUIRE(s.n_free_host == s.n_host_blocks);
}

// Each request alone through the plain generator with options `go`: the reference outputs.
std::vector<std::vector<engine::token_id>> alone_each(const engine::model& m, const engine::generator_options& go,
                                                      const std::vector<actors::generation_params>& ps) {
  engine::generator g(m, go);
  std::vector<std::vector<engine::token_id>> ref;
  for (const auto& p : ps) {
    engine::generation_request r{p.prompt, p.sampling, p.max_tokens};
    ref.push_back(g.run(std::span(&r, 1))[0].tokens);
  }
  return ref;
}

// Submits every request at once; each must finish with its reference's tokens.
void expect_outputs(actors::engine_handle& eng, const std::vector<actors::generation_params>& ps,
                    const std::vector<std::vector<engine::token_id>>& ref) {
  std::vector<std::shared_ptr<actors::generation_stream>> ss;
  for (const auto& p : ps) ss.push_back(eng.submit(p));
  for (size_t i = 0; i < ss.size(); ++i) {
    auto out = drain(*ss[i]);
    REQUIRE(out.final.type == actors::stream_event::kind::done);
    CHECK(out.tokens == ref[i]);
  }
}

actors::engine_options options() {
  actors::engine_options o;
  o.model_path = model_path();
  o.n_threads = 2;
  o.n_device_blocks = 256;
  o.n_host_blocks = 256;
  return o;
}

const std::vector<std::string> prompts = {
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at",
    "Here is a short poem about the sea:",
    "To make a cup of tea, first",
};

}  // namespace

TEST_CASE("16 concurrent greedy requests give the outputs each gives alone", "[actors][model]") {
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 16; ++i) ps.push_back(greedy(prompts[i % prompts.size()] + std::string(i / 8, '!'), 12 + i % 5));
  std::vector<std::vector<engine::token_id>> ref;
  for (const auto& p : ps) ref.push_back(alone(p));

  auto eng = actors::engine_handle::start(options());
  std::vector<std::shared_ptr<actors::generation_stream>> ss;
  for (const auto& p : ps) ss.push_back(eng->submit(p));
  for (size_t i = 0; i < ss.size(); ++i) {
    auto o = drain(*ss[i]);
    REQUIRE(o.final.type == actors::stream_event::kind::done);
    CHECK(o.final.finish == actors::finish_reason::length);
    CHECK(o.final.n_generated == ps[i].max_tokens);
    CHECK(o.tokens == ref[i]);
    CHECK(o.text == plain_model().vocab().decode(ref[i], false));
  }
  require_no_leak(*eng);
}

namespace {

// Six greedy requests through an engine configured by `o`, with a KV pool so small (9 blocks: 144
// positions for six sequences of up to ~45) that someone must yield, preempted by `mode` (swapped
// to every rank's or stage's host pool and back, or recomputed): each output must equal
// `ref_opts`'s generator run alone (the same split, one sequence at a time).
void check_tiny_pool(actors::engine_options o, const engine::generator_options& ref_opts, actors::preemption_mode mode) {
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 6; ++i) ps.push_back(greedy(prompts[i], 24));
  const auto ref = alone_each(plain_model(), ref_opts, ps);
  o.n_device_blocks = 9;
  o.n_host_blocks = 64;
  o.sched.preemption = mode;
  o.sched.kv_watermark_blocks = 0;
  auto eng = actors::engine_handle::start(o);
  expect_outputs(*eng, ps, ref);
  const auto st = eng->stats();
  if (mode == actors::preemption_mode::swap) CHECK(st.sched.n_preempted_swap > 0);
  else CHECK(st.sched.n_preempted_recompute > 0);
  require_no_leak(*eng);
}

}  // namespace

TEST_CASE("a tiny KV pool forces preemption and the outputs stay identical", "[actors][model]") {
  for (auto mode : {actors::preemption_mode::swap, actors::preemption_mode::recompute})
    DYNAMIC_SECTION("mode " << actors::to_string(mode)) { check_tiny_pool(options(), {2, 512, 16, 512}, mode); }
}

TEST_CASE("tensor parallel over 3 ranks: batched, swapped out and back, outputs equal the sharded engine alone", "[actors][model][tp]") {
  auto o = options();
  o.tensor_parallel = 3;
  check_tiny_pool(o, {2, 512, 16, 512, 3}, actors::preemption_mode::swap);
  o.tensor_parallel = 2;  // 9 heads do not split in 2: refused at start with the reason
  REQUIRE_THROWS_WITH(actors::engine_handle::start(o), Catch::Contains("9 attention heads does not split into 2"));
}

TEST_CASE("pipeline parallel over 3 stages: batched, swapped out and back, outputs equal one stage's", "[actors][model][pp]") {
  auto o = options();
  o.pipeline_parallel = 3;
  check_tiny_pool(o, {2, 512, 16, 512}, actors::preemption_mode::swap);  // staged logits are bit-identical to one stage's
  o.pipeline_parallel = 31;  // more stages than the model's 30 layers: refused at start
  REQUIRE_THROWS_WITH(actors::engine_handle::start(o), Catch::Contains("30 layers do not split into 31 pipeline stages"));
}

TEST_CASE("seeded sampling gives the same tokens with and without preemption or pipelining", "[actors][model]") {
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 6; ++i) {
    auto p = greedy(prompts[i], 24);
    p.sampling.temperature = 0.9f;
    p.sampling.top_p = 0.95f;
    p.sampling.seed = 1000 + (uint64_t)i;
    p.sampling.has_seed = true;
    if (i % 2 == 1) {  // penalties read the history, whose last token a decode planned ahead gets from the executor
      p.sampling.repetition_penalty = 1.3f;
      p.sampling.frequency_penalty = 0.5f;
    }
    ps.push_back(p);
  }
  int64_t n_ahead = 0, n_admitted_ahead = 0;
  // staggered: half the requests arrive once the first is decoding, so they join steps planned
  // ahead (their first draw is their own, not the one after the step in flight).
  auto run = [&](int32_t n_blocks, actors::preemption_mode mode, bool plan_ahead = true, bool staggered = false,
                 bool device_path = false) {
    auto o = options();
    o.emulate_device_sampling = device_path;
    o.n_device_blocks = n_blocks;
    o.sched.preemption = mode;
    o.sched.plan_ahead = plan_ahead;
    auto eng = actors::engine_handle::start(o);
    std::vector<std::shared_ptr<actors::generation_stream>> ss;
    std::vector<std::vector<engine::token_id>> out(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      if (staggered && i == ps.size() / 2)
        for (int k = 0; k < 3; ++k) {  // the first request's first tokens: the engine is decoding
          auto ev = ss[0]->next(60s);
          REQUIRE(ev);
          REQUIRE(ev->type == actors::stream_event::kind::token);
          out[0].push_back(ev->token);
        }
      ss.push_back(eng->submit(ps[i]));
    }
    for (size_t i = 0; i < ss.size(); ++i) {
      auto rest = drain(*ss[i]).tokens;
      out[i].insert(out[i].end(), rest.begin(), rest.end());
    }
    const auto st = eng->stats();
    require_no_leak(*eng);
    n_ahead = st.n_steps_ahead;
    n_admitted_ahead = st.sched.n_admitted_ahead;
    return std::make_pair(out, st.sched.n_preempted_swap + st.sched.n_preempted_recompute);
  };
  const auto [roomy, n0] = run(256, actors::preemption_mode::swap);
  CHECK(n0 == 0);
  CHECK(n_ahead > 10);
  const auto [one_step, n1] = run(256, actors::preemption_mode::swap, false);
  CHECK(n_ahead == 0);
  CHECK(one_step == roomy);
  const auto [staggered, n2] = run(256, actors::preemption_mode::swap, true, true);
  CHECK(n2 == 0);
  CHECK(n_admitted_ahead > 0);
  CHECK(staggered == roomy);
  for (auto mode : {actors::preemption_mode::swap, actors::preemption_mode::recompute}) {
    const auto [tight, n] = run(9, mode);
    CHECK(n > 0);
    CHECK(tight == roomy);
  }
  // The executor's path for a device that samples (rows, draw seeds, penalty windows with the
  // token fed to an ahead decode, tokens back) gives the same tokens as the host path.
  const auto [dev_staggered, n3] = run(256, actors::preemption_mode::swap, true, true, true);
  CHECK(n_admitted_ahead > 0);
  CHECK(dev_staggered == roomy);
  const auto [dev_tight, n4] = run(9, actors::preemption_mode::swap, true, false, true);
  CHECK(n4 > 0);
  CHECK(n_ahead > 10);
  CHECK(dev_tight == roomy);
}

TEST_CASE("cancel mid-stream frees every block", "[actors][model]") {
  auto eng = actors::engine_handle::start(options());
  auto s = eng->submit(greedy(prompts[1], 400));
  for (int got = 0; got < 3;) {
    auto ev = s->next(30s);
    REQUIRE(ev);
    REQUIRE(ev->type == actors::stream_event::kind::token);
    ++got;
  }
  s->cancel();
  auto o = drain(*s);
  CHECK(o.final.type == actors::stream_event::kind::error);
  CHECK(o.final.error == actors::gen_error::cancelled);
  require_no_leak(*eng);
  CHECK(eng->stats().sched.n_cancelled == 1);
}

TEST_CASE("a shared system prompt is computed once and outputs are unchanged", "[actors][model]") {
  const std::string sys = "You are a helpful assistant who answers briefly and precisely, with facts only. "
                          "Always answer in English, in one sentence, and never ask a question back. "
                          "Prefer plain words to jargon, give numbers with their units, and say so when unsure. ";
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(greedy(sys + prompts[i], 10));
  std::vector<std::vector<engine::token_id>> ref;
  for (const auto& p : ps) ref.push_back(alone(p));
  auto eng = actors::engine_handle::start(options());
  // The first one alone warms the cache; the rest hit it.
  CHECK(drain(*eng->submit(ps[0])).tokens == ref[0]);
  std::vector<std::shared_ptr<actors::generation_stream>> ss;
  for (size_t i = 1; i < ps.size(); ++i) ss.push_back(eng->submit(ps[i]));
  for (size_t i = 1; i < ps.size(); ++i) CHECK(drain(*ss[i - 1]).tokens == ref[i]);
  // Each later request reuses the full blocks of its common prefix with the first one.
  int64_t expect = 0;
  for (size_t i = 1; i < ps.size(); ++i) {
    size_t n = 0;
    while (n < ps[0].prompt.size() && n < ps[i].prompt.size() && ps[0].prompt[n] == ps[i].prompt[n]) ++n;
    expect += (int64_t)(n / 16) * 16;
  }
  REQUIRE(expect >= 3 * 32);
  const auto st = eng->stats();
  CHECK(st.kv.n_hit_tokens >= expect);
  require_no_leak(*eng);
}

TEST_CASE("queue timeout and admission refusal give their reasons", "[actors][model]") {
  auto o = options();
  o.sched.max_num_seqs = 1;
  o.sched.max_waiting = 2;
  auto eng = actors::engine_handle::start(o);
  auto running = eng->submit(greedy(prompts[0], 60));
  REQUIRE(running->next(30s));  // it runs
  auto p = greedy(prompts[2], 4);
  p.queue_timeout_s = 0.05;
  auto timed_out = eng->submit(p);
  auto waiting = eng->submit(greedy(prompts[3], 4));
  for (int i = 0; i < 500 && eng->stats().n_waiting < 2; ++i) std::this_thread::sleep_for(1ms);
  auto refused = eng->submit(greedy(prompts[4], 4));
  auto r = drain(*refused);
  CHECK(r.final.error == actors::gen_error::overloaded);
  CHECK_THAT(r.final.message, Catch::Contains("waiting (limit 2)"));
  auto t = drain(*timed_out);
  CHECK(t.final.error == actors::gen_error::queue_timeout);
  CHECK_THAT(t.final.message, Catch::Contains("limit"));
  CHECK(drain(*waiting).final.type == actors::stream_event::kind::done);
  CHECK(drain(*running).final.type == actors::stream_event::kind::done);
  require_no_leak(*eng);
}

TEST_CASE("invalid requests and deadlines end with a clear error", "[actors][model]") {
  auto eng = actors::engine_handle::start(options());
  auto p = greedy(prompts[0], 4);
  p.sampling.top_p = 0;
  CHECK(drain(*eng->submit(p)).final.error == actors::gen_error::invalid);
  p = greedy(prompts[0], 4);
  p.prompt.push_back(1 << 24);
  CHECK_THAT(drain(*eng->submit(p)).final.message, Catch::Contains("outside the vocabulary"));
  p = greedy(prompts[0], 100000);
  CHECK(drain(*eng->submit(p)).final.error == actors::gen_error::too_long);
  p = greedy(prompts[0], 2000);
  p.deadline_s = 0.2;
  CHECK(drain(*eng->submit(p)).final.error == actors::gen_error::deadline);
  require_no_leak(*eng);
}

TEST_CASE("drain refuses new work and waits for what is admitted", "[actors][model]") {
  auto eng = actors::engine_handle::start(options());
  auto a = eng->submit(greedy(prompts[0], 30)), b = eng->submit(greedy(prompts[1], 30));
  REQUIRE(a->next(30s));
  REQUIRE(b->next(30s));
  std::atomic<bool> drained{false};
  std::thread t([&] { drained = eng->drain(60s); });
  for (int i = 0; i < 200 && eng->stats().n_running + eng->stats().n_waiting == 0; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);  // the drain message is in
  auto late = drain(*eng->submit(greedy(prompts[2], 4)));
  CHECK(late.final.error == actors::gen_error::unavailable);
  CHECK_THAT(late.final.message, Catch::Contains("draining"));
  CHECK(drain(*a).final.type == actors::stream_event::kind::done);
  CHECK(drain(*b).final.type == actors::stream_event::kind::done);
  t.join();
  CHECK(drained);
  require_no_leak(*eng);
}

TEST_CASE("an executor that cannot build its backend fails the start with its reason, at once", "[actors][model][fault]") {
  auto o = options();
  o.fail_executor_start = "out of device memory: the KV cache asks 80 GiB, 3 GiB are free";
  const auto t0 = std::chrono::steady_clock::now();
  try {
    actors::engine_handle::start(o);
    FAIL("start succeeded");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "the executor could not start: " + o.fail_executor_start);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);  // no restart loop, no timeout
}

TEST_CASE("a KV cache larger than the machine's memory is refused before anything is allocated", "[actors][model]") {
  auto o = options();
  o.n_device_blocks = 0;
  o.max_kv_bytes = int64_t{1} << 50;  // 1 PiB
  CHECK_THROWS_WITH(actors::engine_handle::start(o), Catch::Contains("of host memory") && Catch::Contains("lower --kv-mb"));
}

TEST_CASE("repeated executor faults open the circuit, refusals name the last error", "[actors][model][fault]") {
  auto o = options();
  o.max_restarts = 1;
  auto eng = actors::engine_handle::start(o);
  auto p = greedy(prompts[0], 400);
  for (int i = 0; i < 2; ++i) {  // two deaths within the window: one more than max_restarts
    auto s = eng->submit(p);
    REQUIRE(s->next(30s));
    eng->inject_executor_fault();
    drain(*s);  // recomputed on the restarted executor, or failed once the circuit opens
  }
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (!eng->stats().circuit_open && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  REQUIRE(eng->stats().circuit_open);
  const auto o2 = drain(*eng->submit(greedy(prompts[1], 4)));
  CHECK(o2.final.type == actors::stream_event::kind::error);
  CHECK(o2.final.error == actors::gen_error::unavailable);
  CHECK_THAT(o2.final.message, Catch::Contains("unavailable") && Catch::Contains("injected executor fault"));
}

TEST_CASE("an open circuit half opens after circuit_reset_s: a new executor serves again, a quick failure reopens it", "[actors][model][fault]") {
  auto o = options();
  o.max_restarts = 1;
  o.circuit_reset_s = 1;
  auto eng = actors::engine_handle::start(o);
  const auto p = greedy(prompts[1], 8);
  const auto ref = drain(*eng->submit(p));
  REQUIRE(ref.final.type == actors::stream_event::kind::done);
  auto wait_circuit = [&](bool open) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (eng->stats().circuit_open != open && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
    return eng->stats().circuit_open == open;
  };
  auto fault_while_running = [&] {
    auto s = eng->submit(greedy(prompts[0], 100));
    REQUIRE(s->next(30s));
    eng->inject_executor_fault();
    drain(*s);  // recomputed on a restarted executor, or failed once the circuit opens
  };
  fault_while_running();
  fault_while_running();  // two deaths within the window: the circuit opens
  REQUIRE(wait_circuit(true));
  const auto refused = drain(*eng->submit(greedy(prompts[2], 4)));
  CHECK(refused.final.error == actors::gen_error::unavailable);
  const int restarts = eng->stats().executor_restarts;

  // A second later a new executor starts; once it is up the circuit closes, and the same
  // request gives the same tokens.
  REQUIRE(wait_circuit(false));
  auto st = eng->stats();
  CHECK(st.executor_alive);
  CHECK(st.executor_restarts == restarts + 1);
  CHECK(st.device_lost.empty());
  const auto again = drain(*eng->submit(p));
  REQUIRE(again.final.type == actors::stream_event::kind::done);
  CHECK(again.tokens == ref.tokens);

  // Those deaths are still within the window: the next failure opens the circuit at once (no
  // restart), and it half opens again.
  fault_while_running();
  REQUIRE(wait_circuit(true));
  CHECK(eng->stats().executor_restarts == restarts + 1);
  REQUIRE(wait_circuit(false));
  CHECK(drain(*eng->submit(p)).tokens == ref.tokens);
  require_no_leak(*eng);
}

TEST_CASE("a lost device is not restarted: the circuit opens at the first failure and says why", "[actors][model][fault]") {
  // A sticky CUDA error (the executor's backend says its device is lost after the failure) leaves
  // nothing a restart could use: the requests in flight fail at once with the reason, later ones
  // are refused, and the process is told once (on_device_lost) so the server can exit.
  auto o = options();
  o.max_restarts = 3;
  auto told = std::make_shared<std::atomic<int>>(0);
  auto reason = std::make_shared<std::string>();
  auto mu = std::make_shared<std::mutex>();
  o.on_device_lost = [told, reason, mu](const std::string& why) {
    std::lock_guard lk(*mu);
    *reason = why;
    ++*told;
  };
  auto eng = actors::engine_handle::start(o);
  auto s = eng->submit(greedy(prompts[0], 400));
  REQUIRE(s->next(30s));
  eng->inject_executor_fault(true);
  const auto o1 = drain(*s);
  CHECK(o1.final.type == actors::stream_event::kind::error);
  CHECK(o1.final.error == actors::gen_error::unavailable);
  CHECK_THAT(o1.final.message, Catch::Contains("device is lost") && Catch::Contains("injected executor fault") &&
                                   Catch::Contains("cudaErrorIllegalAddress"));
  // The circuit opens as the executor reports the loss; its end (not waited for) follows.
  auto st = eng->stats();
  for (const auto until = std::chrono::steady_clock::now() + 10s; st.executor_alive && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
    st = eng->stats();
  }
  CHECK(st.circuit_open);
  CHECK_FALSE(st.executor_alive);
  CHECK(st.executor_restarts == 0);
  CHECK_THAT(st.device_lost, Catch::Contains("injected executor fault"));
  const auto o2 = drain(*eng->submit(greedy(prompts[1], 4)));
  CHECK(o2.final.error == actors::gen_error::unavailable);
  CHECK_THAT(o2.final.message, Catch::Contains("device is lost"));
  const auto until = std::chrono::steady_clock::now() + 10s;  // told right after the circuit opens
  while (told->load() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(50ms);
  CHECK(told->load() == 1);
  std::lock_guard lk(*mu);
  CHECK_THAT(*reason, Catch::Contains("device is lost") && Catch::Contains("only a new process"));
}

TEST_CASE("a step past its timeout is stopped and recomputed on a restarted executor, output unchanged", "[actors][model][fault]") {
  // The executor hangs 2.5 s in a step timed out after 1 s (a step here takes tens of ms: room for
  // a loaded machine): the scheduler requeues its sequences
  // and tells it to stop; it does once the step returns (within executor_stop_timeout_s), so it is
  // restarted as after a failure, and the generation goes on to the same tokens.
  const auto p = greedy(prompts[1], 24);
  const auto ref = alone(p);
  auto o = options();
  o.step_timeout_s = 1;
  o.executor_stop_timeout_s = 10;
  auto eng = actors::engine_handle::start(o);
  auto s = eng->submit(p);
  const auto first = s->next(30s);
  REQUIRE(first);
  eng->inject_executor_hang(2.5);
  auto out = drain(*s);
  REQUIRE(out.final.type == actors::stream_event::kind::done);
  out.tokens.insert(out.tokens.begin(), ref[0]);  // the first token, taken above
  CHECK(out.tokens == ref);
  const auto st = eng->stats();
  CHECK(st.executor_restarts == 1);
  CHECK_FALSE(st.circuit_open);
  CHECK(st.device_lost.empty());
}

TEST_CASE("an executor that neither finishes a step nor stops is wedged: given up as a lost device", "[actors][model][fault]") {
  // A hung kernel or a deadlock: the step outlasts its timeout and the executor's thread never
  // takes the stop. After executor_stop_timeout_s the supervisor gives it up, as for a lost
  // device: the generation fails with the reason, long before the hang ends, and the process is
  // told (a server exits: the executor's thread cannot be joined).
  auto o = options();
  o.step_timeout_s = 1;
  o.executor_stop_timeout_s = 0.5;
  auto told = std::make_shared<std::atomic<int>>(0);
  o.on_device_lost = [told](const std::string&) { ++*told; };
  auto eng = actors::engine_handle::start(o);
  auto s = eng->submit(greedy(prompts[0], 400));
  REQUIRE(s->next(30s));
  const double hang_s = 8;  // destroying the engine waits for it to end
  eng->inject_executor_hang(hang_s);
  const auto t0 = std::chrono::steady_clock::now();
  const auto o1 = drain(*s);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(o1.final.type == actors::stream_event::kind::error);
  CHECK(o1.final.error == actors::gen_error::unavailable);
  CHECK_THAT(o1.final.message, Catch::Contains("executor is wedged") && Catch::Contains("within 1 s") &&
                                   Catch::Contains("within 0.5 s"));
  CHECK(took < hang_s - 3);  // failed on the timeouts (1.5 s), not when the hang ended
  const auto st = eng->stats();
  CHECK(st.circuit_open);
  CHECK(st.executor_restarts == 0);
  CHECK_THAT(st.device_lost, Catch::Contains("executor is wedged"));
  CHECK(told->load() == 1);
  const auto o2 = drain(*eng->submit(greedy(prompts[1], 4)));
  CHECK(o2.final.error == actors::gen_error::unavailable);
}

TEST_CASE("an executor killed mid-batch is restarted and every output is unchanged", "[actors][model][fault]") {
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 8; ++i) ps.push_back(greedy(prompts[i], 16));
  std::vector<std::vector<engine::token_id>> ref;
  for (const auto& p : ps) ref.push_back(alone(p));
  auto eng = actors::engine_handle::start(options());
  std::vector<std::shared_ptr<actors::generation_stream>> ss;
  for (const auto& p : ps) ss.push_back(eng->submit(p));
  REQUIRE(ss[0]->next(30s));  // mid-generation
  eng->inject_executor_fault();
  for (size_t i = 0; i < ss.size(); ++i) {
    auto o = drain(*ss[i]);
    REQUIRE(o.final.type == actors::stream_event::kind::done);
    std::vector<engine::token_id> got = o.tokens;
    if (i == 0) got.insert(got.begin(), ref[0][0]);  // its first token was taken above
    CHECK(got == ref[i]);
  }
  const auto st = eng->stats();
  CHECK(st.executor_restarts == 1);
  CHECK(st.executor_alive);
  require_no_leak(*eng);
}

TEST_CASE("two engines live side by side and either stops while the other serves", "[actors][model][reload]") {
  // Hot reload (net/model_slot.hpp): the new version is built beside the serving one on another
  // thread, and the old one is destroyed on a third while the threads that used it live on. Each
  // engine has its own actor system; stopping one must neither wait on nor disturb the other.
  // (CAF 0.17 pins a system's logger in every thread that built it or asked it something; before
  // the engine let go of it, destroying `a` below waited forever.)
  const auto p = greedy(prompts[0], 8);
  const auto ref = alone(p);
  auto a = actors::engine_handle::start(options());  // on this thread, which lives on
  CHECK(a->stats().n_running == 0);
  std::unique_ptr<actors::engine_handle> b;
  std::thread([&] {
    b = actors::engine_handle::start(options());
    CHECK(b->stats().n_running == 0);
    CHECK(drain(*b->submit(greedy(prompts[0], 1))).final.type == actors::stream_event::kind::done);
  }).join();
  CHECK(drain(*a->submit(p)).tokens == ref);
  auto running = b->submit(greedy(prompts[1], 48));
  CHECK(a->stats().n_running == 0);  // this thread's last call into an engine: into `a`
  auto stop = [](std::unique_ptr<actors::engine_handle>& e) {
    const auto t0 = std::chrono::steady_clock::now();
    std::thread([&] { e.reset(); }).join();
    return std::chrono::steady_clock::now() - t0;
  };
  CHECK(stop(a) < 10s);
  CHECK(drain(*running).final.type == actors::stream_event::kind::done);
  CHECK(drain(*b->submit(p)).tokens == ref);
  auto c = actors::engine_handle::start(options());
  CHECK(b->stats().n_running == 0);
  CHECK(stop(b) < 10s);
  CHECK(drain(*c->submit(p)).tokens == ref);
  require_no_leak(*c);
}

TEST_CASE("expert parallel over 2 ranks: a mixture of experts served through the executor equals the generator", "[actors][ep]") {
  const auto path = (std::filesystem::path(TROUPE_SOURCE_DIR) / "tests/fixtures/generated/llama_moe_q8_0.gguf").string();
  auto moe = engine::model::load(path);
  std::vector<actors::generation_params> ps;
  for (int i = 0; i < 4; ++i) {
    actors::generation_params p;
    for (int t = 0; t < 5 + 7 * i; ++t) p.prompt.push_back((engine::token_id)((t * 37 + i * 11) % 250 + 3));
    p.sampling.temperature = 0;
    p.sampling.ignore_eos = true;
    p.max_tokens = 12;
    ps.push_back(p);
  }
  const auto ref = alone_each(*moe, {2, 256, 16, 256, 1, 1, 2}, ps);
  actors::engine_options o;
  o.model_path = path;
  o.n_threads = 2;
  o.n_device_blocks = 64;
  o.n_host_blocks = 64;
  o.expert_parallel = 2;
  auto eng = actors::engine_handle::start(o);
  expect_outputs(*eng, ps, ref);
  require_no_leak(*eng);
  o.expert_parallel = 3;
  REQUIRE_THROWS_WITH(actors::engine_handle::start(o), Catch::Contains("4 experts do not split into 3"));
}
