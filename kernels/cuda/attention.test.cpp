// paged_attention against kernels::attention_row on the same fp16 cache: mixed steps (chunked
// prefill continuing a cached prefix, q_len off the tile sizes, decode rows short and long enough
// to split), GQA ratios 1 to 64, head_dim 64, 128 and 256, sliding windows, block sizes 16 and odd
// ones, shuffled block tables. Cache slots no row may read (past each sequence's KV, unused blocks, the other layer)
// hold NaN, as does the output before the call.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/test_util.hpp"
#include "kernels/ops.hpp"

namespace {

using namespace troupe::kernels::cuda;
using namespace troupe::kernels::cuda::test;
namespace cpu = troupe::kernels;

struct seq_spec {
  int pos0;
  int q_len;
};

struct attn_case {
  int n_heads, n_kv_heads, head_dim;
  int max_splits;
  std::vector<seq_spec> seqs;
  int extra_q_len = 0;   // added to max_q_len / max_kv_len: the launcher must accept upper bounds
  int extra_kv_len = 0;
  int block_size = 16;
  int kv_per_split = 64;  // attention_scratch::kv_per_split
  int window = 0;         // sliding window (Gemma 3); 0: full causal attention
  // KV layer group read (step_layout::group): each sequence's tables of the groups before it point
  // at blocks that hold NaN, and with a window, the group's own entries before the window of pos0
  // are -1 (given back), as the block manager leaves them.
  int group = 0;
};

// Mixed prefill and decode: q_len 37 / 130 / 2 / 3 (130 > 2 tiles), a continued prefix at
// pos0 100 and 1000, decode rows with kv_len 1, 17, 700 and 3000.
std::vector<seq_spec> mixed_step() {
  return {{0, 37}, {100, 130}, {0, 1}, {16, 1}, {0, 2}, {699, 1}, {1000, 3}, {2999, 1}};
}

constexpr int n_layers = 2;
constexpr int layer = 1;

// Max over (token row, head) of max|got - want| / max|want| of that head's row (infinity on NaN).
// Per row, not over the whole output: a long row's output is a mean over many values, so it is
// ~1/sqrt(kv_len) of a short row's, and a bug confined to long rows (split bounds, the merge)
// would hide under a global scale. Expected error ~4e-3 (bf16 output: half an ulp is 2^-8).
double row_normalized_error(const std::vector<float>& got, const std::vector<float>& want, int hd) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0.0;
  for (size_t r0 = 0; r0 < want.size(); r0 += (size_t)hd) {
    const std::vector<float> g(got.begin() + (std::ptrdiff_t)r0, got.begin() + (std::ptrdiff_t)(r0 + hd));
    const std::vector<float> w(want.begin() + (std::ptrdiff_t)r0, want.begin() + (std::ptrdiff_t)(r0 + hd));
    const double e = normalized_error(g, w);
    if (!(e <= worst)) worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
  }
  return worst;
}

// What one step on the device gave: the output's bits, its per-row normalized error against the
// CPU, and (fused merge) the arrival counters after the call.
struct attn_result {
  double error = 0.0;
  std::vector<uint16_t> bits;
  std::vector<uint16_t> first_bits;  // fused_merge: the first run's output
  std::vector<unsigned> counters;
};

