// Element-wise and per-row kernels: embedding gather, fused residual add + RMSNorm, SwiGLU (GeGLU), dtype
// conversions, and the fused bias + RoPE + KV-cache write. All are memory bound: rows are read
// with 16-byte vector loads where the row length and pointer alignment allow (a scalar
// instantiation handles the rest), math is fp32.
#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rope.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int row_threads = 256;    // per-row kernels: one block per row
constexpr int flat_threads = 256;   // flat element-wise kernels
constexpr int flat_max_blocks = 8192;
constexpr int rope_threads = 128;   // one block per (token row, head)

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// V consecutive values to or from registers; V is 1, 4 or 8 and the pointer is V-element aligned.
template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const float4 t = *reinterpret_cast<const float4*>(p + k);
      v[k] = t.x, v[k + 1] = t.y, v[k + 2] = t.z, v[k + 3] = t.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = p[k];
  }
}

template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) *reinterpret_cast<float4*>(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = v[k];
  }
}

// bf16 vectors travel as V/2 bf16 pairs in one 8- or 16-byte word.
template <int V>
struct bf16_word;
template <>
struct bf16_word<4> {
  using type = uint2;
};
template <>
struct bf16_word<8> {
  using type = uint4;
};

template <int V>
__device__ __forceinline__ void load(const bf16* p, float (&v)[V]) {
  if constexpr (V >= 4) {
    const auto w = *reinterpret_cast<const typename bf16_word<V>::type*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      v[2 * k] = f.x, v[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = __bfloat162float(p[k]);
  }
}

template <int V>
__device__ __forceinline__ void store(bf16* p, const float (&v)[V]) {
  if constexpr (V >= 4) {
    typename bf16_word<V>::type w;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&w);
#pragma unroll
    for (int k = 0; k < V / 2; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    *reinterpret_cast<typename bf16_word<V>::type*>(p) = w;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = __float2bfloat16_rn(v[k]);
  }
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it. Call once per kernel.
__device__ float block_sum(float v) {
  TROUPE_SHARED(float[32], part);
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? part[lane] : 0.0f;
  return warp_sum(v);
}

// RMSNorm rows: one pass of the row per thread where it fits (d_model 4096 at 4 values a thread
// is 1024 threads), so a decode row's two passes and reduction are not 4 loop trips deep.
int norm_threads(int n, int v) {
  const int t = ((n + v - 1) / v + 31) / 32 * 32;
  return t < 32 ? 32 : t > 1024 ? 1024 : t;
}

// SwiGLU: (CTAs across a row, rows); the y dimension is capped, the kernel loops over rows.
dim3 swiglu_grid(int rows, int d_ff, int v) {
  const int per_cta = row_threads * v;
  return dim3((unsigned)((d_ff + per_cta - 1) / per_cta), (unsigned)(rows < 65535 ? rows : 65535));
}

int grid_for(int64_t n_items, int threads) {
  const int64_t blocks = (n_items + threads - 1) / threads;
  return int(blocks < 1 ? 1 : blocks > flat_max_blocks ? flat_max_blocks : blocks);
}

// ---- per-row kernels --------------------------------------------------------------------------

template <int V>
__global__ void embed_rows_kernel(const bf16* table, const int32_t* tokens, float* out, int d, float scale) {
  pdl_launch_dependents();  // launched plainly (it follows the layout copy); the next kernel may start
  const bf16* src = table + int64_t(tokens[blockIdx.x]) * d;
  float* dst = out + int64_t(blockIdx.x) * d;
  for (int i = threadIdx.x * V; i < d; i += blockDim.x * V) {
    float v[V];
    load<V>(src + i, v);
    if (scale != 1.0f)
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] *= scale;
    store<V>(dst + i, v);
  }
}

template <int V>
__global__ void add_rmsnorm_kernel(float* residual, const bf16* add, const float* w, bf16* y, int n, float eps,
                                   const float* add_norm_w) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t off = int64_t(blockIdx.x) * n;
  float* x = residual + off;
  float add_scale = 1.0f;  // Gemma: the added row's own RMSNorm
  if (add && add_norm_w) {
    float ssa = 0.0f;
    for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
      float a[V];
      load<V>(add + off + i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) ssa += a[k] * a[k];
    }
    add_scale = 1.0f / sqrtf(block_sum(ssa) / float(n) + eps);
    __syncthreads();  // block_sum's shared partials are used again below
  }
  float ss = 0.0f;
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    float v[V];
    load<V>(x + i, v);
    if (add) {
      float a[V];
      load<V>(add + off + i, a);
      if (add_norm_w) {
        float g[V];
        load<V>(add_norm_w + i, g);
#pragma unroll
        for (int k = 0; k < V; ++k) a[k] = a[k] * add_scale * g[k];
      }
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] += a[k];
      store<V>(x + i, v);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) ss += v[k] * v[k];
  }
  const float scale = 1.0f / sqrtf(block_sum(ss) / float(n) + eps);
  // Each thread re-reads exactly the elements it wrote above, so no barrier is needed.
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    float v[V], g[V];
    load<V>(x + i, v);
    load<V>(w + i, g);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = v[k] * scale * g[k];
    store<V>(y + off + i, v);
  }
}

