#include "engine/kv_cache.hpp"

#include <catch2/catch.hpp>

#include <set>

using namespace troupe::engine;

TEST_CASE("block_allocator hands out every block once and takes them back", "[kv]") {
  block_allocator a(8);
  std::set<int32_t> got;
  for (int i = 0; i < 8; ++i) {
    const int32_t b = a.allocate();
    REQUIRE(b >= 0);
    REQUIRE(b < 8);
    REQUIRE(got.insert(b).second);
  }
  REQUIRE(a.allocate() == -1);
  REQUIRE(a.n_free() == 0);
  for (int32_t b : got) a.release(b);
  REQUIRE(a.n_free() == 8);
}

TEST_CASE("block_allocator reference counts shared blocks", "[kv]") {
  block_allocator a(2);
  const int32_t b = a.allocate();
  a.retain(b);
  REQUIRE(a.ref_count(b) == 2);
  a.release(b);
  REQUIRE(a.n_free() == 1);  // still held once
  a.release(b);
  REQUIRE(a.n_free() == 2);
  REQUIRE_THROWS_AS(a.release(b), std::logic_error);
  REQUIRE_THROWS_AS(a.retain(b), std::logic_error);
}

TEST_CASE("kv_storage layer views address disjoint K and V rows of each block", "[kv]") {
  kv_shape s{3, 2, 8, 4};
  kv_storage kv(s, 5);
  std::set<const void*> seen;
  for (int il = 0; il < 3; ++il) {
    auto v = kv.layer(il);
    for (int32_t b = 0; b < 5; ++b)
      for (int slot = 0; slot < 4; ++slot) {
        REQUIRE(seen.insert(v.k_at(b, slot)).second);
        REQUIRE(seen.insert(v.v_at(b, slot)).second);
        // Every row lies inside its block's contiguous range.
        const auto* lo = kv.block_data(b);
        const auto* hi = lo + s.block_elems();
        REQUIRE(v.k_at(b, slot) >= lo);
        REQUIRE(v.v_at(b, slot) + s.row_elems() <= hi);
      }
  }
  REQUIRE((int64_t)seen.size() == 3 * 5 * 4 * 2);
  REQUIRE(kv_blocks_for(0, 16) == 0);
  REQUIRE(kv_blocks_for(16, 16) == 1);
  REQUIRE(kv_blocks_for(17, 16) == 2);
}
