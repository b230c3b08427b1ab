// Dummy loads (load_options::dummy, vLLM's --load-format dummy): a file's shapes and tokenizer with
// random weights, or a built-in architecture with its published configuration; against the real
// load of the same file and the distribution the weights are drawn from.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "engine/generator.hpp"
#include "engine/model.hpp"
#include "kernels/dequant.hpp"

using namespace troupe::engine;
using troupe::kernels::dtype;
using troupe::kernels::weight_view;

namespace {

std::string fixture(const std::string& rel) {
  const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / rel;
  if (!std::filesystem::exists(path)) FAIL(rel + " missing: run scripts/setup.sh");
  return path.string();
}

std::vector<float> values(const weight_view& w) {
  std::vector<float> out((size_t)(w.n_in * w.n_out));
  for (int64_t r = 0; r < w.n_out; ++r)
    troupe::kernels::dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + (size_t)r * w.row_stride,
                                    out.data() + (size_t)(r * w.n_in), w.n_in);
  return out;
}

bool same_bytes(const weight_view& a, const weight_view& b) {
  return a.type == b.type && a.row_stride == b.row_stride && a.n_out == b.n_out &&
         std::memcmp(a.data, b.data, a.row_stride * (size_t)a.n_out) == 0;
}

void check_same_hparams(const model_hparams& a, const model_hparams& b) {
  CHECK(a.arch == b.arch);
  CHECK(a.name == b.name);
  CHECK(a.n_layers == b.n_layers);
  CHECK(a.d_model == b.d_model);
  CHECK(a.n_heads == b.n_heads);
  CHECK(a.n_kv_heads == b.n_kv_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.d_ff == b.d_ff);
  CHECK(a.n_vocab == b.n_vocab);
  CHECK(a.n_ctx_train == b.n_ctx_train);
  CHECK(a.n_rot == b.n_rot);
  CHECK(a.rope_base == b.rope_base);
  CHECK(a.norm_eps == b.norm_eps);
  CHECK(a.rope == b.rope);
  CHECK(a.tied_output == b.tied_output);
  CHECK(a.n_experts == b.n_experts);
  CHECK(a.n_experts_used == b.n_experts_used);
}

// Mean and standard deviation of v.
std::pair<double, double> moments(const std::vector<float>& v) {
  double s = 0, s2 = 0;
  for (float x : v) s += x, s2 += (double)x * x;
  const double mean = s / (double)v.size();
  return {mean, std::sqrt(s2 / (double)v.size() - mean * mean)};
}

}  // namespace

