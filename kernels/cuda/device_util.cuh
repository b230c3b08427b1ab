// Small device helpers shared by the kernel files: warp reductions, bf16 vector conversion, shared
// memory addresses for PTX.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace troupe::kernels::cuda {

/// Sum over the 32 lanes of a warp (all lanes active); every lane gets it.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Eight bf16 values in one 16-byte word, as floats.
__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

/// SwiGLU's product silu(g) * u = g / (1 + e^-g) * u: one function, so the swiglu kernel and the
/// GEMV that applies it to its own outputs give the same bits.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/// GeGLU's product gelu(g) * u, GELU by its tanh approximation written as a sigmoid (as
/// kernels::geglu): g * sigmoid(2 sqrt(2/pi) g (1 + 0.044715 g^2)) * u.
__device__ __forceinline__ float gelu_mul(float g, float u) {
  constexpr float two_c = 2.0f * 0.79788456080286535588f, coef = 0.044715f;
  return g / (1.0f + expf(-(two_c * g * (1.0f + coef * g * g)))) * u;
}

/// Asks L2 for the 128-byte line at p (no register holds anything; the load that wants it later
/// finds it in L2 if it arrived and stayed).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifndef TROUPE_CUDA_EMU  // nothing to ask of a cache in the CPU emulation build (tests/cuda_emu)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

/// The shared-state-space address of a pointer into shared memory (PTX operands).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// T as a type name a declaration can put before the variable's name, arrays included
/// (std::type_identity is C++20; .cu files are C++17): for TROUPE_SHARED.
template <class T>
struct shared_decl {
  using type = T;
};

}  // namespace troupe::kernels::cuda

/// `__shared__ T name`, a static shared variable (arrays too: TROUPE_SHARED(float[4][8], sums)); in
/// the CPU emulation build (tests/cuda_emu) storage of the running CTA's own, so CTAs suspended
/// mid-kernel keep theirs.
#ifdef TROUPE_CUDA_EMU
#define TROUPE_SHARED(T, name)  \
  static char name##_emu_key_; \
  auto& name = *static_cast<typename ::troupe::kernels::cuda::shared_decl<T>::type*>(::troupe_emu::cta_static(&name##_emu_key_, sizeof(T), alignof(T)))
#else
#define TROUPE_SHARED(T, name) __shared__ typename ::troupe::kernels::cuda::shared_decl<T>::type name
#endif

/// `extern __shared__ __align__(A) T name[]`, the launch's dynamic shared memory; in the CPU
/// emulation build (tests/cuda_emu) the running CTA's buffer.
#ifdef TROUPE_CUDA_EMU
#define TROUPE_DYNAMIC_SMEM(T, name, A) T* const name = reinterpret_cast<T*>(::troupe_emu::dynamic_smem())
#else
#define TROUPE_DYNAMIC_SMEM(T, name, A) extern __shared__ __align__(A) T name[]
#endif
