// Private interface between the matmul driver (matmul.cpp) and its per-ISA kernels
// (matmul_scalar.cpp, matmul_avx2.cpp, matmul_avx512.cpp): the quantized activation layouts, the
// kernel signature and the run-time ISA choice (with a hook that lets tests force each level).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/ggml_types.hpp"
#include "kernels/matmul.hpp"

namespace troupe::kernels::detail {

/// SIMD levels, in increasing order. avx512 means AVX-512 F/BW/VL/DQ + VNNI + VBMI.
enum class isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(isa level);

/// The best level this CPU (and this build) supports.
isa detected_isa();

/// The level matmul uses now: detected_isa() unless a test forced a lower one.
isa active_isa();

/// Test hook: makes matmul use `level`. Returns false (and changes nothing) when the CPU or the
/// build lacks it. Not thread-safe with respect to concurrent matmul calls.
bool force_isa(isa level);

/// How a kernel wants its activations.
enum class act_kind : int {
  f32,     ///< the caller's float rows as they are
  q8x4,    ///< act_group rows, values as int8
  q8x4_u,  ///< act_group rows, values stored as uint8 q + 128 (for u8 x s8 products)
  q8x8,    ///< act_octet rows, values as int8
  q8_k,    ///< act_block_k rows (k-quants)
};

/// Number of act_kind values (for tables indexed by kind).
inline constexpr int n_act_kinds = 5;

/// Activations quantized per block of 32 (x ~ d * q, q in [-127, 127], d = max|x| / 127), four
/// blocks to a group. The layout serves the 4-blocks-at-a-time integer dot products: the 128 values
/// are stored as [b0[0:16] b1[0:16] b2[0:16] b3[0:16] b0[16:32] b1[16:32] b2[16:32] b3[16:32]],
/// which is where a Q4 block's low and high nibbles land when four blocks are unpacked side by side;
/// after a 4-byte dot product, 32-bit lanes 4b..4b+3 belong to block b. The scales are stored
/// ready for those lanes: d[4b + l] = d_b and s[4b + l] = d_b * sum(q_b) / 4 for l in [0, 4).
/// A row of n_in values takes ceil(n_in / 128) groups; blocks past n_in have q = 0, d = s = 0.
struct alignas(64) act_group {
  uint8_t q[128];
  float d[16];
  float s[16];
};
static_assert(sizeof(act_group) == 256);

/// The same blocks of 32, eight to a group, for the AVX-512 Q4 kernels: four 64-byte runs, each
/// holding 8 values of every block (block b at bytes 8b..8b+7 of the run): run 0 holds values
/// 0..7 of each block, run 1 values 16..23, run 2 values 8..15 and run 3 values 24..31 - where
/// the low and high nibbles of byte ranges [0, 8) and [8, 16) of eight Q4 blocks land when
/// gathered side by side. A 4-byte dot product then leaves block b in 32-bit lanes 2b and 2b + 1;
/// d[2b + l] = d_b and s[2b + l] = d_b * sum(q_b) / 2 for l in {0, 1}. Blocks past n_in are zero.
struct alignas(64) act_octet {
  uint8_t q[256];
  float d[16];
  float s[16];
};
static_assert(sizeof(act_octet) == 384);

/// Position of value i (0 <= i < 256) of an octet in act_octet::q.
constexpr int act_octet_pos(int i) {
  constexpr int run_of[4] = {0, 2, 1, 3};
  const int b = i / 32, j = i % 32;
  return 64 * run_of[j / 8] + 8 * b + j % 8;
}

/// Activations quantized per 256 values for the k-quants (as ggml's block_q8_K): x ~ d * q,
/// q in [-127, 127] in natural order, bsums[i] = sum of q[16 i .. 16 i + 16).
struct alignas(64) act_block_k {
  int8_t q[qk_k];
  int16_t bsums[qk_k / 16];
  float d;
};
static_assert(sizeof(act_block_k) == 320);

/// Position of value i (0 <= i < 128) of a group in act_group::q.
constexpr int act_group_pos(int i) {
  const int b = i / 32, j = i % 32;
  return j < 16 ? 16 * b + j : 64 + 16 * b + (j - 16);
}

/// m activation rows, row i at data + i * stride bytes (f32: the caller's floats).
struct act_view {
  act_kind kind = act_kind::f32;
  const uint8_t* data = nullptr;
  size_t stride = 0;
  int64_t m = 0;
  int64_t n_in = 0;
};

/// Bytes of one quantized row of n_in values (0 for f32, which is not copied).
size_t act_row_bytes(act_kind kind, int64_t n_in);

/// Quantizes rows [i0, i1) of x (row i at x + i * ldx) into dst (row i at dst + i * stride) with
/// the given level's code. Every level produces identical bytes.
void quantize_rows(act_kind kind, isa level, const float* x, int64_t ldx, int64_t n_in, int64_t i0, int64_t i1,
                   uint8_t* dst, size_t stride);

/// Computes y[i * ldy + o] for all activation rows i and weight rows o in [o0, o1).
using gemm_fn = void (*)(const weight_view& w, int64_t o0, int64_t o1, const act_view& a, float* y, int64_t ldy);

/// A kernel for one weight type at one level, and the activation layout it reads.
struct kernel {
  act_kind act = act_kind::f32;
  gemm_fn fn = nullptr;
};

// Kernel tables, one per level; fn is null for a type the level does not handle.
kernel find_kernel_scalar(dtype t);
kernel find_kernel_avx2(dtype t);
kernel find_kernel_avx512(dtype t);

}  // namespace troupe::kernels::detail
