// The GEMVs that finish their own outputs (launch_options::gemv_swiglu, gemv_rope, and the writer
// side of gemv_fold_norm), written once for any weight format, with the folded norm's helpers.
// `Rows` supplies one CTA's dot products:
//
//   __device__ void cta_dots(int64_t row, const bf16* x, float (&sums)[gemv_warps][B]) const;
//
// called by every thread of the CTA: warp w computes the B dot products of weight row `row` (its
// own; -1: none, the warp only waits for the kernel ahead) and lane b stores the b-th in
// sums[w][b], then the CTA meets at a barrier. Before it returns every thread has waited for the
// kernel ahead (pdl_wait), so the epilogues below may write. bf16 weights: quant.cu's bf16_rows;
// GGUF blocks: quant_layout.cuh's quant_rows. Each rounds a dot product to bf16 before its
// epilogue, as the plain GEMV stores it, so the fused kernel gives the bits of that GEMV followed
// by swiglu, rope_qkv_store or add_rmsnorm's residual update.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rope.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int gemv_warps = 4;  // rows per block

// Partial sums of squares a writer of n rows leaves per batch row: one per CTA.
__host__ __device__ inline int64_t fold_parts(int64_t n) { return (n + gemv_warps - 1) / gemv_warps; }

// A reader's RMSNorm scale for one batch row: 1 / sqrt(sum of the writer's partial sums / n +
// eps), the partials summed lane by lane in a fixed order (the same value in every warp and kernel
// for one sumsq and n). Each warp of a reader computes it at the end of its row, so the loads are
// 16-byte ones, 8 a lane in flight (n = 4096: 1,024 partials, one trip of 8 loads a lane rather
// than 32 dependent-on-the-loop 4-byte ones), where the partials allow (a multiple of 4, aligned).
__device__ __forceinline__ float norm_fold_scale(const float* __restrict__ sumsq, int64_t n, float eps) {
  const int64_t parts = fold_parts(n);
  const int lane = threadIdx.x & 31;
  float ss = 0.0f;
  if (parts % 4 == 0 && reinterpret_cast<uintptr_t>(sumsq) % 16 == 0) {
    const float4* p = reinterpret_cast<const float4*>(sumsq);
    const int64_t n4 = parts / 4;
    constexpr int U = 8;
    int64_t i = lane;
    for (; i + 32 * (U - 1) < n4; i += 32 * U) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldg(p + i + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u) ss += (v[u].x + v[u].y) + (v[u].z + v[u].w);
    }
    for (; i < n4; i += 32) {
      const float4 v = __ldg(p + i);
      ss += (v.x + v.y) + (v.z + v.w);
    }
  } else {
    for (int64_t i = lane; i < parts; i += 32) ss += sumsq[i];
  }
  return 1.0f / sqrtf(warp_sum(ss) / float(n) + eps);
}

// acc scaled as a gemv_norm reader scales its dot products: by each batch row's RMSNorm scale.
template <int B>
__device__ __forceinline__ void apply_norm_reader(const gemv_norm& norm, int64_t n_in, float (&acc)[B]) {
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] *= norm_fold_scale(norm.sumsq_in + b * fold_parts(n_in), n_in, norm.eps);
}

// The residual add and RMSNorm carried by a GEMV (gemv_norm's writer): each output rounded to
// bf16 and added to the fp32 residual as add_rmsnorm adds it (x + float(bf16 y)), y gets the next
// norm's input before its scale (residual * norm_w, bf16), and sumsq_out this CTA's sum of squares
// of its 4 rows' new residual values per batch row (rows in order; norm_fold_parts(n_out) a row).
template <class Rows, int B>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_writer_kernel(Rows w, int64_t n_out, const bf16* __restrict__ x,
                                                                      bf16* __restrict__ y, gemv_norm norm) {
  TROUPE_SHARED(float[gemv_warps][B], sums);
  TROUPE_SHARED(float[gemv_warps][B], squares);
  pdl_launch_dependents();
  const int64_t o = int64_t(blockIdx.x) * gemv_warps + (threadIdx.x >> 5);
  w.cta_dots(o < n_out ? o : -1, x, sums);
  if (threadIdx.x < gemv_warps * B) {
    const int k = threadIdx.x / B, b = threadIdx.x % B;
    const int64_t row = int64_t(blockIdx.x) * gemv_warps + k;
    float sq = 0.0f;  // the last CTA's rows past n_out add nothing
    if (row < n_out) {
      float* r = norm.residual + b * n_out + row;
      const float v = *r + __bfloat162float(__float2bfloat16_rn(sums[k][b]));
      *r = v;
      y[b * n_out + row] = __float2bfloat16_rn(v * norm.norm_w[row]);
      sq = v * v;
    }
    squares[k][b] = sq;
  }
  __syncthreads();
  if (threadIdx.x < B) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < gemv_warps; ++k) ss += squares[k][threadIdx.x];
    norm.sumsq_out[threadIdx.x * gridDim.x + blockIdx.x] = ss;
  }
}

