// Causal attention over the paged fp16 KV cache (sm_90). Two kernels share one launch:
//  - prefill_kernel: FlashAttention-2 for sequences with q_len > 1. One CTA per (query tile,
//    sequence, kv head); the query heads of a GQA group are packed into the M dimension so each
//    K/V tile is read once per group. QK^T and PV run on tensor cores (mma.sync m16n8k16, fp16 in,
//    fp32 accumulate); the online softmax is fp32 in the exp2 domain (log2e folded into the scale).
//  - decode_kernel (+ merge_kernel): flash-decoding for sequences with q_len == 1. One CTA per
//    (sequence, up to 8 heads of one kv head, KV split); long KV is split across CTAs whose
//    partial (out, max, sum) go to scratch and are merged by a second kernel, or, given arrival
//    counters (attention_scratch::counters), by the last CTA of each row and head chunk to finish.
// A CTA whose sequence is not of its kind exits at once, so the host needs no per-sequence list.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"

namespace troupe::kernels::cuda {
namespace {

constexpr float log2e = 1.4426950408889634f;

// Prefill tiles: 4 warps of 16 packed (query row, head) rows each; KV tiles of 64 positions (32
// at head_dim 256, whose output accumulators alone take 128 registers a thread).
constexpr int pf_warps = 4;
constexpr int pf_threads = pf_warps * 32;
constexpr int pf_tile_m = pf_warps * 16;
template <int HD>
constexpr int pf_tile_n_of = HD > 128 ? 32 : 64;
// Head sizes up to 128 keep Q's mma fragments in registers for the whole CTA; 256 re-reads them
// (L1) for each KV tile instead of holding another 64 registers.
template <int HD>
constexpr bool pf_q_in_registers = HD <= 128;

// Decode: split KV once a row is longer than attention_scratch::kv_per_split positions (64 by
// default: two passes of the CTA's 32 positions in flight); each split keeps at least that many,
// and splits stop growing once the grid has about dec_target_waves full waves of resident CTAs
// (so the last, partial wave is a small part of the time: 512 CTAs on 132 SMs x 3 resident are
// 1.3 waves, half of it at a third of the GPU). Small batches need the splits most: one sequence
// of Llama-3-8B gives 8 CTAs, whose 512-position rows took 53 us per layer on an H200 unsplit (a
// dependent load chain per pass, latency-bound), see docs/perf.md.
constexpr int dec_threads = 128;
constexpr int dec_target_waves = 4;
constexpr int dec_max_heads = 8;  // query heads per decode CTA (a larger GQA group takes more CTAs)
constexpr int dec_stages = 2;     // cp.async stages of a decode CTA's K/V chunks

// Splits for a decode row with kv_len positions, at least per_split positions each, when at
// most cap are allowed. Host and device must agree (the merge kernel recomputes it), hence one
// function.
__host__ __device__ inline int decode_splits(int kv_len, int cap, int per_split) {
  if (cap <= 1 || kv_len <= per_split) return 1;
  const int n = (kv_len + per_split - 1) / per_split;
  return n < cap ? n : cap;
}

// First key a decode row of kv_len positions attends to: 0, or the start of its sliding window
// of `window` positions (itself included).
__host__ __device__ inline int decode_first_key(int kv_len, int window) {
  return window > 0 && kv_len > window ? kv_len - window : 0;
}

// ---- PTX helpers ---------------------------------------------------------------------------------
// (The CPU emulation build, TROUPE_CUDA_EMU, runs tests/cuda_emu's stand-ins instead of the PTX.)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#ifdef TROUPE_CUDA_EMU
  troupe_emu::cp_async(smem, gmem, 16);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
#endif
}
#ifdef TROUPE_CUDA_EMU
__device__ __forceinline__ void cp_async_commit() { troupe_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  troupe_emu::cp_async_wait(N);
}
#else
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Four 8x8 b16 matrices; lanes 8j..8j+7 address the rows of matrix j, register j receives it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
#ifdef TROUPE_CUDA_EMU
  troupe_emu::ldmatrix_x4(r, smem, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem))
               : "memory");
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
#ifdef TROUPE_CUDA_EMU
  troupe_emu::ldmatrix_x4(r, smem, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem))
               : "memory");
