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

block_manager::block_manager(int block_size, int32_t n_device, int32_t n_host, block_hash_fn hash)
    : block_size_(block_size),
      hash_(hash ? hash : kv_block_hash),
      device_(n_device > 0 ? n_device : throw std::invalid_argument("block_manager: n_device must be > 0")),
      host_(n_host >= 0 ? n_host : throw std::invalid_argument("block_manager: n_host must be >= 0")),
      meta_((size_t)n_device),
      lru_pos_((size_t)n_device) {
  if (block_size <= 0) throw std::invalid_argument("block_manager: block_size must be > 0");
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
  return hit;
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

void block_manager::forget_block(int32_t b) {
  block_meta& m = meta_[(size_t)b];
  if (m.registered) {
    auto it = cache_.find(m.hash);
    if (it != cache_.end() && it->second == b) cache_.erase(it);
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
  allocation_cost c;
  c.n_cached_positions = (int64_t)hit.blocks.size() * block_size_;
  c.n_blocks = n_total - (int32_t)hit.blocks.size() + hit.n_parked;
  return c;
}

bool block_manager::can_allocate(std::span<const token_id> prompt) const {
  return !prompt.empty() && cost_allocate(prompt).n_blocks <= n_available_device();
}

int32_t block_manager::cost_append(uint64_t seq, int64_t n_new) const {
  const seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::cost_append: " + seq_name(seq) + " is swapped out");
  if (n_new <= 0) return 0;
  const int32_t fresh = kv_blocks_for(e.n_positions + n_new, block_size_) - (int32_t)e.table.size();
  const bool cow = e.n_positions % block_size_ != 0 && device_.ref_count(e.table.back()) > 1;
  return fresh + (cow ? 1 : 0);
}

std::vector<int32_t> block_manager::swap_in_hits(const seq_entry& e) const {
  std::vector<int32_t> hits(e.hashes.size(), -1);
  uint64_t parent_cid = 0;
  for (size_t j = 0; j < e.hashes.size(); ++j) {
    const auto toks = std::span(e.tokens).subspan(j * (size_t)block_size_, (size_t)block_size_);
    hits[j] = find_cached(e.hashes[j], parent_cid, toks);
    // A hit may carry another id for the same content (recomputed after an eviction): follow it.
    parent_cid = hits[j] >= 0 ? meta_[(size_t)hits[j]].cid : e.cids[j];
  }
  return hits;
}

int32_t block_manager::cost_swap_in(uint64_t seq, int64_t n_extra) const {
  const seq_entry& e = get(seq);
  if (!e.swapped) throw std::logic_error("block_manager::cost_swap_in: " + seq_name(seq) + " is resident");
  int32_t n = kv_blocks_for(e.n_positions + std::max<int64_t>(n_extra, 0), block_size_);
  // Committed blocks still referenced in the cache cost nothing (parked ones still leave the pool).
  for (int32_t b : swap_in_hits(e))
    if (b >= 0 && !device_.is_parked(b)) --n;
  return n;
}

int32_t block_manager::n_exclusive(uint64_t seq) const {
  const seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::n_exclusive: " + seq_name(seq) + " is swapped out");
  int32_t n = 0;
  for (int32_t b : e.table) n += device_.ref_count(b) == 1 ? 1 : 0;
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
  const int32_t n_fresh = n_total - (int32_t)hit.blocks.size();
  if (n_fresh + hit.n_parked > n_available_device()) return std::nullopt;

  seq_entry e;
  e.table.reserve((size_t)n_total);
  // Hits first, so that the fresh allocations below cannot evict them.
  for (int32_t b : hit.blocks) {
    acquire_cached(b);
    e.table.push_back(b);
  }
  for (int32_t i = 0; i < n_fresh; ++i) e.table.push_back(take_device_block());
  e.n_positions = (int64_t)prompt.size();
  const int64_t n_cached = (int64_t)hit.blocks.size() * block_size_;
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
  if (n_new == 0) return true;
  if (cost > n_available_device()) return false;
  seq_entry& e = get(seq);
  if (e.n_positions % block_size_ != 0 && device_.ref_count(e.table.back()) > 1) {
    const int32_t old = e.table.back();
    const int32_t fresh = take_device_block();
    copies.push_back({block_copy::kind::device_to_device, old, fresh});
    release_device(old);  // still held by the other sharers
    e.table.back() = fresh;
    ++stats_.n_cow_copies;
  }
  const int32_t n_total = kv_blocks_for(e.n_positions + n_new, block_size_);
  while ((int32_t)e.table.size() < n_total) e.table.push_back(take_device_block());
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
    const int32_t b = e.table[j];
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
      e.table[j] = dup;
      release_device(b);
      cid = meta_[(size_t)dup].cid;
      ++stats_.n_deduplicated;
    } else {
      cid = next_cid_++;
      identify_block(b, h, cid, parent_cid, toks);  // stays unregistered on a hash collision
    }
    e.hashes.push_back(h);
    e.cids.push_back(cid);
    e.tokens.insert(e.tokens.end(), toks.begin(), toks.end());
  }
}

