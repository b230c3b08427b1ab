// Weight-only quantized GEMV straight from GGUF blocks (the decode path: each 4/8-bit weight is
// read from HBM once per launch and used for all batch rows), and block expansion to bf16.
//
// Work is cut into "units" of 8 weights whose quantized bytes are contiguous: a quarter of a
// q8_0 block, a quarter of a q4_0 or q4_1 block (4 bytes: weights j..j+3 low nibbles, j+16..j+19
// high), and a 32nd of a k-quant super-block: 4 bytes of q4_k's or q5_k's nibbles (4 weights of
// sub-block 2p and 4 of 2p+1; q5_k's fifth bits from 4 bytes of qh that 8 lanes share), 4 bytes
// of q6_k's low nibbles (4 weights of one 32-run and 4 of the run 64 further; their top two bits
// from 4 bytes of qh that 8 lanes share). Lane l of a warp takes units l, l+32, ..., so a warp
// reads each row's quants as one coalesced stream. One warp computes one output row for every
// batch row, accumulating in fp32. Together these are the types of llama.cpp's Q4_K_M, Q5_K_M,
// Q4_0 and Q8_0 files (Q6_K for the tensors the K_M mixes keep at more bits).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rope.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int gemv_warps = 4;  // rows per block
constexpr int dequant_threads = 256;
constexpr int max_batch = 8;

__device__ __forceinline__ void store_half(uint8_t* p, float v) {
  const __half_raw r = __half(__float2half_rn(v));
  *reinterpret_cast<uint16_t*>(p) = r.x;
}

// Scales of a random q4_k / q5_k block whose quants are uniform (standard deviation q_std, mean
// q_mean): every sub-block's 6-bit scale and min 32 (the 12 bytes that scale_min_k4 unpacks so),
// d = stddev / (32 q_std) and dmin = q_mean d, so w = d * 32 * (q - q_mean) has mean 0 (stddev
// may be negative).
__device__ __forceinline__ void set_k_scales(uint8_t* blk, float stddev, float q_std, float q_mean) {
  const float d = stddev / (32.0f * q_std);
  store_half(blk, d), store_half(blk + 2, q_mean * d);
  for (int i = 0; i < 8; ++i) blk[4 + i] = 160;  // 32 in the low 6 bits, 32 >> 4 in the top 2
  for (int i = 8; i < 12; ++i) blk[4 + i] = 0;
}

// 4 bf16 activations at an 8-byte aligned address.
__device__ __forceinline__ void load4(const bf16* p, float (&v)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

__device__ __forceinline__ void store4(bf16* p, const float (&v)[4]) {
  uint2 w;
  *reinterpret_cast<__nv_bfloat162*>(&w.x) = __floats2bfloat162_rn(v[0], v[1]);
  *reinterpret_cast<__nv_bfloat162*>(&w.y) = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = w;
}

// One unit decoded: 8 weights as two runs of 4 consecutive positions, [i0, i0+4) and [i1, i1+4),
// with w = scale * q + offset (q small integers held exactly in float).
struct unit {
  int64_t i0, i1;   // positions within the row
  float q[8];       // q[0..3] at i0.., q[4..7] at i1..
  float scale[2];   // for the first and the second run
  float offset[2];
};

// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ uint32_t load_u32_a2(const uint8_t* p) {
  return uint32_t(*reinterpret_cast<const uint16_t*>(p)) | uint32_t(*reinterpret_cast<const uint16_t*>(p + 2)) << 16;
}

__device__ __forceinline__ uint32_t load_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The fp16 value in the low 16 bits of `bits`.
__device__ __forceinline__ float half_bits(uint32_t bits) {
  __half_raw r;
  r.x = uint16_t(bits & 0xffff);
  return __half2float(__half(r));
}

// The memory words decoding one unit reads (its quants and its block's scales). Each layout's
// load() issues every load of a unit and decode() uses them, so a lane can have several units'
// loads in flight before the first is decoded (gemv_kernel's Unroll).
template <int N>
struct words {
  uint32_t w[N];
};

template <quant_type T>
struct layout;

