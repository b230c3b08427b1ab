// Pipeline parallelism on the CPU backend: the layers split into consecutive stages, each stage on
// its own thread with its own kernel thread pool and the KV storage of its layers only; a step's
// batch is cut into micro-batches that flow through the stages, so stage s works on micro-batch i
// while stage s + 1 works on micro-batch i - 1 (GPipe's schedule within a step). The activations a
// stage hands on are the micro-batch's hidden rows (the message between stages; across machines
// they would travel as one).
//
// Every row is computed as the whole-model forward computes it (the forward's rows are
// independent, and a prompt cut between micro-batches is a chunked prefill), so the logits are
// bit-identical to one stage's.
//
//   pp_cpu_forward pp(model, 2, kv_shape_of_the_model, n_blocks, n_host_blocks, threads_per_stage);
//   const auto& logits = pp.forward(batch);
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/forward.hpp"
#include "engine/model.hpp"

namespace troupe::engine {

/// Empty when `n_layers` split into `n_stages` stages, else why not.
std::string pipeline_parallel_error(int n_layers, int n_stages);

/// [begin, end) layer ranges of `n_stages` stages, as even as the layers allow (earlier stages
/// take the remainder). Throws std::invalid_argument when there are fewer layers than stages.
std::vector<std::pair<int, int>> split_layers(int n_layers, int n_stages);

/// The batch cut into at most `n` micro-batches of about equal token counts, in order: a chunk
/// may be cut into consecutive pieces (each but the last without logits unless the chunk wants
/// every row's), so the micro-batches' logits rows, concatenated, are the batch's.
std::vector<std::vector<seq_chunk>> split_micro_batches(std::span<const seq_chunk> batch, int n);

class pp_cpu_forward {
 public:
  /// `full`: the whole model's KV shape; each stage holds n_blocks (and n_host_blocks) blocks of
  /// its layers. micro_batches 0: as many as stages. tensor_ranks > 1: each stage is a
  /// tensor-parallel group of that many ranks over its layers (engine/tensor_parallel.hpp), each
  /// rank with threads_per_stage threads and the KV of its heads — Megatron's TP within a stage,
  /// PP across stages.
  pp_cpu_forward(const model& m, int n_stages, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks,
                 int threads_per_stage, int micro_batches = 0,
                 std::chrono::milliseconds stage_timeout = std::chrono::seconds(120), int tensor_ranks = 1);
  ~pp_cpu_forward();
  pp_cpu_forward(const pp_cpu_forward&) = delete;
  pp_cpu_forward& operator=(const pp_cpu_forward&) = delete;

  /// As cpu_forward::forward. A stage's exception is rethrown here once every stage has stopped
  /// (the stages after it skip the step). A stage that waits longer than stage_timeout for its
  /// input fails the step.
  const std::vector<float>& forward(std::span<const seq_chunk> batch);
  /// Runs `fn(stage's device pool, stage's host pool)` on every stage (block copies).
  void for_each_kv(const std::function<void(kv_storage& device, kv_storage& host)>& fn);
  int n_stages() const { return (int)stages_.size(); }

 private:
  struct stage;
  void worker(stage& s);

  std::vector<std::unique_ptr<stage>> stages_;
  int micro_batches_;
  std::chrono::milliseconds timeout_;
  int n_vocab_, block_size_;
  int32_t n_blocks_;
  std::mutex mu_;
  std::condition_variable cv_;
  // The step under way: its micro-batches, their hidden rows, where each one's logits go.
  std::vector<std::vector<seq_chunk>> mbs_;
  std::vector<std::vector<float>> hidden_;
  std::vector<size_t> logits_at_;
  std::vector<float> logits_;
  std::vector<int> progress_;  // micro-batches each stage has finished this step
  uint64_t step_ = 0;
  int n_done_ = 0;             // stages done with the step
  bool failed_ = false, stop_ = false;
};

}  // namespace troupe::engine
