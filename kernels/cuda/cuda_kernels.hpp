// CUDA kernels of the transformer forward (sm_90). Host-callable launchers: each enqueues its
// work on `stream` and returns at once; none synchronizes, none allocates (callers pass scratch).
// Activations are bf16 in HBM except the residual stream (fp32, for accuracy over many layers)
// and logits (fp32). The paged KV cache has the CPU layout (engine/kv_cache.hpp): fp16, block b
// holds for every layer K then V of block_size positions, each position n_kv_heads * head_dim
// values, so a block is one contiguous span and swaps to host with one copy.
//
// Launch errors are reported by check_launch() (cudaGetLastError) and thrown as cuda_error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe::kernels::cuda {

using bf16 = __nv_bfloat16;
using fp16 = __half;

/// A CUDA runtime or library failure, with the call and the error string.
class cuda_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws cuda_error naming `what` when `e` is not cudaSuccess.
void check(cudaError_t e, const char* what);
/// Throws when the last launch failed (cudaGetLastError).
void check_launch(const char* kernel);
/// Number of CUDA devices (0 where there is no driver or no GPU; never throws).
int device_count();
/// Empty while this thread's device still takes work; else the sticky error that lost its context
/// (an illegal address, a kernel exception: "any further CUDA work will return the same error",
/// and only a new process can use the device again), as "NAME: description". Clears a plain
/// error first. Never throws, never waits.
std::string sticky_error();

/// While alive, the launches of add_rmsnorm, swiglu, rope_qkv_store, paged_attention, gemv_bf16,
/// gemv_bf16_swiglu, gemv_bf16_rope_qkv and gemv_bf16_streamed made on this thread allow
/// programmatic dependent launch (kernels/cuda/launch.cuh): each may start before the kernel
/// ahead of it on the stream has finished, and waits for it inside.
/// Ordinary launches (no scope, or `on` false) behave as before. Scopes nest.
class pdl_scope {
 public:
  explicit pdl_scope(bool on);
  ~pdl_scope();
  pdl_scope(const pdl_scope&) = delete;
  pdl_scope& operator=(const pdl_scope&) = delete;

 private:
  bool previous_;
};

// ---- element-wise and per-row ----------------------------------------------------------------

/// out[r, :] = float(table[tokens[r], :]) * scale for r in [0, rows). table is bf16 [n_vocab, d].
/// (Gemma scales its embeddings by sqrt(d).)
void embed_rows(const bf16* table, const int32_t* tokens, float* out, int rows, int d, cudaStream_t stream,
                float scale = 1.0f);

/// Fused residual add + RMSNorm: for each row r, when `add` is not null residual[r] += add[r]
/// (bf16 -> fp32); then y[r] = bf16(residual[r] / sqrt(mean(residual[r]^2) + eps) * w).
/// residual fp32 [rows, n], w fp32 [n], y bf16 [rows, n]. With add_norm_w (Gemma's norm of each
/// block's output, fp32 [n]) the added row is itself RMS-normalized first: residual[r] +=
/// add[r] / sqrt(mean(add[r]^2) + eps) * add_norm_w.
void add_rmsnorm(float* residual, const bf16* add, const float* w, bf16* y, int rows, int n, float eps,
                 cudaStream_t stream, const float* add_norm_w = nullptr);

/// Final residual add without norm: residual[r] += add[r].
void add_residual(float* residual, const bf16* add, int rows, int n, cudaStream_t stream);

/// SwiGLU over a fused gate|up GEMM output: gu bf16 [rows, 2 * d_ff] (gate in [0, d_ff), up in
/// [d_ff, 2 d_ff)); out bf16 [rows, d_ff] = silu(gate) * up, computed in fp32.
void swiglu(const bf16* gu, bf16* out, int rows, int d_ff, cudaStream_t stream);

/// GeGLU (Gemma), laid out as swiglu: out = gelu(gate) * up with GELU's tanh approximation, as
/// kernels::geglu computes it (gate * sigmoid(2 sqrt(2/pi) (gate + 0.044715 gate^3))).
void geglu(const bf16* gu, bf16* out, int rows, int d_ff, cudaStream_t stream);

