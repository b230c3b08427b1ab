// Weight-only quantized GEMV straight from GGUF blocks (the decode path: each 4/8-bit weight is
// read from HBM once per launch and used for all batch rows; block layouts in quant_layout.cuh),
// block expansion to bf16, random blocks for synthetic models, and the bf16 GEMVs of small
// batches with their fused SwiGLU and RoPE forms (gemv_fused.cuh; quant_fused.cu has the
// quantized ones).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv_fused.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_layout.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int dequant_threads = 256;

// One warp per output row (quant_row_dots), for every batch row; scaled as a gemv_norm reader
// when Reader.
template <quant_type T, int B, class Out, int Unroll, bool Reader>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_kernel(const uint8_t* __restrict__ w, int64_t n_out, int64_t n_in,
                                                               const bf16* __restrict__ x, Out* __restrict__ y,
                                                               int64_t ldy, gemv_norm norm) {
  using L = layout<T>;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.x) * gemv_warps + (threadIdx.x >> 5);
  if (o >= n_out) return;  // whole warps leave together
  float acc[B];
  quant_row_dots<T, B, Unroll>(w + o * (n_in / L::block_values) * L::block_bytes, n_in, x, acc);
  if constexpr (Reader) apply_norm_reader<B>(norm, n_in, acc);
#pragma unroll
  for (int b = 0; b < B; ++b) {
    if (lane == b) {
      if constexpr (std::is_same_v<Out, float>) {
        y[b * ldy + o] = acc[b];
      } else {
        y[b * ldy + o] = __float2bfloat16_rn(acc[b]);
      }
    }
  }
}

// bf16 weights, batch B <= 8: the cuBLASLt path at M = 1 read the small projections (qkv, o) at
// 67-72% of the copy rate on an H200 (docs/perf.md §4). One warp per output row, each lane 16-byte
// loads of 8 weights, gemv_bf16_unroll of them in flight before the first is used; the
// activations (a few KB, shared by every warp) come through L1. Unroll: 8 at one or two rows (a
// Llama-3-8B row of 4,096 weights is then two trips of 4 KB per warp in flight), 4 above, where
// each weight load also feeds B activation loads. Under programmatic dependent launch it waits
// for the kernel ahead before anything but its optional L2 prefetch of weights (prefetch_bytes;
// a variant that loaded its first weights into registers before waiting needed 56 registers
// instead of 36 and ran slower: docs/perf.md §4b).
template <int B>
constexpr int gemv_bf16_unroll = B <= 2 ? 8 : 4;

template <int B>
__device__ __forceinline__ void gemv_bf16_acc(const uint4& wr, const bf16* __restrict__ x, int64_t n_in, int64_t v,
                                              float (&acc)[B]) {
  float wf[8];
  bf16x8_to_float(wr, wf);
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float xf[8];
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(x + b * n_in) + v), xf);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[b] = fmaf(wf[k], xf[k], acc[b]);
  }
}

// Before pdl_wait(): the first `bytes` of a weight row (a kernel input no kernel writes) asked of
// L2, a line per lane, while the kernel ahead still runs and HBM would idle.
__device__ __forceinline__ void gemv_prefetch_row(const bf16* row_w, int64_t n_in, int bytes) {
  const int64_t n = bytes < n_in * int64_t(sizeof(bf16)) ? bytes : n_in * int64_t(sizeof(bf16));
  const char* p = reinterpret_cast<const char*>(row_w);
  for (int64_t off = int64_t(threadIdx.x & 31) * 128; off < n; off += 32 * 128) prefetch_l2(p + off);
}

