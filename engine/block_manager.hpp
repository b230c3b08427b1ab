// KV block bookkeeping for the serving runtime: which device and host blocks each sequence holds,
// the prefix cache over computed full blocks, copy-on-write and swap. Plain code, no I/O and no
// actor library; the KV-cache manager actor owns one, the scheduler core plans with it.
//
// Contract
// - Two pools of block ids: device [0, n_device) and host [0, n_host), each a block_allocator.
//   This class never touches KV memory: operations that need data moved append block_copy ops
//   to a caller's list, and the executor performs them IN LIST ORDER before the next forward
//   (a block freed by one op may be the target of a later op in the same list).
// - A sequence (uint64_t id) is resident (its table holds device ids) or swapped (host ids).
//   Its table covers positions [0, n_positions): position p lives in table[p / block_size].
// - Prefix cache: a full block whose KV is computed (see commit) is registered under
//   hash(parent block's hash, the block's tokens). Lookups walk a prompt's full blocks from the
//   start and verify each hit's tokens and parent identity, so a hash collision can never hand
//   out wrong KV. A registered block whose last reference goes stays cached (parked at count 0)
//   and is evicted least recently released first, only when a fresh block is needed and the free
//   list is empty. A sequence's tail blocks are released before its head, so they go first.
// - Sliding-window groups (kv_groups, kv_cache.hpp's layout): a sequence has one table per
//   group, all over the one device pool. Group 0 (full attention) holds a block for every
//   position; a sliding group only for [n_computed - window + 1, n_computed + step_tokens): its
//   block j is given back once no position still to compute attends to it (commit: every
//   position of the block < n_computed - window + 1), and the blocks ahead are taken as the
//   computed positions advance (append, also of 0 positions: cost_append counts them, so a
//   scheduler plans them as any growth). Entries outside read -1. A sliding
//   group's committed block is cached under group 0's content id of the same block (that id
//   already names the whole prefix), so a prefix hit needs, in every sliding group, the blocks of
//   the window before the hit, and is shortened until it has them.
// - Every failing operation returns false / nullopt and leaves no trace. Misuse (unknown or
//   duplicate sequence id, resident/swapped mismatch) throws std::logic_error.
// - Invariant (check()): each block's count equals the number of tables holding it; a block at
//   count 0 is free, or cached (registered, parked, in the LRU); free + referenced + cached equals
//   the pool size in each pool; a sliding group's entry is -1 exactly for the blocks out of the
//   window.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/kv_cache.hpp"
#include "engine/tokenizer.hpp"

namespace troupe::engine {

/// One block copy the executor performs before the step's forward.
struct block_copy {
  enum class kind : uint8_t { device_to_host, host_to_device, device_to_device };
  kind dir = kind::device_to_device;
  int32_t src = -1;
  int32_t dst = -1;
  friend bool operator==(const block_copy&, const block_copy&) = default;
};

/// Chain hash of a full block: 64-bit, from the parent block's hash (0 for the first block)
/// and the block's token ids. Stable across processes (usable for prefix-aware routing).
uint64_t kv_block_hash(uint64_t parent_hash, std::span<const token_id> tokens);
using block_hash_fn = uint64_t (*)(uint64_t parent_hash, std::span<const token_id> tokens);

struct block_manager_stats {
  int64_t n_lookups = 0;           // allocate() calls
  int64_t n_lookup_tokens = 0;     // prompt tokens offered to the cache
  int64_t n_hit_tokens = 0;        // of them, served from cached blocks
  int64_t n_evictions = 0;         // cached blocks dropped for a fresh allocation
  int64_t n_cow_copies = 0;        // copy-on-write copies
  int64_t n_deduplicated = 0;      // committed blocks replaced by an identical cached one
  int64_t n_swapped_out = 0;       // blocks copied device -> host
  int64_t n_swapped_in = 0;        // blocks copied host -> device
  int64_t n_swap_in_reused = 0;    // blocks a swap-in took from the prefix cache instead
};

/// Layer groups of the KV (kv_shape::n_groups, window): group 0 full attention, groups 1..n-1
/// sliding windows of `window` positions. step_tokens: the most positions one step computes for
/// a sequence (a scheduler's token budget); the sliding groups hold blocks that far past the
/// computed positions (0: to the end of the sequence, a whole prompt from its allocation).
struct kv_groups {
  int n = 1;
  int window = 0;
  int step_tokens = 0;
};

/// Positions one sequence with a short prompt can reach in a pool of n_device blocks (every
/// group's blocks counted, block_manager::peak_blocks).
int64_t kv_max_positions(int block_size, int32_t n_device, kv_groups groups);

/// Blocks (every group) one sequence of n_positions positions holds at most: block_manager::peak_blocks.
int32_t kv_peak_blocks(int64_t n_positions, int block_size, kv_groups groups);

/// What allocate() would do for a prompt, without doing it.
struct allocation_cost {
  int64_t n_cached_positions = 0;  // leading positions served by cached blocks
  int32_t n_blocks = 0;            // blocks taken from the free + evictable pool
};

class block_manager {
 public:
  /// block_size > 0 positions per block; n_device > 0, n_host >= 0 blocks. `hash` is replaceable
  /// for tests (a degenerate hash must cost hits, never correctness).
  block_manager(int block_size, int32_t n_device, int32_t n_host, block_hash_fn hash = kv_block_hash,
                kv_groups groups = {});

