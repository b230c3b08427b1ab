// Quantized GEMV and block expansion against kernels::dequantize_row: random GGUF blocks (random
// quants and scale bytes, finite scales), batches 1..8, row counts that do not fill the last
// thread block. The bf16 GEMVs against the host, and their fused forms (SwiGLU, the folded
// residual add + RMSNorm) against the unfused kernels; so the quantized SwiGLU GEMV (the RoPE ones:
// ops.test.cpp).
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/test_util.hpp"
#include "kernels/dequant.hpp"
#include "kernels/fp16.hpp"

using namespace troupe::kernels::cuda;
using namespace troupe::kernels::cuda::test;
namespace cpu = troupe::kernels;

namespace {

struct type_info {
  quant_type t;
  cpu::dtype dt;
  int block_values, block_bytes;
};

const type_info types[] = {
    {quant_type::q8_0, cpu::dtype::q8_0, 32, int(sizeof(cpu::block_q8_0))},
    {quant_type::q4_0, cpu::dtype::q4_0, 32, int(sizeof(cpu::block_q4_0))},
    {quant_type::q4_1, cpu::dtype::q4_1, 32, int(sizeof(cpu::block_q4_1))},  // the default model's type
    {quant_type::q4_k, cpu::dtype::q4_k, 256, int(sizeof(cpu::block_q4_k))},
    {quant_type::q5_k, cpu::dtype::q5_k, 256, int(sizeof(cpu::block_q5_k))},
    {quant_type::q6_k, cpu::dtype::q6_k, 256, int(sizeof(cpu::block_q6_k))},  // Q4_K_M's attn_v / ffn_down mix
};

/// Bytes of n values of ti's blocks.
size_t kc_row_bytes(const type_info& ti, int64_t n) { return size_t(n / ti.block_values * ti.block_bytes); }

/// Byte offsets of a block's fp16 scales: d first, then q4_1's m or the k-quants' dmin; q6_k's d
/// is its last two bytes.
std::vector<int> scale_offsets(quant_type t) {
  switch (t) {
    case quant_type::q4_1:
    case quant_type::q4_k:
    case quant_type::q5_k: return {0, 2};
    case quant_type::q6_k: return {int(offsetof(cpu::block_q6_k, d))};
    default: return {0};
  }
}

/// n_blocks random blocks: every byte random except the fp16 scales, small and finite, of either
/// sign (ggml's q4_0 quantizer stores d = max / -8, negative for a positive extreme).
std::vector<uint8_t> random_blocks(const type_info& ti, int64_t n_blocks, std::mt19937_64& g) {
  std::vector<uint8_t> raw(size_t(n_blocks * ti.block_bytes));
  for (auto& b : raw) b = uint8_t(g());
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    uint8_t* blk = &raw[size_t(b * ti.block_bytes)];
    for (const int at : scale_offsets(ti.t)) {
      const uint16_t h = cpu::f32_to_fp16((g() & 1) ? scale(g) : -scale(g));
      std::memcpy(blk + at, &h, 2);
    }
  }
  return raw;
}

/// y[b, o] = sum_i w[o, i] x[b, i] in double precision.
std::vector<float> reference_gemv(const std::vector<float>& w, const std::vector<float>& x, int batch, int64_t n_out,
                                  int64_t n_in) {
  std::vector<float> y(size_t(batch * n_out));
  for (int b = 0; b < batch; ++b)
    for (int64_t o = 0; o < n_out; ++o) {
      double s = 0.0;
      for (int64_t i = 0; i < n_in; ++i) s += double(w[size_t(o * n_in + i)]) * x[size_t(b * n_in + i)];
      y[size_t(b * n_out + o)] = float(s);
    }
  return y;
}

/// |w| |x| summed per output: what rounding the products' inputs can move each output by, in
/// units of the rounding's relative size.
std::vector<float> reference_gemv_abs(const std::vector<float>& w, const std::vector<float>& x, int batch, int64_t n_out,
                                      int64_t n_in) {
  std::vector<float> wa(w.size()), xa(x.size());
  std::transform(w.begin(), w.end(), wa.begin(), [](float v) { return std::fabs(v); });
  std::transform(x.begin(), x.end(), xa.begin(), [](float v) { return std::fabs(v); });
  return reference_gemv(wa, xa, batch, n_out, n_in);
}

/// The worst of |got - want| / (rel * max |want| + 2^-7 * slack) over the outputs: within 1 when
/// each output is off by at most a fraction rel of the largest, plus what bf16-rounded inputs can
/// move it by, 2^-8 of its slack (sum |w| |x|) for two roundings (2x margin). Where outputs are few
/// their largest can be tiny by cancellation, and rel alone would fail a correct kernel.
double gemv_error(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& slack,
                  double rel) {
  if (got.size() != want.size() || got.size() != slack.size()) return INFINITY;
  double top = 0.0, worst = 0.0;
  for (const float v : want) top = std::max(top, std::fabs(double(v)));
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(double(got[i]) - double(want[i]));
    worst = std::isnan(e) ? INFINITY : std::max(worst, e / (rel * top + std::ldexp(double(slack[i]), -7) + 1e-30));
  }
  return worst;
}

