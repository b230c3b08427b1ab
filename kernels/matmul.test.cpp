// matmul against double-precision references built from dequantize_row, for every weight type,
// SIMD level, a sweep of shapes (tails of every tile size) and thread counts.
//
// Two references per product:
//  * ref_q: the product with the activations rounded exactly as the contract says (per block of
//    32, or 256 for the k-quants: d = max|x| / 127, q = round-half-even(x / d)), in double. The
//    kernels compute this with exact integer dots and a few float roundings per block, so they must
//    match it to 1e-4 of sum_k |W_ok xq_k|: a misplaced value, scale or block is off by O(1).
//  * ref: the exact product of the float activations. Rounding x to 8 bits adds per-value errors
//    uniform in +-d/2 with d = max|x| / 127 over a block, independent of each other and of W, so
//    over many outputs ||y - ref|| / ||ref|| ~ (d / sqrt(12)) / rms(x). For Gaussian x (max ~ 2.5
//    sigma over 32 values) that is 2.5 / 127 / 3.46 ~ 0.6% (measured: 0.53%); the bound is 1.5%.
//    The k-quants round per 256 values, and the test data puts a run of 32 values 8x larger in
//    about one block in five, so d ~ 8 * 3 sigma / 127 while rms(x) ~ 3.7 sigma: ~1.5% (measured:
//    1.25%); the bound is 3%. Float weights must match ref to float rounding: 1e-6 * (n_in + 16)
//    of sum_k |W_ok x_k|.
#include "kernels/matmul.hpp"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/dequant.hpp"
#include "kernels/fp16.hpp"
#include "kernels/matmul_impl.hpp"
#include "kernels/thread_pool.hpp"

namespace tk = troupe::kernels;
using tk::dtype;
using tk::detail::isa;

namespace {

constexpr dtype all_types[] = {dtype::f32,  dtype::f16,  dtype::bf16, dtype::q4_0, dtype::q4_1,
                               dtype::q8_0, dtype::q4_k, dtype::q5_k, dtype::q6_k};

bool is_float(dtype t) { return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16; }

/// Sets the matmul SIMD level for a scope.
struct isa_scope {
  isa previous = tk::detail::active_isa();
  explicit isa_scope(isa level) { REQUIRE(tk::detail::force_isa(level)); }
  ~isa_scope() { tk::detail::force_isa(previous); }
};

std::vector<isa> available_levels() {
  std::vector<isa> levels;
  for (isa l : {isa::scalar, isa::avx2, isa::avx512})
    if (l <= tk::detail::detected_isa()) levels.push_back(l);
  return levels;
}

/// A random n_out x n_in weight matrix of type t with valid scales (no inf or NaN), rows
/// row_stride bytes apart; the padding between rows is 0xff (fp16 NaN) so that reading it shows.
struct weights {
  dtype type;
  int64_t n_out, n_in;
  size_t row_stride;
  std::vector<uint8_t> bytes;
  std::vector<float> dense;  // dequantized, n_out x n_in

