// Kernels of engine/cuda/cuda_util.hpp.
#include "engine/cuda/cuda_util.hpp"

namespace troupe::engine::cuda {

namespace {

constexpr int threads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + threads - 1) / threads;
  return (int)(b < 65535 * 8 ? b : 65535 * 8);  // grid-stride loops cover the rest
}

// splitmix64 of (seed, i) to a float in [-1, 1).
__device__ float hash_uniform(uint64_t seed, int64_t i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void fill_uniform_bf16_kernel(bf16* p, int64_t n, float amplitude, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(amplitude * hash_uniform(seed, i));
}

__global__ void fill_uniform_f32_kernel(float* p, int64_t n, float amplitude, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = amplitude * hash_uniform(seed, i);
}

__global__ void fill_f32_kernel(float* p, int64_t n, float value) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = value;
}

// One block per output row; 16-byte vectors when d allows (rows of the model are multiples of 8).
__global__ void gather_rows_kernel(const bf16* in, const int32_t* rows, bf16* out, int d) {
  const int r = blockIdx.x;
  const bf16* src = in + (int64_t)rows[r] * d;
  bf16* dst = out + (int64_t)r * d;
  if (d % 8 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* t = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < d / 8; i += blockDim.x) t[i] = s[i];
  } else {
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

void fill_uniform_bf16(bf16* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  fill_uniform_bf16_kernel<<<blocks_for(n), threads, 0, stream>>>(p, n, amplitude, seed);
  kc::check_launch("fill_uniform_bf16");
}

void fill_uniform_f32(float* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  fill_uniform_f32_kernel<<<blocks_for(n), threads, 0, stream>>>(p, n, amplitude, seed);
  kc::check_launch("fill_uniform_f32");
}

void fill_f32(float* p, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return;
  fill_f32_kernel<<<blocks_for(n), threads, 0, stream>>>(p, n, value);
  kc::check_launch("fill_f32");
}

void gather_rows_bf16(const bf16* in, const int32_t* rows, bf16* out, int n_rows, int d, cudaStream_t stream) {
  if (n_rows <= 0) return;
  gather_rows_kernel<<<n_rows, 128, 0, stream>>>(in, rows, out, d);
  kc::check_launch("gather_rows_bf16");
}

}  // namespace troupe::engine::cuda