// The gate|up GEMV with SwiGLU on its outputs: CTA c computes act[:, 2c] and act[:, 2c + 1], its
// warps taking gate rows 2c, 2c + 1 and up rows d_ff + 2c, d_ff + 2c + 1, then silu_mul as swiglu
// does, without the gate|up round trip or a launch.
template <class Rows, int B>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_swiglu_kernel(Rows w, int64_t d_ff, const bf16* __restrict__ x,
                                                                      bf16* __restrict__ act) {
  static_assert(gemv_warps == 4, "two gate and two up rows a CTA");
  TROUPE_SHARED(float[gemv_warps][B], sums);
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5;
  const int64_t j = int64_t(blockIdx.x) * 2 + (warp & 1);
  // Gate row j (warps 0, 1) or up row j (2, 3); the last CTA of an odd d_ff has one column.
  w.cta_dots(j < d_ff ? (warp >> 1) * d_ff + j : -1, x, sums);
  if (threadIdx.x < 2 * B) {
    const int pair = threadIdx.x & 1, b = threadIdx.x >> 1;
    const int64_t jj = int64_t(blockIdx.x) * 2 + pair;
    if (jj < d_ff) {
      const float g = __bfloat162float(__float2bfloat16_rn(sums[pair][b]));
      const float u = __bfloat162float(__float2bfloat16_rn(sums[2 + pair][b]));
      act[b * d_ff + jj] = __float2bfloat16_rn(silu_mul(g, u));
    }
  }
}

// The qkv GEMV with bias, RoPE and the KV-cache write on its own outputs: CTA c computes work
// items 2c and 2c + 1 (qkv_item, qkv_items.hpp), a warp per column, then finishes each item as
// rope_qkv_store does (rope.cuh), without the qkv round trip or a launch. Batch row t is token
// row t of st.
template <class Rows, int B>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_rope_kernel(Rows w, const bf16* __restrict__ x, qkv_rope_args r) {
  static_assert(gemv_warps == 4, "two work items of two columns a CTA");
  TROUPE_SHARED(float[gemv_warps][B], sums);
  pdl_launch_dependents();
  const rope_params& rp = r.rope;
  const int warp = threadIdx.x >> 5;
  const int n_items = qkv_item_count(rp.n_heads, rp.n_kv_heads, rp.head_dim);
  const bool neox = rp.kind == rope_kind::neox;
  const auto item = [&](int p) { return qkv_item(rp.n_heads, rp.n_kv_heads, rp.head_dim, rp.n_rot, neox, p); };
  const int p = blockIdx.x * 2 + (warp >> 1);
  // The last CTA of an odd item count has one.
  w.cta_dots(p < n_items ? int64_t(item(p).row(rp.n_heads, rp.n_kv_heads, rp.head_dim, warp & 1)) : -1, x, sums);
  if (threadIdx.x >= 2 * B) return;
  const int local = threadIdx.x & 1, t = threadIdx.x >> 1;
  const int pp = blockIdx.x * 2 + local;
  if (pp >= n_items) return;
  const qkv_item it = item(pp);
  const float x0 = __bfloat162float(__float2bfloat16_rn(sums[2 * local][t]));
  const float x1 = __bfloat162float(__float2bfloat16_rn(sums[2 * local + 1][t]));
  fp16* k_slot = kv_slot(r.st, r.kv, t, r.layer);
  if (it.h < 0) {
    fp16* v_dst = k_slot + int64_t(r.kv.block_size) * r.kv.row_elems();
    v_dst[it.a] = rope_v_value(x0, r.bv, it.a);
    v_dst[it.b] = rope_v_value(x1, r.bv, it.b);
  } else {
    const float2 cs = it.j < rp.n_rot / 2 ? rope_angle(rp, r.st.token_pos[t], it.j) : float2{};
    rope_qk_pair(rp, it.h, it.j, it.a, it.b, x0, x1, r.bq, r.bk, cs, r.q_out + int64_t(t) * rp.n_heads * rp.head_dim, k_slot);
  }
}

// CTAs of the fused kernels: two columns of act, or two qkv work items, each.
inline unsigned swiglu_ctas(int64_t d_ff) { return unsigned((d_ff + 1) / 2); }
inline unsigned rope_ctas(const rope_params& rp) { return unsigned((qkv_item_count(rp.n_heads, rp.n_kv_heads, rp.head_dim) + 1) / 2); }

// The shapes gemv_rope_kernel's work items assume (rope_qkv_store's).
inline void check_rope_args(const char* name, const rope_params& rp) {
  if (rp.n_rot % 2 != 0 || rp.n_rot > rp.head_dim || rp.head_dim % 2 != 0 || rp.n_heads <= 0 || rp.n_kv_heads <= 0)
    throw cuda_error(std::string(name) + ": n_rot and head_dim must be even with n_rot <= head_dim, heads > 0");
  if (rp.q_norm || rp.k_norm) throw cuda_error(std::string(name) + ": QK-norm is rope_qkv_store's only");
}

}  // namespace

}  // namespace troupe::kernels::cuda
