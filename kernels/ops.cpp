#include "kernels/ops.hpp"

#include <immintrin.h>

#include <cmath>

namespace troupe::kernels {

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Dot product of n floats with n fp16 values (n a multiple of 8 on the fast path).
inline float dot_f32_f16(const float* a, const fp16_t* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i))), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i + 8))), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i))), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * _cvtsh_ss(b[i]);
  return s;
}

// out[0:n] += w * b[0:n] (fp16)
inline void axpy_f16(float* out, float w, const fp16_t* b, int n) {
  const __m256 vw = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 o = _mm256_loadu_ps(out + i);
    o = _mm256_fmadd_ps(vw, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i))), o);
    _mm256_storeu_ps(out + i, o);
  }
  for (; i < n; ++i) out[i] += w * _cvtsh_ss(b[i]);
}

// exp(x) for 8 floats, x <= 0 (softmax after max subtraction): Cephes-style range reduction and
// a degree-6 polynomial; relative error ~2e-7. Inputs below -87 return 0.
inline __m256 exp256_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out[0:8*NV] = sum_p w[p] * V_p, accumulators in registers. NV = head_dim / 8.
template <int NV>
inline void weighted_sum_f16(float* out, const float* w, int64_t n_pos, const kv_layer_view& kv, const int32_t* table,
                             int64_t offset) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n_pos; ++p) {
    const fp16_t* v = kv.v_at(table[p / kv.block_size], (int)(p % kv.block_size)) + offset;
    const __m256 wp = _mm256_set1_ps(w[p]);
    for (int j = 0; j < NV; ++j)
      acc[j] = _mm256_fmadd_ps(wp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v + 8 * j))), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

inline void store_f16(fp16_t* dst, const float* src, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace

void rmsnorm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0.0;  // double: the mean of squares over thousands of values must not lose bits
  for (int64_t i = 0; i < n; ++i) ss += (double)x[i] * x[i];
  const float scale = (float)(1.0 / std::sqrt(ss / (double)n + (double)eps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void rope_cos_sin(int64_t pos, int n_rot, float base, const float* freq_factors, float* cos_sin) {
  for (int i = 0; i < n_rot / 2; ++i) {
    double theta = (double)pos * std::pow((double)base, -2.0 * i / n_rot);
    if (freq_factors) theta /= freq_factors[i];
    cos_sin[2 * i] = (float)std::cos(theta);
    cos_sin[2 * i + 1] = (float)std::sin(theta);
  }
}

void rope_row(float* x, int n_heads, int head_dim, int n_rot, const float* cos_sin, rope_style style) {
  const int half = n_rot / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + (int64_t)h * head_dim;
    for (int i = 0; i < half; ++i) {
      const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
      const int a = style == rope_style::normal ? 2 * i : i;
      const int b = style == rope_style::normal ? 2 * i + 1 : i + half;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * c - x1 * s;
      v[b] = x0 * s + x1 * c;
    }
  }
}

void swiglu(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void kv_store_row(const kv_layer_view& kv, int32_t block, int slot, const float* k, const float* v) {
  const int n = kv.n_kv_heads * kv.head_dim;
  store_f16(kv.k_at(block, slot), k, n);
  store_f16(kv.v_at(block, slot), v, n);
}

void attention_row(const float* q, int n_heads, int64_t pos, const kv_layer_view& kv,
                   const int32_t* block_table, float scale, float* out, int h0, int h1, float* scratch) {
  const int hd = kv.head_dim;
  const int group = n_heads / kv.n_kv_heads;
  const int64_t n_pos = pos + 1;
  for (int h = h0; h < h1; ++h) {
    const int g = h / group;
    const float* qh = q + (int64_t)h * hd;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n_pos; ++p) {
      const fp16_t* k = kv.k_at(block_table[p / kv.block_size], (int)(p % kv.block_size)) + (int64_t)g * hd;
      const float s = dot_f32_f16(qh, k, hd) * scale;
      scratch[p] = s;
      mx = s > mx ? s : mx;
    }
    // Softmax weights, vectorized; the sum in double so long contexts lose nothing.
    double sum = 0.0;
    int64_t p = 0;
    const __m256 vmx = _mm256_set1_ps(mx);
    for (; p + 8 <= n_pos; p += 8) {
      const __m256 e = exp256_neg(_mm256_sub_ps(_mm256_loadu_ps(scratch + p), vmx));
      _mm256_storeu_ps(scratch + p, e);
      sum += (double)hsum(e);
    }
    for (; p < n_pos; ++p) {
      const float e = std::exp(scratch[p] - mx);
      scratch[p] = e;
      sum += e;
    }
    const float inv = (float)(1.0 / sum);
    for (p = 0; p < n_pos; ++p) scratch[p] *= inv;
    float* oh = out + (int64_t)h * hd;
    const int64_t off = (int64_t)g * hd;
    switch (hd) {
      case 32: weighted_sum_f16<4>(oh, scratch, n_pos, kv, block_table, off); break;
      case 64: weighted_sum_f16<8>(oh, scratch, n_pos, kv, block_table, off); break;
      case 128: weighted_sum_f16<16>(oh, scratch, n_pos, kv, block_table, off); break;
      default:
        for (int i = 0; i < hd; ++i) oh[i] = 0.0f;
        for (int64_t q = 0; q < n_pos; ++q)
          axpy_f16(oh, scratch[q], kv.v_at(block_table[q / kv.block_size], (int)(q % kv.block_size)) + off, hd);
    }
  }
}

}  // namespace troupe::kernels
