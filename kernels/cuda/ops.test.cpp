// The element-wise CUDA kernels and the fused RoPE + KV write against the CPU references
// (kernels/ops.hpp, kernels/fp16.hpp): fresh random inputs, poisoned outputs, row lengths that
// are not multiples of the vector width (scalar paths) as well as ones that are; the qkv GEMV
// that applies RoPE itself against gemv_bf16 then rope_qkv_store.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/test_util.hpp"
#include "kernels/fp16.hpp"
#include "kernels/ops.hpp"

using namespace troupe::kernels::cuda;
using namespace troupe::kernels::cuda::test;
namespace cpu = troupe::kernels;

namespace {

constexpr double bf16_bound = 1e-2;  // one bf16 rounding of the output is 2^-9 relative
constexpr double fp16_bound = 2e-3;
constexpr double f32_bound = 1e-5;

// act(gate) * up for each row of gu [rows, 2 d_ff] (gate then up) by the CPU kernel `act`
// (cpu::swiglu or cpu::geglu).
std::vector<float> glu_reference(const std::vector<float>& gu, int rows, int d_ff, void (*act)(float*, const float*, int64_t)) {
  std::vector<float> out(size_t(rows) * d_ff);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(&gu[size_t(r) * 2 * d_ff], d_ff, &out[size_t(r) * d_ff]);
    act(&out[size_t(r) * d_ff], &gu[size_t(r) * 2 * d_ff + d_ff], d_ff);
  }
  return out;
}

}  // namespace

TEST_CASE("embed_rows gathers bf16 rows as floats", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int d : {576, 1000, 577}) {
    const int n_vocab = 1001, rows = 7;
    const auto table = round_bf16(random_floats(size_t(n_vocab) * d, g));
    std::vector<int32_t> tokens(rows);
    for (auto& t : tokens) t = int32_t(g() % n_vocab);
    dev_buf<bf16> d_table(to_bf16(table));
    dev_buf<int32_t> d_tokens(tokens);
    dev_buf<float> d_out(size_t(rows) * d);
    d_out.poison();
    embed_rows(d_table.p, d_tokens.p, d_out.p, rows, d, nullptr);
    std::vector<float> want(size_t(rows) * d);
    for (int r = 0; r < rows; ++r)
      std::copy_n(&table[size_t(tokens[r]) * d], d, &want[size_t(r) * d]);
    INFO("d " << d);
    CHECK(normalized_error(d_out.download(), want) == 0.0);
    // Gemma's sqrt(d) scale, in fp32 as the CPU forward applies it.
    const float scale = std::sqrt(float(d));
    d_out.poison();
    embed_rows(d_table.p, d_tokens.p, d_out.p, rows, d, nullptr, scale);
    for (float& v : want) v *= scale;
    CHECK(normalized_error(d_out.download(), want) == 0.0);
  }
}

TEST_CASE("add_rmsnorm adds the residual and normalises each row", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int n : {576, 1000, 1001}) {
    for (const bool with_add : {true, false}) {
      const int rows = 7;
      const float eps = 1e-5f;
      auto residual = random_floats(size_t(rows) * n, g, -3.0f, 3.0f);
      const auto add = round_bf16(random_floats(size_t(rows) * n, g));
      const auto w = random_floats(size_t(n), g, 0.5f, 1.5f);
      dev_buf<float> d_res(residual), d_w(w);
      dev_buf<bf16> d_add(to_bf16(add)), d_y(size_t(rows) * n);
      d_y.poison();
      add_rmsnorm(d_res.p, with_add ? d_add.p : nullptr, d_w.p, d_y.p, rows, n, eps, nullptr);
      std::vector<float> want_y(residual.size());
      for (int r = 0; r < rows; ++r) {
        float* x = &residual[size_t(r) * n];
        if (with_add)
          for (int i = 0; i < n; ++i) x[i] += add[size_t(r) * n + i];
        cpu::rmsnorm_row(x, w.data(), &want_y[size_t(r) * n], n, eps);
      }
      INFO("n " << n << " add " << with_add);
      CHECK(normalized_error(d_res.download(), residual) <= f32_bound);
      CHECK(normalized_error(from_bf16(d_y.download()), want_y) <= bf16_bound);
    }
  }
}