#endif
}

// d += a * b for one 16x8x16 tile: a row-major fp16 (4 regs), b column-major fp16 (2 regs), d fp32.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef TROUPE_CUDA_EMU
  troupe_emu::mma_16816_f16(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- prefill: FlashAttention-2 over the paged cache ---------------------------------------------

template <int HD>
constexpr int prefill_smem_bytes() {
  return 2 /*K,V*/ * 2 /*buffers*/ * pf_tile_n_of<HD> * (HD + 8) * (int)sizeof(fp16);
}

// Grid (query tiles, n_seqs, n_kv_heads); CTAs stride over tiles so any grid.x is correct.
// Packed row m of a tile is query row m / group, head m % group of the kv head's group. With a
// sliding window (window > 0) a row at position p sees keys (p - window, p] only: KV tiles wholly
// below every row's window are skipped, the rest masked.
// Fragment layouts are those of mma.m16n8k16: thread (g = lane / 4, t = lane % 4) holds rows g
// and g + 8, columns 2t and 2t + 1 of each 8-wide accumulator tile.
template <int HD>
__global__ void __launch_bounds__(pf_threads)
    prefill_kernel(const bf16* __restrict__ q, step_layout st, kv_cache_view kv, int layer, int n_heads,
                   float scale_log2, int window, bf16* __restrict__ out) {
  constexpr int pf_tile_n = pf_tile_n_of<HD>;
  constexpr bool q_regs = pf_q_in_registers<HD>;
  constexpr int stride = HD + 8;  // smem row in halves; the 16-byte pad spreads ldmatrix rows over banks
  constexpr int chunks = HD / 8;  // 16-byte chunks per K or V row
  constexpr int n_kt = pf_tile_n / 8;
  constexpr int n_dt = HD / 8;
  TROUPE_DYNAMIC_SMEM(unsigned char, smem_raw, 128);
  fp16* k_smem = reinterpret_cast<fp16*>(smem_raw);  // [2][pf_tile_n][stride]
  fp16* v_smem = k_smem + 2 * pf_tile_n * stride;

  pdl_launch_dependents();
  pdl_wait();
  const int seq = blockIdx.y, kvh = blockIdx.z;
  const int q_begin = st.q_start[seq];
  const int q_len = st.q_start[seq + 1] - q_begin;
  if (q_len <= 1) return;  // decode rows belong to decode_kernel
  const int pos0 = st.pos0[seq];
  const int32_t* table = seq_table(st, seq, kv.block_size);
  const int group = n_heads / kv.n_kv_heads;
  const int rows = pf_tile_m / group;  // query rows per tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int64_t row_elems = kv.row_elems();
  const int64_t v_offset = (int64_t)kv.block_size * row_elems;
  const int64_t q_stride = (int64_t)n_heads * HD;

  for (int tile = blockIdx.x; tile * rows < q_len; tile += gridDim.x) {
    const int q0 = tile * rows;
    const int nq = min(rows, q_len - q0);
    const int min_qpos = pos0 + q0;
    const int kv_limit = pos0 + q0 + nq;  // keys [0, kv_limit) are the most any row here sees
    // Keys below kv_lo are outside every row's window.
    const int kv_lo = window > 0 ? max(0, min_qpos - window + 1) : 0;

    // This thread's rows g and g + 8 of the warp's 16. Padding rows attend like the last
    // position (finite, never stored) so no NaN can arise from a fully masked row.
    int qpos[2];
    int64_t q_off[2];
    bool valid[2];
    for (int r = 0; r < 2; ++r) {
      const int m = warp * 16 + g + r * 8;
      const int qi = m / group;
      valid[r] = qi < nq;
      qpos[r] = valid[r] ? min_qpos + qi : kv_limit - 1;
      q_off[r] = (int64_t)(q_begin + q0 + qi) * q_stride + (int64_t)(kvh * group + m % group) * HD;
    }

    // Q as mma A fragments. bf16 -> fp16 for the fp16 tensor-core path; the scale (with log2e)
    // is applied first, which keeps |q| small enough for fp16's range.
    auto q_fragment = [&](int kk, uint32_t(&a)[4]) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t u = 0;
          if (valid[r]) {
            const float2 f = __bfloat1622float2(
                *reinterpret_cast<const __nv_bfloat162*>(q + q_off[r] + kk * 16 + half * 8 + tig * 2));
            u = pack_half2(f.x * scale_log2, f.y * scale_log2);
          }
          a[r + 2 * half] = u;
        }
      }
    };
    uint32_t qa[q_regs ? HD / 16 : 1][4];
    if constexpr (q_regs) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) q_fragment(kk, qa[kk]);
    }

    float o[n_dt][4];
