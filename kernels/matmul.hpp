// Products of float activations with (possibly quantized) weight matrices, reading the quantized
// blocks directly. Activations are quantized per row on the fly to the integer format the weight
// type pairs with (q8 blocks, as llama.cpp does), so the inner loops are integer dot products.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/ggml_types.hpp"

namespace troupe::kernels {

class thread_pool;

/// A weight matrix of n_out rows, each n_in weights of `type`, rows row_stride bytes apart
/// (GGUF: ne[0] = n_in, ne[1] = n_out). n_in is a multiple of the type's block size; data and
/// row_stride are even (rows need no other alignment).
struct weight_view {
  dtype type = dtype::f32;
  const void* data = nullptr;
  int64_t n_out = 0;
  int64_t n_in = 0;
  size_t row_stride = 0;
};

/// y[i * ldy + o] = sum_k x[i * ldx + k] * W[o][k]   for i in [0, m), o in [0, n_out).
/// Supported types: f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k. Uses every pool thread.
/// For the quantized types x is rounded per block to 8 bits first (as llama.cpp does), which
/// costs about 0.5% relative error (1% for the k-quants, which round per 256 values); float types
/// are accurate to float rounding. Each output is computed the same way whatever the number of
/// threads or the batch it is part of, so results are reproducible bit for bit.
/// Preconditions: x is finite, x and y do not overlap.
/// Throws std::invalid_argument for an unsupported type or inconsistent shapes and strides.
void matmul(const weight_view& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, thread_pool& pool);

/// One product of a matmul_batch: y[i * ldy + o] = sum_k x[i * ldx + k] * w[o][k].
struct matmul_out {
  weight_view w;
  float* y = nullptr;
  int64_t ldy = 0;
};

/// Several products of the same activations, e.g. the Q, K and V projections of one input: x is
/// quantized once per activation format and all products share one parallel region. Every w.n_in
/// must be equal. Same preconditions and errors as matmul; the y buffers must not overlap each
/// other. On an error nothing has been written.
void matmul_batch(std::span<const matmul_out> outs, const float* x, int64_t ldx, int64_t m, thread_pool& pool);

/// The SIMD level chosen at run time ("avx512-vnni", "avx2", "scalar"), for logs and benchmarks.
const char* matmul_isa();

}  // namespace troupe::kernels
