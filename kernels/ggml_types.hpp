// Tensor element types as GGUF stores them (ggml's numbering and block layouts), shared by the
// loader in engine/ and the kernels that read quantized blocks directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace troupe::kernels {

/// ggml type ids (only those troupe supports are named; the numbers are fixed by the GGUF format).
enum class dtype : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,  // read by the loader only: repacked to q8_0 (exactly) when a model is loaded
  q8_0 = 8,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  bf16 = 30,
};

/// Number of weights in one super-block of the k-quants.
inline constexpr int qk_k = 256;

using fp16_t = uint16_t;  // IEEE half, raw bits
using bf16_t = uint16_t;  // bfloat16, raw bits

// ggml's block layouts, byte for byte (static_asserts below pin the sizes).
struct block_q4_0 {  // 32 weights: w = (q - 8) * d; qs[j] low nibble -> j, high nibble -> j + 16
  fp16_t d;
  uint8_t qs[16];
};
struct block_q4_1 {  // 32 weights: w = q * d + m
  fp16_t d;
  fp16_t m;
  uint8_t qs[16];
};
struct block_q5_0 {  // 32 weights: w = (q - 16) * d, q = low nibble (qs, as q4_0) | bit j of qh << 4
  fp16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct block_q8_0 {  // 32 weights: w = q * d
  fp16_t d;
  int8_t qs[32];
};
struct block_q4_k {  // 256 weights in 8 sub-blocks of 32, 6-bit scales and mins packed in scales[12]
  fp16_t d;
  fp16_t dmin;
  uint8_t scales[12];
  uint8_t qs[qk_k / 2];
};
struct block_q5_k {  // as q4_k plus one high bit per weight in qh
  fp16_t d;
  fp16_t dmin;
  uint8_t scales[12];
  uint8_t qh[qk_k / 8];
  uint8_t qs[qk_k / 2];
};
struct block_q6_k {  // 256 weights in 16 sub-blocks of 16, 8-bit signed scales
  uint8_t ql[qk_k / 2];
  uint8_t qh[qk_k / 4];
  int8_t scales[qk_k / 16];
  fp16_t d;
};
static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q4_k) == 144);
static_assert(sizeof(block_q5_k) == 176);
static_assert(sizeof(block_q6_k) == 210);

struct dtype_traits {
  dtype type;
  const char* name;    // as gguf-py names it: "F32", "Q4_K", ...
  int64_t block_size;  // weights per block
  int64_t type_size;   // bytes per block
};

/// Traits of a raw GGUF type id, or nullptr when troupe does not support that type.
const dtype_traits* find_dtype(uint32_t raw);

/// Traits of a supported type (never null).
const dtype_traits& traits(dtype t);

/// Bytes taken by n weights of type t; n must be a multiple of the block size.
inline int64_t row_bytes(const dtype_traits& tr, int64_t n) { return n / tr.block_size * tr.type_size; }

}  // namespace troupe::kernels
