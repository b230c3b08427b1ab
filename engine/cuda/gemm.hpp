// bf16 GEMMs through cuBLASLt for the linear layers: y[m, n_out] = x[m, n_in] * W^T, W row-major
// [n_out, n_in] (the GGUF / PyTorch Linear layout), x and y row-major. bf16 inputs, fp32
// accumulation on tensor cores (CUBLAS_COMPUTE_32F), bf16 or fp32 output. One 32 MiB workspace
// is allocated at construction; the heuristic's algorithm is chosen on the first call of each
// (m, n_out, n_in, output type, pointer alignments) and reused, so later calls allocate nothing
// and can be captured into a CUDA graph. The pointers' actual alignments (up to 256 bytes) are
// told to the heuristic, so an offset pointer never gets an algorithm that needs more.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "engine/cuda/cuda_util.hpp"

namespace troupe::engine::cuda {

enum class gemm_out { bf16, f32 };

class gemm_runner {
 public:
  static constexpr size_t workspace_bytes = 32u << 20;

  /// On the current device. Throws cuda_error when cuBLASLt cannot start or memory is short.
  gemm_runner();
  ~gemm_runner();
  gemm_runner(const gemm_runner&) = delete;
  gemm_runner& operator=(const gemm_runner&) = delete;

  /// Enqueues y = x * W^T on `stream`. y is bf16 or float per `out`. Pointers 16-byte aligned and
  /// n_in, n_out multiples of 8 give the tensor-core kernels. Throws cuda_error when cuBLASLt finds
  /// no algorithm or the launch fails.
  void run(const bf16* x, const bf16* w, void* y, gemm_out out, int m, int n_out, int n_in, cudaStream_t stream);

 private:
  struct plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using key = std::tuple<int, int, int, gemm_out, uint32_t, uint32_t, uint32_t>;
  const plan& plan_for(const key& k);

  cublasLtHandle_t lt_ = nullptr;
  device_buffer workspace_;
  std::map<key, plan> plans_;
};

}  // namespace troupe::engine::cuda