#pragma unroll
    for (int dt = 0; dt < n_dt; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.0f, 0.0f};  // per-thread partial sums; the quad reduces them at the end

    // Positions past kv_limit are zero-filled, never read: their blocks may not exist and stale
    // slots may hold anything (0 * NaN would poison the PV product).
    auto load_tile = [&](int t, int buf) {
      const int kv0 = t * pf_tile_n;
      fp16* kd = k_smem + buf * pf_tile_n * stride;
      fp16* vd = v_smem + buf * pf_tile_n * stride;
      const int c = threadIdx.x % chunks;
      for (int r = threadIdx.x / chunks; r < pf_tile_n; r += pf_threads / chunks) {
        const int p = kv0 + r;
        fp16* kdst = kd + r * stride + c * 8;
        fp16* vdst = vd + r * stride + c * 8;
        if (p < kv_limit && p >= kv_lo) {
          const fp16* src = kv.k_block(table[p / kv.block_size], layer) + (int64_t)(p % kv.block_size) * row_elems +
                            kvh * HD + c * 8;
          cp_async16(kdst, src);
          cp_async16(vdst, src + v_offset);
        } else {
          *reinterpret_cast<uint4*>(kdst) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(vdst) = make_uint4(0, 0, 0, 0);
        }
      }
    };

    const int n_tiles = (kv_limit + pf_tile_n - 1) / pf_tile_n;  // tiles above the diagonal never load
    const int t_first = kv_lo / pf_tile_n;                          // nor tiles below every window
    load_tile(t_first, t_first & 1);
    cp_async_commit();
    for (int t = t_first; t < n_tiles; ++t) {
      if (t + 1 < n_tiles) {  // double buffering: tile t + 1 streams in while t is computed
        load_tile(t + 1, (t + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const fp16* kb = k_smem + (t & 1) * pf_tile_n * stride;
      const fp16* vb = v_smem + (t & 1) * pf_tile_n * stride;

      // S = Q K^T (log2 units). K rows in smem are B's columns: ldmatrix without transpose.
      float sc[n_kt][4];
#pragma unroll
      for (int nt = 0; nt < n_kt; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        const auto s_step = [&](const uint32_t(&a)[4]) {
#pragma unroll
          for (int np = 0; np < n_kt / 2; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, kb + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * stride + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_16816(sc[2 * np], a, b[0], b[1]);
            mma_16816(sc[2 * np + 1], a, b[2], b[3]);
          }
        };
        if constexpr (q_regs) {
          s_step(qa[kk]);
        } else {
          uint32_t a_kk[4];
          q_fragment(kk, a_kk);
          s_step(a_kk);
        }
      }

      const int kv0 = t * pf_tile_n;
      // The tile crosses the diagonal of some row, or the lower edge of some row's window: mask.
      if (kv0 + pf_tile_n - 1 > min_qpos || (window > 0 && kv0 <= kv_limit - 1 - window)) {
#pragma unroll
        for (int nt = 0; nt < n_kt; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = kv0 + nt * 8 + tig * 2 + (e & 1), qp = qpos[e >> 1];
            if (key > qp || (window > 0 && key <= qp - window)) sc[nt][e] = -INFINITY;
          }
      }

      // Online softmax: new running max, rescale what was accumulated, exponentiate.
      float m_use[2], corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m_run[r];
#pragma unroll
        for (int nt = 0; nt < n_kt; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][2 * r], sc[nt][2 * r + 1]));
        mx = quad_max(mx);
        m_use[r] = mx == -INFINITY ? 0.0f : mx;  // a row masked so far: avoid (-inf) - (-inf)
        corr[r] = exp2f(m_run[r] - m_use[r]);
        m_run[r] = mx;
        l_run[r] *= corr[r];
      }
#pragma unroll
      for (int nt = 0; nt < n_kt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[nt][e] = exp2f(sc[nt][e] - m_use[e >> 1]);
          l_run[e >> 1] += sc[nt][e];
        }
#pragma unroll
      for (int dt = 0; dt < n_dt; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] *= corr[e >> 1];

      // O += P V. The S accumulators of two adjacent 8-key tiles are exactly an A fragment
      // (P as fp16, values in [0, 1]); V rows are B's rows: ldmatrix with transpose.
#pragma unroll
      for (int kc = 0; kc < pf_tile_n / 16; ++kc) {
        const uint32_t pa[4] = {pack_half2(sc[2 * kc][0], sc[2 * kc][1]), pack_half2(sc[2 * kc][2], sc[2 * kc][3]),
                                pack_half2(sc[2 * kc + 1][0], sc[2 * kc + 1][1]),
                                pack_half2(sc[2 * kc + 1][2], sc[2 * kc + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vb + (kc * 16 + (lane & 15)) * stride + dp * 16 + (lane >> 4) * 8);
          mma_16816(o[2 * dp], pa, b[0], b[1]);
          mma_16816(o[2 * dp + 1], pa, b[2], b[3]);
        }
      }
      __syncthreads();  // buffer t & 1 is refilled by the next iteration's prefetch
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[r]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      if (!valid[r]) continue;
      bf16* orow = out + q_off[r];
#pragma unroll
      for (int dt = 0; dt < n_dt; ++dt)
        *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8 + tig * 2) =
            __floats2bfloat162_rn(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    }
  }
}

