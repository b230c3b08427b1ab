// A self-contained generation driver over the CPU forward: prompts are prefilled in chunks under
// a per-step token budget while already-prefilled sequences decode in the same step (the same
// mixing the scheduler actor does), sampling with stop tokens and stop strings, text streamed as
// valid UTF-8. Blocks come from a block manager, so a model with sliding-window layers holds only
// their windows (as served). Used by `troupe generate`, `troupe logits`, `troupe bench` and the
// engine tests.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/forward.hpp"
#include "engine/split_forward.hpp"
#include "engine/kv_cache.hpp"
#include "engine/model.hpp"
#include "engine/sampling.hpp"

namespace troupe::kernels {
class thread_pool;
}

namespace troupe::engine {

struct generation_request {
  std::vector<token_id> prompt;
  sampling_params sampling;
  int32_t max_tokens = 128;
};

enum class finish_reason { stop, length };
const char* to_string(finish_reason r);

struct generation_result {
  std::vector<token_id> tokens;       // generated, stop token excluded
  std::string text;                   // decoded, stop string excluded
  finish_reason finish = finish_reason::length;
  std::vector<sample_result> samples;  // per generated token, when logprobs were asked for
  double prefill_s = 0;                // from start until the first token was sampled
  double total_s = 0;
};

struct generator_options {
  int n_threads = 1;
  int n_ctx = 0;        // max positions per sequence (0: the model's trained context)
  int block_size = 16;
  int n_batch = 512;    // max tokens per step
  int tensor_parallel = 1;  // > 1: the forward split over this many ranks (engine/tensor_parallel.hpp), threads shared
  int pipeline_parallel = 1;  // > 1: the layers split over this many stages (engine/pipeline_parallel.hpp), threads shared
  int expert_parallel = 1;    // > 1: a mixture of experts' experts split over this many ranks, threads shared
  bool kv_window_groups = true;  // sliding-window layers in KV groups of their own that give back the blocks
                                 // out of the window (without pipeline stages); false: --swa-full
};

class generator {
 public:
  generator(const model& m, const generator_options& opt);
  ~generator();

  /// Called with (sequence index, token, text made complete by it); return false to stop that
  /// sequence (finish_reason::stop).
  using on_token_fn = std::function<bool(size_t, token_id, std::string_view)>;

  /// Runs the requests together to completion. Throws std::invalid_argument when a request is
  /// impossible (empty prompt, prompt + max_tokens over the context, invalid sampling values).
  std::vector<generation_result> run(std::span<const generation_request> reqs, const on_token_fn& on_token = {});

  /// Logits of every position of `tokens` (n_tokens x n_vocab), one sequence from position 0.
  std::vector<float> logits_all(std::span<const token_id> tokens);

  const model& get_model() const { return m_; }
  int n_ctx() const { return n_ctx_; }
  /// The KV layout the forward runs over (model_kv_shape's, grouped per kv_window_groups).
  const kv_shape& shape() const { return shape_; }
  /// Bytes of the KV cache built (every rank's; sized for the largest run or logits_all so far).
  int64_t kv_bytes() const { return kv_blocks_ * split_block_bytes(shape_, parallel()); }

 private:
  void ensure_kv(int64_t n_blocks);

  const model& m_;
  generator_options opt_;
  int n_ctx_;
  parallelism parallel() const { return {opt_.tensor_parallel, opt_.pipeline_parallel, opt_.expert_parallel}; }
  kv_shape shape_;
  std::unique_ptr<vocab_index> vocab_;  // built at the first request with a grammar
  std::unique_ptr<split_forward> fwd_;
  int64_t kv_blocks_ = 0;  // blocks of the KV cache built
};

}  // namespace troupe::engine