  tk::weight_view view() const { return {type, bytes.data(), n_out, n_in, row_stride}; }
};

uint16_t random_scale(std::mt19937& rng, float lo, float hi) {
  return tk::f32_to_fp16(std::uniform_real_distribution<float>(lo, hi)(rng));
}

weights make_weights(dtype t, int64_t n_out, int64_t n_in, size_t pad, std::mt19937& rng) {
  const auto& tr = tk::traits(t);
  weights w{t, n_out, n_in, static_cast<size_t>(tk::row_bytes(tr, n_in)) + pad, {}, {}};
  w.bytes.assign(w.row_stride * static_cast<size_t>(n_out), 0xff);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t o = 0; o < n_out; ++o) {
    uint8_t* row = w.bytes.data() + static_cast<size_t>(o) * w.row_stride;
    const size_t n_bytes = static_cast<size_t>(tk::row_bytes(tr, n_in));
    for (size_t i = 0; i < n_bytes; ++i) row[i] = static_cast<uint8_t>(byte(rng));
    // Overwrite the scale fields (and the float weights) with finite values.
    for (int64_t b = 0; b < n_in / tr.block_size; ++b) {
      uint8_t* blk = row + b * tr.type_size;
      auto put = [&](size_t off, uint16_t v) { std::memcpy(blk + off, &v, 2); };
      switch (t) {
        case dtype::f32: {
          const float v = normal(rng) * 0.1f;
          std::memcpy(blk, &v, 4);
          break;
        }
        case dtype::f16:
          put(0, tk::f32_to_fp16(normal(rng) * 0.1f));
          break;
        case dtype::bf16:
          put(0, tk::f32_to_bf16(normal(rng) * 0.1f));
          break;
        case dtype::q4_0:
        case dtype::q5_0:
        case dtype::q8_0:
          put(0, random_scale(rng, -0.02f, 0.02f));
          break;
        case dtype::q4_1:
          put(0, random_scale(rng, 0.001f, 0.02f));
          put(2, random_scale(rng, -0.15f, 0.0f));
          break;
        case dtype::q4_k:
        case dtype::q5_k:
          put(0, random_scale(rng, 0.0001f, 0.001f));
          put(2, random_scale(rng, 0.0001f, 0.003f));
          break;
        case dtype::q6_k:
          put(offsetof(tk::block_q6_k, d), random_scale(rng, -0.0003f, 0.0003f));
          break;
      }
    }
  }
  w.dense.resize(static_cast<size_t>(n_out * n_in));
  for (int64_t o = 0; o < n_out; ++o)
    tk::dequantize_row(t, w.bytes.data() + static_cast<size_t>(o) * w.row_stride, w.dense.data() + o * n_in, n_in);
  return w;
}

/// m x n_in activations (row stride ldx; the padding is NaN): Gaussian, some blocks scaled up
/// (outliers as in real activations) and one all-zero block.
std::vector<float> make_acts(int64_t m, int64_t n_in, int64_t ldx, std::mt19937& rng) {
  std::vector<float> x(static_cast<size_t>(m * ldx), std::numeric_limits<float>::quiet_NaN());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < n_in; ++k) x[i * ldx + k] = normal(rng) * ((k / 32 + i) % 5 == 3 ? 8.0f : 1.0f);
  if (n_in >= 64) std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  return x;
}

/// x rounded as the kernels round it (see the file comment); x itself for float weights.
std::vector<double> round_acts(dtype t, const std::vector<float>& x, int64_t m, int64_t n_in, int64_t ldx) {
  std::vector<double> xq(static_cast<size_t>(m * n_in));
  const int64_t bs = is_float(t) ? 1 : (t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k) ? 256 : 32;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < n_in; b += bs) {
      const float* xb = x.data() + i * ldx + b;
      if (bs == 1) {
        xq[i * n_in + b] = xb[0];
        continue;
      }
      float amax = 0.0f;
      for (int64_t k = 0; k < bs; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t k = 0; k < bs; ++k) xq[i * n_in + b + k] = static_cast<double>(d) * std::nearbyint(xb[k] * id);
    }
  return xq;
}

/// Squared errors against the unquantized reference, summed over products.
struct error_sums {
  double err2 = 0.0, ref2 = 0.0;
  double relative() const { return ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0; }
};

