#include "engine/block_manager.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

using namespace troupe::engine;

namespace {

using tokens_t = std::vector<token_id>;
using copy_kind = block_copy::kind;

tokens_t concat(const tokens_t& a, const tokens_t& b) {
  tokens_t r = a;
  r.insert(r.end(), b.begin(), b.end());
  return r;
}

tokens_t range_tokens(int n, int first) {
  tokens_t r((size_t)n);
  for (int i = 0; i < n; ++i) r[(size_t)i] = first + i;
  return r;
}

std::vector<int32_t> table_of(const block_manager& bm, uint64_t seq) {
  auto t = bm.table(seq);
  return {t.begin(), t.end()};
}

std::vector<int32_t> tables_of(const block_manager& bm, uint64_t seq) {
  std::vector<int32_t> all;
  for (int g = 0; g < bm.n_groups(); ++g) all.insert(all.end(), bm.table(seq, g).begin(), bm.table(seq, g).end());
  return all;
}

// Everything observable about the pools, to prove that a failed call left no trace.
struct snapshot {
  int32_t n_free_device, n_cached, n_free_host;
  std::map<uint64_t, std::pair<std::vector<int32_t>, int64_t>> seqs;
  bool operator==(const snapshot&) const = default;
};

snapshot take_snapshot(const block_manager& bm, const std::vector<uint64_t>& ids) {
  snapshot s{bm.n_free_device(), bm.n_cached(), bm.n_free_host(), {}};
  for (uint64_t id : ids)
    if (bm.has(id)) s.seqs[id] = {tables_of(bm, id), bm.n_positions(id)};
  return s;
}

// Fake KV memory: one int per (block, slot), holding the token whose KV would be there. Copies
// are executed in list order, as the executor must.
struct fake_memory {
  int bs;
  std::vector<int> device, host;
  fake_memory(int block_size, int32_t n_device, int32_t n_host)
      : bs(block_size), device((size_t)n_device * block_size, -1), host((size_t)n_host * block_size, -1) {}
  void run(const std::vector<block_copy>& copies) {
    for (const auto& c : copies) {
      const bool from_dev = c.dir != copy_kind::host_to_device;
      const bool to_dev = c.dir != copy_kind::device_to_host;
      const auto& src = from_dev ? device : host;
      auto& dst = to_dev ? device : host;
      std::copy_n(src.begin() + (ptrdiff_t)c.src * bs, bs, dst.begin() + (ptrdiff_t)c.dst * bs);
    }
  }
  int& at(std::vector<int>& pool, std::span<const int32_t> table, int64_t p) {
    return pool[(size_t)table[(size_t)(p / bs)] * (size_t)bs + (size_t)(p % bs)];
  }
};

void require_empty(block_manager& bm, const std::vector<uint64_t>& ids) {
  for (uint64_t id : ids) bm.free(id);
  bm.clear_cache();
  REQUIRE(bm.check() == "");
  REQUIRE(bm.n_free_device() == bm.n_device());
  REQUIRE(bm.n_free_host() == bm.n_host());
  REQUIRE(bm.n_cached() == 0);
}

}  // namespace

TEST_CASE("block_allocator parks blocks for a cache", "[kv][block_manager]") {
  block_allocator a(3);
  const int32_t b = a.allocate();
  REQUIRE(a.release(b, true) == 0);
  REQUIRE(a.is_parked(b));
  REQUIRE(a.n_parked() == 1);
  REQUIRE(a.n_free() == 2);
  REQUIRE_THROWS_AS(a.retain(b), std::logic_error);
  a.unpark(b);
  REQUIRE(a.ref_count(b) == 1);
  REQUIRE(a.release(b, true) == 0);
  a.free_parked(b);
  REQUIRE(a.is_free(b));
  REQUIRE(a.n_free() == 3);
  REQUIRE_THROWS_AS(a.free_parked(b), std::logic_error);
  REQUIRE_THROWS_AS(a.unpark(b), std::logic_error);
}

