#include "kernels/ops.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/dequant.hpp"
#include "kernels/fp16.hpp"

using namespace troupe::kernels;

namespace {
std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
}  // namespace

TEST_CASE("rmsnorm matches the definition", "[ops]") {
  const int n = 577;
  auto x = randn(n, 1), w = randn(n, 2);
  std::vector<float> y(n);
  rmsnorm_row(x.data(), w.data(), y.data(), n, 1e-5f);
  double ss = 0;
  for (float v : x) ss += (double)v * v;
  const double s = 1.0 / std::sqrt(ss / n + 1e-5);
  for (int i = 0; i < n; ++i) REQUIRE(y[i] == Approx(x[i] * s * w[i]).epsilon(1e-5));
}

TEST_CASE("rope rotates the right pairs in both conventions", "[ops]") {
  const int n_heads = 2, hd = 8, n_rot = 6;  // partial rotation: dims 6, 7 untouched
  const int64_t pos = 7;
  const float base = 10000.0f;
  std::vector<float> cs(n_rot);
  rope_cos_sin(pos, n_rot, base, nullptr, cs.data());
  for (rope_style style : {rope_style::normal, rope_style::neox}) {
    auto x = randn(n_heads * hd, 3), ref = x;
    rope_row(x.data(), n_heads, hd, n_rot, cs.data(), style);
    for (int h = 0; h < n_heads; ++h)
      for (int i = 0; i < n_rot / 2; ++i) {
        const double th = pos * std::pow((double)base, -2.0 * i / n_rot);
        const int a = style == rope_style::normal ? 2 * i : i, b = style == rope_style::normal ? 2 * i + 1 : i + n_rot / 2;
        const double x0 = ref[h * hd + a], x1 = ref[h * hd + b];
        REQUIRE(x[h * hd + a] == Approx(x0 * std::cos(th) - x1 * std::sin(th)).margin(1e-5));
        REQUIRE(x[h * hd + b] == Approx(x0 * std::sin(th) + x1 * std::cos(th)).margin(1e-5));
      }
    for (int h = 0; h < n_heads; ++h)
      for (int i = n_rot; i < hd; ++i) REQUIRE(x[h * hd + i] == ref[h * hd + i]);
  }
}

namespace {

// Dense causal attention in double over the fp16-rounded K/V rows [0, n_pos): n_heads * hd values.
std::vector<double> dense_attention(const std::vector<float>& Q, const std::vector<float>& K, const std::vector<float>& V,
                                    int n_heads, int n_kv, int hd, int n_pos, double scale) {
  const int64_t row = (int64_t)n_kv * hd;
  std::vector<double> out((size_t)n_heads * hd, 0.0);
  for (int h = 0; h < n_heads; ++h) {
    const int g = h / (n_heads / n_kv);
    std::vector<double> s(n_pos);
    double mx = -1e300, sum = 0;
    for (int p = 0; p < n_pos; ++p) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += (double)Q[h * hd + i] * fp16_to_f32(f32_to_fp16(K[p * row + g * hd + i]));
      s[p] = d * scale;
      mx = std::max(mx, s[p]);
    }
    for (auto& v : s) sum += (v = std::exp(v - mx));
    for (int i = 0; i < hd; ++i)
      for (int p = 0; p < n_pos; ++p) out[h * hd + i] += s[p] / sum * fp16_to_f32(f32_to_fp16(V[p * row + g * hd + i]));
  }
  return out;
}

}  // namespace

TEST_CASE("paged attention equals dense causal attention over the same K/V", "[ops]") {
  const int hd = GENERATE(24, 32, 64, 128);  // generic path and each register-blocked size
  const int n_pos = GENERATE(1, 11, 40);      // under and over the 8-wide softmax loop
  const int n_heads = 6, n_kv = 2, bs = 4;
  const int n_blocks = 12;
  const int64_t row = n_kv * hd;
  // One layer, blocks laid out as kv_storage does: [block][K rows | V rows].
  std::vector<fp16_t> mem((size_t)n_blocks * 2 * bs * row);
  kv_layer_view kv{mem.data(), mem.data() + bs * row, 2 * bs * row, bs, n_kv, hd};
  const int32_t table[10] = {5, 1, 6, 11, 0, 3, 9, 2, 8, 7};  // scattered blocks
  auto K = randn(n_pos * row, 4), V = randn(n_pos * row, 5), Q = randn(n_heads * hd, 6);
  for (int p = 0; p < n_pos; ++p) kv_store_row(kv, table[p / bs], p % bs, &K[p * row], &V[p * row]);
  std::vector<float> out(n_heads * hd, NAN), scratch(attention_scratch_floats(n_heads, hd, n_pos));
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t pos = n_pos - 1;
  attention_row(Q.data(), n_heads, pos, kv, table, scale, out.data(), 0, n_heads, scratch.data());
  const std::vector<double> want = dense_attention(Q, K, V, n_heads, n_kv, hd, n_pos, scale);
  for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(want[i]).margin(1e-4));
}

