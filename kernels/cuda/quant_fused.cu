// The quantized GEMVs that finish their own outputs: gemv_fused.cuh's SwiGLU and RoPE kernels over
// GGUF blocks (quant_layout.cuh's quant_rows), for every type, batch and unroll gemv_quant takes,
// with or without a norm reader. (gemv_quant's norm writer is in quant.cu.)
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/gemv_fused.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_layout.cuh"

namespace troupe::kernels::cuda {

void gemv_quant_swiglu(const quant_matrix& w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch,
                       cudaStream_t stream, int unroll, const gemv_norm& norm) {
  check_quant_matrix("gemv_quant_swiglu", w, 2 * d_ff, n_in, x, batch, unroll);
  check_norm_reader("gemv_quant_swiglu", norm);
  if (d_ff <= 0 || n_in <= 0) return;
  if (overlaps(x, batch * n_in * 2, act, batch * d_ff * 2))
    throw cuda_error("gemv_quant_swiglu: act overlaps x (other CTAs still read x while one stores act)");
  with_rows(w, n_in, batch, unroll, norm, "gemv_quant_swiglu", [&](auto rows) {
    constexpr int B = decltype(rows)::batch;
    launch(gemv_swiglu_kernel<decltype(rows), B>, swiglu_ctas(d_ff), gemv_warps * 32, 0, stream, rows, d_ff, x, act);
  });
  check_launch("gemv_quant_swiglu");
}

void gemv_quant_rope_qkv(const quant_matrix& w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                         int unroll, const gemv_norm& norm) {
  const rope_params& rp = r.rope;
  check_rope_args("gemv_quant_rope_qkv", rp);
  check_quant_matrix("gemv_quant_rope_qkv", w, int64_t(rp.n_heads + 2 * rp.n_kv_heads) * rp.head_dim, n_in, x, r.st.n_tokens,
                     unroll);
  check_norm_reader("gemv_quant_rope_qkv", norm);
  if (n_in <= 0) return;
  with_rows(w, n_in, r.st.n_tokens, unroll, norm, "gemv_quant_rope_qkv", [&](auto rows) {
    constexpr int B = decltype(rows)::batch;
    launch(gemv_rope_kernel<decltype(rows), B>, rope_ctas(rp), gemv_warps * 32, 0, stream, rows, x, r);
  });
  check_launch("gemv_quant_rope_qkv");
}

}  // namespace troupe::kernels::cuda