void block_manager::fork(uint64_t parent, uint64_t child) {
  const seq_entry& p = get(parent);
  if (p.swapped) throw std::logic_error("block_manager::fork: " + seq_name(parent) + " is swapped out");
  if (has(child)) throw std::logic_error("block_manager::fork: " + seq_name(child) + " already exists");
  seq_entry c = p;
  for (int32_t b : c.table) device_.retain(b);
  seqs_.emplace(child, std::move(c));
}

void block_manager::free(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  seq_entry& e = it->second;
  if (e.swapped) {
    for (int32_t b : e.table) host_.release(b);
  } else {
    // Tail first: the LRU then evicts a chain's tail before its head.
    for (auto b = e.table.rbegin(); b != e.table.rend(); ++b) release_device(*b);
  }
  seqs_.erase(it);
}

bool block_manager::swap_out(uint64_t seq, std::vector<block_copy>& copies) {
  seq_entry& e = get(seq);
  if (e.swapped) throw std::logic_error("block_manager::swap_out: " + seq_name(seq) + " is already swapped out");
  if ((int32_t)e.table.size() > host_.n_free()) return false;
  std::vector<int32_t> host_table;
  host_table.reserve(e.table.size());
  for (int32_t b : e.table) {
    const int32_t h = host_.allocate();
    copies.push_back({block_copy::kind::device_to_host, b, h});
    host_table.push_back(h);
  }
  for (auto b = e.table.rbegin(); b != e.table.rend(); ++b) release_device(*b);
  e.table = std::move(host_table);
  e.swapped = true;
  stats_.n_swapped_out += (int64_t)e.table.size();
  return true;
}

bool block_manager::swap_in(uint64_t seq, std::vector<block_copy>& copies) {
  if (cost_swap_in(seq) > n_available_device()) return false;  // throws when not swapped
  seq_entry& e = get(seq);
  const size_t bs = (size_t)block_size_;
  const std::vector<int32_t> hits = swap_in_hits(e);
  std::vector<int32_t> dev(e.table.size(), -1);
  // Committed blocks still in the prefix cache come back without a copy; take them first so
  // the fresh allocations below cannot evict them.
  for (size_t j = 0; j < hits.size(); ++j) {
    if (hits[j] < 0) continue;
    acquire_cached(hits[j]);
    dev[j] = hits[j];
    e.cids[j] = meta_[(size_t)hits[j]].cid;
    ++stats_.n_swap_in_reused;
  }
  for (size_t j = 0; j < dev.size(); ++j) {
    if (dev[j] >= 0) continue;
    dev[j] = take_device_block();
    copies.push_back({block_copy::kind::host_to_device, e.table[j], dev[j]});
    ++stats_.n_swapped_in;
    if (j < e.hashes.size())
      identify_block(dev[j], e.hashes[j], e.cids[j], j ? e.cids[j - 1] : 0, std::span(e.tokens).subspan(j * bs, bs));
  }
  for (int32_t h : e.table) host_.release(h);
  e.table = std::move(dev);
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
    if ((int64_t)e.table.size() != (int64_t)kv_blocks_for(e.n_positions, block_size_))
      return who + ": table of " + std::to_string(e.table.size()) + " blocks for " + std::to_string(e.n_positions) + " positions";
    if (e.cids.size() != e.hashes.size() || e.tokens.size() != e.hashes.size() * bs ||
        (int64_t)(e.hashes.size() * bs) > e.n_positions)
      return who + ": inconsistent committed blocks";
    auto& refs = e.swapped ? host_refs : dev_refs;
    for (size_t j = 0; j < e.table.size(); ++j) {
      const int32_t b = e.table[j];
      if (b < 0 || b >= (int32_t)refs.size()) return who + ": block id " + std::to_string(b) + " out of range";
      ++refs[(size_t)b];
      if (!e.swapped && j < e.hashes.size() && (meta_[(size_t)b].cid != e.cids[j] || meta_[(size_t)b].hash != e.hashes[j]))
        return who + ": committed block " + std::to_string(b) + " holds another content";
    }
  }
  int32_t n_ref = 0, n_free = 0, n_cached = 0;
  for (int32_t b = 0; b < n_device(); ++b) {
    const std::string blk = "device block " + std::to_string(b);
    const block_meta& m = meta_[(size_t)b];
    if (device_.ref_count(b) != dev_refs[(size_t)b])
      return blk + ": count " + std::to_string(device_.ref_count(b)) + ", held by " + std::to_string(dev_refs[(size_t)b]) + " tables";
    if (device_.is_parked(b) && !m.registered) return blk + ": cached but not registered";
    if (m.registered) {
      auto it = cache_.find(m.hash);
      if (it == cache_.end() || it->second != b) return blk + ": registered but missing from the cache map";
      if (m.tokens.size() != bs) return blk + ": registered with " + std::to_string(m.tokens.size()) + " tokens";
    }
    if (device_.is_free(b) && (m.cid != 0 || m.registered)) return blk + ": free but still identified";
    n_ref += dev_refs[(size_t)b] > 0;
    n_free += device_.is_free(b);
    n_cached += device_.is_parked(b);
  }
  for (const auto& [h, b] : cache_)
    if (b < 0 || b >= n_device() || !meta_[(size_t)b].registered || meta_[(size_t)b].hash != h)
      return "cache map entry for block " + std::to_string(b) + " is stale";
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