// Runs one step on the device and on the CPU. fused_merge: split rows are merged by their last
// CTA (attention_scratch::counters, zeroed first) instead of merge_kernel; the step runs twice
// then, the second time on a poisoned output and poisoned split partials, so a counter left
// nonzero, or a merge that read partials before every split had written them, would show in
// either run's bits (first_bits, bits).
attn_result run_step(const attn_case& c, uint64_t seed, bool fused_merge) {
  std::mt19937_64 rng(seed);
  const int hd = c.head_dim;
  const int block_size = c.block_size;
  const int64_t row_elems = (int64_t)c.n_kv_heads * hd;
  const int64_t block_elems = (int64_t)n_layers * 2 * block_size * row_elems;
  const int n_seqs = (int)c.seqs.size();

  // Block tables drawn from a shuffled pool with spare blocks, so tables are non-contiguous.
  std::vector<int32_t> q_start{0}, pos0, bt_start, tables, token_pos, token_seq;
  std::vector<int32_t> table_of;  // each sequence's table in c.group: its start in `tables`
  int max_q_len = 0, max_kv_len = 0, n_needed = 0;
  for (const auto& s : c.seqs) n_needed += (s.pos0 + s.q_len + block_size - 1) / block_size;
  const int n_blocks = n_needed * (c.group + 1) + 7;
  std::vector<int32_t> pool(n_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  int next_block = 0;
  for (int si = 0; si < n_seqs; ++si) {
    const auto& s = c.seqs[si];
    const int kv_len = s.pos0 + s.q_len;
    const int n_table = (kv_len + block_size - 1) / block_size;
    pos0.push_back(s.pos0);
    bt_start.push_back((int32_t)tables.size());
    for (int g = 0; g < c.group; ++g)  // other groups' tables: blocks never written (NaN)
      for (int b = 0; b < n_table; ++b) tables.push_back(pool[next_block++]);
    table_of.push_back((int32_t)tables.size());
    const int live = c.group > 0 && c.window > 0 ? std::max(0, s.pos0 - c.window + 1) / block_size : 0;
    for (int b = 0; b < n_table; ++b) tables.push_back(b < live ? -1 : pool[next_block++]);
    for (int i = 0; i < s.q_len; ++i) {
      token_pos.push_back(s.pos0 + i);
      token_seq.push_back(si);
    }
    q_start.push_back(q_start.back() + s.q_len);
    max_q_len = std::max(max_q_len, s.q_len);
    max_kv_len = std::max(max_kv_len, kv_len);
  }
  const int n_tokens = q_start.back();

  // Cache: NaN everywhere, then random values in the slots of each sequence's KV in `layer`.
  std::vector<float> cache((size_t)n_blocks * block_elems, std::nanf(""));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int si = 0; si < n_seqs; ++si) {
    const int kv_len = c.seqs[si].pos0 + c.seqs[si].q_len;
    for (int p = 0; p < kv_len; ++p) {
      if (tables[table_of[si] + p / block_size] < 0) continue;  // given back
      const int64_t k0 = tables[table_of[si] + p / block_size] * block_elems +
                         (int64_t)layer * 2 * block_size * row_elems + (int64_t)(p % block_size) * row_elems;
      for (int64_t i = 0; i < row_elems; ++i) {
        cache[k0 + i] = unit(rng);
        cache[k0 + block_size * row_elems + i] = unit(rng);
      }
    }
  }
  const std::vector<fp16> cache_h = to_fp16(cache);
  std::vector<cpu::fp16_t> cache_bits(cache_h.size());
  for (size_t i = 0; i < cache_h.size(); ++i) cache_bits[i] = __half_raw(cache_h[i]).x;

  // Queries in [-3, 3] so the softmax is peaked at hd 128 rather than flat.
  const std::vector<float> q = round_bf16(random_floats((size_t)n_tokens * c.n_heads * hd, rng, -3.0f, 3.0f));
  const float scale = 1.0f / std::sqrt((float)hd);

  cpu::kv_layer_view view;
  view.k_base = cache_bits.data() + (int64_t)layer * 2 * block_size * row_elems;
  view.v_base = view.k_base + block_size * row_elems;
  view.block_stride = block_elems;
  view.block_size = block_size;
  view.n_kv_heads = c.n_kv_heads;
  view.head_dim = hd;
  std::vector<float> want((size_t)n_tokens * c.n_heads * hd);
  std::vector<float> scratch((size_t)cpu::attention_scratch_floats(c.n_heads, hd, max_kv_len));
  std::vector<float> m((size_t)c.n_heads), l((size_t)c.n_heads), acc((size_t)c.n_heads * hd);
  for (int t = 0; t < n_tokens; ++t) {
    const int si = token_seq[t];
    float* o = want.data() + (size_t)t * c.n_heads * hd;
    if (c.window == 0) {
      cpu::attention_row(q.data() + (size_t)t * c.n_heads * hd, c.n_heads, token_pos[t], view,
                         tables.data() + table_of[si], scale, o, 0, c.n_heads, scratch.data());
    } else {  // the window as the CPU forward attends to it: positions [pos + 1 - window, pos]
      const int64_t end = token_pos[t] + 1;
      cpu::attention_partial(q.data() + (size_t)t * c.n_heads * hd, c.n_heads, std::max<int64_t>(0, end - c.window), end,
                             view, tables.data() + table_of[si], scale, 0, c.n_heads, m.data(), l.data(), acc.data(),
                             scratch.data());
      cpu::attention_merge(1, c.n_heads, hd, m.data(), l.data(), acc.data(), o);
    }
  }

  dev_buf<fp16> d_cache(cache_h);
  dev_buf<bf16> d_q(to_bf16(q));
  dev_buf<int32_t> d_q_start(q_start), d_pos0(pos0), d_bt_start(bt_start), d_tables(tables),
      d_token_pos(token_pos), d_token_seq(token_seq);
  dev_buf<bf16> d_out((size_t)n_tokens * c.n_heads * hd);
  d_out.poison();
  const size_t scratch_bytes = attention_scratch_bytes(n_tokens, c.n_heads, hd, c.max_splits);
  dev_buf<float> d_scratch(scratch_bytes / sizeof(float));
  d_scratch.poison();

  step_layout st;
  st.n_seqs = n_seqs;
  st.n_tokens = n_tokens;
  st.max_q_len = max_q_len + c.extra_q_len;
  st.max_kv_len = max_kv_len + c.extra_kv_len;
  st.q_start = d_q_start.p;
  st.pos0 = d_pos0.p;
  st.bt_start = d_bt_start.p;
  st.block_tables = d_tables.p;
  st.token_pos = d_token_pos.p;
  st.token_seq = d_token_seq.p;
  st.group = c.group;
  kv_cache_view kv;
  kv.base = d_cache.p;
  kv.block_elems = block_elems;
  kv.n_layers = n_layers;
  kv.block_size = block_size;
  kv.n_kv_heads = c.n_kv_heads;
  kv.head_dim = hd;
  attention_scratch sc;
  if (c.max_splits > 0) {
    sc.partial_out = d_scratch.p;
    sc.partial_ml = d_scratch.p + (size_t)n_tokens * c.n_heads * c.max_splits * hd;
    sc.max_splits = c.max_splits;
    sc.kv_per_split = c.kv_per_split;
  }
  dev_buf<unsigned> d_counters(attention_counters(n_tokens, c.n_heads));
  check(cudaMemset(d_counters.p, 0, d_counters.bytes()), "cudaMemset");
  if (fused_merge) sc.counters = d_counters.p;
  paged_attention(d_q.p, st, kv, layer, c.n_heads, scale, d_out.p, sc, nullptr, c.window);
  attn_result r;
  if (fused_merge) {
    check(cudaDeviceSynchronize(), "paged_attention");
    for (const bf16 v : d_out.download()) r.first_bits.push_back(__nv_bfloat16_raw(v).x);
    d_out.poison();
    d_scratch.poison();
    paged_attention(d_q.p, st, kv, layer, c.n_heads, scale, d_out.p, sc, nullptr, c.window);
  }
  check(cudaDeviceSynchronize(), "paged_attention");
  const std::vector<bf16> out = d_out.download();
  r.error = row_normalized_error(from_bf16(out), want, hd);
  for (const bf16 v : out) r.bits.push_back(__nv_bfloat16_raw(v).x);
  r.counters = d_counters.download();
  return r;
}