TEST_CASE("add_rmsnorm with the added row's own norm (Gemma's sandwich norm) matches the CPU", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int n : {640, 1001}) {
    const int rows = 5;
    const float eps = 1e-6f;
    auto residual = random_floats(size_t(rows) * n, g, -3.0f, 3.0f);
    // Rows far from unit RMS: the added row's scale must come from its own sum of squares.
    auto add = random_floats(size_t(rows) * n, g, -40.0f, 40.0f);
    for (int i = 0; i < n; ++i) add[size_t(n) + i] *= 1e-3f;
    add = round_bf16(add);
    const auto w = random_floats(size_t(n), g, 0.5f, 1.5f), post_w = random_floats(size_t(n), g, 0.5f, 1.5f);
    dev_buf<float> d_res(residual), d_w(w), d_post(post_w);
    dev_buf<bf16> d_add(to_bf16(add)), d_y(size_t(rows) * n);
    d_y.poison();
    add_rmsnorm(d_res.p, d_add.p, d_w.p, d_y.p, rows, n, eps, nullptr, d_post.p);
    std::vector<float> want_y(residual.size()), normed((size_t)n);
    for (int r = 0; r < rows; ++r) {
      float* x = &residual[size_t(r) * n];
      cpu::rmsnorm_row(&add[size_t(r) * n], post_w.data(), normed.data(), n, eps);
      for (int i = 0; i < n; ++i) x[i] += normed[(size_t)i];
      cpu::rmsnorm_row(x, w.data(), &want_y[size_t(r) * n], n, eps);
    }
    INFO("n " << n);
    CHECK(normalized_error(d_res.download(), residual) <= f32_bound);
    CHECK(normalized_error(from_bf16(d_y.download()), want_y) <= bf16_bound);
  }
}

TEST_CASE("add_residual adds bf16 rows to the fp32 residual", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int n : {576, 1001}) {
    const int rows = 7;
    auto residual = random_floats(size_t(rows) * n, g, -3.0f, 3.0f);
    const auto add = round_bf16(random_floats(size_t(rows) * n, g));
    dev_buf<float> d_res(residual);
    dev_buf<bf16> d_add(to_bf16(add));
    add_residual(d_res.p, d_add.p, rows, n, nullptr);
    for (size_t i = 0; i < residual.size(); ++i) residual[i] += add[i];
    INFO("n " << n);
    CHECK(normalized_error(d_res.download(), residual) == 0.0);
  }
}

TEST_CASE("swiglu multiplies silu(gate) by up", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int d_ff : {1000, 1001, 576}) {
    const int rows = 7;
    const auto gu = round_bf16(random_floats(size_t(rows) * 2 * d_ff, g, -4.0f, 4.0f));
    dev_buf<bf16> d_gu(to_bf16(gu)), d_out(size_t(rows) * d_ff);
    d_out.poison();
    swiglu(d_gu.p, d_out.p, rows, d_ff, nullptr);
    INFO("d_ff " << d_ff);
    CHECK(normalized_error(from_bf16(d_out.download()), glu_reference(gu, rows, d_ff, cpu::swiglu)) <= bf16_bound);
  }
}

TEST_CASE("geglu multiplies gelu(gate) (tanh approximation) by up as the CPU's kernels::geglu", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int d_ff : {2048, 1001}) {
    const int rows = 3;
    const auto gu = round_bf16(random_floats(size_t(rows) * 2 * d_ff, g, -3.0f, 3.0f));
    dev_buf<bf16> d_gu(to_bf16(gu)), d_out(size_t(rows) * d_ff);
    d_out.poison();
    geglu(d_gu.p, d_out.p, rows, d_ff, nullptr);
    INFO("d_ff " << d_ff);
    const std::vector<float> got = from_bf16(d_out.download());
    CHECK(normalized_error(got, glu_reference(gu, rows, d_ff, cpu::geglu)) <= bf16_bound);
    // Not SiLU: on [-3, 3] the two differ by up to ~0.19 |up| (at gate -1.5 and 2), 0.06 of the
    // largest output, against the 1e-2 bound above.
    CHECK(normalized_error(got, glu_reference(gu, rows, d_ff, cpu::swiglu)) > 0.03);
  }
}

