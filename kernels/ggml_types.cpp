#include "kernels/ggml_types.hpp"

#include <array>
#include <cstdlib>

namespace troupe::kernels {

namespace {

// Block sizes and byte sizes as ggml defines them (GGML_QUANT_SIZES in gguf-py).
constexpr std::array<dtype_traits, 10> all_traits{{
    {dtype::f32, "F32", 1, 4},
    {dtype::f16, "F16", 1, 2},
    {dtype::q4_0, "Q4_0", 32, sizeof(block_q4_0)},
    {dtype::q4_1, "Q4_1", 32, sizeof(block_q4_1)},
    {dtype::q5_0, "Q5_0", 32, sizeof(block_q5_0)},
    {dtype::q8_0, "Q8_0", 32, sizeof(block_q8_0)},
    {dtype::q4_k, "Q4_K", qk_k, sizeof(block_q4_k)},
    {dtype::q5_k, "Q5_K", qk_k, sizeof(block_q5_k)},
    {dtype::q6_k, "Q6_K", qk_k, sizeof(block_q6_k)},
    {dtype::bf16, "BF16", 1, 2},
}};

}  // namespace

const dtype_traits* find_dtype(uint32_t raw) {
  for (const auto& tr : all_traits)
    if (static_cast<uint32_t>(tr.type) == raw) return &tr;
  return nullptr;
}

const dtype_traits& traits(dtype t) {
  const dtype_traits* tr = find_dtype(static_cast<uint32_t>(t));
  if (tr == nullptr) std::abort();  // unreachable for a named enumerator
  return *tr;
}

}  // namespace troupe::kernels
