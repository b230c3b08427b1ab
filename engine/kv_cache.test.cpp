#include "engine/kv_cache.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <vector>

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

TEST_CASE("kv_storage layer views tile each block with disjoint, head-major K and V rows", "[kv]") {
  kv_shape s{3, 2, 8, 4};
  kv_storage kv(s, 5);
  // Every element of the storage belongs to exactly one (layer, block, slot, head, K or V) row.
  std::vector<int> hits((size_t)(s.block_elems() * 5), 0);
  const auto* base = kv.block_data(0);
  for (int il = 0; il < 3; ++il) {
    auto v = kv.layer(il);
    for (int32_t b = 0; b < 5; ++b)
      for (int slot = 0; slot < 4; ++slot)
        for (int h = 0; h < 2; ++h)
          for (const auto* row : {v.k_at(b, slot, h), v.v_at(b, slot, h)}) {
            // Inside its block's contiguous range (one copy swaps the block).
            REQUIRE(row >= kv.block_data(b));
            REQUIRE(row + s.head_dim <= kv.block_data(b) + s.block_elems());
            for (int i = 0; i < s.head_dim; ++i) ++hits[(size_t)(row - base + i)];
          }
    // Head-major: one head's positions of a block are contiguous.
    REQUIRE(v.k_at(1, 1, 1) == v.k_at(1, 0, 1) + s.head_dim);
    REQUIRE(v.k_at(1, 0, 1) == v.k_at(1, 0, 0) + s.block_size * s.head_dim);
  }
  REQUIRE(std::all_of(hits.begin(), hits.end(), [](int n) { return n == 1; }));
  REQUIRE(kv_blocks_for(0, 16) == 0);
  REQUIRE(kv_blocks_for(16, 16) == 1);
  REQUIRE(kv_blocks_for(17, 16) == 2);
}

TEST_CASE("make_kv_shape puts sliding-window layers in groups as large as the full-attention one", "[kv]") {
  // Gemma 3 1B's pattern, cut at 13 layers: full attention at 5 and 11, sliding elsewhere.
  std::vector<bool> sliding(13, true);
  sliding[5] = sliding[11] = false;
  const kv_shape g = make_kv_shape(sliding, 1, 256, 16, 512, true);
  REQUIRE(g.n_layers == 2);
  REQUIRE(g.n_groups == 1 + 6);  // 11 sliding layers in groups of 2, the last one padded
  REQUIRE(g.window == 512);
  REQUIRE(g.slot_of(5) == kv_slot{0, 0});
  REQUIRE(g.slot_of(11) == kv_slot{0, 1});
  REQUIRE(g.slot_of(0) == kv_slot{1, 0});
  REQUIRE(g.slot_of(6) == kv_slot{3, 1});   // the 6th sliding layer
  REQUIRE(g.slot_of(12) == kv_slot{6, 0});  // the 11th, alone in the last group
  REQUIRE(g.block_bytes() * 13 == make_kv_shape(sliding, 1, 256, 16, 512, false).block_bytes() * 2);
  // One group of every layer: not asked, no window, or nothing to group.
  for (const kv_shape& one : {make_kv_shape(sliding, 1, 256, 16, 512, false), make_kv_shape(sliding, 1, 256, 16, 0, true),
                              make_kv_shape(std::vector<bool>(4, true), 1, 256, 16, 512, true),
                              make_kv_shape(std::vector<bool>(4, false), 1, 256, 16, 512, true)}) {
    REQUIRE(one.n_groups == 1);
    REQUIRE(one.slots.empty());
    REQUIRE(one.slot_of(3) == kv_slot{0, 3});
  }
}
