// Reference dequantization: GGUF blocks to float, bit-exact with the gguf Python package.
#pragma once

#include <cstdint>

#include "kernels/ggml_types.hpp"

namespace troupe::kernels {

/// Writes n floats for the n weights starting at src; n is a multiple of the type's block size.
void dequantize_row(dtype t, const void* src, float* dst, int64_t n);

}  // namespace troupe::kernels
