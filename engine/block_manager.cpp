#include "engine/block_manager.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace troupe::engine {

namespace {

// splitmix64's finalizer: a bijection of 64-bit words with full avalanche.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

std::string seq_name(uint64_t seq) { return "sequence " + std::to_string(seq); }

}  // namespace

uint64_t kv_block_hash(uint64_t parent_hash, std::span<const token_id> tokens) {
  constexpr uint64_t k = 0x9e3779b97f4a7c15ULL;  // odd: (t + 1) * k is injective in t
  uint64_t h = mix64(parent_hash + k * ((uint64_t)tokens.size() + 1));
  for (token_id t : tokens) h = mix64(h ^ (((uint64_t)(uint32_t)t + 1) * k));
  return h;
}

block_manager::block_manager(int block_size, int32_t n_device, int32_t n_host, block_hash_fn hash, kv_groups groups)
    : block_size_(block_size),
      hash_(hash ? hash : kv_block_hash),
      device_(n_device > 0 ? n_device : throw std::invalid_argument("block_manager: n_device must be > 0")),
      host_(n_host >= 0 ? n_host : throw std::invalid_argument("block_manager: n_host must be >= 0")),
      meta_((size_t)n_device),
      groups_(groups),
      lru_pos_((size_t)n_device) {
  if (block_size <= 0) throw std::invalid_argument("block_manager: block_size must be > 0");
  if (groups.n < 1 || groups.n > 255 || groups.window < 0 || (groups.n > 1) != (groups.window > 0) || groups.step_tokens < 0)
    throw std::invalid_argument("block_manager: 1..255 groups, a window > 0 exactly when there are sliding groups, step_tokens >= 0");
}

int64_t block_manager::live_from(int64_t n_computed) const {
  if (groups_.n == 1) return 0;
  return std::max<int64_t>(0, n_computed - groups_.window + 1) / block_size_;
}

int64_t block_manager::cover_to(int64_t n_positions, int64_t n_computed, int64_t covered) const {
  int64_t to = kv_blocks_for(n_positions, block_size_);
  if (groups_.step_tokens > 0) to = std::min<int64_t>(to, kv_blocks_for(n_computed + groups_.step_tokens, block_size_));
  return std::max(covered, to);
}

int32_t block_manager::growth(const seq_entry& e, int64_t n_new) const {
  const int64_t n = e.n_positions + n_new;
  auto fresh = (int32_t)(kv_blocks_for(n, block_size_) - (int64_t)e.tables[0].size());
  if (groups_.n > 1) fresh += (int32_t)(cover_to(n, e.n_computed, e.n_covered) - e.n_covered) * (groups_.n - 1);
  return fresh;
}

double block_manager::usage() const {
  const int32_t used = device_.n_blocks() - device_.n_free() - device_.n_parked();
  return (double)used / (double)device_.n_blocks();
}

const block_manager::seq_entry& block_manager::get(uint64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw std::logic_error("block_manager: unknown " + seq_name(seq));
  return it->second;
}

block_manager::seq_entry& block_manager::get(uint64_t seq) {
  return const_cast<seq_entry&>(std::as_const(*this).get(seq));
}

// --- prefix cache -------------------------------------------------------------------------------

int32_t block_manager::find_cached(uint64_t hash, uint64_t parent_cid, std::span<const token_id> tokens) const {
  auto it = cache_.find(hash);
  if (it == cache_.end()) return -1;
  const block_meta& m = meta_[(size_t)it->second];
  // Never trust the hash alone: same parent content and same tokens, or no hit.
  if (m.parent_cid != parent_cid || !std::equal(tokens.begin(), tokens.end(), m.tokens.begin(), m.tokens.end()))
    return -1;
  return it->second;
}

