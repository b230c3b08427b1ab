#include "engine/tensor_parallel.hpp"

#include <stdexcept>
#include <string>
#include <tuple>

#include "kernels/ggml_types.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::engine {

namespace {

const kernels::dtype_traits& traits(const kernels::weight_view& w) {
  const kernels::dtype_traits* tr = kernels::find_dtype((uint32_t)w.type);
  if (!tr) throw std::invalid_argument("tensor parallel: unsupported weight type");
  return *tr;
}

// Rows [r0, r0 + n) of w (output features).
kernels::weight_view rows(const kernels::weight_view& w, int64_t r0, int64_t n) {
  kernels::weight_view s = w;
  s.data = (const uint8_t*)w.data + (size_t)r0 * w.row_stride;
  s.n_out = n;
  return s;
}

// Input columns [c0, c0 + n) of every row of w; whole blocks (checked by tensor_parallel_error).
kernels::weight_view cols(const kernels::weight_view& w, int64_t c0, int64_t n) {
  const auto& tr = traits(w);
  kernels::weight_view s = w;
  s.data = (const uint8_t*)w.data + (size_t)kernels::row_bytes(tr, c0);
  s.n_in = n;
  return s;
}

std::vector<float> slice(const std::vector<float>& v, int64_t i0, int64_t n) {
  if (v.empty()) return {};
  return {v.begin() + i0, v.begin() + i0 + n};
}

}  // namespace

std::string tensor_parallel_error(const model& m, int n) {
  const auto& hp = m.hparams();
  const std::string of = " does not split into " + std::to_string(n) + " tensor-parallel ranks";
  if (n < 1) return "tensor parallel needs at least one rank";
  if (hp.n_experts > 0) return "a mixture-of-experts model splits by experts (expert parallel), not by tensor";
  if (hp.n_heads % n != 0) return std::to_string(hp.n_heads) + " attention heads" + of;
  if (hp.n_kv_heads % n != 0 && n % hp.n_kv_heads != 0)
    return std::to_string(hp.n_kv_heads) + " KV heads neither split into nor are replicated evenly over " + std::to_string(n) +
           " tensor-parallel ranks";
  if (hp.d_ff % n != 0) return "a feed-forward width of " + std::to_string(hp.d_ff) + of;
  const int64_t q_cols = (int64_t)hp.n_heads / n * hp.head_dim, ff_cols = hp.d_ff / n;
  for (int il = 0; il < hp.n_layers; ++il) {
    const layer_weights& L = m.layer(il);
    for (auto [w, what, c] : {std::tuple{&L.wo, "attention output", q_cols}, std::tuple{&L.w_down, "feed-forward down", ff_cols}})
      if (c % traits(*w).block_size != 0)
        return "layer " + std::to_string(il) + ": the " + what + " projection's " + std::to_string(c * n) + " input columns" + of +
               " of whole " + traits(*w).name + " blocks (" + std::to_string(traits(*w).block_size) + " values)";
  }
  return {};
}

model_shard shard_model(const model& m, int rank, int n) {
  if (std::string err = tensor_parallel_error(m, n); !err.empty()) throw std::invalid_argument(err);
  if (rank < 0 || rank >= n) throw std::invalid_argument("no rank " + std::to_string(rank) + " of " + std::to_string(n));
  const auto& full = m.hparams();
  model_shard s;
  s.rank = rank;
  s.n_ranks = n;
  s.hp = full;
  s.hp.n_heads = full.n_heads / n;
  s.hp.n_kv_heads = kv_heads_per_rank(full.n_kv_heads, n);
  s.hp.d_ff = full.d_ff / n;
  const int64_t qd = (int64_t)s.hp.n_heads * full.head_dim, kvd = (int64_t)s.hp.n_kv_heads * full.head_dim, ff = s.hp.d_ff;
  // The rank's first KV head: its own share, or (replicated) the one its query heads read.
  const int64_t kv0 = full.n_kv_heads >= n ? (int64_t)rank * s.hp.n_kv_heads : (int64_t)rank * full.n_kv_heads / n;
  for (int il = 0; il < full.n_layers; ++il) {
    const layer_weights& L = m.layer(il);
    layer_weights r = L;  // norms (per head for QK-norm: the same for every head) replicated
    r.wq = rows(L.wq, rank * qd, qd);
    r.wk = rows(L.wk, kv0 * full.head_dim, kvd);
    r.wv = rows(L.wv, kv0 * full.head_dim, kvd);
    r.bq = slice(L.bq, rank * qd, qd);
    r.bk = slice(L.bk, kv0 * full.head_dim, kvd);
    r.bv = slice(L.bv, kv0 * full.head_dim, kvd);
    r.wo = cols(L.wo, rank * qd, qd);
    r.w_gate = rows(L.w_gate, rank * ff, ff);
    r.w_up = rows(L.w_up, rank * ff, ff);
    r.w_down = cols(L.w_down, rank * ff, ff);
    s.layers.push_back(std::move(r));
  }
  return s;
}

std::string expert_parallel_error(const model& m, int n) {
  const auto& hp = m.hparams();
  if (n < 1) return "expert parallel needs at least one rank";
  if (hp.n_experts == 0) return "expert parallel needs a mixture-of-experts model ('" + hp.name + "' has no experts)";
  if (hp.n_experts % n != 0) return std::to_string(hp.n_experts) + " experts do not split into " + std::to_string(n) + " expert-parallel ranks";
  return {};
}