TEST_CASE("kv_block_hash chains the parent and separates token orders", "[kv][block_manager]") {
  const tokens_t a{1, 2, 3, 4}, b{2, 1, 3, 4};
  REQUIRE(kv_block_hash(0, a) != kv_block_hash(0, b));
  REQUIRE(kv_block_hash(0, a) != kv_block_hash(1, a));
  REQUIRE(kv_block_hash(7, a) == kv_block_hash(7, a));
  REQUIRE(kv_block_hash(0, tokens_t{0}) != kv_block_hash(0, tokens_t{0, 0}));
}

TEST_CASE("a shared system prompt is served from the prefix cache", "[kv][block_manager]") {
  block_manager bm(4, 32, 0);
  const tokens_t sys = range_tokens(10, 100);
  const tokens_t a = concat(sys, range_tokens(5, 500));
  const tokens_t b = concat(sys, range_tokens(6, 600));
  REQUIRE(bm.allocate(1, a) == 0);  // nothing cached yet
  REQUIRE(bm.table(1).size() == 4);
  // Before commit, nothing is cacheable: the KV is not computed yet.
  REQUIRE(bm.cost_allocate(b).n_cached_positions == 0);
  bm.commit(1, std::span(a).first(7));  // one full block computed
  REQUIRE(bm.cost_allocate(b).n_cached_positions == 4);
  bm.commit(1, a);  // all 15 positions: 3 full blocks
  REQUIRE(bm.n_committed_blocks(1) == 3);
  // b shares blocks 0 and 1 (sys[0, 8)); block 2 mixes sys[8, 10) with a's own tokens.
  REQUIRE(bm.allocate(2, b) == 8);
  const auto ta = table_of(bm, 1), tb = table_of(bm, 2);
  REQUIRE(tb.size() == 4);
  REQUIRE(ta[0] == tb[0]);
  REQUIRE(ta[1] == tb[1]);
  REQUIRE(ta[2] != tb[2]);
  REQUIRE(bm.n_exclusive(1) == 2);
  REQUIRE(bm.stats().n_hit_tokens == 8);
  REQUIRE(bm.stats().n_lookups == 2);
  REQUIRE(bm.stats().n_lookup_tokens == (int64_t)(a.size() + b.size()));
  REQUIRE(bm.check() == "");

  // Freed blocks stay cached; a third request with the same prefix still hits after a is gone.
  bm.free(1);
  REQUIRE(bm.n_cached() == 1);  // a's block 2 (its blocks 0, 1 are still held by b)
  REQUIRE(bm.allocate(3, a) == 12);
  REQUIRE(bm.check() == "");
  require_empty(bm, {2, 3});
}

TEST_CASE("the last prompt token is always computed", "[kv][block_manager]") {
  block_manager bm(4, 8, 0);
  const tokens_t p = range_tokens(8, 1);
  REQUIRE(bm.allocate(1, p) == 0);
  bm.commit(1, p);
  REQUIRE(bm.n_committed_blocks(1) == 2);
  REQUIRE(bm.allocate(2, p) == 4);                    // not 8: one token left to compute
  REQUIRE(bm.allocate(3, concat(p, {9})) == 8);       // one more token: both blocks hit
  REQUIRE(bm.allocate(4, std::span(p).first(1)) == 0);
  // The same block under another parent is not a hit: the chain identifies the whole prefix.
  const tokens_t q = concat(range_tokens(4, 50), concat(std::vector(p.begin() + 4, p.end()), {9}));
  REQUIRE(bm.cost_allocate(q).n_cached_positions == 0);
  require_empty(bm, {1, 2, 3, 4});
}

