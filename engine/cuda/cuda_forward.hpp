// The batched transformer forward on one CUDA device: the contract of engine::cpu_forward
// (mixed prefill chunks and decodes, each sequence in its own paged KV), with the KV cache, a
// pinned host swap pool and the weights on the device.
//
// A step: the step layout (token ids, positions, block tables, ...) is written to one pinned
// staging buffer and sent with one copy to fixed device addresses; then embed_rows and per layer
// add_rmsnorm (fusing the residual add of the previous layer's output), the QKV GEMM,
// rope_qkv_store, paged_attention, the O GEMM, add_rmsnorm, the gate|up GEMM, swiglu and the down
// GEMM; the final add_rmsnorm; and the output GEMM on only the rows that need logits (gathered).
// The layers' own kernels go out with programmatic dependent launch (launch_options::pdl), and a
// one-row step multiplies through gemv_bf16 instead of cuBLASLt (launch_options::bf16_gemv_rows).
//
// Gemma 3 takes the same kernels with its own parts: embeddings times sqrt(d_model), QK-norm in
// rope_qkv_store (and the sliding-window layers' RoPE base), each block's output RMS-normalized as
// add_rmsnorm adds it, GeGLU instead of SwiGLU, and paged_attention told the sliding window of the
// layers that have one. Its KV is laid out as the CPU's (engine::kv_shape): the sliding-window
// layers in groups of their own, each with its own block table per sequence, whose blocks before
// the window are given back (-1 in the table, never read); with cuda_options::kv_window_groups
// false, one group that keeps every position. The fused GEMV epilogues and the folded norm are
// Llama-family only and not taken.
//
// Decode-only steps (every chunk one token, at most 256 sequences) are padded to a batch bucket
// (1, 2, 4, ..., 256) with dummy rows that read and write a reserved scratch KV block, and
// attention is told an upper bound of the longest context (a power of two >= 256). With
// use_graphs such a step is captured once per (bucket, context bound) as a CUDA graph and then
// replayed: replays only copy the new layout. Eager and graph runs of a decode step launch the
// same kernels with the same arguments, so their logits are identical. Mixed and prefill steps
// run eagerly at their exact size.
//
// Streams: compute on one stream; block copies (swap and copy-on-write) on a copy stream that the
// next step waits for through an event, so copies overlap host work and earlier compute.
// forward() and forward_sample() return when their step has finished; copy_blocks() returns at
// once. Every wait on the device is bounded by sync_timeout (cuda_error past it).
//
// Not thread-safe: one owner thread at a time (the executor). Each call selects the device first.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/block_manager.hpp"
#include "engine/cuda/cuda_util.hpp"
#include "engine/cuda/cuda_weights.hpp"
#include "engine/cuda/gemm.hpp"
#include "engine/forward.hpp"
#include "engine/kv_cache.hpp"