// Grid (chunks of the row, rows): at one row (decode, batch 1) the d_ff values spread over the
// whole GPU instead of one CTA.
template <int V, bool Gelu>
__global__ void glu_kernel(const bf16* gu, bf16* out, int rows, int d_ff) {
  pdl_launch_dependents();
  pdl_wait();
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const bf16* gate = gu + int64_t(r) * 2 * d_ff;
    const bf16* up = gate + d_ff;
    bf16* dst = out + int64_t(r) * d_ff;
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * V; i < d_ff; i += gridDim.x * blockDim.x * V) {
      float g[V], u[V];
      load<V>(gate + i, g);
      load<V>(up + i, u);
#pragma unroll
      for (int k = 0; k < V; ++k) g[k] = Gelu ? gelu_mul(g[k], u[k]) : silu_mul(g[k], u[k]);
      store<V>(dst + i, g);
    }
  }
}

// ---- flat element-wise kernels: chunks of V values, the ragged end element by element ----------

template <int V>
__global__ void add_residual_kernel(float* residual, const bf16* add, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += int64_t(gridDim.x) * blockDim.x * V) {
    if (i + V <= n) {
      float r[V], a[V];
      load<V>(residual + i, r);
      load<V>(add + i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) r[k] += a[k];
      store<V>(residual + i, r);
    } else {
      for (int64_t j = i; j < n; ++j) residual[j] += __bfloat162float(add[j]);
    }
  }
}

template <int V, class In, class Out>
__global__ void convert_kernel(const In* in, Out* out, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += int64_t(gridDim.x) * blockDim.x * V) {
    if (i + V <= n) {
      float v[V];
      load<V>(in + i, v);
      store<V>(out + i, v);
    } else {
      for (int64_t j = i; j < n; ++j) {
        float v[1];
        load<1>(in + j, v);
        store<1>(out + j, v);
      }
    }
  }
}

template <class In, class Out>
void convert(const In* in, Out* out, int64_t n, cudaStream_t stream, const char* name) {
  if (n <= 0) return;
  if (aligned(in, 32) && aligned(out, 32))
    launch_ordinary(convert_kernel<8, In, Out>, grid_for((n + 7) / 8, flat_threads), flat_threads, 0, stream, in, out, n);
  else
    launch_ordinary(convert_kernel<1, In, Out>, grid_for(n, flat_threads), flat_threads, 0, stream, in, out, n);
  check_launch(name);
}

// ---- RoPE + KV write ---------------------------------------------------------------------------

// Grid (token rows, Q heads + K heads + 1): a CTA rotates one Q or K head of one row (work item
// j < n_rot/2 rotates the pair RoPE couples, later items copy two unrotated dims from
// [n_rot, head_dim)); the last CTA of a row writes its V row. At one row (decode, batch 1) that
// is 41 CTAs for Llama-3-8B instead of one. With QK-norm (rp.q_norm / k_norm) the CTA first
// sums its head's squares: the head is RMS-normalized before it is rotated.
__global__ void rope_qkv_store_kernel(const bf16* qkv, const float* bq, const float* bk, const float* bv,
                                      rope_params rp, step_layout st, kv_cache_view kv, int layer, bf16* q_out) {
  TROUPE_DYNAMIC_SMEM(float2, cos_sin, 8);  // n_rot/2 (cos, sin) pairs for this row's position
  pdl_launch_dependents();
  pdl_wait();
  const int t = blockIdx.x, h = blockIdx.y;
  const int hd = rp.head_dim, half_hd = hd / 2;
  const int q_dim = rp.n_heads * hd, kv_dim = rp.n_kv_heads * hd;
  const bf16* src = qkv + int64_t(t) * (q_dim + 2 * kv_dim);
  fp16* k_slot = kv_slot(st, kv, t, layer);

  if (h == rp.n_heads + rp.n_kv_heads) {  // the V row (uniform over the CTA: no barrier below)
    fp16* v_dst = k_slot + int64_t(kv.block_size) * kv.row_elems();
    const bf16* v_src = src + q_dim + kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) v_dst[i] = rope_v_value(__bfloat162float(v_src[i]), bv, i);
    return;
  }

  for (int i = threadIdx.x; i < rp.n_rot / 2; i += blockDim.x) cos_sin[i] = rope_angle(rp, st.token_pos[t], i);
  __syncthreads();

  const int col = h * hd;  // Q heads then K heads are contiguous in the row
  const bool is_q = h < rp.n_heads;
  const float* norm_w = is_q ? rp.q_norm : rp.k_norm;
  const float* bias = is_q ? bq : bk;
  const int bcol = is_q ? col : col - q_dim;
  float norm_scale = 1.0f;
  if (norm_w) {  // uniform over the CTA
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
      const float v = __bfloat162float(src[col + i]) + (bias ? bias[bcol + i] : 0.0f);
      ss += v * v;
    }
    norm_scale = 1.0f / sqrtf(block_sum(ss) / float(hd) + rp.norm_eps);
  }
  for (int j = threadIdx.x; j < half_hd; j += blockDim.x) {
    int a, b;
    rope_pair(rp, j, a, b);
    float x0 = __bfloat162float(src[col + a]), x1 = __bfloat162float(src[col + b]);
    if (norm_w) {  // bias, then the norm; rope_qk_pair adds no bias then
      if (bias) x0 += bias[bcol + a], x1 += bias[bcol + b];
      x0 = x0 * norm_scale * norm_w[a];
      x1 = x1 * norm_scale * norm_w[b];
    }
    rope_qk_pair(rp, h, j, a, b, x0, x1, norm_w ? nullptr : bq, norm_w ? nullptr : bk,
                 j < rp.n_rot / 2 ? cos_sin[j] : float2{}, q_out + int64_t(t) * q_dim, k_slot);
  }
}

}  // namespace