/// A gemv_norm writer's outputs against the host, from the residual r it left (batch rows of d):
/// x * gain (xg) bit for bit and the partial sums of squares (ss) within 1e-6. Returns each batch
/// row's exact RMSNorm scale, 1 / sqrt(mean r^2 + eps), for the reader behind it.
std::vector<double> check_norm_writer(const std::vector<float>& r, const std::vector<float>& gain, const std::vector<bf16>& xg,
                                      const std::vector<float>& ss, int batch, int64_t d, float eps) {
  const int64_t parts = norm_fold_parts(d);
  std::vector<float> want_xg(size_t(batch * d)), want_ss(size_t(batch * parts), 0.0f);
  std::vector<double> scale(size_t(batch), 0.0);
  for (int b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < d; ++i) {
      const float v = r[size_t(b * d + i)];
      want_xg[size_t(b * d + i)] = v * gain[size_t(i)];
      want_ss[size_t(b * parts + i / 4)] += v * v;
      scale[size_t(b)] += double(v) * v;
    }
    scale[size_t(b)] = 1.0 / std::sqrt(scale[size_t(b)] / double(d) + eps);
  }
  CHECK(std::memcmp(to_bf16(want_xg).data(), xg.data(), xg.size() * sizeof(bf16)) == 0);
  double ss_err = 0.0;
  for (size_t i = 0; i < ss.size(); ++i) ss_err = std::max(ss_err, std::fabs(double(ss[i]) - want_ss[i]) / (1e-30 + want_ss[i]));
  CHECK(ss_err <= 1e-6);
  return scale;
}

}  // namespace

TEST_CASE("gemv_quant matches dequantized weights times bf16 activations", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const auto& ti : types) {
    for (const int64_t n_out : {int64_t{1003}, int64_t{3}}) {  // 3: fewer rows than one thread block
      // 9 units of 8 weights a lane and a bit: unrolled by 4 and 8, a main loop and a tail
      const int64_t n_in = ti.block_values == 256 ? 2304 : 2336;
      const int64_t row_blocks = n_in / ti.block_values;
      const auto raw = random_blocks(ti, n_out * row_blocks, g);
      std::vector<float> w(size_t(n_out * n_in));
      for (int64_t o = 0; o < n_out; ++o)
        cpu::dequantize_row(ti.dt, &raw[size_t(o * row_blocks * ti.block_bytes)], &w[size_t(o * n_in)], n_in);
      dev_buf<uint8_t> d_w(raw);
      for (const int batch : {1, 3, 8}) {
        const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
        dev_buf<bf16> d_x(to_bf16(x)), d_y(size_t(batch * n_out));
        d_y.poison();
        gemv_quant(ti.t, d_w.p, n_out, n_in, d_x.p, d_y.p, batch, nullptr);
        const std::vector<float> want = reference_gemv(w, x, batch, n_out, n_in);
        INFO("type " << int(ti.t) << " n_out " << n_out << " batch " << batch);
        const std::vector<float> got = from_bf16(d_y.download());
        CHECK(normalized_error(got, want) <= 1e-2);
        // fp32 outputs (the output head's logits): the same sums, before their rounding to bf16.
        dev_buf<float> d_y32(size_t(batch * n_out));
        d_y32.poison();
        gemv_quant_f32(ti.t, d_w.p, n_out, n_in, d_x.p, d_y32.p, batch, nullptr);
        const std::vector<float> got32 = d_y32.download();
        CHECK(round_bf16(got32) == got);
        CHECK(normalized_error(got32, want) <= 1e-4);
        // Loads of 4 or 8 units in flight a lane: the same sums in the same order.
        for (const int unroll : {4, 8}) {
          d_y32.poison();
          gemv_quant_f32(ti.t, d_w.p, n_out, n_in, d_x.p, d_y32.p, batch, nullptr, 0, unroll);
          INFO("unroll " << unroll);
          CHECK(d_y32.download() == got32);
        }
      }
    }
  }
}

TEST_CASE("gemv_bf16 matches bf16 weights times bf16 activations", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const int64_t n_out : {int64_t{1003}, int64_t{3}}) {   // 3: fewer rows than one thread block
    for (const int64_t n_in : {int64_t{4096}, int64_t{1032}, int64_t{8}}) {  // 1032, 8: the loop's ragged tail
      const auto w = round_bf16(random_floats(size_t(n_out * n_in), g));
      dev_buf<bf16> d_w(to_bf16(w));
      for (const int batch : {1, 3, 8}) {
        const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
        dev_buf<bf16> d_x(to_bf16(x)), d_y(size_t(batch * n_out));
        d_y.poison();
        gemv_bf16(d_w.p, n_out, n_in, d_x.p, d_y.p, batch, nullptr);
        const std::vector<float> want = reference_gemv(w, x, batch, n_out, n_in);
        INFO("n_out " << n_out << " n_in " << n_in << " batch " << batch);
        CHECK(normalized_error(from_bf16(d_y.download()), want) <= 1e-2);
      }
    }
  }
  dev_buf<bf16> w(size_t(64)), x(size_t(9 * 16)), y(size_t(9 * 4));
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 16, x.p, y.p, 9, nullptr), cuda_error);  // batch > 8
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 12, x.p, y.p, 1, nullptr), cuda_error);  // n_in % 8
}

