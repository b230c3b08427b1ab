#include "engine/pipeline_parallel.hpp"

#include <algorithm>
#include <stdexcept>

#include "engine/tensor_parallel.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::engine {

std::string pipeline_parallel_error(int n_layers, int n) {
  if (n < 1 || n > n_layers) return std::to_string(n_layers) + " layers do not split into " + std::to_string(n) + " pipeline stages";
  return {};
}

std::vector<std::pair<int, int>> split_layers(int n_layers, int n) {
  if (std::string err = pipeline_parallel_error(n_layers, n); !err.empty()) throw std::invalid_argument(err);
  std::vector<std::pair<int, int>> out;
  for (int s = 0, begin = 0; s < n; ++s) {
    const int len = n_layers / n + (s < n_layers % n ? 1 : 0);
    out.emplace_back(begin, begin + len);
    begin += len;
  }
  return out;
}

std::vector<std::vector<seq_chunk>> split_micro_batches(std::span<const seq_chunk> batch, int n) {
  int64_t total = 0;
  for (const auto& c : batch) total += (int64_t)c.tokens.size();
  const int64_t per = std::max<int64_t>(1, (total + std::max(n, 1) - 1) / std::max(n, 1));
  std::vector<std::vector<seq_chunk>> out;
  std::vector<seq_chunk> cur;
  int64_t cur_tokens = 0;
  for (const seq_chunk& c : batch) {
    const auto len = (int64_t)c.tokens.size();
    for (int64_t off = 0; off < len;) {
      const int64_t take = std::min(len - off, per - cur_tokens);
      seq_chunk piece = c;
      piece.tokens = c.tokens.subspan((size_t)off, (size_t)take);
      piece.pos0 = c.pos0 + off;
      // A piece before the chunk's last gives logits only if the chunk wants every row's.
      if (off + take < len && !c.all_logits) piece.no_logits = true;
      cur.push_back(piece);
      cur_tokens += take;
      off += take;
      if (cur_tokens == per) {
        out.push_back(std::move(cur));
        cur.clear();
        cur_tokens = 0;
      }
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

namespace {

int64_t logits_rows(const std::vector<seq_chunk>& mb) {
  int64_t rows = 0;
  for (const auto& c : mb) rows += c.no_logits ? 0 : c.all_logits ? (int64_t)c.tokens.size() : 1;
  return rows;
}

kv_shape stage_shape(const kv_shape& full, int layers) {
  if (full.n_groups > 1)
    throw std::invalid_argument("pipeline stages hold their layers' KV in one group: sliding-window groups are not split");
  kv_shape s = full;
  s.n_layers = layers;
  return s;
}

}  // namespace

struct pp_cpu_forward::stage {
  int index, begin, end;
  // One rank: its kernel pool, KV pools and forward; or a tensor-parallel group (each rank with its own).
  std::unique_ptr<kernels::thread_pool> pool;
  std::unique_ptr<kv_storage> device, host;
  std::unique_ptr<cpu_forward> fwd;
  std::unique_ptr<tp_cpu_forward> tp;
  std::thread thread;
  std::exception_ptr error;  // of the last step
  stage(const model& m, int index, std::pair<int, int> layers, const kv_shape& full, int32_t n_blocks, int32_t n_host, int threads,
        int tensor)
      : index(index), begin(layers.first), end(layers.second) {
    const kv_shape shape = stage_shape(full, end - begin);
    if (tensor > 1) {
      tp = std::make_unique<tp_cpu_forward>(m, tensor, shape, n_blocks, n_host, threads, parallel_split::tensor, layers);
      return;
    }
    pool = std::make_unique<kernels::thread_pool>(threads);
    device = std::make_unique<kv_storage>(shape, n_blocks);
    host = std::make_unique<kv_storage>(shape, std::max(n_host, 1));
    fwd = std::make_unique<cpu_forward>(m, *device, *pool, forward_part{nullptr, nullptr, begin, end});
  }
  const std::vector<float>& forward(std::span<const seq_chunk> mb, std::vector<float>* hidden) {
    return tp ? tp->forward(mb, hidden) : fwd->forward(mb, hidden);
  }
};

pp_cpu_forward::pp_cpu_forward(const model& m, int n_stages, const kv_shape& full, int32_t n_blocks, int32_t n_host_blocks,
                               int threads_per_stage, int micro_batches, std::chrono::milliseconds stage_timeout, int tensor_ranks)
    : micro_batches_(micro_batches > 0 ? micro_batches : n_stages),
      timeout_(stage_timeout),
      n_vocab_(m.hparams().n_vocab),
      block_size_(full.block_size),
      n_blocks_(n_blocks) {
  if (threads_per_stage < 1) throw std::invalid_argument("pipeline parallel: each stage needs at least one thread");
  if (tensor_ranks > 1)
    if (std::string err = tensor_parallel_error(m, tensor_ranks); !err.empty()) throw std::invalid_argument(err);
  const auto layers = split_layers(m.hparams().n_layers, n_stages);
  for (int s = 0; s < n_stages; ++s)
    stages_.push_back(
        std::make_unique<stage>(m, s, layers[(size_t)s], full, n_blocks, n_host_blocks, threads_per_stage, std::max(1, tensor_ranks)));
  for (auto& s : stages_) s->thread = std::thread([this, st = s.get()] { worker(*st); });
}

pp_cpu_forward::~pp_cpu_forward() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& s : stages_) s->thread.join();
}

void pp_cpu_forward::worker(stage& s) {
  const bool last = s.index + 1 == (int)stages_.size();
  uint64_t seen = 0;
  for (;;) {
    size_t n_mb = 0;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || step_ != seen; });
      if (stop_) return;
      seen = step_;
      n_mb = mbs_.size();
    }
    s.error = nullptr;
    for (size_t i = 0; i < n_mb; ++i) {
      {
        // Micro-batch i's rows, once the stage before has handed them on.
        std::unique_lock lk(mu_);
        const bool ready = cv_.wait_for(lk, timeout_, [&] { return failed_ || s.index == 0 || progress_[(size_t)s.index - 1] > (int)i; });
        if (!ready) {
          s.error = std::make_exception_ptr(std::runtime_error("pipeline stage " + std::to_string(s.index) + " waited more than " +
                                                               std::to_string(timeout_.count()) + " ms for its input"));
          failed_ = true;
        }
        if (failed_) break;
      }
      try {
        const std::vector<float>& l = s.forward(mbs_[i], &hidden_[i]);
        if (last) std::copy(l.begin(), l.end(), logits_.begin() + (ptrdiff_t)logits_at_[i]);
      } catch (...) {
        s.error = std::current_exception();
        std::lock_guard lk(mu_);
        failed_ = true;
      }
      {
        std::lock_guard lk(mu_);
        if (!s.error) progress_[(size_t)s.index] = (int)i + 1;
      }
      cv_.notify_all();
      if (s.error) break;
    }
    {
      std::lock_guard lk(mu_);
      ++n_done_;
    }
    cv_.notify_all();
  }
}

