// Gemma 3's sliding-window layers in KV groups of their own (kv_cache.hpp): the forward over
// grouped tables, whose blocks out of the window the block manager gives back, computes the
// same logits bit for bit as over one table of every layer. The given-back blocks are filled
// with NaN before the next step, so a read of any of them would show. The same over tensor-parallel
// ranks, where the model's one KV head is replicated on every rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>

#include "engine/block_manager.hpp"
#include "engine/forward.hpp"
#include "engine/generator.hpp"
#include "engine/tensor_parallel.hpp"
#include "kernels/thread_pool.hpp"

using namespace troupe::engine;

namespace {

const model& gemma() {
  static std::unique_ptr<model> m = [] {
    const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / "models" / "gemma3-270m.gguf";
    if (!std::filesystem::exists(path)) FAIL("models/gemma3-270m.gguf missing: run scripts/setup.sh");
    return model::load(path.string());
  }();
  return *m;
}

std::vector<token_id> long_prompt(const model& m) {
  std::string text;
  const char* s[] = {"The river runs past the old mill and under the stone bridge. ",
                     "In spring the farmers plant barley and oats in the long fields. ",
                     "At night the lighthouse keeper climbs the tower to tend the lamp. "};
  for (int i = 0; i < 50; ++i) text += s[(i * 2) % 3];
  return m.vocab().encode(text, true, false);
}

// A forward over the grouped layout: one rank, or tensor-parallel ranks (each with its pools).
struct one_rank {
  kv_storage kv;
  cpu_forward fwd;
  one_rank(const model& m, const kv_shape& shape, int32_t n_blocks, troupe::kernels::thread_pool& pool)
      : kv(shape, n_blocks), fwd(m, kv, pool) {}
  const std::vector<float>& forward(std::span<const seq_chunk> b) { return fwd.forward(b); }
  void poison(int32_t block) { std::fill_n(kv.block_data(block), kv.shape().block_elems(), (troupe::kernels::fp16_t)0x7e00); }
};

struct tp_ranks {
  tp_cpu_forward fwd;
  tp_ranks(const model& m, int n, const kv_shape& shape, int32_t n_blocks) : fwd(m, n, shape, n_blocks, 1, 1) {}
  const std::vector<float>& forward(std::span<const seq_chunk> b) { return fwd.forward(b); }
  void poison(int32_t block) {
    fwd.for_each_kv([&](kv_storage& d, kv_storage&) { std::fill_n(d.block_data(block), d.shape().block_elems(), (troupe::kernels::fp16_t)0x7e00); });
  }
};

// Prefills the long prompt in chunks of 100 (the windows move inside a chunk; the sliding groups
// take blocks 100 positions ahead), then 8 greedy decodes, through `flat_fwd` over one table of
// every layer (blocks 0, 1, ...) and through `grouped_fwd` over the block manager's tables of the
// `grouped` layout, poisoning every block it gives back: each step's logits are bit-identical.
template <class Fwd>
void check_windows(const model& m, Fwd& flat_fwd, Fwd& grouped_fwd, const kv_shape& grouped, int32_t n_blocks) {
  const int bs = grouped.block_size;
  const kv_shape flat = model_kv_shape(m, bs, false);
  const std::vector<token_id> prompt = long_prompt(m);
  REQUIRE(prompt.size() > (size_t)grouped.window + 100);  // past the window
  const int32_t n_flat = kv_blocks_for((int64_t)prompt.size() + 8, bs);
  REQUIRE(n_blocks >= n_flat * grouped.n_groups);
  block_manager bm(bs, n_blocks, 0, kv_block_hash, {grouped.n_groups, grouped.window, 100});
  std::vector<int32_t> flat_table((size_t)n_flat);
  for (int32_t i = 0; i < n_flat; ++i) flat_table[(size_t)i] = i;
  REQUIRE(bm.allocate(1, prompt) == 0);

  std::vector<token_id> tokens = prompt;
  int64_t done = 0;
  int n_given_back = 0;
  const size_t n_vocab = (size_t)m.hparams().n_vocab;
  auto step = [&](int64_t n) {
    const std::span<const token_id> chunk = std::span(tokens).subspan((size_t)done, (size_t)n);
    std::vector<block_copy> none;
    REQUIRE(bm.append(1, 0, none));  // the sliding groups' blocks for this step
    REQUIRE(none.empty());
    const std::vector<int32_t> table = bm.step_table(1, done + n);
    const std::vector<float> a = flat_fwd.forward(std::vector{seq_chunk{chunk, done, flat_table}});
    const std::vector<float>& b = grouped_fwd.forward(std::vector{seq_chunk{chunk, done, table}});
    REQUIRE(a.size() == n_vocab);
    REQUIRE(b.size() == n_vocab);
    INFO("positions [" << done << ", " << done + n << ")");
    REQUIRE(std::memcmp(a.data(), b.data(), n_vocab * sizeof(float)) == 0);
    done += n;
    // Commit: blocks leave the window. Poison what was given back (not a cached block another
    // sequence could still want: this is the only sequence).
    std::vector<int32_t> before;
    for (int g = 1; g < grouped.n_groups; ++g) before.insert(before.end(), bm.table(1, g).begin(), bm.table(1, g).end());
    bm.commit(1, std::span(tokens).first((size_t)done));
    size_t k = 0;
    for (int g = 1; g < grouped.n_groups; ++g)
      for (int32_t now : bm.table(1, g)) {
        if (k < before.size() && before[k] >= 0 && now < 0) {
          grouped_fwd.poison(before[k]);
          ++n_given_back;
        }
        ++k;
      }
    return (token_id)(std::max_element(a.begin(), a.end()) - a.begin());
  };
  token_id next = -1;
  while (done < (int64_t)prompt.size()) next = step(std::min<int64_t>(100, (int64_t)prompt.size() - done));
  std::vector<block_copy> copies;
  for (int i = 0; i < 8; ++i) {
    tokens.push_back(next);
    REQUIRE(bm.append(1, 1, copies));
    next = step(1);
  }
  REQUIRE(copies.empty());
  REQUIRE(bm.check() == "");
  // Each sliding group holds the window's blocks only (~700 positions here: 82% of the memory of
  // one table of all 18 layers; a 4096-position context would hold 27%).
  const int32_t full = kv_blocks_for(done, bs);
  const int32_t window_blocks = full - (int32_t)(std::max<int64_t>(0, done - grouped.window + 1) / bs);
  REQUIRE(n_given_back == (full - window_blocks) * (grouped.n_groups - 1));
  REQUIRE(bm.n_held(1) == full + (grouped.n_groups - 1) * window_blocks);
  REQUIRE(bm.n_held(1) * grouped.block_bytes() < full * flat.block_bytes());
}

}  // namespace