block_manager::chain_hit block_manager::match_prefix(std::span<const token_id> prompt) const {
  chain_hit hit;
  if (prompt.empty()) return hit;
  // At least the last prompt token is computed (its logits start the generation).
  const size_t n_max = (prompt.size() - 1) / (size_t)block_size_;
  uint64_t parent_hash = 0, parent_cid = 0;
  for (size_t j = 0; j < n_max; ++j) {
    const auto toks = prompt.subspan(j * (size_t)block_size_, (size_t)block_size_);
    const uint64_t h = hash_(parent_hash, toks);
    const int32_t b = find_cached(h, parent_cid, toks);
    if (b < 0) break;
    hit.blocks.push_back(b);
    hit.hashes.push_back(h);
    hit.cids.push_back(meta_[(size_t)b].cid);
    if (device_.is_parked(b)) ++hit.n_parked;
    parent_hash = h;
    parent_cid = meta_[(size_t)b].cid;
  }
  if (groups_.n == 1) return hit;
  hit.window.assign((size_t)groups_.n - 1, {});
  if (hit.blocks.empty()) return hit;
  // The sliding groups: a hit of h blocks needs, in each, the blocks of the window before it
  // (from live_from(h * block_size)). Shorten it until they are all cached.
  const auto h_full = (int64_t)hit.blocks.size();
  std::vector<int64_t> missing(h_full + 1, 0);  // missing[j]: blocks < j lacking a sliding group
  for (int64_t j = 0; j < h_full; ++j) {
    bool all = true;
    for (int g = 1; g < groups_.n && all; ++g) all = find_window(hit.cids[(size_t)j], g) >= 0;
    missing[j + 1] = missing[j] + (all ? 0 : 1);
  }
  int64_t h = h_full;
  while (h > 0 && missing[h] - missing[live_from(h * block_size_)] != 0) --h;
  hit.blocks.resize((size_t)h);
  hit.hashes.resize((size_t)h);
  hit.cids.resize((size_t)h);
  hit.n_parked = 0;
  for (int32_t b : hit.blocks) hit.n_parked += device_.is_parked(b);
  const int64_t lo = live_from(h * block_size_);
  hit.window.assign((size_t)groups_.n - 1, std::vector<int32_t>((size_t)h, -1));
  for (int g = 1; g < groups_.n; ++g)
    for (int64_t j = lo; j < h; ++j) {
      const int32_t b = find_window(hit.cids[(size_t)j], g);
      hit.window[(size_t)g - 1][(size_t)j] = b;
      hit.n_parked += device_.is_parked(b);
    }
  return hit;
}

int32_t block_manager::find_window(uint64_t cid, int g) const {
  auto it = window_cache_.find(window_key(cid, g));
  return it == window_cache_.end() ? -1 : it->second;
}

void block_manager::identify_block(int32_t b, uint64_t hash, uint64_t cid, uint64_t parent_cid,
                                   std::span<const token_id> tokens) {
  block_meta& m = meta_[(size_t)b];
  m.hash = hash;
  m.cid = cid;
  m.parent_cid = parent_cid;
  if (!m.registered && !cache_.count(hash)) {
    m.registered = true;
    m.tokens.assign(tokens.begin(), tokens.end());
    cache_[hash] = b;
  }
}

void block_manager::identify_window_block(int32_t b, int g, uint64_t cid) {
  block_meta& m = meta_[(size_t)b];
  m.group = (int16_t)g;
  m.cid = cid;
  const uint64_t key = window_key(cid, g);
  if (!m.registered && !window_cache_.count(key)) {
    m.registered = true;
    window_cache_[key] = b;
  }
}

void block_manager::forget_block(int32_t b) {
  block_meta& m = meta_[(size_t)b];
  if (m.registered) {
    auto& map = m.group == 0 ? cache_ : window_cache_;
    auto it = map.find(m.group == 0 ? m.hash : window_key(m.cid, m.group));
    if (it != map.end() && it->second == b) map.erase(it);
  }
  m = block_meta{};
}

int32_t block_manager::take_device_block() {
  int32_t b = device_.allocate();
  if (b >= 0) return b;
  if (lru_.empty()) throw std::logic_error("block_manager: device pool exhausted after a successful cost check");
  const int32_t victim = lru_.front();
  lru_.pop_front();
  forget_block(victim);
  device_.free_parked(victim);
  ++stats_.n_evictions;
  return device_.allocate();
}

void block_manager::acquire_cached(int32_t b) {
  if (device_.is_parked(b)) {
    lru_.erase(lru_pos_[(size_t)b]);
    device_.unpark(b);
  } else {
    device_.retain(b);
  }
}

void block_manager::release_device(int32_t b) {
  const bool keep = meta_[(size_t)b].registered;
  if (device_.release(b, keep) != 0) return;
  if (keep) lru_pos_[(size_t)b] = lru_.insert(lru_.end(), b);
  else forget_block(b);
}

// --- queries ------------------------------------------------------------------------------------

