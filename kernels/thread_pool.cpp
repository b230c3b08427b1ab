// Spin-then-sleep worker pool. A region is published by bumping generation_ (release) after fn_ and
// ctx_ are set; workers acquire it, run their share and count pending_ down. Sleeping workers are
// woken through cv_ only when sleeping_ says someone sleeps, so back-to-back regions cost a few
// cache-line transfers and no system call.
#include "kernels/thread_pool.hpp"

#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace troupe::kernels {

namespace {

/// How long an idle worker polls for the next region before sleeping. A decode step's regions are
/// a few to a few hundred microseconds apart, so this keeps workers hot through a step while an
/// idle server sleeps after 100 µs.
constexpr auto spin_time = std::chrono::microseconds(100);

/// Polls between clock reads (each poll is one pause: ~10-60 ns depending on the CPU).
constexpr int polls_per_clock_read = 64;

/// Polls of the caller for its workers before it starts yielding its core (a worker may have been
/// preempted when more threads than cores are runnable).
constexpr int polls_before_yield = 1 << 14;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

thread_pool::thread_pool(int n_threads) : n_threads_(n_threads) {
  if (n_threads < 1)
    throw std::invalid_argument("thread_pool: n_threads must be >= 1, got " + std::to_string(n_threads));
  workers_.reserve(static_cast<size_t>(n_threads - 1));
  try {
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker(i); });
  } catch (...) {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

thread_pool::~thread_pool() {
  stop_.store(true);
  generation_.fetch_add(1);  // wakes spinning workers
  {
    std::lock_guard<std::mutex> lock(mu_);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::run_impl(task_fn fn, void* ctx) {
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  error_ = nullptr;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  // seq_cst pairs with the worker's seq_cst sleeping_ increment and generation_ re-check: either the
  // worker sees the new generation, or this thread sees it asleep and wakes it.
  generation_.fetch_add(1);
  if (sleeping_.load() > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
    }
    cv_.notify_all();
  }

  std::exception_ptr own_error;
  try {
    fn(ctx, 0, n_threads_);
  } catch (...) {
    own_error = std::current_exception();
  }
  // The region's closure lives on the caller's stack: never return before every worker is done.
  for (int polls = 0; pending_.load(std::memory_order_acquire) != 0; ++polls) {
    if (polls < polls_before_yield)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  if (own_error) std::rethrow_exception(own_error);
  if (error_) std::rethrow_exception(error_);
}

void thread_pool::worker(int ith) {
  uint64_t seen = 0;  // the generation at construction: a region may be published before we start
  for (;;) {
    // Poll for the next region, then sleep.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    if (gen == seen) {
      const auto deadline = std::chrono::steady_clock::now() + spin_time;
      for (int polls = 1;; ++polls) {
        cpu_relax();
        gen = generation_.load(std::memory_order_acquire);
        if (gen != seen) break;
        if (polls % polls_per_clock_read == 0 && std::chrono::steady_clock::now() >= deadline) break;
      }
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1);
      cv_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
      sleeping_.fetch_sub(1);
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = gen;
    try {
      fn_(ctx_, ith, n_threads_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace troupe::kernels