TEST_CASE("a dummy load keeps the file's shapes and tokenizer and draws its weights", "[model][dummy]") {
  const std::string path = fixture("models/default.gguf");
  auto real = model::load(path);
  auto dummy = model::load(path, {.dummy = true, .seed = 7});
  CHECK_FALSE(real->dummy());
  CHECK(dummy->dummy());
  CHECK(dummy->dummy_seed() == 7);
  CHECK(dummy->has_host_weights());
  check_same_hparams(dummy->hparams(), real->hparams());
  CHECK(dummy->chat_template() == real->chat_template());
  CHECK_FALSE(dummy->chat_template().empty());
  const std::string text = "The quick brown fox <|im_start|> jumps";
  CHECK(dummy->vocab().encode(text, true, true) == real->vocab().encode(text, true, true));
  CHECK(dummy->vocab().n_vocab() == real->vocab().n_vocab());

  const auto& hp = dummy->hparams();
  for (int il : {0, hp.n_layers - 1}) {
    const auto& l = dummy->layer(il);
    for (const weight_view* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
      CHECK(w->type == dtype::q8_0);
      const auto [mean, sd] = moments(values(*w));
      const double want = 1.0 / std::sqrt((double)w->n_in);  // activations stay O(1) through the layers
      CHECK(std::abs(mean) < 0.1 * want);
      CHECK(sd == Approx(want).epsilon(0.03));
    }
    CHECK(l.attn_norm == std::vector<float>((size_t)hp.d_model, 1.0f));
    CHECK(l.ffn_norm == std::vector<float>((size_t)hp.d_model, 1.0f));
    // Not the file's weights.
    const auto a = values(l.wq), b = values(real->layer(il).wq);
    REQUIRE(a.size() == b.size());
    size_t equal = 0;
    for (size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
    CHECK(equal < a.size() / 20);
  }
  CHECK(moments(values(dummy->token_embd())).second == Approx(1.0 / std::sqrt((double)hp.d_model)).epsilon(0.03));
  CHECK(dummy->output().data == dummy->token_embd().data);  // tied, as the file
  CHECK(dummy->weight_bytes_per_token() ==
        (size_t)hp.n_layers * (size_t)(2 * hp.d_model * hp.n_heads * hp.head_dim + 2 * hp.d_model * hp.n_kv_heads * hp.head_dim +
                                       3 * hp.d_model * hp.d_ff) / 32 * 34 +
            (size_t)hp.n_vocab * hp.d_model / 32 * 34);

  // The same seed, the same weights; another seed, others.
  auto again = model::load(path, {.dummy = true, .seed = 7});
  auto other = model::load(path, {.dummy = true, .seed = 8});
  CHECK(same_bytes(again->layer(3).w_down, dummy->layer(3).w_down));
  CHECK(same_bytes(again->token_embd(), dummy->token_embd()));
  CHECK_FALSE(same_bytes(other->layer(3).w_down, dummy->layer(3).w_down));

  // It runs: finite logits, greedy generation repeatable.
  generator g(*dummy, {.n_threads = 2});
  const std::vector<token_id> prompt = dummy->vocab().encode("Hello, world", true, false);
  const auto logits = g.logits_all(prompt);
  REQUIRE(logits.size() == prompt.size() * (size_t)hp.n_vocab);
  CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
  generation_request req;
  req.prompt = prompt;
  req.max_tokens = 8;
  req.sampling.temperature = 0;
  req.sampling.ignore_eos = true;
  const auto r1 = g.run(std::span(&req, 1)), r2 = g.run(std::span(&req, 1));
  CHECK(r1[0].tokens.size() == 8);
  CHECK(r1[0].tokens == r2[0].tokens);
}

TEST_CASE("a dummy load of a file with attention biases or a mixture of experts", "[model][dummy]") {
  SECTION("qwen2's attention biases") {
    auto real = model::load(fixture("tests/fixtures/generated/qwen2_f32_mqa.gguf"));
    auto dummy = model::load(fixture("tests/fixtures/generated/qwen2_f32_mqa.gguf"), {.dummy = true, .seed = 1});
    check_same_hparams(dummy->hparams(), real->hparams());
    const auto& l = dummy->layer(0);
    REQUIRE(l.bq.size() == real->layer(0).bq.size());
    REQUIRE(!l.bq.empty());
    for (const auto* b : {&l.bq, &l.bk, &l.bv})
      for (float x : *b) CHECK(std::abs(x) <= 0.1f);
    CHECK(l.bq != real->layer(0).bq);
  }
  SECTION("a mixture of experts") {
    auto real = model::load(fixture("tests/fixtures/generated/llama_moe_q8_0.gguf"));
    auto dummy = model::load(fixture("tests/fixtures/generated/llama_moe_q8_0.gguf"), {.dummy = true, .seed = 1});
    check_same_hparams(dummy->hparams(), real->hparams());
    const auto& l = dummy->layer(0);
    REQUIRE((int)l.expert_gate.size() == dummy->hparams().n_experts);
    CHECK_FALSE(same_bytes(l.expert_gate[0], l.expert_gate[1]));  // each expert its own stream
    generator g(*dummy, {.n_threads = 1});
    const auto logits = g.logits_all(std::vector<token_id>{1, 2, 3});
    CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
  }
}

TEST_CASE("the built-in Gemma 3 270M has the shapes of the published file", "[model][dummy]") {
  const auto builtin = synthetic_hparams("gemma3-270m");
  const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / "models/gemma3-270m.gguf";
  if (!std::filesystem::exists(path)) {
    WARN("models/gemma3-270m.gguf missing (scripts/setup.sh): case skipped");
    return;
  }
  model_hparams file = model::load(path.string(), {.dummy = true, .host_weights = false})->hparams();
  file.name = builtin.name;
  check_same_hparams(builtin, file);
  CHECK(builtin.gemma);
  CHECK(builtin.sliding_window == file.sliding_window);
  CHECK(builtin.rope_base_swa == file.rope_base_swa);
  CHECK(builtin.attn_scale == file.attn_scale);
  // Loaded by name: its layers alternate as the file's (every 6th global), with QK-norm weights.
  auto m = model::load("gemma3-270m", {.dummy = true, .seed = 2, .host_weights = false});
  CHECK(m->layer(5).sliding == false);
  CHECK(m->layer(4).sliding);
  CHECK(m->layer(0).q_norm.size() == 256);
}

TEST_CASE("a built-in architecture: its configuration and a byte-level vocabulary of its size", "[model][dummy]") {
  auto m = model::load("smollm2-135m", {.dummy = true, .seed = 3});
  check_same_hparams(m->hparams(), synthetic_hparams("smollm2-135m"));
  const auto& hp = m->hparams();
  CHECK(hp.n_layers == 30);
  CHECK(hp.d_model == 576);
  CHECK(hp.n_vocab == 49152);
  CHECK(m->vocab().n_vocab() == hp.n_vocab);
  CHECK(m->chat_template().empty());
  CHECK(m->default_chat_family() == "chatml");
  const tokenizer& tok = m->vocab();
  CHECK(tok.token_text(tok.eos()) == "<|endoftext|>");
  CHECK(tok.is_eog(tok.find("<|im_end|>")));
  const std::string text = "héllo, wörld <|im_start|>user";
  const auto ids = tok.encode(text, false, true);
  CHECK(ids[ids.size() - 5] == tok.find("<|im_start|>"));
  CHECK(tok.decode(ids, true) == text);
  CHECK(tok.decode(std::vector<token_id>{4000, 4001}, false) == " w4000 w4001");
  CHECK(m->layer(0).bq.empty());

  auto q = model::load("qwen2.5-7b", {.dummy = true, .seed = 3, .host_weights = false});
  CHECK(q->hparams().n_vocab == 152064);
  CHECK(q->hparams().rope == troupe::kernels::rope_style::neox);
  CHECK(q->layer(0).bq.size() == 28 * 128);  // Qwen2's attention biases
  CHECK_FALSE(q->has_host_weights());
  // No host weights: bf16 views without data, so the bytes a device step reads.
  const auto& l = q->layer(5);
  CHECK(l.wq.data == nullptr);
  CHECK(l.wq.type == dtype::bf16);
  CHECK(l.wq.row_stride == 3584 * 2);
  const size_t d = 3584, kvd = 4 * 128, ff = 18944, vocab = 152064;
  CHECK(q->weight_bytes_per_token() == 2 * (28 * (2 * d * d + 2 * d * kvd + 3 * d * ff) + vocab * d));
}

TEST_CASE("dummy loads refuse what they cannot build", "[model][dummy]") {
  CHECK_THROWS_WITH(model::load("llama-3-8b"), Catch::Contains("built-in architecture") && Catch::Contains("--load-format dummy"));
  CHECK_THROWS_WITH(model::load("/no/such.gguf", {.dummy = true}),
                    Catch::Contains("neither a file nor a built-in architecture") && Catch::Contains("llama-3-8b"));
  CHECK_THROWS_WITH(synthetic_hparams("llama-9"), Catch::Contains("qwen2.5-7b"));
}