allocation_cost block_manager::cost_allocate(std::span<const token_id> prompt) const {
  const chain_hit hit = match_prefix(prompt);
  const int32_t n_total = kv_blocks_for((int64_t)prompt.size(), block_size_);
  const auto h = (int64_t)hit.blocks.size();
  allocation_cost c;
  c.n_cached_positions = h * block_size_;
  c.n_blocks = (int32_t)(n_total - h + (cover_to((int64_t)prompt.size(), h * block_size_, h) - h) * (groups_.n - 1)) + hit.n_parked;
  return c;
}

bool block_manager::can_allocate(std::span<const token_id> prompt) const {
  return !prompt.empty() && cost_allocate(prompt).n_blocks <= n_available_device();
}

int32_t block_manager::cost_append(uint64_t seq, int64_t n_new) const {
  const seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::cost_append: " + seq_name(seq) + " is swapped out");
  if (n_new < 0) return 0;
  int32_t cow = 0;
  if (n_new > 0 && e.n_positions % block_size_ != 0)
    for (const auto& t : e.tables) cow += t.back() >= 0 && device_.ref_count(t.back()) > 1;
  return growth(e, n_new) + cow;
}

std::vector<int32_t> block_manager::step_table(uint64_t seq, int64_t n_positions) const {
  const seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::step_table: " + seq_name(seq) + " is swapped out");
  const auto n = (size_t)kv_blocks_for(n_positions, block_size_);
  if (n > e.tables[0].size() || (groups_.n > 1 && (int64_t)n > e.n_covered))
    throw std::logic_error("block_manager::step_table: " + seq_name(seq) + " does not cover the step");
  std::vector<int32_t> out;
  out.reserve(n * e.tables.size());
  for (const auto& t : e.tables) out.insert(out.end(), t.begin(), t.begin() + (ptrdiff_t)n);
  return out;
}

int32_t block_manager::n_held(uint64_t seq) const {
  int32_t n = 0;
  for (const auto& t : get(seq).tables)
    for (int32_t b : t) n += b >= 0;
  return n;
}

namespace {
// Blocks a sliding group holds at most: those of [c - window + 1, c + step_tokens) for c
// computed positions (-1: every block of the sequence).
int32_t window_blocks(int block_size, kv_groups g) {
  return g.step_tokens > 0 ? kv_blocks_for(g.window + g.step_tokens - 1, block_size) + 1 : -1;
}
}  // namespace

int32_t block_manager::peak_blocks(int64_t n_positions) const { return kv_peak_blocks(n_positions, block_size_, groups_); }

int32_t kv_peak_blocks(int64_t n_positions, int block_size, kv_groups g) {
  const int32_t all = kv_blocks_for(n_positions, block_size);
  const int32_t live = window_blocks(block_size, g);
  return all + (live < 0 ? all : std::min(all, live)) * (g.n - 1);
}

int64_t kv_max_positions(int block_size, int32_t n_device, kv_groups g) {
  const int32_t live = window_blocks(block_size, g);
  if (g.n == 1 || live < 0) return (int64_t)(n_device / g.n) * block_size;
  // The most blocks b of group 0 with b + min(b, live) * (n - 1) <= n_device.
  const int32_t b = std::max(std::min(live, n_device / g.n), n_device - live * (g.n - 1));
  return (int64_t)b * block_size;
}

std::vector<std::vector<int32_t>> block_manager::swap_in_hits(const seq_entry& e) const {
  std::vector<std::vector<int32_t>> hits((size_t)groups_.n, std::vector<int32_t>(e.hashes.size(), -1));
  uint64_t parent_cid = 0;
  for (size_t j = 0; j < e.hashes.size(); ++j) {
    const auto toks = std::span(e.tokens).subspan(j * (size_t)block_size_, (size_t)block_size_);
    const int32_t b = find_cached(e.hashes[j], parent_cid, toks);
    hits[0][j] = b;
    // A hit may carry another id for the same content (recomputed after an eviction): follow it.
    parent_cid = b >= 0 ? meta_[(size_t)b].cid : e.cids[j];
    for (int g = 1; g < groups_.n; ++g)
      if (e.tables[(size_t)g][j] >= 0) hits[(size_t)g][j] = find_window(parent_cid, g);
  }
  return hits;
}

