// bf16 GEMV whose weights arrive by bulk copies (the TMA engine) into a ring of shared-memory
// stages, for one or two activation rows. gemv_bf16 (quant.cu) loads through registers, one warp
// per row; on an H200 it read Llama-3-8B's matrices at 2.6-3.6 TB/s, below the 4.27 TB/s copy
// rate (docs/perf.md §4b). Here a persistent grid (gemv_stream_config::ctas_per_sm per SM) gives
// each CTA a contiguous run of rows, one contiguous span of memory; thread 0 keeps `stages` copies
// of `chunk_bytes` in flight (cp.async.bulk, completion counted on an mbarrier per stage), so
// the bytes in flight do not cost registers, and all 8 warps sum out of the stage that arrived.
// A warp takes 32 consecutive 16-byte vectors (a "slice", 256 weights of one row: n_in must be a
// multiple of 256) every 256 vectors, keeps a per-lane sum while its slices stay in one row (its
// slices of a row are consecutive, so it meets each row once) and stores the warp's total in the
// row's slot for that warp when the row changes; the CTA adds each row's 8 slots in a fixed order
// at the end, so results repeat bit for bit. The first stages are requested before pdl_wait(): the weights are no kernel's
// output, so under programmatic dependent launch they stream in while the kernel ahead finishes.
#include <atomic>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int stream_threads = 256;
constexpr int slice_vecs = 32;
constexpr int stride_vecs = stream_threads;  // a warp's next slice: 8 warps x 32 vectors on

#ifdef TROUPE_CUDA_EMU  // the CPU emulation build (tests/cuda_emu) runs its stand-ins for the PTX
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) { troupe_emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_init_fence() {}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  troupe_emu::mbar_arrive_expect_tx(bar, bytes);
  troupe_emu::bulk_copy(dst, src, bytes, bar);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!troupe_emu::mbar_test_parity(bar, parity)) troupe_emu::spin_yield();
}
#else
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Thread 0: arrive on `bar` expecting `bytes` from a bulk copy into `dst`, and start that copy.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits for the phase of `bar` with this parity. A copy that never lands (a bug: a stage takes
// microseconds) traps after 2 s by the global timer instead of hanging the device; time, not a
// poll count, so a device slowed by a profiler or a debugger does not trap.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  constexpr uint64_t limit_ns = 2'000'000'000;
  uint32_t done = 0;
  uint64_t start = 0;
  for (uint32_t polls = 0; !done; ++polls) {
    if ((polls & 1023u) == 1023u) {  // the timer read costs more than a poll
      const uint64_t now = globaltimer_ns();
      if (start == 0) start = now;
      else if (now - start > limit_ns) __trap();
    }
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
#endif

constexpr int stream_warps = stream_threads / 32;

size_t stream_smem_bytes(const gemv_stream_config& c, int batch, int64_t max_rows) {
  return size_t(c.stages) * c.chunk_bytes + c.stages * sizeof(uint64_t) + size_t(batch) * max_rows * stream_warps * sizeof(float);
}

template <int B>
__global__ void __launch_bounds__(stream_threads) gemv_stream_kernel(const bf16* __restrict__ w, int64_t n_out, int64_t n_in,
                                                                     const bf16* __restrict__ x, bf16* __restrict__ y,
                                                                     int stages, int chunk) {
  const int chunk_vecs = chunk / 16;
  TROUPE_DYNAMIC_SMEM(unsigned char, smem, 128);
  auto* buf = reinterpret_cast<uint4*>(smem);  // [stages][chunk_vecs]
  auto* full = reinterpret_cast<uint64_t*>(smem + size_t(stages) * chunk);
  auto* part = reinterpret_cast<float*>(full + stages);  // [B][n_rows][stream_warps]

  const int64_t r0 = n_out * blockIdx.x / gridDim.x, r1 = n_out * (blockIdx.x + 1) / gridDim.x;
  const int n_rows = int(r1 - r0);
  const int64_t n_vec = n_in / 8;
  const int64_t bytes = int64_t(n_rows) * n_in * int64_t(sizeof(bf16));
  const int64_t n_chunks = (bytes + chunk - 1) / chunk;
  const char* src = reinterpret_cast<const char*>(w + r0 * n_in);
  auto issue = [&](int64_t c) {
    const int s = int(c % stages);
    const auto size = uint32_t(bytes - c * chunk < chunk ? bytes - c * chunk : chunk);
    bulk_load(buf + s * chunk_vecs, src + c * chunk, size, &full[s]);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
  }
  __syncthreads();
  pdl_launch_dependents();
  if (threadIdx.x == 0)
    for (int64_t c = 0; c < n_chunks && c < stages; ++c) issue(c);
  for (int i = threadIdx.x; i < B * n_rows * stream_warps; i += stream_threads) part[i] = 0.0f;
  pdl_wait();  // x is the kernel ahead's output
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int64_t vec = int64_t(warp) * slice_vecs;  // the warp's current slice, from the CTA's first vector
  int64_t row = vec / n_vec, col = vec - row * n_vec;
  bool dirty = false;
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.0f;
  auto flush = [&] {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float s = warp_sum(acc[b]);
      if (lane == 0) part[(b * n_rows + row) * stream_warps + warp] = s;
      acc[b] = 0.0f;
    }
    dirty = false;
  };

  for (int64_t c = 0; c < n_chunks; ++c) {
    const int s = int(c % stages);
    mbar_wait(&full[s], uint32_t((c / stages) & 1));
    const int64_t first = c * chunk_vecs;
    const int64_t end = first + (bytes - c * chunk < chunk ? (bytes - c * chunk) / 16 : chunk_vecs);
    for (; vec < end; vec += stride_vecs) {
      const uint4 wr = buf[s * chunk_vecs + (vec - first) + lane];
      float wf[8];
      bf16x8_to_float(wr, wf);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        float xf[8];
        bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(x + b * n_in) + col + lane), xf);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[b] = fmaf(wf[k], xf[k], acc[b]);
      }
      dirty = true;
      col += stride_vecs;
      if (col >= n_vec) {  // the next slice is in a later row
        flush();
        while (col >= n_vec) col -= n_vec, ++row;
      }
    }
    __syncthreads();  // every warp is done with stage s
    if (threadIdx.x == 0 && c + stages < n_chunks) issue(c + stages);
  }
  if (dirty) flush();
  __syncthreads();
  for (int i = threadIdx.x; i < B * n_rows; i += stream_threads) {
    const int b = i / n_rows, r = i - b * n_rows;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < stream_warps; ++k) sum += part[i * stream_warps + k];
    y[b * n_out + r0 + r] = __float2bfloat16_rn(sum);
  }
}

