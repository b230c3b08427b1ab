#include "engine/cuda/cuda_forward.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace troupe::engine::cuda {

namespace {

constexpr int max_decode_bucket = 256;
constexpr int min_context_bound = 256;

// Smallest bucket (a power of two up to 256) that holds n sequences.
int decode_bucket(int n) { return (int)std::bit_ceil((unsigned)std::max(n, 1)); }

// Upper bound of the longest context that a decode step tells attention: a power of two, so a
// graph serves every context up to it.
int context_bound(int kv_len) { return (int)std::bit_ceil((unsigned)std::max(kv_len, min_context_bound)); }


// The CUDA forward is the Llama-family one (llama, mistral, qwen2) and Gemma 3's.
const model& supported(const model& m) {
  if (m.hparams().n_experts > 0)
    throw std::invalid_argument("the CUDA backend does not run mixture-of-experts models yet: use --device cpu");
  return m;
}

}  // namespace

/// One step, as laid out in the staging buffer.
struct cuda_forward::plan {
  bool decode = false;  // padded decode step: same kernels and arguments eager or as a graph
  int n_seqs = 0, n_tokens = 0, n_real_seqs = 0;
  int max_q_len = 0, max_kv_len = 0;
  int n_out = 0;                      // logits rows returned
  bool gather = false;                // eager: output rows are not token rows 0..n_out-1
  std::vector<int32_t> out_dev_rows;  // decode: token row of each output row
  int n_sample = 0;                   // rows sample_tokens reads
  int n_history = 0;                  // history token ids staged
  size_t layout_bytes = 0;            // staging bytes to copy before the step
};

cuda_forward::cuda_forward(const model& m, const cuda_options& o)
    : opt_(o),
      device_((select_device(o.device), o.device)),
      weights_(supported(m).dummy() ? device_weights(m.hparams(), m.dummy_seed(), compute_.get(), m.rope_freq_factors())
                                    : device_weights(m, o.weights, compute_.get())) {
  setup();
}

cuda_forward::cuda_forward(synthetic_tag, const model_hparams& hp, const cuda_options& o)
    : opt_(o),
      device_((select_device(o.device), o.device)),
      weights_(hp, o.synthetic_seed, compute_.get(), {}, o.synthetic_weights, o.weights) {
  setup();
}

std::unique_ptr<cuda_forward> cuda_forward::synthetic(const std::string& arch, const cuda_options& o) {
  return synthetic(synthetic_hparams(arch), o);
}

std::unique_ptr<cuda_forward> cuda_forward::synthetic(const model_hparams& hp, const cuda_options& o) {
  return std::unique_ptr<cuda_forward>(new cuda_forward(synthetic_tag{}, hp, o));
}

cuda_forward::~cuda_forward() {
  try {
    synchronize();
  } catch (const kc::cuda_error&) {  // a failed device: release what can be released
  }
  drop_graphs();
  if (logits_registered_) cudaHostUnregister(logits_.data());
}

void cuda_forward::drop_graphs() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  graphs_.clear();
}

void cuda_forward::set_launch_options(const launch_options& l) {
  synchronize();
  drop_graphs();
  graph_error_.clear();  // a capture that failed under other options is tried again under these
  opt_.launch = l;
}

