#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/thread_pool.hpp"

namespace tk = troupe::kernels;

TEST_CASE("thread_pool runs each share once per region", "[kernels][thread_pool]") {
  for (int n : {1, 2, 3, 5}) {
    tk::thread_pool pool(n);
    REQUIRE(pool.size() == n);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    for (int region = 0; region < 2000; ++region) {
      pool.run([&](int ith, int nth) {
        REQUIRE(nth == n);
        hits[static_cast<size_t>(ith)].fetch_add(1);
      });
    }
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
        pool.parallel_for(size, grain, [&](int64_t b, int64_t e, int ith) {
          REQUIRE(0 <= b);
          REQUIRE(b < e);
          REQUIRE(e <= size);
          REQUIRE(ith < n);
          REQUIRE((b % grain == 0));
          for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
        });
        for (auto& s : seen) REQUIRE(s.load() == 1);
      }
    }
  }
}

TEST_CASE("thread_pool rethrows an exception from any thread after the region", "[kernels][thread_pool]") {
  tk::thread_pool pool(3);
  for (int thrower = 0; thrower < 3; ++thrower) {
    std::atomic<int> finished{0};
    REQUIRE_THROWS_WITH(pool.run([&](int ith, int) {
      if (ith == thrower) throw std::runtime_error("boom");
      finished.fetch_add(1);
    }),
                        "boom");
    REQUIRE(finished.load() == 2);  // the others completed before run returned
  }
  std::atomic<int> after{0};
  pool.run([&](int, int) { after.fetch_add(1); });  // still usable
  REQUIRE(after.load() == 3);
}

TEST_CASE("thread_pool rejects fewer than one thread", "[kernels][thread_pool]") {
  REQUIRE_THROWS_AS(tk::thread_pool(0), std::invalid_argument);
}
