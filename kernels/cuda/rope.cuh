// RoPE and the KV-cache write, one pair of values at a time: shared by rope_qkv_store (ops.cu) and
// the qkv GEMV that applies them to its own outputs (quant.cu), so the two give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/qkv_items.hpp"

namespace troupe::kernels::cuda {

/// rope_pair_cols for rp (qkv_items.hpp).
__device__ __forceinline__ void rope_pair(const rope_params& rp, int j, int& a, int& b) {
  rope_pair_cols(rp.n_rot, rp.kind == rope_kind::neox, j, a, b);
}

/// cos and sin of pair i's angle at position pos. Double precision, as kernels::rope_cos_sin:
/// theta reaches tens of thousands of radians.
__device__ __forceinline__ float2 rope_angle(const rope_params& rp, int pos, int i) {
  double theta = double(pos) * pow(double(rp.base), -2.0 * i / rp.n_rot);
  if (rp.freq_factors) theta /= rp.freq_factors[i];
  double s, c;
  sincos(theta, &s, &c);
  return make_float2(float(c), float(s));
}

/// Token row t's KV-cache slot: the start of its K row in `layer` (V is block_size rows later).
__device__ __forceinline__ fp16* kv_slot(const step_layout& st, const kv_cache_view& kv, int t, int layer) {
  const int pos = st.token_pos[t];
  const int32_t block = seq_table(st, st.token_seq[t], kv.block_size)[pos / kv.block_size];
  return kv.k_block(block, layer) + int64_t(pos % kv.block_size) * kv.row_elems();
}

/// Work item j of Q or K head h (Q heads first) of one token row, its values x0, x1 at columns
/// a, b as the QKV GEMM left them: bias added, rotated by cs = rope_angle(.., j) when
/// j < n_rot / 2 (explicit rounding: no contraction left to the compiler), then Q stored into
/// q_row (bf16 [n_heads * head_dim]) or K into the cache slot k_slot (fp16).
__device__ __forceinline__ void rope_qk_pair(const rope_params& rp, int h, int j, int a, int b, float x0, float x1,
                                             const float* bq, const float* bk, float2 cs, bf16* q_row, fp16* k_slot) {
  const int q_dim = rp.n_heads * rp.head_dim;
  const int col = h * rp.head_dim;
  const float* bias = h < rp.n_heads ? bq : bk;
  const int bcol = h < rp.n_heads ? col : col - q_dim;
  if (bias) x0 += bias[bcol + a], x1 += bias[bcol + b];
  if (j < rp.n_rot / 2) {
    const float y0 = __fmaf_rn(x0, cs.x, -__fmul_rn(x1, cs.y));
    const float y1 = __fmaf_rn(x0, cs.y, __fmul_rn(x1, cs.x));
    x0 = y0, x1 = y1;
  }
  if (h < rp.n_heads) {
    q_row[col + a] = __float2bfloat16_rn(x0);
    q_row[col + b] = __float2bfloat16_rn(x1);
  } else {
    k_slot[bcol + a] = __float2half_rn(x0);
    k_slot[bcol + b] = __float2half_rn(x1);
  }
}

/// V value i of a token row as the cache stores it (bias bv optional).
__device__ __forceinline__ fp16 rope_v_value(float x, const float* bv, int i) {
  return __float2half_rn(x + (bv ? bv[i] : 0.0f));
}

}  // namespace troupe::kernels::cuda