void cuda_forward::setup() {
  const model_hparams& hp = hparams();
  if (hp.head_dim != 64 && hp.head_dim != 128 && hp.head_dim != 256)
    throw std::invalid_argument("cuda_forward: head size " + std::to_string(hp.head_dim) + " (the CUDA attention takes 64, 128 or 256)");
  const int64_t d = hp.d_model, qd = (int64_t)hp.n_heads * hp.head_dim, kvd = (int64_t)hp.n_kv_heads * hp.head_dim;
  const int64_t qkv_dim = qd + 2 * kvd;
  std::vector<bool> sliding((size_t)hp.n_layers);  // as engine::model_kv_shape lays the model out
  for (int il = 0; il < hp.n_layers; ++il) sliding[(size_t)il] = weights_.layer(il).sliding;
  kv_shape_ = make_kv_shape(sliding, hp.n_kv_heads, hp.head_dim, opt_.block_size, hp.sliding_window, opt_.kv_window_groups);

  const int top_bucket = decode_bucket(std::min(std::max(opt_.max_seqs, 1), max_decode_bucket));
  cap_seqs_ = std::max(opt_.max_seqs, top_bucket);  // a padded decode step stages a whole bucket
  cap_tokens_ = std::max(opt_.max_batch_tokens, max_decode_bucket);
  cap_logits_ = std::max(opt_.max_logit_rows, top_bucket);
  cap_bt_ = cap_seqs_ * (kv_blocks_for(opt_.max_context, opt_.block_size) + 1) * kv_shape_.n_groups;
  cap_history_ = std::max(opt_.max_history_tokens, 0);
  cap_split_rows_ = top_bucket;
  const int splits = std::max(opt_.attention_splits, 0);

  // Staging: every array at a fixed offset, so graphs find the layout at the same addresses.
  size_t at = 0;
  auto region = [&](size_t bytes) {
    const size_t o = at;
    at += align_up(bytes);
    return o;
  };
  off_.tokens = region(4 * (size_t)cap_tokens_);
  off_.token_pos = region(4 * (size_t)cap_tokens_);
  off_.token_seq = region(4 * (size_t)cap_tokens_);
  off_.q_start = region(4 * (size_t)(cap_seqs_ + 1));
  off_.pos0 = region(4 * (size_t)cap_seqs_);
  off_.bt_start = region(4 * (size_t)cap_seqs_);
  off_.out_rows = region(4 * (size_t)cap_tokens_);
  off_.hist_start = region(4 * (size_t)(cap_logits_ + 1));
  off_.sample_params = region(sizeof(kc::sample_row_params) * (size_t)cap_logits_);
  off_.block_tables = region(4 * (size_t)cap_bt_);
  off_.history = region(4 * (size_t)cap_history_);
  off_.end = at;
  stage_host_ = pinned_buffer(off_.end, "the step staging buffer");
  stage_dev_ = device_buffer(off_.end, "the step layout");

  const size_t T = (size_t)cap_tokens_;
  x_ = device_buffer(T * d * sizeof(float), "the residual stream");
  h_ = device_buffer(T * d * sizeof(bf16), "normed activations");
  qkv_ = device_buffer(T * qkv_dim * sizeof(bf16), "QKV activations");
  q_ = device_buffer(T * qd * sizeof(bf16), "rotated queries");
  attn_ = device_buffer(T * qd * sizeof(bf16), "attention outputs");
  y_ = device_buffer(T * d * sizeof(bf16), "projection outputs");
  gu_ = device_buffer(T * 2 * (size_t)hp.d_ff * sizeof(bf16), "gate|up activations");
  act_ = device_buffer(T * (size_t)hp.d_ff * sizeof(bf16), "SwiGLU activations");
  out_rows_ = device_buffer((size_t)cap_logits_ * d * sizeof(bf16), "gathered output rows");
  logits_dev_ = device_buffer((size_t)cap_logits_ * hp.n_vocab * sizeof(float), "device logits");
  const size_t split_elems = (size_t)cap_split_rows_ * hp.n_heads * splits;
  attn_scratch_ = device_buffer(std::max(split_elems * (hp.head_dim + 2) * sizeof(float),
                                         kc::attention_scratch_bytes(cap_split_rows_, hp.n_heads, hp.head_dim, splits)),
                                "attention split scratch");
  attn_counters_ = device_buffer(splits > 1 ? kc::attention_counters(cap_split_rows_, hp.n_heads) * sizeof(unsigned) : 0,
                                 "attention split counters");
  norm_sumsq_ = device_buffer((size_t)gemv_max_batch * kc::norm_fold_parts(d) * sizeof(float), "RMSNorm partial sums");
  sample_scratch_ = device_buffer(kc::sample_scratch_bytes(cap_logits_, hp.n_vocab), "sampling scratch");
  tokens_dev_ = device_buffer((size_t)cap_logits_ * sizeof(int32_t), "sampled tokens");
  tokens_host_ = pinned_buffer((size_t)cap_logits_ * sizeof(int32_t), "sampled tokens");
  expand_ = device_buffer((size_t)weights_.max_raw_only_elems() * sizeof(bf16), "the quantized-weight expansion scratch");

  // KV cache, plus the scratch block dummy decode rows use.
  const size_t block_bytes = (size_t)kv_shape_.block_bytes();
  if (opt_.n_blocks > 0) {
    n_blocks_ = opt_.n_blocks;
  } else {
    size_t free_b = 0, total_b = 0;
    kc::check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    const double usable = (double)free_b * std::clamp(opt_.kv_memory_fraction, 0.0, 1.0);
    n_blocks_ = (int32_t)std::min<double>(usable / (double)block_bytes - 1.0, (double)INT32_MAX - 1);
    if (n_blocks_ < 1)
      throw kc::cuda_error("no device memory left for the KV cache: " + std::to_string(free_b >> 20) + " MiB free, a block takes " +
                           std::to_string(block_bytes >> 10) + " KiB");
  }
  kv_ = device_buffer(((size_t)n_blocks_ + 1) * block_bytes, "the KV cache");
  // Zero once; paged_attention leaves them at zero after every call.
  if (attn_counters_.bytes() > 0)
    kc::check(cudaMemsetAsync(attn_counters_.as<void>(), 0, attn_counters_.bytes(), compute_.get()),
              "clearing the attention counters");
  // Zeroed so that no read of an unwritten slot can bring a NaN into a masked product.
  kc::check(cudaMemsetAsync(kv_.as<void>(), 0, kv_.bytes(), compute_.get()), "clearing the KV cache");
  n_host_blocks_ = std::max(opt_.n_host_blocks, 0);
  host_kv_ = pinned_buffer((size_t)n_host_blocks_ * block_bytes, "the host KV swap pool");
  sync_stream(compute_.get(), sync_event_.get(), opt_.sync_timeout, "setting up the CUDA forward");
}

size_t cuda_forward::device_bytes() const {
  size_t n = weights_.device_bytes() + kv_.bytes() + stage_dev_.bytes() + gemm_runner::workspace_bytes;
  for (const device_buffer* b : {&x_, &h_, &qkv_, &q_, &attn_, &y_, &gu_, &act_, &out_rows_, &logits_dev_, &attn_scratch_,
                                 &attn_counters_, &norm_sumsq_, &sample_scratch_, &tokens_dev_, &expand_})
    n += b->bytes();
  return n;
}

