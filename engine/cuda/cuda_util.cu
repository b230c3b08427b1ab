// Kernels of engine/cuda/cuda_util.hpp.
#include "engine/cuda/cuda_util.hpp"
#include "kernels/cuda/launch.cuh"

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

// Four 16-byte loads in flight a thread per trip, then the tail one vector at a time.
__global__ void read_checksum_kernel(const uint4* p, int64_t n_vec, uint32_t* out) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0 && acc != 0) atomicXor(out, acc);
}

}  // namespace

void read_checksum(const void* p, size_t bytes, uint32_t* out, int ctas, cudaStream_t stream) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(p) % 16 != 0 || ctas < 1)
    throw kc::cuda_error("read_checksum: bytes a multiple of 16 from a 16-byte aligned address, ctas >= 1");
  if (bytes == 0) return;
  kc::launch_ordinary(read_checksum_kernel, ctas, threads, 0, stream, static_cast<const uint4*>(p), int64_t(bytes / 16), out);
  kc::check_launch("read_checksum");
}

void fill_uniform_bf16(bf16* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  kc::launch_ordinary(fill_uniform_bf16_kernel, blocks_for(n), threads, 0, stream, p, n, amplitude, seed);
  kc::check_launch("fill_uniform_bf16");
}

void fill_uniform_f32(float* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  kc::launch_ordinary(fill_uniform_f32_kernel, blocks_for(n), threads, 0, stream, p, n, amplitude, seed);
  kc::check_launch("fill_uniform_f32");
}

void fill_f32(float* p, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return;
  kc::launch_ordinary(fill_f32_kernel, blocks_for(n), threads, 0, stream, p, n, value);
  kc::check_launch("fill_f32");
}

void gather_rows_bf16(const bf16* in, const int32_t* rows, bf16* out, int n_rows, int d, cudaStream_t stream) {
  if (n_rows <= 0) return;
  kc::launch_ordinary(gather_rows_kernel, n_rows, 128, 0, stream, in, rows, out, d);
  kc::check_launch("gather_rows_bf16");
}

}  // namespace troupe::engine::cuda