TEST_CASE("gemv_bf16_swiglu equals gemv_bf16 then swiglu bit for bit", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);  // plain launches, and the ones the forward makes
  const pdl_scope scope(pdl);
  // d_ff 1003: an odd count, the last CTA half idle; 1: one CTA; n_in 1032: the ragged tail.
  const int64_t shapes[][2] = {{1003, 4096}, {1, 1032}, {64, 8}};
  for (const auto& sh : shapes) {
    const int64_t d_ff = sh[0], n_in = sh[1];
    const auto w = round_bf16(random_floats(size_t(2 * d_ff * n_in), g));
    dev_buf<bf16> d_w(to_bf16(w));
    for (const int batch : {1, 2, 8}) {
      const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
      dev_buf<bf16> d_x(to_bf16(x)), d_gu(size_t(batch * 2 * d_ff)), d_two(size_t(batch * d_ff)), d_one(size_t(batch * d_ff));
      d_two.poison();
      d_one.poison();
      gemv_bf16(d_w.p, 2 * d_ff, n_in, d_x.p, d_gu.p, batch, nullptr);
      swiglu(d_gu.p, d_two.p, batch, int(d_ff), nullptr);
      gemv_bf16_swiglu(d_w.p, d_ff, n_in, d_x.p, d_one.p, batch, nullptr);
      const std::vector<bf16> one = d_one.download(), two = d_two.download();
      INFO("pdl " << pdl << " d_ff " << d_ff << " n_in " << n_in << " batch " << batch);
      CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(bf16)) == 0);
      // With the L2 prefetch (more bytes than a row has, and fewer): the same bits, both kernels.
      for (const int prefetch : {1 << 20, 200}) {
        d_one.poison();
        gemv_bf16_swiglu(d_w.p, d_ff, n_in, d_x.p, d_one.p, batch, nullptr, prefetch);
        CHECK(std::memcmp(d_one.download().data(), one.data(), one.size() * sizeof(bf16)) == 0);
        dev_buf<bf16> d_gu2(d_gu.n);
        d_gu2.poison();
        gemv_bf16(d_w.p, 2 * d_ff, n_in, d_x.p, d_gu2.p, batch, nullptr, prefetch);
        CHECK(std::memcmp(d_gu2.download().data(), d_gu.download().data(), d_gu.bytes()) == 0);
      }
      // And against the host: silu(gate) * up from the fp32 reference products, within 2e-2 of
      // the largest plus what float summation (2^-12 of sum |w x| over 4096 terms) moves gate and
      // up by, times the other factor and silu's slope (at most 1.1). With d_ff 1 a single output,
      // near zero by cancellation in its gate, failed 2e-2 of the largest alone.
      const std::vector<float> gu = reference_gemv(w, x, batch, 2 * d_ff, n_in);
      const std::vector<float> gu_abs = reference_gemv_abs(w, x, batch, 2 * d_ff, n_in);
      std::vector<float> want(size_t(batch * d_ff)), slack(want.size());
      for (int b = 0; b < batch; ++b)
        for (int64_t j = 0; j < d_ff; ++j) {
          const size_t gi = size_t(b * 2 * d_ff + j), ui = gi + size_t(d_ff);
          const double gate = gu[gi], up = gu[ui], silu = gate / (1.0 + std::exp(-gate));
          want[size_t(b * d_ff + j)] = float(silu * up);
          // gemv_error allows 2^-7 of the slack: 2^-12 of the sums.
          slack[size_t(b * d_ff + j)] = float(std::ldexp(1.1 * std::fabs(up) * gu_abs[gi] + std::fabs(silu) * gu_abs[ui], -5));
        }
      CHECK(gemv_error(from_bf16(one), want, slack, 2e-2) <= 1.0);
    }
  }
  dev_buf<bf16> w(size_t(64)), x(size_t(9 * 16)), y(size_t(9 * 2));
  CHECK_THROWS_AS(gemv_bf16_swiglu(w.p, 2, 16, x.p, y.p, 9, nullptr), cuda_error);  // batch > 8
  CHECK_THROWS_AS(gemv_bf16_swiglu(w.p, 2, 12, x.p, y.p, 1, nullptr), cuda_error);  // n_in % 8
  CHECK_THROWS_AS(gemv_bf16_swiglu(w.p, 2, 16, x.p, y.p, 1, nullptr, -1), cuda_error);
  CHECK_THROWS_AS(gemv_bf16(w.p, 2, 16, x.p, y.p, 1, nullptr, -1), cuda_error);
}

TEST_CASE("gemv_quant_swiglu equals gemv_quant then swiglu bit for bit", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);
  const pdl_scope scope(pdl);
  for (const auto& ti : types) {
    // 9 units of 8 weights a lane and a bit (the unrolled loops' tails); d_ff 37: the last CTA half idle.
    const int64_t n_in = ti.block_values == 256 ? 2304 : 2336, row_blocks = n_in / ti.block_values;
    for (const int64_t d_ff : {int64_t{37}, int64_t{1}}) {
      const auto raw = random_blocks(ti, 2 * d_ff * row_blocks, g);
      const size_t half = raw.size() / 2;
      // Gate and up in one allocation (one part), and apart (two parts, as gate and up tensors load).
      dev_buf<uint8_t> d_w(raw), d_gate(std::vector<uint8_t>(raw.begin(), raw.begin() + long(half))),
          d_up(std::vector<uint8_t>(raw.begin() + long(half), raw.end()));
      quant_matrix one, two;
      one.qt = two.qt = ti.t;
      one.n_parts = 1, one.raw[0] = d_w.p;
      two.n_parts = 2, two.raw[0] = d_gate.p, two.raw[1] = d_up.p, two.row0[1] = d_ff;
      for (const int batch : {1, 3, 8}) {
        const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
        dev_buf<bf16> d_x(to_bf16(x)), d_gu(size_t(batch * 2 * d_ff)), d_want(size_t(batch * d_ff)), d_got(size_t(batch * d_ff));
        d_want.poison();
        gemv_quant(ti.t, d_w.p, 2 * d_ff, n_in, d_x.p, d_gu.p, batch, nullptr);
        swiglu(d_gu.p, d_want.p, batch, int(d_ff), nullptr);
        const std::vector<bf16> want = d_want.download();
        // The unfused pair's values are the product's: against the CPU dequantization.
        std::vector<float> w(size_t(2 * d_ff * n_in));
        for (int64_t o = 0; o < 2 * d_ff; ++o)
          cpu::dequantize_row(ti.dt, &raw[size_t(o * row_blocks * ti.block_bytes)], &w[size_t(o * n_in)], n_in);
        INFO("type " << int(ti.t) << " d_ff " << d_ff << " batch " << batch << " pdl " << pdl);
        CHECK(normalized_error(from_bf16(d_gu.download()), reference_gemv(w, x, batch, 2 * d_ff, n_in)) <= 1e-2);
        for (const quant_matrix* m : {&one, &two})
          for (const int unroll : {1, 4, 8}) {
            INFO("parts " << m->n_parts << " unroll " << unroll);
            d_got.poison();
            gemv_quant_swiglu(*m, d_ff, n_in, d_x.p, d_got.p, batch, nullptr, unroll);
            CHECK(std::memcmp(d_got.download().data(), want.data(), want.size() * sizeof(bf16)) == 0);
          }
      }
    }
  }
  dev_buf<uint8_t> w(quant_row_bytes(quant_type::q4_k, 256) * 4);
  dev_buf<bf16> x(size_t(9 * 256)), act(size_t(9 * 2));
  quant_matrix m;
  m.qt = quant_type::q4_k, m.n_parts = 1, m.raw[0] = w.p;
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 256, x.p, act.p, 9, nullptr), cuda_error);     // batch > 8
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 128, x.p, act.p, 1, nullptr), cuda_error);     // not whole q4_k blocks
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 256, x.p, act.p, 1, nullptr, 2), cuda_error);  // unroll 1, 4 or 8
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 256, x.p, x.p + 8, 1, nullptr), cuda_error);  // act inside x
  m.raw[0] = w.p + 1;  // q4_k reads 32-bit words
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 256, x.p, act.p, 1, nullptr), cuda_error);
  m.raw[0] = w.p, m.n_parts = 2, m.raw[1] = w.p, m.row0[1] = 0;  // parts must start at increasing rows
  CHECK_THROWS_AS(gemv_quant_swiglu(m, 2, 256, x.p, act.p, 1, nullptr), cuda_error);
}