kc::kv_cache_view cuda_forward::kv_view() const {
  kc::kv_cache_view v;
  v.base = kv_.as<kc::fp16>();
  v.block_elems = kv_shape_.block_elems();
  v.n_layers = kv_shape_.n_layers;
  v.block_size = kv_shape_.block_size;
  v.n_kv_heads = kv_shape_.n_kv_heads;
  v.head_dim = kv_shape_.head_dim;
  return v;
}

const void* cuda_forward::host_block(int32_t b) const {
  if (b < 0 || b >= n_host_blocks_) throw std::invalid_argument("cuda_forward: host block " + std::to_string(b) + " out of range");
  return host_kv_.as<const std::byte>() + (size_t)b * (size_t)kv_shape_.block_bytes();
}

// ---- block copies -------------------------------------------------------------------------------

void cuda_forward::copy_blocks(std::span<const block_copy> ops) {
  using k = block_copy::kind;
  for (const block_copy& c : ops) {
    const int32_t n_src = c.dir == k::host_to_device ? n_host_blocks_ : n_blocks_;
    const int32_t n_dst = c.dir == k::device_to_host ? n_host_blocks_ : n_blocks_;
    if (c.src < 0 || c.src >= n_src || c.dst < 0 || c.dst >= n_dst)
      throw std::invalid_argument("cuda_forward: block copy " + std::to_string(c.src) + " -> " + std::to_string(c.dst) +
                                  " outside its pool");
  }
  if (ops.empty()) return;
  kc::check(cudaSetDevice(device_), "cudaSetDevice");
  const cudaStream_t s = copy_.get();
  // After the KV writes of the steps already enqueued.
  kc::check(cudaStreamWaitEvent(s, step_done_.get(), 0), "cudaStreamWaitEvent");
  const size_t bb = (size_t)kv_shape_.block_bytes();
  auto* dev = kv_.as<std::byte>();
  auto* host = host_kv_.as<std::byte>();
  for (size_t i = 0; i < ops.size();) {
    // Coalesce a run of consecutive blocks in the same direction into one copy (for device to
    // device only while source and destination ranges stay apart, as sequential copies would).
    size_t n = 1;
    while (i + n < ops.size() && ops[i + n].dir == ops[i].dir && ops[i + n].src == ops[i].src + (int32_t)n &&
           ops[i + n].dst == ops[i].dst + (int32_t)n) {
      const int32_t len = (int32_t)n + 1;
      if (ops[i].dir == k::device_to_device && ops[i].src < ops[i].dst + len && ops[i].dst < ops[i].src + len) break;
      ++n;
    }
    const block_copy& c = ops[i];
    std::byte* dst = (c.dir == k::device_to_host ? host : dev) + (size_t)c.dst * bb;
    const std::byte* src = (c.dir == k::host_to_device ? host : dev) + (size_t)c.src * bb;
    const cudaMemcpyKind kind = c.dir == k::device_to_host   ? cudaMemcpyDeviceToHost
                                : c.dir == k::host_to_device ? cudaMemcpyHostToDevice
                                                             : cudaMemcpyDeviceToDevice;
    kc::check(cudaMemcpyAsync(dst, src, n * bb, kind, s), "copying KV blocks");
    i += n;
  }
  kc::check(cudaEventRecord(copies_done_.get(), s), "cudaEventRecord");
  copies_pending_ = true;
}

void cuda_forward::synchronize() {
  kc::check(cudaSetDevice(device_), "cudaSetDevice");
  sync_stream(copy_.get(), sync_event_.get(), opt_.sync_timeout, "waiting for KV block copies");
  sync_stream(compute_.get(), sync_event_.get(), opt_.sync_timeout, "waiting for the forward");
  copies_pending_ = false;
}

// ---- the step layout ----------------------------------------------------------------------------

