// A fixed pool of worker threads for the CPU kernels. One parallel region at a time; the calling
// thread takes part as thread 0. Workers spin briefly between regions (a decode step opens a few
// hundred regions, each too short for a futex wake-up) and then sleep, so an idle pool costs no CPU.
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

  /// Runs fn(ith, nth) once on each of the nth = size() threads and returns when all are done.
  /// Not reentrant: fn must not call run() on the same pool, and only one thread may call run()
  /// at a time. An exception thrown by fn on any thread is rethrown here once all threads are done
  /// (the first one, when several throw).
  template <class Fn>
  void run(Fn&& fn) {
    run_impl(+[](void* ctx, int ith, int nth) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(ith, nth); },
             const_cast<void*>(static_cast<const void*>(&fn)));
  }

  /// Splits [0, n) into contiguous chunks of `grain` (the last may be shorter) handed out
  /// statically: fn(begin, end, ith).
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
  void worker(int ith);

  int n_threads_;
  std::vector<std::thread> workers_;
  task_fn fn_ = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleeping_{0};
  std::exception_ptr error_;  // first exception of a worker in the current region (under mu_)
};

}  // namespace troupe::kernels