TEST_CASE("hits are verified on the tokens, never on the hash alone", "[kv][block_manager]") {
  // Every block hashes alike: each lookup lands on whatever block holds that hash.
  block_manager bm(2, 16, 0, [](uint64_t, std::span<const token_id>) -> uint64_t { return 42; });
  const tokens_t a{1, 2, 3, 4, 5}, b{1, 2, 7, 8, 9}, c{6, 6, 3, 4, 5};
  REQUIRE(bm.allocate(1, a) == 0);
  bm.commit(1, a);
  REQUIRE(bm.n_committed_blocks(1) == 2);
  REQUIRE(bm.allocate(2, b) == 2);  // block {1,2} is the one registered under 42
  REQUIRE(bm.allocate(3, c) == 0);  // {6,6} collides with {1,2}: no hit
  bm.commit(3, c);                  // collides: stays uncached, nothing breaks
  REQUIRE(bm.check() == "");
  bm.free(1);
  bm.free(3);
  REQUIRE(bm.n_cached() == 0);      // {1,2} is still held by 2; the others were never cached
  REQUIRE(bm.allocate(4, a) == 2);  // {3,4} was never registered (collision): only the first block
  bm.free(2);
  bm.free(4);
  REQUIRE(bm.n_cached() == 1);
  REQUIRE(bm.allocate(5, c) == 0);
  require_empty(bm, {5});
}

TEST_CASE("a block computed twice is replaced by the cached one", "[kv][block_manager]") {
  block_manager bm(2, 8, 0);
  const tokens_t p{1, 2, 3, 4, 5};
  REQUIRE(bm.allocate(1, p) == 0);
  REQUIRE(bm.allocate(2, p) == 0);  // both prefill the same prompt in the same step
  bm.commit(1, p);
  const auto t1 = table_of(bm, 1), t2 = table_of(bm, 2);
  REQUIRE(bm.n_free_device() == 2);
  bm.commit(2, p);
  REQUIRE(bm.stats().n_deduplicated == 2);
  const auto t2b = table_of(bm, 2);
  REQUIRE(t2b[0] == t1[0]);
  REQUIRE(t2b[1] == t1[1]);
  REQUIRE(t2b[2] == t2[2]);         // the partial block is its own
  REQUIRE(bm.n_free_device() == 4); // its two duplicates went back to the free list
  REQUIRE(bm.check() == "");
  require_empty(bm, {1, 2});
}

TEST_CASE("appending to a forked sequence copies its shared last block", "[kv][block_manager]") {
  block_manager bm(4, 8, 0);
  const tokens_t p = range_tokens(6, 1);
  REQUIRE(bm.allocate(1, p) == 0);
  bm.commit(1, p);
  bm.fork(1, 2);
  const auto t1 = table_of(bm, 1);
  REQUIRE(table_of(bm, 2) == t1);
  REQUIRE(bm.n_exclusive(1) == 0);
  REQUIRE(bm.cost_append(1, 1) == 1);  // copy-on-write of the half-full block
  REQUIRE(bm.cost_append(1, 3) == 2);  // ... plus a new block for position 8
  std::vector<block_copy> copies;
  REQUIRE(bm.append(1, 1, copies));
  REQUIRE(copies.size() == 1);
  const auto t1b = table_of(bm, 1);
  REQUIRE(copies[0] == block_copy{copy_kind::device_to_device, t1[1], t1b[1]});
  REQUIRE(t1b[0] == t1[0]);  // the full block stays shared
  REQUIRE(t1b[1] != t1[1]);
  REQUIRE(table_of(bm, 2) == t1);
  REQUIRE(bm.stats().n_cow_copies == 1);
  // The child now owns the old block alone: it writes in place.
  copies.clear();
  REQUIRE(bm.cost_append(2, 1) == 0);
  REQUIRE(bm.append(2, 1, copies));
  REQUIRE(copies.empty());
  REQUIRE(table_of(bm, 2) == t1);
  // A full shared last block needs no copy: new positions go to a new block.
  REQUIRE(bm.append(2, 1, copies));  // position 7: block 1 full now
  bm.fork(2, 3);
  REQUIRE(bm.cost_append(3, 1) == 1);
  REQUIRE(bm.append(3, 1, copies));
  REQUIRE(copies.empty());
  REQUIRE(bm.check() == "");
  require_empty(bm, {1, 2, 3});
}

