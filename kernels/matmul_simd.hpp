// 256-bit kernels shared by the AVX2 and AVX-512 levels: the tiling loop, the float-weight
// kernels and the k-quant dot products. Included only by matmul_avx2.cpp and matmul_avx512.cpp,
// each compiled with its own target flags; everything here has internal linkage (unnamed
// namespace) so the two copies never merge at link time. With AVX512_VNNI the k-quant sums use
// vpdpwssd; on Zen 4 (512-bit ops split in two) these 256-bit loops lose nothing to 512-bit ones.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/matmul_impl.hpp"

namespace troupe::kernels::detail {
namespace {

// ---- helpers ----

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

/// Sums of the lanes of four vectors, in that order.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float fp16_load(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline const uint8_t* weight_row(const weight_view& w, int64_t o) {
  return static_cast<const uint8_t*>(w.data) + static_cast<size_t>(o) * w.row_stride;
}

/// How far ahead of the rows in use the next rows are prefetched (into L2): far enough to cover the
/// memory latency at full bandwidth, measured best at 8-16 KiB on Zen 4.
constexpr int64_t prefetch_distance_bytes = 12 << 10;

/// Calls f(std::integral_constant<int, C>) for the runtime n in [1, CMax].
template <int CMax, class F>
inline void with_count(int n, F&& f) {
  if constexpr (CMax > 1) {
    if (n < CMax) return with_count<CMax - 1>(n, f);
  }
  f(std::integral_constant<int, CMax>{});
}

/// Drives a micro-kernel over weight rows [o0, o1) x all activation rows. The micro-kernel
/// computes an R x C tile: Micro::template run<C>(rows, next, acts, n_rows, n_in, y, ldy) with
/// rows[R] (tail tiles repeat the last row; only n_rows outputs per activation row are written),
/// next[R] rows about prefetch_distance_bytes ahead (to prefetch) and acts[C]. Rows are taken
/// row_block at a time so that a block of weights stays in cache while every activation row
/// passes over it; a tile of C activation rows stays in L1 over the block.
template <class Micro, int R, int CMax, int64_t row_block = 16>
void tile_loop(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  const uint8_t* rows[R];
  const uint8_t* next[R];
  const uint8_t* acts[CMax];
  const int64_t ahead =
      R * std::clamp<int64_t>(prefetch_distance_bytes / (R * static_cast<int64_t>(w.row_stride)), 1, 16);
  for (int64_t ob = o0; ob < o1; ob += row_block) {
    const int64_t oe = std::min(o1, ob + row_block);
    for (int64_t i = 0; i < a.m; i += CMax) {
      const int nc = static_cast<int>(std::min<int64_t>(CMax, a.m - i));
      for (int c = 0; c < nc; ++c) acts[c] = a.data + static_cast<size_t>(i + c) * a.stride;
      for (int64_t o = ob; o < oe; o += R) {
        const int nr = static_cast<int>(std::min<int64_t>(R, oe - o));
        for (int r = 0; r < R; ++r) {
          rows[r] = weight_row(w, o + std::min(r, nr - 1));
          next[r] = weight_row(w, std::min(o + ahead + r, o1 - 1));
        }
        float* yt = y + i * ldy + o;
        with_count<CMax>(
            nc, [&](auto cc) { Micro::template run<decltype(cc)::value>(rows, next, acts, nr, w.n_in, yt, ldy); });
      }
    }
  }
}

/// With one activation row the weights stream from memory once: while a tile's group g (up to
/// 192 bytes per row) is in use, fetch the same bytes of rows further ahead into L2. (Zen 4's
/// own prefetchers leave the kernel waiting on memory about as long as it computes.)
template <int R>
inline void prefetch_group(const uint8_t* const* next, int64_t offset) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 3; ++l) _mm_prefetch(reinterpret_cast<const char*>(next[r] + offset + 64 * l), _MM_HINT_T1);
}

/// Stores acc[r] reduced to y[r] for r < n_rows. Every output is summed in the same order
/// (hsum4's) whatever the tile shape, so results do not depend on how rows are split over
/// threads or tiles.
template <int R>
inline void store_row_sums(const __m256* acc, int n_rows, float* y) {
  for (int r0 = 0; r0 < n_rows; r0 += 4) {
    auto at = [&](int r) { return acc[std::min(r0 + r, R - 1)]; };
    alignas(16) float sums[4];
    _mm_store_ps(sums, hsum4(at(0), at(1), at(2), at(3)));
    for (int r = 0; r < 4 && r0 + r < n_rows; ++r) y[r0 + r] = sums[r];
  }
}