cuda_forward::plan cuda_forward::prepare(std::span<const seq_chunk> batch) {
  const int bs = kv_shape_.block_size, n_groups = kv_shape_.n_groups;
  validate_batch(batch, hparams().n_vocab, bs, n_blocks_, n_groups, kv_shape_.window);
  plan p;
  p.n_real_seqs = (int)batch.size();
  if (p.n_real_seqs > cap_seqs_)
    throw std::invalid_argument("forward: " + std::to_string(batch.size()) + " sequences, max_seqs is " + std::to_string(cap_seqs_));
  p.decode = p.n_real_seqs <= max_decode_bucket &&
             std::all_of(batch.begin(), batch.end(), [](const seq_chunk& c) { return c.tokens.size() == 1; });
  p.n_seqs = p.decode ? decode_bucket(p.n_real_seqs) : p.n_real_seqs;
  int64_t n_tokens = 0, n_bt = 0;
  for (const seq_chunk& c : batch) {
    n_tokens += (int64_t)c.tokens.size();
    n_bt += kv_blocks_for(c.pos0 + (int64_t)c.tokens.size(), bs) * n_groups;
  }
  if (p.decode) {
    n_tokens = p.n_seqs;
    n_bt += (p.n_seqs - p.n_real_seqs) * n_groups;
  }
  if (n_tokens > cap_tokens_)
    throw std::invalid_argument("forward: " + std::to_string(n_tokens) + " tokens in one step, max_batch_tokens is " +
                                std::to_string(cap_tokens_));
  if (n_bt > cap_bt_)
    throw std::invalid_argument("forward: " + std::to_string(n_bt) + " block-table entries in one step, the staging holds " +
                                std::to_string(cap_bt_) + " (max_seqs * max_context)");
  p.n_tokens = (int)n_tokens;

  auto* base = stage_host_.as<std::byte>();
  auto at = [&](size_t off) { return reinterpret_cast<int32_t*>(base + off); };
  int32_t *tokens = at(off_.tokens), *token_pos = at(off_.token_pos), *token_seq = at(off_.token_seq);
  int32_t *q_start = at(off_.q_start), *pos0 = at(off_.pos0), *bt_start = at(off_.bt_start), *bt = at(off_.block_tables);
  int32_t* out_rows = at(off_.out_rows);
  int32_t row = 0, n_entries = 0, max_kv = 0;
  p.max_q_len = 0;
  for (int s = 0; s < p.n_seqs; ++s) {
    q_start[s] = row;
    bt_start[s] = n_entries;
    if (s >= p.n_real_seqs) {  // dummy decode row: token 0 at position 0 in the scratch block (every group's)
      pos0[s] = 0;
      tokens[row] = 0, token_pos[row] = 0, token_seq[row] = s;
      ++row;
      for (int g = 0; g < n_groups; ++g) bt[n_entries++] = n_blocks_;
      continue;
    }
    const seq_chunk& c = batch[(size_t)s];
    const int len = (int)c.tokens.size();
    pos0[s] = (int32_t)c.pos0;
    for (int j = 0; j < len; ++j, ++row) {
      tokens[row] = c.tokens[(size_t)j];
      token_pos[row] = (int32_t)c.pos0 + j;
      token_seq[row] = s;
    }
    // Each group's first nb entries, group after group (kc::seq_table); validate_batch checked them.
    const int32_t nb = kv_blocks_for(c.pos0 + len, bs);
    const size_t group_len = c.block_table.size() / (size_t)n_groups;
    for (int g = 0; g < n_groups; ++g, n_entries += nb) std::copy_n(c.block_table.begin() + (ptrdiff_t)(g * group_len), nb, bt + n_entries);
    p.max_q_len = std::max(p.max_q_len, len);
    max_kv = std::max(max_kv, (int32_t)c.pos0 + len);
  }
  q_start[p.n_seqs] = row;
  p.max_kv_len = p.decode ? context_bound(max_kv) : max_kv;
  if (p.decode) p.max_q_len = 1;

  // Output rows.
  p.n_out = 0;
  p.gather = false;
  for (int s = 0, r = 0; s < p.n_real_seqs; ++s) {
    const seq_chunk& c = batch[(size_t)s];
    const int len = (int)c.tokens.size();
    const int first = c.no_logits ? len : c.all_logits ? 0 : len - 1;
    for (int j = first; j < len; ++j) {
      if (p.decode) {
        p.out_dev_rows.push_back(r + j);
      } else {
        out_rows[p.n_out] = r + j;
        p.gather = p.gather || r + j != p.n_out;
      }
      ++p.n_out;
    }
    r += len;
  }
  p.layout_bytes = off_.block_tables + 4 * (size_t)n_entries;
  return p;
}

void cuda_forward::stage_sampling(plan& p, std::span<const kc::sample_row_params> params,
                                  std::span<const std::span<const int32_t>> histories) {
  if (params.size() != (size_t)p.n_out)
    throw std::invalid_argument("forward_sample: " + std::to_string(params.size()) + " sampling rows for " + std::to_string(p.n_out) +
                                " logits rows");
  if (!histories.empty() && histories.size() != (size_t)p.n_out)
    throw std::invalid_argument("forward_sample: " + std::to_string(histories.size()) + " histories for " + std::to_string(p.n_out) +
                                " logits rows");
  // Decode samples every real row (those without logits greedily, then dropped); eager steps
  // sample the gathered rows.
  p.n_sample = p.decode ? p.n_real_seqs : p.n_out;
  if (p.n_sample > cap_logits_)
    throw std::invalid_argument("forward_sample: " + std::to_string(p.n_sample) + " rows, max_logit_rows is " + std::to_string(cap_logits_));
  auto* base = stage_host_.as<std::byte>();
  auto* sp = reinterpret_cast<kc::sample_row_params*>(base + off_.sample_params);
  auto* hist_start = reinterpret_cast<int32_t*>(base + off_.hist_start);
  auto* hist = reinterpret_cast<int32_t*>(base + off_.history);
  kc::sample_row_params greedy;
  greedy.temperature = 0.0f;
  std::vector<int> row_of(p.n_sample, -1);  // output row sampled from each device row
  for (int i = 0; i < p.n_out; ++i) row_of[(size_t)(p.decode ? p.out_dev_rows[(size_t)i] : i)] = i;
  int64_t n_hist = 0;
  for (int r = 0; r < p.n_sample; ++r) {
    const int i = row_of[(size_t)r];
    sp[r] = i >= 0 ? params[(size_t)i] : greedy;
    hist_start[r] = (int32_t)n_hist;
    if (i < 0 || histories.empty()) continue;
    const auto h = histories[(size_t)i];
    if (n_hist + (int64_t)h.size() > cap_history_)
      throw std::invalid_argument("forward_sample: penalty histories exceed max_history_tokens (" + std::to_string(cap_history_) + ")");
    std::copy(h.begin(), h.end(), hist + n_hist);
    n_hist += (int64_t)h.size();
  }
  hist_start[p.n_sample] = (int32_t)n_hist;
  p.n_history = (int)n_hist;
}