TEST_CASE("f32_to_bf16 rounds to nearest even and bf16_to_f32 is exact", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const int64_t n = 4099;
  const auto x = random_floats(size_t(n), g, -100.0f, 100.0f);
  dev_buf<float> d_x(x), d_back{size_t(n)};
  dev_buf<bf16> d_b{size_t(n)};
  d_b.poison();
  d_back.poison();
  f32_to_bf16(d_x.p, d_b.p, n, nullptr);
  bf16_to_f32(d_b.p, d_back.p, n, nullptr);
  const auto want = round_bf16(x);
  CHECK(normalized_error(from_bf16(d_b.download()), want) == 0.0);
  CHECK(normalized_error(d_back.download(), want) == 0.0);
  // Unaligned starts take the scalar path.
  d_back.poison();
  bf16_to_f32(d_b.p + 1, d_back.p + 1, n - 1, nullptr);
  const auto back = d_back.download();
  CHECK(normalized_error(std::vector<float>(back.begin() + 1, back.end()), std::vector<float>(want.begin() + 1, want.end())) == 0.0);
}

namespace {

struct rope_case {
  int head_dim, n_rot;
  rope_kind kind;
  bool bias, freq;
  bool qk_norm = false;  // Gemma 3: each Q and K head RMS-normalized before the rotation
};

// Three sequences at very different positions (one past 4096, where theta needs double
// precision), block_size 16, each block index mapped to a distinct random block.
void check_rope_qkv_store(const rope_case& c, std::mt19937_64& g) {
  const int n_heads = 6, n_kv = 2, hd = c.head_dim, n_layers = 2, layer = 1, bs = 16, n_blocks = 48;
  const std::vector<int> pos0 = {0, 13, 5000}, q_len = {1, 7, 5};
  const int n_seqs = 3, n_tokens = 13;
  const int q_dim = n_heads * hd, kv_dim = n_kv * hd, row = q_dim + 2 * kv_dim;

  std::vector<int32_t> pool(n_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), g);
  std::vector<int32_t> q_start = {0}, bt_start, tables, token_pos, token_seq;
  for (int s = 0; s < n_seqs; ++s) {
    q_start.push_back(q_start.back() + q_len[s]);
    bt_start.push_back(int32_t(tables.size()));
    const int n_table = (pos0[s] + q_len[s] + bs - 1) / bs;
    for (int b = 0; b < n_table; ++b) {
      if (b < pos0[s] / bs) {  // not written this step: never read
        tables.push_back(-1);
        continue;
      }
      tables.push_back(pool.back());
      pool.pop_back();
    }
    for (int j = 0; j < q_len[s]; ++j) token_pos.push_back(pos0[s] + j), token_seq.push_back(s);
  }
  REQUIRE(int(token_pos.size()) == n_tokens);

  const auto qkv = round_bf16(random_floats(size_t(n_tokens) * row, g, -2.0f, 2.0f));
  const auto bq = random_floats(size_t(q_dim), g), bk = random_floats(size_t(kv_dim), g),
             bv = random_floats(size_t(kv_dim), g);
  const auto freq = random_floats(size_t(c.n_rot / 2), g, 1.0f, 8.0f);
  const auto q_norm = random_floats(size_t(hd), g, 0.5f, 2.0f), k_norm = random_floats(size_t(hd), g, 0.5f, 2.0f);
  const float base = 10000.0f, norm_eps = 1e-6f;

  dev_buf<bf16> d_qkv(to_bf16(qkv)), d_q(size_t(n_tokens) * q_dim);
  dev_buf<float> d_bq(bq), d_bk(bk), d_bv(bv), d_freq(freq), d_q_norm(q_norm), d_k_norm(k_norm);
  dev_buf<int32_t> d_q_start(q_start), d_pos0(std::vector<int32_t>(pos0.begin(), pos0.end())), d_bt_start(bt_start),
      d_tables(tables), d_token_pos(token_pos), d_token_seq(token_seq);
  const int64_t block_elems = int64_t(n_layers) * 2 * bs * kv_dim;
  dev_buf<fp16> d_cache(size_t(n_blocks * block_elems));
  d_cache.poison();
  d_q.poison();