// One warp's dot products of weight row `row` (n_in bf16, 16-byte aligned) with the B activation
// rows of x; every lane returns the totals.
template <int B>
__device__ __forceinline__ void gemv_bf16_row(const bf16* __restrict__ row_w, int64_t n_in, const bf16* __restrict__ x,
                                              float (&acc)[B]) {
  const int lane = threadIdx.x & 31;
  const uint4* row = reinterpret_cast<const uint4*>(row_w);
  const int64_t n_vec = n_in / 8;
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.0f;
  constexpr int U = gemv_bf16_unroll<B>;
  int64_t v = lane;
  for (; v + 32 * (U - 1) < n_vec; v += 32 * U) {
    uint4 wr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) wr[u] = __ldcs(row + v + 32 * u);  // read once: streamed past the caches
#pragma unroll
    for (int u = 0; u < U; ++u) gemv_bf16_acc<B>(wr[u], x, n_in, v + 32 * u, acc);
  }
  for (; v < n_vec; v += 32) gemv_bf16_acc<B>(__ldcs(row + v), x, n_in, v, acc);
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = warp_sum(acc[b]);
}

// One warp's B dot products of row `row_w`, scaled as a gemv_norm reader when Reader (every lane
// returns them).
template <int B, bool Reader>
__device__ __forceinline__ void gemv_bf16_dots(const bf16* __restrict__ row_w, int64_t n_in, const bf16* __restrict__ x,
                                               const gemv_norm& norm, float (&acc)[B]) {
  gemv_bf16_row<B>(row_w, n_in, x, acc);
  if constexpr (Reader) apply_norm_reader<B>(norm, n_in, acc);
}

// The fused GEMVs up to their epilogue: warp w's row (null: none, the warp only synchronizes)
// prefetched, the wait for the kernel ahead, its B dot products into sums[w], a barrier.
template <int B, bool Reader>
__device__ __forceinline__ void gemv_bf16_cta_dots(const bf16* __restrict__ row, int64_t n_in, const bf16* __restrict__ x,
                                                   const gemv_norm& norm, int prefetch_bytes, float (&sums)[gemv_warps][B]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (row && prefetch_bytes > 0) gemv_prefetch_row(row, n_in, prefetch_bytes);
  pdl_wait();
  if (row) {
    float acc[B];
    gemv_bf16_dots<B, Reader>(row, n_in, x, norm, acc);
#pragma unroll
    for (int b = 0; b < B; ++b)
      if (lane == b) sums[warp][b] = acc[b];
  }
  __syncthreads();
}

template <int B, bool Reader>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_bf16_kernel(const bf16* __restrict__ w, int64_t n_out, int64_t n_in,
                                                                    const bf16* __restrict__ x, bf16* __restrict__ y,
                                                                    int prefetch_bytes, gemv_norm norm) {
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.x) * gemv_warps + warp;
  if (o < n_out && prefetch_bytes > 0) gemv_prefetch_row(w + o * n_in, n_in, prefetch_bytes);
  pdl_wait();
  if (o >= n_out) return;  // whole warps leave together
  float acc[B];
  gemv_bf16_dots<B, Reader>(w + o * n_in, n_in, x, norm, acc);
#pragma unroll
  for (int b = 0; b < B; ++b)
    if (lane == b) y[b * n_out + o] = __float2bfloat16_rn(acc[b]);
}

// bf16 weight rows for the fused GEMVs (gemv_fused.cuh): gemv_bf16_cta_dots, with an optional
// norm reader and L2 prefetch.
template <int B, bool Reader>
struct bf16_rows {
  const bf16* w;
  int64_t n_in;
  int prefetch_bytes;
  gemv_norm norm;
  __device__ void cta_dots(int64_t row, const bf16* __restrict__ x, float (&sums)[gemv_warps][B]) const {
    gemv_bf16_cta_dots<B, Reader>(row >= 0 ? w + row * n_in : nullptr, n_in, x, norm, prefetch_bytes, sums);
  }
};