TEST_CASE("cached blocks are evicted least recently released first, tails first", "[kv][block_manager]") {
  block_manager bm(2, 6, 0);
  const tokens_t a{1, 2, 3, 4, 5}, b{6, 7, 8, 9, 10};
  REQUIRE(bm.allocate(1, a) == 0);
  bm.commit(1, a);
  REQUIRE(bm.allocate(2, b) == 0);
  bm.commit(2, b);
  const auto ta = table_of(bm, 1), tb = table_of(bm, 2);
  bm.free(1);  // LRU: a1, a0 (the tail first); a's partial block is free
  bm.free(2);  // LRU: a1, a0, b1, b0
  REQUIRE(bm.n_cached() == 4);
  REQUIRE(bm.n_free_device() == 2);
  // A hit takes a's blocks out of the LRU although they are the oldest ...
  REQUIRE(bm.allocate(3, a) == 4);
  REQUIRE(table_of(bm, 3)[0] == ta[0]);
  REQUIRE(table_of(bm, 3)[1] == ta[1]);
  REQUIRE(bm.n_cached() == 2);
  REQUIRE(bm.stats().n_evictions == 0);
  // ... so a fresh 3-block prompt takes the last free block, then evicts b's tail, then b's head.
  REQUIRE(bm.allocate(4, range_tokens(5, 20)) == 0);
  REQUIRE(bm.stats().n_evictions == 2);
  auto t4 = table_of(bm, 4);
  REQUIRE(t4[1] == tb[1]);
  REQUIRE(t4[2] == tb[0]);
  REQUIRE(bm.cost_allocate(b).n_cached_positions == 0);
  // Releasing a again: its tail is evicted before its head.
  bm.free(3);  // LRU: a1, a0; free: a's partial block
  REQUIRE(bm.allocate(5, range_tokens(3, 40)) == 0);  // 2 blocks: the free one, then a1
  REQUIRE(bm.stats().n_evictions == 3);
  REQUIRE(table_of(bm, 5)[1] == ta[1]);
  REQUIRE(bm.cost_allocate(a).n_cached_positions == 2);
  REQUIRE(bm.check() == "");
  require_empty(bm, {4, 5});
}

TEST_CASE("swap out and in round-trips the KV and frees the pools", "[kv][block_manager]") {
  const int bs = 4;
  block_manager bm(bs, 8, 8);
  fake_memory mem(bs, 8, 8);
  const tokens_t p = range_tokens(10, 1);
  REQUIRE(bm.allocate(1, p) == 0);
  for (int64_t i = 0; i < 10; ++i) mem.at(mem.device, bm.table(1), i) = p[(size_t)i];
  bm.commit(1, p);
  std::vector<block_copy> copies;
  REQUIRE(bm.swap_out(1, copies));
  REQUIRE(copies.size() == 3);
  for (const auto& c : copies) REQUIRE(c.dir == copy_kind::device_to_host);
  REQUIRE(bm.is_swapped(1));
  REQUIRE(bm.n_free_host() == 5);
  REQUIRE(bm.n_available_device() == 8);
  REQUIRE(bm.n_cached() == 2);  // the two committed blocks stay in the prefix cache
  mem.run(copies);
  REQUIRE_THROWS_AS(bm.append(1, 1, copies), std::logic_error);
  REQUIRE_THROWS_AS(bm.commit(1, p), std::logic_error);

  SECTION("cached blocks come back without a copy") {
    copies.clear();
    REQUIRE(bm.cost_swap_in(1) == 3);  // parked hits still leave the evictable pool
    REQUIRE(bm.swap_in(1, copies));
    REQUIRE(copies.size() == 1);  // only the uncommitted tail block
    REQUIRE(bm.stats().n_swap_in_reused == 2);
    mem.run(copies);
  }
  SECTION("evicted blocks are copied back and cached again") {
    bm.clear_cache();
    copies.clear();
    REQUIRE(bm.swap_in(1, copies));
    REQUIRE(copies.size() == 3);
    for (const auto& c : copies) REQUIRE(c.dir == copy_kind::host_to_device);
    mem.run(copies);
    REQUIRE(bm.cost_allocate(concat(p, {77})).n_cached_positions == 8);
  }
  REQUIRE_FALSE(bm.is_swapped(1));
  REQUIRE(bm.n_free_host() == 8);
  for (int64_t i = 0; i < 10; ++i) REQUIRE(mem.at(mem.device, bm.table(1), i) == p[(size_t)i]);
  REQUIRE(bm.check() == "");
  require_empty(bm, {1});
}