TEST_CASE("gemv_quant with the residual add and RMSNorm folded in (gemv_norm): writer bits, reader scale, fused readers' bits", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);
  const pdl_scope scope(pdl);
  const float eps = 1e-5f;
  for (const auto& ti : types) {
    // {d, writer inputs k}: a reader behind (d whole blocks); a writer whose last CTA has one row.
    const int64_t shapes[][2] = {{512, 512}, {37, 256}};
    for (const auto& sh : shapes) {
      const int64_t d = sh[0], k = sh[1], m = 13, parts = norm_fold_parts(d);
      const bool has_reader = d % ti.block_values == 0;
      const auto raw1 = random_blocks(ti, d * (k / ti.block_values), g);
      const auto raw2 = has_reader ? random_blocks(ti, 2 * m * (d / ti.block_values), g) : std::vector<uint8_t>{};
      dev_buf<uint8_t> d_w1(raw1), d_w2(has_reader ? raw2 : std::vector<uint8_t>(2));
      const auto gain = random_floats(size_t(d), g, 0.5f, 1.5f);
      dev_buf<float> d_gain(gain);
      for (const int batch : {1, 3, 8})
        for (const int unroll : {1, 8}) {
          INFO("type " << int(ti.t) << " pdl " << pdl << " d " << d << " batch " << batch << " unroll " << unroll);
          const auto a = round_bf16(random_floats(size_t(batch * k), g));
          auto r0 = random_floats(size_t(batch * d), g, -4.0f, 4.0f);
          for (int b = 0; b < batch; ++b)  // each batch row at its own scale: a reader of another row's sums is off
            for (int64_t i = 0; i < d; ++i) r0[size_t(b * d + i)] *= 0.5f * float(b + 1);
          dev_buf<bf16> d_a(to_bf16(a));
          const size_t bd = size_t(batch * d);
          // Unfused: the plain GEMV, then add_rmsnorm's residual update.
          dev_buf<float> d_r_ref(r0);
          dev_buf<bf16> d_y(bd), d_h(bd);
          gemv_quant(ti.t, d_w1.p, d, k, d_a.p, d_y.p, batch, nullptr, 0, unroll);
          add_rmsnorm(d_r_ref.p, d_y.p, d_gain.p, d_h.p, batch, int(d), eps, nullptr);
          // The writer: the same residual bits, x * gain, the partial sums of squares.
          dev_buf<float> d_r(r0), d_ss(size_t(batch * parts));
          dev_buf<bf16> d_xg(bd);
          d_xg.poison();
          d_ss.poison();
          gemv_norm writer;
          writer.residual = d_r.p, writer.norm_w = d_gain.p, writer.sumsq_out = d_ss.p;
          gemv_quant(ti.t, d_w1.p, d, k, d_a.p, d_xg.p, batch, nullptr, 0, unroll, writer);
          const std::vector<float> r = d_r.download();
          CHECK(std::memcmp(r.data(), d_r_ref.download().data(), d_r.bytes()) == 0);
          const std::vector<double> scale = check_norm_writer(r, gain, d_xg.download(), d_ss.download(), batch, d, eps);
          if (!has_reader) continue;
          // The reader: each unscaled sum (gemv_quant_f32 of the same input) times its row's norm
          // scale, rounded to bf16 (the device sums the partials in another order: a bf16 step of slack).
          gemv_norm reader;
          reader.sumsq_in = d_ss.p, reader.eps = eps;
          dev_buf<bf16> d_gu(size_t(batch * 2 * m));
          dev_buf<float> d_gu32(size_t(batch * 2 * m));
          d_gu.poison();
          gemv_quant(ti.t, d_w2.p, 2 * m, d, d_xg.p, d_gu.p, batch, nullptr, 0, unroll, reader);
          gemv_quant_f32(ti.t, d_w2.p, 2 * m, d, d_xg.p, d_gu32.p, batch, nullptr, 0, unroll);
          const std::vector<float> gu = from_bf16(d_gu.download()), plain = d_gu32.download();
          double worst = 0.0;
          for (int b = 0; b < batch; ++b)
            for (int64_t o = 0; o < 2 * m; ++o) {
              const size_t i = size_t(b * 2 * m + o);
              const double want = double(plain[i]) * scale[size_t(b)];
              worst = std::max(worst, std::fabs(gu[i] - want) / (std::ldexp(std::fabs(want), -7) + 1e-30));
            }
          CHECK(worst <= 1.0);
          // The SwiGLU GEMV as a reader: the bits of the reader gemv_quant, then swiglu.
          dev_buf<bf16> d_two(size_t(batch * m)), d_one(size_t(batch * m));
          d_one.poison();
          swiglu(d_gu.p, d_two.p, batch, int(m), nullptr);
          quant_matrix qm;
          qm.qt = ti.t, qm.n_parts = 1, qm.raw[0] = d_w2.p;
          gemv_quant_swiglu(qm, m, d, d_xg.p, d_one.p, batch, nullptr, unroll, reader);
          CHECK(std::memcmp(d_one.download().data(), d_two.download().data(), d_one.bytes()) == 0);
        }
    }
  }
  dev_buf<uint8_t> w(quant_row_bytes(quant_type::q8_0, 32) * 8);
  dev_buf<bf16> x(size_t(32)), y(size_t(16));
  dev_buf<float> f(size_t(16)), sums(size_t(8));
  gemv_norm writer;
  writer.residual = f.p, writer.norm_w = f.p, writer.sumsq_out = sums.p;
  gemv_norm both = writer;
  both.sumsq_in = sums.p + 4;
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 4, 32, x.p, y.p, 1, nullptr, 0, 1, both), cuda_error);  // writer and reader
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 4, 32, x.p, y.p, 1, nullptr, 8, 1, writer), cuda_error);  // a writer's ldy
  gemv_norm no_gain = writer;
  no_gain.norm_w = nullptr;
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 4, 32, x.p, y.p, 1, nullptr, 0, 1, no_gain), cuda_error);
  quant_matrix qm;
  qm.qt = quant_type::q8_0, qm.n_parts = 1, qm.raw[0] = w.p;
  CHECK_THROWS_AS(gemv_quant_swiglu(qm, 4, 32, x.p, y.p, 1, nullptr, 1, writer), cuda_error);
  CHECK_NOTHROW(gemv_quant(quant_type::q8_0, w.p, 4, 32, x.p, y.p, 1, nullptr, 0, 1, writer));
  check(cudaDeviceSynchronize(), "gemv_quant");
}

