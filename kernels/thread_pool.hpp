// A fixed pool of worker threads for the CPU kernels. A parallel region is split into size()
// shares; the calling thread runs share 0 and then every share no worker has claimed yet, so a
// worker that is slow to start (asleep, or preempted on a busy machine) never holds the region
// up: the region just runs on fewer threads. Workers spin briefly between regions (a decode step
// opens a few hundred regions, each too short for a futex wake-up) and then sleep, so an idle
// pool costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace troupe::kernels {

class thread_pool {
 public:
  /// n_threads >= 1 counts the caller; n_threads - 1 workers are started.
  explicit thread_pool(int n_threads);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const { return n_threads_; }

  /// Runs fn(ith, nth) exactly once for each share ith in [0, nth), nth = size(), and returns
  /// when all have finished. Shares run concurrently on different threads, but one thread may run
  /// several shares one after another, so fn must never wait for another share (no barrier inside
  /// a region). Not reentrant: fn must not call run() on the same pool, and only one thread may
  /// call run() at a time. If fn throws, shares not yet started are skipped and the first
  /// exception is rethrown here once the started ones have finished.
  template <class Fn>
  void run(Fn&& fn) {
    run_impl(
        +[](void* ctx, int ith, int nth) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(ith, nth); },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }

  /// Splits [0, n) into contiguous chunks of `grain` (the last may be shorter), one run of
  /// chunks per share: fn(begin, end, ith), ith the share (see run()).
  template <class Fn>
  void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    const int64_t n_chunks = (n + grain - 1) / grain;
    run([&](int ith, int nth) {
      const int64_t c0 = n_chunks * ith / nth, c1 = n_chunks * (ith + 1) / nth;
      const int64_t b = c0 * grain, e = c1 * grain < n ? c1 * grain : n;
      if (b < e) fn(b, e, ith);
    });
  }

 private:
  using task_fn = void (*)(void*, int, int);
  void run_impl(task_fn fn, void* ctx);
  void worker();
  int claim(uint32_t generation);  // a share of that region, or -1 when none is left
  void execute(int ith);

  int n_threads_;
  std::vector<std::thread> workers_;
  task_fn fn_ = nullptr;  // the current region, written by the caller before it is published
  void* ctx_ = nullptr;
  uint32_t generation_ = 0;                     // the caller's count of regions
  alignas(64) std::atomic<uint64_t> state_{0};  // generation << 32 | next unclaimed share
  alignas(64) std::atomic<int> done_{0};        // shares of the current region finished by workers
  std::atomic<bool> failed_{false};             // a share of the current region threw
  std::atomic<bool> stop_{false};
  std::atomic<int> sleeping_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;  // the first exception of the current region (under mu_)
};

}  // namespace troupe::kernels
