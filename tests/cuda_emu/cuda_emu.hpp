// CPU emulation of the CUDA execution model for the kernel and engine tests (TROUPE_CUDA_EMU builds only).
//
// Force-included (-include) ahead of every kernels/cuda and engine/cuda source and CUDA test
// compiled by the host C++ compiler for troupe_cuda_emu_tests, so the device code runs on this
// machine, which has no GPU: each CTA's threads are cooperative fibers on one OS thread, switched
// only where a CUDA thread would wait for others (__syncthreads, warp shuffles and votes, mbarrier
// waits); static shared variables (TROUPE_SHARED) and dynamic shared memory are each CTA's own;
// global memory is host memory. A grid's CTAs start in a shuffled order, up to four resident at
// once (TROUPE_EMU_RESIDENT_CTAS), one running: at a global atomic or __threadfence another
// resident CTA may continue, half the time, so a CTA that counts itself done before all its
// threads wrote what the last CTA reads is seen doing so; each round of a CTA's fibers goes in a
// shuffled order. A kernel that assumes an order between CTAs or lacks a barrier
// between its threads can fail here as it could on a device.
//
// Streams are queues (runtime_emu.cpp): the emulated device works through them in an order of its
// own, a random amount at each call, so host code that reads a result before it synchronized, or
// a stream that does not wait for another's event, sees the wrong bytes here as it could on a
// device. Graphs record the work captured from a stream, parameters included, and replay it.
// cuBLASLt matmuls run on the CPU (cublaslt_emu.cpp).
//
// Asynchronous copies into shared memory (cp.async, cp.async.bulk) land late: at the wait that
// covers them, or earlier at random (see the PTX stand-ins below), so a read before that wait sees
// the old bytes.
//
// What it checks: the kernels' arithmetic, indexing, barriers and warp-level exchanges against the
// CPU reference, including the fused and split paths; the host code's stream, event and graph
// order. What it cannot: timing, memory ordering between CTAs (memory here is sequentially
// consistent: a missing fence goes unseen), device math's last-ulp behaviour (expf is the host's),
// tensor-core accumulation order (mma is summed in float, in k order). Programmatic dependent
// launch: a programmatic launch right behind a kernel on its stream (launch.cuh's launch() under a
// pdl_scope) half the time starts first, its CTAs that may be resident running up to pdl_wait()
// (and half of those times the programmatic launch behind it too), then the kernel ahead, then the
// rest of each; so a read before pdl_wait() of what a kernel one or two ahead writes sees the old
// bytes. Host threads may call the runtime at once: it serializes them.
// tests/cuda_emu/cuda_emu.test.cpp checks that the emulation sees the mistakes it claims to.
#pragma once

#ifndef TROUPE_CUDA_EMU
#error "cuda_emu.hpp is for the emulation build (TROUPE_CUDA_EMU) only"
#endif

