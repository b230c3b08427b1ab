// Transformer weights in device memory, uploaded once: from a loaded GGUF model, or random
// (synthetic) with the shapes of a named architecture. Q|K|V are fused into one [qkv_dim, d]
// matrix and gate|up into one [2 d_ff, d] matrix, so each costs one GEMM.
//
// Every matrix has a bf16 copy for cuBLASLt, except raw-only ones (see weight_options). GGUF
// types gemv_quant reads (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k) can also stay on the device as raw
// blocks, so small decode batches read 4- to 8-bit memory; a fused matrix whose parts differ in
// type (a Q4_K_M file's q4_k Q|K with a q6_k V) keeps each part's blocks and multiplies part by
// part. Other types are dequantized on the host (kernels::dequantize_row) and uploaded as bf16.
// The output head always has a bf16 copy (its GEMM writes fp32 logits); small steps read its
// blocks instead where gemv_quant takes their type (gemv_quant_f32: fp32 logits too, as bf16
// ones would round too coarsely for greedy ties).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/cuda/cuda_util.hpp"
#include "engine/model.hpp"

namespace troupe::engine::cuda {

/// How the linear layers' weights are held.
enum class weights_mode {
  bf16,                    // everything bf16: cuBLASLt, or gemv_bf16 per cuda::launch_options
  quant_gemv_small_batch,  // gemv_quant's types also raw; batches <= gemv_max_batch use gemv_quant
};

/// Largest batch that gemv_quant serves (its contract); larger batches use cuBLASLt.
inline constexpr int gemv_max_batch = 8;

struct weight_options {
  weights_mode mode = weights_mode::quant_gemv_small_batch;
  /// With quant_gemv_small_batch: also keep a bf16 copy of raw matrices (memory for speed). When
  /// false, batches above gemv_max_batch expand the raw blocks into a scratch matrix per GEMM.
  bool expand_quant = true;
  /// Longest wait for the device to finish an upload or an expansion before cuda_error.
  std::chrono::milliseconds sync_timeout{600000};
};

/// Rows [row0, row0 + n_out) of a matrix as GGUF blocks of one type (byte for byte the file's).
struct raw_part {
  int64_t row0 = 0, n_out = 0;
  kc::quant_type qt = kc::quant_type::q8_0;
  const void* raw = nullptr;
  size_t bytes = 0;
};

/// The layer weights of a synthetic model: bf16, or random GGUF blocks for gemv_quant (an untied
/// output head too: q6_k, or q8_0; embeddings stay bf16).
enum class synthetic_quant {
  none,
  q4_k_m,  // q4_k, V and down in q6_k in every other layer: llama.cpp's Q4_K_M mix
  q8_0,
};

/// One linear layer, W row-major [n_out, n_in].
struct dev_matrix {
  int64_t n_out = 0, n_in = 0;
  const bf16* w = nullptr;    // bf16 copy, or null for a raw-only matrix
  std::vector<raw_part> raw;  // GGUF blocks for gemv_quant, covering every row in order; or none
  /// Bytes of the raw blocks.
  size_t raw_bytes() const {
    size_t n = 0;
    for (const raw_part& p : raw) n += p.bytes;
    return n;
  }
};

struct dev_layer {
  const float* attn_norm = nullptr;  // [d]
  const float* ffn_norm = nullptr;   // [d]
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // q/k/v biases, null when none
  // Gemma 3: QK-norm weights [head_dim], the norms of each block's output [d]; else null.
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
  bool sliding = false;  // attends to the last hparams().sliding_window positions only
  dev_matrix qkv, o, gate_up, down;
};

class device_weights {
 public:
  /// Uploads m's weights (current device). Throws cuda_error when memory is short.
  device_weights(const model& m, const weight_options& o, cudaStream_t stream);
  /// Random bf16 weights generated on the device for hp's shapes: matrices (embeddings included)
  /// uniform with standard deviation 1/sqrt(n_in) (activations stay O(1) through any depth), norms 1,
  /// biases small;
  /// RoPE's frequency factors (configuration, not weights) as given. With `quant`, the layer
  /// matrices are random blocks (kc::fill_random_blocks, the same standard deviation) held as `o` says.
  device_weights(const model_hparams& hp, uint64_t seed, cudaStream_t stream, const std::vector<float>& rope_freqs = {},
                 synthetic_quant quant = synthetic_quant::none, const weight_options& o = {});

  const model_hparams& hparams() const { return hp_; }
  const bf16* token_embd() const { return token_embd_; }  // [n_vocab, d]
  const dev_matrix& output() const { return output_; }     // bf16 may alias token_embd; blocks too (see above)
  const float* output_norm() const { return output_norm_; }
  const float* rope_freqs() const { return rope_freqs_; }  // [n_rot / 2] or null
  const dev_layer& layer(int il) const { return layers_[(size_t)il]; }
  /// Elements of the largest raw-only matrix (the expansion scratch a forward needs), else 0.
  int64_t max_raw_only_elems() const { return max_raw_only_elems_; }
  /// Bytes one decode step at batch 1 reads: the matrices it multiplies with, in the form used
  /// at batch 1 (raw where gemv serves it), plus the output head, the one embedding row and the
  /// norm weights and biases (not the rest of the embedding table).
  size_t decode_bytes_per_token() const { return decode_bytes_; }
  /// Device bytes held.
  size_t device_bytes() const { return device_bytes_; }

 private:
  template <class T>
  T* alloc(int64_t count, const char* what);
  dev_matrix upload_fused(std::initializer_list<const kernels::weight_view*> parts, const weight_options& o,
                          cudaStream_t stream, const char* what);
  struct raw_spec {
    int64_t n_out;
    kc::quant_type qt;
  };
  /// A matrix of GGUF blocks, parts stacked by rows, each filled by fill(part, device bytes,
  /// size) in stream order; plus its bf16 expansion as `o` asks, or none with bf16_elsewhere
  /// (the blocks of a matrix whose bf16 copy exists: the output head's).
  dev_matrix raw_matrix(int64_t n_in, const std::vector<raw_spec>& parts, const weight_options& o, cudaStream_t stream,
                        const char* what, const std::function<void(size_t, uint8_t*, size_t)>& fill,
                        bool bf16_elsewhere = false);
  dev_matrix random_matrix(int64_t n_out, int64_t n_in, float stddev, uint64_t seed, cudaStream_t stream,
                           const char* what);
  const float* upload_floats(const std::vector<float>& v, const char* what, cudaStream_t stream);
  void count_decode_bytes(const dev_matrix& m);

  model_hparams hp_;
  std::vector<device_buffer> buffers_;
  std::vector<dev_layer> layers_;
  const bf16* token_embd_ = nullptr;
  dev_matrix output_;
  const float* output_norm_ = nullptr;
  const float* rope_freqs_ = nullptr;
  int64_t max_raw_only_elems_ = 0;
  size_t decode_bytes_ = 0;
  size_t device_bytes_ = 0;
};

}  // namespace troupe::engine::cuda
