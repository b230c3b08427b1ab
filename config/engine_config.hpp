// Engine settings shared by every command: which model, how many threads, how the KV cache and
// the prefill chunks are sized. Every limit is here, with its default.
#pragma once

#include <cstdint>
#include <string>

namespace troupe::config {

struct engine_config {
  std::string model_path;   // empty: the default model (see default_model_path)
  // "auto": the file's weights; "dummy": random weights of its shapes, or of a built-in
  // architecture named in place of a file (engine::load_options; vLLM's --load-format dummy).
  std::string load_format = "auto";
  int dummy_seed = 0;  // the random weights' seed
  int n_threads = 0;        // 0: one per physical core the process may use
  int n_ctx = 0;            // max positions per sequence; 0: the model's trained context
  int kv_block_size = 16;   // positions per KV block
  int n_batch = 256;        // max tokens per forward step (prefill chunk size); perf.md 2d
  int64_t max_kv_bytes = 1LL << 30;  // cap on the KV cache allocation
  int tensor_parallel = 1;  // ranks the model is split over (heads, feed-forward columns); CPU: threads are shared among them
  int pipeline_parallel = 1;  // stages the layers are split over (micro-batches flow through them); CPU: threads shared
  int expert_parallel = 1;    // ranks a mixture of experts' experts are split over (attention replicated); CPU: threads shared
  // Sliding-window layers (Gemma 3) keep the KV of every position, as full-attention ones do
  // (llama.cpp's --swa-full); else only their window's (the serve path's paged KV cache).
  bool swa_full = false;
  std::string device = "cpu";  // the executor's device: "cpu", or "cuda" / "cuda:N" (builds with CUDA)
  // Device "cuda" only: decode steps replayed from CUDA graphs (false: launched eagerly each
  // step, as vLLM's --enforce-eager), and the fused decode launches (engine::cuda::launch_options:
  // the GEMVs with SwiGLU, RoPE and the RMSNorm fold, the last-CTA attention merge).
  bool cuda_graphs = true;
  bool cuda_fused_decode = false;
};

/// "cpu" -> -1; "cuda" -> 0; "cuda:N" -> N. Throws std::invalid_argument for anything else.
int parse_device(const std::string& device);

/// Empty when valid, else one line naming the option and its allowed range.
std::string validate(const engine_config& c);

/// The thread count to use for n_threads == 0.
int default_threads();

/// Where the default model is looked for, in order: $TROUPE_MODEL; models/default.gguf under the
/// source tree the binary was built from (scripts/setup.sh installs it there). Returns the first
/// existing path, or an empty string.
std::string default_model_path();

}  // namespace troupe::config
