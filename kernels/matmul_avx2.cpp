// AVX2 kernels. Q4_0, Q4_1 and Q8_0 weights against act_group activations (signed q8): two
// weight blocks fill a 256-bit register, `maddubs` multiplies unsigned by signed bytes into 16-bit
// pairs and `madd` widens them, leaving 32-bit lanes 0..3 for the first block and 4..7 for the
// second, which the block scales then weight in float. Q8_0's signed weights take the usual sign
// transfer (|w| times x with w's sign). Float weights and k-quants come from matmul_simd.hpp.
#include "kernels/matmul_impl.hpp"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include "kernels/matmul_simd.hpp"

namespace troupe::kernels::detail {

namespace {

/// The two blocks 2p and 2p + 1 of a group of one weight row, ready for the integer dot.
struct pair_weights {
  __m256i w1, w2;  // values for act bytes [32p, 32p + 32) and [64 + 32p, 64 + 32p + 32)
  __m256 dw;       // block scales, each over its 4 lanes
  __m256 mw;       // Q4: the additive term per block (Q4_1 m, Q4_0 -8 d), over its 4 lanes
};

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

/// Spreads fp16 words 0 and 2 (or 1 and 3) of v over lanes [0, 4) and [4, 8).
inline __m256 spread_halves(__m128i v, int word) {
  const char a = static_cast<char>(2 * word), b = static_cast<char>(2 * word + 4);
  const __m128i idx = _mm_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
  return _mm256_cvtph_ps(_mm_shuffle_epi8(v, idx));
}

/// Q4_0 (bytes = 18) and Q4_1 (bytes = 20): d, [m], 16 bytes of nibbles.
template <dtype T>
struct q4_pair {
  static constexpr int bytes = T == dtype::q4_1 ? 20 : 18;
  static constexpr int qs = T == dtype::q4_1 ? 4 : 2;

  template <bool two>  // false: block 2p + 1 is missing (last group of a row)
  static pair_weights load(const uint8_t* bp) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m128i q0 = load128(bp + qs);
    const __m128i q1 = two ? load128(bp + bytes + qs) : _mm_setzero_si128();
    const __m256i v = _mm256_set_m128i(q1, q0);
    pair_weights p;
    p.w1 = _mm256_and_si256(v, low4);
    p.w2 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m128i dm = _mm_setr_epi32(load32(bp), two ? load32(bp + bytes) : 0, 0, 0);  // d0 m0 d1 m1
    p.dw = spread_halves(dm, 0);
    p.mw = T == dtype::q4_1 ? spread_halves(dm, 1) : _mm256_mul_ps(p.dw, _mm256_set1_ps(-8.0f));
    return p;
  }

  static __m256i dot(const pair_weights& p, __m256i x1, __m256i x2) {
    // Nibbles (0..15) times int8: each 16-bit pair sum is at most 2 * 15 * 127, so two still fit.
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(p.w1, x1), _mm256_maddubs_epi16(p.w2, x2));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  }
  static constexpr bool has_min = true;
};

/// Q8_0: d, 32 signed bytes.
struct q8_pair {
  static constexpr int bytes = 34;

  template <bool two>
  static pair_weights load(const uint8_t* bp) {
    pair_weights p;
    p.w1 = _mm256_set_m128i(two ? load128(bp + bytes + 2) : _mm_setzero_si128(), load128(bp + 2));
    p.w2 = _mm256_set_m128i(two ? load128(bp + bytes + 18) : _mm_setzero_si128(), load128(bp + 18));
    const __m128i dd = _mm_setr_epi32(load32(bp), two ? load32(bp + bytes) : 0, 0, 0);
    p.dw = spread_halves(dd, 0);  // the word after d is a weight byte pair: ignored
    return p;
  }

  static __m256i dot(const pair_weights& p, __m256i x1, __m256i x2) {
    // |w| * (x with w's sign); a 16-bit pair can reach 2 * 127 * 127, so widen each separately.
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(p.w1, p.w1), _mm256_sign_epi8(x1, p.w1)), ones);
    const __m256i b =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(p.w2, p.w2), _mm256_sign_epi8(x2, p.w2)), ones);
    return _mm256_add_epi32(a, b);
  }
  static constexpr bool has_min = false;
};

template <class B, int R>
struct q_micro {
  template <int C>
  static void run(const uint8_t* const* rows, const uint8_t* const* next, const uint8_t* const* acts, int n_rows,
                  int64_t n_in, float* y, int64_t ldy) {
    const int64_t n_blocks = n_in / 32;
    __m256 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
    // Weights outer (unpacked once per tile row), activations re-read from L1 for each row.
    auto step = [&](int64_t pair, auto two) {
      const int64_t g = pair / 2;
      const int p = static_cast<int>(pair % 2);
      if (C == 1 && p == 0) prefetch_group<R>(next, g * 4 * B::bytes);
      for (int r = 0; r < R; ++r) {
        const pair_weights pw = B::template load<decltype(two)::value>(rows[r] + 2 * pair * B::bytes);
        for (int c = 0; c < C; ++c) {
          const auto* ag = reinterpret_cast<const act_group*>(acts[c]) + g;
          const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(ag->q + 32 * p));
          const __m256i x2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(ag->q + 64 + 32 * p));
          const __m256 v = _mm256_cvtepi32_ps(B::dot(pw, x1, x2));
          acc[c][r] = _mm256_fmadd_ps(v, _mm256_mul_ps(pw.dw, _mm256_load_ps(ag->d + 8 * p)), acc[c][r]);
          if constexpr (B::has_min) acc[c][r] = _mm256_fmadd_ps(pw.mw, _mm256_load_ps(ag->s + 8 * p), acc[c][r]);
        }
      }
    };
    int64_t pair = 0;  // pairs of blocks; pair 2g + p is half p of group g
    for (; 2 * pair + 2 <= n_blocks; ++pair) step(pair, std::true_type{});
    if (2 * pair < n_blocks) step(pair, std::false_type{});  // odd block count: one block left
    for (int c = 0; c < C; ++c) store_row_sums<R>(acc[c], n_rows, y + c * ldy);
  }
};

template <class B>
void gemm_q(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  if (a.m == 1)
    tile_loop<q_micro<B, 4>, 4, 1>(w, o0, o1, a, y, ldy);
  else
    tile_loop<q_micro<B, 2>, 2, 4>(w, o0, o1, a, y, ldy);
}

}  // namespace

kernel find_kernel_avx2(dtype t) {
  switch (t) {
    case dtype::f32:
      return {act_kind::f32, gemm_float<dtype::f32, 3>};
    case dtype::f16:
      return {act_kind::f32, gemm_float<dtype::f16, 3>};
    case dtype::bf16:
      return {act_kind::f32, gemm_float<dtype::bf16, 3>};
    case dtype::q4_0:
      return {act_kind::q8x4, gemm_q<q4_pair<dtype::q4_0>>};
    case dtype::q4_1:
      return {act_kind::q8x4, gemm_q<q4_pair<dtype::q4_1>>};
    case dtype::q8_0:
      return {act_kind::q8x4, gemm_q<q8_pair>};
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
kernel find_kernel_avx2(dtype) { return {}; }
}  // namespace troupe::kernels::detail

#endif
