// Prefix-aware routing across data-parallel replicas (the policy, no actor library): remember
// which replica last took each prompt prefix, so prompts that share a prefix (a system prompt, a
// few-shot header, a conversation so far) go where its KV is already cached, unless that replica
// is busier than the least loaded by more than a bound. SGLang's cache-aware router does the same
// with a radix tree per worker; here a prefix is named by the chain hash of its full KV blocks
// (engine::kv_block_hash, the prefix cache's own), so a prefix of k blocks is one table entry.
//
//   prefix_affinity a(65536);
//   auto hit = a.find(hashes, usable);   // (replica, matched blocks) of the deepest known prefix
//   a.record(hashes, chosen);            // every prefix of this prompt now points to `chosen`
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>

namespace troupe::actors {

class prefix_affinity {
 public:
  /// At most `capacity` prefixes are remembered (least recently routed forgotten first).
  explicit prefix_affinity(size_t capacity);

  /// The replica that last took the longest prefix of `hashes` (chain hashes of a prompt's full
  /// blocks, first block first) among those `usable` accepts, and the blocks matched.
  std::optional<std::pair<size_t, size_t>> find(std::span<const uint64_t> hashes, const std::function<bool(size_t)>& usable) const;
  /// Every prefix of `hashes` now points to `replica`, most recently used.
  void record(std::span<const uint64_t> hashes, size_t replica);
  /// Drops what points to `replica` (it was lost: its cache is gone with it).
  void forget(size_t replica);
  size_t size() const { return map_.size(); }

 private:
  using lru = std::list<uint64_t>;  // most recent first
  struct entry {
    size_t replica;
    lru::iterator pos;
  };
  size_t capacity_;
  lru order_;
  std::unordered_map<uint64_t, entry> map_;
};

}  // namespace troupe::actors