  int block_size() const { return block_size_; }
  int n_groups() const { return groups_.n; }
  const kv_groups& groups() const { return groups_; }
  int32_t n_device() const { return device_.n_blocks(); }
  int32_t n_host() const { return host_.n_blocks(); }
  /// Device blocks on the free list (cached blocks excluded).
  int32_t n_free_device() const { return device_.n_free(); }
  /// Unreferenced cached device blocks (evictable).
  int32_t n_cached() const { return device_.n_parked(); }
  /// Device blocks a fresh allocation can get: free + evictable.
  int32_t n_available_device() const { return device_.n_free() + device_.n_parked(); }
  int32_t n_free_host() const { return host_.n_free(); }
  /// Fraction of device blocks referenced by some table, in [0, 1].
  double usage() const;
  const block_manager_stats& stats() const { return stats_; }

  // --- queries (const) ---
  bool has(uint64_t seq) const { return seqs_.count(seq) != 0; }
  bool is_swapped(uint64_t seq) const { return get(seq).swapped; }
  int64_t n_positions(uint64_t seq) const { return get(seq).n_positions; }
  /// The sequence's table of a group: device ids when resident, host ids when swapped; -1 for a
  /// sliding group's blocks out of the window.
  std::span<const int32_t> table(uint64_t seq, int group = 0) const { return get(seq).tables.at((size_t)group); }
  /// The block tables a step over positions [0, n_positions) of a resident sequence reads: each
  /// group's first kv_blocks_for(n_positions) entries, group after group (seq_chunk's layout).
  std::vector<int32_t> step_table(uint64_t seq, int64_t n_positions) const;
  /// Blocks the sequence holds in its pool (every group): what a swap-out takes on the host.
  int32_t n_held(uint64_t seq) const;
  /// Device blocks a lone sequence of n_positions positions needs at most, from its admission on.
  int32_t peak_blocks(int64_t n_positions) const;
  /// kv_max_positions of this pool.
  int64_t max_positions() const { return kv_max_positions(block_size_, n_device(), groups_); }
  /// Full blocks of this sequence committed as computed.
  int32_t n_committed_blocks(uint64_t seq) const { return (int32_t)get(seq).hashes.size(); }
  /// Prefix hits and blocks allocate(prompt) would take (exact for one call on today's state).
  allocation_cost cost_allocate(std::span<const token_id> prompt) const;
  bool can_allocate(std::span<const token_id> prompt) const;
  /// Fresh device blocks append(seq, n_new) needs, copy-on-write and the sliding groups' blocks
  /// ahead included (which may make it > 0 for n_new == 0). Resident only.
  int32_t cost_append(uint64_t seq, int64_t n_new) const;
  /// Device blocks swap_in(seq) then append(seq, n_extra) need at most. Swapped only.
  int32_t cost_swap_in(uint64_t seq, int64_t n_extra = 0) const;
  /// Device blocks held by this sequence alone (freed by free/swap_out). Resident only.
  int32_t n_exclusive(uint64_t seq) const;

  // --- operations ---
  /// New resident sequence covering prompt.size() > 0 positions. Reuses the longest chain of
  /// cached full blocks matching the prompt, leaving at least the last prompt token to compute.
  /// Returns the number of cached positions (the prefill starts there), or nullopt when not
  /// enough blocks are available (nothing changed). Throws if seq exists or prompt is empty.
  std::optional<int64_t> allocate(uint64_t seq, std::span<const token_id> prompt);
  /// Grows a resident sequence's table by n_new >= 0 positions. When the last block is partly
  /// filled and shared it is first copied (copy-on-write; a device_to_device op is appended).
  /// The sliding groups take their blocks up to step_tokens past the computed positions. Call it
  /// (n_new may be 0) before every step of the sequence. Returns false when out of blocks
  /// (nothing changed).
  bool append(uint64_t seq, int64_t n_new, std::vector<block_copy>& copies);
  /// Marks positions [0, tokens.size()) of a resident sequence as computed: full blocks among
  /// them become cacheable. tokens: the ids at those positions (prompt then generated); the
  /// already-committed prefix must be unchanged. tokens.size() <= n_positions(seq). A block
  /// whose content is already cached in another block is replaced by that one in the table
  /// (the duplicate is released), so the table may change: read it again before the next step.
  void commit(uint64_t seq, std::span<const token_id> tokens);
  /// A new resident sequence sharing every block of resident `parent` (copy-on-write).
  void fork(uint64_t parent, uint64_t child);
  /// Drops the sequence (resident or swapped). Cached blocks stay cached. Unknown ids: no-op.
  void free(uint64_t seq);
  /// Moves a resident sequence to fresh host blocks (device_to_host ops, one per table entry)
  /// and drops its device references. Returns false when the host pool is short.
  bool swap_out(uint64_t seq, std::vector<block_copy>& copies);
  /// Brings a swapped sequence back: committed blocks still in the prefix cache are reused, the
  /// rest copied to fresh device blocks (host_to_device ops). Host blocks are freed. Returns
  /// false when the device pool is short.
  bool swap_in(uint64_t seq, std::vector<block_copy>& copies);
  /// Evicts every unreferenced cached block (back to the free list).
  void clear_cache();