namespace troupe::engine::cuda {

/// How a step's kernels are chosen and launched (cuda_forward::set_launch_options changes them).
struct launch_options {
  /// Steps of at most this many token rows (<= gemv_max_batch) multiply bf16 weights with
  /// kernels::cuda::gemv_bf16 instead of cuBLASLt; 0: never. On an H200 (Llama-3-8B shapes,
  /// docs/perf.md §4b) the GEMV made a batch-1 decode step 6% faster (4.60 vs 4.89 ms), batch 2
  /// 1% faster, batch 4 16% and batch 8 1.9x slower; troupe_gpu_bench reports them.
  int bf16_gemv_rows = 1;
  /// ... and only for matrices of at most this many bytes (0: any size). Alone, cuBLASLt read
  /// Llama-3-8B's large gate|up and down matrices faster than gemv_bf16 (3.8 and 3.6 vs 3.6 and
  /// 3.3 TB/s) and its qkv and o slower (3.0 and 2.0 vs 3.1 and 2.6): a cap between them (64 MiB)
  /// sends each to the faster one. Not yet measured in whole steps (troupe_gpu_bench's
  /// decode_b1_split_* does).
  size_t bf16_gemv_max_bytes = 0;
  /// Such GEMVs of one or two rows over rows of a multiple of 256 weights use
  /// kernels::cuda::gemv_bf16_streamed (weights by bulk copies into shared memory) instead. Not
  /// yet measured on a device: troupe_gpu_bench's decode_b1_streamed_* will say.
  bool bf16_gemv_streamed = false;
  /// Its pipeline (CTAs per SM, stages, bytes a copy).
  kc::gemv_stream_config bf16_gemv_stream;
  /// Launch the layers' own kernels with programmatic dependent launch (kernels::cuda::pdl_scope):
  /// each is scheduled while the one before it finishes and waits for it inside, so launch gaps
  /// overlap work (a batch-1 decode step 2-4% faster on an H200, docs/perf.md §4b).
  bool pdl = true;
  /// The gate|up GEMV of such steps applies SwiGLU to its own outputs
  /// (kernels::cuda::gemv_bf16_swiglu: the same bits, one launch and the gate|up round trip fewer
  /// per layer). Not with the streamed GEMV. Quantized gate|up blocks of one type: the same with
  /// kernels::cuda::gemv_quant_swiglu. Off until a device measures it (troupe_gpu_bench's
  /// decode_b1_fused, decode_q4_k_m_b1_fused).
  bool gemv_swiglu = false;
  /// Split-KV decode attention merges each row's splits in the last CTA to finish
  /// (attention_scratch::counters) instead of a second kernel: the same bits, one launch fewer per
  /// layer. Off until a device measures it (decode_b1_fused, decode_b64_fused).
  bool attention_last_cta_merge = false;
  /// gemv_bf16 (and gemv_bf16_swiglu) ask L2 for the first this many bytes of each weight row
  /// before waiting for the kernel ahead (programmatic launch), so HBM streams weights while the
  /// small kernels between GEMVs run. 0: off until a device measures it (decode_b1_prefetch_*).
  int bf16_gemv_prefetch_bytes = 0;
  /// In such steps the residual add and RMSNorm between the layers' GEMVs ride on them
  /// (kernels::cuda::gemv_norm): the o and down GEMVs add into the residual stream and leave the
  /// normalized input with its sum of squares, the qkv and gate|up GEMVs scale their products by
  /// the norm. 63 add_rmsnorm launches fewer a Llama-3-8B step; values within bf16 rounding of
  /// the unfused step (not the same bits). Only where all four matrices of every layer go through
  /// gemv_bf16 or (blocks, the o and down matrices of one type) gemv_quant. Off until a device
  /// measures it (troupe_gpu_bench's decode_b1_fold_*, and decode_q4_k_m_*_fused).
  bool gemv_fold_norm = false;
  /// The qkv GEMV of such steps applies the biases, RoPE and the KV-cache write to its own
  /// outputs (kernels::cuda::gemv_bf16_rope_qkv: the same bits, one launch and the qkv round trip
  /// fewer per layer). Not with the streamed GEMV. Quantized QKV blocks of one type (not a K_M
  /// layer's q4_k Q|K with a q6_k V): the same with kernels::cuda::gemv_quant_rope_qkv. Off until
  /// a device measures it (decode_b1_rope_only_*, and every *_fused_* line).
  bool gemv_rope = false;
  /// Decode attention splits a row once longer than this many positions, each split keeping at
  /// least as many (kernels::cuda::attention_scratch::kv_per_split; at most
  /// cuda_options::attention_splits splits). troupe_gpu_bench's decode_b1_attn_kv* lines try others.
  int attention_kv_per_split = 64;
  /// The host's wait for a step polls without sleeping for this long (then sleeps 20 us between
  /// polls, which overshoots by tens of microseconds): decode steps of a few ms end inside it.
  /// 0: sleep from the first millisecond, as before this option (troupe_gpu_bench's
  /// decode_b1_sleep_wait_* measures that).
  std::chrono::milliseconds step_spin{50};
  /// Units of 8 quantized weights each lane of gemv_quant loads before decoding the first (1, 4
  /// or 8; the same results): more of HBM's latency covered at batch 1, more registers. Prepared
  /// without a device (docs/perf.md §4b): 1 until measured (troupe_gpu_bench decode_q4_k_m_*_unroll*).
  int quant_gemv_unroll = 1;
};

/// l with every fused decode launch on: gemv_swiglu, gemv_rope, attention_last_cta_merge and
/// gemv_fold_norm (config: engine.cuda_fused_decode).
inline launch_options fused_decode(launch_options l) {
  l.gemv_swiglu = l.gemv_rope = l.attention_last_cta_merge = l.gemv_fold_norm = true;
  return l;
}

struct cuda_options {
  int device = 0;
  weight_options weights;
  /// Device KV blocks; 0: kv_memory_fraction of the memory free after weights and scratch.
  int32_t n_blocks = 0;
  double kv_memory_fraction = 0.9;
  /// Blocks of the pinned host swap pool (0: none).
  int32_t n_host_blocks = 0;
  int block_size = 16;
  /// Sliding-window layers (Gemma 3) in KV groups of their own, whose blocks the block manager
  /// gives back as they leave the window (engine::make_kv_shape's grouped layout; the executor's
  /// KV manager must use the same shape: engine::model_kv_shape(m, block_size, this)); false: one
  /// group, every layer keeps every position (--swa-full).
  bool kv_window_groups = true;
  /// Token rows per step (scratch sizing); raised to at least 256, the largest decode bucket.
  int max_batch_tokens = 2048;
  /// Sequences per step (up to 256: raised to a power of two, the decode bucket).
  int max_seqs = 256;
  /// Longest sequence (positions): with max_seqs, sizes the staged block tables.
  int max_context = 8192;
  /// Logits rows held on the device at once (raised to the largest decode bucket used). forward()
  /// pages the output GEMM through more; forward_sample() accepts at most this many.
  int max_logit_rows = 256;
  /// Token ids of all penalty histories of one forward_sample() together.
  int max_history_tokens = 1 << 18;
  /// Flash-decoding splits for decode rows (0: none).
  int attention_splits = 16;
  bool use_graphs = true;
  launch_options launch;
  /// Longest wait for the device before cuda_error.
  std::chrono::milliseconds sync_timeout{120000};
  /// Seed of synthetic weights.
  uint64_t synthetic_seed = 1;
  /// Layer weights of synthetic(): bf16, or random quantized blocks (held as `weights` says).
  synthetic_quant synthetic_weights = synthetic_quant::none;
};

class cuda_forward {
 public:
  /// Uploads m's weights to o.device and allocates the KV cache and scratch. m must outlive the
  /// construction only (weights are copied). Throws cuda_error on a bad device index, short
  /// memory (naming what was asked and what was free) or a failed launch. A dummy model
  /// (load_options::dummy) gets random bf16 weights generated on the device from its seed, as
  /// synthetic().
  cuda_forward(const model& m, const cuda_options& o);
  /// Random bf16 weights for a named architecture (synthetic_hparams), generated on the device.
  static std::unique_ptr<cuda_forward> synthetic(const std::string& arch, const cuda_options& o);
  /// The same for given hyper-parameters (a named architecture's, e.g. with fewer layers).
  static std::unique_ptr<cuda_forward> synthetic(const model_hparams& hp, const cuda_options& o);
  ~cuda_forward();
  cuda_forward(const cuda_forward&) = delete;
  cuda_forward& operator=(const cuda_forward&) = delete;

