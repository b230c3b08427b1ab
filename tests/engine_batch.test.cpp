// The real default model through the generator: batch invariance, chunked prefill, and the
// request errors the engine reports.
#include <catch2/catch.hpp>

#include <filesystem>
#include <memory>

#include "engine/generator.hpp"
#include "kernels/thread_pool.hpp"

using namespace troupe::engine;

namespace {

const model& default_model() {
  static std::unique_ptr<model> m = [] {
    const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / "models" / "default.gguf";
    if (!std::filesystem::exists(path)) FAIL("default model missing: run scripts/setup.sh");
    return model::load(path.string());
  }();
  return *m;
}

generation_request greedy(const std::string& text, int n) {
  generation_request r;
  r.prompt = default_model().vocab().encode(text, true, false);
  r.sampling.temperature = 0.0f;
  r.sampling.ignore_eos = true;
  r.max_tokens = n;
  return r;
}

// The default model's CPU forward over a KV cache of n_blocks blocks of 16 positions, 2 threads.
struct forward_rig {
  explicit forward_rig(int32_t n_blocks)
      : kv({m.hparams().n_layers, m.hparams().n_kv_heads, m.hparams().head_dim, 16}, n_blocks), fwd(m, kv, pool) {}
  const model& m = default_model();
  kv_storage kv;
  troupe::kernels::thread_pool pool{2};
  cpu_forward fwd;
};

}  // namespace

TEST_CASE("greedy output is the same alone, batched with other lengths, and with chunked prefill", "[engine][model]") {
  const model& m = default_model();
  const std::vector<generation_request> reqs = {
      greedy("The capital of France is", 20),
      greedy("Once upon a time, in a small village at the edge of a great forest, there lived", 20),
      greedy("def fibonacci(n):", 20),
      greedy("1, 2, 3, 4,", 20),
  };
  std::vector<std::vector<token_id>> alone;
  {
    generator g(m, {2, 256, 16, 512});
    for (const auto& r : reqs) alone.push_back(g.run(std::span(&r, 1))[0].tokens);
  }
  for (const auto& a : alone) REQUIRE(a.size() == 20);

  SECTION("all four in one batch") {
    generator g(m, {2, 256, 16, 512});
    auto res = g.run(reqs);
    for (size_t i = 0; i < reqs.size(); ++i) CHECK(res[i].tokens == alone[i]);
  }
  SECTION("tiny step budget: prefill chunks of 7 tokens mixed with decodes, other block size, one thread") {
    generator g(m, {1, 256, 8, 7});
    auto res = g.run(reqs);
    for (size_t i = 0; i < reqs.size(); ++i) CHECK(res[i].tokens == alone[i]);
  }
}

TEST_CASE("logits of a sequence do not depend on the batch around it", "[engine][model]") {
  forward_rig rig(8);
  const model& m = rig.m;
  const auto& hp = m.hparams();
  cpu_forward& fwd = rig.fwd;
  const std::vector<token_id> a = m.vocab().encode("Paged attention keeps each sequence apart.", true, false);
  const std::vector<token_id> b = m.vocab().encode("Another, longer prompt that shares the step with the first one, so rows mix.", true, false);
  const std::vector<int32_t> ta = {0, 1}, tb = {2, 3, 4}, tc = {5, 6};
  seq_chunk ca{a, 0, ta, true};
  const std::vector<float> alone = fwd.forward(std::span(&ca, 1));
  seq_chunk batch[3] = {{b, 0, tb, false}, {a, 0, tc, true}, {std::span(b).subspan(0, 3), 0, ta, false}};
  const std::vector<float>& mixed = fwd.forward(batch);
  const size_t n = a.size() * (size_t)hp.n_vocab;
  REQUIRE(mixed.size() == (1 + a.size() + 1) * (size_t)hp.n_vocab);
  // Rows are computed independently: bit-identical.
  REQUIRE(std::equal(alone.begin(), alone.begin() + (ptrdiff_t)n, mixed.begin() + hp.n_vocab));
}

TEST_CASE("a long context's attention parts do not depend on the batch around it", "[engine][model]") {
  // A decode over 601 positions (three attention parts) alone, then with a 700-token prefill in
  // the same step: its logits stay bit-identical.
  forward_rig rig(96);
  const auto& hp = rig.m.hparams();
  cpu_forward& fwd = rig.fwd;
  std::vector<token_id> a(601), b(700);
  for (size_t i = 0; i < a.size(); ++i) a[i] = (token_id)(100 + (i * 7919) % 40000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = (token_id)(200 + (i * 104729) % 40000);
  std::vector<int32_t> ta(38), tb(44);
  for (int32_t i = 0; i < 38; ++i) ta[(size_t)i] = i;
  for (int32_t i = 0; i < 44; ++i) tb[(size_t)i] = 38 + i;
  seq_chunk prefill{std::span(a).first(600), 0, ta, false, true};
  fwd.forward(std::span(&prefill, 1));
  seq_chunk decode{std::span(a).subspan(600, 1), 600, ta};
  const std::vector<float> alone = fwd.forward(std::span(&decode, 1));
  seq_chunk batch[2] = {{b, 0, tb, false, true}, {std::span(a).subspan(600, 1), 600, ta}};
  const std::vector<float>& mixed = fwd.forward(batch);
  REQUIRE(alone.size() == (size_t)hp.n_vocab);
  REQUIRE(mixed.size() == (size_t)hp.n_vocab);
  REQUIRE(std::equal(alone.begin(), alone.end(), mixed.begin()));
}

TEST_CASE("impossible requests are refused with a clear reason", "[engine][model]") {
  const model& m = default_model();
  generator g(m, {1, 64, 16, 512});
  generation_request r = greedy("hello", 8);
  SECTION("empty prompt") {
    r.prompt.clear();
    REQUIRE_THROWS_WITH(g.run(std::span(&r, 1)), Catch::Contains("empty"));
  }
  SECTION("prompt + max_tokens over the context") {
    r.max_tokens = 64;
    REQUIRE_THROWS_WITH(g.run(std::span(&r, 1)), Catch::Contains("exceed the context of 64"));
  }
  SECTION("token outside the vocabulary") {
    r.prompt.push_back(1 << 20);
    REQUIRE_THROWS_WITH(g.run(std::span(&r, 1)), Catch::Contains("outside the vocabulary"));
  }
  SECTION("invalid sampling value") {
    r.sampling.top_p = 1.5f;
    REQUIRE_THROWS_WITH(g.run(std::span(&r, 1)), Catch::Contains("top_p"));
  }
}