// ---- the step -----------------------------------------------------------------------------------

bool cuda_forward::bf16_gemv(const dev_matrix& w, int rows) const {
  const launch_options& l = opt_.launch;
  return w.w && rows <= std::min(l.bf16_gemv_rows, gemv_max_batch) && w.n_in % 8 == 0 &&
         (l.bf16_gemv_max_bytes == 0 || (size_t)(w.n_out * w.n_in) * sizeof(bf16) <= l.bf16_gemv_max_bytes);
}

bool cuda_forward::quant_gemv(const dev_matrix& w, int rows) const { return !w.raw.empty() && rows <= gemv_max_batch; }

size_t cuda_forward::step_weight_bytes(int rows) const {
  // decode_bytes_per_token counts the blocks of every matrix that keeps them: a step that does
  // not take gemv_quant reads the bf16 form instead.
  size_t bytes = decode_bytes_per_token();
  auto as_bf16 = [&](const dev_matrix& w) {
    if (!w.raw.empty() && !quant_gemv(w, rows)) bytes += (size_t)(w.n_out * w.n_in) * sizeof(bf16) - w.raw_bytes();
  };
  for (int il = 0; il < hparams().n_layers; ++il) {
    const dev_layer& L = weights_.layer(il);
    for (const dev_matrix* w : {&L.qkv, &L.o, &L.gate_up, &L.down}) as_bf16(*w);
  }
  as_bf16(weights_.output());
  return bytes;
}

std::optional<kc::quant_matrix> cuda_forward::fused_quant(const dev_matrix& w, int rows) const {
  if (!quant_gemv(w, rows) || w.raw.size() > std::size(kc::quant_matrix{}.raw)) return std::nullopt;
  kc::quant_matrix m;
  m.qt = w.raw[0].qt;
  for (const raw_part& p : w.raw) {
    if (p.qt != m.qt) return std::nullopt;  // a K_M layer's q4_k Q|K with a q6_k V: part by part
    m.raw[m.n_parts] = p.raw;
    m.row0[m.n_parts++] = p.row0;
  }
  return m;
}

bool cuda_forward::streamed_gemv(const dev_matrix& w, int rows) const {
  return opt_.launch.bf16_gemv_streamed && rows <= 2 && w.n_in % 256 == 0 && bf16_gemv(w, rows);
}

bool cuda_forward::plain_gemv(const dev_matrix& w, int rows) const {
  return !quant_gemv(w, rows) && bf16_gemv(w, rows) && !streamed_gemv(w, rows);
}

bool cuda_forward::fold_norm(int rows) const {
  if (!opt_.launch.gemv_fold_norm || hparams().gemma) return false;  // Gemma's norms of each block's output: kernels
  for (int il = 0; il < hparams().n_layers; ++il) {
    const dev_layer& L = weights_.layer(il);
    for (const dev_matrix* w : {&L.qkv, &L.gate_up})  // readers: gemv_bf16, or gemv_quant part by part
      if (!plain_gemv(*w, rows) && !quant_gemv(*w, rows)) return false;
    for (const dev_matrix* w : {&L.o, &L.down})  // writers: gemv_bf16, or gemv_quant over one part
      if (!plain_gemv(*w, rows) && !(quant_gemv(*w, rows) && w->raw.size() == 1)) return false;
  }
  return true;
}

void cuda_forward::linear(const dev_matrix& w, const bf16* x, bf16* y, int rows, cudaStream_t s,
                          const kc::gemv_norm& norm) {
  // Only gemv_bf16 and gemv_quant carry a folded norm; fold_norm() admits a step only where they are the path.
  if ((norm.residual || norm.sumsq_in) && !plain_gemv(w, rows) && !quant_gemv(w, rows))
    throw std::logic_error("cuda_forward: a folded RMSNorm on a matrix that neither gemv_bf16 nor gemv_quant multiplies");
  if (quant_gemv(w, rows)) {
    for (const raw_part& p : w.raw)
      kc::gemv_quant(p.qt, p.raw, p.n_out, w.n_in, x, y + p.row0, rows, s, w.n_out, opt_.launch.quant_gemv_unroll, norm);
  } else if (streamed_gemv(w, rows)) {
    kc::gemv_bf16_streamed(w.w, w.n_out, w.n_in, x, y, rows, s, opt_.launch.bf16_gemv_stream);
  } else if (bf16_gemv(w, rows)) {
    kc::gemv_bf16(w.w, w.n_out, w.n_in, x, y, rows, s, opt_.launch.bf16_gemv_prefetch_bytes, norm);
  } else {
    gemm_.run(x, bf16_weights(w, s), y, gemm_out::bf16, rows, (int)w.n_out, (int)w.n_in, s);
  }
}

const bf16* cuda_forward::bf16_weights(const dev_matrix& w, cudaStream_t s) {
  if (w.w) return w.w;
  for (const raw_part& p : w.raw)
    kc::dequant_to_bf16(p.qt, p.raw, p.n_out * w.n_in, expand_.as<bf16>() + p.row0 * w.n_in, s);
  return expand_.as<bf16>();
}

