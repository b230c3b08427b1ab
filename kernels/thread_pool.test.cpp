#include "kernels/thread_pool.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace tk = troupe::kernels;

TEST_CASE("thread_pool runs each share exactly once per region", "[kernels][thread_pool]") {
  for (int n : {1, 2, 3, 5}) {
    tk::thread_pool pool(n);
    REQUIRE(pool.size() == n);
    // Catch2 assertions are not thread-safe: shares only record, the test thread checks.
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::atomic<int> wrong_nth{0};
    for (int region = 0; region < 2000; ++region) {
      pool.run([&](int ith, int nth) {
        if (nth != n) wrong_nth.fetch_add(1);
        hits[static_cast<size_t>(ith)].fetch_add(1);
      });
    }
    REQUIRE(wrong_nth.load() == 0);
    for (auto& h : hits) REQUIRE(h.load() == 2000);
  }
}

TEST_CASE("thread_pool wakes sleeping workers", "[kernels][thread_pool]") {
  tk::thread_pool pool(3);
  for (int region = 0; region < 3; ++region) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // well past the spin time
    std::atomic<int> sum{0};
    pool.run([&](int ith, int) { sum.fetch_add(ith + 1); });
    REQUIRE(sum.load() == 6);
  }
}

TEST_CASE("thread_pool::parallel_for covers the range exactly once", "[kernels][thread_pool]") {
  for (int n : {1, 2, 3}) {
    tk::thread_pool pool(n);
    for (int64_t size : {0, 1, 2, 7, 64, 1001}) {
      for (int64_t grain : {1, 3, 16, 5000}) {
        std::vector<std::atomic<int>> seen(static_cast<size_t>(size));
        std::atomic<int> bad{0};
        pool.parallel_for(size, grain, [&](int64_t b, int64_t e, int ith) {
          if (b < 0 || b >= e || e > size || ith < 0 || ith >= n || b % grain != 0) bad.fetch_add(1);
          for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
        });
        REQUIRE(bad.load() == 0);
        for (auto& s : seen) REQUIRE(s.load() == 1);
      }
    }
  }
}

TEST_CASE("thread_pool rethrows an exception from any share after the region", "[kernels][thread_pool]") {
  tk::thread_pool pool(3);
  for (int thrower = 0; thrower < 3; ++thrower) {
    std::atomic<int> started{0}, finished{0};
    REQUIRE_THROWS_WITH(pool.run([&](int ith, int) {
      started.fetch_add(1);
      if (ith == thrower) throw std::runtime_error("boom");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      finished.fetch_add(1);
    }),
                        "boom");
    // Shares not started when the exception was caught are skipped; started ones have finished.
    REQUIRE(finished.load() == started.load() - 1);
  }
  std::atomic<int> after{0};
  pool.run([&](int, int) { after.fetch_add(1); });  // still usable
  REQUIRE(after.load() == 3);
}

TEST_CASE("thread_pool rejects fewer than one thread", "[kernels][thread_pool]") {
  REQUIRE_THROWS_AS(tk::thread_pool(0), std::invalid_argument);
}