TEST_CASE("gemv_bf16 with the residual add and RMSNorm folded in (gemv_norm) against add_rmsnorm and the host", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const bool pdl = GENERATE(false, true);
  const pdl_scope scope(pdl);
  const float eps = 1e-5f;
  // {d, writer inputs k, reader outputs m}: Llama-3-8B's d; a ragged reader; one CTA; a writer
  // whose last CTA has two rows (d = 1030: no reader, whose inputs are a multiple of 8); 1,028
  // partial sums a row (the reader's 16-byte loads past one full trip; 1032's 258 take 4-byte ones).
  const int64_t shapes[][3] = {{4096, 1024, 1003}, {1032, 520, 129}, {8, 16, 5}, {1030, 520, 5}, {4112, 64, 37}};
  for (const auto& sh : shapes) {
    const int64_t d = sh[0], k = sh[1], m = sh[2], parts = norm_fold_parts(d);
    const auto w1 = round_bf16(random_floats(size_t(d * k), g)), w2 = round_bf16(random_floats(size_t(m * d), g));
    const auto w3 = round_bf16(random_floats(size_t(2 * m * d), g)), w4 = round_bf16(random_floats(size_t(d * d), g));
    const auto gain = random_floats(size_t(d), g, 0.5f, 1.5f);
    dev_buf<bf16> d_w1(to_bf16(w1)), d_w2(to_bf16(w2)), d_w3(to_bf16(w3)), d_w4(to_bf16(w4));
    dev_buf<float> d_gain(gain);
    for (const int batch : {1, 2, 8}) {
      INFO("pdl " << pdl << " d " << d << " k " << k << " m " << m << " batch " << batch);
      const auto a = round_bf16(random_floats(size_t(batch * k), g));
      // Each batch row's residual at its own scale (x 0.5 to x 4), so a reader that took another
      // row's sums of squares would be off by a factor of 1.5 or more.
      // The last 16 positions of a row at 8 times the rest: a fifth of its sum of squares (d = 4096),
      // so a reader that drops the last partial sums is off by more than bf16 rounding.
      auto r0 = random_floats(size_t(batch * d), g, -4.0f, 4.0f);
      for (int b = 0; b < batch; ++b)
        for (int64_t i = 0; i < d; ++i) r0[size_t(b * d + i)] *= 0.5f * float(b + 1) * (i >= d - 16 ? 8.0f : 1.0f);
      dev_buf<bf16> d_a(to_bf16(a));
      const size_t bd = size_t(batch * d), bm = size_t(batch * m);

      // Unfused: the writer's GEMV, add_rmsnorm, the reader's GEMV.
      dev_buf<float> d_r_ref(r0);
      dev_buf<bf16> d_y(bd), d_h(bd), d_out_ref(bm);
      gemv_bf16(d_w1.p, d, k, d_a.p, d_y.p, batch, nullptr);
      add_rmsnorm(d_r_ref.p, d_y.p, d_gain.p, d_h.p, batch, int(d), eps, nullptr);
      const bool has_reader = d % 8 == 0;
      if (has_reader) gemv_bf16(d_w2.p, m, d, d_h.p, d_out_ref.p, batch, nullptr);

      // Folded: the writer leaves the residual (the same bits), x * gain and the partial sums.
      dev_buf<float> d_r(r0), d_ss(size_t(batch * parts));
      dev_buf<bf16> d_xg(bd), d_out(bm);
      d_xg.poison();
      d_ss.poison();
      d_out.poison();
      gemv_norm writer;
      writer.residual = d_r.p, writer.norm_w = d_gain.p, writer.sumsq_out = d_ss.p;
      gemv_bf16(d_w1.p, d, k, d_a.p, d_xg.p, batch, nullptr, 0, writer);
      const std::vector<float> r = d_r.download();
      CHECK(std::memcmp(r.data(), d_r_ref.download().data(), d_r.bytes()) == 0);
      const std::vector<double> scale = check_norm_writer(r, gain, d_xg.download(), d_ss.download(), batch, d, eps);
      if (!has_reader) continue;

      // The reader against the host's exact norm and the unfused path.
      gemv_norm reader;
      reader.sumsq_in = d_ss.p, reader.eps = eps;
      gemv_bf16(d_w2.p, m, d, d_xg.p, d_out.p, batch, nullptr, 0, reader);
      std::vector<float> normed(bd);
      for (int b = 0; b < batch; ++b)
        for (int64_t i = 0; i < d; ++i)
          normed[size_t(b * d + i)] = float(double(r[size_t(b * d + i)]) * scale[size_t(b)] * gain[size_t(i)]);
      const std::vector<float> want = reference_gemv(w2, normed, batch, m, d), out = from_bf16(d_out.download());
      // Folded and unfused round different things to bf16 (x * gain, the normed input): allowed
      // their rounding's share of sum |w| |x| per output besides 1e-2 of the largest (gemv_error).
      const std::vector<float> abs_sums = reference_gemv_abs(w2, normed, batch, m, d);
      CHECK(gemv_error(out, want, abs_sums, 1e-2) <= 1.0);
      CHECK(gemv_error(from_bf16(d_out_ref.download()), want, abs_sums, 1e-2) <= 1.0);
      CHECK(gemv_error(out, from_bf16(d_out_ref.download()), abs_sums, 1e-2) <= 1.0);

      // Reader and writer in one launch: the reader's rounded products added to the residual.
      dev_buf<bf16> d_p(bd), d_xg2(bd);
      dev_buf<float> d_r2(r), d_ss2(size_t(batch * parts));
      gemv_bf16(d_w4.p, d, d, d_xg.p, d_p.p, batch, nullptr, 0, reader);
      gemv_norm both = writer;
      both.residual = d_r2.p, both.sumsq_out = d_ss2.p, both.sumsq_in = d_ss.p, both.eps = eps;
      gemv_bf16(d_w4.p, d, d, d_xg.p, d_xg2.p, batch, nullptr, 1 << 10, both);
      std::vector<float> want_r2 = r;
      const std::vector<float> p = from_bf16(d_p.download());
      for (size_t i = 0; i < bd; ++i) want_r2[i] += p[i];
      CHECK(std::memcmp(d_r2.download().data(), want_r2.data(), d_r2.bytes()) == 0);

      // The SwiGLU GEMV as a reader: the bits of the reader gemv_bf16, then swiglu.
      dev_buf<bf16> d_gu(size_t(2) * bm), d_two(bm), d_one(bm);
      d_one.poison();
      gemv_bf16(d_w3.p, 2 * m, d, d_xg.p, d_gu.p, batch, nullptr, 0, reader);
      swiglu(d_gu.p, d_two.p, batch, int(m), nullptr);
      gemv_bf16_swiglu(d_w3.p, m, d, d_xg.p, d_one.p, batch, nullptr, 0, reader);
      CHECK(std::memcmp(d_one.download().data(), d_two.download().data(), d_one.bytes()) == 0);
    }
  }
  dev_buf<bf16> w(size_t(64)), x(size_t(16)), y(size_t(8));
  dev_buf<float> f(size_t(16));
  gemv_norm no_gain;
  no_gain.residual = f.p, no_gain.sumsq_out = f.p;
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 16, x.p, y.p, 1, nullptr, 0, no_gain), cuda_error);
  gemv_norm no_residual;
  no_residual.norm_w = f.p, no_residual.sumsq_out = f.p;
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 16, x.p, y.p, 1, nullptr, 0, no_residual), cuda_error);
  gemv_norm writer;
  writer.residual = f.p, writer.norm_w = f.p, writer.sumsq_out = f.p;
  CHECK_THROWS_AS(gemv_bf16_swiglu(w.p, 2, 16, x.p, y.p, 1, nullptr, 0, writer), cuda_error);
  // Aliasing that would race between CTAs: y over x; a reader's sums under the writer's.
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 16, x.p, x.p + 8, 1, nullptr), cuda_error);
  dev_buf<float> res(size_t(4)), gain(size_t(4)), sums(size_t(8));  // sums: 1 written, 4 read
  gemv_norm both;
  both.residual = res.p, both.norm_w = gain.p, both.sumsq_out = sums.p, both.sumsq_in = sums.p, both.eps = 1e-5f;
  CHECK_THROWS_AS(gemv_bf16(w.p, 4, 16, x.p, y.p, 1, nullptr, 0, both), cuda_error);
  both.sumsq_in = sums.p + 4;  // separate sums: accepted
  CHECK_NOTHROW(gemv_bf16(w.p, 4, 16, x.p, y.p, 1, nullptr, 0, both));
  check(cudaDeviceSynchronize(), "gemv_bf16");
}