  rope_params rp;
  rp.n_heads = n_heads, rp.n_kv_heads = n_kv, rp.head_dim = hd, rp.n_rot = c.n_rot, rp.base = base, rp.kind = c.kind;
  rp.freq_factors = c.freq ? d_freq.p : nullptr;
  if (c.qk_norm) rp.q_norm = d_q_norm.p, rp.k_norm = d_k_norm.p, rp.norm_eps = norm_eps;
  step_layout st;
  st.n_seqs = n_seqs, st.n_tokens = n_tokens, st.max_q_len = 7, st.max_kv_len = 5005;
  st.q_start = d_q_start.p, st.pos0 = d_pos0.p, st.bt_start = d_bt_start.p, st.block_tables = d_tables.p;
  st.token_pos = d_token_pos.p, st.token_seq = d_token_seq.p;
  kv_cache_view kv;
  kv.base = d_cache.p, kv.block_elems = block_elems, kv.n_layers = n_layers, kv.block_size = bs, kv.n_kv_heads = n_kv,
  kv.head_dim = hd;
  rope_qkv_store(d_qkv.p, c.bias ? d_bq.p : nullptr, c.bias ? d_bk.p : nullptr, c.bias ? d_bv.p : nullptr, rp, st, kv,
                 layer, d_q.p, nullptr);

  // CPU reference: the cache as floats (NaN where nothing may be written), Q as floats.
  const auto nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> want_cache(size_t(n_blocks * block_elems), nan), want_q(size_t(n_tokens) * q_dim);
  std::vector<float> cos_sin(size_t(c.n_rot));
  for (int t = 0; t < n_tokens; ++t) {
    std::vector<float> x(&qkv[size_t(t) * row], &qkv[size_t(t) * row] + row);
    if (c.bias) {
      for (int i = 0; i < q_dim; ++i) x[size_t(i)] += bq[size_t(i)];
      for (int i = 0; i < kv_dim; ++i) x[size_t(q_dim + i)] += bk[size_t(i)], x[size_t(q_dim + kv_dim + i)] += bv[size_t(i)];
    }
    if (c.qk_norm) {  // as cpu_forward: per head, after the bias, before RoPE
      for (int h = 0; h < n_heads; ++h) cpu::rmsnorm_row(&x[size_t(h * hd)], q_norm.data(), &x[size_t(h * hd)], hd, norm_eps);
      for (int h = 0; h < n_kv; ++h)
        cpu::rmsnorm_row(&x[size_t(q_dim + h * hd)], k_norm.data(), &x[size_t(q_dim + h * hd)], hd, norm_eps);
    }
    cpu::rope_cos_sin(token_pos[t], c.n_rot, base, c.freq ? freq.data() : nullptr, cos_sin.data());
    const auto style = c.kind == rope_kind::neox ? cpu::rope_style::neox : cpu::rope_style::normal;
    cpu::rope_row(x.data(), n_heads, hd, c.n_rot, cos_sin.data(), style);
    cpu::rope_row(x.data() + q_dim, n_kv, hd, c.n_rot, cos_sin.data(), style);
    std::copy_n(x.data(), q_dim, &want_q[size_t(t) * q_dim]);
    const int p = token_pos[t];
    const int32_t block = tables[size_t(bt_start[token_seq[t]] + p / bs)];
    const int64_t k_off = block * block_elems + int64_t(layer) * 2 * bs * kv_dim + int64_t(p % bs) * kv_dim;
    for (int i = 0; i < kv_dim; ++i) {
      want_cache[size_t(k_off + i)] = cpu::fp16_to_f32(cpu::f32_to_fp16(x[size_t(q_dim + i)]));
      want_cache[size_t(k_off + bs * kv_dim + i)] = cpu::fp16_to_f32(cpu::f32_to_fp16(x[size_t(q_dim + kv_dim + i)]));
    }
  }
  CHECK(normalized_error(from_bf16(d_q.download()), want_q) <= bf16_bound);
  // Written slots match; every other slot still holds the poison.
  const auto cache = from_fp16(d_cache.download());
  std::vector<float> got_written, want_written;
  size_t touched_elsewhere = 0;
  for (size_t i = 0; i < cache.size(); ++i) {
    if (std::isnan(want_cache[i])) {
      touched_elsewhere += !std::isnan(cache[i]);
    } else {
      got_written.push_back(cache[i]);
      want_written.push_back(want_cache[i]);
    }
  }
  CHECK(touched_elsewhere == 0);
  CHECK(normalized_error(got_written, want_written) <= fp16_bound);
}