int32_t block_manager::cost_swap_in(uint64_t seq, int64_t n_extra) const {
  const seq_entry& e = get(seq);
  if (!e.swapped) throw std::logic_error("block_manager::cost_swap_in: " + seq_name(seq) + " is resident");
  int32_t n = n_held(seq) + growth(e, std::max<int64_t>(n_extra, 0));
  // Committed blocks still referenced in the cache cost nothing (parked ones still leave the pool).
  for (const auto& group : swap_in_hits(e))
    for (int32_t b : group)
      if (b >= 0 && !device_.is_parked(b)) --n;
  return n;
}

int32_t block_manager::n_exclusive(uint64_t seq) const {
  const seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::n_exclusive: " + seq_name(seq) + " is swapped out");
  int32_t n = 0;
  for (const auto& t : e.tables)
    for (int32_t b : t) n += b >= 0 && device_.ref_count(b) == 1 ? 1 : 0;
  return n;
}

// --- operations ---------------------------------------------------------------------------------

std::optional<int64_t> block_manager::allocate(uint64_t seq, std::span<const token_id> prompt) {
  if (prompt.empty()) throw std::invalid_argument("block_manager::allocate: empty prompt for " + seq_name(seq));
  if (has(seq)) throw std::logic_error("block_manager::allocate: " + seq_name(seq) + " already exists");
  ++stats_.n_lookups;
  stats_.n_lookup_tokens += (int64_t)prompt.size();
  chain_hit hit = match_prefix(prompt);
  const int32_t n_total = kv_blocks_for((int64_t)prompt.size(), block_size_);
  const auto h = (int32_t)hit.blocks.size();
  const int32_t n_fresh = n_total - h;
  const auto covered = (int32_t)cover_to((int64_t)prompt.size(), (int64_t)h * block_size_, h);
  if (n_fresh + (covered - h) * (groups_.n - 1) + hit.n_parked > n_available_device()) return std::nullopt;

  seq_entry e;
  e.tables.resize((size_t)groups_.n);
  // Hits first, so that the fresh allocations below cannot evict them.
  for (int32_t b : hit.blocks) {
    acquire_cached(b);
    e.tables[0].push_back(b);
  }
  for (int g = 1; g < groups_.n; ++g)
    for (int32_t b : hit.window[(size_t)g - 1]) {
      if (b >= 0) acquire_cached(b);
      e.tables[(size_t)g].push_back(b);
    }
  for (int32_t i = 0; i < n_fresh; ++i) e.tables[0].push_back(take_device_block());
  for (size_t g = 1; g < e.tables.size(); ++g)
    for (int32_t j = h; j < n_total; ++j) e.tables[g].push_back(j < covered ? take_device_block() : -1);
  e.n_positions = (int64_t)prompt.size();
  const int64_t n_cached = (int64_t)h * block_size_;
  e.n_computed = n_cached;
  e.n_covered = groups_.n > 1 ? covered : 0;
  e.hashes = std::move(hit.hashes);
  e.cids = std::move(hit.cids);
  e.tokens.assign(prompt.begin(), prompt.begin() + n_cached);
  seqs_.emplace(seq, std::move(e));
  stats_.n_hit_tokens += n_cached;
  return n_cached;
}

bool block_manager::append(uint64_t seq, int64_t n_new, std::vector<block_copy>& copies) {
  if (n_new < 0) throw std::invalid_argument("block_manager::append: negative position count");
  const int32_t cost = cost_append(seq, n_new);  // throws for unknown or swapped sequences
  if (cost > n_available_device()) return false;
  seq_entry& e = get(seq);
  for (auto& t : e.tables) {
    if (n_new == 0 || e.n_positions % block_size_ == 0 || t.back() < 0 || device_.ref_count(t.back()) == 1) continue;
    const int32_t old = t.back();
    const int32_t fresh = take_device_block();
    copies.push_back({block_copy::kind::device_to_device, old, fresh});
    release_device(old);  // still held by the other sharers
    t.back() = fresh;
    ++stats_.n_cow_copies;
  }
  const int32_t n_total = kv_blocks_for(e.n_positions + n_new, block_size_);
  while ((int32_t)e.tables[0].size() < n_total) e.tables[0].push_back(take_device_block());
  if (groups_.n > 1) {
    const int64_t covered = cover_to(e.n_positions + n_new, e.n_computed, e.n_covered);
    for (size_t g = 1; g < e.tables.size(); ++g) {
      e.tables[g].resize((size_t)n_total, -1);
      for (int64_t j = e.n_covered; j < covered; ++j) e.tables[g][(size_t)j] = take_device_block();
    }
    e.n_covered = covered;
  }
  e.n_positions += n_new;
  return true;
}