model_shard shard_experts(const model& m, int rank, int n) {
  if (std::string err = expert_parallel_error(m, n); !err.empty()) throw std::invalid_argument(err);
  if (rank < 0 || rank >= n) throw std::invalid_argument("no rank " + std::to_string(rank) + " of " + std::to_string(n));
  model_shard s;
  s.rank = rank;
  s.n_ranks = n;
  s.split_attention = false;
  s.hp = m.hparams();
  const int per = s.hp.n_experts / n;
  for (int il = 0; il < s.hp.n_layers; ++il) {
    layer_weights r = m.layer(il);
    auto keep = [&](std::vector<kernels::weight_view>& v) { v = {v.begin() + rank * per, v.begin() + (rank + 1) * per}; };
    keep(r.expert_gate);
    keep(r.expert_up);
    keep(r.expert_down);
    r.expert_begin = rank * per;
    s.layers.push_back(std::move(r));
  }
  return s;
}

int kv_heads_per_rank(int n_kv_heads, int n) { return n_kv_heads >= n ? n_kv_heads / n : 1; }

kv_shape shard_kv_shape(const kv_shape& full, int n) {
  kv_shape s = full;
  s.n_kv_heads = kv_heads_per_rank(full.n_kv_heads, n);
  return s;
}

// --- tp_cpu_forward ------------------------------------------------------------------------------

struct tp_cpu_forward::rank_state {
  model_shard shard;
  kernels::thread_pool pool;
  kv_storage device, host;
  cpu_forward fwd;
  std::thread thread;
  std::exception_ptr error;  // of the last step
  rank_state(const model& m, int rank, int n, const kv_shape& full, int32_t n_blocks, int32_t n_host, int threads, communicator& comm,
             parallel_split split, std::pair<int, int> layers)
      : shard(split == parallel_split::tensor ? shard_model(m, rank, n) : shard_experts(m, rank, n)),
        pool(threads),
        device(split == parallel_split::tensor ? shard_kv_shape(full, n) : full, n_blocks),
        host(split == parallel_split::tensor ? shard_kv_shape(full, n) : full, std::max(n_host, 1)),
        fwd(m, device, pool, {&shard, &comm, layers.first, layers.second}) {}
};

tp_cpu_forward::tp_cpu_forward(const model& m, int n, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks, int threads_per_rank,
                               parallel_split split, std::pair<int, int> layers)
    : group_(std::make_unique<local_group>(n)) {
  if (threads_per_rank < 1) throw std::invalid_argument("tensor parallel: each rank needs at least one thread");
  for (int r = 0; r < n; ++r)
    ranks_.push_back(std::make_unique<rank_state>(m, r, n, full, n_blocks, n_host_blocks, threads_per_rank, group_->rank(r), split, layers));
  for (auto& r : ranks_) r->thread = std::thread([this, rs = r.get()] { worker(*rs); });
}

tp_cpu_forward::~tp_cpu_forward() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& r : ranks_) r->thread.join();
}

void tp_cpu_forward::worker(rank_state& r) {
  uint64_t seen = 0;
  for (;;) {
    std::span<const seq_chunk> batch;
    std::vector<float>* hidden = nullptr;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || step_ != seen; });
      if (stop_) return;
      seen = step_;
      batch = batch_;
      hidden = hidden_;
    }
    r.error = nullptr;
    try {
      r.fwd.forward(batch, hidden);
    } catch (...) {
      r.error = std::current_exception();
      group_->abort("rank " + std::to_string(r.shard.rank) + " failed");  // the others' collectives throw
    }
    {
      std::lock_guard lk(mu_);
      ++done_;
    }
    cv_.notify_all();
  }
}

const std::vector<float>& tp_cpu_forward::forward(std::span<const seq_chunk> batch, std::vector<float>* hidden) {
  // A bad batch is refused here, before any rank starts (the group stays usable).
  const kv_storage& kv0 = ranks_[0]->device;
  validate_batch(batch, ranks_[0]->shard.hp.n_vocab, kv0.shape().block_size, kv0.n_blocks(), kv0.shape().n_groups,
                 kv0.shape().window);
  std::unique_lock lk(mu_);
  if (error_) std::rethrow_exception(error_);
  batch_ = batch;
  hidden_ = hidden;
  done_ = 0;
  ++step_;
  cv_.notify_all();
  // Bounded: a rank stuck in a collective times out there (local_group's limit) and reports.
  cv_.wait(lk, [&] { return done_ == (int)ranks_.size(); });
  // The cause is the first rank that failed other than by the group's abort.
  for (auto& r : ranks_) {
    if (!r->error) continue;
    try {
      std::rethrow_exception(r->error);
    } catch (const collective_error&) {
      if (!error_) error_ = r->error;
    } catch (...) {
      error_ = r->error;
      break;
    }
  }
  if (error_) std::rethrow_exception(error_);
  return ranks_[0]->fwd.logits();
}

void tp_cpu_forward::for_each_kv(const std::function<void(kv_storage&, kv_storage&)>& fn) {
  for (auto& r : ranks_) fn(r->device, r->host);
}

}  // namespace troupe::engine