template <>
struct layout<quant_type::q8_0> {
  static constexpr int block_values = 32, block_bytes = 34, units_per_block = 4;
  // Random quants are uniform int8 (standard deviation 73.9): d scales them to `stddev`.
  __device__ static void set_scales(uint8_t* blk, float stddev) { store_half(blk, stddev / 73.9f); }
  using raw = words<3>;  // d; quants 0-3; quants 4-7
  __device__ static raw load(const uint8_t* blk, int u) {
    const uint8_t* qs = blk + 2 + 8 * u;  // 2-byte aligned only: 34-byte blocks
    return {{load_u16(blk), load_u32_a2(qs), load_u32_a2(qs + 4)}};
  }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    unit o;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o.q[k] = float(int8_t((r.w[1] >> (8 * k)) & 0xff));
      o.q[4 + k] = float(int8_t((r.w[2] >> (8 * k)) & 0xff));
    }
    o.i0 = base + 8 * u, o.i1 = o.i0 + 4;
    o.scale[0] = o.scale[1] = half_bits(r.w[0]);
    o.offset[0] = o.offset[1] = 0.0f;
    return o;
  }
};

// The 32-weight nibble blocks (q4_0, q4_1): unit u is bytes 4u..4u+3 of the nibbles (b), weights
// 4u.. (low nibbles) and 4u+16.. (high); w = d * (nibble + q_shift) + m.
__device__ __forceinline__ unit decode_nibbles32(uint32_t b, int u, int64_t base, float d, float q_shift, float m) {
  unit r;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    r.q[k] = float((b >> (8 * k)) & 0x0f) + q_shift;
    r.q[4 + k] = float((b >> (8 * k + 4)) & 0x0f) + q_shift;
  }
  r.i0 = base + 4 * u, r.i1 = r.i0 + 16;
  r.scale[0] = r.scale[1] = d;
  r.offset[0] = r.offset[1] = m;
  return r;
}

template <>
struct layout<quant_type::q4_0> {  // d (fp16), 16 bytes of nibbles; w = d * (q - 8)
  static constexpr int block_values = 32, block_bytes = 18, units_per_block = 4;
  __device__ static void set_scales(uint8_t* blk, float stddev) { store_half(blk, stddev / 4.61f); }  // q - 8: std 4.61
  using raw = words<2>;  // d; nibbles (2-byte aligned only: 18-byte blocks)
  __device__ static raw load(const uint8_t* blk, int u) { return {{load_u16(blk), load_u32_a2(blk + 2 + 4 * u)}}; }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    return decode_nibbles32(r.w[1], u, base, half_bits(r.w[0]), -8.0f, 0.0f);
  }
};

template <>
struct layout<quant_type::q4_1> {  // d, m (fp16), 16 bytes of nibbles; w = d * q + m
  static constexpr int block_values = 32, block_bytes = 20, units_per_block = 4;
  __device__ static void set_scales(uint8_t* blk, float stddev) {
    const float d = stddev / 4.61f;
    store_half(blk, d), store_half(blk + 2, -7.5f * d);  // q in [0, 15]: mean 7.5
  }
  using raw = words<2>;  // d | m << 16; nibbles
  __device__ static raw load(const uint8_t* blk, int u) { return {{load_u32_a2(blk), load_u32_a2(blk + 4 + 4 * u)}}; }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    return decode_nibbles32(r.w[1], u, base, half_bits(r.w[0]), 0.0f, half_bits(r.w[0] >> 16));
  }
};

// Byte i (0..11) of a k-quant's 12 scale bytes held as three words.
__device__ __forceinline__ int scale_byte(uint32_t s0, uint32_t s1, uint32_t s2, int i) {
  const uint32_t w = i < 4 ? s0 : i < 8 ? s1 : s2;
  return int((w >> (8 * (i & 3))) & 0xff);
}

// The 6-bit scale and min of sub-block j of a q4_k / q5_k super-block (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, uint32_t s0, uint32_t s1, uint32_t s2, int& sc, int& m) {
  if (j < 4) {
    sc = scale_byte(s0, s1, s2, j) & 63;
    m = scale_byte(s0, s1, s2, j + 4) & 63;
  } else {
    sc = (scale_byte(s0, s1, s2, j + 4) & 0x0f) | ((scale_byte(s0, s1, s2, j - 4) >> 6) << 4);
    m = (scale_byte(s0, s1, s2, j + 4) >> 4) | ((scale_byte(s0, s1, s2, j) >> 6) << 4);
  }
}

