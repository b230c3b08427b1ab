// GGUF block layouts as the quantized GEMVs read them on the device (quant.cu's plain GEMV and norm
// writer, the fused SwiGLU and RoPE ones of quant_fused.cu), one warp's dot products over a
// quantized row, the row source the fused kernels of gemv_fused.cuh take (quant_rows), and the
// host-side checks and type/batch/unroll dispatch their launchers share.
//
// Work is cut into "units" of 8 weights whose quantized bytes are contiguous: a quarter of a
// q8_0 block, a quarter of a q4_0 or q4_1 block (4 bytes: weights j..j+3 low nibbles, j+16..j+19
// high), and a 32nd of a k-quant super-block: 4 bytes of q4_k's or q5_k's nibbles (4 weights of
// sub-block 2p and 4 of 2p+1; q5_k's fifth bits from 4 bytes of qh that 8 lanes share), 4 bytes
// of q6_k's low nibbles (4 weights of one 32-run and 4 of the run 64 further; their top two bits
// from 4 bytes of qh that 8 lanes share). Lane l of a warp takes units l, l+32, ..., so a warp
// reads each row's quants as one coalesced stream. Together these are the types of llama.cpp's
// Q4_K_M, Q5_K_M, Q4_0 and Q8_0 files (Q6_K for the tensors the K_M mixes keep at more bits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv_fused.cuh"
#include "kernels/cuda/launch.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int max_batch = 8;  // batch rows of the GEMVs

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

// One warp's B dot products of a quantized row (n_in values of type T) with the B rows of x; every
// lane returns the totals. Lane l takes units l, l + 32, ... in order. Unroll > 1: the loads of
// Unroll units (layout::load) are issued before the first is decoded, so a lane has Unroll units'
// quants and scales in flight rather than one (the same sums in the same order: the same bits).
// Under programmatic dependent launch (launch.cuh) it waits for the kernel ahead before it reads
// x; unrolled, the first Unroll units' weight loads (no kernel writes weights) go out before that
// wait, so HBM streams while the kernel ahead finishes.
template <quant_type T, int B, int Unroll>
__device__ __forceinline__ void quant_row_dots(const uint8_t* __restrict__ row, int64_t n_in, const bf16* __restrict__ x,
                                               float (&acc)[B]) {
  using L = layout<T>;
  const int lane = threadIdx.x & 31;
  const int64_t n_units = n_in / L::block_values * L::units_per_block;
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
  for (int b = 0; b < B; ++b) acc[b] = warp_sum(acc[b]);
}

// Rows of a quant_matrix of type T for gemv_fused.cuh's kernels: warp w's dots by
// quant_row_dots (the same sums as gemv_quant's), scaled as a gemv_norm reader when Reader; with
// no row, only the wait for the kernel ahead.
template <quant_type T, int B, int Unroll, bool Reader>
struct quant_rows {
  static constexpr int batch = B;
  quant_matrix m;
  int64_t n_in;
  gemv_norm norm;
  __device__ const uint8_t* row_at(int64_t row) const {
    int p = m.n_parts - 1;
    while (p > 0 && row < m.row0[p]) --p;
    return static_cast<const uint8_t*>(m.raw[p]) + (row - m.row0[p]) * (n_in / layout<T>::block_values) * layout<T>::block_bytes;
  }
  __device__ void cta_dots(int64_t row, const bf16* __restrict__ x, float (&sums)[gemv_warps][B]) const {
    if (row >= 0) {
      float acc[B];
      quant_row_dots<T, B, Unroll>(row_at(row), n_in, x, acc);
      if constexpr (Reader) apply_norm_reader<B>(norm, n_in, acc);
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int b = 0; b < B; ++b)
        if (lane == b) sums[threadIdx.x >> 5][b] = acc[b];
    } else {
      pdl_wait();
    }
    __syncthreads();
  }
};

// ---- host side ----------------------------------------------------------------------------------

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

inline int block_values(quant_type t) {
  int n = 0;
  with_type(t, [&](auto c) { n = layout<decltype(c)::value>::block_values; });
  return n;
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
inline bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + uintptr_t(b_bytes) && pb < pa + uintptr_t(a_bytes);
}

inline void check_args(quant_type t, const void* w, int64_t n, const char* name) {
  // q4_k and q5_k read 32-bit words of 144- and 176-byte blocks; the others 16-bit words.
  const bool words = t == quant_type::q4_k || t == quant_type::q5_k;
  if (n % block_values(t) != 0 || !aligned(w, words ? 4 : 2))
    throw cuda_error(std::string(name) + ": length not a multiple of the block size, or misaligned weights");
}

// f(std::integral_constant<int, unroll>{}) for unroll 1, 4 or 8 (launch_options::quant_gemv_unroll).
template <class F>
void with_unroll(int unroll, const char* name, F&& f) {
  switch (unroll) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
  }
  throw cuda_error(std::string(name) + ": unroll must be 1, 4 or 8");
}

// The checks gemv_quant makes, for a quant_matrix of n_out rows read by `batch` rows of x.
inline void check_quant_matrix(const char* name, const quant_matrix& w, int64_t n_out, int64_t n_in, const bf16* x, int batch, int unroll) {
  const std::string n = name;
  if (batch < 1 || batch > max_batch) throw cuda_error(n + ": batch must be in [1, 8]");
  if (w.n_parts < 1 || w.n_parts > 3 || w.row0[0] != 0) throw cuda_error(n + ": a quant_matrix has 1 to 3 parts, the first at row 0");
  for (int p = 0; p < w.n_parts; ++p) {
    check_args(w.qt, w.raw[p], n_in, name);
    if (p > 0 && !(w.row0[p] > w.row0[p - 1] && w.row0[p] < n_out))
      throw cuda_error(n + ": a quant_matrix's parts must start at increasing rows below n_out");
  }
  if (!aligned(x, 8)) throw cuda_error(n + ": x must be 8-byte aligned");
  if (unroll != 1 && unroll != 4 && unroll != 8) throw cuda_error(n + ": unroll must be 1, 4 or 8");
}

// A gemv_norm that is a reader or nothing (the fused quantized GEMVs' inputs are a norm's).
inline void check_norm_reader(const char* name, const gemv_norm& norm) {
  if (norm.residual || norm.norm_w || norm.sumsq_out) throw cuda_error(std::string(name) + ": a norm reader only");
}

// f(quant_rows<T, B, Unroll, Reader>{w, n_in, norm}) for w's type, the batch, the unroll and
// whether norm is a reader.
template <class F>
void with_rows(const quant_matrix& w, int64_t n_in, int batch, int unroll, const gemv_norm& norm, const char* name, F&& f) {
  with_type(w.qt, [&](auto type) {
    with_batch(batch, [&](auto b) {
      with_unroll(unroll, name, [&](auto u) {
        constexpr quant_type T = decltype(type)::value;
        constexpr int B = decltype(b)::value, U = decltype(u)::value;
        if (norm.sumsq_in)
          f(quant_rows<T, B, U, true>{w, n_in, norm});
        else
          f(quant_rows<T, B, U, false>{w, n_in, norm});
      });
    });
  });
}

}  // namespace

}  // namespace troupe::kernels::cuda
