#include "engine/forward.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/communicator.hpp"
#include "engine/tensor_parallel.hpp"
#include "kernels/dequant.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::engine {

using kernels::thread_pool;

cpu_forward::cpu_forward(const model& m, kv_storage& kv, thread_pool& pool, forward_part p)
    : m_(m),
      shard_(p.shard),
      comm_(p.comm),
      layer_begin_(p.layer_begin),
      layer_end_(p.layer_end < 0 ? m.hparams().n_layers : p.layer_end),
      hp_(p.shard ? p.shard->hp : m.hparams()),
      kv_(kv),
      pool_(pool) {
  if ((p.shard == nullptr) != (p.comm == nullptr) || (p.shard && (p.shard->rank != p.comm->rank() || p.shard->n_ranks != p.comm->size())))
    throw std::invalid_argument("cpu_forward: a shard needs the communicator of its rank");
  if (layer_begin_ < 0 || layer_begin_ >= layer_end_ || layer_end_ > m.hparams().n_layers)
    throw std::invalid_argument("cpu_forward: layers [" + std::to_string(layer_begin_) + ", " + std::to_string(layer_end_) +
                                ") are not a range of the model's " + std::to_string(m.hparams().n_layers));
  const auto& hp = hp_;
  const auto& s = kv.shape();
  const bool layers_ok = s.slots.empty() ? s.n_layers == layer_end_ - layer_begin_
                                         : layer_begin_ == 0 && s.slots.size() == (size_t)layer_end_ && layer_end_ == m.hparams().n_layers;
  if (!layers_ok || s.n_kv_heads != hp.n_kv_heads || s.head_dim != hp.head_dim)
    throw std::invalid_argument("cpu_forward: KV storage shape does not match the model");
  for (int il = layer_begin_; il < layer_end_ && !s.slots.empty(); ++il)
    if (s.slot_of(il).slot >= s.n_layers || s.slot_of(il).group >= s.n_groups || (s.slot_of(il).group > 0) != m.layer(il).sliding)
      throw std::invalid_argument("cpu_forward: the KV layer groups do not match the model's sliding-window layers");
}

const layer_weights& cpu_forward::layer(int il) const { return shard_ ? shard_->layers[(size_t)il] : m_.layer(il); }

kv_shape model_kv_shape(const model& m, int block_size, bool grouped) {
  const auto& hp = m.hparams();
  std::vector<bool> sliding((size_t)hp.n_layers);
  for (int il = 0; il < hp.n_layers; ++il) sliding[(size_t)il] = m.layer(il).sliding;
  return make_kv_shape(sliding, hp.n_kv_heads, hp.head_dim, block_size, hp.sliding_window, grouped);
}

void validate_batch(std::span<const seq_chunk> batch, int n_vocab, int block_size, int32_t n_blocks, int n_groups, int window) {
  for (size_t i = 0; i < batch.size(); ++i) {
    const seq_chunk& c = batch[i];
    if (c.tokens.empty()) throw std::invalid_argument("forward: chunk " + std::to_string(i) + " has no tokens");
    for (token_id t : c.tokens)
      if (t < 0 || t >= n_vocab)
        throw std::invalid_argument("forward: token id " + std::to_string(t) + " outside the vocabulary [0, " +
                                    std::to_string(n_vocab) + ")");
    const int64_t end = c.pos0 + (int64_t)c.tokens.size();
    const size_t per_group = c.block_table.size() / (size_t)n_groups;
    if (c.pos0 < 0 || c.block_table.size() % (size_t)n_groups != 0 || (int64_t)per_group < kv_blocks_for(end, block_size))
      throw std::invalid_argument("forward: block table of chunk " + std::to_string(i) + " does not cover position " +
                                  std::to_string(end - 1));
    // A sliding-window group reads from the window of the chunk's first position on.
    const auto live = (size_t)(std::max<int64_t>(0, c.pos0 - window + 1) / block_size);
    for (size_t k = 0; k < c.block_table.size(); ++k) {
      const int32_t b = c.block_table[k];
      if (b == -1 && k >= per_group && k % per_group < live) continue;
      if (b < 0 || b >= n_blocks) throw std::invalid_argument("forward: block id " + std::to_string(b) + " out of range");
    }
  }
}

