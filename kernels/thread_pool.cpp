// Share-claiming worker pool. A region is published by storing (generation, 1) into state_ after
// fn_ and ctx_ are set (share 0 belongs to the caller); every thread then claims shares by
// incrementing the low half of state_ while it still names that generation. The caller counts the
// shares it ran itself and waits only for the ones workers claimed, which cannot be reused before
// they finish, so fn_ and ctx_ stay valid for every claimed share. Sleeping workers are woken
// through cv_ only when sleeping_ says someone sleeps, so back-to-back regions cost a few
// cache-line transfers and no system call.
#include "kernels/thread_pool.hpp"

#include <chrono>
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

/// Polls of the caller for claimed shares before it starts yielding its core (the worker running
/// one may have been preempted when more threads than cores are runnable).
constexpr int polls_before_yield = 1 << 14;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline uint32_t generation_of(uint64_t state) { return static_cast<uint32_t>(state >> 32); }

}  // namespace

thread_pool::thread_pool(int n_threads) : n_threads_(n_threads) {
  if (n_threads < 1)
    throw std::invalid_argument("thread_pool: n_threads must be >= 1, got " + std::to_string(n_threads));
  workers_.reserve(static_cast<size_t>(n_threads - 1));
  try {
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { worker(); });
  } catch (...) {
    stop_.store(true);
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

thread_pool::~thread_pool() {
  stop_.store(true);
  // A new generation with no share left wakes spinning workers without giving them work.
  state_.store((static_cast<uint64_t>(generation_ + 1) << 32) | static_cast<uint32_t>(n_threads_));
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int thread_pool::claim(uint32_t generation) {
  uint64_t s = state_.load(std::memory_order_acquire);
  for (;;) {
    const auto next = static_cast<uint32_t>(s);
    if (generation_of(s) != generation || next >= static_cast<uint32_t>(n_threads_)) return -1;
    if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      return static_cast<int>(next);
  }
}

void thread_pool::execute(int ith) {
  if (failed_.load(std::memory_order_relaxed)) return;  // skip the rest of a failed region
  try {
    fn_(ctx_, ith, n_threads_);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true, std::memory_order_relaxed);
  }
}

void thread_pool::run_impl(task_fn fn, void* ctx) {
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  error_ = nullptr;
  failed_.store(false, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  ++generation_;
  // seq_cst pairs with the worker's seq_cst sleeping_ increment and state_ re-check: either the
  // worker sees the new generation, or this thread sees it asleep and wakes it.
  state_.store((static_cast<uint64_t>(generation_) << 32) | 1u);
  if (sleeping_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
  }

  int mine = 1;
  execute(0);
  for (int ith; (ith = claim(generation_)) >= 0; ++mine) execute(ith);
  // Every share is claimed now; those claimed by workers must finish before fn's closure, which
  // lives on the caller's stack, goes away.
  for (int polls = 0; done_.load(std::memory_order_acquire) != n_threads_ - mine; ++polls) {
    if (polls < polls_before_yield)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  if (error_) std::rethrow_exception(error_);
}

void thread_pool::worker() {
  uint32_t seen = 0;  // the generation at construction: a region may be published before we start
  for (;;) {
    // Poll for the next region, then sleep.
    uint32_t gen = generation_of(state_.load(std::memory_order_acquire));
    if (gen == seen) {
      const auto deadline = std::chrono::steady_clock::now() + spin_time;
      for (int polls = 1;; ++polls) {
        cpu_relax();
        gen = generation_of(state_.load(std::memory_order_acquire));
        if (gen != seen) break;
        if (polls % polls_per_clock_read == 0 && std::chrono::steady_clock::now() >= deadline) break;
      }
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1);
      cv_.wait(lock, [&] { return generation_of(state_.load()) != seen || stop_.load(); });
      sleeping_.fetch_sub(1);
      gen = generation_of(state_.load(std::memory_order_acquire));
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = gen;
    for (int ith; (ith = claim(gen)) >= 0;) {
      execute(ith);
      done_.fetch_add(1, std::memory_order_release);
    }
  }
}

}  // namespace troupe::kernels
