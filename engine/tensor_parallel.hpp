// Tensor parallelism (Megatron-LM's split) on the CPU backend, through the communicator interface
// a GPU build would back with NCCL:
//   - Q, K, V and the gate/up projections are split by output rows: each rank has n_heads / N
//     query heads, n_kv_heads / N KV heads (and their KV cache) and d_ff / N feed-forward columns;
//     with fewer KV heads than ranks (N a multiple of n_kv_heads), each KV head is replicated on
//     the N / n_kv_heads ranks whose query heads read it (vLLM's rule): every rank computes and
//     caches that one head, so the cache costs N / n_kv_heads times the unsplit one;
//   - O and down are split by input columns, so each rank's product is a partial sum of the full
//     one, completed by one all-reduce per block (two per layer);
//   - embeddings, norms and the output head are replicated; rank 0 computes the logits.
// Slices are views into the model's mapped weights (nothing is copied), cut at the weight type's
// block boundaries, so a quantized row's blocks stay whole.
//
//   tp_cpu_forward tp(model, 3, kv_shape_of_the_model, n_blocks, threads_per_rank);
//   const auto& logits = tp.forward(batch);   // as cpu_forward::forward; ranks run on their threads
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "engine/communicator.hpp"
#include "engine/forward.hpp"
#include "engine/model.hpp"

namespace troupe::kernels {
class thread_pool;
}

namespace troupe::engine {

/// One rank's share of a model: its hyperparameters (n_heads, n_kv_heads, d_ff of the rank) and
/// per-layer weights (views into the model's).
struct model_shard {
  int rank = 0, n_ranks = 1;
  bool split_attention = true;  // false: expert parallel (attention replicated, the experts split)
  model_hparams hp;
  std::vector<layer_weights> layers;
};

/// Empty when `m` splits into `n_ranks` shards, else why not (heads not divisible, KV heads
/// neither divisible nor dividing n_ranks, a slice not a whole number of quantization blocks).
std::string tensor_parallel_error(const model& m, int n_ranks);

/// Rank `rank` of `n_ranks`. Throws std::invalid_argument with tensor_parallel_error's text.
model_shard shard_model(const model& m, int rank, int n_ranks);

/// KV heads each of n_ranks holds: n_kv_heads / n_ranks, or 1 where they are replicated.
int kv_heads_per_rank(int n_kv_heads, int n_ranks);
/// The KV shape of one rank: its KV heads only (kv_heads_per_rank).
kv_shape shard_kv_shape(const kv_shape& full, int n_ranks);

/// Expert parallelism for a mixture-of-experts model: each rank holds n_experts / N experts of
/// every layer and runs the rest (attention, router, norms) replicated; a layer's output is the
/// all-reduced sum of the ranks' experts' contributions. Empty when `m` splits, else why not.
std::string expert_parallel_error(const model& m, int n_ranks);
/// Rank `rank` of `n_ranks` experts. Throws std::invalid_argument with expert_parallel_error's text.
model_shard shard_experts(const model& m, int rank, int n_ranks);

enum class parallel_split : uint8_t { tensor, expert };

/// N ranks of the CPU forward, each on its own thread with its own kernel thread pool and KV
/// storage (device and host pools of its KV heads), joined by a local_group. One step at a time.
class tp_cpu_forward {
 public:
  /// `full`: the unsharded KV shape; every rank holds n_blocks (and n_host_blocks) blocks of its share.
  /// `split`: heads and feed-forward columns (tensor), or experts (expert; each rank then holds
  /// the whole KV cache, its attention being replicated).
  /// `layers`: a pipeline stage's [begin, end) (end -1: the last layer), `full` then the shape of
  /// those layers' KV (a tensor-parallel group as one stage of a pipeline).
  tp_cpu_forward(const model& m, int n_ranks, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks, int threads_per_rank,
                 parallel_split split = parallel_split::tensor, std::pair<int, int> layers = {0, -1});
  ~tp_cpu_forward();
  tp_cpu_forward(const tp_cpu_forward&) = delete;
  tp_cpu_forward& operator=(const tp_cpu_forward&) = delete;

  /// As cpu_forward::forward (rank 0's logits). A rank's exception is rethrown here, after every
  /// rank has stopped; the group is then unusable (build a new one).
  const std::vector<float>& forward(std::span<const seq_chunk> batch) { return forward(batch, nullptr); }
  /// A pipeline stage's step (cpu_forward's): every rank reads `hidden`, rank 0 writes it.
  const std::vector<float>& forward(std::span<const seq_chunk> batch, std::vector<float>* hidden);
  /// Runs `fn(rank's device pool, rank's host pool)` on every rank (block copies: swap,
  /// copy-on-write), on the calling thread.
  void for_each_kv(const std::function<void(kv_storage& device, kv_storage& host)>& fn);
  int n_ranks() const { return (int)ranks_.size(); }

 private:
  struct rank_state;
  void worker(rank_state& r);

  std::unique_ptr<local_group> group_;
  std::vector<std::unique_ptr<rank_state>> ranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::span<const seq_chunk> batch_;
  std::vector<float>* hidden_ = nullptr;
  uint64_t step_ = 0;
  int done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace troupe::engine