double run_case(const attn_case& c, uint64_t seed) { return run_step(c, seed, false).error; }

}  // namespace

TEST_CASE("paged_attention matches the CPU reference on mixed steps", "[cuda]") {
  struct shape {
    int n_heads, n_kv_heads, head_dim;
  };
  const shape sh = GENERATE(shape{9, 3, 64},     // SmolLM2: GQA 3
                            shape{32, 8, 128},   // Llama-3-8B: GQA 4
                            shape{8, 8, 128},    // no GQA
                            shape{28, 4, 128},   // Qwen2.5-7B: GQA 7
                            shape{16, 8, 64},    // GQA 2
                            shape{64, 8, 128},   // GQA 8: one full decode CTA per kv head
                            shape{16, 1, 64});   // GQA 16: two decode CTAs per kv head
  const int max_splits = GENERATE(0, 16);
  const uint64_t seed = fresh_seed();
  INFO("n_heads " << sh.n_heads << " n_kv_heads " << sh.n_kv_heads << " head_dim " << sh.head_dim << " max_splits "
                  << max_splits << " seed " << seed);
  attn_case c{sh.n_heads, sh.n_kv_heads, sh.head_dim, max_splits, mixed_step()};
  CHECK(run_case(c, seed) <= 2e-2);
}

TEST_CASE("paged_attention decode-only batch splits long rows", "[cuda]") {
  const int head_dim = GENERATE(64, 128);
  const uint64_t seed = fresh_seed();
  INFO("head_dim " << head_dim << " seed " << seed);
  attn_case c{32, 8, head_dim, 16, {{0, 1}, {512, 1}, {513, 1}, {1023, 1}, {4095, 1}, {77, 1}, {2500, 1}}};
  // Splits of at least 64 positions (the default), 32 (one pass of a CTA), 7 (a ragged pass) and
  // 128: rows of 17 to 4096 positions split 1 to 16 ways. 113 positions at 7: 16 splits of 8, the
  // last one empty.
  c.seqs.push_back({16, 1});
  c.seqs.push_back({112, 1});
  c.kv_per_split = GENERATE(64, 32, 7, 128);
  INFO("kv_per_split " << c.kv_per_split);
  CHECK(run_case(c, seed) <= 2e-2);
  const attn_result kernel = run_step(c, seed, false), fused = run_step(c, seed, true);
  CHECK(fused.bits == kernel.bits);  // the last-CTA merge at every split size
  CHECK(fused.first_bits == kernel.bits);
}