// ---- decode: flash-decoding ------------------------------------------------------------------------

// 16 bytes of 8 fp16 values as floats (bf16: device_util.cuh).
__device__ __forceinline__ void fp16x8_to_float(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// Dimension d of one decode row and head from its n_split partials at slots [slot0, slot0 +
// n_split): each split weighted by sum * 2^(max - overall max), splits in index order (so the
// merge kernel and the last-CTA merge give the same bits). Loads bypass L1 (__ldcg): in the
// last-CTA merge the partials were written by other CTAs of the same launch, and an L1 line
// cached earlier on this SM could be stale.
template <int HD>
__device__ __forceinline__ float merge_splits(const float* part_out, const float* part_ml, int64_t slot0, int n_split,
                                              int d) {
  float m = -INFINITY;
  for (int sp = 0; sp < n_split; ++sp)
    if (__ldcg(part_ml + (slot0 + sp) * 2 + 1) > 0.0f) m = fmaxf(m, __ldcg(part_ml + (slot0 + sp) * 2));
  float l = 0.0f, o = 0.0f;
  for (int sp = 0; sp < n_split; ++sp) {
    const float ls = __ldcg(part_ml + (slot0 + sp) * 2 + 1);
    if (!(ls > 0.0f)) continue;  // an empty split
    // Explicitly rounded: no multiply-add contracted differently in the two kernels that inline this.
    const float w = __fmul_rn(ls, exp2f(__ldcg(part_ml + (slot0 + sp) * 2) - m));
    l = __fadd_rn(l, w);
    o = fmaf(w, __ldcg(part_out + (slot0 + sp) * HD + d), o);
  }
  return l > 0.0f ? o / l : 0.0f;
}

// Grid (n_seqs, n_kv_heads * head chunks, n_split_max). A row reads keys [decode_first_key, kv_len)
// (all of them, or its sliding window's), split evenly. Each group of HD / 8 lanes reads one
// position's K and V head rows with 16-byte loads (8 dims per lane) and keeps its own online
// softmax for every head of the CTA; the groups are merged through shared memory at the end.
// With one split the CTA writes the output row; otherwise (out / sum, max, sum) go to scratch,
// and with `counters` (one zeroed counter per (sequence, blockIdx.y)) each CTA then counts itself
// in; the last of the row's splits merges them (merge_splits) and sets the counter back to zero
// for the next launch. Without counters merge_kernel merges.
template <int HD, int GT>
__global__ void __launch_bounds__(dec_threads)
    decode_kernel(const bf16* __restrict__ q, step_layout st, kv_cache_view kv, int layer, int n_heads,
                  float scale_log2, int window, int n_split_max, int kv_per_split, bf16* __restrict__ out,
                  float* __restrict__ part_out, float* __restrict__ part_ml, int max_splits,
                  unsigned* __restrict__ counters) {
  constexpr int lpp = HD / 8;               // lanes per position
  constexpr int subs = dec_threads / lpp;   // positions in flight across the CTA per step
  constexpr int unroll = GT >= 8 ? 2 : 4;   // positions per lane group per step (loads in flight)
  // The next pass's K and V chunks are copied (cp.async) while this pass computes: two stages of
  // each thread's own 16-byte chunks, so a thread waits only on its own copies. The merge at the
  // end reuses the same shared memory.
  union smem_t {
    struct {
      uint4 k[dec_stages][unroll][dec_threads];
      uint4 v[dec_stages][unroll][dec_threads];
    } buf;
    struct {
      float acc[subs][GT][HD];
      float m[subs][GT];
      float l[subs][GT];
    } red;
  };
  TROUPE_SHARED(smem_t, sm);
  TROUPE_SHARED(bool, merge_here);

  pdl_launch_dependents();
  pdl_wait();
  const int seq = blockIdx.x;
  const int tok = st.q_start[seq];
  if (st.q_start[seq + 1] - tok != 1) return;  // prefill rows belong to prefill_kernel
  const int kv_len = st.pos0[seq] + 1;
  const int kv_lo = decode_first_key(kv_len, window);
  const int n_split = decode_splits(kv_len - kv_lo, n_split_max, kv_per_split);
  const int split = blockIdx.z;
  if (split >= n_split) return;
  const int per_split = (kv_len - kv_lo + n_split - 1) / n_split;
  const int p_begin = kv_lo + split * per_split;
  const int p_end = min(kv_len, p_begin + per_split);

  const int group = n_heads / kv.n_kv_heads;
  const int head_chunks = (group + GT - 1) / GT;
  const int kvh = blockIdx.y / head_chunks;
  const int h0 = kvh * group + (blockIdx.y % head_chunks) * GT;
  const int n_h = min(GT, kvh * group + group - h0);
  const int sub = threadIdx.x / lpp, c = threadIdx.x % lpp;
  const int32_t* table = seq_table(st, seq, kv.block_size);
  const int64_t row_elems = kv.row_elems();
  const int64_t v_offset = (int64_t)kv.block_size * row_elems;

  float qf[GT][8];
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    if (h < n_h) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(q + ((int64_t)tok * n_heads + h0 + h) * HD + c * 8));
      bf16x8_to_float(raw, qf[h]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[h][i] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[h][i] = 0.0f;
    }
  }

  float acc[GT][8], m_run[GT], l_run[GT];
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    m_run[h] = -INFINITY;
    l_run[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }

  // Copies of the pass at p_base into stage st, one commit group per pass (empty past the end).
  const auto issue = [&](int p_base, int st) {
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      const int p = p_base + u * subs + sub;
      if (p < p_end) {
        const fp16* src = kv.k_block(table[p / kv.block_size], layer) + (int64_t)(p % kv.block_size) * row_elems +
                          kvh * HD + c * 8;
        cp_async16(&sm.buf.k[st][u][threadIdx.x], src);
        cp_async16(&sm.buf.v[st][u][threadIdx.x], src + v_offset);
      }
    }
    cp_async_commit();
  };
  constexpr int pass = subs * unroll;
  issue(p_begin, 0);
  for (int p_base = p_begin, st = 0; p_base < p_end; p_base += pass, st ^= 1) {
    issue(p_base + pass, st ^ 1);
    cp_async_wait<1>();  // this pass's group is complete
    float kf[unroll][8], vf[unroll][8];
    bool ok[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      ok[u] = p_base + u * subs + sub < p_end;
      uint4 kr = make_uint4(0, 0, 0, 0), vr = kr;
      if (ok[u]) {
        kr = sm.buf.k[st][u][threadIdx.x];
        vr = sm.buf.v[st][u][threadIdx.x];
      }
      fp16x8_to_float(kr, kf[u]);
      fp16x8_to_float(vr, vf[u]);
    }
#pragma unroll
    for (int h = 0; h < GT; ++h) {
      if (h >= n_h) continue;  // uniform over the CTA, so the shuffles below stay converged
      float s[unroll];
      float mx = m_run[h];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(qf[h][i], kf[u][i], d);
#pragma unroll
        for (int off = lpp / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        s[u] = ok[u] ? d : -INFINITY;
        mx = fmaxf(mx, s[u]);
      }
      const float m_use = mx == -INFINITY ? 0.0f : mx;
      const float corr = exp2f(m_run[h] - m_use);
      m_run[h] = mx;
      l_run[h] *= corr;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= corr;
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        const float w = exp2f(s[u] - m_use);
        l_run[h] += w;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(w, vf[u][i], acc[h][i]);
      }
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // every thread is done with the stages before they become the merge's
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    if (c == 0) {
      sm.red.m[sub][h] = m_run[h];
      sm.red.l[sub][h] = l_run[h];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sm.red.acc[sub][h][c * 8 + i] = acc[h][i];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < n_h * HD; idx += dec_threads) {
    const int h = idx / HD, d = idx % HD;
    float m = -INFINITY;
    for (int sb = 0; sb < subs; ++sb) m = fmaxf(m, sm.red.m[sb][h]);
    float l = 0.0f, o = 0.0f;
    if (m != -INFINITY) {
      for (int sb = 0; sb < subs; ++sb) {
        const float w = exp2f(sm.red.m[sb][h] - m);
        l = fmaf(sm.red.l[sb][h], w, l);
        o = fmaf(sm.red.acc[sb][h][d], w, o);
      }
    }
    const float val = l > 0.0f ? o / l : 0.0f;
    const int64_t row_head = (int64_t)tok * n_heads + h0 + h;
    if (n_split == 1) {
      out[row_head * HD + d] = __float2bfloat16_rn(val);
    } else {
      const int64_t slot = row_head * max_splits + split;
      part_out[slot * HD + d] = val;
      if (d == 0) {
        part_ml[slot * 2] = m;
        part_ml[slot * 2 + 1] = l;
      }
    }
  }
  if (n_split == 1 || counters == nullptr) return;

  // Count this split in; the last to arrive merges. Release: every thread's partials are made
  // visible device-wide before thread 0's atomic; acquire: the fence after seeing the count.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* count = counters + (int64_t)seq * gridDim.y + blockIdx.y;
    merge_here = atomicAdd(count, 1u) == unsigned(n_split - 1);
    if (merge_here) atomicExch(count, 0u);  // every split has arrived: nobody else touches it now
  }
  __syncthreads();
  if (!merge_here) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < n_h * HD; idx += dec_threads) {
    const int h = idx / HD, d = idx % HD;
    const int64_t row_head = (int64_t)tok * n_heads + h0 + h;
    out[row_head * HD + d] = __float2bfloat16_rn(merge_splits<HD>(part_out, part_ml, row_head * max_splits, n_split, d));
  }
}

