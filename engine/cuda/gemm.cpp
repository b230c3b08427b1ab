#include "engine/cuda/gemm.hpp"

#include <algorithm>
#include <string>

namespace troupe::engine::cuda {

namespace {

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw kc::cuda_error(std::string("cuBLASLt ") + what + ": " + cublasLtGetStatusString(s));
}

// Largest power of two (at most 256) dividing the address.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return a == 0 ? 256u : (uint32_t)std::min<uintptr_t>(256, a & (~a + 1));
}

}  // namespace

gemm_runner::gemm_runner() : workspace_(workspace_bytes, "the cuBLASLt workspace") {
  check_lt(cublasLtCreate(&lt_), "cublasLtCreate");
}

gemm_runner::~gemm_runner() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (lt_) cublasLtDestroy(lt_);
}

// Column-major view: Y^T [n_out, m] = W [n_out, n_in] * X^T [n_in, m]. The row-major W is a
// column-major [n_in, n_out] matrix taken transposed (A, op T), the row-major x a column-major
// [n_in, m] matrix (B, op N): the TN layout the tensor-core kernels prefer.
const gemm_runner::plan& gemm_runner::plan_for(const key& k) {
  if (auto it = plans_.find(k); it != plans_.end()) return it->second;
  const auto [m, n_out, n_in, out, align_x, align_w, align_y] = k;

  plan p;
  const cudaDataType_t c_type = out == gemm_out::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  check_lt(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  check_lt(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n_in, n_out, n_in), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, n_in, m, n_in), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&p.c, c_type, n_out, m, n_out), "layout C");

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t ws = workspace_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w, sizeof(align_w));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x, sizeof(align_x));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_y, sizeof(align_y));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_y, sizeof(align_y));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    throw kc::cuda_error("cuBLASLt has no algorithm for a bf16 GEMM of m " + std::to_string(m) + ", n " + std::to_string(n_out) +
                         ", k " + std::to_string(n_in) + (s != CUBLAS_STATUS_SUCCESS ? std::string(": ") + cublasLtGetStatusString(s) : ""));
  }
  p.algo = result.algo;
  return plans_.emplace(k, p).first->second;
}

void gemm_runner::run(const bf16* x, const bf16* w, void* y, gemm_out out, int m, int n_out, int n_in, cudaStream_t stream) {
  if (m <= 0) return;
  const plan& p = plan_for({m, n_out, n_in, out, alignment(x), alignment(w), alignment(y)});
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(lt_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo, workspace_.as<void>(),
                          workspace_bytes, stream),
           "matmul");
}

}  // namespace troupe::engine::cuda