TEST_CASE("paged_attention's last-CTA merge equals merge_kernel bit for bit and resets its counters", "[cuda]") {
  struct shape {
    int n_heads, n_kv_heads, head_dim;
  };
  const shape sh = GENERATE(shape{32, 8, 128},   // GQA 4
                            shape{9, 3, 64},     // GQA 3
                            shape{16, 1, 64});   // GQA 16: two CTAs (two counters) per kv head
  const uint64_t seed = fresh_seed();
  INFO("n_heads " << sh.n_heads << " n_kv_heads " << sh.n_kv_heads << " head_dim " << sh.head_dim << " seed " << seed);
  attn_case c{sh.n_heads, sh.n_kv_heads, sh.head_dim, 16, mixed_step()};
  c.seqs.push_back({4095, 1});  // 16 splits
  c.seqs.push_back({64, 1});    // 65 positions: 2 splits
  const attn_result kernel = run_step(c, seed, false), fused = run_step(c, seed, true);
  CHECK(fused.error <= 2e-2);
  CHECK(fused.bits == kernel.bits);
  CHECK(std::all_of(fused.counters.begin(), fused.counters.end(), [](unsigned v) { return v == 0; }));
}

TEST_CASE("paged_attention reads any block_size through the block table", "[cuda]") {
  struct shape {
    int n_heads, n_kv_heads, head_dim;
  };
  const shape sh = GENERATE(shape{9, 3, 64},     // GQA 3
                            shape{64, 1, 128});  // GQA 64, the limit: one query row per prefill tile
  const int bs = GENERATE(1, 7, 33);  // KV tiles and splits cross blocks at odd offsets
  const uint64_t seed = fresh_seed();
  INFO("n_heads " << sh.n_heads << " n_kv_heads " << sh.n_kv_heads << " head_dim " << sh.head_dim << " block_size "
                  << bs << " seed " << seed);
  attn_case c{sh.n_heads, sh.n_kv_heads, sh.head_dim, 16, mixed_step()};
  c.block_size = bs;
  CHECK(run_case(c, seed) <= 2e-2);
}

TEST_CASE("paged_attention accepts upper bounds for max_q_len and max_kv_len", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  attn_case c{9, 3, 64, 8, mixed_step(), 200, 5000};
  CHECK(run_case(c, seed) <= 2e-2);
}

