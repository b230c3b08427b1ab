// A forward pass on an accelerator, loaded at run time. The CUDA backend (engine/cuda, cuBLASLt,
// the CUDA runtime) is built as a module, libtroupe_cuda.so, opened only when a command asks for
// a CUDA device: a process that runs on the CPU never maps the CUDA libraries (cuBLASLt alone
// costs ~150 MB of resident memory at load). This header has no CUDA dependency.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/block_manager.hpp"
#include "engine/forward.hpp"

namespace troupe::engine {

class model;

/// One logits row's sampling on the device (the fields of kernels::cuda::sample_row_params).
struct device_sample_params {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  uint64_t seed = 0, draw = 0;
};

/// What the executor asks of a device (engine::cuda::cuda_options raises the step sizes to its
/// minimums).
struct device_forward_options {
  int device = 0;
  int32_t n_blocks = 0, n_host_blocks = 0;  // device KV blocks (the scheduler's pool); pinned host blocks
  int block_size = 16;
  int max_batch_tokens = 2048, max_seqs = 256, max_context = 8192, max_logit_rows = 256;
  bool graphs = true;          // decode steps from CUDA graphs (cuda_options::use_graphs)
  bool fused_decode = false;   // the fused decode launches (engine::cuda::fused_decode)
  int64_t sync_timeout_ms = 0;  // longest wait for the device in a step (0: cuda_options' default)
  bool kv_window_groups = true;  // sliding-window layers in KV groups of their own (cuda_options::kv_window_groups)
};

/// The module's forward (engine::cuda::cuda_forward behind it; see its header for the contracts).
class device_forward {
 public:
  virtual ~device_forward() = default;
  virtual void copy_blocks(std::span<const block_copy> copies) = 0;
  virtual const std::vector<float>& forward(std::span<const seq_chunk> batch) = 0;
  /// One token per logits row; histories empty, or one penalty window per row.
  virtual std::vector<token_id> forward_sample(std::span<const seq_chunk> batch, std::span<const device_sample_params> params,
                                               std::span<const std::span<const int32_t>> histories) = 0;
  virtual int max_logit_rows() const = 0;
  /// Weight bytes a step of `rows` token rows reads in the form the device holds them
  /// (engine::cuda::cuda_forward::step_weight_bytes): a memory-bound step's roofline.
  virtual size_t step_weight_bytes(int rows) const = 0;
  virtual int max_history_tokens() const = 0;
  /// After `failure` (an exception this forward threw): empty while the device still takes work;
  /// else why not — a wait for the device that timed out (work that never ends), or the sticky error
  /// that lost its context (kernels::cuda::sticky_error). Nothing in this process can use the
  /// device again then, a new forward on it included.
  virtual std::string device_lost(const std::exception_ptr& failure) const = 0;
};

/// The module's file: $TROUPE_CUDA_MODULE, else libtroupe_cuda.so beside the executable, else
/// the one this build produced. Empty when none exists.
std::string cuda_module_path();
/// CUDA devices usable by this process. Throws std::runtime_error naming the reason when the
/// module is missing (a build without nvcc) or cannot be loaded (its CUDA libraries absent).
int cuda_device_count();
/// Uploads m's weights to o.device (a dummy model's are generated there) and allocates its KV pools; the module's errors (no such
/// device, out of memory) propagate as thrown. Same load errors as cuda_device_count().
std::unique_ptr<device_forward> open_cuda_forward(const model& m, const device_forward_options& o);
/// Bytes per second a device-to-device copy of `bytes` moves on `device` (read plus write), the
/// best of `reps` (engine::cuda::copy_bandwidth): a memory-bound step's roofline on that device.
/// Same load errors as cuda_device_count(); the device's errors propagate as thrown.
double cuda_copy_bandwidth(int device, size_t bytes, int reps);

/// The module's entry points (C linkage, looked up by name; the version guards against a module
/// from another build).
inline constexpr int cuda_module_abi = 9;
extern "C" {
using cuda_module_abi_fn = int (*)();
using cuda_module_device_count_fn = int (*)();
using cuda_module_open_fn = device_forward* (*)(const model* m, const device_forward_options* o);
using cuda_module_copy_bandwidth_fn = double (*)(int device, size_t bytes, int reps);
}

}  // namespace troupe::engine