// ---- float weights (f32, f16, bf16) against float activations ----

template <dtype T>
inline __m256 load8(const uint8_t* row, int64_t k) {
  if constexpr (T == dtype::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (T == dtype::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
  } else {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

template <dtype T>
inline float load1(const uint8_t* row, int64_t k) {
  if constexpr (T == dtype::f32) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  } else if constexpr (T == dtype::f16) {
    return fp16_load(row + 2 * k);
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

template <dtype T, int R>
struct float_micro {
  template <int C>
  static void run(const uint8_t* const* rows, const uint8_t* const*, const uint8_t* const* acts, int n_rows,
                  int64_t n_in, float* y, int64_t ldy) {
    const float* x[C];
    for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const float*>(acts[c]);
    __m256 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n_in; k += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 wv = load8<T>(rows[r], k);
        for (int c = 0; c < C; ++c) acc[c][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[c] + k), acc[c][r]);
      }
    }
    for (int c = 0; c < C; ++c) {
      float* yc = y + c * ldy;
      store_row_sums<R>(acc[c], n_rows, yc);
      for (int r = 0; r < n_rows; ++r)
        for (int64_t kk = k; kk < n_in; ++kk) yc[r] += load1<T>(rows[r], kk) * x[c][kk];
    }
  }
};

template <dtype T, int CMax>
void gemm_float(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  if (a.m == 1)
    tile_loop<float_micro<T, 4>, 4, 1>(w, o0, o1, a, y, ldy);
  else
    tile_loop<float_micro<T, 4>, 4, CMax>(w, o0, o1, a, y, ldy);
}

// ---- k-quants against act_block_k ----

/// int32 lanes += 16-bit pairs of p times the 16-bit scales sc.
inline __m256i madd_acc(__m256i acc, __m256i p, __m256i sc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, sc);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
}

/// The eight 6-bit scales (bytes 0..7) and mins (bytes 8..15) of a q4_k / q5_k super-block.
inline void unpack_scales_k4(const uint8_t* packed, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);  // mins 4..7
  const uint32_t mins_lo = u[1] & low6;                       // mins 0..3
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);         // scales 4..7
  u[2] = mins_lo;
  u[0] &= low6;  // scales 0..3
  std::memcpy(out, u, 16);
}

/// sum_j m_j (bsums[2j] + bsums[2j + 1]) for the eight mins m of a q4_k / q5_k super-block.
inline int min_sum_k4(const uint8_t* mins8, const act_block_k& a) {
  const __m128i bs_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums));
  const __m128i bs_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums + 8));
  const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins8)));
  const __m128i prod = _mm_madd_epi16(mins, _mm_hadd_epi16(bs_lo, bs_hi));
  __m128i s = _mm_add_epi32(prod, _mm_unpackhi_epi64(prod, prod));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