void block_manager::commit(uint64_t seq, std::span<const token_id> tokens) {
  seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::commit: " + seq_name(seq) + " is swapped out");
  if ((int64_t)tokens.size() > e.n_positions)
    throw std::logic_error("block_manager::commit: " + std::to_string(tokens.size()) + " tokens but " +
                           seq_name(seq) + " covers " + std::to_string(e.n_positions) + " positions");
  const size_t bs = (size_t)block_size_;
  const size_t n_full = tokens.size() / bs;
  if (n_full < e.hashes.size()) return;  // nothing new (e.g. a shorter view after a fork)
  e.n_computed = std::max(e.n_computed, (int64_t)tokens.size());
  if (!e.hashes.empty()) {
    // Cheap guard on the precondition: the last committed block is unchanged.
    const size_t j = e.hashes.size() - 1;
    if (!std::equal(e.tokens.begin() + (ptrdiff_t)(j * bs), e.tokens.end(), tokens.begin() + (ptrdiff_t)(j * bs)))
      throw std::logic_error("block_manager::commit: committed tokens of " + seq_name(seq) + " changed");
  }
  for (size_t j = e.hashes.size(); j < n_full; ++j) {
    const auto toks = tokens.subspan(j * bs, bs);
    const uint64_t parent_hash = j ? e.hashes[j - 1] : 0;
    const uint64_t parent_cid = j ? e.cids[j - 1] : 0;
    const uint64_t h = hash_(parent_hash, toks);
    const int32_t b = e.tables[0][j];
    uint64_t cid;
    if (meta_[(size_t)b].cid != 0) {
      // Shared with a sequence that committed it first (fork): same content by construction.
      if (meta_[(size_t)b].hash != h)
        throw std::logic_error("block_manager::commit: tokens of " + seq_name(seq) + " differ from its shared block");
      const block_meta& m = meta_[(size_t)b];
      cid = m.cid;
      if (!m.registered) identify_block(b, m.hash, m.cid, m.parent_cid, toks);  // if its hash is free by now
    } else if (const int32_t dup = find_cached(h, parent_cid, toks); dup >= 0) {
      // Computed twice (two requests prefilled the same prefix at once): keep the cached copy.
      acquire_cached(dup);
      e.tables[0][j] = dup;
      release_device(b);
      cid = meta_[(size_t)dup].cid;
      ++stats_.n_deduplicated;
    } else {
      cid = next_cid_++;
      identify_block(b, h, cid, parent_cid, toks);  // stays unregistered on a hash collision
    }
    for (int g = 1; g < groups_.n; ++g) {
      int32_t& w = e.tables[(size_t)g][j];  // in the window: committed blocks are at or after it
      if (w < 0)
        throw std::logic_error("block_manager::commit: " + seq_name(seq) + " computed positions its sliding groups do not hold (append before each step)");
      if (meta_[(size_t)w].cid != 0) continue;  // shared, identified by the sequence that committed it first
      if (const int32_t dup = find_window(cid, g); dup >= 0) {
        acquire_cached(dup);
        release_device(w);
        w = dup;
      } else {
        identify_window_block(w, g, cid);
      }
    }
    e.hashes.push_back(h);
    e.cids.push_back(cid);
    e.tokens.insert(e.tokens.end(), toks.begin(), toks.end());
  }
  trim(e);
}

void block_manager::trim(seq_entry& e) {
  const auto lo = (size_t)live_from(e.n_computed);
  for (size_t g = 1; g < e.tables.size(); ++g)
    for (size_t j = 0; j < lo && j < e.tables[g].size(); ++j)
      if (e.tables[g][j] >= 0) {
        release_device(e.tables[g][j]);  // a committed one stays cached
        e.tables[g][j] = -1;
      }
}

void block_manager::fork(uint64_t parent, uint64_t child) {
  const seq_entry& p = get(parent);
  if (p.swapped) throw std::logic_error("block_manager::fork: " + seq_name(parent) + " is swapped out");
  if (has(child)) throw std::logic_error("block_manager::fork: " + seq_name(child) + " already exists");
  seq_entry c = p;
  for (const auto& t : c.tables)
    for (int32_t b : t)
      if (b >= 0) device_.retain(b);
  seqs_.emplace(child, std::move(c));
}

