#include "kernels/ops.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

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
  std::vector<float> out(n_heads * hd, NAN), scratch(n_pos);
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t pos = n_pos - 1;
  attention_row(Q.data(), n_heads, pos, kv, table, scale, out.data(), 0, n_heads, scratch.data());
  for (int h = 0; h < n_heads; ++h) {
    const int g = h / (n_heads / n_kv);
    std::vector<double> s(n_pos);
    double mx = -1e30, sum = 0;
    for (int p = 0; p < n_pos; ++p) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += (double)Q[h * hd + i] * fp16_to_f32(f32_to_fp16(K[p * row + g * hd + i]));
      s[p] = d * scale;
      mx = std::max(mx, s[p]);
    }
    for (auto& v : s) sum += (v = std::exp(v - mx));
    for (int i = 0; i < hd; ++i) {
      double o = 0;
      for (int p = 0; p < n_pos; ++p) o += s[p] / sum * fp16_to_f32(f32_to_fp16(V[p * row + g * hd + i]));
      REQUIRE(out[h * hd + i] == Approx(o).margin(1e-4));
    }
  }
}

TEST_CASE("swiglu is silu(gate) * up", "[ops]") {
  auto g = randn(37, 7), u = randn(37, 8), ref = g;
  swiglu(g.data(), u.data(), 37);
  for (int i = 0; i < 37; ++i) REQUIRE(g[i] == Approx(ref[i] / (1 + std::exp(-ref[i])) * u[i]).epsilon(1e-5));
}