// Grid (n_seqs, n_heads), HD threads: combines the splits of one decode row and head.
template <int HD>
__global__ void __launch_bounds__(HD)
    merge_kernel(step_layout st, int n_heads, int window, int n_split_max, int kv_per_split, const float* __restrict__ part_out,
                 const float* __restrict__ part_ml, int max_splits, bf16* __restrict__ out) {
  pdl_launch_dependents();
  pdl_wait();
  const int seq = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int tok = st.q_start[seq];
  if (st.q_start[seq + 1] - tok != 1) return;
  const int kv_len = st.pos0[seq] + 1;
  const int n_split = decode_splits(kv_len - decode_first_key(kv_len, window), n_split_max, kv_per_split);
  if (n_split <= 1) return;  // decode_kernel wrote this row itself
  const int64_t row_head = (int64_t)tok * n_heads + head;
  out[row_head * HD + d] = __float2bfloat16_rn(merge_splits<HD>(part_out, part_ml, row_head * max_splits, n_split, d));
}

// ---- launch ---------------------------------------------------------------------------------------

template <int HD>
void launch_prefill(const bf16* q, const step_layout& st, const kv_cache_view& kv, int layer, int n_heads,
                    float scale_log2, int window, bf16* out, cudaStream_t stream) {
  const int group = n_heads / kv.n_kv_heads;
  const int rows = pf_tile_m / group;
  constexpr int smem = prefill_smem_bytes<HD>();
  // Above the 48 KiB default for head_dim 128; set per call since the attribute is per device.
  check(cudaFuncSetAttribute(prefill_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "paged_attention: cudaFuncSetAttribute");
  const dim3 grid((st.max_q_len + rows - 1) / rows, st.n_seqs, kv.n_kv_heads);
  launch(prefill_kernel<HD>, grid, pf_threads, smem, stream, q, st, kv, layer, n_heads, scale_log2, window, out);
  check_launch("paged_attention prefill_kernel");
}

// CTAs of decode_kernel<HD, GT> resident at once on the current device (SMs x CTAs per SM),
// asked once per device (the first decode step runs eagerly, before any graph capture) and kept.
template <int HD, int GT>
int decode_wave() {
  static std::atomic<int> cache[64];
  int dev = 0;
  check(cudaGetDevice(&dev), "paged_attention: cudaGetDevice");
  if (dev >= 0 && dev < 64)
    if (const int c = cache[dev].load(std::memory_order_relaxed); c > 0) return c;
  int sms = 0, per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "paged_attention: multiprocessor count");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<HD, GT>, dec_threads, 0),
        "paged_attention: decode occupancy");
  const int wave = std::max(1, sms) * std::max(1, per_sm);
  if (dev >= 0 && dev < 64) cache[dev].store(wave, std::memory_order_relaxed);
  return wave;
}

