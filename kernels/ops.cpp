#include "kernels/ops.hpp"

#include <immintrin.h>

#include <algorithm>
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

// sigmoid(x) for 8 floats from e = exp(-|x|), which never overflows: 1 / (1 + e) for x >= 0,
// e / (1 + e) below.
inline __m256 sigmoid256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256_neg(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
  const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), x);  // x's sign bit picks e / (1 + e)
}

inline float sigmoid(float x) {
  const float e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
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

// silu(g) * up = g * sigmoid(g) * up.
void swiglu(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid256(g)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

// GELU, tanh form: 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3).
void geglu(float* gate, const float* up, int64_t n) {
  constexpr float two_c = 2.0f * 0.79788456080286535588f, coef = 0.044715f;
  int64_t i = 0;
  const __m256 vc = _mm256_set1_ps(two_c), va = _mm256_set1_ps(coef), one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 t = _mm256_mul_ps(_mm256_mul_ps(vc, g), _mm256_fmadd_ps(_mm256_mul_ps(va, g), g, one));  // 2u
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid256(t)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g * sigmoid(two_c * g * (1.0f + coef * g * g)) * up[i];
  }
}

void kv_store_row(const kv_layer_view& kv, int32_t block, int slot, const float* k, const float* v) {
  for (int h = 0; h < kv.n_kv_heads; ++h) {
    store_f16(kv.k_at(block, slot, h), k + (int64_t)h * kv.head_dim, kv.head_dim);
    store_f16(kv.v_at(block, slot, h), v + (int64_t)h * kv.head_dim, kv.head_dim);
  }
}

namespace {

// {sum(a), sum(b), sum(c), sum(d)} of four 8-lane vectors.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// G (<= 4) query heads that share the KV head at offset `off` (elements from slot 0 of a block),
// over positions [p0, p1) (p1 > p0):
// per head the largest score m, l = sum of exp(score - m), acc = sum of exp(score - m) * V
// (unnormalised). qs: the G heads' rows, scaled, G * hd floats (hd a multiple of 8). Each K and
// V row is loaded and converted once for all G heads; positions go 4 at a time through one
// horizontal reduction. sc: G * (p1 - p0) floats.
template <int G>
void partial_group(const float* qs, int hd, int64_t p0, int64_t p1, const kv_layer_view& kv, const int32_t* table,
                   int64_t off, float* m, float* l, float* acc, float* sc) {
  const int nv = hd / 8;
  const int64_t row = kv.slot_step();
  const int64_t n = p1 - p0;
  const int bs = kv.block_size;
  __m128 vmx[G];
  float mx[G];
  for (int g = 0; g < G; ++g) {
    vmx[g] = _mm_set1_ps(-INFINITY);
    mx[g] = -INFINITY;
  }
  // Scores, block by block (no division per position).
  for (int64_t p = p0; p < p1;) {
    const int64_t b = p / bs;
    const int64_t end = std::min<int64_t>(p1, (b + 1) * bs);
    const fp16_t* kb = kv.k_base + table[b] * kv.block_stride + off;  // position b * bs
    for (; p + 4 <= end; p += 4) {
      __m256 a[G][4];
      for (int t = 0; t < 4; ++t) {
        const fp16_t* k = kb + (p + t - b * bs) * row;
        __m256 kf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)k));
        for (int g = 0; g < G; ++g) a[g][t] = _mm256_mul_ps(_mm256_loadu_ps(qs + g * hd), kf);
        for (int j = 1; j < nv; ++j) {
          kf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k + 8 * j)));
          for (int g = 0; g < G; ++g) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * hd + 8 * j), kf, a[g][t]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m128 d = hsum4(a[g][0], a[g][1], a[g][2], a[g][3]);
        _mm_storeu_ps(sc + g * n + (p - p0), d);
        vmx[g] = _mm_max_ps(vmx[g], d);
      }
    }
    for (; p < end; ++p) {
      const fp16_t* k = kb + (p - b * bs) * row;
      for (int g = 0; g < G; ++g) {
        const float d = dot_f32_f16(qs + g * hd, k, hd);
        sc[g * n + (p - p0)] = d;
        mx[g] = std::max(mx[g], d);
      }
    }
  }
  // Weights exp(score - m), their sum in double so long contexts lose nothing.
  for (int g = 0; g < G; ++g) {
    float m4[4];
    _mm_storeu_ps(m4, vmx[g]);
    for (float v : m4) mx[g] = std::max(mx[g], v);
    float* w = sc + g * n;
    double sum = 0.0;
    int64_t i = 0;
    const __m256 vm = _mm256_set1_ps(mx[g]);
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp256_neg(_mm256_sub_ps(_mm256_loadu_ps(w + i), vm));
      _mm256_storeu_ps(w + i, e);
      sum += (double)hsum(e);
    }
    for (; i < n; ++i) sum += (w[i] = std::exp(w[i] - mx[g]));
    m[g] = mx[g];
    l[g] = (float)sum;
  }
  // Weighted V rows, 4 vectors (one cache line) of each row at a time, G accumulators each.
  for (int j0 = 0; j0 < nv; j0 += 4) {
    const int w = std::min(4, nv - j0);
    __m256 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t p = p0; p < p1;) {
      const int64_t b = p / bs;
      const int64_t end = std::min<int64_t>(p1, (b + 1) * bs);
      const fp16_t* vb = kv.v_base + table[b] * kv.block_stride + off + 8 * j0;  // position b * bs
      for (; p < end; ++p) {
        const fp16_t* v = vb + (p - b * bs) * row;
        __m256 wp[G];
        for (int g = 0; g < G; ++g) wp[g] = _mm256_broadcast_ss(sc + g * n + (p - p0));
        for (int j = 0; j < w; ++j) {
          const __m256 vf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v + 8 * j)));
          for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(wp[g], vf, a[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < w; ++j) _mm256_storeu_ps(acc + g * hd + 8 * (j0 + j), a[g][j]);
  }
}