template <quant_type T>
__global__ void dequant_kernel(const uint8_t* __restrict__ w, int64_t n_units, bf16* __restrict__ out) {
  using L = layout<T>;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < n_units; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t blk = u / L::units_per_block;
    const unit q = decode_unit<T>(w + blk * L::block_bytes, int(u % L::units_per_block), blk * L::block_values);
    // Rounded product then sum, no FMA: the same float value as kernels::dequantize_row.
    float v0[4], v1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v0[k] = __fadd_rn(__fmul_rn(q.scale[0], q.q[k]), q.offset[0]);
      v1[k] = __fadd_rn(__fmul_rn(q.scale[1], q.q[4 + k]), q.offset[1]);
    }
    store4(out + q.i0, v0);
    store4(out + q.i1, v1);
  }
}

// Random quants: every 16-bit half of the blocks from splitmix64 of (seed, its index).
__global__ void fill_random_bytes_kernel(uint16_t* w, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ULL * uint64_t(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    w[i] = uint16_t((z ^ (z >> 31)) >> 48);
  }
}

// Every other block's scales negative (a negative d flips its weights): the quants' own mean
// (q4_0's q - 8 is -0.5 on average) cancels over a row.
template <quant_type T>
__global__ void fill_block_scales_kernel(uint8_t* w, int64_t n_blocks, float stddev) {
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < n_blocks; b += int64_t(gridDim.x) * blockDim.x)
    layout<T>::set_scales(w + b * layout<T>::block_bytes, b % 2 == 0 ? stddev : -stddev);
}


void check_bf16_args(const char* name, const bf16* w, int64_t n_in, const bf16* x, int batch, int prefetch_bytes) {
  const std::string n = name;
  if (batch < 1 || batch > max_batch) throw cuda_error(n + ": batch must be in [1, 8]");
  if (prefetch_bytes < 0) throw cuda_error(n + ": prefetch_bytes must be >= 0");
  if (n_in % 8 != 0) throw cuda_error(n + ": n_in must be a multiple of 8");
  if (!aligned(w, 16) || !aligned(x, 16)) throw cuda_error(n + ": w and x must be 16-byte aligned");
}

template <class Out>
void gemv_quant_to(const char* name, quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, Out* y, int batch,
                   cudaStream_t stream, int64_t ldy, int unroll, const gemv_norm& norm) {
  const std::string n = name;
  if (batch < 1 || batch > max_batch) throw cuda_error(n + ": batch must be in [1, 8]");
  check_args(t, w, n_in, name);
  if (!aligned(x, 8)) throw cuda_error(n + ": x must be 8-byte aligned");
  if (ldy == 0) ldy = n_out;
  if (ldy < n_out) throw cuda_error(n + ": ldy must be 0 or at least n_out");
  if (unroll != 1 && unroll != 4 && unroll != 8) throw cuda_error(n + ": unroll must be 1, 4 or 8");
  const bool reader = norm.sumsq_in != nullptr, writer = norm.residual != nullptr;
  if (writer && (!norm.norm_w || !norm.sumsq_out)) throw cuda_error(n + ": a norm writer needs norm_w and sumsq_out");
  if (!writer && (norm.norm_w || norm.sumsq_out)) throw cuda_error(n + ": norm_w or sumsq_out without a residual");
  // A quantized writer's input is attention's output or SwiGLU's, never a norm's.
  if (writer && (reader || ldy != n_out)) throw cuda_error(n + ": a norm writer reads no norm and writes all of y (ldy 0)");
  if (n_out <= 0 || n_in <= 0) return;
  if (overlaps(x, batch * n_in * 2, y, ((batch - 1) * ldy + n_out) * int64_t(sizeof(Out))))
    throw cuda_error(n + ": y overlaps x (other CTAs still read x while one stores y)");
  const auto blocks = unsigned((n_out + gemv_warps - 1) / gemv_warps);
  const auto* raw = static_cast<const uint8_t*>(w);
  if constexpr (std::is_same_v<Out, bf16>) {
    if (writer) {  // over one part, reading no norm
      quant_matrix m;
      m.qt = t, m.n_parts = 1, m.raw[0] = w;
      with_type(t, [&](auto type) {
        with_batch(batch, [&](auto b) {
          with_unroll(unroll, name, [&](auto u) {
            using rows = quant_rows<decltype(type)::value, decltype(b)::value, decltype(u)::value, false>;
            launch(gemv_writer_kernel<rows, rows::batch>, blocks, gemv_warps * 32, 0, stream, rows{m, n_in, norm}, n_out, x, y,
                   norm);
          });
        });
      });
      check_launch(name);
      return;
    }
  }
  with_type(t, [&](auto type) {
    with_batch(batch, [&](auto b) {
      constexpr quant_type T = decltype(type)::value;
      constexpr int B = decltype(b)::value;
      with_unroll(unroll, name, [&](auto u) {
        constexpr int U = decltype(u)::value;
        if constexpr (std::is_same_v<Out, bf16>) {
          if (reader) {
            launch(gemv_kernel<T, B, Out, U, true>, blocks, gemv_warps * 32, 0, stream, raw, n_out, n_in, x, y, ldy, norm);
            return;
          }
        }
        launch(gemv_kernel<T, B, Out, U, false>, blocks, gemv_warps * 32, 0, stream, raw, n_out, n_in, x, y, ldy, norm);
      });
    });
  });
  check_launch(name);
}

}  // namespace

