// Tensor and pipeline parallelism on the CPU: the in-process communicator, the sharded forward and
// the staged forward against the whole one (the reference: the same model, the same steps, one
// rank or stage).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "engine/pipeline_parallel.hpp"
#include "engine/split_forward.hpp"
#include "engine/tensor_parallel.hpp"
#include "kernels/thread_pool.hpp"

using namespace troupe::engine;

namespace {

std::unique_ptr<model> load(const std::string& rel) {
  const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / rel;
  if (!std::filesystem::exists(path)) FAIL(rel + " missing: run scripts/setup.sh");
  return model::load(path.string());
}

// A prefill of `prompt` in two chunks, then decodes of fixed tokens, for two sequences at once
// (different lengths and block tables); returns every step's logits.
template <class Fwd>
std::vector<std::vector<float>> run_steps(Fwd& fwd, int n_vocab) {
  std::vector<token_id> a, b;
  for (int i = 0; i < 37; ++i) a.push_back((i * 7919 + 13) % n_vocab);
  for (int i = 0; i < 20; ++i) b.push_back((i * 104729 + 5) % n_vocab);
  const std::vector<int32_t> ta = {3, 0, 5, 7}, tb = {1, 6, 2, 4};  // 16 positions per block
  std::vector<std::vector<float>> out;
  auto step = [&](std::vector<seq_chunk> batch) { out.push_back(fwd.forward(batch)); };
  step({{std::span(a).subspan(0, 20), 0, ta, false, true}, {std::span(b), 0, tb, true}});
  step({{std::span(a).subspan(20), 20, ta, true}});
  for (int i = 0; i < 4; ++i) {
    const token_id ta_next[1] = {(token_id)((i * 31 + 1) % n_vocab)}, tb_next[1] = {(token_id)((i * 17 + 2) % n_vocab)};
    step({{std::span(ta_next), 37 + i, ta}, {std::span(tb_next), 20 + i, tb}});
  }
  return out;
}

// The largest |a - b| over the largest |b|, per step.
double worst_rel(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    REQUIRE(a[s].size() == b[s].size());
    REQUIRE(!a[s].empty());
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a[s].size(); ++i) {
      diff = std::max(diff, (double)std::fabs(a[s][i] - b[s][i]));
      scale = std::max(scale, (double)std::fabs(b[s][i]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

std::vector<std::vector<float>> unsharded(const model& m, int32_t n_blocks) {
  const auto& hp = m.hparams();
  kv_storage kv({hp.n_layers, hp.n_kv_heads, hp.head_dim, 16}, n_blocks);
  troupe::kernels::thread_pool pool(2);
  cpu_forward fwd(m, kv, pool);
  return run_steps(fwd, hp.n_vocab);
}

std::vector<std::vector<float>> sharded(const model& m, int n_ranks, int32_t n_blocks) {
  const auto& hp = m.hparams();
  tp_cpu_forward fwd(m, n_ranks, {hp.n_layers, hp.n_kv_heads, hp.head_dim, 16}, n_blocks, 1, 1);
  return run_steps(fwd, hp.n_vocab);
}

size_t argmax(const float* p, size_t n) { return (size_t)(std::max_element(p, p + n) - p); }

}  // namespace

TEST_CASE("local_group: all_reduce_sum gives every rank the rank-ordered sum, bit for bit", "[engine][tp]") {
  for (int n_ranks : {1, 2, 3, 4}) {
    local_group g(n_ranks);
    for (size_t n : {size_t{1}, size_t{2}, size_t{1001}, size_t{4096}}) {
      std::vector<std::vector<float>> data((size_t)n_ranks);
      std::mt19937 rng((uint32_t)(n * 31 + n_ranks));
      std::uniform_real_distribution<float> u(-100, 100);
      for (auto& v : data) {
        v.resize(n);
        for (float& x : v) x = u(rng);
      }
      std::vector<float> expect(n);
      for (size_t i = 0; i < n; ++i) {
        float s = data[0][i];
        for (int r = 1; r < n_ranks; ++r) s += data[(size_t)r][i];
        expect[i] = s;
      }
      std::vector<std::thread> threads;
      for (int r = 0; r < n_ranks; ++r) threads.emplace_back([&, r] { g.rank(r).all_reduce_sum(data[(size_t)r].data(), n); });
      for (auto& t : threads) t.join();
      for (int r = 0; r < n_ranks; ++r)
        REQUIRE(std::memcmp(data[(size_t)r].data(), expect.data(), n * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("local_group: a rank that never arrives makes the others throw within the limit", "[engine][tp]") {
  local_group g(2, std::chrono::milliseconds(200));
  std::vector<float> x(8, 1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_AS(g.rank(0).all_reduce_sum(x.data(), x.size()), collective_error);
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  // The group stays failed: the next collective throws at once.
  REQUIRE_THROWS_WITH(g.rank(1).all_reduce_sum(x.data(), x.size()), Catch::Contains("did not reach a collective"));
}

TEST_CASE("local_group: abort wakes a waiting rank", "[engine][tp]") {
  local_group g(3);
  std::vector<float> x(4, 1.0f);
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g.abort("rank 2 failed");
  });
  REQUIRE_THROWS_WITH(g.rank(0).all_reduce_sum(x.data(), x.size()), Catch::Contains("rank 2 failed"));
  t.join();
}

TEST_CASE("tensor parallel: f32 model, 2 ranks equal 1 rank to float rounding", "[engine][tp]") {
  auto m = load("tests/fixtures/generated/llama_f32_hd64.gguf");
  REQUIRE(tensor_parallel_error(*m, 2).empty());
  const auto ref = unsharded(*m, 8);
  const auto tp = sharded(*m, 2, 8);
  // Only the order of the float sums differs (partial products added by the all-reduce).
  CHECK(worst_rel(tp, ref) < 1e-4);
}

TEST_CASE("tensor parallel: fewer KV heads than ranks, each replicated on the ranks that read it, equal 1 rank", "[engine][tp]") {
  // qwen2_f32_mqa: 4 query heads, 1 KV head (and K/V biases); llama_f32_gqa2: 4 query heads, 2 KV
  // heads, so 4 ranks hold KV heads 0, 0, 1, 1.
  const auto [fixture, n] = GENERATE(std::pair{"qwen2_f32_mqa", 2}, std::pair{"qwen2_f32_mqa", 4}, std::pair{"llama_f32_gqa2", 4});
  INFO(fixture << " on " << n << " ranks");
  auto m = load(std::string("tests/fixtures/generated/") + fixture + ".gguf");
  const auto& hp = m->hparams();
  REQUIRE(hp.n_kv_heads < n);
  REQUIRE(tensor_parallel_error(*m, n).empty());
  REQUIRE(kv_heads_per_rank(hp.n_kv_heads, n) == 1);
  for (int r = 0; r < n; ++r) {
    const model_shard s = shard_model(*m, r, n);
    CHECK(s.hp.n_kv_heads == 1);
    CHECK(s.hp.n_heads == hp.n_heads / n);
    // The rank's K rows are those of the KV head its query heads read.
    const int kv_head = r * hp.n_heads / n / (hp.n_heads / hp.n_kv_heads);
    CHECK(s.layers[0].wk.data == (const uint8_t*)m->layer(0).wk.data + (size_t)kv_head * hp.head_dim * m->layer(0).wk.row_stride);
  }
  const auto ref = unsharded(*m, 8);
  const auto tp = sharded(*m, n, 8);
  CHECK(worst_rel(tp, ref) < 1e-4);  // a rank reading another head's K/V would be off by far more
}

TEST_CASE("split_block_bytes: a block id's bytes over every rank, copies included", "[engine][tp][pp][ep]") {
  const kv_shape gqa2{2, 2, 16, 16};  // 2 layers, 2 KV heads of 16 values, 16 positions
  CHECK(split_block_bytes(gqa2, {}) == gqa2.block_bytes());
  CHECK(split_block_bytes(gqa2, {.tensor = 2}) == gqa2.block_bytes());       // each rank its head
  CHECK(split_block_bytes(gqa2, {.tensor = 4}) == 2 * gqa2.block_bytes());   // each head on 2 ranks
  CHECK(split_block_bytes(gqa2, {.pipeline = 2}) == gqa2.block_bytes());     // each stage its layers
  CHECK(split_block_bytes(gqa2, {.expert = 4}) == 4 * gqa2.block_bytes());   // attention replicated
}

TEST_CASE("tensor parallel: the default model (Q4_1) on 3 ranks matches 1 rank", "[engine][tp][model]") {
  auto m = load("models/default.gguf");
  const auto& hp = m->hparams();
  const auto ref = unsharded(*m, 8);
  const auto tp = sharded(*m, 3, 8);
  // Each rank's slice of a quantized row keeps its blocks whole, and a product's activations are
  // rounded per block as in one rank, so a layer's sums differ in order only (~1e-7). But the next
  // layer rounds its activations to 8 bits per block again, and a 1e-7 change flips a rounding now
  // and then: over 30 layers the logits drift ~3% of their range on these random token ids (the
  // Python tests hold both paths to the same float64 reference bound: tests/python/test_forward.py).
  // A missing or doubled reduction would be off by the size of the logits themselves.
  const double rel = worst_rel(tp, ref);
  CHECK(rel < 0.1);
  size_t same = 0, rows = 0;
  for (size_t s = 0; s < ref.size(); ++s)
    for (size_t row = 0; row * hp.n_vocab < ref[s].size(); ++row, ++rows)
      same += argmax(&tp[s][row * hp.n_vocab], hp.n_vocab) == argmax(&ref[s][row * hp.n_vocab], hp.n_vocab);
  CHECK(same * 4 >= rows * 3);  // most top-1 choices agree (random ids: near-ties are common)
}

TEST_CASE("tensor parallel: shapes that do not split are refused with the reason", "[engine][tp]") {
  auto m = load("models/default.gguf");  // 9 heads, 3 KV heads, d_ff 1536
  CHECK_THAT(tensor_parallel_error(*m, 2), Catch::Contains("9 attention heads does not split into 2"));
  CHECK_THAT(tensor_parallel_error(*m, 6), Catch::Contains("9 attention heads"));
  CHECK_THAT(tensor_parallel_error(*m, 9), Catch::Contains("a feed-forward width of 1536"));  // 3 KV heads replicate over 9
  auto gqa2 = load("tests/fixtures/generated/llama_f32_gqa2.gguf");  // 4 heads, 2 KV heads: 4 ranks replicate them
  CHECK(tensor_parallel_error(*gqa2, 4).empty());
  auto kv3 = load("tests/fixtures/generated/llama_f32_kv3.gguf");  // 6 heads, 3 KV heads
  CHECK_THAT(tensor_parallel_error(*kv3, 2), Catch::Contains("3 KV heads neither split into nor are replicated evenly over 2"));
  CHECK(tensor_parallel_error(*kv3, 3).empty());
  CHECK(tensor_parallel_error(*kv3, 6).empty());  // each KV head on 2 ranks
  CHECK(tensor_parallel_error(*m, 1).empty());
  CHECK(tensor_parallel_error(*m, 3).empty());
  auto q4k = load("tests/fixtures/generated/llama_q4_k.gguf");  // 4 heads, 2 KV heads; O: 256 input columns, blocks of 256
  CHECK_THAT(tensor_parallel_error(*q4k, 2), Catch::Contains("256 input columns does not split into 2 tensor-parallel ranks of whole Q4_K blocks (256 values)"));
  CHECK_THAT(tensor_parallel_error(*q4k, 4), Catch::Contains("input columns"));  // its KV heads would replicate; O's blocks do not split
  const auto& hp = q4k->hparams();
  CHECK_THROWS_AS(tp_cpu_forward(*q4k, 2, {hp.n_layers, hp.n_kv_heads, hp.head_dim, 16}, 4, 1, 1), std::invalid_argument);
}

// --- pipeline parallel ---------------------------------------------------------------------------

namespace {

std::vector<std::vector<float>> staged(const model& m, int n_stages, int micro_batches, int32_t n_blocks) {
  const auto& hp = m.hparams();
  pp_cpu_forward fwd(m, n_stages, {hp.n_layers, hp.n_kv_heads, hp.head_dim, 16}, n_blocks, 1, 1, micro_batches);
  return run_steps(fwd, hp.n_vocab);
}

bool bit_identical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t s = 0; s < a.size(); ++s)
    if (a[s].size() != b[s].size() || std::memcmp(a[s].data(), b[s].data(), a[s].size() * sizeof(float)) != 0) return false;
  return true;
}

}  // namespace

TEST_CASE("split_layers: consecutive ranges, the remainder to the first stages", "[engine][pp]") {
  using r = std::vector<std::pair<int, int>>;
  CHECK(split_layers(30, 4) == r{{0, 8}, {8, 16}, {16, 23}, {23, 30}});
  CHECK(split_layers(2, 2) == r{{0, 1}, {1, 2}});
  CHECK(split_layers(5, 1) == r{{0, 5}});
  CHECK_THROWS_WITH(split_layers(2, 3), Catch::Contains("2 layers do not split into 3 pipeline stages"));
  CHECK_THROWS_AS(split_layers(2, 0), std::invalid_argument);
}

TEST_CASE("split_micro_batches: pieces in order, positions continued, the same logits rows", "[engine][pp]") {
  std::vector<token_id> a(37), b(1), c(20);
  for (size_t i = 0; i < a.size(); ++i) a[i] = (token_id)i;
  const std::vector<int32_t> table = {0, 1, 2};
  const std::vector<seq_chunk> batch = {{a, 5, table}, {b, 40, table}, {c, 0, table, true}};
  for (int n : {1, 2, 3, 4, 7, 58, 100}) {
    INFO("micro-batches " << n);
    const auto mbs = split_micro_batches(batch, n);
    CHECK((int)mbs.size() <= std::max(1, n));
    std::vector<seq_chunk> flat;
    for (const auto& mb : mbs) {
      CHECK(!mb.empty());
      flat.insert(flat.end(), mb.begin(), mb.end());
    }
    // Pieces of each chunk: its tokens in order, positions continuing, logits where the chunk wants them.
    size_t k = 0;
    int64_t rows = 0;
    for (const seq_chunk& orig : batch) {
      size_t off = 0;
      while (off < orig.tokens.size()) {
        REQUIRE(k < flat.size());
        const seq_chunk& p = flat[k++];
        CHECK(p.tokens.data() == orig.tokens.data() + off);
        CHECK(p.pos0 == orig.pos0 + (int64_t)off);
        off += p.tokens.size();
        const bool final_piece = off == orig.tokens.size();
        CHECK(p.all_logits == orig.all_logits);
        CHECK(p.no_logits == (final_piece ? orig.no_logits : !orig.all_logits));
        rows += p.no_logits ? 0 : p.all_logits ? (int64_t)p.tokens.size() : 1;
      }
      CHECK(off == orig.tokens.size());
    }
    CHECK(k == flat.size());
    CHECK(rows == 1 + 1 + 20);
  }
}

TEST_CASE("pipeline parallel: 2, 3 and 5 stages, 1 to 4 micro-batches, logits bit-identical to one stage", "[engine][pp][model]") {
  auto m = load("models/default.gguf");
  const auto ref = unsharded(*m, 8);
  for (auto [stages, mbs] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{3, 3}, std::pair{3, 4}, std::pair{5, 2}}) {
    INFO(stages << " stages, " << mbs << " micro-batches");
    CHECK(bit_identical(staged(*m, stages, mbs, 8), ref));
  }
  auto f = load("tests/fixtures/generated/llama_f32_hd64.gguf");  // 2 layers: one per stage
  CHECK(bit_identical(staged(*f, 2, 3, 8), unsharded(*f, 8)));
}

TEST_CASE("tensor and pipeline parallel combined: each stage a group of ranks", "[engine][tp][pp][model]") {
  // Stages are bit-identical to one stage, so stages of tensor-parallel groups are bit-identical
  // to the same groups unstaged (the ranks pass the rows on after their all-reduces).
  auto m = load("models/default.gguf");
  const auto& hp = m->hparams();
  const kv_shape full{hp.n_layers, hp.n_kv_heads, hp.head_dim, 16};
  REQUIRE(parallel_error(*m, {.tensor = 3, .pipeline = 2}).empty());
  const auto tp_alone = sharded(*m, 3, 8);
  for (auto [stages, mbs] : {std::pair{2, 2}, std::pair{3, 1}}) {
    INFO(stages << " stages of 3 ranks, " << mbs << " micro-batches");
    pp_cpu_forward both(*m, stages, full, 8, 1, 1, mbs, std::chrono::seconds(120), 3);
    CHECK(bit_identical(run_steps(both, hp.n_vocab), tp_alone));
  }
  // f32 models (exact arithmetic but for the order of sums) against one rank: 2 stages of 2 ranks,
  // and of 4 ranks sharing 2 KV heads (replicated).
  for (auto [fixture, ranks] : {std::pair{"llama_f32_hd64", 2}, std::pair{"llama_f32_gqa2", 4}}) {
    INFO(fixture << ": 2 stages of " << ranks << " ranks");
    auto f = load(std::string("tests/fixtures/generated/") + fixture + ".gguf");
    const auto& fh = f->hparams();
    pp_cpu_forward both(*f, 2, {fh.n_layers, fh.n_kv_heads, fh.head_dim, 16}, 8, 1, 1, 2, std::chrono::seconds(120), ranks);
    CHECK(worst_rel(run_steps(both, fh.n_vocab), unsharded(*f, 8)) < 1e-4);
  }
  // Swap and copy-on-write reach every rank of every stage.
  pp_cpu_forward both(*m, 2, full, 8, 1, 1, 2, std::chrono::seconds(120), 3);
  int n = 0;
  both.for_each_kv([&](kv_storage& d, kv_storage&) {
    CHECK(d.shape().n_kv_heads == 1);
    ++n;
  });
  CHECK(n == 6);
  // Expert parallel stands alone; a shape that does not split is named.
  CHECK_THAT(parallel_error(*m, {.tensor = 3, .expert = 2}), Catch::Contains("expert parallelism cannot be combined"));
  CHECK_THAT(parallel_error(*m, {.tensor = 2, .pipeline = 2}), Catch::Contains("9 attention heads"));
  CHECK_THAT(parallel_error(*m, {.tensor = 3, .pipeline = 31}), Catch::Contains("30 layers do not split into 31"));
  CHECK_THROWS_AS(pp_cpu_forward(*m, 2, full, 8, 1, 1, 2, std::chrono::seconds(120), 2), std::invalid_argument);
  // The KV budget: the stages partition the layers, the ranks the heads.
  CHECK(split_block_bytes(full, {.tensor = 3, .pipeline = 2}) == full.block_bytes());
}

TEST_CASE("tensor and pipeline parallel: a bad batch is refused before the ranks or stages run, and they stay usable", "[engine][tp][pp]") {
  auto m = load("tests/fixtures/generated/llama_f32_hd64.gguf");
  const auto& hp = m->hparams();
  const kv_shape full{hp.n_layers, hp.n_kv_heads, hp.head_dim, 16};
  auto check = [&](auto& fwd) {
    const token_id bad[1] = {hp.n_vocab};
    const int32_t table[1] = {0};
    seq_chunk c{std::span(bad), 0, std::span(table)};
    REQUIRE_THROWS_AS(fwd.forward(std::span(&c, 1)), std::invalid_argument);
    const token_id good[2] = {1, 2};
    c.tokens = std::span(good);
    REQUIRE(fwd.forward(std::span(&c, 1)).size() == (size_t)hp.n_vocab);
  };
  tp_cpu_forward tp(*m, 2, full, 4, 1, 1);
  check(tp);
  pp_cpu_forward pp(*m, 2, full, 4, 1, 1);
  check(pp);
  CHECK_THROWS_AS(pp_cpu_forward(*m, 3, full, 4, 1, 1), std::invalid_argument);
}

// --- expert parallel -----------------------------------------------------------------------------

TEST_CASE("expert parallel: a mixture of experts on 2 and 4 ranks matches 1 rank", "[engine][ep]") {
  auto m = load("tests/fixtures/generated/llama_moe_q8_0.gguf");  // 4 experts, 2 per token, Q8_0
  const auto& hp = m->hparams();
  REQUIRE(hp.n_experts == 4);
  REQUIRE(hp.n_experts_used == 2);
  const auto ref = unsharded(*m, 8);
  for (int n : {2, 4}) {
    INFO(n << " ranks");
    tp_cpu_forward fwd(*m, n, {hp.n_layers, hp.n_kv_heads, hp.head_dim, 16}, 8, 1, 1, parallel_split::expert);
    // Each rank sums its experts' weighted outputs; the all-reduce adds the ranks': only the order
    // of the float sums differs from one rank (then re-rounded to 8 bits by the next layer).
    CHECK(worst_rel(run_steps(fwd, hp.n_vocab), ref) < 0.02);
  }
}

TEST_CASE("expert parallel: models that do not split by experts are refused with the reason", "[engine][ep]") {
  auto moe = load("tests/fixtures/generated/llama_moe_q8_0.gguf");
  auto dense = load("models/default.gguf");
  CHECK(expert_parallel_error(*moe, 2).empty());
  CHECK_THAT(expert_parallel_error(*moe, 3), Catch::Contains("4 experts do not split into 3"));
  CHECK_THAT(expert_parallel_error(*dense, 2), Catch::Contains("needs a mixture-of-experts model"));
  CHECK_THAT(tensor_parallel_error(*moe, 2), Catch::Contains("splits by experts"));
  CHECK_THROWS_AS(shard_experts(*dense, 0, 2), std::invalid_argument);
}