TEST_CASE("failed calls leave no trace", "[kv][block_manager]") {
  block_manager bm(4, 4, 2);
  const tokens_t p = range_tokens(9, 1);  // 3 blocks
  REQUIRE(bm.allocate(1, p) == 0);
  bm.commit(1, p);
  const std::vector<uint64_t> ids{1, 2, 3};
  std::vector<block_copy> copies;
  auto before = take_snapshot(bm, ids);
  const auto stats = bm.stats();

  REQUIRE_FALSE(bm.allocate(2, range_tokens(9, 50)));  // needs 3, 1 available
  REQUIRE_FALSE(bm.append(1, 8, copies));              // needs 2 more
  REQUIRE_FALSE(bm.swap_out(1, copies));               // host holds 2 < 3
  REQUIRE(copies.empty());
  REQUIRE(take_snapshot(bm, ids) == before);
  REQUIRE(bm.stats().n_evictions == stats.n_evictions);
  REQUIRE(bm.check() == "");

  // Swap in fails when the device is short, and leaves the sequence on the host.
  block_manager bm2(4, 3, 4);
  REQUIRE(bm2.allocate(1, p) == 0);
  REQUIRE(bm2.swap_out(1, copies));
  REQUIRE(bm2.allocate(2, range_tokens(2, 90)) == 0);  // takes one device block
  copies.clear();
  before = take_snapshot(bm2, ids);
  REQUIRE_FALSE(bm2.swap_in(1, copies));
  REQUIRE(copies.empty());
  REQUIRE(take_snapshot(bm2, ids) == before);
  REQUIRE(bm2.check() == "");

  // Misuse is an error, not a silent state change.
  REQUIRE_THROWS_AS(bm.allocate(1, p), std::logic_error);
  REQUIRE_THROWS_AS(bm.allocate(9, tokens_t{}), std::invalid_argument);
  REQUIRE_THROWS_AS(bm.append(42, 1, copies), std::logic_error);
  REQUIRE_THROWS_AS(bm.commit(1, range_tokens(10, 1)), std::logic_error);  // beyond its positions
  REQUIRE_THROWS_AS(bm.fork(1, 1), std::logic_error);
  REQUIRE_THROWS_AS(bm.swap_in(1, copies), std::logic_error);
  REQUIRE(bm.check() == "");
  require_empty(bm, ids);
  require_empty(bm2, ids);
}