#define __global__
#define __device__
#define __host__
// Static shared variables are declared with TROUPE_SHARED (kernels/cuda/device_util.cuh), which
// gives each CTA its own (cta_static): a plain function static would be one for all the CTAs
// resident at once. A `__shared__` declaration fails to compile here, naming the macro.
#define __shared__ use_TROUPE_SHARED_for_static_shared_memory
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace troupe_emu {

// ---- execution ----------------------------------------------------------------------------------

/// The running fiber's threadIdx, and the running CTA's coordinates.
const uint3& thread_idx();
extern uint3 block_idx;
extern dim3 grid_dim, block_dim;

/// The dynamic shared memory of the running CTA (the launch's smem bytes, 128-byte aligned).
unsigned char* dynamic_smem();

/// Waits for every live thread of the CTA (threads that returned count as arrived).
void syncthreads();
/// Waits for the live lanes of `mask` in the caller's warp.
void syncwarp(unsigned mask);
/// Lets the other fibers run while this one polls for a condition another thread sets; fails
/// the launch (a deadlock) when every fiber of the CTA only polls or waits.
void spin_yield();
/// Aborts the launch (as __trap() would): the next cudaGetLastError reports it.
[[noreturn]] void trap(const char* why);
/// The running CTA's instance of the static shared variable `key` (TROUPE_SHARED), reserved at its
/// first use in the CTA: bytes no thread of the CTA wrote read as 0xFF (NaN), as dynamic ones do.
void* cta_static(const void* key, size_t bytes, size_t align);
/// Whether p is in the running CTA's shared memory (static or dynamic).
bool is_shared(const void* p);
/// Where other CTAs may run in between (a global atomic, a fence): with another CTA resident, half
/// the time the caller's CTA is suspended here and a random resident one continues.
void switch_point();
/// Switches made at switch points so far (for the emulation's own tests).
uint64_t cta_switches();

/// Runs body() once per thread of every CTA of the grid. Errors go to cudaGetLastError.
void run_grid(dim3 grid, dim3 block, size_t smem, std::function<void()> body);
/// Starts a grid launched with programmatic dependent launch before the kernel ahead of it has run:
/// as many CTAs as may be resident run until each thread waits in pdl_wait() or returns, then the
/// grid is parked (false, nothing parked: the launch could not start, or two grids are parked).
bool park_grid(dim3 grid, dim3 block, size_t smem, std::function<void()> body);
/// Releases the oldest parked grid's pdl_wait() and runs it to the end (abandons it after a fault).
void finish_parked_grid();
/// griddepcontrol.wait: in a parked grid, waits until finish_parked_grid(); else returns at once
/// (the kernel ahead has completed: launches otherwise run one after another).
void pdl_wait();

/// Slots (8 bytes a lane) for one exchange among the lanes of mask: each writes its own, calls
/// syncwarp(mask), reads any, then calls exchange_end(mask). A full warp alternates two sets of
/// slots, so it needs no second barrier before the next exchange may write.
uint64_t* exchange_slots(unsigned mask);
void exchange_end(unsigned mask);
int lane();
/// Lanes of the caller's warp that have not returned.
unsigned live_lanes();

/// The runtime's error state: the calling thread's last error (cudaGetLastError) and the error
/// that poisons the context once a kernel fails (every later call reports it, as on a device).
extern thread_local cudaError_t last_error;
extern cudaError_t sticky_error;
/// The scheduler's random numbers (seeded once; TROUPE_EMU_SEED replays a run).
uint64_t random_u64();
/// Whether grid, block and smem make a valid launch; records cudaErrorInvalidConfiguration if not.
bool launch_config_ok(dim3 grid, dim3 block, size_t smem);
/// Refusal injection for the serving tests (runtime_emu.cpp): while the file TROUPE_EMU_REFUSE_FILE
/// names exists, every kernel launch fails at once with cudaErrorLaunchOutOfResources and every
/// cudaMalloc with cudaErrorMemoryAllocation, neither sticky (as while another process holds the
/// device's memory): failures a restart cures once the file is gone.
bool refusing();
/// Puts work on the stream's queue (runtime_emu.cpp): the emulated device runs it in stream order,
/// now or later; a capturing stream adds it to its graph. Returns the error the call reports.
/// `kernel` says the work is a kernel (ours or cuBLASLt's): a programmatic launch after it may start
/// before it runs.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, bool kernel = false);

/// A kernel launch as queued: its configuration and a body that calls the kernel with the
/// parameters the launch converted, kept with it (a graph replays them) and copied into each
/// thread's call as on a device.
struct kernel_launch {
  dim3 grid, block;
  size_t smem = 0;
  bool pdl = false;  // programmatic dependent launch: may start before the kernel ahead runs
  std::function<void()> body;
};
/// Queues the launch (runtime_emu.cpp); a programmatic one right behind a kernel on its stream may
/// start (up to its pdl_wait(), park_grid) before that kernel runs, half the time.
cudaError_t enqueue_kernel(cudaStream_t stream, std::shared_ptr<const kernel_launch> k);

template <class... Params, class... Args>
void launch_kernel(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  if (!launch_config_ok(grid, block, smem)) return;
  if (refusing()) {
    last_error = cudaErrorLaunchOutOfResources;
    return;
  }
  auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
  auto k = std::make_shared<kernel_launch>();
  k->grid = grid, k->block = block, k->smem = smem, k->pdl = pdl;
  k->body = [kernel, params] { std::apply(kernel, *params); };
  const cudaError_t e = enqueue_kernel(stream, std::move(k));
  if (e != cudaSuccess) last_error = e;
}

// ---- warp exchanges -----------------------------------------------------------------------------

/// Every lane of mask publishes v, then reads lane src_of(its lane)'s value.
template <class T, class F>
T exchange(unsigned mask, T v, F src_of) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t* s = exchange_slots(mask);
  const int me = lane();
  std::memcpy(&s[me], &v, sizeof(T));
  syncwarp(mask);
  T r;
  std::memcpy(&r, &s[src_of(me)], sizeof(T));
  exchange_end(mask);
  return r;
}

/// Every lane of mask publishes v; each returns f(value_of, mask), value_of(l) being lane l's
/// value (f visits the lanes of mask only).
template <class T, class F>
auto gather(unsigned mask, T v, F f) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t* s = exchange_slots(mask);
  std::memcpy(&s[lane()], &v, sizeof(T));
  syncwarp(mask);
  auto r = f([s](int l) {
    T x;
    std::memcpy(&x, &s[l], sizeof(T));
    return x;
  });
  exchange_end(mask);
  return r;
}

/// Calls f(l) for each lane l of mask.
template <class F>
void for_lanes(unsigned mask, F f) {
  for (unsigned m = mask; m; m &= m - 1) f(__builtin_ctz(m));
}

// ---- PTX stand-ins (the kernels' asm helpers call these in the emulation build) -----------------