  const model_hparams& hparams() const { return weights_.hparams(); }
  const kv_shape& kv() const { return kv_shape_; }
  int32_t n_blocks() const { return n_blocks_; }
  int32_t n_host_blocks() const { return n_host_blocks_; }

  /// Enqueues block copies (device <-> host pool, device -> device) on the copy stream, in list
  /// order; the next step waits for them. Returns at once. Throws std::invalid_argument (nothing
  /// enqueued) when a block id is outside its pool.
  void copy_blocks(std::span<const block_copy> ops);

  /// As cpu_forward::forward: logits (fp32, n_vocab per row) for every token of all_logits
  /// chunks, none for no_logits chunks, else each chunk's last token, in batch order. Writes the
  /// KV of every token. Throws std::invalid_argument (nothing run) for a token id out of range, a
  /// block table that does not cover its positions or names a block outside [0, n_blocks()), or
  /// a batch beyond the capacities in cuda_options; cuda_error for a device failure.
  const std::vector<float>& forward(std::span<const seq_chunk> batch);

  /// Runs the step and samples on the device (logits never leave it): one token per logits row
  /// (rows as forward() would return them), with params[i] and, when histories is not empty, the
  /// penalty history histories[i] for row i. Same errors as forward(), and std::invalid_argument
  /// when the sizes disagree or the rows exceed max_logit_rows.
  std::vector<int32_t> forward_sample(std::span<const seq_chunk> batch, std::span<const kc::sample_row_params> params,
                                      std::span<const std::span<const int32_t>> histories = {});

  /// Waits (bounded) until all enqueued copies and steps are done.
  void synchronize();

  /// The device KV cache (tests and tools read blocks through it).
  kc::kv_cache_view kv_view() const;
  /// Start of host swap block b (block_bytes of kv()).
  const void* host_block(int32_t b) const;
  /// Weight bytes a batch-1 decode step reads (see device_weights::decode_bytes_per_token).
  size_t decode_bytes_per_token() const { return weights_.decode_bytes_per_token(); }
  /// Weight bytes a step of `rows` token rows reads: as decode_bytes_per_token, with each matrix
  /// in the form this step multiplies it in (blocks up to gemv_max_batch rows where they are kept,
  /// bf16 above: its copy, or the expansion of its blocks, counted as that copy's bytes).
  size_t step_weight_bytes(int rows) const;
  /// Device bytes of weights, KV cache and scratch.
  size_t device_bytes() const;
  /// Changes the launch options for the next steps (waits for the device and drops the captured
  /// graphs, which hold the old choice).
  void set_launch_options(const launch_options& l);
  /// Device time of the last forward()/forward_sample() step, from its layout upload to its last
  /// copy back (ms): with the host's wall time per step it splits a step into device work and
  /// host overhead.
  double last_step_device_ms() const;
  /// CUDA graphs captured so far.
  size_t n_graphs() const { return graphs_.size(); }
  /// Why decode steps stopped using CUDA graphs (a capture failed), or empty; set_launch_options
  /// clears it (its steps are captured again).
  const std::string& graph_error() const { return graph_error_; }
  /// Whether steps of `rows` token rows fold RMSNorm into the GEMVs: launch_options::gemv_fold_norm
  /// and every layer's qkv, o, gate|up and down matrices through gemv_bf16.
  bool fold_norm(int rows) const;

