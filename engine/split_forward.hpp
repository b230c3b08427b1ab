// The CPU forward with KV pools of its own, run whole or split — tensor, pipeline (of tensor-parallel
// groups, with both) or expert parallel (engine/tensor_parallel.hpp, engine/pipeline_parallel.hpp)
// — with the threads shared among the ranks and stages. What the executor's CPU backend and the generator drive.
//
//   split_forward fwd(model, {.tensor = 3}, kv_shape_of_the_model, n_blocks, n_host_blocks, n_threads);
//   const auto& logits = fwd.forward(batch);
//   fwd.for_each_kv([&](kv_storage& device, kv_storage& host) { ... block copies ... });
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "engine/kv_cache.hpp"
#include "engine/model.hpp"

namespace troupe::kernels {
class thread_pool;
}

namespace troupe::engine {

class tp_cpu_forward;
class pp_cpu_forward;

/// Ranks or stages of each kind of split: tensor and pipeline combine (each stage a group of
/// tensor-parallel ranks), expert parallel stands alone.
struct parallelism {
  int tensor = 1, pipeline = 1, expert = 1;
};

/// Empty when `m` runs split as `p` says, else why not (expert parallel combined, a shape that does not split).
std::string parallel_error(const model& m, const parallelism& p);

/// The bytes one block id takes over every rank or stage of `p` (what a KV budget is divided by):
/// the whole model's block, or more where ranks hold copies — tensor-parallel KV heads replicated
/// over ranks (N / n_kv_heads copies), expert parallel (every rank caches every layer's KV, its
/// attention being replicated: N copies).
int64_t split_block_bytes(const kv_shape& full, const parallelism& p);

class split_forward {
 public:
  /// `full`: the whole model's KV shape; each rank or stage holds n_blocks (and n_host_blocks)
  /// blocks of its share. Throws std::invalid_argument with parallel_error's text.
  split_forward(const model& m, const parallelism& p, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks, int n_threads);
  ~split_forward();
  split_forward(const split_forward&) = delete;
  split_forward& operator=(const split_forward&) = delete;

  /// As cpu_forward::forward.
  const std::vector<float>& forward(std::span<const seq_chunk> batch);
  /// Runs `fn(device pool, host pool)` on the KV storage of every rank or stage (block copies).
  void for_each_kv(const std::function<void(kv_storage& device, kv_storage& host)>& fn);

 private:
  std::unique_ptr<kernels::thread_pool> pool_;  // whole: its pool, pools and forward
  std::unique_ptr<kv_storage> device_, host_;
  std::unique_ptr<cpu_forward> fwd_;
  std::unique_ptr<tp_cpu_forward> tp_;  // tensor or expert parallel
  std::unique_ptr<pp_cpu_forward> pp_;  // pipeline parallel
};

}  // namespace troupe::engine
