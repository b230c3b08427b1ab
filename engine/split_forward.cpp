#include "engine/split_forward.hpp"

#include <algorithm>
#include <stdexcept>

#include "engine/pipeline_parallel.hpp"
#include "engine/tensor_parallel.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::engine {

std::string parallel_error(const model& m, const parallelism& p) {
  if (p.expert > 1 && (p.tensor > 1 || p.pipeline > 1)) return "expert parallelism cannot be combined with tensor or pipeline parallelism yet";
  if (p.tensor > 1 && p.pipeline > 1) {  // each pipeline stage a tensor-parallel group
    if (std::string err = tensor_parallel_error(m, p.tensor); !err.empty()) return err;
    return pipeline_parallel_error(m.hparams().n_layers, p.pipeline);
  }
  if (p.tensor > 1) return tensor_parallel_error(m, p.tensor);
  if (p.expert > 1) return expert_parallel_error(m, p.expert);
  if (p.pipeline > 1) return pipeline_parallel_error(m.hparams().n_layers, p.pipeline);
  return {};
}

int64_t split_block_bytes(const kv_shape& full, const parallelism& p) {
  if (p.tensor > 1) return shard_kv_shape(full, p.tensor).block_bytes() * p.tensor;
  if (p.expert > 1) return full.block_bytes() * p.expert;
  return full.block_bytes();  // whole, or pipeline stages holding their own layers
}

split_forward::split_forward(const model& m, const parallelism& p, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks,
                             int n_threads) {
  if (std::string err = parallel_error(m, p); !err.empty()) throw std::invalid_argument(err);
  const int32_t n_host = std::max(n_host_blocks, 1);
  const int ways = p.tensor * p.pipeline * p.expert;  // workers: one kind, or stages x ranks
  const int per = std::max(1, n_threads / ways);
  if (p.pipeline > 1)
    pp_ = std::make_unique<pp_cpu_forward>(m, p.pipeline, full, n_blocks, n_host, per, 0, std::chrono::seconds(120), p.tensor);
  else if (p.tensor > 1) tp_ = std::make_unique<tp_cpu_forward>(m, p.tensor, full, n_blocks, n_host, per);
  else if (p.expert > 1) tp_ = std::make_unique<tp_cpu_forward>(m, p.expert, full, n_blocks, n_host, per, parallel_split::expert);
  else {
    pool_ = std::make_unique<kernels::thread_pool>(std::max(1, n_threads));
    device_ = std::make_unique<kv_storage>(full, n_blocks);
    host_ = std::make_unique<kv_storage>(full, n_host);
    fwd_ = std::make_unique<cpu_forward>(m, *device_, *pool_);
  }
}

split_forward::~split_forward() = default;

const std::vector<float>& split_forward::forward(std::span<const seq_chunk> batch) {
  return tp_ ? tp_->forward(batch) : pp_ ? pp_->forward(batch) : fwd_->forward(batch);
}

void split_forward::for_each_kv(const std::function<void(kv_storage&, kv_storage&)>& fn) {
  if (tp_) tp_->for_each_kv(fn);
  else if (pp_) pp_->for_each_kv(fn);
  else fn(*device_, *host_);
}

}  // namespace troupe::engine