/// One q4_k / q5_k weight row against C activation rows (sharing the unpacked weights):
/// out[c] = sum over super-blocks of dx (d sum_j sc_j dot_j - dmin sum_j m_j sum_j(q)).
template <bool five_bit, int C>
void dot_k4(const uint8_t* wr, const act_block_k* const* a, int64_t n_blocks, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), bit0 = _mm256_set1_epi8(1);
  float sum[C] = {};
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t *scales, *qs, *qh = nullptr;
    float d, dmin;
    if constexpr (five_bit) {
      const auto& wb = reinterpret_cast<const block_q5_k*>(wr)[b];
      scales = wb.scales, qs = wb.qs, qh = wb.qh;
      d = fp16_load(reinterpret_cast<const uint8_t*>(&wb.d));
      dmin = fp16_load(reinterpret_cast<const uint8_t*>(&wb.dmin));
    } else {
      const auto& wb = reinterpret_cast<const block_q4_k*>(wr)[b];
      scales = wb.scales, qs = wb.qs;
      d = fp16_load(reinterpret_cast<const uint8_t*>(&wb.d));
      dmin = fp16_load(reinterpret_cast<const uint8_t*>(&wb.dmin));
    }
    alignas(16) uint8_t sm[16];
    unpack_scales_k4(scales, sm);
    __m256i hbits = five_bit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (five_bit) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, bit0), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), bit0), 4));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      const __m256i sc_lo = _mm256_set1_epi16(sm[2 * j]), sc_hi = _mm256_set1_epi16(sm[2 * j + 1]);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a[c][b].q + 64 * j;
        const __m256i x_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32));
        isum[c] = madd_acc(isum[c], _mm256_maddubs_epi16(lo, x_lo), sc_lo);
        isum[c] = madd_acc(isum[c], _mm256_maddubs_epi16(hi, x_hi), sc_hi);
      }
    }
    for (int c = 0; c < C; ++c) {
      const int msum = min_sum_k4(sm + 8, a[c][b]);
      sum[c] += a[c][b].d * (d * static_cast<float>(hsum_i32(isum[c])) - dmin * static_cast<float>(msum));
    }
  }
  for (int c = 0; c < C; ++c) out[c] = sum[c];
}

/// One q6_k weight row against C activation rows:
/// out[c] = sum over super-blocks of d dx sum_s sc_s (dot_s(q) - 32 sum_s(x)), sub-blocks s of 16.
template <int C>
void dot_q6_k(const uint8_t* wr, const act_block_k* const* a, int64_t n_blocks, float* out) {
  const auto* wb = reinterpret_cast<const block_q6_k*>(wr);
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(3);
  float sum[C] = {};
  for (int64_t b = 0; b < n_blocks; ++b) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb[b].scales));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    alignas(16) int8_t sc[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(sc), sc8);
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = wb[b].ql + 64 * h;
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[b].qh + 32 * h));
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4)),
      };
      for (int k = 0; k < 4; ++k) {  // 32 values: sub-blocks 8h + 2k (first 16) and 8h + 2k + 1
        const __m256i scales =
            _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * k + 1]), _mm_set1_epi16(sc[8 * h + 2 * k]));
        for (int c = 0; c < C; ++c) {
          const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(a[c][b].q + 128 * h + 32 * k));
          isum[c] = madd_acc(isum[c], _mm256_maddubs_epi16(q[k], x), scales);
        }
      }
    }
    const float d = fp16_load(reinterpret_cast<const uint8_t*>(&wb[b].d));
    for (int c = 0; c < C; ++c) {
      // 32 sum_s sc_s bsum_s corrects for the -32 offset of the 6-bit values.
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c][b].bsums));
      const int corr = hsum_i32(_mm256_madd_epi16(sc16, bsums));
      sum[c] += d * a[c][b].d * static_cast<float>(hsum_i32(isum[c]) - 32 * corr);
    }
  }
  for (int c = 0; c < C; ++c) out[c] = sum[c];
}

template <dtype T>
void gemm_kquant(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  const int64_t n_blocks = w.n_in / qk_k;
  constexpr int act_tile = 4;      // activation rows sharing each unpacked weight row
  constexpr int64_t row_block = 16;  // weight rows kept in cache while the activations pass
  const act_block_k* acts[act_tile];
  for (int64_t ob = o0; ob < o1; ob += row_block) {
    const int64_t oe = std::min(o1, ob + row_block);
    for (int64_t i = 0; i < a.m; i += act_tile) {
      const int nc = static_cast<int>(std::min<int64_t>(act_tile, a.m - i));
      for (int c = 0; c < nc; ++c)
        acts[c] = reinterpret_cast<const act_block_k*>(a.data + static_cast<size_t>(i + c) * a.stride);
      for (int64_t o = ob; o < oe; ++o) {
        with_count<act_tile>(nc, [&](auto cc) {
          constexpr int C = decltype(cc)::value;
          float out[C];
          if constexpr (T == dtype::q6_k)
            dot_q6_k<C>(weight_row(w, o), acts, n_blocks, out);
          else
            dot_k4<T == dtype::q5_k, C>(weight_row(w, o), acts, n_blocks, out);
          for (int c = 0; c < C; ++c) y[(i + c) * ldy + o] = out[c];
        });
      }
    }
  }
}

}  // namespace
}  // namespace troupe::kernels::detail
