// Transformer weights in device memory, uploaded once: from a loaded GGUF model, or random
// (synthetic) with the shapes of a named architecture. Q|K|V are fused into one [qkv_dim, d]
// matrix and gate|up into one [2 d_ff, d] matrix, so each costs one GEMM.
//
// Every matrix has a bf16 copy for cuBLASLt, except raw-only ones (see weight_options). GGUF
// types gemv_quant reads (q8_0, q4_0, q4_1, q4_k) can also stay on the device as raw blocks, so small
// decode batches read 4-bit / 8-bit memory; other types are dequantized on the host
// (kernels::dequantize_row) and uploaded as bf16. The output head is always bf16 (its GEMM writes
// fp32 logits, which bf16 GEMV output would round too coarsely for greedy ties).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cuda/cuda_util.hpp"
#include "engine/model.hpp"

namespace troupe::engine::cuda {

/// How the linear layers' weights are held.
enum class weights_mode {
  bf16,                    // everything bf16: cuBLASLt, or gemv_bf16 per cuda::launch_options
  quant_gemv_small_batch,  // q8_0/q4_0/q4_1/q4_k also raw; batches <= gemv_max_batch use gemv_quant
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

/// One linear layer, W row-major [n_out, n_in].
struct dev_matrix {
  int64_t n_out = 0, n_in = 0;
  const bf16* w = nullptr;    // bf16 copy, or null for a raw-only matrix
  const void* raw = nullptr;  // GGUF blocks for gemv_quant, or null
  kc::quant_type qt = kc::quant_type::q8_0;
  size_t raw_bytes = 0;
};

struct dev_layer {
  const float* attn_norm = nullptr;  // [d]
  const float* ffn_norm = nullptr;   // [d]
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // q/k/v biases, null when none
  dev_matrix qkv, o, gate_up, down;
};

class device_weights {
 public:
  /// Uploads m's weights (current device). Throws cuda_error when memory is short.
  device_weights(const model& m, const weight_options& o, cudaStream_t stream);
  /// Random bf16 weights generated on the device for hp's shapes: matrices (embeddings included)
  /// uniform with standard deviation 1/sqrt(n_in) (activations stay O(1) through any depth), norms 1,
  /// biases small;
  /// RoPE's frequency factors (configuration, not weights) as given.
  device_weights(const model_hparams& hp, uint64_t seed, cudaStream_t stream, const std::vector<float>& rope_freqs = {});

  const model_hparams& hparams() const { return hp_; }
  const bf16* token_embd() const { return token_embd_; }  // [n_vocab, d]
  const dev_matrix& output() const { return output_; }     // bf16 only; may alias token_embd
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