 private:
  struct synthetic_tag {};
  cuda_forward(synthetic_tag, const model_hparams& hp, const cuda_options& o);
  struct plan;
  void setup();
  plan prepare(std::span<const seq_chunk> batch);
  void stage_sampling(plan& p, std::span<const kc::sample_row_params> params,
                      std::span<const std::span<const int32_t>> histories);
  void launch(const plan& p);
  void run_layers(const plan& p, cudaStream_t s);
  /// y = x w^T through gemv_quant, gemv_bf16(_streamed) or cuBLASLt; `norm` (a folded RMSNorm
  /// reader or writer) only where gemv_bf16 is the path (plain_gemv).
  void linear(const dev_matrix& w, const bf16* x, bf16* y, int rows, cudaStream_t s, const kc::gemv_norm& norm = {});
  /// w's bf16 copy, or its blocks expanded into the scratch (stream order: valid until the next call).
  const bf16* bf16_weights(const dev_matrix& w, cudaStream_t s);
  /// Whether linear() multiplies w for a step of `rows` rows with gemv_quant, part by part.
  bool quant_gemv(const dev_matrix& w, int rows) const;
  /// Where quant_gemv holds and w's parts share one type: its blocks as the fused quantized GEMVs
  /// (gemv_quant_swiglu, gemv_quant_rope_qkv) read them; else none (the unfused launches).
  std::optional<kc::quant_matrix> fused_quant(const dev_matrix& w, int rows) const;
  /// Whether linear() multiplies w for a step of `rows` rows with gemv_bf16 (or, streamed_gemv,
  /// gemv_bf16_streamed) rather than cuBLASLt; quantized matrices kept raw take gemv_quant first.
  bool bf16_gemv(const dev_matrix& w, int rows) const;
  bool streamed_gemv(const dev_matrix& w, int rows) const;
  /// Whether linear() takes gemv_bf16 itself for w: the fused GEMVs (SwiGLU, RoPE, norm) replace it there.
  bool plain_gemv(const dev_matrix& w, int rows) const;
  void drop_graphs();
  void output_rows(const plan& p, int first, int count, cudaStream_t s);
  cudaGraphExec_t capture(const plan& p, cudaStream_t s);
  void resize_host_logits(size_t n);
  void finish_step(const char* what);

  // Declared first: the device is selected before any member allocates.
  cuda_options opt_;
  int device_ = 0;
  stream_handle compute_, copy_;
  event_handle copies_done_, step_done_, sync_event_;
  event_handle step_start_{true}, step_end_{true};  // timed: last_step_device_ms()
  bool copies_pending_ = false;
  device_weights weights_;
  gemm_runner gemm_;

  kv_shape kv_shape_;
  int32_t n_blocks_ = 0, n_host_blocks_ = 0;  // the device pool holds one more: the scratch block
  device_buffer kv_;
  pinned_buffer host_kv_;

  // Capacities (after raising) and the fixed layout of the staging buffers.
  int cap_tokens_ = 0, cap_seqs_ = 0, cap_logits_ = 0, cap_bt_ = 0, cap_history_ = 0, cap_split_rows_ = 0;
  struct staging_offsets {
    size_t tokens, token_pos, token_seq, q_start, pos0, bt_start, out_rows, hist_start, sample_params, block_tables,
        history, end;
  } off_{};
  pinned_buffer stage_host_;
  device_buffer stage_dev_;

  // Activations and outputs.
  device_buffer x_, h_, qkv_, q_, attn_, y_, gu_, act_, out_rows_, logits_dev_, attn_scratch_, attn_counters_, norm_sumsq_, sample_scratch_, tokens_dev_,
      expand_;
  pinned_buffer tokens_host_;
  std::vector<float> logits_;
  bool logits_registered_ = false;

  std::map<std::pair<int, int>, cudaGraphExec_t> graphs_;  // (bucket, context bound) -> graph
  std::string graph_error_;
};

}  // namespace troupe::engine::cuda
