// AVX-512 kernels (F/BW/VL/DQ + VNNI + VBMI; compiled with the flags in kernels/CMakeLists.txt,
// VBMI enabled below, entered only after the run-time check in matmul.cpp).
//
// Q4_0, Q4_1 and Q8_0 weights take four blocks (one act_group, 128 values) per step. One vpermt2b
// gathers the four blocks' quantized bytes from the packed rows into a register, another their
// fp16 scales (already repeated over each block's four 32-bit lanes); two vpdpbusd then leave
// block b's dot product in lanes 4b..4b+3, which one conversion and one multiply-add weight by
// the block scales. Q4 nibbles are the unsigned operand and the activations the signed one; Q8_0's
// signed weights meet activations stored as q + 128, corrected by -128 * sum(w) computed once per
// weight row and group. A micro-kernel holds R weight rows x C activation rows of accumulators, so
// each unpacked weight group is used C times. Float weights and k-quants: matmul_simd.hpp.
#include "kernels/matmul_impl.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)

#pragma GCC target("avx512vbmi")
// GCC 12 reports its own _mm512_castsi512_si256 (an intentionally undefined upper half) as
// "maybe uninitialized" once inlined deep enough.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels/matmul_simd.hpp"

namespace troupe::kernels::detail {

namespace {

/// One weight row's group of four blocks, unpacked.
/// One weight row's group of blocks (four or eight), unpacked.
struct group_weights {
  __m512i w[4];   // values for the activation bytes [64k, 64k + 64)
  __m512 dw;      // block scales over each block's lanes
  __m512 mw;      // Q4: additive term per block (Q4_1: m; Q4_0: -8 d) over its lanes
  __m512i ncorr;  // Q8_0: -128 * sum of the weights, per lane
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
/// (an act_octet) at a time. The eight blocks span 144 or 160 bytes, read as [0, 64), [64, 128) and
/// the last 64 bytes; vpermt2b reaches the first two, vpermb the last, merged under a byte mask.
template <dtype T>
struct q4_octet {
  using act_t = act_octet;
  static constexpr int n_blocks = 8;
  static constexpr int bytes = T == dtype::q4_1 ? 20 : 18;
  static constexpr int qs = T == dtype::q4_1 ? 4 : 2;
  static constexpr int span = n_blocks * bytes;
  static constexpr int tail_from = span - 64;  // start of the third read
  // First block read from the third register: its quantized bytes (and for simplicity its
  // scales) do not fit in [0, 128).
  static constexpr int first_late = T == dtype::q4_1 ? 6 : 7;
  static constexpr bool has_min = true;

  // V_a / V_b: bytes [0, 8) / [8, 16) of each block's nibbles, block b at bytes 8b..8b+7.
  static constexpr int offset_a(int i) { return bytes * (i / 8) + qs + i % 8; }
  static constexpr byte_table table_a = make_table([](int i) { return offset_a(i) % 128; });
  static constexpr byte_table table_a_late = make_table([](int i) { return (offset_a(i) - tail_from) & 63; });
  static constexpr byte_table table_b = make_table([](int i) { return (offset_a(i) + 8) % 128; });
  static constexpr byte_table table_b_late = make_table([](int i) { return (offset_a(i) + 8 - tail_from) & 63; });
  // Scales: bytes 0..31 the d of block l / 2 for fp16 lane l, bytes 32..63 the m likewise.
  static constexpr int offset_dm(int i) { return bytes * ((i % 32) / 4) + (i >= 32 ? 2 : 0) + i % 2; }
  static constexpr byte_table table_dm = make_table([](int i) { return offset_dm(i) % 128; });
  static constexpr byte_table table_dm_late = make_table([](int i) { return (offset_dm(i) - tail_from) & 63; });
  static constexpr __mmask64 late_q = ~__mmask64{0} << (8 * first_late);  // bytes of late blocks in V_a
  static constexpr __mmask64 late_dm = (~__mmask64{0} << (4 * first_late)) & 0xffffffffull;

  template <bool full>
  static group_weights load(const uint8_t* gp, int64_t nb) {
    const int64_t n = nb * bytes;
    const __m512i a = load64<full>(gp, n), b = load64<full>(gp + 64, n - 64);
    const __m512i c = load64<full>(gp + tail_from, n - tail_from);
    const __mmask64 late_d = late_dm | late_dm << 32;
    const __m512i va = _mm512_mask_permutexvar_epi8(_mm512_permutex2var_epi8(a, table_a.load(), b), late_q,
                                                    table_a_late.load(), c);
    const __m512i vb = _mm512_mask_permutexvar_epi8(_mm512_permutex2var_epi8(a, table_b.load(), b), late_q,
                                                    table_b_late.load(), c);
    const __m512i dm = _mm512_mask_permutexvar_epi8(_mm512_permutex2var_epi8(a, table_dm.load(), b), late_d,
                                                    table_dm_late.load(), c);
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

  static __m512i dot(const group_weights& g, const act_t* x) {
    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g.w[0], _mm512_load_si512(x->q));
    d = _mm512_dpbusd_epi32(d, g.w[1], _mm512_load_si512(x->q + 64));
    d = _mm512_dpbusd_epi32(d, g.w[2], _mm512_load_si512(x->q + 128));
    return _mm512_dpbusd_epi32(d, g.w[3], _mm512_load_si512(x->q + 192));
  }

