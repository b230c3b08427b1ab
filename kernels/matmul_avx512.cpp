// AVX-512 kernels (F/BW/VL/DQ + VNNI + VBMI; compiled with the flags in kernels/CMakeLists.txt,
// VBMI enabled below, entered only after the run-time check in matmul.cpp).
//
// Quantized weights are read in place, a group of blocks per step. Byte permutes (vpermt2b)
// gather a group's quantized bytes out of the packed rows into the order of the activation layout
// and its fp16 scales already repeated over each block's 32-bit lanes; vpdpbusd then leaves each
// block's integer dot product in its own lanes, which one conversion and one multiply-add weight
// by the block scales (and a second multiply-add adds Q4's per-block offset times the block's
// activation sum).
//  * Q4_0 / Q4_1: eight blocks per step (act_octet, two lanes per block). Nibbles are the unsigned
//    operand, activations the signed one.
//  * Q8_0: four blocks per step (act_group, four lanes per block). Signed weights meet activations
//    stored as q + 128; -128 * sum(w), computed once per weight row and group, corrects the dot.
// A micro-kernel keeps R weight rows x C activation rows of accumulators in registers, so each
// unpacked group serves C activation rows; with one activation row it prefetches the next tile.
// Float weights and k-quants come from matmul_simd.hpp (256-bit code: on Zen 4, which splits
// 512-bit operations in two, it loses nothing).
#include "kernels/matmul_impl.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)

#pragma GCC target("avx512vbmi")
// GCC 12 reports its own _mm512_castsi512_si256 (an intentionally undefined upper half) as
// "maybe uninitialized" once inlined deep enough.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "kernels/matmul_simd.hpp"

namespace troupe::kernels::detail {

namespace {

/// One weight row's group of blocks (four or eight), unpacked.
struct group_weights {
  __m512i w[4];   // values for the activation bytes [64k, 64k + 64)
  __m512 dw;      // block scales over each block's lanes
  __m512 mw;      // Q4: additive term per block (Q4_1: m; Q4_0: -8 d) over its lanes
  __m512i ncorr;  // Q8_0: -128 * sum of the weights, per lane
};

/// The same for at most four blocks of an octet, at half width.
struct half_weights {
  __m256i w[4];
  __m256 dw, mw;
};

inline __mmask64 first_bytes(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : n <= 0 ? __mmask64{0} : (__mmask64{1} << n) - 1;
}

/// 64 bytes at p, or only the first n of them (the rest zero, nothing past them read).
template <bool full>
inline __m512i load64(const uint8_t* p, int64_t n) {
  if constexpr (full)
    return _mm512_loadu_si512(p);
  else
    return _mm512_maskz_loadu_epi8(first_bytes(n), p);
}

/// A vpermt2b index table: byte i of the result is byte f(i) of the 128-byte pair (a, b).
struct alignas(64) byte_table {
  uint8_t v[64];
  __m512i load() const { return _mm512_load_si512(v); }
};
template <class F>
constexpr byte_table make_table(F f) {
  byte_table t{};
  for (int i = 0; i < 64; ++i) t.v[i] = static_cast<uint8_t>(f(i));
  return t;
}

/// Q4_0 (18-byte blocks: d, 16 bytes of nibbles) and Q4_1 (20: d, m, nibbles), eight blocks
/// (an act_octet) at a time, read as two halves of four blocks (72 or 80 bytes): 64 bytes at the
/// start of each half plus the 8 or 16 after. One vpermt2b per half puts bytes [0, 8) and
/// [8, 16) of its four blocks' nibbles side by side, two 128-bit shuffles join the halves into
/// V_a and V_b, and one vpermt2b over both halves' first 64 bytes gathers all the scales.
template <dtype T>
struct q4_octet {
  using act_t = act_octet;
  static constexpr int n_blocks = 8;
  static constexpr int bytes = T == dtype::q4_1 ? 20 : 18;
  static constexpr int qs = T == dtype::q4_1 ? 4 : 2;
  static constexpr int half_bytes = 4 * bytes;
  static constexpr bool has_min = true;

