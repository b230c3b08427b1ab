// Reference dequantization: GGUF blocks to float, bit-exact with the gguf Python package.
#pragma once

#include <cstdint>

#include "kernels/ggml_types.hpp"

namespace troupe::kernels {

/// Writes n floats for the n weights starting at src; n is a multiple of the type's block size.
void dequantize_row(dtype t, const void* src, float* dst, int64_t n);

/// q5_0 blocks as q8_0 blocks with the same scale and the same integer values (-16..15): the
/// weights are identical, so the matmul kernels read q5_0 models through their q8_0 path.
void repack_q5_0_to_q8_0(const block_q5_0* x, block_q8_0* y, int64_t n_blocks);

}  // namespace troupe::kernels