// gemv_bf16_rope_qkv against gemv_bf16 then rope_qkv_store: `batch` sequences of one token each
// at scattered positions (the first past 4096), n_in with a ragged tail, optionally a norm reader
// (random partial sums); Q and the whole cache compared bit for bit (poison included). With
// `quant`, gemv_quant_rope_qkv against gemv_quant (Q, K and V blocks in three allocations, each
// part's GEMV writing its columns as the forward does) then rope_qkv_store, unrolled 1, 4 (with a
// norm reader) and 8.
void check_gemv_rope(const rope_case& c, int batch, std::mt19937_64& g, const quant_type* quant = nullptr) {
  const int n_heads = 6, n_kv = 2, hd = c.head_dim, n_layers = 2, layer = 1, bs = 16, n_blocks = 24;
  const int q_dim = n_heads * hd, kv_dim = n_kv * hd, rows = q_dim + 2 * kv_dim;
  const int64_t n_in = quant ? 512 : 264;
  std::vector<int32_t> pool(n_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), g);
  std::vector<int32_t> q_start = {0}, pos0, bt_start, tables, token_pos, token_seq;
  for (int s = 0; s < batch; ++s) {
    const int pos = s == 0 ? 5000 : int(g() % 300);
    q_start.push_back(s + 1);
    pos0.push_back(pos);
    bt_start.push_back(int32_t(tables.size()));
    for (int b = 0; b < pos / bs; ++b) tables.push_back(-1);  // earlier blocks: not written this step
    tables.push_back(pool.back());
    pool.pop_back();
    token_pos.push_back(pos);
    token_seq.push_back(s);
  }
  const auto w = round_bf16(random_floats(size_t(rows) * n_in, g)), x = round_bf16(random_floats(size_t(batch) * n_in, g));
  const auto bq = random_floats(size_t(q_dim), g), bk = random_floats(size_t(kv_dim), g), bv = random_floats(size_t(kv_dim), g);
  const auto freq = random_floats(size_t(c.n_rot / 2), g, 1.0f, 8.0f);
  const auto sumsq = random_floats(size_t(batch * norm_fold_parts(n_in)), g, 0.5f, 2.0f);
  dev_buf<bf16> d_w(to_bf16(w)), d_x(to_bf16(x)), d_qkv(size_t(batch) * rows);
  dev_buf<float> d_bq(bq), d_bk(bk), d_bv(bv), d_freq(freq), d_sumsq(sumsq);
  dev_buf<int32_t> d_q_start(q_start), d_pos0(pos0), d_bt_start(bt_start), d_tables(tables), d_token_pos(token_pos),
      d_token_seq(token_seq);
  const int64_t block_elems = int64_t(n_layers) * 2 * bs * kv_dim;

  qkv_rope_args r;
  if (c.bias) r.bq = d_bq.p, r.bk = d_bk.p, r.bv = d_bv.p;
  r.rope.n_heads = n_heads, r.rope.n_kv_heads = n_kv, r.rope.head_dim = hd, r.rope.n_rot = c.n_rot, r.rope.kind = c.kind;
  r.rope.freq_factors = c.freq ? d_freq.p : nullptr;
  r.st.n_seqs = batch, r.st.n_tokens = batch, r.st.max_q_len = 1, r.st.max_kv_len = 5001;
  r.st.q_start = d_q_start.p, r.st.pos0 = d_pos0.p, r.st.bt_start = d_bt_start.p, r.st.block_tables = d_tables.p;
  r.st.token_pos = d_token_pos.p, r.st.token_seq = d_token_seq.p;
  r.kv.block_elems = block_elems, r.kv.n_layers = n_layers, r.kv.block_size = bs, r.kv.n_kv_heads = n_kv, r.kv.head_dim = hd;
  r.layer = layer;
  if (quant) {
    const int64_t part_rows[3] = {q_dim, kv_dim, kv_dim};
    std::vector<dev_buf<uint8_t>> parts;
    quant_matrix m;
    m.qt = *quant;
    for (int p = 0; p < 3; ++p) {
      parts.emplace_back(quant_row_bytes(*quant, n_in) * size_t(part_rows[p]));
      fill_random_blocks(*quant, parts.back().p, part_rows[p] * n_in, 0.05f, g(), nullptr);
      m.raw[p] = parts.back().p;
      m.row0[p] = p == 0 ? 0 : m.row0[p - 1] + part_rows[p - 1];
    }
    m.n_parts = 3;
    for (const int unroll : {1, 4, 8}) {
      const bool reader = unroll == 4;  // random partial sums of squares: a norm reader
      gemv_norm norm;
      if (reader) norm.sumsq_in = d_sumsq.p, norm.eps = 1e-6f;
      INFO("type " << int(*quant) << " batch " << batch << " unroll " << unroll << " norm reader " << reader);
      dev_buf<fp16> cache_two(size_t(n_blocks * block_elems)), cache_one(size_t(n_blocks * block_elems));
      dev_buf<bf16> q_two(size_t(batch) * q_dim), q_one(size_t(batch) * q_dim);
      cache_two.poison(), cache_one.poison(), q_two.poison(), q_one.poison();
      for (int p = 0; p < 3; ++p)
        gemv_quant(*quant, m.raw[p], part_rows[p], n_in, d_x.p, d_qkv.p + m.row0[p], batch, nullptr, rows, unroll, norm);
      r.kv.base = cache_two.p;
      rope_qkv_store(d_qkv.p, r.bq, r.bk, r.bv, r.rope, r.st, r.kv, layer, q_two.p, nullptr);
      r.kv.base = cache_one.p, r.q_out = q_one.p;
      gemv_quant_rope_qkv(m, n_in, d_x.p, r, nullptr, unroll, norm);
      CHECK(std::memcmp(q_one.download().data(), q_two.download().data(), q_one.bytes()) == 0);
      CHECK(std::memcmp(cache_one.download().data(), cache_two.download().data(), cache_one.bytes()) == 0);
      // Not all the same bits by accident: the values are the quantized product's.
      const std::vector<float> q = from_bf16(q_one.download());
      CHECK(std::count_if(q.begin(), q.end(), [](float v) { return v != 0.0f && std::isfinite(v); }) > int(q.size()) / 2);
    }
    return;
  }
  for (const bool reader : {false, true}) {
    INFO("batch " << batch << " norm reader " << reader);
    gemv_norm norm;
    if (reader) norm.sumsq_in = d_sumsq.p, norm.eps = 1e-6f;
    dev_buf<fp16> cache_two(size_t(n_blocks * block_elems)), cache_one(size_t(n_blocks * block_elems));
    dev_buf<bf16> q_two(size_t(batch) * q_dim), q_one(size_t(batch) * q_dim);
    cache_two.poison(), cache_one.poison(), q_two.poison(), q_one.poison();
    gemv_bf16(d_w.p, rows, n_in, d_x.p, d_qkv.p, batch, nullptr, 0, norm);
    r.kv.base = cache_two.p, r.q_out = q_two.p;
    rope_qkv_store(d_qkv.p, r.bq, r.bk, r.bv, r.rope, r.st, r.kv, layer, q_two.p, nullptr);
    r.kv.base = cache_one.p, r.q_out = q_one.p;
    gemv_bf16_rope_qkv(d_w.p, n_in, d_x.p, r, nullptr, reader ? 512 : 0, norm);
    CHECK(std::memcmp(q_one.download().data(), q_two.download().data(), q_one.bytes()) == 0);
    CHECK(std::memcmp(cache_one.download().data(), cache_two.download().data(), cache_one.bytes()) == 0);
  }
}

}  // namespace