void cuda_forward::run_layers(const plan& p, cudaStream_t s) {
  const model_hparams& hp = hparams();
  const int n = p.n_tokens, d = hp.d_model;
  const auto* stage = stage_dev_.as<std::byte>();
  auto at = [&](size_t off) { return reinterpret_cast<const int32_t*>(stage + off); };

  kc::step_layout st;
  st.n_seqs = p.n_seqs;
  st.n_tokens = n;
  st.max_q_len = p.max_q_len;
  st.max_kv_len = p.max_kv_len;
  st.q_start = at(off_.q_start);
  st.pos0 = at(off_.pos0);
  st.bt_start = at(off_.bt_start);
  st.block_tables = at(off_.block_tables);
  st.token_pos = at(off_.token_pos);
  st.token_seq = at(off_.token_seq);
  const kc::kv_cache_view kv = kv_view();

  kc::rope_params rp;
  rp.n_heads = hp.n_heads;
  rp.n_kv_heads = hp.n_kv_heads;
  rp.head_dim = hp.head_dim;
  rp.n_rot = hp.n_rot;
  rp.base = hp.rope_base;
  rp.kind = hp.rope == kernels::rope_style::neox ? kc::rope_kind::neox : kc::rope_kind::normal;
  rp.freq_factors = weights_.rope_freqs();

  // Split-KV scratch holds cap_split_rows_ rows; larger steps attend without splitting.
  kc::attention_scratch sc;
  if (n <= cap_split_rows_ && opt_.attention_splits > 0) {
    sc.max_splits = opt_.attention_splits;
    sc.partial_out = attn_scratch_.as<float>();
    sc.partial_ml = sc.partial_out + (size_t)cap_split_rows_ * hp.n_heads * sc.max_splits * hp.head_dim;
    if (opt_.launch.attention_last_cta_merge && sc.max_splits > 1) sc.counters = attn_counters_.as<unsigned>();
    sc.kv_per_split = opt_.launch.attention_kv_per_split;
  }
  const float scale = hp.attn_scale > 0 ? hp.attn_scale : 1.0f / std::sqrt((float)hp.head_dim);
  // The fused qkv and gate|up GEMVs apply RoPE and SwiGLU: not Gemma's QK-norm and GELU.
  const bool fuse_rope = opt_.launch.gemv_rope && !hp.gemma, fuse_glu = opt_.launch.gemv_swiglu && !hp.gemma;

  float* x = x_.as<float>();
  bf16 *h = h_.as<bf16>(), *y = y_.as<bf16>();
  // With the norm folded in, the o and down GEMVs write the residual stream and leave in h the
  // next norm's input (before its scale) and in norm_sumsq_ its partial sums of squares; qkv and
  // gate|up read them. The first layer's norm (after the embedding) and the last stay kernels.
  const bool fold = fold_norm(n);
  kc::gemv_norm reader, writer;  // empty (no fold) unless folded
  if (fold) {
    reader.sumsq_in = norm_sumsq_.as<float>();
    reader.eps = hp.norm_eps;
    writer.residual = x;
    writer.sumsq_out = norm_sumsq_.as<float>();
  }
  const int prefetch = opt_.launch.bf16_gemv_prefetch_bytes;
  kc::qkv_rope_args rope;  // for the qkv GEMV applying RoPE (launch_options::gemv_rope)
  rope.rope = rp;
  rope.st = st;
  rope.kv = kv;
  rope.q_out = q_.as<bf16>();
  // Gemma scales its embeddings by sqrt(d_model) (in fp32, as the CPU forward).
  const float embed_scale = hp.gemma ? std::sqrt((float)d) : 1.0f;
  kc::embed_rows(weights_.token_embd(), at(off_.tokens), x, n, d, s, embed_scale);  // after the layout copy: a plain launch
  const kc::pdl_scope pdl(opt_.launch.pdl);
  const float* post_ffn_norm = nullptr;  // Gemma: the norm of the previous block's output, applied as it is added
  for (int il = 0; il < hp.n_layers; ++il) {
    const dev_layer& L = weights_.layer(il);
    const kv_slot where = kv_shape_.slot_of(il);  // the layer's KV group (its block tables) and slot in a block
    st.group = where.group;
    const int slot = where.slot;
    const kc::gemv_norm qkv_norm = il > 0 ? reader : kc::gemv_norm{};  // layer 0: after the embedding
    if (!(fold && il > 0)) kc::add_rmsnorm(x, il == 0 ? nullptr : y, L.attn_norm, h, n, d, hp.norm_eps, s, post_ffn_norm);
    rope.bq = L.bq, rope.bk = L.bk, rope.bv = L.bv, rope.layer = slot, rope.st = st;
    if (fuse_rope && plain_gemv(L.qkv, n)) {
      kc::gemv_bf16_rope_qkv(L.qkv.w, L.qkv.n_in, h, rope, s, prefetch, qkv_norm);
    } else if (const auto blocks = fuse_rope ? fused_quant(L.qkv, n) : std::nullopt) {
      kc::gemv_quant_rope_qkv(*blocks, L.qkv.n_in, h, rope, s, opt_.launch.quant_gemv_unroll, qkv_norm);
    } else {
      linear(L.qkv, h, qkv_.as<bf16>(), n, s, qkv_norm);
      kc::rope_params lrp = rp;  // Gemma: QK-norm, and the sliding-window layers' own RoPE base
      lrp.q_norm = L.q_norm, lrp.k_norm = L.k_norm, lrp.norm_eps = hp.norm_eps;
      if (L.sliding) lrp.base = hp.rope_base_swa;
      kc::rope_qkv_store(qkv_.as<bf16>(), L.bq, L.bk, L.bv, lrp, st, kv, slot, q_.as<bf16>(), s);
    }
    kc::paged_attention(q_.as<bf16>(), st, kv, slot, hp.n_heads, scale, attn_.as<bf16>(), sc, s,
                        L.sliding ? hp.sliding_window : 0);
    // Folded, the writers leave the next norm's input in h; else add_rmsnorm makes it from y.
    if (fold) writer.norm_w = L.ffn_norm;
    linear(L.o, attn_.as<bf16>(), fold ? h : y, n, s, writer);
    if (!fold) kc::add_rmsnorm(x, y, L.ffn_norm, h, n, d, hp.norm_eps, s, L.post_attn_norm);
    if (fuse_glu && plain_gemv(L.gate_up, n)) {
      kc::gemv_bf16_swiglu(L.gate_up.w, hp.d_ff, d, h, act_.as<bf16>(), n, s, prefetch, reader);
    } else if (const auto blocks = fuse_glu ? fused_quant(L.gate_up, n) : std::nullopt) {
      kc::gemv_quant_swiglu(*blocks, hp.d_ff, d, h, act_.as<bf16>(), n, s, opt_.launch.quant_gemv_unroll, reader);
    } else {
      linear(L.gate_up, h, gu_.as<bf16>(), n, s, reader);
      if (hp.gemma)
        kc::geglu(gu_.as<bf16>(), act_.as<bf16>(), n, hp.d_ff, s);
      else
        kc::swiglu(gu_.as<bf16>(), act_.as<bf16>(), n, hp.d_ff, s);
    }
    if (fold) writer.norm_w = il + 1 < hp.n_layers ? weights_.layer(il + 1).attn_norm : weights_.output_norm();
    linear(L.down, act_.as<bf16>(), fold ? h : y, n, s, writer);
    post_ffn_norm = L.post_ffn_norm;
  }
  // Folded: the residual is complete, h holds it times the output norm's weights but unscaled.
  kc::add_rmsnorm(x, fold ? nullptr : y, weights_.output_norm(), h, n, d, hp.norm_eps, s, post_ffn_norm);
}