namespace {

void grow(std::vector<float>& v, int64_t size) {
  if ((int64_t)v.size() < size) v.resize((size_t)size);
}

}  // namespace

void cpu_forward::resize(int64_t n) {
  const auto& hp = hp_;
  const int64_t d = hp.d_model, qd = (int64_t)hp.n_heads * hp.head_dim, kvd = (int64_t)hp.n_kv_heads * hp.head_dim;
  grow(x_, n * d);
  grow(h_, n * d);
  grow(q_, n * qd);
  grow(k_, n * kvd);
  grow(v_, n * kvd);
  grow(o_, n * qd);
  grow(gate_, n * hp.d_ff);
  grow(up_, n * hp.d_ff);
  grow(cos_sin_, n * hp.n_rot);
  if (hp.sliding_window > 0) grow(cos_sin_swa_, n * hp.n_rot);
}

// Splits each row's positions [lo, pos] (lo = 0, or the first position of a sliding window of
// `window` positions) into parts of attention_part_positions, so a decode at a long context
// spreads over the threads (flash-decoding). The split depends on the row alone, never on the
// rest of the batch: a row's logits stay bit-identical whatever shares its step. When parts are
// fewer than two per thread (short contexts), each part's KV heads are split into items too
// (heads are independent: no effect on the numbers). Items are taken longest first, one at a
// time, so a prefill's causal rows (row r attends to r + 1 positions) balance.
void cpu_forward::plan_attention(int64_t n, int64_t window, attn_plan& plan) {
  const auto& hp = hp_;
  const int64_t nth = pool_.size();
  const int64_t len = attention_part_positions;
  plan.max_len = 0;
  plan.parts.clear();
  plan.row_parts.assign((size_t)n + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    plan.row_parts[(size_t)r] = (int64_t)plan.parts.size();
    const int64_t end = pos_[(size_t)r] + 1;
    for (int64_t p0 = window > 0 ? std::max<int64_t>(0, end - window) : 0; p0 < end; p0 += len) {
      plan.parts.push_back({r, p0, std::min(end, p0 + len)});
      plan.max_len = std::max(plan.max_len, plan.parts.back().p1 - p0);
    }
  }
  plan.row_parts[(size_t)n] = (int64_t)plan.parts.size();
  const auto n_parts = (int64_t)plan.parts.size();
  const int group = hp.n_heads / hp.n_kv_heads;
  const int splits = (int)std::clamp<int64_t>((2 * nth + n_parts - 1) / n_parts, 1, hp.n_kv_heads);
  plan.items.clear();
  plan.row_items.assign((size_t)n, 0);
  for (int64_t i = 0; i < n_parts; ++i)
    for (int c = 0; c < splits; ++c) {
      const int k0 = hp.n_kv_heads * c / splits, k1 = hp.n_kv_heads * (c + 1) / splits;
      plan.items.push_back({i, k0 * group, k1 * group});
      ++plan.row_items[(size_t)plan.parts[(size_t)i].row];
    }
  auto cost = [&](const attn_item& it) {
    return (plan.parts[(size_t)it.part].p1 - plan.parts[(size_t)it.part].p0) * (it.h1 - it.h0);
  };
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const attn_item& a, const attn_item& b) { return cost(a) > cost(b); });
  grow(part_m_, n_parts * hp.n_heads);
  grow(part_l_, n_parts * hp.n_heads);
  grow(part_acc_, n_parts * hp.n_heads * hp.head_dim);
  scratch_per_thread_ = std::max(scratch_per_thread_, kernels::attention_scratch_floats(hp.n_heads, hp.head_dim, plan.max_len));
  grow(attn_scratch_, nth * scratch_per_thread_);
}