TEST_CASE("rope_qkv_store adds biases, rotates Q and K and writes the paged cache", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int hd : {64, 128})
    for (const int n_rot : {hd, hd / 2})
      for (const rope_kind kind : {rope_kind::normal, rope_kind::neox})
        for (const bool bias : {false, true})
          for (const bool freq : {false, true}) {
            INFO("head_dim " << hd << " n_rot " << n_rot << " neox " << (kind == rope_kind::neox) << " bias " << bias
                             << " freq " << freq);
            check_rope_qkv_store({hd, n_rot, kind, bias, freq}, g);
          }
}

TEST_CASE("rope_qkv_store with QK-norm (Gemma 3) normalizes each Q and K head before rotating it", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int hd : {256, 128})
    for (const bool bias : {false, true}) {
      INFO("head_dim " << hd << " bias " << bias);
      check_rope_qkv_store({hd, hd, rope_kind::neox, bias, false, true}, g);
    }
  // Without the norm, the rotation alone at head_dim 256 (Gemma's RoPE with no norm weights).
  check_rope_qkv_store({256, 256, rope_kind::neox, false, false}, g);
}

TEST_CASE("gemv_bf16_rope_qkv equals gemv_bf16 then rope_qkv_store bit for bit", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);
  const pdl_scope scope(pdl);
  for (const int hd : {64, 128})
    for (const int n_rot : {hd, hd / 2})
      for (const rope_kind kind : {rope_kind::normal, rope_kind::neox})
        for (const bool bias : {false, true})
          for (const int batch : {1, 3, 8}) {
            INFO("pdl " << pdl << " head_dim " << hd << " n_rot " << n_rot << " neox " << (kind == rope_kind::neox)
                        << " bias and freq factors " << bias);
            check_gemv_rope({hd, n_rot, kind, bias, bias}, batch, g);
          }
  dev_buf<bf16> w(size_t(16 * 64)), x(size_t(9 * 64));
  qkv_rope_args r;
  r.rope.n_heads = r.rope.n_kv_heads = 1, r.rope.head_dim = 4, r.rope.n_rot = 4;
  r.st.n_tokens = 9;  // more token rows than the GEMV's 8
  CHECK_THROWS_AS(gemv_bf16_rope_qkv(w.p, 64, x.p, r, nullptr), cuda_error);
  r.st.n_tokens = 1, r.rope.n_rot = 3;
  CHECK_THROWS_AS(gemv_bf16_rope_qkv(w.p, 64, x.p, r, nullptr), cuda_error);
  r.rope.n_rot = 4;
  dev_buf<float> f(size_t(16));
  gemv_norm writer;
  writer.residual = f.p, writer.norm_w = f.p, writer.sumsq_out = f.p;
  CHECK_THROWS_AS(gemv_bf16_rope_qkv(w.p, 64, x.p, r, nullptr, 0, writer), cuda_error);
}