TEST_CASE("random operations keep every invariant and the KV each sequence reads", "[kv][block_manager]") {
  const int bs = 4;
  const uint64_t seed = GENERATE(1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u);
  // Seeds 5-8: three groups, two of them sliding windows of 6 positions, over a pool as large
  // per group; seeds 7 and 8 compute at most 5 positions a step (the sliding groups' blocks
  // ahead are taken as they go), 5 and 6 any number.
  const kv_groups groups = seed > 4 ? kv_groups{3, 6, seed > 6 ? 5 : 0} : kv_groups{};
  const int32_t n_dev = 40 * groups.n, n_host = 20 * groups.n;
  std::mt19937_64 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  block_manager bm(bs, n_dev, n_host, kv_block_hash, groups);
  fake_memory mem(bs, n_dev, n_host);
  // The positions a sequence still reads in group g: all of them in group 0, the window of the
  // next position to compute in a sliding group.
  auto first_read = [&](int g, int64_t n_computed) -> int64_t {
    return g == 0 ? 0 : std::max<int64_t>(0, n_computed - groups.window + 1) / bs * bs;
  };

  // A few shared system prompts over a tiny vocabulary, so that prefixes and blocks repeat.
  std::vector<tokens_t> systems;
  for (int i = 0; i < 3; ++i) {
    tokens_t s((size_t)uni(3, 14));
    for (auto& t : s) t = uni(0, 5);
    systems.push_back(s);
  }
  struct model_seq {
    tokens_t tokens;  // the token at every covered position
    int64_t n_computed = 0;
  };
  std::map<uint64_t, model_seq> model;
  uint64_t next_id = 1;
  int64_t n_hits = 0, n_failures = 0, n_swaps = 0, n_cows = 0;

  auto pick = [&](bool want_swapped) -> uint64_t {
    std::vector<uint64_t> c;
    for (const auto& [id, m] : model)
      if (bm.is_swapped(id) == want_swapped) c.push_back(id);
    return c.empty() ? 0 : c[(size_t)uni(0, (int)c.size() - 1)];
  };
  auto compute = [&](uint64_t id, int64_t upto) {
    model_seq& m = model[id];
    for (int g = 0; g < bm.n_groups(); ++g)
      for (int64_t p = m.n_computed; p < upto; ++p) mem.at(mem.device, bm.table(id, g), p) = m.tokens[(size_t)p];
    m.n_computed = upto;
    bm.commit(id, std::span(m.tokens).first((size_t)upto));
  };

  for (int step = 0; step < 3000; ++step) {
    std::vector<uint64_t> ids;
    for (const auto& [id, m] : model) ids.push_back(id);
    const auto before = take_snapshot(bm, ids);
    std::vector<block_copy> copies;
    bool failed = false;
    const int op = uni(0, 99);
    if (op < 22) {  // a new request
      tokens_t prompt = systems[(size_t)uni(0, 2)];
      if (uni(0, 3) == 0 && !model.empty()) prompt = model.begin()->second.tokens;
      for (int i = uni(0, 9); i > 0; --i) prompt.push_back(uni(0, 5));
      if (prompt.empty()) prompt.push_back(1);
      const int32_t expect_blocks = bm.cost_allocate(prompt).n_blocks;
      const auto r = bm.allocate(next_id, prompt);
      REQUIRE(r.has_value() == (expect_blocks <= before.n_free_device + before.n_cached));
      if (r) {
        REQUIRE(*r < (int64_t)prompt.size());
        REQUIRE(*r % bs == 0);
        n_hits += *r > 0;
        model[next_id] = {prompt, *r};
        ++next_id;
      } else {
        failed = true;
      }
    } else if (op < 45) {  // a step computes some positions
      if (uint64_t id = pick(false); id && model[id].n_computed < (int64_t)model[id].tokens.size()) {
        if (bm.append(id, 0, copies)) {  // the sliding groups' blocks ahead
          const int64_t c = model[id].n_computed, n = (int64_t)model[id].tokens.size();
          compute(id, uni((int)c + 1, (int)(groups.step_tokens > 0 ? std::min<int64_t>(n, c + groups.step_tokens) : n)));
        } else {
          failed = true;
        }
      }
    } else if (op < 62) {  // a decode or the next chunk: new positions
      if (uint64_t id = pick(false)) {
        const int n = uni(1, 6);
        if (bm.append(id, n, copies)) {
          n_cows += !copies.empty();
          for (int i = 0; i < n; ++i) model[id].tokens.push_back(uni(0, 5));
        } else {
          failed = true;
        }
      }
    } else if (op < 68) {  // parallel sampling: fork
      if (uint64_t id = pick(false)) {
        bm.fork(id, next_id);
        model[next_id] = model[id];
        ++next_id;
      }
    } else if (op < 82) {  // finished or cancelled
      if (!model.empty()) {
        auto it = std::next(model.begin(), uni(0, (int)model.size() - 1));
        bm.free(it->first);
        model.erase(it);
      }
    } else if (op < 90) {  // preempted by swapping
      if (uint64_t id = pick(false)) {
        if (bm.swap_out(id, copies)) ++n_swaps; else failed = true;
      }
    } else if (op < 98) {
      if (uint64_t id = pick(true)) {
        if (!bm.swap_in(id, copies)) failed = true;
      }
    } else {
      bm.clear_cache();
    }
    if (failed) {
      ++n_failures;
      REQUIRE(copies.empty());
      REQUIRE(take_snapshot(bm, ids) == before);
    }
    mem.run(copies);
    INFO("seed " << seed << " step " << step);
    REQUIRE(bm.check() == "");
    // Every computed position reads back its own token, wherever its block came from.
    for (const auto& [id, m] : model) {
      REQUIRE(bm.n_positions(id) == (int64_t)m.tokens.size());
      auto& pool = bm.is_swapped(id) ? mem.host : mem.device;
      for (int g = 0; g < bm.n_groups(); ++g) {
        const auto t = bm.table(id, g);
        const int64_t lo = first_read(g, m.n_computed);
        for (int64_t p = 0; p < lo; ++p) REQUIRE(t[(size_t)(p / bs)] == -1);  // given back
        for (int64_t p = lo; p < m.n_computed; ++p) REQUIRE(mem.at(pool, t, p) == m.tokens[(size_t)p]);
      }
    }
  }
  // The run exercised what it claims to.
  INFO("seed " << seed);
  CHECK(n_hits > 20);
  CHECK(n_failures > 10);
  CHECK(n_swaps > 10);
  CHECK(n_cows > 5);
  CHECK(bm.stats().n_evictions > 10);
  CHECK(bm.stats().n_swap_in_reused > 10);
  CHECK(bm.stats().n_deduplicated > 5);
  std::vector<uint64_t> ids;
  for (const auto& [id, m] : model) ids.push_back(id);
  require_empty(bm, ids);
}

