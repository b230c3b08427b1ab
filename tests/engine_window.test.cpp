// Gemma 3's sliding-window layers in KV groups of their own (kv_cache.hpp): the forward over
// grouped tables, whose blocks out of the window the block manager gives back, computes the
// same logits bit for bit as over one table of every layer. The given-back blocks are filled
// with NaN before the next step, so a read of any of them would show.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>

#include "engine/block_manager.hpp"
#include "engine/forward.hpp"
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

  const std::vector<token_id> prompt = long_prompt(m);
  REQUIRE(prompt.size() > (size_t)grouped.window + 100);  // past the window
  const int32_t n_flat = kv_blocks_for((int64_t)prompt.size() + 8, bs);
  troupe::kernels::thread_pool pool(2);
  kv_storage kv_flat(flat, n_flat);
  kv_storage kv_grouped(grouped, n_flat * 6);
  cpu_forward f_flat(m, kv_flat, pool), f_grouped(m, kv_grouped, pool);
  block_manager bm(bs, n_flat * 6, 0, kv_block_hash, {grouped.n_groups, grouped.window, 100});
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
    const std::vector<float> a = f_flat.forward(std::vector{seq_chunk{chunk, done, flat_table}});
    const std::vector<float>& b = f_grouped.forward(std::vector{seq_chunk{chunk, done, table}});
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
          std::fill_n(kv_grouped.block_data(before[k]), grouped.block_elems(), (troupe::kernels::fp16_t)0x7e00);
          ++n_given_back;
        }
        ++k;
      }
    return (token_id)(std::max_element(a.begin(), a.end()) - a.begin());
  };
  // Prefill in chunks of 100 (the windows move inside a chunk; the sliding groups take blocks 100
  // positions ahead), then greedy decodes.
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
  REQUIRE(n_given_back == (full - window_blocks) * 5);
  REQUIRE(bm.n_held(1) == full + 5 * window_blocks);
  REQUIRE(bm.n_held(1) * grouped.block_bytes() < full * flat.block_bytes());
}