/// Runs y = x W^T with a poisoned y (ldy > n_out), checks every output against ref_q and the
/// padding, and adds the deviations from ref to `sums` (a handful of outputs says little about a
/// norm ratio: one small ref makes it large, so callers check it over many products).
void check_product(const weights& w, int64_t m, tk::thread_pool& pool, std::mt19937& rng, error_sums& sums,
                   int64_t ldx_pad = 3) {
  const int64_t n_in = w.n_in, n_out = w.n_out, ldx = n_in + ldx_pad, ldy = n_out + 2;
  const std::vector<float> x = make_acts(m, n_in, ldx, rng);
  std::vector<float> y(static_cast<size_t>(m * ldy), std::numeric_limits<float>::quiet_NaN());
  tk::matmul(w.view(), x.data(), ldx, m, y.data(), ldy, pool);

  const std::vector<double> xq = round_acts(w.type, x, m, n_in, ldx);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t o = 0; o < n_out; ++o) {
      double ref = 0.0, ref_q = 0.0, mag = 0.0;
      for (int64_t k = 0; k < n_in; ++k) {
        const double wv = w.dense[o * n_in + k];
        ref += wv * x[i * ldx + k];
        ref_q += wv * xq[i * n_in + k];
        mag += std::fabs(wv * xq[i * n_in + k]);
      }
      const double got = y[i * ldy + o];
      const double tol = is_float(w.type) ? 1e-6 * static_cast<double>(n_in + 16) * mag : 1e-4 * mag;
      if (!(std::fabs(got - ref_q) <= tol + 1e-30)) {
        INFO("row " << i << " output " << o << ": got " << got << ", want " << ref_q << " (tolerance " << tol << ")");
        REQUIRE(std::fabs(got - ref_q) <= tol + 1e-30);
      }
      sums.err2 += (got - ref) * (got - ref);
      sums.ref2 += ref * ref;
    }
    for (int64_t o = n_out; o < ldy; ++o) REQUIRE(std::isnan(y[i * ldy + o]));  // padding untouched
  }
}

/// The bound on ||y - ref|| / ||ref|| of the file comment (float types: none beyond ref_q's).
void check_relative_error(dtype t, const error_sums& sums) {
  INFO("relative RMS deviation from the unquantized product: " << sums.relative());
  if (is_float(t)) return;
  const bool super_blocks = t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k;
  CHECK(sums.relative() < (super_blocks ? 0.03 : 0.015));
}

std::vector<int64_t> n_in_cases(dtype t) {
  const int64_t bs = tk::traits(t).block_size;
  if (bs == 1) return {1, 2, 7, 8, 9, 33, 200};
  if (bs == 32) return {32, 64, 96, 128, 160, 224, 256, 384, 576};  // 1-5, 7, 8, 12 and 18 blocks
  return {256, 512, 768};
}

}  // namespace

TEST_CASE("matmul matches the references for every type, level, shape and thread count", "[kernels][matmul]") {
  std::mt19937 rng(42);
  std::unique_ptr<tk::thread_pool> pools[3];
  for (int n = 1; n <= 3; ++n) pools[n - 1] = std::make_unique<tk::thread_pool>(n);
  for (isa level : available_levels()) {
    isa_scope scope(level);
    for (dtype t : all_types) {
      error_sums sums;
      for (int64_t n_in : n_in_cases(t)) {
        for (int64_t n_out : {1, 5, 37}) {
          const weights w = make_weights(t, n_out, n_in, n_out == 5 ? 6 : 0, rng);
          for (int64_t m : {1, 2, 3, 7, 16, 33}) {
            for (int n_threads = 1; n_threads <= 3; ++n_threads) {
              INFO(tk::detail::isa_name(level) << " " << tk::traits(t).name << " n_out " << n_out << " n_in " << n_in
                                               << " m " << m << " threads " << n_threads);
              check_product(w, m, *pools[n_threads - 1], rng, sums);
            }
          }
        }
      }
      INFO(tk::detail::isa_name(level) << " " << tk::traits(t).name);
      check_relative_error(t, sums);
    }
  }
}

TEST_CASE("matmul handles larger products: row blocks, many groups, rows split over threads", "[kernels][matmul]") {
  std::mt19937 rng(7);
  tk::thread_pool pool(2);
  for (isa level : available_levels()) {
    isa_scope scope(level);
    for (dtype t : all_types) {
      INFO(tk::detail::isa_name(level) << " " << tk::traits(t).name);
      error_sums sums;
      const weights wide = make_weights(t, 70, 1536, 0, rng);
      check_product(wide, 1, pool, rng, sums, 0);
      check_product(wide, 20, pool, rng, sums, 0);
      // Few rows, many activations: the work is split by activation rows instead.
      const weights narrow = make_weights(t, 3, 256, 0, rng);
      check_product(narrow, 64, pool, rng, sums, 0);
      check_relative_error(t, sums);
    }
  }
}