// Unit u of a q4_k or q5_k block: sub-blocks 2p and 2p + 1 (p = u / 8), q[0..3] and q[4..7] their
// quants; raw words 0-3 are d | dmin << 16 and the 12 scale bytes.
template <class Raw>
__device__ __forceinline__ void k_scales(const Raw& r, int u, int64_t base, unit& o) {
  const int p = u / 8;
  const float d = half_bits(r.w[0]), dmin = half_bits(r.w[0] >> 16);
  int sc, m;
  scale_min_k4(2 * p, r.w[1], r.w[2], r.w[3], sc, m);
  o.scale[0] = d * float(sc), o.offset[0] = -(dmin * float(m));
  scale_min_k4(2 * p + 1, r.w[1], r.w[2], r.w[3], sc, m);
  o.scale[1] = d * float(sc), o.offset[1] = -(dmin * float(m));
  o.i0 = base + 64 * p + 4 * (u % 8), o.i1 = o.i0 + 32;
}

template <>
struct layout<quant_type::q4_k> {  // d, dmin (fp16), 12 scale bytes, qs[128]
  static constexpr int block_values = 256, block_bytes = 144, units_per_block = 32;
  __device__ static void set_scales(uint8_t* blk, float stddev) { set_k_scales(blk, stddev, 4.61f, 7.5f); }
  using raw = words<5>;  // d | dmin << 16; scales 0-3, 4-7, 8-11; qs bytes 4u..4u+3
  __device__ static raw load(const uint8_t* blk, int u) {
    return {{load_u32(blk), load_u32(blk + 4), load_u32(blk + 8), load_u32(blk + 12), load_u32(blk + 16 + 4 * u)}};
  }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    // qs[32p + l] holds weight 64p + l (low nibble) and 64p + 32 + l (high).
    unit o;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o.q[k] = float((r.w[4] >> (8 * k)) & 0x0f);
      o.q[4 + k] = float((r.w[4] >> (8 * k + 4)) & 0x0f);
    }
    k_scales(r, u, base, o);
    return o;
  }
};

template <>
struct layout<quant_type::q5_k> {  // q4_k's d, dmin, scales, then qh[32], qs[128]: q = nibble + 16 * bit
  static constexpr int block_values = 256, block_bytes = 176, units_per_block = 32;
  __device__ static void set_scales(uint8_t* blk, float stddev) { set_k_scales(blk, stddev, 9.23f, 15.5f); }
  using raw = words<6>;  // as q4_k's, then qh bytes 4(u % 8)..+3
  __device__ static raw load(const uint8_t* blk, int u) {
    return {{load_u32(blk), load_u32(blk + 4), load_u32(blk + 8), load_u32(blk + 12), load_u32(blk + 48 + 4 * u),
             load_u32(blk + 16 + 4 * (u % 8))}};
  }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    // As q4_k: qs[32p + l] holds weight 64p + l (low) and 64p + 32 + l (high); qh[l]'s bit 2p is
    // the low weight's fifth bit, bit 2p + 1 the high one's.
    unit o;
    const uint32_t b = r.w[4], h = r.w[5] >> (2 * (u / 8));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o.q[k] = float(((b >> (8 * k)) & 0x0f) | (((h >> (8 * k)) & 1) << 4));
      o.q[4 + k] = float(((b >> (8 * k + 4)) & 0x0f) | (((h >> (8 * k + 1)) & 1) << 4));
    }
    k_scales(r, u, base, o);
    return o;
  }
};

