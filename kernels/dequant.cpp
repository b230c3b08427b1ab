// Scalar reference dequantization. Each formula mirrors gguf-py's numpy code operation by
// operation (same products, same order, float32 throughout) so that results are bit-identical;
// in particular no multiply-add may be contracted into an FMA.
#include "kernels/dequant.hpp"

#include <cstring>

#include "kernels/fp16.hpp"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace troupe::kernels {

namespace {

void dequant_f16(const fp16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_f32(x[i]);
}

void dequant_bf16(const bf16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}

void dequant_q4_0(const block_q4_0* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, y += 32) {
    const float d = fp16_to_f32(x[b].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((x[b].qs[j] & 0x0f) - 8);
      y[j + 16] = d * static_cast<float>((x[b].qs[j] >> 4) - 8);
    }
  }
}

void dequant_q4_1(const block_q4_1* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, y += 32) {
    const float d = fp16_to_f32(x[b].d);
    const float m = fp16_to_f32(x[b].m);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(x[b].qs[j] & 0x0f) + m;
      y[j + 16] = d * static_cast<float>(x[b].qs[j] >> 4) + m;
    }
  }
}

// The signed 5-bit values (-16..15) of a q5_0 block, in weight order.
void q5_0_values(const block_q5_0& b, int8_t* v) {
  uint32_t qh;
  std::memcpy(&qh, b.qh, sizeof qh);
  for (int j = 0; j < 16; ++j) {
    v[j] = (int8_t)(((b.qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
    v[j + 16] = (int8_t)(((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  }
}

void dequant_q5_0(const block_q5_0* x, float* y, int64_t n_blocks) {
  int8_t v[32];
  for (int64_t b = 0; b < n_blocks; ++b, y += 32) {
    const float d = fp16_to_f32(x[b].d);
    q5_0_values(x[b], v);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(v[j]) * d;
  }
}

void dequant_q8_0(const block_q8_0* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, y += 32) {
    const float d = fp16_to_f32(x[b].d);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(x[b].qs[j]) * d;
  }
}

/// The 6-bit scale and min of sub-block j (0..7) of a q4_k / q5_k super-block.
inline void scale_min_k4(int j, const uint8_t* s, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequant_q4_k(const block_q4_k* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = fp16_to_f32(x[b].d);
    const float dmin = fp16_to_f32(x[b].dmin);
    const uint8_t* q = x[b].qs;
    for (int j = 0; j < 8; j += 2, q += 32) {  // 32 bytes hold sub-blocks j (low) and j+1 (high)
      uint8_t sc, m;
      scale_min_k4(j, x[b].scales, sc, m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      scale_min_k4(j + 1, x[b].scales, sc, m);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0f) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void dequant_q5_k(const block_q5_k* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = fp16_to_f32(x[b].d);
    const float dmin = fp16_to_f32(x[b].dmin);
    const uint8_t* ql = x[b].qs;
    const uint8_t* qh = x[b].qh;
    for (int j = 0; j < 8; j += 2, ql += 32) {  // sub-block j takes bit j of qh[l] as bit 4
      uint8_t sc, m;
      scale_min_k4(j, x[b].scales, sc, m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      scale_min_k4(j + 1, x[b].scales, sc, m);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        const int q = (ql[l] & 0x0f) | (((qh[l] >> j) & 1) << 4);
        *y++ = d1 * static_cast<float>(q) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int q = (ql[l] >> 4) | (((qh[l] >> (j + 1)) & 1) << 4);
        *y++ = d2 * static_cast<float>(q) - m2;
      }
    }
  }
}

void dequant_q6_k(const block_q6_k* x, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, y += qk_k) {
    const float d = fp16_to_f32(x[b].d);
    // Two halves of 128 weights; in each, ql[64] and qh[32] give four runs of 32 weights.
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x[b].ql + 64 * h;
      const uint8_t* qh = x[b].qh + 32 * h;
      const int8_t* sc = x[b].scales + 8 * h;
      float* yh = y + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        yh[l] = (d * static_cast<float>(sc[is + 0])) * static_cast<float>(q1);
        yh[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
        yh[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
        yh[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
      }
    }
  }
}

}  // namespace

void repack_q5_0_to_q8_0(const block_q5_0* x, block_q8_0* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    y[b].d = x[b].d;
    q5_0_values(x[b], y[b].qs);
  }
}

void dequantize_row(dtype t, const void* src, float* dst, int64_t n) {
  const int64_t n_blocks = n / traits(t).block_size;
  switch (t) {
    case dtype::f32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case dtype::f16:
      return dequant_f16(static_cast<const fp16_t*>(src), dst, n);
    case dtype::bf16:
      return dequant_bf16(static_cast<const bf16_t*>(src), dst, n);
    case dtype::q4_0:
      return dequant_q4_0(static_cast<const block_q4_0*>(src), dst, n_blocks);
    case dtype::q4_1:
      return dequant_q4_1(static_cast<const block_q4_1*>(src), dst, n_blocks);
    case dtype::q5_0:
      return dequant_q5_0(static_cast<const block_q5_0*>(src), dst, n_blocks);
    case dtype::q8_0:
      return dequant_q8_0(static_cast<const block_q8_0*>(src), dst, n_blocks);
    case dtype::q4_k:
      return dequant_q4_k(static_cast<const block_q4_k*>(src), dst, n_blocks);
    case dtype::q5_k:
      return dequant_q5_k(static_cast<const block_q5_k*>(src), dst, n_blocks);
    case dtype::q6_k:
      return dequant_q6_k(static_cast<const block_q6_k*>(src), dst, n_blocks);
  }
}

}  // namespace troupe::kernels