/// Float -> bf16 conversion of n values (weights on load; tests).
void f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream);
/// bf16 -> float conversion of n values.
void bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream);

// ---- step layout shared by RoPE/KV write and attention -----------------------------------------

/// The flattened description of one step, all arrays in device memory. Token rows are grouped by
/// sequence: sequence s owns rows [q_start[s], q_start[s+1]) at positions
/// [pos0[s], pos0[s] + q_len); its KV lives in blocks block_tables[bt_start[s] ...]. After the
/// step, the sequence's KV covers positions [0, pos0[s] + q_len) (kv_len = pos0 + q_len).
struct step_layout {
  int n_seqs = 0;
  int n_tokens = 0;
  int max_q_len = 0;               // >= every sequence's q_len (grid sizing; an upper bound will do,
  int max_kv_len = 0;              // >= every pos0 + q_len       which CUDA graph replays rely on)
  const int32_t* q_start = nullptr;      // [n_seqs + 1]
  const int32_t* pos0 = nullptr;         // [n_seqs]
  const int32_t* bt_start = nullptr;     // [n_seqs]: offset of the sequence's table in block_tables
  const int32_t* block_tables = nullptr; // concatenated block tables
  const int32_t* token_pos = nullptr;    // [n_tokens]: position of each token row
  const int32_t* token_seq = nullptr;    // [n_tokens]: sequence of each token row
  /// KV layer group (engine::kv_shape::n_groups: Gemma 3's sliding-window layers apart from the
  /// full-attention ones) whose tables this layer reads: a sequence's tables lie group after group
  /// from bt_start, each as many entries as its KV then covers (seq_table). 0 with one group.
  int group = 0;
};

/// Sequence seq's block table in group st.group (kv_blocks = ceil((pos0 + q_len) / block_size)
/// entries a group). A sliding group's entries before the window may be -1: never read.
__host__ __device__ inline const int32_t* seq_table(const step_layout& st, int seq, int block_size) {
  const int32_t* t = st.block_tables + st.bt_start[seq];
  if (st.group > 0) {
    const int kv_len = st.pos0[seq] + st.q_start[seq + 1] - st.q_start[seq];
    t += (int64_t)st.group * ((kv_len + block_size - 1) / block_size);
  }
  return t;
}

/// The paged KV cache on the device, one layer addressed at a time.
struct kv_cache_view {
  fp16* base = nullptr;      // block 0, layer 0, K
  int64_t block_elems = 0;   // fp16 values per block (all layers, K and V)
  int n_layers = 0;
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
  __host__ __device__ int64_t row_elems() const { return (int64_t)n_kv_heads * head_dim; }
  /// Start of K for (block, layer); V follows block_size rows later.
  __host__ __device__ fp16* k_block(int32_t block, int layer) const {
    return base + block * block_elems + (int64_t)layer * 2 * block_size * row_elems();
  }
  __host__ __device__ fp16* v_block(int32_t block, int layer) const {
    return k_block(block, layer) + (int64_t)block_size * row_elems();
  }
};

/// RoPE style, matching kernels::rope_style (normal = adjacent pairs, neox = halves).
enum class rope_kind : int { normal = 0, neox = 1 };

struct rope_params {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, n_rot = 0;
  float base = 10000.0f;
  rope_kind kind = rope_kind::normal;
  const float* freq_factors = nullptr;  // device [n_rot / 2] or null
  /// QK-norm (Gemma 3): each Q head RMS-normalized with q_norm, each K head with k_norm (device
  /// fp32 [head_dim]; after the bias, before the rotation); null: none. rope_qkv_store only.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
};

/// Fused bias + RoPE + KV-cache write for one layer. qkv bf16 [n_tokens, (n_heads + 2 n_kv) *
/// head_dim] as the fused QKV GEMM writes it (Q heads, then K heads, then V heads). Adds the
/// optional biases (fp32 [n_heads*hd], [n_kv*hd], [n_kv*hd]; null = none), rotates Q and K at
/// each token's position, writes Q (bf16, rotated) to q_out [n_tokens, n_heads * head_dim], and
/// K (rotated) and V as fp16 into the cache at the token's block/slot of `layer`.
void rope_qkv_store(const bf16* qkv, const float* bq, const float* bk, const float* bv, const rope_params& rp,
                    const step_layout& st, const kv_cache_view& kv, int layer, bf16* q_out, cudaStream_t stream);

