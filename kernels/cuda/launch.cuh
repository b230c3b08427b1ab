// Kernel launches that may overlap the kernel before them (programmatic dependent launch, sm_90).
//
// A kernel launched by launch() while a pdl_scope is on for the calling thread carries
// cudaLaunchAttributeProgrammaticStreamSerialization: the GPU may start it as soon as every CTA of
// the kernel before it on the stream has called pdl_launch_dependents(), instead of when that
// kernel has finished. Each such kernel must therefore call pdl_wait() before it reads anything an
// earlier kernel wrote or writes anything an earlier kernel reads; pdl_wait() returns when the
// kernel before has completed and its writes are visible (and that kernel waited likewise, so every
// earlier one has too). Before pdl_wait() a kernel may only touch inputs no kernel of the step
// writes; ours call it first thing (a GEMV that loaded its first weights before it held more
// registers and ran slower: docs/perf.md §4b), so what overlaps is the launch and scheduling of
// the next kernel's CTAs. Exceptions, all on weights: the optional L2 prefetch (prefetch_bytes) of
// gemv_bf16, gemv_bf16_swiglu and gemv_bf16_rope_qkv, gemv_bf16_streamed's first bulk copies, and
// an unrolled gemv_quant's first loads. Without the attribute (no scope, another architecture) both calls are
// no-ops and the launch is an ordinary one.
#pragma once

#include <utility>

#include "kernels/cuda/cuda_kernels.hpp"

namespace troupe::kernels::cuda {

/// Whether launch() on this thread asks for programmatic dependent launch (pdl_scope).
bool pdl_enabled();

/// Lets the kernel after this one on the stream start (it waits in its own pdl_wait()).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Returns when the kernel before this one on the stream has completed, its writes visible.
__device__ __forceinline__ void pdl_wait() {
#ifdef TROUPE_CUDA_EMU
  ::troupe_emu::pdl_wait();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// kernel<<<grid, block, smem, stream>>>(args...) whatever pdl_enabled() says: for kernels that
/// do not call pdl_wait(), which must not overlap the kernel before them.
template <class... Params, class... Args>
void launch_ordinary(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
#ifdef TROUPE_CUDA_EMU  // the CPU emulation build (tests/cuda_emu)
  ::troupe_emu::launch_kernel(false, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
}

/// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute
/// when pdl_enabled(). Launch errors are left for check_launch().
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
#ifdef TROUPE_CUDA_EMU  // there it may start, up to its pdl_wait(), before the kernel ahead runs
  ::troupe_emu::launch_kernel(pdl_enabled(), kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
#endif
}

}  // namespace troupe::kernels::cuda
