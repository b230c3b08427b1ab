// A Llama-family model loaded from GGUF: hyper-parameters from the metadata, weights viewed in
// place in the memory-mapped file (quantized blocks are never expanded), and the tokenizer. Or,
// with load_options::dummy, the same shapes with random weights (vLLM's --load-format dummy), from a
// file's metadata or a built-in architecture's configuration, so that throughput can be measured
// without the weights.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"
#include "kernels/matmul.hpp"
#include "kernels/ops.hpp"

namespace troupe::engine {

struct model_hparams {
  std::string arch;  // "llama", "qwen2", ...
  std::string name;
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int d_ff = 0;
  int n_vocab = 0;
  int n_ctx_train = 0;
  int n_rot = 0;  // rotated dims per head (<= head_dim)
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;
  kernels::rope_style rope = kernels::rope_style::normal;
  bool tied_output = false;
  // Gemma 3 (arch "gemma3"); the defaults leave the Llama-family forward unchanged.
  bool gemma = false;           // embeddings x sqrt(d_model), QK-norm, sandwich norms, GELU gate
  float attn_scale = 0;         // softmax scale of QK^T; 0: 1/sqrt(head_dim)
  int sliding_window = 0;       // positions a sliding-window layer attends to (itself included); 0: none
  float rope_base_swa = 10000;  // RoPE base of the sliding-window layers
  // Mixture of experts (Mixtral-style, llama.cpp's `{arch}.expert_count`): every layer's
  // feed-forward is n_experts SwiGLU experts of width d_ff, each token going through the
  // n_experts_used with the highest router probability, weighted by them renormalized to sum 1.
  int n_experts = 0, n_experts_used = 0;
};

struct layer_weights {
  std::vector<float> attn_norm, ffn_norm;
  std::vector<float> q_norm, k_norm;                  // per-head RMSNorm of Q and K (Gemma 3); else empty
  std::vector<float> post_attn_norm, post_ffn_norm;   // RMSNorm of each block's output (Gemma 3); else empty
  bool sliding = false;                               // attends to the last hparams.sliding_window positions only
  std::vector<float> bq, bk, bv;  // empty when the model has no attention biases
  kernels::weight_view wq, wk, wv, wo;
  kernels::weight_view w_gate, w_up, w_down;  // dense feed-forward (unset in a mixture-of-experts layer)
  // Mixture of experts: the router (n_experts rows of d_model) and the experts this holds,
  // [expert_begin, expert_begin + expert_gate.size()) of the model's (all of them, but for an
  // expert-parallel shard).
  kernels::weight_view router;
  int expert_begin = 0;
  std::vector<kernels::weight_view> expert_gate, expert_up, expert_down;
};

/// How model::load gets the weights.
struct load_options {
  /// Random weights in place of the file's (vLLM's --load-format dummy). The shapes, tokenizer and
  /// chat template come from the file's metadata (its tensors' shapes are checked, their data never
  /// read); or `path` names a built-in architecture (synthetic_architectures()): its published
  /// configuration, with a byte-level vocabulary of its size (ChatML's special tokens among them).
  bool dummy = false;
  uint64_t seed = 0;  // the random weights' seed: the same seed, the same weights
  /// With dummy: the host holds the random weights (q8_0 matrices, f32 where a row is not whole
  /// blocks), for the CPU forward. False for a device that generates its own from dummy_seed(): the
  /// weight views keep their shapes, typed bf16, with no data.
  bool host_weights = true;
};

/// The built-in architectures a dummy load accepts in place of a file: "llama-3-8b",
/// "qwen2.5-7b", "smollm2-135m", "gemma3-270m".
const std::vector<std::string>& synthetic_architectures();
/// The configuration of one of them (as its GGUF's metadata would give it). Throws
/// std::invalid_argument naming the known ones.
model_hparams synthetic_hparams(const std::string& arch);

class model {
 public:
  /// Maps `path` and validates every tensor's type and shape against the metadata. Throws
  /// gguf_error naming the file and, where one is at fault, the key or tensor; with o.dummy and a
  /// path that is neither a file nor a built-in architecture, std::invalid_argument.
  static std::unique_ptr<model> load(const std::string& path, const load_options& o = {});

  const model_hparams& hparams() const { return hp_; }
  /// The file's tokenizer.chat_template, empty when it has none (or the model no file).
  std::string chat_template() const;
  /// The chat format to use when the model carries no template: "gemma" for Gemma 3 (whose GGUF
  /// carries none), "chatml" for a built-in architecture; else empty.
  std::string default_chat_family() const;
  /// Random weights (load_options::dummy), and their seed.
  bool dummy() const { return load_.dummy; }
  uint64_t dummy_seed() const { return load_.seed; }
  /// False for dummy weights left to a device to generate: the views have no data.
  bool has_host_weights() const { return !load_.dummy || load_.host_weights; }
  const tokenizer& vocab() const { return *tok_; }
  const layer_weights& layer(int il) const { return layers_[(size_t)il]; }
  const kernels::weight_view& token_embd() const { return token_embd_; }
  const kernels::weight_view& output() const { return output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<float>& rope_freq_factors() const { return rope_freqs_; }
  /// Bytes of weights read per decoded token (all matrices plus the output head).
  size_t weight_bytes_per_token() const;

 private:
  model() = default;
  load_options load_;
  std::unique_ptr<gguf_file> file_;  // null for a built-in architecture
  std::unique_ptr<tokenizer> tok_;
  model_hparams hp_;
  std::vector<layer_weights> layers_;
  kernels::weight_view token_embd_, output_;
  std::vector<float> output_norm_, rope_freqs_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // weights repacked at load (q5_0 -> q8_0), or random
};

}  // namespace troupe::engine