TEST_CASE("sliding-window groups: same logits as one table, with the blocks out of the window given back", "[engine][model][window]") {
  const model& m = gemma();
  const int bs = 16;
  const kv_shape flat = model_kv_shape(m, bs, false);
  const kv_shape grouped = model_kv_shape(m, bs, true);
  // 18 layers, every 6th full attention: 3 full-attention layers, 15 sliding in 5 groups of 3.
  REQUIRE(flat.n_groups == 1);
  REQUIRE(grouped.n_groups == 6);
  REQUIRE(grouped.n_layers == 3);
  REQUIRE(grouped.window == m.hparams().sliding_window);
  REQUIRE(grouped.slot_of(5) == kv_slot{0, 0});
  REQUIRE(grouped.slot_of(4) == kv_slot{2, 1});
  REQUIRE(grouped.block_bytes() * 6 == flat.block_bytes());

  troupe::kernels::thread_pool pool(2);
  one_rank f_flat(m, flat, 48, pool), f_grouped(m, grouped, 48 * 6, pool);
  check_windows(m, f_flat, f_grouped, grouped, 48 * 6);
}

TEST_CASE("tensor parallel over sliding-window groups: Gemma 3's one KV head replicated on 2 and 4 ranks", "[engine][model][window][tp]") {
  // Tensor parallel against one rank is held in parallel.test.cpp (replicated KV heads included);
  // here, the ranks over the grouped layout against the same ranks over one table.
  const model& m = gemma();
  REQUIRE(m.hparams().n_kv_heads == 1);
  const int n = GENERATE(2, 4);
  REQUIRE(tensor_parallel_error(m, n).empty());
  const kv_shape grouped = model_kv_shape(m, 16, true);
  REQUIRE(shard_kv_shape(grouped, n).n_kv_heads == 1);
  REQUIRE(shard_kv_shape(grouped, n).n_groups == 6);
  tp_ranks f_flat(m, n, model_kv_shape(m, 16, false), 48), f_grouped(m, n, grouped, 48 * 6);
  check_windows(m, f_flat, f_grouped, grouped, 48 * 6);
}

TEST_CASE("the generator over sliding-window groups: the logits and greedy tokens of one table, in less memory", "[engine][model][window]") {
  const model& m = gemma();
  const std::vector<token_id> prompt = long_prompt(m);
  // generator_options: threads, context, block size, tokens per step (prompts in chunks of 100).
  generator grouped(m, {2, 0, 16, 100}), flat(m, {2, 0, 16, 100, 1, 1, 1, false});
  REQUIRE(grouped.shape().n_groups == 6);
  REQUIRE(flat.shape().n_groups == 1);
  const std::vector<float> a = grouped.logits_all(prompt), b = flat.logits_all(prompt);
  REQUIRE(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);

  std::vector<generation_request> reqs(3);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].prompt = std::vector<token_id>(prompt.begin() + (ptrdiff_t)(i * 40), prompt.end());  // three lengths past the window
    reqs[i].max_tokens = 12;
    reqs[i].sampling.temperature = 0;
    reqs[i].sampling.ignore_eos = true;
  }
  const auto ga = grouped.run(reqs), gb = flat.run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO("request " << i);
    REQUIRE(ga[i].tokens.size() == 12);
    CHECK(ga[i].tokens == gb[i].tokens);
  }
  // The pools: every block of the 3 full-attention layers, the window's (and one step's tokens
  // ahead) of the 15 sliding ones — at ~700 positions a little less than one table of every layer
  // (the window is most of the context); at 4096 positions well under a third.
  int32_t peak = 0, all = 0;
  for (const auto& r : reqs) {
    peak += kv_peak_blocks((int64_t)r.prompt.size() + 12, 16, {6, grouped.shape().window, 100});
    all += kv_blocks_for((int64_t)r.prompt.size() + 12, 16);
  }
  CHECK(grouped.kv_bytes() == peak * grouped.shape().block_bytes());
  CHECK(flat.kv_bytes() == all * flat.shape().block_bytes());
  CHECK(grouped.kv_bytes() < flat.kv_bytes());
  CHECK(kv_peak_blocks(4096, 16, {6, grouped.shape().window, 100}) * grouped.shape().block_bytes() * 3 <
        kv_blocks_for(4096, 16) * flat.shape().block_bytes());
}