TEST_CASE("gemv_bf16_streamed matches bf16 weights times bf16 activations, repeatably", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  // 20011 rows: several per warp and CTA, runs that start and end inside 16 KB chunks; 14336: a
  // row over two chunks; 20000 x 256: ~76 rows a CTA, 32 of them a chunk (517 x 256: one or two
  // rows a CTA); 3 rows: fewer CTAs than SMs.
  const int64_t shapes[][2] = {{20011, 1280}, {1003, 4096}, {301, 14336}, {20000, 256}, {517, 256}, {3, 4096}};
  for (const auto& sh : shapes) {
    const int64_t n_out = sh[0], n_in = sh[1];
    const auto w = round_bf16(random_floats(size_t(n_out * n_in), g));
    dev_buf<bf16> d_w(to_bf16(w));
    for (const int batch : {1, 2}) {
      const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
      dev_buf<bf16> d_x(to_bf16(x)), d_y(size_t(batch * n_out));
      d_y.poison();
      gemv_bf16_streamed(d_w.p, n_out, n_in, d_x.p, d_y.p, batch, nullptr);
      const auto first = d_y.download();
      const std::vector<float> want = reference_gemv(w, x, batch, n_out, n_in);
      INFO("n_out " << n_out << " n_in " << n_in << " batch " << batch);
      CHECK(normalized_error(from_bf16(first), want) <= 1e-2);
      d_y.poison();
      gemv_bf16_streamed(d_w.p, n_out, n_in, d_x.p, d_y.p, batch, nullptr);
      CHECK(std::memcmp(d_y.download().data(), first.data(), first.size() * sizeof(bf16)) == 0);  // fixed order
    }
  }
  // Other pipeline shapes: 2 stages of 512 bytes (each stage refilled hundreds of times, its
  // barrier's phase flipping), 3 of 1.5 KiB at 4 CTAs per SM.
  for (const gemv_stream_config c : {gemv_stream_config{1, 2, 512}, gemv_stream_config{4, 3, 1536}}) {
    const int64_t n_out = 2003, n_in = 1280;
    const auto w = round_bf16(random_floats(size_t(n_out * n_in), g));
    const auto x = round_bf16(random_floats(size_t(n_in), g));
    dev_buf<bf16> d_w(to_bf16(w)), d_x(to_bf16(x)), d_y{size_t(n_out)};
    d_y.poison();
    gemv_bf16_streamed(d_w.p, n_out, n_in, d_x.p, d_y.p, 1, nullptr, c);
    INFO("ctas " << c.ctas_per_sm << " stages " << c.stages << " chunk " << c.chunk_bytes);
    CHECK(normalized_error(from_bf16(d_y.download()), reference_gemv(w, x, 1, n_out, n_in)) <= 1e-2);
  }
  dev_buf<bf16> w(size_t(4 * 512)), x(size_t(3 * 512)), y(size_t(3 * 4));
  CHECK_THROWS_AS(gemv_bf16_streamed(w.p, 4, 512, x.p, y.p, 3, nullptr), cuda_error);  // batch > 2
  CHECK_THROWS_AS(gemv_bf16_streamed(w.p, 4, 264, x.p, y.p, 1, nullptr), cuda_error);  // n_in % 256
  CHECK_THROWS_AS(gemv_bf16_streamed(w.p, 4, 512, x.p, y.p, 1, nullptr, {2, 4, 1000}), cuda_error);  // chunk % 512
  CHECK_THROWS_AS(gemv_bf16_streamed(w.p, 4, 512, x.p, y.p, 1, nullptr, {1, 8, 65536}), cuda_error);  // 512 KiB
}

