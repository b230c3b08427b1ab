#include <catch2/catch.hpp>

#include <vector>

#include "actors/prefix_affinity.hpp"

using troupe::actors::prefix_affinity;

TEST_CASE("prefix_affinity: the deepest known prefix wins, among usable replicas", "[actors][routing]") {
  prefix_affinity a(100);
  const std::vector<uint64_t> sys = {11, 12, 13}, other = {21, 22};
  auto any = [](size_t) { return true; };
  CHECK(!a.find(sys, any));
  a.record(sys, 1);
  a.record(other, 0);
  // A prompt that shares two of sys's blocks, then differs.
  const std::vector<uint64_t> q = {11, 12, 99, 98};
  auto hit = a.find(q, any);
  REQUIRE(hit);
  CHECK(hit->first == 1);
  CHECK(hit->second == 2);
  // Recorded elsewhere later: its whole chain moves, the shared part included.
  a.record(q, 0);
  CHECK(a.find(sys, any)->first == 1);  // block 13 still points to 1 (deepest)
  CHECK(a.find(std::vector<uint64_t>{11, 12}, any)->first == 0);
  // A replica that is not usable (down, tried) is passed over for a shallower match.
  CHECK(a.find(sys, [](size_t r) { return r != 1; })->first == 0);
  CHECK(a.find(sys, [](size_t r) { return r != 1; })->second == 2);
  CHECK(!a.find(other, [](size_t r) { return r != 0; }));
}

TEST_CASE("prefix_affinity: bounded, least recently routed forgotten first, forget(replica)", "[actors][routing]") {
  prefix_affinity a(4);
  a.record(std::vector<uint64_t>{1, 2}, 0);
  a.record(std::vector<uint64_t>{3, 4}, 1);
  CHECK(a.size() == 4);
  a.record(std::vector<uint64_t>{1}, 0);        // 1 is now the most recent
  a.record(std::vector<uint64_t>{5, 6}, 1);     // evicts the two least recent: 2, then 3
  CHECK(a.size() == 4);
  auto any = [](size_t) { return true; };
  CHECK(a.find(std::vector<uint64_t>{1}, any));
  CHECK(!a.find(std::vector<uint64_t>{2}, any));
  CHECK(!a.find(std::vector<uint64_t>{3}, any));
  CHECK(a.find(std::vector<uint64_t>{4}, any));
  a.forget(1);
  CHECK(a.size() == 1);
  CHECK(!a.find(std::vector<uint64_t>{5, 6}, any));
  CHECK(a.find(std::vector<uint64_t>{1}, any)->first == 0);
  CHECK_THROWS_AS(prefix_affinity(0), std::invalid_argument);
}