TEST_CASE("sliding-window groups give back the blocks that left the window", "[kv][block_manager]") {
  const int bs = 4;
  // Groups 1 and 2: windows of 6 positions; one step computes at most 4 positions of a sequence.
  block_manager bm(bs, 30, 30, kv_block_hash, {3, 6, 4});
  const tokens_t p = range_tokens(10, 1);
  // Group 0 takes the whole prompt, the sliding groups the first step's block.
  REQUIRE(bm.cost_allocate(p).n_blocks == 3 + 2);
  REQUIRE(bm.allocate(1, p) == 0);
  REQUIRE(bm.n_held(1) == 5);
  REQUIRE(bm.table(1, 1)[1] == -1);
  REQUIRE_THROWS_AS(bm.step_table(1, 8), std::logic_error);  // positions 4-7: not taken yet
  std::vector<block_copy> copies;
  tokens_t all = p;
  int64_t done = 0;
  auto step = [&](int64_t n) {  // a scheduler's step of n positions of the sequence
    REQUIRE(bm.append(1, 0, copies));
    REQUIRE(bm.step_table(1, done + n).size() == 3 * (size_t)kv_blocks_for(done + n, bs));
    done += n;
    bm.commit(1, std::span(all).first((size_t)done));
    REQUIRE(bm.check() == "");
  };
  step(4);
  REQUIRE(bm.cost_append(1, 0) == 2);  // the next step's block, in each sliding group
  step(4);
  // Computed up to position 9: position 10 attends to [5, 10], so block 0 (positions 0-3) goes.
  step(2);
  for (int g : {1, 2}) {
    REQUIRE(bm.table(1, g)[0] == -1);
    REQUIRE(bm.table(1, g)[1] >= 0);
  }
  REQUIRE(bm.n_held(1) == 7);
  REQUIRE(bm.n_cached() == 2);  // committed: kept for a later prefix hit
  // A step's table: each group's first blocks in turn, -1 where given back.
  const auto st = bm.step_table(1, 10);
  REQUIRE(st.size() == 9);
  REQUIRE(std::vector<int32_t>(st.begin(), st.begin() + 3) == table_of(bm, 1));
  REQUIRE(st[3] == -1);
  REQUIRE(st[6] == -1);

  // Decoding: a new block costs one per group; a sliding group holds the two blocks of the window.
  for (int i = 0; i < 30; ++i) {
    REQUIRE(bm.cost_append(1, 1) == (bm.n_positions(1) % bs == 0 ? 3 : 0));
    REQUIRE(bm.append(1, 1, copies));
    all.push_back(100 + i);
    ++done;
    bm.commit(1, all);
    REQUIRE(bm.check() == "");
    for (int g : {1, 2}) {
      int live = 0;
      for (int32_t b : bm.table(1, g)) live += b >= 0;
      REQUIRE(live == 2);
    }
  }
  REQUIRE(copies.empty());
  REQUIRE(bm.table(1).size() == 10);
  REQUIRE(bm.n_held(1) == 10 + 2 * 2);  // group 0's 10 blocks; blocks 8-9 (position 40's window [35, 40]) twice
  // Swap: only held blocks move; the given back ones stay given back.
  REQUIRE(bm.swap_out(1, copies));
  REQUIRE(copies.size() == 14);
  REQUIRE(bm.n_free_host() == 30 - 14);
  copies.clear();
  REQUIRE(bm.swap_in(1, copies));
  REQUIRE(bm.table(1, 1)[0] == -1);
  REQUIRE(bm.check() == "");
  // A lone sequence's peak: every block of group 0, and in each sliding group those of a window
  // and a step ([c - 5, c + 4): 4 blocks at most).
  REQUIRE(bm.peak_blocks(40) == 10 + 4 * 2);
  REQUIRE(bm.peak_blocks(400) == 100 + 4 * 2);
  REQUIRE(bm.peak_blocks(8) == 2 * 3);
  // The longest it can grow in this pool: 22 blocks of group 0 and 4 in each sliding group.
  REQUIRE(kv_max_positions(bs, 30, {3, 6, 4}) == 88);
  REQUIRE(bm.peak_blocks(88) == 30);
  REQUIRE(bm.peak_blocks(89) == 31);
  REQUIRE(kv_max_positions(bs, 6, {3, 6, 4}) == 8);  // a pool smaller than three windows
  REQUIRE(kv_max_positions(bs, 30, {3, 6}) == 40);    // no step bound: whole tables in every group
  REQUIRE(kv_max_positions(bs, 30, {}) == 120);
  require_empty(bm, {1});
}