TEST_CASE("paged_attention long prefill with a single sequence", "[cuda]") {
  const int head_dim = GENERATE(64, 128);
  const uint64_t seed = fresh_seed();
  INFO("head_dim " << head_dim << " seed " << seed);
  attn_case c{32, 8, head_dim, 16, {{0, 1000}}};
  CHECK(run_case(c, seed) <= 2e-2);
}

TEST_CASE("paged_attention with head_dim 256, sliding windows and KV layer groups (Gemma 3) matches the CPU", "[cuda]") {
  struct window_case {
    int n_heads, n_kv_heads, head_dim, window, max_splits;
    int group = 0;  // a sliding-window layer group's tables, entries before the window given back
  };
  // Windows: 0 (head_dim 256's own prefill tiles and Q re-reads), 1 (only the row itself), 48
  // (inside a prefill tile), 100 (across tiles and splits), 5000 (longer than every row).
  const window_case wc = GENERATE(window_case{4, 1, 256, 0, 16},    // Gemma 3 270M: GQA 4
                                  window_case{4, 1, 256, 48, 16},
                                  window_case{4, 1, 256, 100, 16},
                                  window_case{4, 1, 256, 100, 0},   // unsplit decode rows
                                  window_case{8, 4, 256, 1, 16},    // Gemma 3 4B: GQA 2
                                  window_case{8, 4, 256, 5000, 16},
                                  window_case{16, 8, 128, 100, 16},  // the window at the other head sizes
                                  window_case{9, 3, 64, 48, 16},
                                  window_case{4, 1, 256, 100, 16, 2},  // Gemma 3's KV layer groups
                                  window_case{9, 3, 64, 48, 0, 1},
                                  window_case{16, 8, 128, 0, 16, 3});  // a group's table without a window
  const uint64_t seed = fresh_seed();
  INFO("n_heads " << wc.n_heads << " n_kv_heads " << wc.n_kv_heads << " head_dim " << wc.head_dim << " window "
                  << wc.window << " max_splits " << wc.max_splits << " group " << wc.group << " seed " << seed);
  attn_case c{wc.n_heads, wc.n_kv_heads, wc.head_dim, wc.max_splits, mixed_step()};
  c.window = wc.window;
  c.group = wc.group;
  c.block_size = 7;  // windows start inside blocks
  CHECK(run_case(c, seed) <= 2e-2);
  if (wc.max_splits > 0) {
    c.kv_per_split = 7;  // a window of 100 splits 15 ways; split bounds move with the window's start
    const attn_result kernel = run_step(c, seed, false), fused = run_step(c, seed, true);
    CHECK(kernel.error <= 2e-2);
    CHECK(fused.bits == kernel.bits);
    CHECK(fused.first_bits == kernel.bits);
  }
}

TEST_CASE("paged_attention rejects unsupported shapes", "[cuda]") {
  step_layout st;
  kv_cache_view kv;
  kv.n_layers = 1;
  kv.n_kv_heads = 2;
  kv.head_dim = 96;
  const attention_scratch sc;
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 4, 1.0f, nullptr, sc, nullptr), cuda_error);
  kv.head_dim = 64;
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 5, 1.0f, nullptr, sc, nullptr), cuda_error);  // 5 % 2
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 130, 1.0f, nullptr, sc, nullptr), cuda_error);  // group 65
  CHECK_NOTHROW(paged_attention(nullptr, st, kv, 0, 4, 1.0f, nullptr, sc, nullptr));  // empty step: no launch
  attention_scratch counted;
  unsigned counter = 0;
  counted.counters = &counter;  // counters without split scratch
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 4, 1.0f, nullptr, counted, nullptr), cuda_error);
  attention_scratch no_split_size;
  float dummy[2];
  no_split_size.partial_out = no_split_size.partial_ml = dummy, no_split_size.max_splits = 16;
  no_split_size.kv_per_split = 0;
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 4, 1.0f, nullptr, no_split_size, nullptr), cuda_error);
  CHECK_THROWS_AS(paged_attention(nullptr, st, kv, 0, 4, 1.0f, nullptr, sc, nullptr, -1), cuda_error);  // window < 0
}