// Logits of output rows [first, first + count) into logits_dev_ rows [0, count).
void cuda_forward::output_rows(const plan& p, int first, int count, cudaStream_t s) {
  const model_hparams& hp = hparams();
  const bf16* rows = h_.as<bf16>() + (size_t)first * hp.d_model;
  if (p.gather) {
    const auto* idx = reinterpret_cast<const int32_t*>(stage_dev_.as<std::byte>() + off_.out_rows) + first;
    gather_rows_bf16(h_.as<bf16>(), idx, out_rows_.as<bf16>(), count, hp.d_model, s);
    rows = out_rows_.as<bf16>();
  }
  const dev_matrix& w = weights_.output();
  float* logits = logits_dev_.as<float>();
  if (quant_gemv(w, count)) {
    for (const raw_part& q : w.raw)
      kc::gemv_quant_f32(q.qt, q.raw, q.n_out, w.n_in, rows, logits + q.row0, count, s, w.n_out, opt_.launch.quant_gemv_unroll);
  } else {
    gemm_.run(rows, bf16_weights(w, s), logits, gemm_out::f32, count, (int)w.n_out, (int)w.n_in, s);
  }
}

cudaGraphExec_t cuda_forward::capture(const plan& p, cudaStream_t s) {
  cudaGraph_t g = nullptr;
  kc::check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    run_layers(p, s);
    output_rows(p, 0, p.n_tokens, s);
  } catch (...) {
    cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  // Failures here are not sticky: clear them, so the next step's check_launch does not see them.
  if (const cudaError_t e = cudaStreamEndCapture(s, &g); e != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    kc::check(e, "capturing a decode step");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) cudaGetLastError();
  kc::check(e, "cudaGraphInstantiate");
  return exec;
}

// Enqueues the layout copy and the layers; a decode step also its output GEMM over all rows.
void cuda_forward::launch(const plan& p) {
  kc::check(cudaSetDevice(device_), "cudaSetDevice");
  const cudaStream_t s = compute_.get();
  if (copies_pending_) {
    kc::check(cudaStreamWaitEvent(s, copies_done_.get(), 0), "cudaStreamWaitEvent");
    copies_pending_ = false;
  }
  kc::check(cudaEventRecord(step_start_.get(), s), "cudaEventRecord");
  kc::check(cudaMemcpyAsync(stage_dev_.as<void>(), stage_host_.as<void>(), p.layout_bytes, cudaMemcpyHostToDevice, s),
            "uploading the step layout");
  if (p.n_history > 0)
    kc::check(cudaMemcpyAsync(stage_dev_.as<std::byte>() + off_.history, stage_host_.as<std::byte>() + off_.history,
                              4 * (size_t)p.n_history, cudaMemcpyHostToDevice, s),
              "uploading penalty histories");
  if (!p.decode) {
    run_layers(p, s);
    return;
  }
  const auto key = std::make_pair(p.n_tokens, p.max_kv_len);
  const bool graphs = opt_.use_graphs && graph_error_.empty();
  if (auto it = graphs_.find(key); graphs && it != graphs_.end()) {
    kc::check(cudaGraphLaunch(it->second, s), "cudaGraphLaunch");
    return;
  }
  // First step of its kind runs eagerly (loading kernels, choosing GEMM algorithms), then is
  // captured for the next ones. A capture that fails leaves this step's eager run valid: decode
  // steps stay eager from then on, and graph_error() says why. (A sticky device error fails the
  // next call anyway.)
  run_layers(p, s);
  output_rows(p, 0, p.n_tokens, s);
  if (graphs) {
    try {
      graphs_.emplace(key, capture(p, s));
    } catch (const kc::cuda_error& e) {
      graph_error_ = e.what();
    }
  }
}

