// The emulation's own tests: what it claims to catch, it catches. Each check runs a correct toy
// kernel and the same kernel with one mistake the emulation is meant to expose; the correct one
// must pass every launch, the mistaken one must fail at least one (so a change to the emulation that
// stops seeing the mistake fails here, not silently in the kernel tests).
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/test_util.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int toy_ctas = 8, toy_threads = 64;

// Each CTA keeps its index in a static shared variable across a global atomic (where another
// resident CTA may run) and writes it out from every thread.
__global__ void own_shared_kernel(int* out, unsigned* counter) {
  TROUPE_SHARED(int, mine);
  if (threadIdx.x == 0) mine = int(blockIdx.x);
  __syncthreads();
  atomicAdd(counter, 1u);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = mine;
}

// The same with a function static: one variable for every CTA resident at once, as a
// `#define __shared__ static` emulation would have it.
__global__ void one_static_kernel(int* out, unsigned* counter) {
  static int mine;
  if (threadIdx.x == 0) mine = int(blockIdx.x);
  __syncthreads();
  atomicAdd(counter, 1u);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = mine;
}

// Every thread writes its partial; the CTA counts itself done; the last CTA to arrive sums all the
// partials. With `barrier` false thread 0 counts the CTA in before its other threads have written,
// the mistake the split attention's last-CTA merge must not make.
template <bool barrier>
__global__ void last_cta_sum_kernel(const int* in, int* partials, unsigned* count, long long* total) {
  TROUPE_SHARED(bool, last);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  partials[i] = 2 * in[i];
  __threadfence();
  if constexpr (barrier) __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(count, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    long long s = 0;
    for (int k = 0; k < int(gridDim.x * blockDim.x); ++k) s += partials[k];
    *total = s;
    *count = 0;
  }
}