template <>
struct layout<quant_type::q6_k> {  // ql[128], qh[64], int8 scales[16], d (fp16): w = d * sc * (q - 32)
  static constexpr int block_values = 256, block_bytes = 210, units_per_block = 32;
  __device__ static void set_scales(uint8_t* blk, float stddev) {
    for (int i = 0; i < 16; ++i) blk[192 + i] = 16;
    store_half(blk + 208, stddev / (16.0f * 18.47f));  // q - 32: std 18.47
  }
  // Half hf of the block (128 weights): ql[64 hf + l] holds weight 128 hf + l (low nibble) and
  // 128 hf + 64 + l (high), ql[64 hf + 32 + l] weights 128 hf + 32 + l and + 96 + l; qh[32 hf + l]
  // their top two bits at 0, 4 and 2, 6. Unit u takes ql bytes 4u..4u+3: g = 0 the first pair of
  // runs, g = 1 the second; its scales are sc[8 hf + l0 / 16 + 2 g] and the one 4 further.
  using raw = words<4>;  // d; the two scales (bytes 0 and 1); ql; qh (2-byte aligned only: 210-byte blocks)
  __device__ static raw load(const uint8_t* blk, int u) {
    const int hf = u / 16, g = (u / 8) & 1, l0 = 4 * (u % 8);
    const uint8_t* sc = blk + 192 + 8 * hf + l0 / 16 + 2 * g;
    return {{load_u16(blk + 208), uint32_t(sc[0]) | uint32_t(sc[4]) << 8, load_u32_a2(blk + 4 * u),
             load_u32_a2(blk + 128 + 32 * hf + l0)}};
  }
  __device__ static unit decode(const raw& r, int u, int64_t base) {
    const int hf = u / 16, g = (u / 8) & 1, l0 = 4 * (u % 8);
    unit o;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o.q[k] = float(int(((r.w[2] >> (8 * k)) & 0x0f) | (((r.w[3] >> (8 * k + 2 * g)) & 3) << 4)) - 32);
      o.q[4 + k] = float(int(((r.w[2] >> (8 * k + 4)) & 0x0f) | (((r.w[3] >> (8 * k + 4 + 2 * g)) & 3) << 4)) - 32);
    }
    const float d = half_bits(r.w[0]);
    o.scale[0] = d * float(int8_t(r.w[1] & 0xff)), o.scale[1] = d * float(int8_t((r.w[1] >> 8) & 0xff));
    o.offset[0] = o.offset[1] = 0.0f;
    o.i0 = base + 128 * hf + 32 * g + l0, o.i1 = o.i0 + 64;
    return o;
  }
};

// Unit u of the block at blk, loaded and decoded.
template <quant_type T>
__device__ __forceinline__ unit decode_unit(const uint8_t* blk, int u, int64_t base) {
  return layout<T>::decode(layout<T>::load(blk, u), u, base);
}

// One unit's B dot products added to acc: scale * sum(q x) + offset * sum(x), two sums per run
// instead of a dequantized weight each.
template <int B>
__device__ __forceinline__ void unit_dots(const unit& q, const bf16* __restrict__ x, int64_t n_in, float (&acc)[B]) {
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float x0[4], x1[4];
    load4(x + b * n_in + q.i0, x0);
    load4(x + b * n_in + q.i1, x1);
    float qx0 = 0.0f, qx1 = 0.0f, sx0 = 0.0f, sx1 = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      qx0 += q.q[k] * x0[k], qx1 += q.q[4 + k] * x1[k];
      sx0 += x0[k], sx1 += x1[k];
    }
    acc[b] += q.scale[0] * qx0 + q.scale[1] * qx1 + q.offset[0] * sx0 + q.offset[1] * sx1;
  }
}

