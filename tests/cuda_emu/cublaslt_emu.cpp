// cuBLASLt in the CUDA emulation (cuda_emu.hpp), as far as engine/cuda/gemm.cpp calls it: matmuls
// D = alpha op(A) op(B) + beta C over column-major bf16, fp16 or fp32 matrices, computed on the
// CPU in float when the emulated device reaches them on their stream (so a graph captures and
// replays them like any kernel). Descriptor attributes other than the transposes are refused
// (CUBLAS_STATUS_NOT_SUPPORTED), so a new use shows up here instead of being ignored. The sums run
// in another order than any cuBLAS kernel: results agree with a device to float rounding only.
#include <cublasLt.h>

#include <cstring>
#include <vector>

namespace {

struct layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
struct desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t trans_a, trans_b;  // cublasOperation_t
};
static_assert(sizeof(layout) <= sizeof(cublasLtMatrixLayoutOpaque_t));
static_assert(sizeof(desc) <= sizeof(cublasLtMatmulDescOpaque_t));

layout& as_layout(cublasLtMatrixLayout_t l) { return *reinterpret_cast<layout*>(l->data); }
desc& as_desc(cublasLtMatmulDesc_t d) { return *reinterpret_cast<desc*>(d->data); }

bool supported(cudaDataType_t t) { return t == CUDA_R_16BF || t == CUDA_R_16F || t == CUDA_R_32F; }

float load(const void* p, cudaDataType_t t, size_t i) {
  switch (t) {
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

void store(void* p, cudaDataType_t t, size_t i, float v) {
  switch (t) {
    case CUDA_R_16BF: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v); break;
    case CUDA_R_16F: static_cast<__half*>(p)[i] = __float2half(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

float dot(const float* a, const float* b, uint64_t k) {
  float s = 0.0f;
  for (uint64_t p = 0; p < k; ++p) s += a[p] * b[p];  // vectorized: this file allows reassociation
  return s;
}

// op(A) (m x k) and op(B) (k x n) as rows of k floats, then one dot product per element of D, in
// tiles of A's rows so a large matrix is never held in float at once.
void matmul(const desc& d, float alpha, const void* A, layout la, const void* B, layout lb, float beta, const void* C,
            layout lc, void* D, layout ld) {
  const uint64_t m = ld.rows, n = ld.cols;
  const uint64_t k = d.trans_a == CUBLAS_OP_N ? la.cols : la.rows;
  std::vector<float> bf(n * k);
  for (uint64_t j = 0; j < n; ++j)
    for (uint64_t p = 0; p < k; ++p)
      bf[j * k + p] = load(B, lb.type, d.trans_b == CUBLAS_OP_N ? p + j * (uint64_t)lb.ld : j + p * (uint64_t)lb.ld);
  constexpr uint64_t tile = 256;
  std::vector<float> af(tile * k);
  for (uint64_t i0 = 0; i0 < m; i0 += tile) {
    const uint64_t rows = std::min(tile, m - i0);
    for (uint64_t i = 0; i < rows; ++i)
      for (uint64_t p = 0; p < k; ++p)
        af[i * k + p] = load(A, la.type, d.trans_a == CUBLAS_OP_N ? (i0 + i) + p * (uint64_t)la.ld : p + (i0 + i) * (uint64_t)la.ld);
    for (uint64_t j = 0; j < n; ++j)
      for (uint64_t i = 0; i < rows; ++i) {
        float v = alpha * dot(&af[i * k], &bf[j * k], k);
        if (beta != 0.0f) v += beta * load(C, lc.type, (i0 + i) + j * (uint64_t)lc.ld);
        store(D, ld.type, (i0 + i) + j * (uint64_t)ld.ld, v);
      }
  }
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  static int handle;
  *h = reinterpret_cast<cublasLtHandle_t>(&handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return CUBLAS_STATUS_SUCCESS; }

const char* cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported (by the emulation: tests/cuda_emu/cublaslt_emu.cpp)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "cuBLAS error (emulated)";
  }
}
const char* cublasLtGetStatusName(cublasStatus_t s) { return cublasLtGetStatusString(s); }

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld) {
  if (!supported(type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (ld < (int64_t)std::max<uint64_t>(rows, 1)) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque_t{};
  as_layout(*l) = layout{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new cublasLtMatmulDescOpaque_t{};
  as_desc(*d) = desc{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t bytes) {
  if ((attr != CUBLASLT_MATMUL_DESC_TRANSA && attr != CUBLASLT_MATMUL_DESC_TRANSB) || bytes != sizeof(int32_t))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  int32_t op;
  std::memcpy(&op, buf, sizeof op);
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  (attr == CUBLASLT_MATMUL_DESC_TRANSA ? as_desc(d).trans_a : as_desc(d).trans_b) = op;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void*,
                                                    size_t) {
  return CUBLAS_STATUS_SUCCESS;  // workspace and alignment limits: the CPU needs neither
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t, int requested, cublasLtMatmulHeuristicResult_t results[],
                                              int* found) {
  *found = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  const layout& la = as_layout(a);
  const layout& lb = as_layout(b);
  const layout& lc = as_layout(c);
  const layout& ld = as_layout(dd);
  const uint64_t k_a = as_desc(d).trans_a == CUBLAS_OP_N ? la.cols : la.rows;
  const uint64_t m_a = as_desc(d).trans_a == CUBLAS_OP_N ? la.rows : la.cols;
  const uint64_t k_b = as_desc(d).trans_b == CUBLAS_OP_N ? lb.rows : lb.cols;
  const uint64_t n_b = as_desc(d).trans_b == CUBLAS_OP_N ? lb.cols : lb.rows;
  if (k_a != k_b || m_a != ld.rows || n_b != ld.cols || lc.rows != ld.rows || lc.cols != ld.cols) return CUBLAS_STATUS_INVALID_VALUE;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void* alpha, const void* A, cublasLtMatrixLayout_t a,
                              const void* B, cublasLtMatrixLayout_t b, const void* beta, const void* C, cublasLtMatrixLayout_t c,
                              void* D, cublasLtMatrixLayout_t dd, const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t stream) {
  const desc op = as_desc(d);
  const layout la = as_layout(a), lb = as_layout(b), lc = as_layout(c), ld = as_layout(dd);
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);  // host pointer mode
  const cudaError_t e = troupe_emu::enqueue(stream, [=] { matmul(op, al, A, la, B, lb, be, C, lc, D, ld); }, /*kernel=*/true);
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // extern "C"
