// Activation quantization for the integer matmul kernels: per 32 values (act_group) or per 256
// (act_block_k), symmetric, d = max|x| / 127, q = round-half-even(x / d). The scalar and AVX2 code
// perform the same float operations in the same order, so they produce identical bytes.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/matmul_impl.hpp"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace troupe::kernels::detail {

namespace {

constexpr int64_t group_values = 128;

// ---- scalar ----

void quantize_group_scalar(const float* x, int64_t n_blocks, bool offset, act_group& g) {
  std::memset(g.q, offset ? 0x80 : 0, sizeof(g.q));
  std::fill(std::begin(g.d), std::end(g.d), 0.0f);
  std::fill(std::begin(g.s), std::end(g.s), 0.0f);
  for (int b = 0; b < n_blocks; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      sum += q;
      g.q[act_group_pos(32 * b + i)] = static_cast<uint8_t>(offset ? q + 128 : q);
    }
    const float s = d * static_cast<float>(sum) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      g.d[4 * b + l] = d;
      g.s[4 * b + l] = s;
    }
  }
}

void quantize_octet_scalar(const float* x, int64_t n_blocks, act_octet& g) {
  std::memset(g.q, 0, sizeof(g.q));
  std::fill(std::begin(g.d), std::end(g.d), 0.0f);
  std::fill(std::begin(g.s), std::end(g.s), 0.0f);
  for (int b = 0; b < n_blocks; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      sum += q;
      g.q[act_octet_pos(32 * b + i)] = static_cast<uint8_t>(q);
    }
    const float s = d * static_cast<float>(sum) * 0.5f;
    g.d[2 * b] = g.d[2 * b + 1] = d;
    g.s[2 * b] = g.s[2 * b + 1] = s;
  }
}

void quantize_block_k_scalar(const float* x, act_block_k& blk) {
  float amax = 0.0f;
  for (int i = 0; i < qk_k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < qk_k / 16; ++j) {
    int sum = 0;
    for (int i = 16 * j; i < 16 * j + 16; ++i) {
      const int q = static_cast<int>(std::nearbyint(x[i] * id));
      blk.q[i] = static_cast<int8_t>(q);
      sum += q;
    }
    blk.bsums[j] = static_cast<int16_t>(sum);
  }
  blk.d = d;
}

// ---- AVX2 ----

#if defined(__AVX2__)

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int hsum8_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

/// Quantizes 32 values: returns them as 32 int8 in order, and their sum and scale.
inline __m256i quantize32_avx2(const float* x, float& d_out, int& sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
  }
  const float m = hmax8(amax);
  const float d = m / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));  // half-even
  sum_out = hsum8_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  d_out = d;
  // packs work per 128-bit lane; the 64-bit permutes restore the order.
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
  return _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xd8);
}

void quantize_group_avx2(const float* x, int64_t n_blocks, bool offset, act_group& g) {
  const __m256i flip = _mm256_set1_epi8(offset ? static_cast<char>(0x80) : 0);
  for (int b = 0; b < 4; ++b) {
    float d = 0.0f;
    int sum = 0;
    __m256i q = _mm256_setzero_si256();
    if (b < n_blocks) q = quantize32_avx2(x + 32 * b, d, sum);
    q = _mm256_xor_si256(q, flip);
    _mm_store_si128(reinterpret_cast<__m128i*>(g.q + 16 * b), _mm256_castsi256_si128(q));
    _mm_store_si128(reinterpret_cast<__m128i*>(g.q + 64 + 16 * b), _mm256_extracti128_si256(q, 1));
    const float s = d * static_cast<float>(sum) * 0.25f;
    _mm_store_ps(g.d + 4 * b, _mm_set1_ps(d));
    _mm_store_ps(g.s + 4 * b, _mm_set1_ps(s));
  }
}