template <int HD, int GT>
void launch_decode(const bf16* q, const step_layout& st, const kv_cache_view& kv, int layer, int n_heads,
                   float scale_log2, int window, bf16* out, const attention_scratch& scratch, cudaStream_t stream) {
  const int group = n_heads / kv.n_kv_heads;
  const int head_chunks = (group + GT - 1) / GT;
  const int base_ctas = st.n_seqs * kv.n_kv_heads * head_chunks;
  const int target = dec_target_waves * decode_wave<HD, GT>();
  const int cap = std::min(scratch.max_splits, std::max(1, (target + base_ctas - 1) / base_ctas));
  const int longest = window > 0 ? std::min(st.max_kv_len, window) : st.max_kv_len;  // keys a row reads
  const int n_split_max = decode_splits(longest, cap, scratch.kv_per_split);
  const dim3 grid(st.n_seqs, kv.n_kv_heads * head_chunks, n_split_max);
  launch(decode_kernel<HD, GT>, grid, dec_threads, 0, stream, q, st, kv, layer, n_heads, scale_log2, window, n_split_max,
         scratch.kv_per_split, out, scratch.partial_out, scratch.partial_ml, scratch.max_splits, scratch.counters);
  check_launch("paged_attention decode_kernel");
  if (n_split_max > 1 && scratch.counters == nullptr) {
    launch(merge_kernel<HD>, dim3(st.n_seqs, n_heads), HD, 0, stream, st, n_heads, window, n_split_max, scratch.kv_per_split,
           scratch.partial_out, scratch.partial_ml, scratch.max_splits, out);
    check_launch("paged_attention merge_kernel");
  }
}