int64_t norm_fold_parts(int64_t n_out) { return fold_parts(n_out); }

void gemv_quant(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch,
                cudaStream_t stream, int64_t ldy, int unroll, const gemv_norm& norm) {
  gemv_quant_to("gemv_quant", t, w, n_out, n_in, x, y, batch, stream, ldy, unroll, norm);
}

void gemv_quant_f32(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, float* y, int batch,
                    cudaStream_t stream, int64_t ldy, int unroll) {
  gemv_quant_to("gemv_quant_f32", t, w, n_out, n_in, x, y, batch, stream, ldy, unroll, gemv_norm{});
}

void gemv_bf16(const bf16* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch, cudaStream_t stream,
               int prefetch_bytes, const gemv_norm& norm) {
  check_bf16_args("gemv_bf16", w, n_in, x, batch, prefetch_bytes);
  const bool reader = norm.sumsq_in != nullptr, writer = norm.residual != nullptr;
  if (writer && (!norm.norm_w || !norm.sumsq_out)) throw cuda_error("gemv_bf16: a norm writer needs norm_w and sumsq_out");
  if (!writer && (norm.norm_w || norm.sumsq_out)) throw cuda_error("gemv_bf16: norm_w or sumsq_out without a residual");
  if (n_out <= 0 || n_in <= 0) return;
  // CTAs store while others still read: what they write must not alias what any of them reads.
  if (overlaps(x, batch * n_in * 2, y, batch * n_out * 2))
    throw cuda_error("gemv_bf16: y overlaps x (other CTAs still read x while one stores y)");
  if (reader && writer &&
      overlaps(norm.sumsq_in, batch * fold_parts(n_in) * 4, norm.sumsq_out, batch * fold_parts(n_out) * 4))
    throw cuda_error("gemv_bf16: a norm reader and writer in one launch need separate sums of squares");
  const auto blocks = unsigned(norm_fold_parts(n_out));
  with_batch(batch, [&](auto b) {
    constexpr int B = decltype(b)::value;
    if (writer && reader)
      launch(gemv_writer_kernel<bf16_rows<B, true>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, true>{w, n_in, prefetch_bytes, norm}, n_out, x, y, norm);
    else if (writer)
      launch(gemv_writer_kernel<bf16_rows<B, false>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, false>{w, n_in, prefetch_bytes, norm}, n_out, x, y, norm);
    else
      launch(reader ? gemv_bf16_kernel<B, true> : gemv_bf16_kernel<B, false>, blocks, gemv_warps * 32, 0, stream, w, n_out,
             n_in, x, y, prefetch_bytes, norm);
  });
  check_launch("gemv_bf16");
}