void embed_rows(const bf16* table, const int32_t* tokens, float* out, int rows, int d, cudaStream_t stream,
                float scale) {
  if (rows <= 0 || d <= 0) return;
  if (d % 8 == 0 && aligned(table, 16) && aligned(out, 32))
    launch_ordinary(embed_rows_kernel<8>, rows, row_threads, 0, stream, table, tokens, out, d, scale);
  else
    launch_ordinary(embed_rows_kernel<1>, rows, row_threads, 0, stream, table, tokens, out, d, scale);
  check_launch("embed_rows");
}

void add_rmsnorm(float* residual, const bf16* add, const float* w, bf16* y, int rows, int n, float eps,
                 cudaStream_t stream, const float* add_norm_w) {
  if (rows <= 0 || n <= 0) return;
  if (n % 4 == 0 && aligned(residual, 16) && aligned(add, 8) && aligned(w, 16) && aligned(y, 8) && aligned(add_norm_w, 16))
    launch(add_rmsnorm_kernel<4>, rows, norm_threads(n, 4), 0, stream, residual, add, w, y, n, eps, add_norm_w);
  else
    launch(add_rmsnorm_kernel<1>, rows, norm_threads(n, 1), 0, stream, residual, add, w, y, n, eps, add_norm_w);
  check_launch("add_rmsnorm");
}

void add_residual(float* residual, const bf16* add, int rows, int n, cudaStream_t stream) {
  const int64_t total = int64_t(rows) * n;
  if (total <= 0) return;
  if (aligned(residual, 32) && aligned(add, 16))
    launch_ordinary(add_residual_kernel<8>, grid_for((total + 7) / 8, flat_threads), flat_threads, 0, stream, residual, add, total);
  else
    launch_ordinary(add_residual_kernel<1>, grid_for(total, flat_threads), flat_threads, 0, stream, residual, add, total);
  check_launch("add_residual");
}

namespace {
template <bool Gelu>
void glu(const bf16* gu, bf16* out, int rows, int d_ff, cudaStream_t stream, const char* name) {
  if (rows <= 0 || d_ff <= 0) return;
  if (d_ff % 8 == 0 && aligned(gu, 16) && aligned(out, 16))
    launch(glu_kernel<8, Gelu>, swiglu_grid(rows, d_ff, 8), row_threads, 0, stream, gu, out, rows, d_ff);
  else
    launch(glu_kernel<1, Gelu>, swiglu_grid(rows, d_ff, 1), row_threads, 0, stream, gu, out, rows, d_ff);
  check_launch(name);
}
}  // namespace

void swiglu(const bf16* gu, bf16* out, int rows, int d_ff, cudaStream_t stream) { glu<false>(gu, out, rows, d_ff, stream, "swiglu"); }

void geglu(const bf16* gu, bf16* out, int rows, int d_ff, cudaStream_t stream) { glu<true>(gu, out, rows, d_ff, stream, "geglu"); }

void f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream) {
  convert(in, out, n, stream, "f32_to_bf16");
}

void bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream) {
  convert(in, out, n, stream, "bf16_to_f32");
}

void rope_qkv_store(const bf16* qkv, const float* bq, const float* bk, const float* bv, const rope_params& rp,
                    const step_layout& st, const kv_cache_view& kv, int layer, bf16* q_out, cudaStream_t stream) {
  if (st.n_tokens <= 0) return;
  if (rp.n_rot % 2 != 0 || rp.n_rot > rp.head_dim || rp.head_dim % 2 != 0)
    throw cuda_error("rope_qkv_store: n_rot and head_dim must be even with n_rot <= head_dim");
  const size_t smem = size_t(rp.n_rot / 2) * sizeof(float2);
  const dim3 grid(st.n_tokens, rp.n_heads + rp.n_kv_heads + 1);
  launch(rope_qkv_store_kernel, grid, rope_threads, smem, stream, qkv, bq, bk, bv, rp, st, kv, layer, q_out);
  check_launch("rope_qkv_store");
}

}  // namespace troupe::kernels::cuda