  // Within a half: bytes 0..31 = bytes [0, 8) of blocks 0..3's nibbles, 32..63 = bytes [8, 16).
  static constexpr byte_table table_half =
      make_table([](int i) { return bytes * ((i % 32) / 8) + qs + i % 8 + (i >= 32 ? 8 : 0); });
  // Over (first 64 bytes of half 0, first 64 of half 1): bytes 0..31 the d of block l / 2 for
  // fp16 lane l, bytes 32..63 the m (Q4_1) likewise.
  static constexpr byte_table table_dm = make_table([](int i) {
    const int block = (i % 32) / 4, field = (i >= 32 ? 2 : 0) + i % 2;
    return block < 4 ? bytes * block + field : 64 + bytes * (block - 4) + field;
  });
  // Within a half, for at most four blocks: d (bytes 0..15) and m (16..31) of blocks 0..3.
  static constexpr byte_table table_dm_half =
      make_table([](int i) { return bytes * ((i % 16) / 4) + (i >= 16 ? 2 : 0) + i % 2; });

  /// Bytes [64, half_bytes) of a half (the rest of the register zero).
  template <bool full>
  static __m512i load_rest(const uint8_t* p, int64_t n) {
    if constexpr (!full)
      return _mm512_maskz_loadu_epi8(first_bytes(std::min<int64_t>(n, half_bytes - 64)), p);
    else if constexpr (half_bytes - 64 == 16)
      return _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else
      return _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }

  template <bool full>
  static group_weights load(const uint8_t* gp, int64_t nb) {
    const int64_t n = nb * bytes;
    const __m512i a0 = load64<full>(gp, n), b0 = load_rest<full>(gp + 64, n - 64);
    const __m512i a1 = load64<full>(gp + half_bytes, n - half_bytes);
    const __m512i b1 = load_rest<full>(gp + half_bytes + 64, n - half_bytes - 64);
    const __m512i p0 = _mm512_permutex2var_epi8(a0, table_half.load(), b0);
    const __m512i p1 = _mm512_permutex2var_epi8(a1, table_half.load(), b1);
    const __m512i va = _mm512_shuffle_i64x2(p0, p1, 0x44), vb = _mm512_shuffle_i64x2(p0, p1, 0xee);
    const __m512i dm = _mm512_permutex2var_epi8(a0, table_dm.load(), a1);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    group_weights g;
    g.w[0] = _mm512_and_si512(va, low4);
    g.w[1] = _mm512_and_si512(_mm512_srli_epi16(va, 4), low4);
    g.w[2] = _mm512_and_si512(vb, low4);
    g.w[3] = _mm512_and_si512(_mm512_srli_epi16(vb, 4), low4);
    g.dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if constexpr (T == dtype::q4_1)
      g.mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
    else
      g.mw = _mm512_mul_ps(g.dw, _mm512_set1_ps(-8.0f));
    return g;
  }

  static __m512i dot(const group_weights& g, const act_t* x) {  // two chains: half the latency
    const __m512i zero = _mm512_setzero_si512();
    const __m512i d0 = _mm512_dpbusd_epi32(zero, g.w[0], _mm512_load_si512(x->q));
    const __m512i d1 = _mm512_dpbusd_epi32(zero, g.w[1], _mm512_load_si512(x->q + 64));
    return _mm512_add_epi32(_mm512_dpbusd_epi32(d0, g.w[2], _mm512_load_si512(x->q + 128)),
                            _mm512_dpbusd_epi32(d1, g.w[3], _mm512_load_si512(x->q + 192)));
  }