// ---- attention over the paged cache -------------------------------------------------------------

/// Causal attention for every token row of the step over its sequence's paged KV (positions
/// [0, token_pos] of the row's sequence), GQA aware (query head h reads kv head h / (n_heads /
/// n_kv_heads)). q bf16 [n_tokens, n_heads * hd]; out bf16 likewise. FlashAttention-style:
/// tiles of queries against tiles of keys with an online softmax in fp32; no score matrix in
/// memory. Rows of decode-only sequences (q_len 1) take a split-KV path (flash-decoding) when
/// their KV is long: partial results go to `scratch` and are merged by a second kernel, or, with
/// `counters`, by the last split to finish (one launch fewer; the result is the same bits).
/// head_dim must be 64, 128 or 256 (others: cuda_error). scale usually 1/sqrt(head_dim). With
/// window > 0 (a sliding-window layer: Gemma 3) a row at position p attends to positions
/// (p - window, p] only, as kernels::attention_partial over that range.
struct attention_scratch {
  float* partial_out = nullptr;  // [n_tokens, n_heads, max_splits, head_dim]
  float* partial_ml = nullptr;   // [n_tokens, n_heads, max_splits, 2] (running max, sum)
  int max_splits = 0;            // 0 disables split-KV
  /// Optional: attention_counters(n_tokens, n_heads) arrival counters, zero before the first
  /// call; every call leaves them at zero again (so graphs may replay it). Not shared between
  /// calls that may run at the same time.
  unsigned* counters = nullptr;
  /// A decode row splits once longer than this many positions, each split keeping at least as
  /// many (up to max_splits and a few waves of CTAs).
  int kv_per_split = 64;
};
/// Bytes of scratch needed for n_tokens rows with up to max_splits splits.
size_t attention_scratch_bytes(int n_tokens, int n_heads, int head_dim, int max_splits);
/// Counters attention_scratch::counters needs for n_tokens rows.
size_t attention_counters(int n_tokens, int n_heads);

void paged_attention(const bf16* q, const step_layout& st, const kv_cache_view& kv, int layer, int n_heads,
                     float scale, bf16* out, const attention_scratch& scratch, cudaStream_t stream, int window = 0);

// ---- weight-only quantized GEMV (decode from quantized memory) ----------------------------------

/// GGUF quantized block types usable directly by gemv_quant (the raw GGUF block layout).
enum class quant_type : int { q8_0 = 0, q4_0 = 1, q4_k = 2, q4_1 = 3, q5_k = 4, q6_k = 5 };

/// The residual add and RMSNorm carried by the GEMVs on either side of them instead of an
/// add_rmsnorm launch (engine::cuda::launch_options::gemv_fold_norm): gemv_bf16 and its fused
/// forms; gemv_quant (a writer or a reader) and its fused forms (readers).
///
/// Writer (the GEMV whose outputs add into the residual stream: attention output, down): with
/// `residual` set, each output is rounded to bf16 and added to residual (fp32 [batch, n_out]) as
/// add_rmsnorm adds it (the same bits), and y receives bf16(new residual * norm_w) instead of the
/// outputs, and sumsq_out[b, c] the sum of squares of the new residual values of CTA c's rows
/// (norm_fold_parts(n_out) of them a row, in a fixed order).
///
/// Reader (the GEMV taking the normalized activations: qkv, gate|up): with `sumsq_in` set, x is
/// such a y (n_in = the writer's n_out) and each dot product is scaled by
/// 1 / sqrt(sum of sumsq_in's row / n_in + eps) before it is rounded: RMSNorm with neither a
/// kernel nor a launch of its own. It differs from add_rmsnorm then gemv_bf16 only where bf16
/// rounding falls (the norm's scale after the product instead of before).
struct gemv_norm {
  float* residual = nullptr;        // writer
  const float* norm_w = nullptr;    // writer: the next RMSNorm's weights [n_out]
  float* sumsq_out = nullptr;       // writer: [batch, norm_fold_parts(n_out)]
  const float* sumsq_in = nullptr;  // reader: [batch, norm_fold_parts(n_in)]
  float eps = 1e-5f;                // reader
};