TEST_CASE("gemv_quant writes a fused matrix's parts of several types into one output (ldy)", "[cuda]") {
  // As Q4_K_M's fused q|k|v of some layers: q and k q4_k, v q6_k, each part's GEMV writing its
  // columns of the [batch, n_q + 2 n_kv] output; the columns of the other parts stay as they were.
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const int64_t n_in = 512, rows[3] = {67, 29, 29}, ld = 67 + 29 + 29;
  const type_info* part_types[3] = {&types[3], &types[3], &types[5]};
  std::vector<std::vector<float>> w(3);
  std::vector<dev_buf<uint8_t>> d_w;
  for (int p = 0; p < 3; ++p) {
    const type_info& ti = *part_types[p];
    const auto raw = random_blocks(ti, rows[p] * (n_in / 256), g);
    w[p].resize(size_t(rows[p] * n_in));
    for (int64_t o = 0; o < rows[p]; ++o)
      cpu::dequantize_row(ti.dt, &raw[size_t(o * (n_in / 256) * ti.block_bytes)], &w[p][size_t(o * n_in)], n_in);
    d_w.emplace_back(raw);
  }
  for (const int batch : {1, 5}) {
    const auto x = round_bf16(random_floats(size_t(batch * n_in), g));
    dev_buf<bf16> d_x(to_bf16(x)), d_y(size_t(batch * ld));
    d_y.poison();
    std::vector<bf16> before = d_y.download();
    int64_t col = 0;
    for (int p = 0; p < 3; ++p) {
      gemv_quant(part_types[p]->t, d_w[p].p, rows[p], n_in, d_x.p, d_y.p + col, batch, nullptr, ld);
      const std::vector<bf16> after = d_y.download();
      const std::vector<float> all = from_bf16(after);
      std::vector<float> got(size_t(batch * rows[p]));
      for (int b = 0; b < batch; ++b)
        for (int64_t o = 0; o < ld; ++o) {
          const size_t i = size_t(b * ld + o);
          if (o >= col && o < col + rows[p]) {
            got[size_t(b * rows[p] + (o - col))] = all[i];
          } else {
            INFO("part " << p << " batch " << batch << ": column " << o << " of row " << b << " outside the part");
            REQUIRE(std::memcmp(&after[i], &before[i], sizeof(bf16)) == 0);
          }
        }
      INFO("part " << p << " batch " << batch);
      CHECK(normalized_error(got, reference_gemv(w[p], x, batch, rows[p], n_in)) <= 1e-2);
      before = after;
      col += rows[p];
    }
  }
}

