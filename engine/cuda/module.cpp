// libtroupe_cuda.so: the CUDA backend as a module (engine/device_module.hpp), so that only a
// process that asks for a CUDA device loads the CUDA runtime and cuBLASLt.
#include "engine/cuda/cuda_forward.hpp"
#include "engine/cuda/cuda_util.hpp"
#include "engine/device_module.hpp"

namespace troupe::engine::cuda {
namespace {

class module_forward final : public device_forward {
 public:
  module_forward(const model& m, const cuda_options& o) : opt_(o), fwd_(m, o) {}

  void copy_blocks(std::span<const block_copy> copies) override { fwd_.copy_blocks(copies); }
  const std::vector<float>& forward(std::span<const seq_chunk> batch) override { return fwd_.forward(batch); }
  std::vector<token_id> forward_sample(std::span<const seq_chunk> batch, std::span<const device_sample_params> params,
                                       std::span<const std::span<const int32_t>> histories) override {
    rows_.clear();
    for (const device_sample_params& p : params)
      rows_.push_back({p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty, p.seed, p.draw});
    return fwd_.forward_sample(batch, rows_, histories);
  }
  int max_logit_rows() const override { return opt_.max_logit_rows; }
  size_t step_weight_bytes(int rows) const override { return fwd_.step_weight_bytes(rows); }
  int max_history_tokens() const override { return opt_.max_history_tokens; }
  // Work that never finished (CUDA cannot cancel a kernel, so the device stays busy with it, and
  // freeing memory it may touch would wait for it), or a sticky error.
  std::string device_lost(const std::exception_ptr& failure) const override {
    try {
      if (failure) std::rethrow_exception(failure);
    } catch (const device_timeout& e) {
      return std::string("device timeout: ") + e.what();
    } catch (...) {
    }
    return kc::sticky_error();
  }

 private:
  cuda_options opt_;
  cuda_forward fwd_;
  std::vector<kc::sample_row_params> rows_;
};

}  // namespace
}  // namespace troupe::engine::cuda

extern "C" {

__attribute__((visibility("default"))) int troupe_cuda_module_abi() { return troupe::engine::cuda_module_abi; }

__attribute__((visibility("default"))) int troupe_cuda_module_device_count() { return troupe::kernels::cuda::device_count(); }

__attribute__((visibility("default"))) double troupe_cuda_module_copy_bandwidth(int device, size_t bytes, int reps) {
  troupe::engine::cuda::select_device(device);
  const troupe::engine::cuda::stream_handle s;
  return troupe::engine::cuda::copy_bandwidth(bytes, reps, s.get(), std::chrono::milliseconds(20000));
}

__attribute__((visibility("default"))) troupe::engine::device_forward* troupe_cuda_module_open(
    const troupe::engine::model* m, const troupe::engine::device_forward_options* o) {
  troupe::engine::cuda::cuda_options c;
  c.device = o->device;
  c.n_blocks = o->n_blocks;  // the scheduler's block manager addresses exactly these
  c.n_host_blocks = o->n_host_blocks;
  c.block_size = o->block_size;
  c.max_batch_tokens = o->max_batch_tokens;
  c.max_seqs = o->max_seqs;
  c.max_context = o->max_context;
  c.max_logit_rows = o->max_logit_rows;
  c.use_graphs = o->graphs;
  c.kv_window_groups = o->kv_window_groups;
  if (o->sync_timeout_ms > 0) c.sync_timeout = std::chrono::milliseconds(o->sync_timeout_ms);
  if (o->fused_decode) c.launch = troupe::engine::cuda::fused_decode(c.launch);
  return new troupe::engine::cuda::module_forward(*m, c);
}
}