const std::vector<float>& pp_cpu_forward::forward(std::span<const seq_chunk> batch) {
  const int n_vocab = n_vocab_;
  validate_batch(batch, n_vocab, block_size_, n_blocks_);
  std::unique_lock lk(mu_);
  mbs_ = split_micro_batches(batch, micro_batches_);
  hidden_.assign(mbs_.size(), {});
  logits_at_.clear();
  size_t rows = 0;
  for (const auto& mb : mbs_) {
    logits_at_.push_back(rows * (size_t)n_vocab);
    rows += (size_t)logits_rows(mb);
  }
  logits_.assign(rows * (size_t)n_vocab, 0.0f);
  progress_.assign(stages_.size(), 0);
  n_done_ = 0;
  failed_ = false;
  ++step_;
  cv_.notify_all();
  cv_.wait(lk, [&] { return n_done_ == (int)stages_.size(); });
  for (auto& s : stages_)  // the earliest stage's error is the cause; those after it only stopped
    if (s->error) std::rethrow_exception(s->error);
  return logits_;
}

void pp_cpu_forward::for_each_kv(const std::function<void(kv_storage&, kv_storage&)>& fn) {
  for (auto& s : stages_) {
    if (s->tp) s->tp->for_each_kv(fn);
    else fn(*s->device, *s->host);
  }
}

}  // namespace troupe::engine