TEST_CASE("fill_random_blocks: valid blocks of the asked standard deviation, mean near 0, seeded", "[cuda]") {
  for (const auto& ti : types) {
    INFO("type " << int(ti.t));
    const int64_t n = 256 * 512;
    const float stddev = 0.02f;
    dev_buf<uint8_t> a(kc_row_bytes(ti, n)), b(kc_row_bytes(ti, n)), c(kc_row_bytes(ti, n));
    REQUIRE(quant_row_bytes(ti.t, n) == a.n);
    fill_random_blocks(ti.t, a.p, n, stddev, 5, nullptr);
    fill_random_blocks(ti.t, b.p, n, stddev, 5, nullptr);
    fill_random_blocks(ti.t, c.p, n, stddev, 6, nullptr);
    const std::vector<uint8_t> raw = a.download();
    CHECK(raw == b.download());
    CHECK(raw != c.download());
    std::vector<float> w(static_cast<size_t>(n));
    cpu::dequantize_row(ti.dt, raw.data(), w.data(), n);
    double sum = 0.0, sq = 0.0;
    for (const float v : w) sum += v, sq += double(v) * v;
    const double mean = sum / double(n), sd = std::sqrt(sq / double(n) - mean * mean);
    CHECK(std::fabs(mean) < 0.05 * stddev);
    CHECK(std::fabs(sd - stddev) < 0.05 * stddev);  // fp16 scales: within a few parts in 1,000 of it
  }
}

TEST_CASE("gemv_quant under programmatic dependent launch: a chain of two equals plain launches bit for bit", "[cuda]") {
  // The second GEMV reads what the first writes: launched programmatically (the forward's way) it
  // may start before the first ends, and must not read x before its pdl_wait(); unrolled, it
  // loads its first weights before that wait. Rows of 8 units a lane: the unrolled loop runs.
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  // The emulation starts the second early about one chain in four on a stream of its own (the
  // legacy stream runs each kernel at once), so each programmatic case runs 8 times.
  const int64_t n_in = 2048, n_mid = 2048, n_out = 37;
  dev_buf<uint8_t> w1(random_blocks(types[3], n_mid * n_in / 256, g)), w2(random_blocks(types[5], n_out * n_mid / 256, g));
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  for (const int batch : {1, 3}) {
    dev_buf<bf16> x(to_bf16(round_bf16(random_floats(size_t(batch * n_in), g)))), mid(size_t(batch * n_mid)),
        y(size_t(batch * n_out));
    std::vector<bf16> first;
    for (const int unroll : {1, 4, 8})
      for (int run = 0; run < 9; ++run) {
        const bool pdl = run > 0;
        mid.poison();  // an early read of x sees NaN
        y.poison();
        {
          const pdl_scope scope(pdl);
          gemv_quant(quant_type::q4_k, w1.p, n_mid, n_in, x.p, mid.p, batch, stream, 0, unroll);
          gemv_quant(quant_type::q6_k, w2.p, n_out, n_mid, mid.p, y.p, batch, stream, 0, unroll);
        }
        check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const std::vector<bf16> got = y.download();
        INFO("batch " << batch << " unroll " << unroll << " pdl " << pdl);
        const std::vector<float> values = from_bf16(got);
        REQUIRE(std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); }));
        if (first.empty()) first = got;
        CHECK(std::memcmp(got.data(), first.data(), got.size() * sizeof(bf16)) == 0);
      }
  }
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

TEST_CASE("gemv_quant rejects bad batch sizes and lengths", "[cuda]") {
  dev_buf<uint8_t> w(size_t(34 * 4));
  dev_buf<bf16> x(size_t(9 * 64)), y(size_t(9 * 2));
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 2, 64, x.p, y.p, 9, nullptr), cuda_error);
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 2, 48, x.p, y.p, 1, nullptr), cuda_error);
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 2, 64, x.p, y.p, 1, nullptr, 1), cuda_error);  // ldy < n_out
  CHECK_THROWS_AS(gemv_quant(quant_type::q6_k, w.p, 2, 128, x.p, y.p, 1, nullptr), cuda_error);   // half a super-block
  CHECK_THROWS_AS(gemv_quant(quant_type::q8_0, w.p, 2, 64, x.p, y.p, 1, nullptr, 0, 2), cuda_error);  // unroll 1, 4 or 8
}

TEST_CASE("dequant_to_bf16 equals the CPU dequantization rounded to bf16", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  for (const auto& ti : types) {
    const int64_t n_blocks = 37, n = n_blocks * ti.block_values;
    const auto raw = random_blocks(ti, n_blocks, g);
    std::vector<float> want(static_cast<size_t>(n));
    cpu::dequantize_row(ti.dt, raw.data(), want.data(), n);
    dev_buf<uint8_t> d_w(raw);
    dev_buf<bf16> d_out{size_t(n)};
    d_out.poison();
    dequant_to_bf16(ti.t, d_w.p, n, d_out.p, nullptr);
    INFO("type " << int(ti.t));
    CHECK(normalized_error(from_bf16(d_out.download()), round_bf16(want)) == 0.0);
  }
}
