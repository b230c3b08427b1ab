// The batched transformer forward on the CPU. One call runs one step for many sequences at once:
// prefill chunks and single-token decodes mixed, each sequence reading and writing its own paged
// KV cache through its block table. Rows are computed independently, so a sequence's result
// does not depend on what else is in the batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/kv_cache.hpp"
#include "engine/model.hpp"

namespace troupe::kernels {
class thread_pool;
}

namespace troupe::engine {

struct model_shard;
class communicator;

/// One sequence's part of a step: tokens at positions [pos0, pos0 + tokens.size()).
struct seq_chunk {
  std::span<const token_id> tokens;
  int64_t pos0 = 0;
  // Covers positions [0, pos0 + tokens.size()): with KV layer groups (kv_shape::n_groups), each
  // group's table in turn, all as long; a sliding group's entries before the window of pos0 may
  // be -1 (given back).
  std::span<const int32_t> block_table;
  bool all_logits = false;                // logits for every token, else for the last one only
  bool no_logits = false;                 // no logits at all (a prefill chunk that ends mid-prompt)
};

/// Checks a step before any backend runs it: every chunk has tokens with ids in [0, n_vocab), and
/// a block table that covers its positions with ids in [0, n_blocks) (-1 in a sliding group's
/// table before the window of `window` positions). Throws std::invalid_argument naming the
/// chunk, token or block.
void validate_batch(std::span<const seq_chunk> batch, int n_vocab, int block_size, int32_t n_blocks, int n_groups = 1,
                    int window = 0);

/// The KV shape of model m with blocks of block_size positions: with `grouped`, its sliding-window
/// layers in groups of their own (make_kv_shape); else one group of every layer.
kv_shape model_kv_shape(const model& m, int block_size, bool grouped);

/// What part of the model this forward runs (default: all of it).
struct forward_part {
  /// One rank of a tensor-parallel group (engine/tensor_parallel.hpp): its share of the heads
  /// and feed-forward columns over `kv` (its KV heads), the partial sums completed by comm's
  /// all-reduce. Only rank 0 computes logits (the others return none). Both outlive the forward.
  const model_shard* shard = nullptr;
  communicator* comm = nullptr;
  /// One pipeline stage (engine/pipeline_parallel.hpp): layers [layer_begin, layer_end) over
  /// `kv` holding those layers only (-1: to the last layer).
  int layer_begin = 0, layer_end = -1;
};

class cpu_forward {
 public:
  /// Positions per part of a row's attention (the parts are merged; see plan_attention).
  static constexpr int64_t attention_part_positions = 256;

  cpu_forward(const model& m, kv_storage& kv, kernels::thread_pool& pool, forward_part p = {});

  /// Runs one step. Returns the logits rows, n_vocab floats each, in batch order: every token of
  /// a chunk with all_logits, none for a chunk with no_logits, else its last token. The KV of every token is written to the cache.
  /// Throws std::invalid_argument (nothing written) when a token id is out of range or a block
  /// table does not cover its positions.
  const std::vector<float>& forward(std::span<const seq_chunk> batch) { return forward(batch, nullptr); }
  /// A pipeline stage's step: `hidden` holds the batch's token rows (d_model floats each, in batch
  /// order); a stage that does not start at layer 0 reads them instead of embedding the tokens,
  /// one that does not end at the last layer writes its output rows there (and returns no logits).
  const std::vector<float>& forward(std::span<const seq_chunk> batch, std::vector<float>* hidden);
  /// The logits of the last forward.
  const std::vector<float>& logits() const { return logits_; }
  /// The hyperparameters it runs with (a shard's heads and feed-forward width).
  const model_hparams& hparams() const { return hp_; }

 private:
  void resize(int64_t n_tokens);
  void post_norm(const std::vector<float>& w, int64_t n_tokens);
  void moe_ffn(const layer_weights& L, int64_t n_tokens);  // h_ <- the mixture of experts' output for h_
  struct attn_plan;
  void plan_attention(int64_t n_tokens, int64_t window, attn_plan& plan);

  const layer_weights& layer(int il) const;  // the model's, or the shard's

  const model& m_;
  const model_shard* shard_;
  communicator* comm_;
  int layer_begin_, layer_end_;
  const model_hparams& hp_;  // the model's, or the shard's (its heads and feed-forward width)
  kv_storage& kv_;
  kernels::thread_pool& pool_;
  // Scratch, grown on demand and reused across steps.
  std::vector<float> x_, h_, q_, k_, v_, o_, gate_, up_, cos_sin_, cos_sin_swa_, attn_scratch_, out_rows_, logits_;
  std::vector<float> router_, route_w_, moe_x_, moe_y_, moe_out_, moe_wt_;  // mixture of experts
  std::vector<int32_t> route_e_, moe_rows_;
  // Attention work: a row's positions split into parts (a long context spreads over the
  // threads), a part's heads into items when parts alone are too few to feed every thread.
  struct attn_part {
    int64_t row, p0, p1;
  };
  struct attn_item {
    int64_t part;
    int h0, h1;
  };
  struct attn_plan {
    std::vector<attn_part> parts;
    std::vector<attn_item> items;      // longest first: threads take them in turn
    std::vector<int64_t> row_parts;    // row r's parts are [row_parts[r], row_parts[r + 1])
    std::vector<int32_t> row_items;    // items per row
    int64_t max_len = 0;               // positions of the longest part
  };
  attn_plan full_, window_;            // causal attention; a sliding window's (Gemma 3)
  std::vector<int32_t> row_left_;      // items of each row not done in this layer
  std::vector<float> part_m_, part_l_, part_acc_;
  int64_t scratch_per_thread_ = 0;
  std::vector<int64_t> pos_;
  std::vector<std::pair<int32_t, int32_t>> row_seq_;  // token row -> (chunk index, index in chunk)
};

}  // namespace troupe::engine