  // A last octet of at most four blocks at half width: one permute for the nibbles, one for the
  // scales.
  static half_weights load_half(const uint8_t* gp, int64_t nb) {
    const int64_t n = nb * bytes;
    const __m512i a = load64<false>(gp, n), b = load_rest<false>(gp + 64, n - 64);
    const __m512i v = _mm512_permutex2var_epi8(a, table_half.load(), b);
    const __m256i dm = _mm512_castsi512_si256(_mm512_permutex2var_epi8(a, table_dm_half.load(), b));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    half_weights h;
    h.w[0] = _mm512_castsi512_si256(lo);
    h.w[1] = _mm512_castsi512_si256(hi);
    h.w[2] = _mm512_extracti64x4_epi64(lo, 1);
    h.w[3] = _mm512_extracti64x4_epi64(hi, 1);
    h.dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    if constexpr (T == dtype::q4_1)
      h.mw = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
    else
      h.mw = _mm256_mul_ps(h.dw, _mm256_set1_ps(-8.0f));
    return h;
  }

  static __m256i dot_half(const half_weights& h, const act_t* x) {  // lanes 0..7: blocks 0..3
    auto xq = [&](int k) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x->q + 64 * k)); };
    const __m256i zero = _mm256_setzero_si256();
    const __m256i d0 = _mm256_dpbusd_epi32(zero, h.w[0], xq(0)), d1 = _mm256_dpbusd_epi32(zero, h.w[1], xq(1));
    return _mm256_add_epi32(_mm256_dpbusd_epi32(d0, h.w[2], xq(2)), _mm256_dpbusd_epi32(d1, h.w[3], xq(3)));
  }
};

/// Q8_0 (34-byte blocks: d, 32 signed bytes). A group spans 136 bytes, read as [0, 64), [64, 128)
/// for the first halves and scales and [8, 72), [72, 136) for the second halves.
struct q8_group {
  using act_t = act_group;
  static constexpr int n_blocks = 4;
  static constexpr int bytes = 34;
  static constexpr bool has_min = false;

  static constexpr byte_table table_1 = make_table([](int i) { return bytes * (i / 16) + 2 + i % 16; });
  static constexpr byte_table table_2 = make_table([](int i) { return bytes * (i / 16) + 18 + i % 16 - 8; });
  static constexpr byte_table table_d = make_table([](int i) { return bytes * ((i % 32) / 8) + i % 2; });

  template <bool full>
  static group_weights load(const uint8_t* gp, int64_t nb) {
    const int64_t n = nb * bytes;
    const __m512i idx_1 = table_1.load(), idx_2 = table_2.load(), idx_d = table_d.load();
    const __m512i a = load64<full>(gp, n), b = load64<full>(gp + 64, n - 64);
    const __m512i a2 = load64<full>(gp + 8, n - 8), c = load64<full>(gp + 72, n - 72);
    group_weights g;
    g.w[0] = _mm512_permutex2var_epi8(a, idx_1, b);
    g.w[1] = _mm512_permutex2var_epi8(a2, idx_2, c);
    g.dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a, idx_d, b)));
    const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i corr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, g.w[0]), k128, g.w[1]);
    g.ncorr = _mm512_sub_epi32(_mm512_setzero_si512(), corr);
    return g;
  }

  static __m512i dot(const group_weights& g, const act_t* x) {  // x->q holds q + 128
    const __m512i d = _mm512_dpbusd_epi32(g.ncorr, _mm512_load_si512(x->q), g.w[0]);
    return _mm512_dpbusd_epi32(d, _mm512_load_si512(x->q + 64), g.w[1]);
  }
};

inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

