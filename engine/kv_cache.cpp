#include "engine/kv_cache.hpp"

#include <algorithm>
#include <stdexcept>

namespace troupe::engine {

kv_shape make_kv_shape(const std::vector<bool>& sliding, int n_kv_heads, int head_dim, int block_size, int window,
                       bool grouped) {
  kv_shape s{(int)sliding.size(), n_kv_heads, head_dim, block_size};
  const int n_full = (int)std::count(sliding.begin(), sliding.end(), false);
  const int n_sliding = (int)sliding.size() - n_full;
  if (!grouped || window <= 0 || n_full == 0 || n_sliding == 0) return s;
  s.n_layers = n_full;
  s.n_groups = 1 + (n_sliding + n_full - 1) / n_full;
  s.window = window;
  int full = 0, slide = 0;
  for (bool w : sliding) {
    if (w) {
      s.slots.push_back({(int16_t)(1 + slide / n_full), (int16_t)(slide % n_full)});
      ++slide;
    } else {
      s.slots.push_back({0, (int16_t)full++});
    }
  }
  return s;
}

kv_storage::kv_storage(const kv_shape& shape, int32_t n_blocks)
    : shape_(shape), n_blocks_(n_blocks) {
  if (n_blocks <= 0 || shape.block_size <= 0) throw std::invalid_argument("kv_storage: empty cache");
  data_ = std::make_unique_for_overwrite<kernels::fp16_t[]>((size_t)(shape.block_elems() * n_blocks));
}

kernels::kv_layer_view kv_storage::layer(int il) {
  kernels::kv_layer_view v;
  const int64_t layer_elems = 2LL * shape_.block_size * shape_.row_elems();
  v.k_base = data_.get() + il * layer_elems;
  v.v_base = v.k_base + layer_elems / 2;
  v.block_stride = shape_.block_elems();
  v.block_size = shape_.block_size;
  v.n_kv_heads = shape_.n_kv_heads;
  v.head_dim = shape_.head_dim;
  v.slot_stride = shape_.head_dim;                                // head-major: [head][slot][dim]
  v.head_stride = (int64_t)shape_.block_size * shape_.head_dim;
  return v;
}

block_allocator::block_allocator(int32_t n_blocks) : refs_((size_t)n_blocks, 0), parked_((size_t)n_blocks, 0) {
  free_.reserve((size_t)n_blocks);
  for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t block_allocator::allocate() {
  if (free_.empty()) return -1;
  const int32_t b = free_.back();
  free_.pop_back();
  refs_[(size_t)b] = 1;
  return b;
}

void block_allocator::retain(int32_t b) {
  if (refs_.at((size_t)b) <= 0) throw std::logic_error("block_allocator::retain of an unreferenced block");
  ++refs_[(size_t)b];
}

int32_t block_allocator::release(int32_t b, bool park) {
  if (refs_.at((size_t)b) <= 0) throw std::logic_error("block_allocator::release of an unreferenced block");
  const int32_t left = --refs_[(size_t)b];
  if (left == 0) {
    if (park) {
      parked_[(size_t)b] = 1;
      ++n_parked_;
    } else {
      free_.push_back(b);
    }
  }
  return left;
}

void block_allocator::unpark(int32_t b) {
  if (parked_.at((size_t)b) == 0) throw std::logic_error("block_allocator::unpark of a block that is not parked");
  parked_[(size_t)b] = 0;
  --n_parked_;
  refs_[(size_t)b] = 1;
}

void block_allocator::free_parked(int32_t b) {
  if (parked_.at((size_t)b) == 0) throw std::logic_error("block_allocator::free_parked of a block that is not parked");
  parked_[(size_t)b] = 0;
  --n_parked_;
  free_.push_back(b);
}

}  // namespace troupe::engine