void cuda_forward::finish_step(const char* what) {
  kc::check(cudaEventRecord(step_end_.get(), compute_.get()), "cudaEventRecord");
  kc::check(cudaEventRecord(step_done_.get(), compute_.get()), "cudaEventRecord");
  wait_event(step_done_.get(), opt_.sync_timeout, what, std::max(opt_.launch.step_spin, std::chrono::milliseconds(1)));
}

double cuda_forward::last_step_device_ms() const {
  float ms = 0.0f;
  kc::check(cudaEventElapsedTime(&ms, step_start_.get(), step_end_.get()), "cudaEventElapsedTime");
  return ms;
}

void cuda_forward::resize_host_logits(size_t n) {
  if (logits_.capacity() < n) {
    if (logits_registered_) cudaHostUnregister(logits_.data());
    logits_registered_ = false;
    std::vector<float> fresh;
    fresh.reserve(n);
    logits_.swap(fresh);
    // Pinned, so the copies are true DMA; where pinning fails they still work, staged.
    logits_registered_ = cudaHostRegister(logits_.data(), logits_.capacity() * sizeof(float), cudaHostRegisterDefault) == cudaSuccess;
    if (!logits_registered_) cudaGetLastError();
  }
  logits_.resize(n);
}

const std::vector<float>& cuda_forward::forward(std::span<const seq_chunk> batch) {
  const int64_t n_vocab = hparams().n_vocab;
  if (batch.empty()) {
    logits_.clear();
    return logits_;
  }
  const plan p = prepare(batch);
  launch(p);
  resize_host_logits((size_t)p.n_out * (size_t)n_vocab);
  const cudaStream_t s = compute_.get();
  const size_t row_bytes = (size_t)n_vocab * sizeof(float);
  if (p.decode) {
    // Runs of consecutive token rows in one copy each.
    for (int i = 0; i < p.n_out;) {
      int n = 1;
      while (i + n < p.n_out && p.out_dev_rows[(size_t)(i + n)] == p.out_dev_rows[(size_t)i] + n) ++n;
      kc::check(cudaMemcpyAsync(logits_.data() + (size_t)i * n_vocab, logits_dev_.as<float>() + (size_t)p.out_dev_rows[(size_t)i] * n_vocab,
                                n * row_bytes, cudaMemcpyDeviceToHost, s),
                "downloading logits");
      i += n;
    }
  } else {
    for (int first = 0; first < p.n_out; first += cap_logits_) {
      const int count = std::min(cap_logits_, p.n_out - first);
      output_rows(p, first, count, s);
      kc::check(cudaMemcpyAsync(logits_.data() + (size_t)first * n_vocab, logits_dev_.as<float>(), count * row_bytes,
                                cudaMemcpyDeviceToHost, s),
                "downloading logits");
    }
  }
  finish_step("forward");
  return logits_;
}

std::vector<int32_t> cuda_forward::forward_sample(std::span<const seq_chunk> batch, std::span<const kc::sample_row_params> params,
                                                  std::span<const std::span<const int32_t>> histories) {
  if (batch.empty()) return {};
  plan p = prepare(batch);
  stage_sampling(p, params, histories);
  launch(p);
  const cudaStream_t s = compute_.get();
  if (!p.decode && p.n_out > 0) output_rows(p, 0, p.n_out, s);
  std::vector<int32_t> out((size_t)p.n_out);
  if (p.n_sample == 0) {
    finish_step("forward_sample");
    return out;
  }
  const auto* stage = stage_dev_.as<std::byte>();
  kc::sample_tokens(logits_dev_.as<float>(), p.n_sample, hparams().n_vocab,
                    reinterpret_cast<const kc::sample_row_params*>(stage + off_.sample_params),
                    reinterpret_cast<const int32_t*>(stage + off_.history), reinterpret_cast<const int32_t*>(stage + off_.hist_start),
                    sample_scratch_.as<void>(), tokens_dev_.as<int32_t>(), s);
  kc::check(cudaMemcpyAsync(tokens_host_.as<void>(), tokens_dev_.as<void>(), (size_t)p.n_sample * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, s),
            "downloading sampled tokens");
  finish_step("forward_sample");
  const int32_t* t = tokens_host_.as<int32_t>();
  for (int i = 0; i < p.n_out; ++i) out[(size_t)i] = t[p.decode ? p.out_dev_rows[(size_t)i] : i];
  return out;
}

}  // namespace troupe::engine::cuda