  /// The first four blocks only (lanes 0..7): for a last octet of at most four blocks.
  static __m256i dot_half(const group_weights& g, const act_t* x) {
    auto lo = [](__m512i v) { return _mm512_castsi512_si256(v); };
    auto xq = [&](int k) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x->q + 64 * k)); };
    __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo(g.w[0]), xq(0));
    d = _mm256_dpbusd_epi32(d, lo(g.w[1]), xq(1));
    d = _mm256_dpbusd_epi32(d, lo(g.w[2]), xq(2));
    return _mm256_dpbusd_epi32(d, lo(g.w[3]), xq(3));
  }
};

/// Q8_0 (34-byte blocks: d, 32 signed bytes). A group spans 136 bytes, read as [0, 64), [64, 128)
/// for the first halves and scales and [8, 72), [72, 136) for the second halves.
struct q8_group {
  static constexpr int bytes = 34;
  static constexpr bool has_min = false;

  static constexpr byte_table table_1 = make_table([](int i) { return bytes * (i / 16) + 2 + i % 16; });
  static constexpr byte_table table_2 = make_table([](int i) { return bytes * (i / 16) + 18 + i % 16 - 8; });
  static constexpr byte_table table_d = make_table([](int i) { return bytes * ((i % 32) / 8) + i % 2; });
  const __m512i idx_1 = table_1.load(), idx_2 = table_2.load(), idx_d = table_d.load();

  template <bool full>
  group_weights load(const uint8_t* gp, int64_t n_blocks) const {
    const int64_t n = n_blocks * bytes;
    const __m512i a = load64<full>(gp, n), b = load64<full>(gp + 64, n - 64);
    const __m512i a2 = load64<full>(gp + 8, n - 8), c = load64<full>(gp + 72, n - 72);
    group_weights g;
    g.w1 = _mm512_permutex2var_epi8(a, idx_1, b);
    g.w2 = _mm512_permutex2var_epi8(a2, idx_2, c);
    g.dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a, idx_d, b)));
    const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i corr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, g.w1), k128, g.w2);
    g.ncorr = _mm512_sub_epi32(_mm512_setzero_si512(), corr);
    return g;
  }

  static __m512i dot(const group_weights& g, const uint8_t* xq) {  // xq holds q + 128
    const __m512i d = _mm512_dpbusd_epi32(g.ncorr, _mm512_load_si512(xq), g.w1);
    return _mm512_dpbusd_epi32(d, _mm512_load_si512(xq + 64), g.w2);
  }
};

inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

template <class B, int R>
struct q_micro {
  template <int C>
  static void run(const uint8_t* const* rows, const uint8_t* const* acts, int n_rows, int64_t n_in, float* y,
                  int64_t ldy) {
    static_assert(R == 4);
    const B unpack;
    const int64_t n_blocks = n_in / 32, n_full = n_blocks / 4;
    constexpr int64_t group_bytes = 4 * B::bytes;
    __m512 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
    // Weights outer (unpacked once per tile row and group), activations re-read from L1 per row.
    auto step = [&](int64_t g, int64_t nb, auto full) {
      for (int r = 0; r < R; ++r) {
        const group_weights gw = unpack.template load<decltype(full)::value>(rows[r] + g * group_bytes, nb);
        for (int c = 0; c < C; ++c) {
          const auto* ag = reinterpret_cast<const act_group*>(acts[c]) + g;
          const __m512 v = _mm512_cvtepi32_ps(B::dot(gw, ag->q));
          acc[c][r] = _mm512_fmadd_ps(v, _mm512_mul_ps(gw.dw, _mm512_load_ps(ag->d)), acc[c][r]);
          if constexpr (B::has_min) acc[c][r] = _mm512_fmadd_ps(gw.mw, _mm512_load_ps(ag->s), acc[c][r]);
        }
      }
    };
    for (int64_t g = 0; g < n_full; ++g) step(g, 4, std::true_type{});
    if (n_blocks % 4 != 0) step(n_full, n_blocks % 4, std::false_type{});
    for (int c = 0; c < C; ++c) {
      const __m256 sums[4] = {fold(acc[c][0]), fold(acc[c][1]), fold(acc[c][2]), fold(acc[c][3])};
      store_row_sums<4>(sums, n_rows, y + c * ldy);
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
      return {act_kind::q8x4, gemm_q<q4_group<dtype::q4_0>>};
    case dtype::q4_1:
      return {act_kind::q8x4, gemm_q<q4_group<dtype::q4_1>>};
    case dtype::q8_0:
      return {act_kind::q8x4_u, gemm_q<q8_group>};
    case dtype::q4_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q4_k>};
    case dtype::q5_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q5_k>};
    case dtype::q6_k:
      return {act_kind::q8_k, gemm_kquant<dtype::q6_k>};
  }
  return {};
}

}  // namespace troupe::kernels::detail

#else

namespace troupe::kernels::detail {
kernel find_kernel_avx512(dtype) { return {}; }
}  // namespace troupe::kernels::detail

#endif