template <int HD>
void launch_all(const bf16* q, const step_layout& st, const kv_cache_view& kv, int layer, int n_heads,
                float scale_log2, int window, bf16* out, const attention_scratch& scratch, cudaStream_t stream) {
  if (st.max_q_len > 1) launch_prefill<HD>(q, st, kv, layer, n_heads, scale_log2, window, out, stream);
  const int group = n_heads / kv.n_kv_heads;
  if (group <= 1)
    launch_decode<HD, 1>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
  else if (group <= 2)
    launch_decode<HD, 2>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
  else if (group <= 4)
    launch_decode<HD, 4>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
  else
    launch_decode<HD, dec_max_heads>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
}

}  // namespace

size_t attention_scratch_bytes(int n_tokens, int n_heads, int head_dim, int max_splits) {
  if (max_splits <= 0) return 0;
  return (size_t)n_tokens * n_heads * max_splits * (head_dim + 2) * sizeof(float);
}

size_t attention_counters(int n_tokens, int n_heads) { return (size_t)std::max(n_tokens, 0) * std::max(n_heads, 0); }

void paged_attention(const bf16* q, const step_layout& st, const kv_cache_view& kv, int layer, int n_heads,
                     float scale, bf16* out, const attention_scratch& scratch, cudaStream_t stream, int window) {
  const int hd = kv.head_dim;
  if (hd != 64 && hd != 128 && hd != 256)
    throw cuda_error("paged_attention: head_dim " + std::to_string(hd) + " unsupported (64, 128 or 256)");
  if (window < 0) throw cuda_error("paged_attention: negative sliding window " + std::to_string(window));
  if (kv.n_kv_heads <= 0 || n_heads <= 0 || n_heads % kv.n_kv_heads != 0)
    throw cuda_error("paged_attention: n_heads " + std::to_string(n_heads) + " not a multiple of n_kv_heads " +
                     std::to_string(kv.n_kv_heads));
  if (n_heads / kv.n_kv_heads > pf_tile_m)
    throw cuda_error("paged_attention: GQA group of " + std::to_string(n_heads / kv.n_kv_heads) +
                     " heads exceeds " + std::to_string(pf_tile_m));
  if (kv.block_size <= 0) throw cuda_error("paged_attention: block_size must be positive");
  if (layer < 0 || layer >= kv.n_layers) throw cuda_error("paged_attention: layer out of range");
  if (scratch.max_splits > 1 && (scratch.partial_out == nullptr || scratch.partial_ml == nullptr))
    throw cuda_error("paged_attention: max_splits > 1 needs scratch buffers");
  if (scratch.counters != nullptr && scratch.max_splits <= 1)
    throw cuda_error("paged_attention: counters without split-KV scratch (max_splits > 1)");
  if (scratch.max_splits > 1 && scratch.kv_per_split < 1) throw cuda_error("paged_attention: kv_per_split must be >= 1");
  if (st.n_seqs <= 0 || st.n_tokens <= 0) return;
  const float scale_log2 = scale * log2e;
  if (hd == 64)
    launch_all<64>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
  else if (hd == 128)
    launch_all<128>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
  else
    launch_all<256>(q, st, kv, layer, n_heads, scale_log2, window, out, scratch, stream);
}

}  // namespace troupe::kernels::cuda