// Multiprocessors of device `dev`, asked once (the first decode step runs eagerly, before any
// graph capture) and kept.
int multiprocessors(int dev) {
  static std::atomic<int> cache[64];
  std::atomic<int>& c = cache[dev >= 0 && dev < 64 ? dev : 0];
  int sms = c.load(std::memory_order_relaxed);
  if (sms <= 0) {
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "gemv_bf16_streamed: cudaDeviceGetAttribute");
    c.store(sms = sms > 0 ? sms : 1, std::memory_order_relaxed);
  }
  return sms;
}

template <int B>
void launch_stream(const bf16* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, cudaStream_t stream,
                   const gemv_stream_config& cfg) {
  int dev = 0;
  check(cudaGetDevice(&dev), "gemv_bf16_streamed: cudaGetDevice");
  const int sms = multiprocessors(dev);
  const int64_t grid = int64_t(sms) * cfg.ctas_per_sm;
  const int64_t ctas = n_out < grid ? n_out : grid;
  const int64_t max_rows = (n_out + ctas - 1) / ctas;
  const size_t smem = stream_smem_bytes(cfg, B, max_rows);
  if (smem > size_t{227} << 10)
    throw cuda_error("gemv_bf16_streamed: " + std::to_string(smem) + " bytes of shared memory a CTA (stages x chunk + " +
                     std::to_string(max_rows) + " rows' sums) exceed 227 KiB");
  // The kernel's dynamic shared-memory limit, raised to the largest size asked (per device; one
  // such static per instantiation, i.e. per kernel).
  static std::atomic<size_t> raised[64];
  std::atomic<size_t>& r = raised[dev >= 0 && dev < 64 ? dev : 0];
  if (r.load(std::memory_order_relaxed) < smem) {
    check(cudaFuncSetAttribute(gemv_stream_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "gemv_bf16_streamed: cudaFuncSetAttribute");
    r.store(smem, std::memory_order_relaxed);
  }
  launch(gemv_stream_kernel<B>, unsigned(ctas), stream_threads, smem, stream, w, n_out, n_in, x, y, cfg.stages,
         cfg.chunk_bytes);
}

}  // namespace

void gemv_bf16_streamed(const bf16* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch, cudaStream_t stream,
                        const gemv_stream_config& cfg) {
  if (batch < 1 || batch > 2) throw cuda_error("gemv_bf16_streamed: batch must be 1 or 2");
  if (cfg.ctas_per_sm < 1 || cfg.ctas_per_sm > 8 || cfg.stages < 2 || cfg.stages > 16 || cfg.chunk_bytes < 512 ||
      cfg.chunk_bytes > (64 << 10) || cfg.chunk_bytes % 512 != 0)
    throw cuda_error("gemv_bf16_streamed: ctas_per_sm in [1, 8], stages in [2, 16], chunk_bytes a multiple of 512 up to 64 KiB");
  if (n_in % 256 != 0) throw cuda_error("gemv_bf16_streamed: n_in must be a multiple of 256");
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
    throw cuda_error("gemv_bf16_streamed: w and x must be 16-byte aligned");
  if (n_out <= 0) return;
  if (batch == 1)
    launch_stream<1>(w, n_out, n_in, x, y, stream, cfg);
  else
    launch_stream<2>(w, n_out, n_in, x, y, stream, cfg);
  check_launch("gemv_bf16_streamed");
}

}  // namespace troupe::kernels::cuda