/// Partial sums of squares a writer GEMV of n_out rows leaves per batch row (one per CTA).
int64_t norm_fold_parts(int64_t n_out);

/// y[b, o] = sum_i W[o, i] * x[b, i] for b in [0, batch) (batch <= 8), W stored as GGUF blocks,
/// row-major, `n_in` values per row (a multiple of the block size: 32, or 256 for the k-quants).
/// x bf16 [batch, n_in]; y bf16 with batch row b at y + b * ldy (ldy 0: n_out), so the parts of a
/// fused matrix of several types write their columns of one output. Accumulates in fp32. unroll
/// (1, 4 or 8): units of 8 weights whose loads each lane issues before decoding the first (the
/// same results; engine::cuda::launch_options::quant_gemv_unroll). norm: see gemv_norm; a writer
/// reads no norm and takes ldy 0.
void gemv_quant(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch,
                cudaStream_t stream, int64_t ldy = 0, int unroll = 1, const gemv_norm& norm = {});
/// As gemv_quant with fp32 outputs (the output head: logits are not rounded to bf16).
void gemv_quant_f32(quant_type t, const void* w, int64_t n_out, int64_t n_in, const bf16* x, float* y, int batch,
                    cudaStream_t stream, int64_t ldy = 0, int unroll = 1);

/// The same product with bf16 weights [n_out, n_in] (n_in a multiple of 8, w and x 16-byte
/// aligned): small-batch decode without cuBLASLt (engine::cuda::launch_options). prefetch_bytes
/// > 0: each row's first that many bytes are asked of L2 before the kernel waits for the one
/// ahead (under pdl_scope; the results are the same). norm: see gemv_norm (default: neither).
void gemv_bf16(const bf16* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch, cudaStream_t stream,
               int prefetch_bytes = 0, const gemv_norm& norm = {});

/// gemv_bf16 over the fused gate|up matrix w [2 * d_ff, n_in] (gate rows first) followed by
/// swiglu, in one kernel: act[b, j] = silu(gate_j . x_b) * (up_j . x_b), each dot product
/// rounded to bf16 first, so act holds the same bits as gemv_bf16 into a [batch, 2 * d_ff]
/// buffer and swiglu from it. Same limits as gemv_bf16; norm may be a reader only (the same
/// bits as gemv_bf16 with that reader, then swiglu).
void gemv_bf16_swiglu(const bf16* w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch,
                      cudaStream_t stream, int prefetch_bytes = 0, const gemv_norm& norm = {});

/// What rope_qkv_store takes besides the qkv activations.
struct qkv_rope_args {
  const float* bq = nullptr;  // optional biases, as rope_qkv_store's
  const float* bk = nullptr;
  const float* bv = nullptr;
  rope_params rope;
  step_layout st;  // batch row t of the GEMV is token row t (st.n_tokens <= 8)
  kv_cache_view kv;
  int layer = 0;
  bf16* q_out = nullptr;
};

/// gemv_bf16 over the fused QKV matrix w [(n_heads + 2 n_kv_heads) * head_dim, n_in] followed by
/// rope_qkv_store, in one kernel (launch_options::gemv_rope): Q and the cache get the same bits
/// as gemv_bf16 into a qkv buffer then rope_qkv_store from it. Same limits as gemv_bf16 with
/// batch = r.st.n_tokens; norm may be a reader only.
void gemv_bf16_rope_qkv(const bf16* w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                        int prefetch_bytes = 0, const gemv_norm& norm = {});

/// A quantized matrix of one type whose rows lie in up to 3 parts (the Q, K and V tensors of a
/// fused QKV, or gate and up, each part's blocks where the loader placed them): part p holds rows
/// [row0[p], row0[p + 1]) (the last up to the matrix's n_out), row0[0] = 0, rows of
/// quant_row_bytes(qt, n_in) bytes. The fused quantized GEMVs read it.
struct quant_matrix {
  quant_type qt = quant_type::q8_0;
  int n_parts = 0;
  const void* raw[3] = {};
  int64_t row0[3] = {};
};

