// Paged KV cache storage and block bookkeeping (plain code; the KV-cache manager actor owns one).
//
// Storage: n_blocks blocks; block b holds, for each of its layers (every layer of the model, or
// one group's: below), K then V of block_size positions, each position n_kv_heads * head_dim
// fp16 values. A block is contiguous across its layers, so swapping one to host memory is a
// single copy. A sequence addresses its KV through a block
// table: position p lives in block table[p / block_size], slot p % block_size.
//
// Sliding-window layer groups (Gemma 3): a layer that attends to the last `window` positions
// only has no use for the KV before them. Its layers then live apart from the full-attention
// layers: group 0 holds the full-attention layers, each further group as many sliding-window
// layers (the last group padded), so every block has one size and one pool serves every group
// (vLLM's hybrid allocator). A sequence has one block table per group; a sliding group's table
// gives back the blocks that left the window (block_manager), group 0's keeps them all.
#pragma once

#include <cstdint>
#include <string>
#include <memory>
#include <vector>

#include "kernels/ggml_types.hpp"
#include "kernels/ops.hpp"

namespace troupe::engine {

/// Where a model layer's KV lives: its group's block table, and its slot inside each block.
struct kv_slot {
  int16_t group = 0;
  int16_t slot = 0;
  friend bool operator==(const kv_slot&, const kv_slot&) = default;
};

struct kv_shape {
  int n_layers = 0;     // layers in one block: the model's, or one group's
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;  // positions per block
  // Layer groups: empty (one group, model layer il in slot il), or one entry per model layer.
  std::vector<kv_slot> slots{};
  int n_groups = 1;     // group 0: full attention; groups 1..: sliding windows of `window`
  int window = 0;       // positions a sliding-window layer attends to, itself included

  int64_t row_elems() const { return (int64_t)n_kv_heads * head_dim; }
  /// Model layer il's group and slot.
  kv_slot slot_of(int il) const { return slots.empty() ? kv_slot{0, (int16_t)il} : slots[(size_t)il]; }
  /// fp16 elements in one block (all of its layers, K and V).
  int64_t block_elems() const { return (int64_t)n_layers * 2 * block_size * row_elems(); }
  int64_t block_bytes() const { return block_elems() * (int64_t)sizeof(kernels::fp16_t); }
};

/// The KV shape of a model whose layer il attends to a sliding window when sliding[il] (window
/// positions). With `grouped`, at least one sliding and one full-attention layer, and window > 0:
/// group 0 holds the full-attention layers, groups 1.. the sliding ones in layer order, as many
/// per block as group 0 has. Otherwise one group of every layer (the layout without windows).
kv_shape make_kv_shape(const std::vector<bool>& sliding, int n_kv_heads, int head_dim, int block_size, int window,
                       bool grouped);

/// The memory of a paged KV cache. Owns n_blocks blocks; says nothing about who uses them. The
/// memory is not initialised (every position is written before it is read), so the system
/// commits a block's pages when it is first written: an idle server with a large cache, or a
/// swap pool never swapped into, costs address space, not resident memory.
class kv_storage {
 public:
  kv_storage(const kv_shape& shape, int32_t n_blocks);
  const kv_shape& shape() const { return shape_; }
  int32_t n_blocks() const { return n_blocks_; }
  /// View of layer `il` over all blocks, as the attention kernel reads it.
  kernels::kv_layer_view layer(int il);
  /// Start of block b (block_elems() fp16 values), for copies (swap, copy-on-write).
  kernels::fp16_t* block_data(int32_t b) { return data_.get() + (int64_t)b * shape_.block_elems(); }

 private:
  kv_shape shape_;
  int32_t n_blocks_;
  std::unique_ptr<kernels::fp16_t[]> data_;
};

/// Reference-counted block ids over [0, n_blocks): allocate, share (fork), release.
/// A block returns to the free list when its count reaches zero. Freed blocks are reused LIFO.
/// A block whose count reaches zero may instead be *parked*: held at count 0 by the caller (a
/// prefix cache keeps computed blocks this way) until it is unparked (a cache hit) or freed
/// (an eviction). Each block is in exactly one state: free, referenced (count > 0) or parked.
class block_allocator {
 public:
  explicit block_allocator(int32_t n_blocks);
  /// A free block with count 1, or -1 when none is free.
  int32_t allocate();
  /// Adds a reference (copy-on-write sharing). Precondition: b is referenced.
  void retain(int32_t b);
  /// Drops a reference and returns the count left. At zero the block goes to the free list, or
  /// is parked when `park` is true. Precondition: b is referenced.
  int32_t release(int32_t b, bool park = false);
  /// Takes a parked block back with count 1. Precondition: b is parked.
  void unpark(int32_t b);
  /// Returns a parked block to the free list. Precondition: b is parked.
  void free_parked(int32_t b);
  int32_t ref_count(int32_t b) const { return refs_.at(b); }
  bool is_parked(int32_t b) const { return parked_.at(b) != 0; }
  bool is_free(int32_t b) const { return refs_.at(b) == 0 && parked_.at(b) == 0; }
  int32_t n_free() const { return (int32_t)free_.size(); }
  int32_t n_parked() const { return n_parked_; }
  int32_t n_blocks() const { return (int32_t)refs_.size(); }

 private:
  std::vector<int32_t> refs_;
  std::vector<uint8_t> parked_;
  std::vector<int32_t> free_;
  int32_t n_parked_ = 0;
};

/// Blocks needed to hold n_positions positions.
inline int32_t kv_blocks_for(int64_t n_positions, int block_size) {
  return (int32_t)((n_positions + block_size - 1) / block_size);
}

}  // namespace troupe::engine