TEST_CASE("matmul results do not depend on the thread count", "[kernels][matmul]") {
  std::mt19937 rng(21);
  std::unique_ptr<tk::thread_pool> pools[3];
  for (int n = 1; n <= 3; ++n) pools[n - 1] = std::make_unique<tk::thread_pool>(n);
  for (isa level : available_levels()) {
    isa_scope scope(level);
    for (dtype t : all_types) {
      const weights w = make_weights(t, 150, tk::traits(t).block_size == 1 ? 100 : 512, 0, rng);
      for (int64_t m : {1, 7, 33}) {
        const std::vector<float> x = make_acts(m, w.n_in, w.n_in, rng);
        std::vector<float> y[3];
        for (int n = 0; n < 3; ++n) {
          y[n].assign(static_cast<size_t>(m * w.n_out), std::numeric_limits<float>::quiet_NaN());
          tk::matmul(w.view(), x.data(), w.n_in, m, y[n].data(), w.n_out, *pools[n]);
        }
        INFO(tk::detail::isa_name(level) << " " << tk::traits(t).name << " m " << m);
        REQUIRE(y[1] == y[0]);
        REQUIRE(y[2] == y[0]);
      }
    }
  }
}

TEST_CASE("matmul_batch equals separate matmuls", "[kernels][matmul]") {
  std::mt19937 rng(3);
  tk::thread_pool pool(2);
  const int64_t n_in = 512, m = 5;
  const weights a = make_weights(dtype::q4_1, 40, n_in, 0, rng);
  const weights b = make_weights(dtype::q8_0, 24, n_in, 0, rng);
  const weights c = make_weights(dtype::q6_k, 9, n_in, 0, rng);
  const weights d = make_weights(dtype::f16, 11, n_in, 0, rng);
  const std::vector<float> x = make_acts(m, n_in, n_in, rng);
  for (isa level : available_levels()) {
    isa_scope scope(level);
    INFO(tk::detail::isa_name(level));
    const weights* ws[] = {&a, &b, &c, &d};
    std::vector<std::vector<float>> separate, batched;
    std::vector<tk::matmul_out> outs;
    for (const weights* w : ws) {
      separate.emplace_back(static_cast<size_t>(m * w->n_out));
      batched.emplace_back(static_cast<size_t>(m * w->n_out), std::numeric_limits<float>::quiet_NaN());
      tk::matmul(w->view(), x.data(), n_in, m, separate.back().data(), w->n_out, pool);
      outs.push_back({w->view(), batched.back().data(), w->n_out});
    }
    tk::matmul_batch(outs, x.data(), n_in, m, pool);
    for (size_t j = 0; j < separate.size(); ++j) REQUIRE(batched[j] == separate[j]);  // same sums, same bits
  }
}

TEST_CASE("activation quantization is identical at every level", "[kernels][matmul]") {
  using tk::detail::act_kind;
  std::mt19937 rng(11);
  for (act_kind kind : {act_kind::q8x4, act_kind::q8x4_u, act_kind::q8x8, act_kind::q8_k}) {
    for (int64_t n_in : {256, 512, 1536}) {
      const int64_t m = 3;
      const std::vector<float> x = make_acts(m, n_in, n_in, rng);
      const size_t stride = tk::detail::act_row_bytes(kind, n_in);
      std::vector<std::vector<uint8_t>> out;
      for (isa level : available_levels()) {
        out.emplace_back(stride * m + 64, 0xcd);
        uint8_t* dst = out.back().data() + (64 - reinterpret_cast<uintptr_t>(out.back().data()) % 64) % 64;
        tk::detail::quantize_rows(kind, level, x.data(), n_in, n_in, 0, m, dst, stride);
        out.back().assign(dst, dst + stride * m);
      }
      for (size_t l = 1; l < out.size(); ++l) REQUIRE(out[l] == out[0]);
    }
  }
}