void block_manager::free(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  seq_entry& e = it->second;
  for (const auto& t : e.tables) {
    if (e.swapped) {
      for (int32_t b : t)
        if (b >= 0) host_.release(b);
    } else {
      // Tail first: the LRU then evicts a chain's tail before its head.
      for (auto b = t.rbegin(); b != t.rend(); ++b)
        if (*b >= 0) release_device(*b);
    }
  }
  seqs_.erase(it);
}

bool block_manager::swap_out(uint64_t seq, std::vector<block_copy>& copies) {
  seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::swap_out: " + seq_name(seq) + " is already swapped out");
  const int32_t n = n_held(seq);
  if (n > host_.n_free()) return false;
  for (auto& t : e.tables) {
    std::vector<int32_t> host_table;
    host_table.reserve(t.size());
    for (int32_t b : t) {
      const int32_t h = b >= 0 ? host_.allocate() : -1;
      if (b >= 0) copies.push_back({block_copy::kind::device_to_host, b, h});
      host_table.push_back(h);
    }
    for (auto b = t.rbegin(); b != t.rend(); ++b)
      if (*b >= 0) release_device(*b);
    t = std::move(host_table);
  }
  e.swapped = true;
  stats_.n_swapped_out += n;
  return true;
}

bool block_manager::swap_in(uint64_t seq, std::vector<block_copy>& copies) {
  if (cost_swap_in(seq) > n_available_device()) return false;  // throws when not swapped
  seq_entry& e = get(seq);
  const size_t bs = (size_t)block_size_;
  const auto hits = swap_in_hits(e);
  std::vector<std::vector<int32_t>> dev;
  for (const auto& t : e.tables) dev.emplace_back(t.size(), -1);
  // Committed blocks still in the prefix cache come back without a copy; take them first so
  // the fresh allocations below cannot evict them.
  for (size_t g = 0; g < hits.size(); ++g)
    for (size_t j = 0; j < hits[g].size(); ++j) {
      const int32_t b = hits[g][j];
      if (b < 0) continue;
      acquire_cached(b);
      dev[g][j] = b;
      if (g == 0) e.cids[j] = meta_[(size_t)b].cid;
      ++stats_.n_swap_in_reused;
    }
  for (size_t g = 0; g < dev.size(); ++g)
    for (size_t j = 0; j < dev[g].size(); ++j) {
      if (dev[g][j] >= 0 || e.tables[g][j] < 0) continue;
      dev[g][j] = take_device_block();
      copies.push_back({block_copy::kind::host_to_device, e.tables[g][j], dev[g][j]});
      ++stats_.n_swapped_in;
      if (j >= e.hashes.size()) continue;
      if (g == 0) identify_block(dev[g][j], e.hashes[j], e.cids[j], j ? e.cids[j - 1] : 0, std::span(e.tokens).subspan(j * bs, bs));
      else identify_window_block(dev[g][j], (int)g, e.cids[j]);
    }
  for (const auto& t : e.tables)
    for (int32_t h : t)
      if (h >= 0) host_.release(h);
  e.tables = std::move(dev);
  e.swapped = false;
  return true;
}

void block_manager::clear_cache() {
  while (!lru_.empty()) {
    const int32_t b = lru_.front();
    lru_.pop_front();
    forget_block(b);
    device_.free_parked(b);
  }
}

// --- invariants ---------------------------------------------------------------------------------