template <class B, int R>
struct q_micro {
  template <int C>
  static void run(const uint8_t* const* rows, const uint8_t* const* next, const uint8_t* const* acts, int n_rows,
                  int64_t n_in, float* y, int64_t ldy) {
    using act_t = typename B::act_t;
    const int64_t n_blocks = n_in / 32, n_full = n_blocks / B::n_blocks, n_tail = n_blocks % B::n_blocks;
    constexpr int64_t group_bytes = B::n_blocks * B::bytes;
    __m512 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
    // Weights outer (unpacked once per tile row and group), activations re-read from L1 per row.
    auto step = [&](int64_t g, int64_t nb, auto full) {
      if constexpr (C == 1) prefetch_group<R>(next, g * group_bytes);
      for (int r = 0; r < R; ++r) {
        const group_weights gw = B::template load<decltype(full)::value>(rows[r] + g * group_bytes, nb);
        for (int c = 0; c < C; ++c) {
          const act_t* x = reinterpret_cast<const act_t*>(acts[c]) + g;
          const __m512 v = _mm512_cvtepi32_ps(B::dot(gw, x));
          acc[c][r] = _mm512_fmadd_ps(v, _mm512_mul_ps(gw.dw, _mm512_load_ps(x->d)), acc[c][r]);
          if constexpr (B::has_min) acc[c][r] = _mm512_fmadd_ps(gw.mw, _mm512_load_ps(x->s), acc[c][r]);
        }
      }
    };
    // A last octet of at most four blocks: the same at half width (lanes 0..7).
    auto step_half = [&](auto unpack, int64_t g, int64_t nb) {
      using U = decltype(unpack);
      for (int r = 0; r < R; ++r) {
        const half_weights hw = U::load_half(rows[r] + g * group_bytes, nb);
        for (int c = 0; c < C; ++c) {
          const act_t* x = reinterpret_cast<const act_t*>(acts[c]) + g;
          const __m256 v = _mm256_cvtepi32_ps(U::dot_half(hw, x));
          __m256 t = _mm256_mul_ps(v, _mm256_mul_ps(hw.dw, _mm256_load_ps(x->d)));
          t = _mm256_fmadd_ps(hw.mw, _mm256_load_ps(x->s), t);
          acc[c][r] = _mm512_add_ps(acc[c][r], _mm512_zextps256_ps512(t));
        }
      }
    };
    for (int64_t g = 0; g < n_full; ++g) step(g, B::n_blocks, std::true_type{});
    if constexpr (B::n_blocks == 8) {
      if (n_tail > 0 && n_tail <= 4)
        step_half(B{}, n_full, n_tail);
      else if (n_tail > 0)
        step(n_full, n_tail, std::false_type{});
    } else if (n_tail > 0) {
      step(n_full, n_tail, std::false_type{});
    }
    for (int c = 0; c < C; ++c) {
      __m256 sums[R];
      for (int r = 0; r < R; ++r) sums[r] = fold(acc[c][r]);
      store_row_sums<R>(sums, n_rows, y + c * ldy);
    }
  }
};

template <class B>
void gemm_q(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  if (a.m == 1)
    tile_loop<q_micro<B, 4>, 4, 1>(w, o0, o1, a, y, ldy);
  else
    tile_loop<q_micro<B, 4>, 4, 5>(w, o0, o1, a, y, ldy);
}

}  // namespace

kernel find_kernel_avx512(dtype t) {
  switch (t) {
    case dtype::f32:
      return {act_kind::f32, gemm_float<dtype::f32, 6>};
    case dtype::f16:
      return {act_kind::f32, gemm_float<dtype::f16, 6>};
    case dtype::bf16:
      return {act_kind::f32, gemm_float<dtype::bf16, 6>};
    case dtype::q4_0:
      return {act_kind::q8x8, gemm_q<q4_octet<dtype::q4_0>>};
    case dtype::q4_1:
      return {act_kind::q8x8, gemm_q<q4_octet<dtype::q4_1>>};
    case dtype::q8_0:
      return {act_kind::q8x4_u, gemm_q<q8_group>};
    case dtype::q4_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q4_k>};
    case dtype::q5_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q5_k>};
    case dtype::q6_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q6_k>};
    case dtype::q5_0:  // repacked to q8_0 when a model is loaded (engine::model)
      return {};
  }
  return {};
}

}  // namespace troupe::kernels::detail

#else

namespace troupe::kernels::detail {
kernel find_kernel_avx512(dtype) { return {}; }
}  // namespace troupe::kernels::detail

#endif
