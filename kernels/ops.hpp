// Element-wise and per-row CPU kernels of the transformer forward: RMSNorm, RoPE, SwiGLU, and
// attention of query rows over a paged fp16 KV cache.
#pragma once

#include <cstdint>

#include "kernels/ggml_types.hpp"

namespace troupe::kernels {

class thread_pool;

/// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], for one row of n. y may alias x.
void rmsnorm_row(const float* x, const float* w, float* y, int64_t n, float eps);

/// RoPE pair conventions: `normal` rotates (2i, 2i+1) (GGUF / llama.cpp "norm"), `neox` rotates
/// (i, i + n_rot/2) (GPT-NeoX, Qwen2).
enum class rope_style { normal, neox };

/// Rotates the first n_rot dims of each of n_heads heads (head_dim apart) of one row in place,
/// with cos_sin holding n_rot/2 (cos, sin) pairs for this row's position.
void rope_row(float* x, int n_heads, int head_dim, int n_rot, const float* cos_sin, rope_style style);

/// Fills cos_sin[n_rot/2 pairs] for position pos: theta_i = pos * base^(-2i/n_rot) / freq_factor_i.
/// freq_factors may be null (all 1).
void rope_cos_sin(int64_t pos, int n_rot, float base, const float* freq_factors, float* cos_sin);

/// gate[i] = silu(gate[i]) * up[i], n elements.
void swiglu(float* gate, const float* up, int64_t n);

/// gate[i] = gelu(gate[i]) * up[i] with GELU's tanh approximation (as ggml and Gemma), n elements.
void geglu(float* gate, const float* up, int64_t n);

/// A paged KV cache view for one layer: block b holds K and V for block_size positions of
/// n_kv_heads heads, head_dim fp16 values each. K of (block, slot, head) is at
/// k_base + block * block_stride + slot * slot_step() + head * head_step(); V likewise.
/// Strides 0 mean slot-major rows (all heads of a position together, as the CUDA cache lays
/// them out); engine::kv_storage lays each head's positions out together (head-major), so one
/// KV head's rows of a block are contiguous for the attention kernels.
struct kv_layer_view {
  fp16_t* k_base = nullptr;
  fp16_t* v_base = nullptr;
  int64_t block_stride = 0;  // in fp16 elements between consecutive blocks
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t slot_stride = 0;  // between positions of one head (0: n_kv_heads * head_dim)
  int64_t head_stride = 0;  // between heads of one position (0: head_dim)
  int64_t slot_step() const { return slot_stride ? slot_stride : (int64_t)n_kv_heads * head_dim; }
  int64_t head_step() const { return head_stride ? head_stride : head_dim; }
  fp16_t* k_at(int32_t block, int slot, int head) const {
    return k_base + block * block_stride + slot * slot_step() + head * head_step();
  }
  fp16_t* v_at(int32_t block, int slot, int head) const {
    return v_base + block * block_stride + slot * slot_step() + head * head_step();
  }
};

/// Causal attention for one query row at position `pos` over positions [0, pos] of a sequence
/// whose KV lives in the blocks of `block_table`. q: n_heads * head_dim floats; out likewise.
/// Heads [h0, h1) only. scratch: >= attention_scratch_floats(h1 - h0, head_dim, pos + 1).
void attention_row(const float* q, int n_heads, int64_t pos, const kv_layer_view& kv,
                   const int32_t* block_table, float scale, float* out, int h0, int h1, float* scratch);

/// One part of a row's attention, over positions [p0, p1) (p0 < p1), for heads [h0, h1): per
/// head (index h - h0) the largest scaled score m, l = sum over the part of exp(score - m) and
/// acc = sum of exp(score - m) * V (head_dim floats, unnormalised). Parts of one row over
/// disjoint ranges combine with attention_merge (flash-decoding on the CPU: a long context
/// splits across threads). Query heads that share a KV head read each K and V row once.
/// scratch: >= attention_scratch_floats(h1 - h0, head_dim, p1 - p0).
void attention_partial(const float* q, int n_heads, int64_t p0, int64_t p1, const kv_layer_view& kv,
                       const int32_t* block_table, float scale, int h0, int h1, float* m, float* l, float* acc,
                       float* scratch);

/// out[h] = sum_i exp(m_i[h] - M) acc_i[h] / sum_i exp(m_i[h] - M) l_i[h] over n_parts parts, M the
/// largest m_i[h]; part i's values at m[i * n_heads + h], l likewise, acc[(i * n_heads + h) * head_dim].
void attention_merge(int n_parts, int n_heads, int head_dim, const float* m, const float* l, const float* acc,
                     float* out);

/// Scratch floats attention_row / attention_partial need for n_heads heads over n_pos positions.
inline int64_t attention_scratch_floats(int n_heads, int head_dim, int64_t n_pos) {
  return 2 * (int64_t)n_heads + 4 * (int64_t)head_dim + 4 * (n_pos + 8);
}

/// Writes one position's K and V rows (floats, n_kv_heads * head_dim each) into the cache.
void kv_store_row(const kv_layer_view& kv, int32_t block, int slot, const float* k, const float* v);

}  // namespace troupe::kernels