/// gemv_bf16_swiglu over quantized gate|up blocks w (2 * d_ff rows, gate rows first): act gets the
/// bits of gemv_quant into a [batch, 2 * d_ff] buffer and swiglu from it (launch_options::gemv_swiglu
/// on the quantized path). Same limits as gemv_quant; norm may be a reader only.
void gemv_quant_swiglu(const quant_matrix& w, int64_t d_ff, int64_t n_in, const bf16* x, bf16* act, int batch,
                       cudaStream_t stream, int unroll = 1, const gemv_norm& norm = {});

/// gemv_bf16_rope_qkv over quantized QKV blocks w ((n_heads + 2 n_kv_heads) * head_dim rows): Q and
/// the cache get the bits of gemv_quant into a qkv buffer then rope_qkv_store from it
/// (launch_options::gemv_rope on the quantized path). Same limits as gemv_quant with batch =
/// r.st.n_tokens; norm may be a reader only.
void gemv_quant_rope_qkv(const quant_matrix& w, int64_t n_in, const bf16* x, const qkv_rope_args& r, cudaStream_t stream,
                         int unroll = 1, const gemv_norm& norm = {});

/// The shape of gemv_bf16_streamed's pipeline: CTAs per SM, shared-memory stages, bytes a bulk
/// copy (a multiple of 512, at most 64 KiB). Untuned: 2 x 4 x 16 KiB until a device measures.
struct gemv_stream_config {
  int ctas_per_sm = 2;
  int stages = 4;
  int chunk_bytes = 16384;
};

/// The same for one or two rows with weights brought by bulk copies into shared-memory stages
/// (kernels/cuda/gemv_stream.cu; launch_options::bf16_gemv_streamed): n_in a multiple of 256, w
/// and x 16-byte aligned, batch 1 or 2 (cuda_error otherwise). Sums in a fixed order.
void gemv_bf16_streamed(const bf16* w, int64_t n_out, int64_t n_in, const bf16* x, bf16* y, int batch,
                        cudaStream_t stream, const gemv_stream_config& cfg = {});

/// Bytes of one row of n_in values (a multiple of the block size) in type t.
size_t quant_row_bytes(quant_type t, int64_t n_in);

/// n values (a multiple of the block size) of random GGUF blocks of type t at w: random quants,
/// scales set so the weights have mean about 0 and standard deviation about `stddev` (synthetic
/// quantized weights for benchmarks). Seeded: the same bytes for the same arguments.
void fill_random_blocks(quant_type t, void* w, int64_t n, float stddev, uint64_t seed, cudaStream_t stream);

/// Expands GGUF blocks of type t (n values, a multiple of the block size) into bf16.
void dequant_to_bf16(quant_type t, const void* w, int64_t n, bf16* out, cudaStream_t stream);

// ---- sampling on the device ---------------------------------------------------------------------

/// Per-row sampling parameters (device array of n_rows). temperature <= 0 means greedy (argmax,
/// lowest index wins a tie). top_k <= 0: off; top_p >= 1: off; min_p <= 0: off. Penalties use
/// the row's recent tokens (history[hist_start[r] .. hist_start[r+1]) on the device): repetition
/// (llama.cpp: logit > 0 ? logit / rp : logit * rp), presence and frequency (OpenAI). The random
/// draw is a counter-based hash of (seed, draw) so a row's token depends on nothing else.
struct sample_row_params {
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  uint64_t draw = 0;
};

/// Scratch for sample_tokens: bytes needed for n_rows rows of n_vocab.
size_t sample_scratch_bytes(int n_rows, int n_vocab);

/// logits fp32 [n_rows, n_vocab] (modified in place by the penalties only; temperature is applied
/// on the fly); writes one token per row to out_tokens (device int32 [n_rows]).
void sample_tokens(float* logits, int n_rows, int n_vocab, const sample_row_params* params,
                   const int32_t* history, const int32_t* hist_start, void* scratch, int32_t* out_tokens,
                   cudaStream_t stream);

}  // namespace troupe::kernels::cuda