void quantize_octet_avx2(const float* x, int64_t n_blocks, act_octet& g) {
  for (int b = 0; b < 8; ++b) {
    float d = 0.0f;
    int sum = 0;
    __m256i q = _mm256_setzero_si256();
    if (b < n_blocks) q = quantize32_avx2(x + 32 * b, d, sum);
    // 8-value pieces to runs 0, 2, 1, 3 (see act_octet).
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(g.q + 8 * b), lo);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(g.q + 128 + 8 * b), _mm_unpackhi_epi64(lo, lo));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(g.q + 64 + 8 * b), hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(g.q + 192 + 8 * b), _mm_unpackhi_epi64(hi, hi));
    const float s = d * static_cast<float>(sum) * 0.5f;
    _mm_storel_pi(reinterpret_cast<__m64*>(g.d + 2 * b), _mm_set1_ps(d));
    _mm_storel_pi(reinterpret_cast<__m64*>(g.s + 2 * b), _mm_set1_ps(s));
  }
}

void quantize_block_k_avx2(const float* x, act_block_k& blk) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < qk_k; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  const float m = hmax8(amax);
  const float d = m / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  for (int i = 0; i < qk_k; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), id));
    blk.bsums[i / 16] = static_cast<int16_t>(hsum8_i32(_mm256_add_epi32(q[0], q[1])));
    blk.bsums[i / 16 + 1] = static_cast<int16_t>(hsum8_i32(_mm256_add_epi32(q[2], q[3])));
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
    _mm256_store_si256(reinterpret_cast<__m256i*>(blk.q + i),
                       _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xd8));
  }
  blk.d = d;
}

#endif  // __AVX2__

}  // namespace

size_t act_row_bytes(act_kind kind, int64_t n_in) {
  switch (kind) {
    case act_kind::f32:
      return 0;
    case act_kind::q8x4:
    case act_kind::q8x4_u:
      return static_cast<size_t>((n_in + group_values - 1) / group_values) * sizeof(act_group);
    case act_kind::q8x8:
      return static_cast<size_t>((n_in + 255) / 256) * sizeof(act_octet);
    case act_kind::q8_k:
      return static_cast<size_t>(n_in / qk_k) * sizeof(act_block_k);
  }
  return 0;
}

void quantize_rows(act_kind kind, isa level, const float* x, int64_t ldx, int64_t n_in, int64_t i0, int64_t i1,
                   uint8_t* dst, size_t stride) {
#if defined(__AVX2__)
  const bool simd = level >= isa::avx2;
#else
  const bool simd = false;
  (void)level;
#endif
  for (int64_t i = i0; i < i1; ++i) {
    const float* xr = x + i * ldx;
    uint8_t* row = dst + static_cast<size_t>(i) * stride;
    switch (kind) {
      case act_kind::f32:
        return;
      case act_kind::q8x4:
      case act_kind::q8x4_u: {
        const bool offset = kind == act_kind::q8x4_u;
        auto* groups = reinterpret_cast<act_group*>(row);
        const int64_t n_blocks = n_in / 32;
        for (int64_t g = 0; g * 4 < n_blocks; ++g) {
          const int64_t nb = std::min<int64_t>(4, n_blocks - 4 * g);
#if defined(__AVX2__)
          if (simd) {
            quantize_group_avx2(xr + g * group_values, nb, offset, groups[g]);
            continue;
          }
#endif
          quantize_group_scalar(xr + g * group_values, nb, offset, groups[g]);
        }
        break;
      }
      case act_kind::q8x8: {
        auto* octets = reinterpret_cast<act_octet*>(row);
        const int64_t n_blocks = n_in / 32;
        for (int64_t g = 0; g * 8 < n_blocks; ++g) {
          const int64_t nb = std::min<int64_t>(8, n_blocks - 8 * g);
#if defined(__AVX2__)
          if (simd) {
            quantize_octet_avx2(xr + g * 256, nb, octets[g]);
            continue;
          }
#endif
          quantize_octet_scalar(xr + g * 256, nb, octets[g]);
        }
        break;
      }
      case act_kind::q8_k: {
        auto* blocks = reinterpret_cast<act_block_k*>(row);
        for (int64_t b = 0; b < n_in / qk_k; ++b) {
#if defined(__AVX2__)
          if (simd) {
            quantize_block_k_avx2(xr + b * qk_k, blocks[b]);
            continue;
          }
#endif
          quantize_block_k_scalar(xr + b * qk_k, blocks[b]);
        }
        break;
      }
    }
  }
}

}  // namespace troupe::kernels::detail