// One warp per output row; lane l takes units l, l + 32, ... in order. Unroll > 1: the loads of
// Unroll units (layout::load) are issued before the first is decoded, so a lane has Unroll units'
// quants and scales in flight rather than one (the same sums in the same order: the same bits).
// Under programmatic dependent launch (launch.cuh) it waits for the kernel ahead before reading x
// or writing y; unrolled, the first Unroll units' weight loads (no kernel writes weights) go out
// before that wait, so HBM streams while the kernel ahead finishes.
template <quant_type T, int B, class Out, int Unroll>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_kernel(const uint8_t* __restrict__ w, int64_t n_out, int64_t n_in,
                                                               const bf16* __restrict__ x, Out* __restrict__ y,
                                                               int64_t ldy) {
  using L = layout<T>;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.x) * gemv_warps + (threadIdx.x >> 5);
  if (o >= n_out) return;  // whole warps leave together
  const int64_t n_units = n_in / L::block_values * L::units_per_block;
  const uint8_t* row = w + o * (n_in / L::block_values) * L::block_bytes;
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.0f;
  int64_t u = lane;
  bool waited = false;
  if constexpr (Unroll > 1) {
    for (; u + 32 * (Unroll - 1) < n_units; u += 32 * Unroll) {
      typename L::raw r[Unroll];
#pragma unroll
      for (int k = 0; k < Unroll; ++k) {
        const int64_t uk = u + 32 * k;
        r[k] = L::load(row + uk / L::units_per_block * L::block_bytes, int(uk % L::units_per_block));
      }
      if (!waited) pdl_wait(), waited = true;
#pragma unroll
      for (int k = 0; k < Unroll; ++k) {
        const int64_t uk = u + 32 * k;
        unit_dots<B>(L::decode(r[k], int(uk % L::units_per_block), uk / L::units_per_block * L::block_values), x, n_in, acc);
      }
    }
  }
  if (!waited) pdl_wait();
  for (; u < n_units; u += 32) {
    const int64_t blk = u / L::units_per_block;
    unit_dots<B>(decode_unit<T>(row + blk * L::block_bytes, int(u % L::units_per_block), blk * L::block_values), x, n_in, acc);
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float s = warp_sum(acc[b]);
    if (lane == b) {
      if constexpr (std::is_same_v<Out, float>) {
        y[b * ldy + o] = s;
      } else {
        y[b * ldy + o] = __float2bfloat16_rn(s);
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

// One warp's B dot products of row `row_w`, scaled as a gemv_norm reader when Reader (every lane
// returns them).
template <int B, bool Reader>
__device__ __forceinline__ void gemv_bf16_dots(const bf16* __restrict__ row_w, int64_t n_in, const bf16* __restrict__ x,
                                               const gemv_norm& norm, float (&acc)[B]) {
  gemv_bf16_row<B>(row_w, n_in, x, acc);
  if constexpr (Reader) {
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] *= norm_fold_scale(norm.sumsq_in + b * fold_parts(n_in), n_in, norm.eps);
  }
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

template <int B, bool Reader, bool Writer>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_bf16_kernel(const bf16* __restrict__ w, int64_t n_out, int64_t n_in,
                                                                    const bf16* __restrict__ x, bf16* __restrict__ y,
                                                                    int prefetch_bytes, gemv_norm norm) {
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.x) * gemv_warps + warp;
  if constexpr (!Writer) {
    if (o < n_out && prefetch_bytes > 0) gemv_prefetch_row(w + o * n_in, n_in, prefetch_bytes);
    pdl_wait();
    if (o >= n_out) return;  // whole warps leave together
    float acc[B];
    gemv_bf16_dots<B, Reader>(w + o * n_in, n_in, x, norm, acc);
#pragma unroll
    for (int b = 0; b < B; ++b)
      if (lane == b) y[b * n_out + o] = __float2bfloat16_rn(acc[b]);
  } else {
    // Residual add as add_rmsnorm does it (x + float(bf16 y)), then the normalized input of the
    // next GEMV before its scale, and this CTA's sum of squares per batch row (rows in order).
    TROUPE_SHARED(float[gemv_warps][B], sums);
    TROUPE_SHARED(float[gemv_warps][B], squares);
    gemv_bf16_cta_dots<B, Reader>(o < n_out ? w + o * n_in : nullptr, n_in, x, norm, prefetch_bytes, sums);
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
}

// The gate|up GEMV with SwiGLU on its outputs: CTA c computes act[:, 2c] and act[:, 2c + 1], its
// warps taking gate rows 2c, 2c + 1 and up rows d_ff + 2c, d_ff + 2c + 1 (the same per-row sums
// as gemv_bf16_kernel, rounded to bf16 as it stores them), then silu_mul as swiglu does: the
// result is the bits of gemv_bf16 followed by swiglu, without the gate|up round trip or a launch.
template <int B, bool Reader>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_bf16_swiglu_kernel(const bf16* __restrict__ w, int64_t d_ff,
                                                                           int64_t n_in, const bf16* __restrict__ x,
                                                                           bf16* __restrict__ act, int prefetch_bytes,
                                                                           gemv_norm norm) {
  static_assert(gemv_warps == 4, "two gate and two up rows a CTA");
  TROUPE_SHARED(float[gemv_warps][B], sums);
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5;
  const int64_t j = int64_t(blockIdx.x) * 2 + (warp & 1);
  // Gate row j (warps 0, 1) or up row j (2, 3); the last CTA of an odd d_ff has one column.
  gemv_bf16_cta_dots<B, Reader>(j < d_ff ? w + ((warp >> 1) * d_ff + j) * n_in : nullptr, n_in, x, norm, prefetch_bytes, sums);
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
// items 2c and 2c + 1 (qkv_item, qkv_items.hpp), a warp per column (the same per-row sums as
// gemv_bf16_kernel, rounded to bf16 as it stores them), then finishes each item as
// rope_qkv_store does (rope.cuh): the same Q and cache bits as gemv_bf16 then rope_qkv_store,
// without the qkv round trip or a launch. Batch row t is token row t of st.
template <int B, bool Reader>
__global__ void __launch_bounds__(gemv_warps * 32) gemv_bf16_rope_kernel(const bf16* __restrict__ w, int64_t n_in,
                                                                         const bf16* __restrict__ x, qkv_rope_args r,
                                                                         int prefetch_bytes, gemv_norm norm) {
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
  gemv_bf16_cta_dots<B, Reader>(
      p < n_items ? w + item(p).row(rp.n_heads, rp.n_kv_heads, rp.head_dim, warp & 1) * n_in : nullptr, n_in, x, norm,
      prefetch_bytes, sums);
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

// f(std::integral_constant<int, batch>{}) for batch in [1, max_batch].
template <class F>
void with_batch(int batch, F&& f) {
  switch (batch) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
  }
}

// f(std::integral_constant<quant_type, t>{}).
template <class F>
void with_type(quant_type t, F&& f) {
  switch (t) {
    case quant_type::q8_0: return f(std::integral_constant<quant_type, quant_type::q8_0>{});
    case quant_type::q4_0: return f(std::integral_constant<quant_type, quant_type::q4_0>{});
    case quant_type::q4_k: return f(std::integral_constant<quant_type, quant_type::q4_k>{});
    case quant_type::q4_1: return f(std::integral_constant<quant_type, quant_type::q4_1>{});
    case quant_type::q5_k: return f(std::integral_constant<quant_type, quant_type::q5_k>{});
    case quant_type::q6_k: return f(std::integral_constant<quant_type, quant_type::q6_k>{});
  }
  throw cuda_error("quantized GEMV: unknown quant_type " + std::to_string(int(t)));
}

int block_values(quant_type t) {
  int n = 0;
  with_type(t, [&](auto c) { n = layout<decltype(c)::value>::block_values; });
  return n;
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + uintptr_t(b_bytes) && pb < pa + uintptr_t(a_bytes);
}

void check_args(quant_type t, const void* w, int64_t n, const char* name) {
  // q4_k and q5_k read 32-bit words of 144- and 176-byte blocks; the others 16-bit words.
  const bool words = t == quant_type::q4_k || t == quant_type::q5_k;
  if (n % block_values(t) != 0 || !aligned(w, words ? 4 : 2))
    throw cuda_error(std::string(name) + ": length not a multiple of the block size, or misaligned weights");
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
                   cudaStream_t stream, int64_t ldy, int unroll) {
  const std::string n = name;
  if (batch < 1 || batch > max_batch) throw cuda_error(n + ": batch must be in [1, 8]");
  check_args(t, w, n_in, name);
  if (!aligned(x, 8)) throw cuda_error(n + ": x must be 8-byte aligned");
  if (ldy == 0) ldy = n_out;
  if (ldy < n_out) throw cuda_error(n + ": ldy must be 0 or at least n_out");
  if (unroll != 1 && unroll != 4 && unroll != 8) throw cuda_error(n + ": unroll must be 1, 4 or 8");
  if (n_out <= 0 || n_in <= 0) return;
  if (overlaps(x, batch * n_in * 2, y, ((batch - 1) * ldy + n_out) * int64_t(sizeof(Out))))
    throw cuda_error(n + ": y overlaps x (other CTAs still read x while one stores y)");
  const auto blocks = unsigned((n_out + gemv_warps - 1) / gemv_warps);
  with_type(t, [&](auto type) {
    with_batch(batch, [&](auto b) {
      constexpr quant_type T = decltype(type)::value;
      constexpr int B = decltype(b)::value;
      auto kernel = unroll == 8 ? gemv_kernel<T, B, Out, 8> : unroll == 4 ? gemv_kernel<T, B, Out, 4> : gemv_kernel<T, B, Out, 1>;
      launch(kernel, blocks, gemv_warps * 32, 0, stream, static_cast<const uint8_t*>(w), n_out, n_in, x, y, ldy);
    });
  });
  check_launch(name);
}

}  // namespace

int64_t norm_fold_parts(int64_t n_out) { return fold_parts(n_out); }

void gemv_quant(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch,
                cudaStream_t stream, int64_t ldy, int unroll) {
  gemv_quant_to("gemv_quant", t, w, n_out, n_in, x, y, batch, stream, ldy, unroll);
}

void gemv_quant_f32(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, float* y, int batch,
                    cudaStream_t stream, int64_t ldy, int unroll) {
  gemv_quant_to("gemv_quant_f32", t, w, n_out, n_in, x, y, batch, stream, ldy, unroll);
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
    auto kernel = reader ? (writer ? gemv_bf16_kernel<B, true, true> : gemv_bf16_kernel<B, true, false>)
                         : (writer ? gemv_bf16_kernel<B, false, true> : gemv_bf16_kernel<B, false, false>);
    launch(kernel, blocks, gemv_warps * 32, 0, stream, w, n_out, n_in, x, y, prefetch_bytes, norm);
  });
  check_launch("gemv_bf16");
}

void gemv_bf16_swiglu(const bf16* w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch, cudaStream_t stream,
                      int prefetch_bytes, const gemv_norm& norm) {
  check_bf16_args("gemv_bf16_swiglu", w, n_in, x, batch, prefetch_bytes);
  if (norm.residual || norm.norm_w || norm.sumsq_out) throw cuda_error("gemv_bf16_swiglu: a norm reader only");
  if (d_ff <= 0 || n_in <= 0) return;
  const auto blocks = unsigned((d_ff + 1) / 2);
  with_batch(batch, [&](auto b) {
    constexpr int B = decltype(b)::value;
    auto kernel = norm.sumsq_in ? gemv_bf16_swiglu_kernel<B, true> : gemv_bf16_swiglu_kernel<B, false>;
    launch(kernel, blocks, gemv_warps * 32, 0, stream, w, d_ff, n_in, x, act, prefetch_bytes, norm);
  });
  check_launch("gemv_bf16_swiglu");
}

void gemv_bf16_rope_qkv(const bf16* w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                        int prefetch_bytes, const gemv_norm& norm) {
  const int batch = r.st.n_tokens;
  check_bf16_args("gemv_bf16_rope_qkv", w, n_in, x, batch, prefetch_bytes);
  const rope_params& rp = r.rope;
  if (rp.n_rot % 2 != 0 || rp.n_rot > rp.head_dim || rp.head_dim % 2 != 0 || rp.n_heads <= 0 || rp.n_kv_heads <= 0)
    throw cuda_error("gemv_bf16_rope_qkv: n_rot and head_dim must be even with n_rot <= head_dim, heads > 0");
  if (norm.residual || norm.norm_w || norm.sumsq_out) throw cuda_error("gemv_bf16_rope_qkv: a norm reader only");
  if (n_in <= 0) return;
  const auto blocks = unsigned((qkv_item_count(rp.n_heads, rp.n_kv_heads, rp.head_dim) + 1) / 2);
  with_batch(batch, [&](auto b) {
    constexpr int B = decltype(b)::value;
    auto kernel = norm.sumsq_in ? gemv_bf16_rope_kernel<B, true> : gemv_bf16_rope_kernel<B, false>;
    launch(kernel, blocks, gemv_warps * 32, 0, stream, w, n_in, x, r, prefetch_bytes, norm);
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