TEST_CASE("gemv_quant_rope_qkv equals gemv_quant then rope_qkv_store bit for bit", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);
  const pdl_scope scope(pdl);
  for (const quant_type t : {quant_type::q8_0, quant_type::q4_0, quant_type::q4_1, quant_type::q4_k, quant_type::q5_k,
                             quant_type::q6_k})
    for (const int batch : {1, 3, 8}) {
      // Llama's rotation at head_dim 128 with biases and frequency factors; Qwen2's neox, a partial rotation.
      const rope_case c = batch == 3 ? rope_case{64, 32, rope_kind::neox, true, false} : rope_case{128, 128, rope_kind::normal, true, true};
      INFO("pdl " << pdl);
      check_gemv_rope(c, batch, g, &t);
    }
  dev_buf<uint8_t> w(quant_row_bytes(quant_type::q8_0, 64) * 12);
  dev_buf<bf16> x(size_t(9 * 64));
  quant_matrix m;
  m.qt = quant_type::q8_0, m.n_parts = 1, m.raw[0] = w.p;
  qkv_rope_args r;
  r.rope.n_heads = r.rope.n_kv_heads = 1, r.rope.head_dim = 4, r.rope.n_rot = 4;
  r.st.n_tokens = 9;  // more token rows than the GEMV's 8
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 64, x.p, r, nullptr), cuda_error);
  r.st.n_tokens = 1;
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 64, x.p, r, nullptr, 3), cuda_error);  // unroll 1, 4 or 8
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 48, x.p, r, nullptr), cuda_error);     // not whole blocks
  r.rope.n_rot = 3;
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 64, x.p, r, nullptr), cuda_error);
  r.rope.n_rot = 4;
  m.n_parts = 2, m.raw[1] = w.p, m.row0[1] = 12;  // a part starting past the matrix's 12 rows
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 64, x.p, r, nullptr), cuda_error);
  m.n_parts = 0;
  CHECK_THROWS_AS(gemv_quant_rope_qkv(m, 64, x.p, r, nullptr), cuda_error);
}