// A kernel that fills buf with v, and a programmatic launch behind it that copies buf to out:
// reading it after its pdl_wait(), or with `early`, before (the read the launch contract forbids).
__global__ void fill_kernel(int* buf, int v) {
  pdl_launch_dependents();
  pdl_wait();
  buf[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

template <bool early>
__global__ void copy_after_wait_kernel(const int* buf, int* out) {
  pdl_launch_dependents();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  int x = 0;
  if constexpr (early) x = buf[i];
  pdl_wait();
  if constexpr (!early) x = buf[i];
  out[i] = x;
}

// A programmatic launch that reads after its wait: between fill_kernel and a copy, so the copy's
// early read is of the output of the kernel two ahead.
__global__ void between_kernel(const int* buf, int* other) {
  pdl_launch_dependents();
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  other[i] = buf[i] + 1;
}

// Tiles of in (copy_threads 16-byte chunks each) pass through two shared-memory stages by
// cp.async, tile t + 1 copied while tile t is read, each thread reading its neighbour's chunk after
// a barrier. Mistakes (M): 1 reads without waiting for its copies; 2 waits only after the barrier,
// so a neighbour's copy may not have landed; 3 leaves one group pending at the last tile (and
// returns with it).
constexpr int copy_threads = 64, copy_tiles = 6;

template <int M>
__global__ void cp_async_tiles_kernel(const uint4* in, uint4* out) {
  struct stages {
    uint4 buf[2][copy_threads];
  };
  TROUPE_SHARED(stages, sm);
  const int me = int(threadIdx.x), next = (me + 1) % copy_threads;
  auto issue = [&](int t) {
    troupe_emu::cp_async(&sm.buf[t & 1][me], &in[t * copy_threads + me], 16);
    troupe_emu::cp_async_commit();
  };
  issue(0);
  for (int t = 0; t < copy_tiles; ++t) {
    const bool more = t + 1 < copy_tiles;
    if (more) issue(t + 1);
    if (M == 0 || M == 3) troupe_emu::cp_async_wait(more || M == 3 ? 1 : 0);
    __syncthreads();
    if (M == 2) troupe_emu::cp_async_wait(more ? 1 : 0);
    out[t * copy_threads + next] = sm.buf[t & 1][next];
    __syncthreads();  // every thread read stage t & 1 before tile t + 2 is copied into it
  }
  if (M == 1) troupe_emu::cp_async_wait(0);  // (waited, but only after every read)
}

// Chunks of in (copy_threads 16-byte vectors each) arrive by bulk copies, counted on an mbarrier
// per stage, into a ring of two stages that thread 0 refills once every thread has read a stage.
// Mistakes (M): 1 reads a stage without waiting on its mbarrier; 2 copies one chunk more than it
// reads, still in flight when the CTA ends.
template <int M>
__global__ void bulk_tiles_kernel(const uint4* in, uint4* out) {
  struct stages {
    uint4 buf[2][copy_threads];
    uint64_t full[2];
  };
  TROUPE_SHARED(stages, sm);
  constexpr uint32_t chunk = copy_threads * sizeof(uint4);
  auto issue = [&](int c) {
    troupe_emu::mbar_arrive_expect_tx(&sm.full[c & 1], chunk);
    troupe_emu::bulk_copy(sm.buf[c & 1], in + (c % copy_tiles) * copy_threads, chunk, &sm.full[c & 1]);
  };
  const int me = int(threadIdx.x);
  if (me == 0) {
    troupe_emu::mbar_init(&sm.full[0], 1);
    troupe_emu::mbar_init(&sm.full[1], 1);
    issue(0);
    issue(1);
  }
  __syncthreads();
  for (int c = 0; c < copy_tiles; ++c) {
    if (M != 1)
      while (!troupe_emu::mbar_test_parity(&sm.full[c & 1], uint32_t((c / 2) & 1))) troupe_emu::spin_yield();
    out[c * copy_threads + (me + 1) % copy_threads] = sm.buf[c & 1][(me + 1) % copy_threads];
    __syncthreads();
    if (me == 0 && c + 2 < copy_tiles + (M == 2 ? 1 : 0)) issue(c + 2);
  }
}

// A failed launch poisons the emulated context, as a fault does a device's; the runs below clear
// it after each launch (a device would need a reset).
bool launch_failed() {
  const bool failed = cudaDeviceSynchronize() != cudaSuccess;
  troupe_emu::sticky_error = cudaSuccess;
  (void)cudaGetLastError();
  return failed;
}

// Launches `runs` times; the number of launches that ran and whose result was right.
template <class Launch, class Right>
int right_runs(int runs, Launch launch_once, Right right) {
  int n = 0;
  for (int r = 0; r < runs; ++r) {
    launch_once();
    if (!launch_failed() && right()) ++n;
  }
  return n;
}

// Launches `runs` times; the number of launches that failed.
template <class Launch>
int failed_runs(int runs, Launch launch_once) {
  int n = 0;
  for (int r = 0; r < runs; ++r) {
    launch_once();
    n += launch_failed();
  }
  return n;
}

}  // namespace

TEST_CASE("the emulation gives each resident CTA its own static shared memory", "[cuda][emu]") {
  test::dev_buf<int> out(size_t(toy_ctas) * toy_threads);
  test::dev_buf<unsigned> counter(std::vector<unsigned>{0});
  std::vector<int> want(out.n);
  for (size_t i = 0; i < want.size(); ++i) want[i] = int(i / toy_threads);
  const uint64_t switches = troupe_emu::cta_switches();
  const int runs = 20;
  const int own = right_runs(runs, [&] { launch_ordinary(own_shared_kernel, dim3(toy_ctas), dim3(toy_threads), 0, nullptr, out.p, counter.p); },
                             [&] { return out.download() == want; });
  CHECK(own == runs);
  CHECK(troupe_emu::cta_switches() > switches);  // CTAs did run interleaved
  const int shared = right_runs(runs, [&] { launch_ordinary(one_static_kernel, dim3(toy_ctas), dim3(toy_threads), 0, nullptr, out.p, counter.p); },
                                [&] { return out.download() == want; });
  CHECK(shared < runs);
  check(cudaGetLastError(), "launch");
}

TEST_CASE("the emulation catches a CTA counted done before all its threads wrote", "[cuda][emu]") {
  const size_t n = size_t(toy_ctas) * toy_threads;
  std::vector<int> host(n);
  long long want = 0;
  for (size_t i = 0; i < n; ++i) host[i] = int(i % 97) - 40, want += 2 * host[i];
  test::dev_buf<int> in(host), partials(n);
  test::dev_buf<unsigned> count(std::vector<unsigned>{0});
  test::dev_buf<long long> total(1);
  auto run = [&](auto kernel, int runs) {
    return right_runs(
        runs,
        [&] {
          partials.upload(std::vector<int>(n, -1000000));  // stale values from an earlier step
          launch_ordinary(kernel, dim3(toy_ctas), dim3(toy_threads), 0, nullptr, in.p, partials.p, count.p, total.p);
        },
        [&] { return total.download()[0] == want; });
  };
  // The mistaken kernel is wrong in most launches (a launch switches CTAs at each global atomic and
  // fence half the time): 40 right in a row would be a broken emulation, not luck.
  CHECK(run(last_cta_sum_kernel<true>, 40) == 40);
  CHECK(run(last_cta_sum_kernel<false>, 40) < 40);
  check(cudaGetLastError(), "launch");
}

TEST_CASE("the emulation starts a programmatic launch before the kernel ahead of it", "[cuda][emu]") {
  const size_t n = size_t(toy_ctas) * toy_threads;
  test::dev_buf<int> buf(n), out(n), other(n);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const pdl_scope pdl(true);
  // Fills buf, optionally passes it through between_kernel (a programmatic launch that waits),
  // then copies it with copy_kernel; right when the copy (and the pass) saw the fill.
  auto run = [&](auto copy_kernel, bool between, int runs) {
    int v = 0;
    return right_runs(
        runs,
        [&] {
          ++v;
          launch(fill_kernel, dim3(toy_ctas), dim3(toy_threads), 0, stream, buf.p, v);
          if (between) launch(between_kernel, dim3(toy_ctas), dim3(toy_threads), 0, stream, buf.p, other.p);
          launch(copy_kernel, dim3(toy_ctas), dim3(toy_threads), 0, stream, buf.p, out.p);
          check(cudaStreamSynchronize(stream), "sync");
        },
        [&] { return out.download() == std::vector<int>(n, v) && (!between || other.download() == std::vector<int>(n, v + 1)); });
  };
  // The pair starts early in about one launch of four (the fill has not run already at its
  // enqueue, and the coin says so): 80 right in a row for the early read would be a broken
  // emulation (0.75^80 = 1e-10).
  CHECK(run(copy_after_wait_kernel<false>, false, 80) == 80);
  CHECK(run(copy_after_wait_kernel<true>, false, 80) < 80);
  // Two ahead: fill, a programmatic launch, then the copy. The copy's early read is seen when
  // both start before the fill, in about one run of sixteen (0.9375^300 = 4e-9).
  CHECK(run(copy_after_wait_kernel<false>, true, 300) == 300);
  CHECK(run(copy_after_wait_kernel<true>, true, 300) < 300);
  check(cudaStreamDestroy(stream), "stream");
  check(cudaGetLastError(), "launch");
}

TEST_CASE("the emulation lands async copies late: a read before the wait sees the old bytes", "[cuda][emu]") {
  const size_t n = size_t(copy_tiles) * copy_threads;
  std::vector<uint4> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = uint4{unsigned(i), unsigned(3 * i + 1), unsigned(i ^ 0x5a5a), 7u};
  test::dev_buf<uint4> in(host), out(n);
  const auto launch_once = [&](auto kernel) {
    return [&, kernel] {
      out.upload(std::vector<uint4>(n, uint4{0, 0, 0, 0}));
      launch_ordinary(kernel, dim3(2), dim3(copy_threads), 0, nullptr, in.p, out.p);
    };
  };
  const auto right = [&] {
    const std::vector<uint4> got = out.download();
    for (size_t i = 0; i < n; ++i)
      if (got[i].x != host[i].x || got[i].y != host[i].y || got[i].z != host[i].z || got[i].w != host[i].w) return false;
    return true;
  };
  const int runs = 20;
  // cp.async: a thread's copies land at its wait_group, so these are wrong in most runs; the last
  // returns with a copy pending in some thread of nearly every launch (all 128 land early: 2^-128).
  CHECK(right_runs(runs, launch_once(cp_async_tiles_kernel<0>), right) == runs);
  CHECK(right_runs(runs, launch_once(cp_async_tiles_kernel<1>), right) < runs);
  CHECK(right_runs(runs, launch_once(cp_async_tiles_kernel<2>), right) < runs);
  CHECK(failed_runs(runs, launch_once(cp_async_tiles_kernel<3>)) == runs);
  // Bulk copies: without the mbarrier wait, stale stages or a failed launch (thread 0 arrives again
  // on a stage whose copy has not landed; a copy in flight when the CTA ends).
  CHECK(right_runs(runs, launch_once(bulk_tiles_kernel<0>), right) == runs);
  CHECK(right_runs(2 * runs, launch_once(bulk_tiles_kernel<1>), right) < 2 * runs);
  // The extra copy lands at its issue half the time in each of the two CTAs: about 3 runs of 4 fail.
  CHECK(failed_runs(runs, launch_once(bulk_tiles_kernel<2>)) > 0);
  check(cudaGetLastError(), "launch");
}

}  // namespace troupe::kernels::cuda
