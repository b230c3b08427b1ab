// Portable kernels: the fallback where no SIMD level is available and the plainest statement of
// each integer dot product (the SIMD kernels compute the same sums, only faster).
#include <algorithm>
#include <cstring>

#include "kernels/fp16.hpp"
#include "kernels/matmul_impl.hpp"

namespace troupe::kernels::detail {

namespace {

inline const uint8_t* weight_row(const weight_view& w, int64_t o) {
  return static_cast<const uint8_t*>(w.data) + static_cast<size_t>(o) * w.row_stride;
}

/// The q8x4 activation value of block b, element j (0..31) of a row.
inline int act_q(const act_group* row, int64_t b, int j) {
  return static_cast<int8_t>(row[b / 4].q[act_group_pos(static_cast<int>(b % 4) * 32 + j)]);
}
inline float act_d(const act_group* row, int64_t b) { return row[b / 4].d[4 * (b % 4)]; }
inline float act_s(const act_group* row, int64_t b) { return 4.0f * row[b / 4].s[4 * (b % 4)]; }

/// One dot product of a weight row with one activation row.
template <dtype T>
float dot_row(const uint8_t* wr, const uint8_t* ar, int64_t n_in);

template <>
float dot_row<dtype::q4_0>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  const auto* wb = reinterpret_cast<const block_q4_0*>(wr);
  const auto* a = reinterpret_cast<const act_group*>(ar);
  float sum = 0.0f;
  for (int64_t b = 0; b < n_in / 32; ++b) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += ((wb[b].qs[j] & 0x0f) - 8) * act_q(a, b, j);
      isum += ((wb[b].qs[j] >> 4) - 8) * act_q(a, b, j + 16);
    }
    sum += fp16_to_f32(wb[b].d) * act_d(a, b) * static_cast<float>(isum);
  }
  return sum;
}

template <>
float dot_row<dtype::q4_1>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  const auto* wb = reinterpret_cast<const block_q4_1*>(wr);
  const auto* a = reinterpret_cast<const act_group*>(ar);
  float sum = 0.0f;
  for (int64_t b = 0; b < n_in / 32; ++b) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += (wb[b].qs[j] & 0x0f) * act_q(a, b, j);
      isum += (wb[b].qs[j] >> 4) * act_q(a, b, j + 16);
    }
    // sum_j (d q_j + m) * dx qx_j = d dx sum(q qx) + m (dx sum(qx))
    sum += fp16_to_f32(wb[b].d) * act_d(a, b) * static_cast<float>(isum) + fp16_to_f32(wb[b].m) * act_s(a, b);
  }
  return sum;
}

template <>
float dot_row<dtype::q8_0>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  const auto* wb = reinterpret_cast<const block_q8_0*>(wr);
  const auto* a = reinterpret_cast<const act_group*>(ar);
  float sum = 0.0f;
  for (int64_t b = 0; b < n_in / 32; ++b) {
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += wb[b].qs[j] * act_q(a, b, j);
    sum += fp16_to_f32(wb[b].d) * act_d(a, b) * static_cast<float>(isum);
  }
  return sum;
}

/// The 6-bit scale and min of sub-block j (0..7) of a q4_k / q5_k super-block.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/// q4_k and q5_k: sum_j (d sc_j q - dmin m_j) x  over sub-blocks j of 32.
template <bool five_bit>
float dot_k4(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  const auto* a = reinterpret_cast<const act_block_k*>(ar);
  float sum = 0.0f;
  for (int64_t b = 0; b < n_in / qk_k; ++b) {
    const uint8_t* scales;
    const uint8_t* qs;
    const uint8_t* qh = nullptr;
    float d, dmin;
    if constexpr (five_bit) {
      const auto& wb = reinterpret_cast<const block_q5_k*>(wr)[b];
      scales = wb.scales, qs = wb.qs, qh = wb.qh, d = fp16_to_f32(wb.d), dmin = fp16_to_f32(wb.dmin);
    } else {
      const auto& wb = reinterpret_cast<const block_q4_k*>(wr)[b];
      scales = wb.scales, qs = wb.qs, d = fp16_to_f32(wb.d), dmin = fp16_to_f32(wb.dmin);
    }
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, scales, sc, m);
      const uint8_t* q = qs + 32 * (j / 2);
      int dot = 0;
      for (int l = 0; l < 32; ++l) {
        int v = j % 2 == 0 ? (q[l] & 0x0f) : (q[l] >> 4);
        if (five_bit) v |= ((qh[l] >> j) & 1) << 4;
        dot += v * a[b].q[32 * j + l];
      }
      isum += sc * dot;
      msum += m * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
    }
    sum += a[b].d * (d * static_cast<float>(isum) - dmin * static_cast<float>(msum));
  }
  return sum;
}