// Mixture of experts (Mixtral's routing, as llama.cpp): the router's softmax over every expert,
// each row's n_experts_used most probable (ties: the lower index), their probabilities
// renormalized to sum 1. Each expert this forward holds takes the rows routed to it, gathered,
// through its SwiGLU; its outputs are added back weighted, a row's experts in index order (so a
// row's result does not depend on the batch). An expert-parallel shard holds some experts: its
// sums are partial, completed by the all-reduce that follows.
void cpu_forward::moe_ffn(const layer_weights& L, int64_t n) {
  const auto& hp = hp_;
  const int64_t d = hp.d_model, n_e = hp.n_experts, k = hp.n_experts_used, ff = hp.d_ff;
  grow(router_, n * n_e);
  kernels::matmul(L.router, h_.data(), d, n, router_.data(), n_e, pool_);
  route_e_.resize((size_t)(n * k));
  route_w_.resize((size_t)(n * k));
  pool_.parallel_for(n, 16, [&](int64_t r0, int64_t r1, int) {
    std::vector<int32_t> order((size_t)n_e);
    for (int64_t r = r0; r < r1; ++r) {
      float* p = &router_[(size_t)(r * n_e)];
      const float mx = *std::max_element(p, p + n_e);
      float sum = 0;
      for (int64_t e = 0; e < n_e; ++e) sum += p[e] = std::exp(p[e] - mx);
      for (int64_t e = 0; e < n_e; ++e) p[e] /= sum;
      for (int64_t e = 0; e < n_e; ++e) order[(size_t)e] = (int32_t)e;
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      float wsum = 0;
      for (int64_t j = 0; j < k; ++j) wsum += p[order[(size_t)j]];
      for (int64_t j = 0; j < k; ++j) {
        route_e_[(size_t)(r * k + j)] = order[(size_t)j];
        route_w_[(size_t)(r * k + j)] = p[order[(size_t)j]] / wsum;
      }
    }
  });
  grow(moe_x_, n * d);
  grow(moe_y_, n * d);
  moe_out_.assign((size_t)(n * d), 0.0f);
  for (size_t le = 0; le < L.expert_gate.size(); ++le) {
    const int32_t e = L.expert_begin + (int32_t)le;
    moe_rows_.clear();
    moe_wt_.clear();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < k; ++j)
        if (route_e_[(size_t)(r * k + j)] == e) {
          moe_rows_.push_back((int32_t)r);
          moe_wt_.push_back(route_w_[(size_t)(r * k + j)]);
        }
    const auto m = (int64_t)moe_rows_.size();
    if (m == 0) continue;
    for (int64_t i = 0; i < m; ++i) std::copy_n(&h_[(size_t)(moe_rows_[(size_t)i] * d)], d, &moe_x_[(size_t)(i * d)]);
    const kernels::matmul_out gate_up[2] = {{L.expert_gate[le], gate_.data(), ff}, {L.expert_up[le], up_.data(), ff}};
    kernels::matmul_batch(gate_up, moe_x_.data(), d, m, pool_);
    kernels::swiglu(gate_.data(), up_.data(), m * ff);
    kernels::matmul(L.expert_down[le], gate_.data(), ff, m, moe_y_.data(), d, pool_);
    for (int64_t i = 0; i < m; ++i) {
      float* out = &moe_out_[(size_t)(moe_rows_[(size_t)i] * d)];
      const float* y = &moe_y_[(size_t)(i * d)];
      const float w = moe_wt_[(size_t)i];
      for (int64_t c = 0; c < d; ++c) out[c] += w * y[c];
    }
  }
  std::copy_n(moe_out_.begin(), n * d, h_.begin());
}

// h_ = RMSNorm(h_) * w, row by row (Gemma's norm of each block's output before the residual add).
void cpu_forward::post_norm(const std::vector<float>& w, int64_t n) {
  const auto& hp = hp_;
  const int64_t d = hp.d_model;
  pool_.parallel_for(n, 8, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) kernels::rmsnorm_row(&h_[(size_t)(r * d)], w.data(), &h_[(size_t)(r * d)], d, hp.norm_eps);
  });
}