void ldmatrix_x4(uint32_t (&r)[4], const void* smem, bool trans);
void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
// Asynchronous copies land late: a bulk copy (cp.async.bulk) half the time when issued (every copy
// of the CTA in flight then lands), else when a poll of its mbarrier lands it (half the polls) or
// every thread of the CTA is stuck polling; a CTA that ends with one in flight fails. A thread's
// cp.async copies land at its cp.async.wait_group: the groups older than the n newest, or half the
// time all of them. So a read of a copy's destination before its wait sees the old bytes, and a
// copy issued into memory still being read may overwrite it first. The source is read as it lands.
void mbar_init(uint64_t* bar, uint32_t count);
void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes);
void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar);
bool mbar_test_parity(uint64_t* bar, uint32_t parity);
/// cp.async.ca/cg of 4, 8 or 16 bytes into shared memory; commit_group; wait_group n. A thread
/// that returns with copies it did not wait for fails the launch.
void cp_async(void* dst, const void* src, uint32_t bytes);
void cp_async_commit();
void cp_async_wait(int n);

}  // namespace troupe_emu

#define threadIdx (::troupe_emu::thread_idx())
#define blockIdx (::troupe_emu::block_idx)
#define blockDim (::troupe_emu::block_dim)
#define gridDim (::troupe_emu::grid_dim)

// ---- CUDA device intrinsics, by their CUDA names ------------------------------------------------

inline void __syncthreads() { troupe_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { troupe_emu::syncwarp(mask); }
inline void __threadfence() { troupe_emu::switch_point(); }
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { troupe_emu::trap("__trap()"); }
inline void __nanosleep(unsigned) { troupe_emu::spin_yield(); }
inline unsigned __activemask() { return troupe_emu::live_lanes(); }

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return troupe_emu::exchange(mask, v, [&](int l) { return (l / width) * width + (src % width); });
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  return troupe_emu::exchange(mask, v, [&](int l) {
    const int s = l ^ m;
    return s / width == l / width ? s : l;
  });
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return troupe_emu::exchange(mask, v, [&](int l) { return l % width >= int(d) ? l - int(d) : l; });
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return troupe_emu::exchange(mask, v, [&](int l) { return l % width + int(d) < width ? l + int(d) : l; });
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return troupe_emu::gather(mask, pred, [&](auto value_of) {
    unsigned r = 0;
    troupe_emu::for_lanes(mask, [&](int l) { r |= value_of(l) ? 1u << l : 0u; });
    return r;
  });
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == (mask & troupe_emu::live_lanes()); }
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  return troupe_emu::gather(mask, v, [&](auto value_of) {
    unsigned r = 0;
    troupe_emu::for_lanes(mask, [&](int l) {
      const T x = value_of(l);
      r |= std::memcmp(&x, &v, sizeof(T)) == 0 ? 1u << l : 0u;
    });
    return r;
  });
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return troupe_emu::gather(mask, v, [&](auto value_of) {
    unsigned r = 0;
    troupe_emu::for_lanes(mask, [&](int l) { r += value_of(l); });
    return r;
  });
}

// Cache-hinted loads and stores are plain ones here.
template <class T>
T __ldg(const T* p) { return *p; }
template <class T>
T __ldcg(const T* p) { return *p; }
template <class T>
T __ldcs(const T* p) { return *p; }
template <class T>
T __ldca(const T* p) { return *p; }
template <class T>
T __ldlu(const T* p) { return *p; }
template <class T>
void __stcg(T* p, T v) { *p = v; }
template <class T>
void __stcs(T* p, T v) { *p = v; }

// Atomics: a read-modify-write is atomic as written (fibers switch only at waits and switch
// points); one on global memory is then a switch point, so another CTA may see its result before
// the rest of this CTA goes on, as on a device.
namespace troupe_emu {
template <class T, class F>
T atomic_rmw(T* p, F f) {
  const T old = *p;
  *p = f(old);
  if (!is_shared(p)) switch_point();
  return old;
}
}  // namespace troupe_emu
template <class T>
T atomicAdd(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return T(o + v); }); }
template <class T>
T atomicSub(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return T(o - v); }); }
template <class T>
T atomicExch(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T) { return v; }); }
template <class T>
T atomicMax(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return std::max(o, v); }); }
template <class T>
T atomicMin(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return std::min(o, v); }); }
template <class T>
T atomicXor(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return T(o ^ v); }); }
template <class T>
T atomicOr(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return T(o | v); }); }
template <class T>
T atomicAnd(T* p, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return T(o & v); }); }
template <class T>
T atomicCAS(T* p, T cmp, T v) { return troupe_emu::atomic_rmw(p, [&](T o) { return o == cmp ? v : o; }); }
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  return troupe_emu::atomic_rmw(p, [&](unsigned o) { return o >= limit ? 0u : o + 1; });
}

// Rounded arithmetic: the host's IEEE operations (the build disables contraction into FMA).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __saturatef(float a) { return std::clamp(a, 0.0f, 1.0f); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline unsigned long long __float2ull_rn(float f) { return (unsigned long long)std::nearbyint(f); }
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (x >> i & 1u) << (31 - i);
  return r;
}
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }

// The runtime's templates on kernel pointers (cuda_runtime.h declares them for nvcc only).
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*f)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(f), attr, value);
}
template <class... P>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void (*f)(P...), int block, size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, reinterpret_cast<const void*>(f), block, smem);
}

using std::isfinite;
using std::isinf;
using std::isnan;

// Device code's unqualified min/max (CUDA overloads them for mixed integer types).
template <class A, class B>
constexpr std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B>
constexpr std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