  /// Empty when every invariant holds, else a description of the first violation.
  std::string check() const;

 private:
  struct seq_entry {
    bool swapped = false;
    std::vector<std::vector<int32_t>> tables;  // per group
    int64_t n_positions = 0;
    int64_t n_computed = 0;  // positions committed as computed (the sliding windows follow it)
    int64_t n_covered = 0;   // sliding groups: blocks taken up to this one (exclusive)
    // The committed full blocks (their KV computed): chain hash, content id, tokens.
    std::vector<uint64_t> hashes;
    std::vector<uint64_t> cids;
    std::vector<token_id> tokens;  // hashes.size() * block_size ids
  };
  // What a device block holds. cid != 0 once its content is a committed full block; such a
  // block is registered (findable in cache_, or window_cache_ for a sliding group's) unless
  // another block held that hash (group and content id) first.
  struct block_meta {
    bool registered = false;
    int16_t group = 0;
    uint64_t hash = 0;
    uint64_t cid = 0;         // content id: one per distinct (parent content, tokens)
    uint64_t parent_cid = 0;  // 0: the first block of a sequence
    std::vector<token_id> tokens;  // registered blocks only
  };
  struct chain_hit {
    std::vector<int32_t> blocks;
    std::vector<uint64_t> hashes, cids;
    std::vector<std::vector<int32_t>> window;  // per sliding group g: window[g - 1][j], -1 before the window
    int32_t n_parked = 0;  // hits that are unreferenced (leave the evictable pool)
  };
  const seq_entry& get(uint64_t seq) const;
  seq_entry& get(uint64_t seq);
  /// The registered block holding (hash, parent_cid, tokens), or -1.
  int32_t find_cached(uint64_t hash, uint64_t parent_cid, std::span<const token_id> tokens) const;
  chain_hit match_prefix(std::span<const token_id> prompt) const;
  /// First block of a sliding group still attended to once n_computed positions are computed.
  int64_t live_from(int64_t n_computed) const;
  /// Blocks the sliding groups cover once n_positions positions are held, n_computed computed.
  int64_t cover_to(int64_t n_positions, int64_t n_computed, int64_t covered) const;
  /// Fresh blocks (copy-on-write aside) for n_new more positions of e, every group.
  int32_t growth(const seq_entry& e, int64_t n_new) const;
  /// The cached block of sliding group g for the block whose group-0 content id is cid, or -1.
  int32_t find_window(uint64_t cid, int g) const;
  static uint64_t window_key(uint64_t cid, int g) { return cid * 256 + (uint64_t)g; }
  /// Gives back the sliding groups' blocks that left the window of e.n_computed.
  void trim(seq_entry& e);
  /// A device block with count 1: from the free list, else by evicting the LRU cached block.
  int32_t take_device_block();
  /// A cached block gets one more reference (unparked if it was unreferenced).
  void acquire_cached(int32_t b);
  void release_device(int32_t b);
  /// Per group and committed block of a swapped sequence: the cached device block to reuse, or -1.
  std::vector<std::vector<int32_t>> swap_in_hits(const seq_entry& e) const;
  /// Records a committed block's content; registers it when its hash is not taken.
  void identify_block(int32_t b, uint64_t hash, uint64_t cid, uint64_t parent_cid, std::span<const token_id> tokens);
  /// Records sliding group g's block b as the one of the committed block named cid.
  void identify_window_block(int32_t b, int g, uint64_t cid);
  /// Forgets a block's content (it returns to the free list).
  void forget_block(int32_t b);

  int block_size_;
  block_hash_fn hash_;
  block_allocator device_, host_;
  std::unordered_map<uint64_t, seq_entry> seqs_;
  std::vector<block_meta> meta_;                 // per device block
  kv_groups groups_;
  std::unordered_map<uint64_t, int32_t> cache_;  // hash -> registered device block (group 0)
  std::unordered_map<uint64_t, int32_t> window_cache_;  // window_key(cid, group) -> registered block
  std::list<int32_t> lru_;                       // unreferenced cached blocks, oldest first
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  uint64_t next_cid_ = 1;
  block_manager_stats stats_;
};

}  // namespace troupe::engine