TEST_CASE("matmul of a 96-value row places every value", "[kernels][matmul]") {
  // One weight row of ones times a one-hot activation picks that value: checks the blocked
  // layout exactly (the value is exact: 1 * d * 127 with d = 1 / 127 rounds back to 1).
  tk::thread_pool pool(1);
  const int64_t n_in = 96;
  std::vector<tk::block_q8_0> row(3);
  for (auto& blk : row) {
    blk.d = tk::f32_to_fp16(1.0f);
    for (int j = 0; j < 32; ++j) blk.qs[j] = static_cast<int8_t>(j % 7 + 1);
  }
  const tk::weight_view w{dtype::q8_0, row.data(), 1, n_in, sizeof(tk::block_q8_0) * 3};
  for (isa level : available_levels()) {
    isa_scope scope(level);
    for (int64_t k = 0; k < n_in; ++k) {
      std::vector<float> x(n_in, 0.0f);
      x[k] = 1.0f;
      float y = std::numeric_limits<float>::quiet_NaN();
      tk::matmul(w, x.data(), n_in, 1, &y, 1, pool);
      INFO(tk::detail::isa_name(level) << " k " << k);
      REQUIRE(y == Approx(static_cast<float>(k % 32 % 7 + 1)).epsilon(1e-6));
    }
  }
}

TEST_CASE("matmul rejects bad arguments before writing anything", "[kernels][matmul]") {
  std::mt19937 rng(5);
  tk::thread_pool pool(2);
  const weights w = make_weights(dtype::q4_1, 8, 64, 0, rng);
  std::vector<float> x(2 * 64, 1.0f), y(2 * 8, std::numeric_limits<float>::quiet_NaN());
  auto run = [&](tk::weight_view v, int64_t ldx, int64_t m, int64_t ldy) {
    tk::matmul(v, x.data(), ldx, m, y.data(), ldy, pool);
  };
  tk::weight_view v = w.view();
  SECTION("n_in not a multiple of the block") {
    v.n_in = 48;
    REQUIRE_THROWS_AS(run(v, 64, 2, 8), std::invalid_argument);
  }
  SECTION("row stride shorter than a row") {
    v.row_stride = 39;
    REQUIRE_THROWS_AS(run(v, 64, 2, 8), std::invalid_argument);
  }
  SECTION("unsupported type") {
    v.type = static_cast<dtype>(7);
    REQUIRE_THROWS_AS(run(v, 64, 2, 8), std::invalid_argument);
  }
  SECTION("ldx shorter than n_in") { REQUIRE_THROWS_AS(run(v, 32, 2, 8), std::invalid_argument); }
  SECTION("ldy shorter than n_out") { REQUIRE_THROWS_AS(run(v, 64, 2, 7), std::invalid_argument); }
  SECTION("negative m") { REQUIRE_THROWS_AS(run(v, 64, -1, 8), std::invalid_argument); }
  SECTION("odd row stride") {
    v.row_stride = 41;
    REQUIRE_THROWS_AS(run(v, 64, 2, 8), std::invalid_argument);
  }
  SECTION("null weights") {
    v.data = nullptr;
    REQUIRE_THROWS_AS(run(v, 64, 2, 8), std::invalid_argument);
  }
  SECTION("batch products with different n_in") {
    const weights other = make_weights(dtype::q4_1, 8, 32, 0, rng);
    std::vector<float> y2(16);
    const tk::matmul_out outs[] = {{v, y.data(), 8}, {other.view(), y2.data(), 8}};
    REQUIRE_THROWS_AS(tk::matmul_batch(outs, x.data(), 64, 2, pool), std::invalid_argument);
  }
  for (float f : y) REQUIRE(std::isnan(f));
}

TEST_CASE("matmul with no rows or no outputs does nothing", "[kernels][matmul]") {
  std::mt19937 rng(9);
  tk::thread_pool pool(2);
  const weights w = make_weights(dtype::q8_0, 4, 32, 0, rng);
  std::vector<float> y(4, std::numeric_limits<float>::quiet_NaN());
  tk::matmul(w.view(), nullptr, 32, 0, y.data(), 4, pool);
  tk::weight_view empty = w.view();
  empty.n_out = 0;
  std::vector<float> x(32, 1.0f);
  tk::matmul(empty, x.data(), 32, 1, y.data(), 4, pool);
  for (float f : y) REQUIRE(std::isnan(f));
  REQUIRE(std::string(tk::matmul_isa()) == tk::detail::isa_name(tk::detail::active_isa()));
}