std::string block_manager::check() const {
  const size_t bs = (size_t)block_size_;
  std::vector<int32_t> dev_refs((size_t)n_device(), 0), host_refs((size_t)n_host(), 0);
  for (const auto& [id, e] : seqs_) {
    const std::string who = seq_name(id);
    if ((int)e.tables.size() != groups_.n) return who + ": " + std::to_string(e.tables.size()) + " tables";
    if (e.cids.size() != e.hashes.size() || e.tokens.size() != e.hashes.size() * bs ||
        (int64_t)(e.hashes.size() * bs) > e.n_computed || e.n_computed > e.n_positions)
      return who + ": inconsistent committed blocks";
    auto& refs = e.swapped ? host_refs : dev_refs;
    const int64_t lo = live_from(e.n_computed);
    if (groups_.n > 1 && (e.n_covered > kv_blocks_for(e.n_positions, block_size_) || e.n_covered < kv_blocks_for(e.n_computed, block_size_)))
      return who + ": sliding groups cover " + std::to_string(e.n_covered) + " blocks";
    for (size_t g = 0; g < e.tables.size(); ++g) {
      const auto& t = e.tables[g];
      if ((int64_t)t.size() != (int64_t)kv_blocks_for(e.n_positions, block_size_))
        return who + ": table of " + std::to_string(t.size()) + " blocks for " + std::to_string(e.n_positions) + " positions";
      for (size_t j = 0; j < t.size(); ++j) {
        const int32_t b = t[j];
        if (g > 0 && (b < 0) != ((int64_t)j < lo || (int64_t)j >= e.n_covered))
          return who + ": group " + std::to_string(g) + " block " + std::to_string(j) + (b < 0 ? " missing from" : " held out of") +
                 " blocks [" + std::to_string(lo) + ", " + std::to_string(e.n_covered) + ")";
        if (b < 0 && g > 0) continue;
        if (b < 0 || b >= (int32_t)refs.size()) return who + ": block id " + std::to_string(b) + " out of range";
        ++refs[(size_t)b];
        if (e.swapped || j >= e.hashes.size()) continue;
        const block_meta& m = meta_[(size_t)b];
        if (m.cid != e.cids[j] || m.group != (int16_t)g || (g == 0 && m.hash != e.hashes[j]))
          return who + ": committed block " + std::to_string(b) + " holds another content";
      }
    }
  }
  int32_t n_ref = 0, n_free = 0, n_cached = 0;
  for (int32_t b = 0; b < n_device(); ++b) {
    const std::string blk = "device block " + std::to_string(b);
    const block_meta& m = meta_[(size_t)b];
    if (device_.ref_count(b) != dev_refs[(size_t)b])
      return blk + ": count " + std::to_string(device_.ref_count(b)) + ", held by " + std::to_string(dev_refs[(size_t)b]) + " tables";
    if (device_.is_parked(b) && !m.registered) return blk + ": cached but not registered";
    if (m.registered && m.group == 0) {
      auto it = cache_.find(m.hash);
      if (it == cache_.end() || it->second != b) return blk + ": registered but missing from the cache map";
      if (m.tokens.size() != bs) return blk + ": registered with " + std::to_string(m.tokens.size()) + " tokens";
    }
    if (m.registered && m.group != 0 && find_window(m.cid, m.group) != b) return blk + ": registered but missing from the window map";
    if (device_.is_free(b) && (m.cid != 0 || m.registered)) return blk + ": free but still identified";
    n_ref += dev_refs[(size_t)b] > 0;
    n_free += device_.is_free(b);
    n_cached += device_.is_parked(b);
  }
  for (const auto& [h, b] : cache_)
    if (b < 0 || b >= n_device() || !meta_[(size_t)b].registered || meta_[(size_t)b].group != 0 || meta_[(size_t)b].hash != h)
      return "cache map entry for block " + std::to_string(b) + " is stale";
  for (const auto& [k, b] : window_cache_)
    if (b < 0 || b >= n_device() || !meta_[(size_t)b].registered || meta_[(size_t)b].group == 0 ||
        window_key(meta_[(size_t)b].cid, meta_[(size_t)b].group) != k)
      return "window map entry for block " + std::to_string(b) + " is stale";
  if (n_free != device_.n_free()) return "device free list holds " + std::to_string(device_.n_free()) + ", counted " + std::to_string(n_free);
  if (n_cached != device_.n_parked() || (size_t)n_cached != lru_.size())
    return "device cached blocks: " + std::to_string(n_cached) + " parked, " + std::to_string(lru_.size()) + " in the LRU";
  for (int32_t b : lru_)
    if (!device_.is_parked(b)) return "device block " + std::to_string(b) + " in the LRU but not cached";
  if (n_ref + n_free + n_cached != n_device()) return "device pool: referenced + free + cached != total";
  int32_t h_ref = 0, h_free = 0;
  for (int32_t b = 0; b < n_host(); ++b) {
    if (host_.ref_count(b) != host_refs[(size_t)b])
      return "host block " + std::to_string(b) + ": count " + std::to_string(host_.ref_count(b)) + ", held by " +
             std::to_string(host_refs[(size_t)b]) + " tables";
    h_ref += host_refs[(size_t)b] > 0;
    h_free += host_.is_free(b);
  }
  if (h_free != host_.n_free() || h_ref + h_free != n_host()) return "host pool: referenced + free != total";
  return {};
}

}  // namespace troupe::engine