template <>
float dot_row<dtype::q4_k>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  return dot_k4<false>(wr, ar, n_in);
}

template <>
float dot_row<dtype::q5_k>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  return dot_k4<true>(wr, ar, n_in);
}

template <>
float dot_row<dtype::q6_k>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  const auto* wb = reinterpret_cast<const block_q6_k*>(wr);
  const auto* a = reinterpret_cast<const act_block_k*>(ar);
  float sum = 0.0f;
  for (int64_t b = 0; b < n_in / qk_k; ++b) {
    // Weight p (0..255) is q6(p) - 32 with scale scales[p / 16]; q6 assembled as in dequant.cpp.
    int isum = 0;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = wb[b].ql + 64 * h;
      const uint8_t* qh = wb[b].qh + 32 * h;
      int dots[8] = {};
      for (int l = 0; l < 32; ++l) {
        const int q[4] = {(ql[l] & 0x0f) | ((qh[l] & 3) << 4), (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                          (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
        for (int k = 0; k < 4; ++k) dots[2 * k + l / 16] += (q[k] - 32) * a[b].q[128 * h + 32 * k + l];
      }
      for (int s = 0; s < 8; ++s) isum += wb[b].scales[8 * h + s] * dots[s];
    }
    sum += fp16_to_f32(wb[b].d) * a[b].d * static_cast<float>(isum);
  }
  return sum;
}

template <class Load>
float dot_float(const uint8_t* wr, const float* x, int64_t n_in, Load load) {
  float sum = 0.0f;
  for (int64_t k = 0; k < n_in; ++k) sum += load(wr, k) * x[k];
  return sum;
}

/// Element k of a row of 2- or 4-byte values (rows need not be aligned: row_stride is free).
template <class V>
inline V element(const uint8_t* row, int64_t k) {
  V v;
  std::memcpy(&v, row + static_cast<size_t>(k) * sizeof(V), sizeof(V));
  return v;
}

template <>
float dot_row<dtype::f32>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  return dot_float(wr, reinterpret_cast<const float*>(ar), n_in,
                   [](const uint8_t* p, int64_t k) { return element<float>(p, k); });
}

template <>
float dot_row<dtype::f16>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  return dot_float(wr, reinterpret_cast<const float*>(ar), n_in,
                   [](const uint8_t* p, int64_t k) { return fp16_to_f32(element<fp16_t>(p, k)); });
}

template <>
float dot_row<dtype::bf16>(const uint8_t* wr, const uint8_t* ar, int64_t n_in) {
  return dot_float(wr, reinterpret_cast<const float*>(ar), n_in,
                   [](const uint8_t* p, int64_t k) { return bf16_to_f32(element<bf16_t>(p, k)); });
}

template <dtype T>
void gemm(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy) {
  // Blocks of rows x activations small enough to stay in cache while they are reused.
  constexpr int64_t row_block = 16, act_block = 8;
  for (int64_t ob = o0; ob < o1; ob += row_block) {
    const int64_t oe = std::min(o1, ob + row_block);
    for (int64_t ib = 0; ib < a.m; ib += act_block) {
      const int64_t ie = std::min(a.m, ib + act_block);
      for (int64_t o = ob; o < oe; ++o)
        for (int64_t i = ib; i < ie; ++i)
          y[i * ldy + o] = dot_row<T>(weight_row(w, o), a.data + static_cast<size_t>(i) * a.stride, w.n_in);
    }
  }
}

}  // namespace

kernel find_kernel_scalar(dtype t) {
  switch (t) {
    case dtype::f32:
      return {act_kind::f32, gemm<dtype::f32>};
    case dtype::f16:
      return {act_kind::f32, gemm<dtype::f16>};
    case dtype::bf16:
      return {act_kind::f32, gemm<dtype::bf16>};
    case dtype::q4_0:
      return {act_kind::q8x4, gemm<dtype::q4_0>};
    case dtype::q4_1:
      return {act_kind::q8x4, gemm<dtype::q4_1>};
    case dtype::q8_0:
      return {act_kind::q8x4, gemm<dtype::q8_0>};
    case dtype::q4_k:
      return {act_kind::q8_k, gemm<dtype::q4_k>};
    case dtype::q5_k:
      return {act_kind::q8_k, gemm<dtype::q5_k>};
    case dtype::q6_k:
      return {act_kind::q8_k, gemm<dtype::q6_k>};
    case dtype::q5_0:  // repacked to q8_0 when a model is loaded (engine::model)
      return {};
  }
  return {};
}

}  // namespace troupe::kernels::detail