TEST_CASE("a prefix hit in sliding-window groups needs the window before it", "[kv][block_manager]") {
  const int bs = 4;
  block_manager bm(bs, 18, 0, kv_block_hash, {3, 6});
  const tokens_t p = range_tokens(24, 1);  // 6 full blocks in each of 3 groups: the whole pool
  REQUIRE(bm.allocate(1, p) == 0);
  bm.commit(1, p);
  bm.free(1);
  REQUIRE(bm.n_cached() == 18);
  const tokens_t again = concat(p, {99});
  // The window of position 24 is [19, 24]: blocks 4 and 5 of the sliding groups, both cached.
  REQUIRE(bm.cost_allocate(again).n_cached_positions == 24);
  // An unrelated prompt evicts 9 blocks, least recently released first: the sliding groups'
  // blocks 0-3 (given back while computing), then group 0's tail block 5.
  REQUIRE(bm.allocate(2, range_tokens(12, 500)) == 0);
  REQUIRE(bm.stats().n_evictions == 9);
  REQUIRE(bm.check() == "");
  // Group 0 alone still holds blocks 0-4 (20 positions), but no hit point has its window's
  // blocks in the sliding groups: position 20 needs blocks 3 and 4 there, position 16 blocks 2
  // and 3, ... all evicted. So nothing is reused, rather than the sliding layers reading nothing.
  REQUIRE(bm.cost_allocate(again).n_cached_positions == 0);
  REQUIRE(bm.cost_allocate(again).n_blocks == 21);
  REQUIRE_FALSE(bm.allocate(3, again).has_value());
  REQUIRE(bm.check() == "");
  require_empty(bm, {2});
}

TEST_CASE("a forked sequence shares its window's blocks and copies them on write", "[kv][block_manager]") {
  const int bs = 4;
  block_manager bm(bs, 40, 0, kv_block_hash, {2, 5});
  const tokens_t p = range_tokens(14, 1);
  REQUIRE(bm.allocate(1, p) == 0);
  bm.commit(1, p);
  bm.fork(1, 2);
  REQUIRE(bm.n_exclusive(1) == 0);
  std::vector<block_copy> copies;
  REQUIRE(bm.cost_append(2, 1) == 2);  // the shared partial block, in each group
  REQUIRE(bm.append(2, 1, copies));
  REQUIRE(copies.size() == 2);
  REQUIRE(bm.table(1, 1)[3] != bm.table(2, 1)[3]);
  REQUIRE(bm.table(1, 1)[2] == bm.table(2, 1)[2]);
  REQUIRE(bm.check() == "");
  require_empty(bm, {1, 2});
}