const std::vector<float>& cpu_forward::forward(std::span<const seq_chunk> batch, std::vector<float>* hidden) {
  const kv_shape& ks = kv_.shape();
  validate_batch(batch, hp_.n_vocab, ks.block_size, kv_.n_blocks(), ks.n_groups, ks.window);
  const auto& hp = hp_;
  const int64_t d = hp.d_model, qd = (int64_t)hp.n_heads * hp.head_dim, kvd = (int64_t)hp.n_kv_heads * hp.head_dim;
  const int bs = kv_.shape().block_size;

  // Lay the batch out as token rows.
  int64_t n = 0;
  for (const auto& c : batch) n += (int64_t)c.tokens.size();
  resize(n);
  pos_.resize((size_t)n);
  row_seq_.resize((size_t)n);
  for (int64_t r = 0, ci = 0; ci < (int64_t)batch.size(); ++ci)
    for (int64_t j = 0; j < (int64_t)batch[ci].tokens.size(); ++j, ++r) {
      pos_[(size_t)r] = batch[ci].pos0 + j;
      row_seq_[(size_t)r] = {(int32_t)ci, (int32_t)j};
    }
  plan_attention(n, 0, full_);
  if (hp.sliding_window > 0) plan_attention(n, hp.sliding_window, window_);

  // Embeddings (Gemma: times sqrt(d_model)), or a pipeline stage's input rows; RoPE angles
  // (sliding-window layers: their own base).
  const bool embed = layer_begin_ == 0, last = layer_end_ == m_.hparams().n_layers;
  if (!embed && (!hidden || (int64_t)hidden->size() != n * d))
    throw std::invalid_argument("forward: a stage after the first needs the batch's " + std::to_string(n) + " hidden rows");
  if (!embed) std::copy(hidden->begin(), hidden->end(), x_.begin());
  const auto& emb = m_.token_embd();
  const float* freq = m_.rope_freq_factors().empty() ? nullptr : m_.rope_freq_factors().data();
  const float embd_scale = hp.gemma ? std::sqrt((float)d) : 1.0f;
  pool_.parallel_for(n, 4, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const auto [ci, j] = row_seq_[(size_t)r];
      const token_id t = batch[(size_t)ci].tokens[(size_t)j];
      float* x = &x_[(size_t)(r * d)];
      if (embed) {
        kernels::dequantize_row(emb.type, (const uint8_t*)emb.data + (size_t)t * emb.row_stride, x, d);
        if (embd_scale != 1.0f)
          for (int64_t i = 0; i < d; ++i) x[i] *= embd_scale;
      }
      kernels::rope_cos_sin(pos_[(size_t)r], hp.n_rot, hp.rope_base, freq, &cos_sin_[(size_t)(r * hp.n_rot)]);
      if (hp.sliding_window > 0)
        kernels::rope_cos_sin(pos_[(size_t)r], hp.n_rot, hp.rope_base_swa, freq, &cos_sin_swa_[(size_t)(r * hp.n_rot)]);
    }
  });

  const float attn_scale = hp.attn_scale > 0 ? hp.attn_scale : 1.0f / std::sqrt((float)hp.head_dim);
  for (int il = layer_begin_; il < layer_end_; ++il) {
    const layer_weights& L = layer(il);
    const kv_slot where = ks.slots.empty() ? kv_slot{0, (int16_t)(il - layer_begin_)} : ks.slot_of(il);
    const kernels::kv_layer_view kv = kv_.layer(where.slot);
    // The chunk's block table of this layer's group (group after group, each as long).
    const auto table_of = [&](int64_t ci) {
      const auto& t = batch[(size_t)ci].block_table;
      return t.data() + (size_t)where.group * (t.size() / (size_t)ks.n_groups);
    };
    const attn_plan& plan = L.sliding ? window_ : full_;
    const std::vector<float>& cos_sin = L.sliding ? cos_sin_swa_ : cos_sin_;

    // Attention block: norm, Q/K/V projections, RoPE, KV write.
    pool_.parallel_for(n, 8, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) kernels::rmsnorm_row(&x_[(size_t)(r * d)], L.attn_norm.data(), &h_[(size_t)(r * d)], d, hp.norm_eps);
    });
    const kernels::matmul_out qkv[3] = {{L.wq, q_.data(), qd}, {L.wk, k_.data(), kvd}, {L.wv, v_.data(), kvd}};
    kernels::matmul_batch(qkv, h_.data(), d, n, pool_);
    pool_.parallel_for(n, 4, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        float* q = &q_[(size_t)(r * qd)];
        float* k = &k_[(size_t)(r * kvd)];
        float* v = &v_[(size_t)(r * kvd)];
        if (!L.bq.empty()) {
          for (int64_t i = 0; i < qd; ++i) q[i] += L.bq[(size_t)i];
          for (int64_t i = 0; i < kvd; ++i) k[i] += L.bk[(size_t)i];
          for (int64_t i = 0; i < kvd; ++i) v[i] += L.bv[(size_t)i];
        }
        if (!L.q_norm.empty()) {  // QK-norm: each head's query and key RMS-normalised
          for (int h = 0; h < hp.n_heads; ++h) kernels::rmsnorm_row(q + h * hp.head_dim, L.q_norm.data(), q + h * hp.head_dim, hp.head_dim, hp.norm_eps);
          for (int h = 0; h < hp.n_kv_heads; ++h) kernels::rmsnorm_row(k + h * hp.head_dim, L.k_norm.data(), k + h * hp.head_dim, hp.head_dim, hp.norm_eps);
        }
        const float* cs = &cos_sin[(size_t)(r * hp.n_rot)];
        kernels::rope_row(q, hp.n_heads, hp.head_dim, hp.n_rot, cs, hp.rope);
        kernels::rope_row(k, hp.n_kv_heads, hp.head_dim, hp.n_rot, cs, hp.rope);
        const auto [ci, j] = row_seq_[(size_t)r];
        const int64_t p = pos_[(size_t)r];
        kernels::kv_store_row(kv, table_of(ci)[p / bs], (int)(p % bs), k, v);
      }
    });

    // Attention over the paged cache: threads take items in turn; whoever finishes a row's last
    // item merges that row's parts.
    row_left_ = plan.row_items;
    std::atomic<int64_t> next{0};
    pool_.run([&](int ith, int) {
      float* scratch = &attn_scratch_[(size_t)(ith * scratch_per_thread_)];
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < (int64_t)plan.items.size();) {
        const attn_item& it = plan.items[(size_t)i];
        const attn_part& pt = plan.parts[(size_t)it.part];
        const auto [ci, j] = row_seq_[(size_t)pt.row];
        const int64_t at = it.part * hp.n_heads + it.h0;
        kernels::attention_partial(&q_[(size_t)(pt.row * qd)], hp.n_heads, pt.p0, pt.p1, kv,
                                   table_of(ci), attn_scale, it.h0, it.h1, &part_m_[(size_t)at],
                                   &part_l_[(size_t)at], &part_acc_[(size_t)(at * hp.head_dim)], scratch);
        if (std::atomic_ref<int32_t>(row_left_[(size_t)pt.row]).fetch_sub(1, std::memory_order_acq_rel) == 1) {
          const int64_t first = plan.row_parts[(size_t)pt.row];
          kernels::attention_merge((int)(plan.row_parts[(size_t)pt.row + 1] - first), hp.n_heads, hp.head_dim,
                                   &part_m_[(size_t)(first * hp.n_heads)], &part_l_[(size_t)(first * hp.n_heads)],
                                   &part_acc_[(size_t)(first * qd)], &o_[(size_t)(pt.row * qd)]);
        }
      }
    });
    kernels::matmul(L.wo, o_.data(), qd, n, h_.data(), d, pool_);
    if (comm_ && shard_->split_attention) comm_->all_reduce_sum(h_.data(), (size_t)(n * d));  // the ranks' heads' partial sums
    if (!L.post_attn_norm.empty()) post_norm(L.post_attn_norm, n);
    for (int64_t i = 0; i < n * d; ++i) x_[(size_t)i] += h_[(size_t)i];

    // Feed-forward block: norm, SwiGLU (or the mixture of experts), down projection, residual.
    pool_.parallel_for(n, 8, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) kernels::rmsnorm_row(&x_[(size_t)(r * d)], L.ffn_norm.data(), &h_[(size_t)(r * d)], d, hp.norm_eps);
    });
    if (hp.n_experts > 0) {
      moe_ffn(L, n);
    } else {
      const kernels::matmul_out gate_up[2] = {{L.w_gate, gate_.data(), hp.d_ff}, {L.w_up, up_.data(), hp.d_ff}};
      kernels::matmul_batch(gate_up, h_.data(), d, n, pool_);
      pool_.parallel_for(n, 4, [&](int64_t r0, int64_t r1, int) {
        if (hp.gemma) kernels::geglu(&gate_[(size_t)(r0 * hp.d_ff)], &up_[(size_t)(r0 * hp.d_ff)], (r1 - r0) * hp.d_ff);
        else kernels::swiglu(&gate_[(size_t)(r0 * hp.d_ff)], &up_[(size_t)(r0 * hp.d_ff)], (r1 - r0) * hp.d_ff);
      });
      kernels::matmul(L.w_down, gate_.data(), hp.d_ff, n, h_.data(), d, pool_);
    }
    if (comm_) comm_->all_reduce_sum(h_.data(), (size_t)(n * d));  // the ranks' feed-forward columns' (or experts') partial sums
    if (!L.post_ffn_norm.empty()) post_norm(L.post_ffn_norm, n);
    for (int64_t i = 0; i < n * d; ++i) x_[(size_t)i] += h_[(size_t)i];
  }

  // A stage before the last hands its rows on (rank 0 of a group: the ranks' rows are the same,
  // and the others have read `hidden` before the first all-reduce that rank 0 passed).
  if (!last) {
    if (!hidden) throw std::invalid_argument("forward: a stage before the last needs somewhere to put its hidden rows");
    if (!comm_ || comm_->rank() == 0) hidden->assign(x_.begin(), x_.begin() + n * d);
    logits_.clear();
    return logits_;
  }
  // Output rows: every row of all_logits chunks, else each chunk's last row (rank 0 of a group only).
  if (comm_ && comm_->rank() != 0) {
    logits_.clear();
    return logits_;
  }
  int64_t n_out = 0;
  for (const auto& c : batch) n_out += c.no_logits ? 0 : c.all_logits ? (int64_t)c.tokens.size() : 1;
  if ((int64_t)out_rows_.size() < n_out * d) out_rows_.resize((size_t)(n_out * d));
  for (int64_t r = 0, o = 0, ci = 0; ci < (int64_t)batch.size(); ++ci) {
    const int64_t len = (int64_t)batch[ci].tokens.size();
    const int64_t first = batch[ci].no_logits ? len : batch[ci].all_logits ? 0 : len - 1;
    for (int64_t j = first; j < len; ++j, ++o)
      kernels::rmsnorm_row(&x_[(size_t)((r + j) * d)], m_.output_norm().data(), &out_rows_[(size_t)(o * d)], d, hp.norm_eps);
    r += len;
  }
  logits_.resize((size_t)(n_out * hp.n_vocab));
  if (n_out > 0) kernels::matmul(m_.output(), out_rows_.data(), d, n_out, logits_.data(), hp.n_vocab, pool_);
  return logits_;
}

}  // namespace troupe::engine
