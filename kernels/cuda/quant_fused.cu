// The quantized GEMVs that finish their own outputs: gemv_fused.cuh's SwiGLU and RoPE kernels over
// GGUF blocks (quant_layout.cuh), for every type, batch and unroll gemv_quant takes.
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/gemv_fused.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_layout.cuh"

namespace troupe::kernels::cuda {

namespace {

// Rows of a quant_matrix of type T for the fused kernels: warp w's dots by quant_row_dots (the
// same sums as gemv_quant's), or, with no row, only the wait for the kernel ahead.
template <quant_type T, int B, int Unroll>
struct quant_rows {
  static constexpr int batch = B;
  quant_matrix m;
  int64_t n_in;
  __device__ const uint8_t* row_at(int64_t row) const {
    int p = m.n_parts - 1;
    while (p > 0 && row < m.row0[p]) --p;
    return static_cast<const uint8_t*>(m.raw[p]) + (row - m.row0[p]) * (n_in / layout<T>::block_values) * layout<T>::block_bytes;
  }
  __device__ void cta_dots(int64_t row, const bf16* __restrict__ x, float (&sums)[gemv_warps][B]) const {
    if (row >= 0) {
      float acc[B];
      quant_row_dots<T, B, Unroll>(row_at(row), n_in, x, acc);
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

// The checks gemv_quant makes, for a quant_matrix of n_out rows read by `batch` rows of x.
void check_quant_matrix(const char* name, const quant_matrix& w, int64_t n_out, int64_t n_in, const bf16* x, int batch, int unroll) {
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

// f(quant_rows<T, B, Unroll>{w, n_in}) for w's type, the batch and the unroll.
template <class F>
void with_rows(const quant_matrix& w, int64_t n_in, int batch, int unroll, const char* name, F&& f) {
  with_type(w.qt, [&](auto type) {
    with_batch(batch, [&](auto b) {
      with_unroll(unroll, name, [&](auto u) {
        f(quant_rows<decltype(type)::value, decltype(b)::value, decltype(u)::value>{w, n_in});
      });
    });
  });
}

}  // namespace

void gemv_quant_swiglu(const quant_matrix& w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch,
                       cudaStream_t stream, int unroll) {
  check_quant_matrix("gemv_quant_swiglu", w, 2 * d_ff, n_in, x, batch, unroll);
  if (d_ff <= 0 || n_in <= 0) return;
  if (overlaps(x, batch * n_in * 2, act, batch * d_ff * 2))
    throw cuda_error("gemv_quant_swiglu: act overlaps x (other CTAs still read x while one stores act)");
  with_rows(w, n_in, batch, unroll, "gemv_quant_swiglu", [&](auto rows) {
    constexpr int B = decltype(rows)::batch;
    launch(gemv_swiglu_kernel<decltype(rows), B>, swiglu_ctas(d_ff), gemv_warps * 32, 0, stream, rows, d_ff, x, act);
  });
  check_launch("gemv_quant_swiglu");
}

void gemv_quant_rope_qkv(const quant_matrix& w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                         int unroll) {
  const rope_params& rp = r.rope;
  check_rope_args("gemv_quant_rope_qkv", rp);
  check_quant_matrix("gemv_quant_rope_qkv", w, int64_t(rp.n_heads + 2 * rp.n_kv_heads) * rp.head_dim, n_in, x, r.st.n_tokens,
                     unroll);
  if (n_in <= 0) return;
  with_rows(w, n_in, r.st.n_tokens, unroll, "gemv_quant_rope_qkv", [&](auto rows) {
    constexpr int B = decltype(rows)::batch;
    launch(gemv_rope_kernel<decltype(rows), B>, rope_ctas(rp), gemv_warps * 32, 0, stream, rows, x, r);
  });
  check_launch("gemv_quant_rope_qkv");
}

}  // namespace troupe::kernels::cuda