// The same for any head_dim, one head at a time (head_dim not a multiple of 8).
void partial_head_generic(const float* qs, int hd, int64_t p0, int64_t p1, const kv_layer_view& kv, const int32_t* table,
                          int64_t off, float* m, float* l, float* acc, float* sc) {
  const int bs = kv.block_size;
  float mx = -INFINITY;
  for (int64_t p = p0; p < p1; ++p) {
    const float d = dot_f32_f16(qs, kv.k_at(table[p / bs], (int)(p % bs), 0) + off, hd);
    sc[p - p0] = d;
    mx = std::max(mx, d);
  }
  double sum = 0.0;
  for (int i = 0; i < hd; ++i) acc[i] = 0.0f;
  for (int64_t p = p0; p < p1; ++p) {
    const float e = std::exp(sc[p - p0] - mx);
    sum += e;
    axpy_f16(acc, e, kv.v_at(table[p / bs], (int)(p % bs), 0) + off, hd);
  }
  *m = mx;
  *l = (float)sum;
}

}  // namespace

void attention_partial(const float* q, int n_heads, int64_t p0, int64_t p1, const kv_layer_view& kv,
                       const int32_t* block_table, float scale, int h0, int h1, float* m, float* l, float* acc,
                       float* scratch) {
  const int hd = kv.head_dim;
  const int group = n_heads / kv.n_kv_heads;
  float* qs = scratch;                       // up to 4 scaled query rows
  float* sc = scratch + 4 * (int64_t)hd;     // their scores
  for (int h = h0; h < h1;) {
    // The heads from h that share its KV head, at most 4.
    const int kvh = h / group;
    const int g = std::min({4, h1 - h, (kvh + 1) * group - h});
    for (int64_t i = 0; i < (int64_t)g * hd; ++i) qs[i] = q[(int64_t)h * hd + i] * scale;
    const int64_t off = kvh * kv.head_step();
    float* mh = m + (h - h0);
    float* lh = l + (h - h0);
    float* ah = acc + (int64_t)(h - h0) * hd;
    if (hd % 8 != 0) {
      for (int i = 0; i < g; ++i)
        partial_head_generic(qs + (int64_t)i * hd, hd, p0, p1, kv, block_table, off, mh + i, lh + i, ah + (int64_t)i * hd, sc);
    } else {
      switch (g) {
        case 1: partial_group<1>(qs, hd, p0, p1, kv, block_table, off, mh, lh, ah, sc); break;
        case 2: partial_group<2>(qs, hd, p0, p1, kv, block_table, off, mh, lh, ah, sc); break;
        case 3: partial_group<3>(qs, hd, p0, p1, kv, block_table, off, mh, lh, ah, sc); break;
        default: partial_group<4>(qs, hd, p0, p1, kv, block_table, off, mh, lh, ah, sc); break;
      }
    }
    h += g;
  }
}

void attention_merge(int n_parts, int n_heads, int head_dim, const float* m, const float* l, const float* acc,
                     float* out) {
  for (int h = 0; h < n_heads; ++h) {
    float mx = -INFINITY;
    for (int i = 0; i < n_parts; ++i) mx = std::max(mx, m[(int64_t)i * n_heads + h]);
    double den = 0.0;
    float* o = out + (int64_t)h * head_dim;
    for (int j = 0; j < head_dim; ++j) o[j] = 0.0f;
    for (int i = 0; i < n_parts; ++i) {
      const float f = std::exp(m[(int64_t)i * n_heads + h] - mx);
      den += (double)f * l[(int64_t)i * n_heads + h];
      const float* a = acc + ((int64_t)i * n_heads + h) * head_dim;
      for (int j = 0; j < head_dim; ++j) o[j] += f * a[j];
    }
    const float inv = (float)(1.0 / den);
    for (int j = 0; j < head_dim; ++j) o[j] *= inv;
  }
}

void attention_row(const float* q, int n_heads, int64_t pos, const kv_layer_view& kv,
                   const int32_t* block_table, float scale, float* out, int h0, int h1, float* scratch) {
  const int n = h1 - h0;
  float* m = scratch;
  float* l = m + n;
  attention_partial(q, n_heads, 0, pos + 1, kv, block_table, scale, h0, h1, m, l, out + (int64_t)h0 * kv.head_dim,
                    l + n);
  for (int h = 0; h < n; ++h) {
    const float inv = 1.0f / l[h];
    float* o = out + (int64_t)(h0 + h) * kv.head_dim;
    for (int j = 0; j < kv.head_dim; ++j) o[j] *= inv;
  }
}

}  // namespace troupe::kernels