TEST_CASE("attention split into parts and merged equals dense attention, for any head grouping", "[ops]") {
  // Query heads per KV head 1, 3, 4, 7 (two sub-groups: 4 + 3) and 8 (4 + 4); head dims on the
  // generic path (20), one cache line (32), 64, 80 (a short last line) and 128.
  const auto [n_heads, n_kv] = GENERATE(std::pair(4, 4), std::pair(6, 2), std::pair(8, 2), std::pair(14, 2), std::pair(16, 2));
  const int hd = GENERATE(20, 32, 64, 80, 128);
  const bool head_major = GENERATE(false, true);  // the CUDA cache's rows, engine::kv_storage's
  const int bs = 16, n_pos = 77, n_blocks = 6;
  const int64_t row = (int64_t)n_kv * hd;
  std::vector<fp16_t> mem((size_t)n_blocks * 2 * bs * row);
  kv_layer_view kv{mem.data(), mem.data() + bs * row, 2 * bs * row, bs, n_kv, hd};
  if (head_major) {
    kv.slot_stride = hd;
    kv.head_stride = (int64_t)bs * hd;
  }
  const int32_t table[5] = {3, 0, 5, 1, 4};
  auto K = randn(n_pos * row, 11), V = randn(n_pos * row, 12), Q = randn((size_t)n_heads * hd, 13);
  for (int p = 0; p < n_pos; ++p) kv_store_row(kv, table[p / bs], p % bs, &K[p * row], &V[p * row]);
  const float scale = 1.0f / std::sqrt((float)hd);
  const std::vector<double> want = dense_attention(Q, K, V, n_heads, n_kv, hd, n_pos, scale);
  INFO("heads " << n_heads << "/" << n_kv << ", head_dim " << hd << (head_major ? ", head-major" : ", slot-major"));

  // Parts that start and end inside blocks, of 1, 3 and 5 positions, and across blocks.
  const std::vector<int64_t> cuts = {0, 1, 4, 5, 18, 21, 48, 77};
  const int n_parts = (int)cuts.size() - 1;
  std::vector<float> m((size_t)n_parts * n_heads, NAN), l(m), acc((size_t)n_parts * n_heads * hd, NAN);
  std::vector<float> scratch(attention_scratch_floats(n_heads, hd, n_pos), NAN);
  for (int i = 0; i < n_parts; ++i)
    attention_partial(Q.data(), n_heads, cuts[i], cuts[i + 1], kv, table, scale, 0, n_heads, &m[(size_t)i * n_heads],
                      &l[(size_t)i * n_heads], &acc[(size_t)i * n_heads * hd], scratch.data());
  std::vector<float> out((size_t)n_heads * hd, NAN);
  attention_merge(n_parts, n_heads, hd, m.data(), l.data(), acc.data(), out.data());
  for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(want[i]).margin(1e-4));

  // One part over everything, for a range of heads that starts and ends inside KV-head groups.
  const int h0 = 1, h1 = n_heads - 1;
  std::vector<float> row_out((size_t)n_heads * hd, NAN);
  attention_row(Q.data(), n_heads, n_pos - 1, kv, table, scale, row_out.data(), h0, h1, scratch.data());
  for (int h = 0; h < n_heads; ++h)
    for (int i = 0; i < hd; ++i) {
      const float v = row_out[(size_t)h * hd + i];
      if (h < h0 || h >= h1) REQUIRE(std::isnan(v));  // other heads untouched
      else REQUIRE(v == Approx(want[(size_t)h * hd + i]).margin(1e-4));
    }
}

TEST_CASE("swiglu is silu(gate) * up", "[ops]") {
  auto g = randn(37, 7), u = randn(37, 8), ref = g;
  swiglu(g.data(), u.data(), 37);
  for (int i = 0; i < 37; ++i) REQUIRE(g[i] == Approx(ref[i] / (1 + std::exp(-ref[i])) * u[i]).epsilon(1e-5));
}

TEST_CASE("geglu is gelu_tanh(gate) * up, for large and tiny gates of either sign", "[ops]") {
  auto g = randn(1003, 9), u = randn(1003, 10);
  for (int i = 0; i < 1003; i += 7) g[(size_t)i] *= 40;  // deep in both tails: tanh saturates
  g[3] = 0, g[4] = -0.0f, g[5] = 1e-30f, g[6] = -90.0f, g[8] = 90.0f;
  auto ref = g;
  geglu(g.data(), u.data(), 1003);
  for (int i = 0; i < 1003; ++i) {
    const double x = ref[(size_t)i];
    // 0.5 x (1 + tanh(v)) as x / (1 + exp(-2v)): in the far negative tail 1 + tanh(v) rounds to 0.
    const double v = std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x);
    const double want = x / (1 + std::exp(-2 * v)) * u[(size_t)i];
    INFO("i=" << i << " x=" << x << " got=" << (double)g[(size_t)i] << " want=" << want);
    REQUIRE(g[(size_t)i] == Approx(want).epsilon(1e-5).margin(1e-30));
  }
}

TEST_CASE("q5_0 blocks repacked as q8_0 keep every weight exactly", "[kernels][quant]") {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<troupe::kernels::block_q5_0> q5(64);
  for (auto& b : q5) {
    auto* p = reinterpret_cast<uint8_t*>(&b);
    for (size_t i = 0; i < sizeof b; ++i) p[i] = (uint8_t)byte(rng);
    b.d = troupe::kernels::f32_to_fp16(std::normal_distribution<float>(0.0f, 0.05f)(rng));
  }
  std::vector<troupe::kernels::block_q8_0> q8(q5.size());
  troupe::kernels::repack_q5_0_to_q8_0(q5.data(), q8.data(), (int64_t)q5.size());
  std::vector<float> a(q5.size() * 32), b(a.size());
  troupe::kernels::dequantize_row(troupe::kernels::dtype::q5_0, q5.data(), a.data(), (int64_t)a.size());
  troupe::kernels::dequantize_row(troupe::kernels::dtype::q8_0, q8.data(), b.data(), (int64_t)b.size());
  REQUIRE(a == b);
  int lo = 0, hi = 0;  // every 5-bit value reached, -16 and 15 among them
  for (const auto& blk : q8)
    for (int8_t v : blk.qs) lo = std::min<int>(lo, v), hi = std::max<int>(hi, v);
  CHECK(lo == -16);
  CHECK(hi == 15);
}