void gemv_bf16_swiglu(const bf16* w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch, cudaStream_t stream,
                      int prefetch_bytes, const gemv_norm& norm) {
  check_bf16_args("gemv_bf16_swiglu", w, n_in, x, batch, prefetch_bytes);
  if (norm.residual || norm.norm_w || norm.sumsq_out) throw cuda_error("gemv_bf16_swiglu: a norm reader only");
  if (d_ff <= 0 || n_in <= 0) return;
  const unsigned blocks = swiglu_ctas(d_ff);
  with_batch(batch, [&](auto b) {
    constexpr int B = decltype(b)::value;
    if (norm.sumsq_in)
      launch(gemv_swiglu_kernel<bf16_rows<B, true>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, true>{w, n_in, prefetch_bytes, norm}, d_ff, x, act);
    else
      launch(gemv_swiglu_kernel<bf16_rows<B, false>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, false>{w, n_in, prefetch_bytes, norm}, d_ff, x, act);
  });
  check_launch("gemv_bf16_swiglu");
}

void gemv_bf16_rope_qkv(const bf16* w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                        int prefetch_bytes, const gemv_norm& norm) {
  const int batch = r.st.n_tokens;
  check_bf16_args("gemv_bf16_rope_qkv", w, n_in, x, batch, prefetch_bytes);
  check_rope_args("gemv_bf16_rope_qkv", r.rope);
  if (norm.residual || norm.norm_w || norm.sumsq_out) throw cuda_error("gemv_bf16_rope_qkv: a norm reader only");
  if (n_in <= 0) return;
  const unsigned blocks = rope_ctas(r.rope);
  with_batch(batch, [&](auto b) {
    constexpr int B = decltype(b)::value;
    if (norm.sumsq_in)
      launch(gemv_rope_kernel<bf16_rows<B, true>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, true>{w, n_in, prefetch_bytes, norm}, x, r);
    else
      launch(gemv_rope_kernel<bf16_rows<B, false>, B>, blocks, gemv_warps * 32, 0, stream,
             bf16_rows<B, false>{w, n_in, prefetch_bytes, norm}, x, r);
  });
  check_launch("gemv_bf16_rope_qkv");
}

size_t quant_row_bytes(quant_type t, int64_t n_in) {
  size_t bytes = 0;
  with_type(t, [&](auto c) {
    using L = layout<decltype(c)::value>;
    bytes = size_t(n_in / L::block_values) * L::block_bytes;
  });
  return bytes;
}

void fill_random_blocks(quant_type t, void* w, int64_t n, float stddev, uint64_t seed, cudaStream_t stream) {
  check_args(t, w, n, "fill_random_blocks");
  if (n <= 0) return;
  const int64_t n_blocks = n / block_values(t), halves = int64_t(quant_row_bytes(t, n)) / 2;
  const auto grid = [](int64_t items) { return unsigned(std::min<int64_t>((items + 255) / 256, 65535 * 8)); };
  launch_ordinary(fill_random_bytes_kernel, grid(halves), 256, 0, stream, static_cast<uint16_t*>(w), halves, seed);
  with_type(t, [&](auto c) {
    launch_ordinary(fill_block_scales_kernel<decltype(c)::value>, grid(n_blocks), 256, 0, stream, static_cast<uint8_t*>(w), n_blocks,
                    stddev);
  });
  check_launch("fill_random_blocks");
}

void dequant_to_bf16(quant_type t, const void* w, int64_t n, bf16* out, cudaStream_t stream) {
  check_args(t, w, n, "dequant_to_bf16");
  if (!aligned(out, 8)) throw cuda_error("dequant_to_bf16: out must be 8-byte aligned");
  if (n <= 0) return;
  const int64_t n_units = n / 8;
  const int64_t want = (n_units + dequant_threads - 1) / dequant_threads;
  const auto blocks = unsigned(want < 65535 ? want : 65535);
  const auto* src = static_cast<const uint8_t*>(w);
  with_type(t, [&](auto type) {
    launch_ordinary(dequant_kernel<decltype(type)::value>, blocks, dequant_threads, 0, stream, src, n_units, out);
  });
  check_launch("dequant_to_bf16");
}

}  // namespace troupe::kernels::cuda
