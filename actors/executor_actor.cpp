// The executor: one per device (the CPU, or a CUDA device with --device cuda). The only owner of
// its KV memory (device pool and host swap pool), its weights on the device, its threads or
// streams and its forward pass. Sampling: on a CUDA device, on the device (logits never leave
// it) unless a row asks for log-probabilities; else on the host (engine::sampler). Greedy rows
// pick the same token either way; seeded stochastic rows draw from the same distribution but
// not the same token (kernels/cuda/sampling.cu says why).
// Spawned detached, so a step's compute runs on the executor's own thread, never on CAF's
// scheduler threads. One step per message.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "actors/runtime.hpp"
#include "engine/device_module.hpp"
#include "engine/forward.hpp"
#include "engine/json_grammar.hpp"
#include "engine/split_forward.hpp"

namespace troupe::actors {

namespace {

// The host sampler on one logits row (scratch: the penalties modify it), seeded for its draw.
engine::sample_result sample_on_host(std::span<float> row, const engine::sampling_params& params, uint64_t seed, uint64_t draw,
                                     std::span<const engine::token_id> history) {
  engine::sampling_params p = params;
  p.seed = engine::mix_seed(seed, draw);
  p.has_seed = true;
  return engine::sampler(p).sample(row, history);
}

// One logits row to sample on the device: its parameters, draw seed and penalty window.
struct device_sample_row {
  const engine::sampling_params* params = nullptr;
  uint64_t seed = 0, draw = 0;
  std::span<const engine::token_id> penalty_window;
};

// What the executor drives on its device: block copies, then a forward that returns logits rows,
// or (a device that samples) one that returns the sampled tokens.
class backend {
 public:
  virtual ~backend() = default;
  virtual void copy_blocks(const std::vector<engine::block_copy>& copies) = 0;
  virtual const std::vector<float>& forward(std::span<const engine::seq_chunk> batch) = 0;
  /// Whether forward_sample takes `rows` logits rows with `window_tokens` penalty tokens in all.
  virtual bool samples_on_device(size_t /*rows*/, size_t /*window_tokens*/) const { return false; }
  virtual std::vector<engine::token_id> forward_sample(std::span<const engine::seq_chunk>,
                                                       std::span<const device_sample_row>) {
    throw std::logic_error("executor: this backend samples on the host");
  }
  /// After `failure`: empty, or why the device can take no more work in this process.
  virtual std::string device_lost(const std::exception_ptr& /*failure*/) const { return {}; }
  /// Weight bytes a step of `rows` token rows reads (executor_config::on_backend_up).
  virtual size_t step_weight_bytes(int rows) const = 0;
};

// The model's weights on the host, which a dummy model for a CUDA device lacks.
const engine::model& with_host_weights(const engine::model& m) {
  if (!m.has_host_weights())
    throw std::invalid_argument("the model's random weights were left to a CUDA device to generate: the CPU executor has none");
  return m;
}

// The CPU: KV pools in host memory, the forward on the executor's own threads — whole, or split
// over ranks or stages, each with the KV pools of its share (engine/split_forward.hpp).
class cpu_backend final : public backend {
 public:
  explicit cpu_backend(const executor_config& c)
      : emulate_device_sampling_(c.emulate_device_sampling),
        n_vocab_((size_t)c.model->hparams().n_vocab),
        weight_bytes_(c.model->weight_bytes_per_token()),
        fwd_(with_host_weights(*c.model), {c.tensor_parallel, c.pipeline_parallel, c.expert_parallel}, c.kv, c.n_device_blocks, c.n_host_blocks,
             c.n_threads) {}

  void copy_blocks(const std::vector<engine::block_copy>& copies) override {
    fwd_.for_each_kv([&](engine::kv_storage& device, engine::kv_storage& host) {
      const auto bytes = (size_t)device.shape().block_bytes();
      for (const auto& c : copies) {
        using k = engine::block_copy::kind;
        engine::kv_storage& src = c.dir == k::host_to_device ? host : device;
        engine::kv_storage& dst = c.dir == k::device_to_host ? host : device;
        if (c.src < 0 || c.src >= src.n_blocks() || c.dst < 0 || c.dst >= dst.n_blocks())
          throw std::logic_error("executor: block copy out of range");
        std::memcpy(dst.block_data(c.dst), src.block_data(c.src), bytes);
      }
    });
  }
  const std::vector<float>& forward(std::span<const engine::seq_chunk> batch) override { return fwd_.forward(batch); }

  // Tests (emulate_device_sampling): the device path's contract, sampled by the host sampler with
  // the seed the host path would use, so both paths give the same tokens.
  bool samples_on_device(size_t, size_t) const override { return emulate_device_sampling_; }
  std::vector<engine::token_id> forward_sample(std::span<const engine::seq_chunk> batch,
                                               std::span<const device_sample_row> rows) override {
    const std::vector<float>& logits = forward(batch);
    if (logits.size() != rows.size() * n_vocab_) throw std::logic_error("executor: logits rows and sampling rows disagree");
    std::vector<engine::token_id> tokens;
    std::vector<float> row(n_vocab_);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::copy_n(logits.begin() + (ptrdiff_t)(i * n_vocab_), n_vocab_, row.begin());
      tokens.push_back(sample_on_host(row, *rows[i].params, rows[i].seed, rows[i].draw, rows[i].penalty_window).token);
    }
    return tokens;
  }
  // The file's types whatever the step: the CPU kernels read the blocks at every batch size.
  size_t step_weight_bytes(int) const override { return weight_bytes_; }

 private:
  bool emulate_device_sampling_;
  size_t n_vocab_;
  size_t weight_bytes_;
  engine::split_forward fwd_;
};

// A CUDA device, through the module (engine/device_module.hpp): weights, KV pool and pinned host
// swap pool owned by engine::cuda::cuda_forward; copies go on its copy stream, which the next
// forward waits for.
class cuda_backend final : public backend {
 public:
  explicit cuda_backend(const executor_config& c) : fwd_(engine::open_cuda_forward(*c.model, options(c))) {}

  void copy_blocks(const std::vector<engine::block_copy>& copies) override { fwd_->copy_blocks(copies); }
  const std::vector<float>& forward(std::span<const engine::seq_chunk> batch) override { return fwd_->forward(batch); }

  bool samples_on_device(size_t rows, size_t window_tokens) const override {
    return rows <= (size_t)fwd_->max_logit_rows() && window_tokens <= (size_t)fwd_->max_history_tokens();
  }
  std::vector<engine::token_id> forward_sample(std::span<const engine::seq_chunk> batch,
                                               std::span<const device_sample_row> rows) override {
    params_.clear();
    histories_.clear();
    bool any_history = false;
    for (const auto& r : rows) {
      const engine::sampling_params& p = *r.params;
      params_.push_back({p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                         p.frequency_penalty, r.seed, r.draw});
      histories_.push_back(r.penalty_window);
      any_history = any_history || !r.penalty_window.empty();
    }
    if (!any_history) histories_.clear();
    return fwd_->forward_sample(batch, params_, histories_);
  }
  std::string device_lost(const std::exception_ptr& failure) const override { return fwd_->device_lost(failure); }
  size_t step_weight_bytes(int rows) const override { return fwd_->step_weight_bytes(rows); }

 private:
  static engine::device_forward_options options(const executor_config& c) {
    engine::device_forward_options o;
    o.device = c.cuda_device;
    o.n_blocks = c.n_device_blocks;  // the scheduler's block manager addresses exactly these
    o.n_host_blocks = c.n_host_blocks;
    o.block_size = c.kv.block_size;
    o.kv_window_groups = c.kv.n_groups > 1;  // the KV manager's layout (engine_kv_shape)
    // Step buffers sized for the scheduler's steps (cuda_forward raises them to its minimums).
    o.max_batch_tokens = c.max_batch_tokens;
    o.max_seqs = c.max_seqs;
    o.max_context = (int)std::min<int64_t>(c.max_context, INT32_MAX);
    o.max_logit_rows = c.max_seqs;
    o.graphs = c.cuda_graphs;
    o.fused_decode = c.cuda_fused_decode;
    o.sync_timeout_ms = (int64_t)std::ceil(c.step_timeout_s * 1000);
    return o;
  }
  std::unique_ptr<engine::device_forward> fwd_;
  std::vector<engine::device_sample_params> params_;
  std::vector<std::span<const int32_t>> histories_;
};

std::unique_ptr<backend> make_backend(const executor_config& c) {
  if (!c.fail_start.empty()) throw std::runtime_error(c.fail_start);
  if (c.cuda_device < 0) return std::make_unique<cpu_backend>(c);
  return std::make_unique<cuda_backend>(c);
}

struct executor_state {
  explicit executor_state(const executor_config& c) : cfg(c), dev(make_backend(c)) {}
  executor_config cfg;
  std::unique_ptr<backend> dev;
  std::vector<engine::seq_chunk> chunks;
  // The tokens sampled by the last step, for decodes planned ahead (scheduler_core::ahead_token).
  std::unordered_map<uint64_t, engine::token_id> last_sampled;
  // Structured output: the model's vocabulary as bytes, built at the first row with a grammar,
  // and each such sequence's place in its grammar, kept from one step to the next.
  std::unique_ptr<engine::vocab_index> vocab;
  std::unordered_map<uint64_t, engine::grammar_cursor> grammars;
  std::string injected_loss;  // tests: the device loss a step_work::inject_device_loss fault stands for
};

caf::error exception_error(std::exception_ptr& x) {
  try {
    std::rethrow_exception(x);
  } catch (const std::exception& e) {
    return caf::make_error(caf::sec::runtime_error, std::string(e.what()));
  } catch (...) {
    return caf::make_error(caf::sec::runtime_error, std::string("unknown exception"));
  }
}

}  // namespace

std::string exit_text(const caf::actor_system& sys, const caf::error& reason) {
  const caf::message& ctx = reason.context();
  if (reason.category() == caf::atom("system") && ctx.size() == 1 && ctx.match_element<std::string>(0))
    return ctx.get_as<std::string>(0);
  return sys.render(reason);
}

caf::behavior executor_actor(caf::event_based_actor* self, executor_config cfg, caf::actor supervisor) {
  std::shared_ptr<executor_state> st;
  try {
    st = std::make_shared<executor_state>(cfg);
  } catch (...) {
    auto x = std::current_exception();
    self->quit(exception_error(x));
    return {};
  }
  // A failed step (an exception) ends the actor with the exception's text as its exit reason. One
  // that lost the device (a sticky CUDA error) is told to the supervisor first: no restart on that
  // device can succeed.
  self->set_exception_handler([self, st, supervisor](caf::scheduled_actor*, std::exception_ptr& x) {
    caf::error err = exception_error(x);
    const std::string lost = st->injected_loss.empty() ? st->dev->device_lost(x) : st->injected_loss;
    if (!lost.empty()) self->send<caf::message_priority::high>(supervisor, lost_atom::value, exit_text(self->system(), err), lost);
    return err;
  });
  if (cfg.on_backend_up) {
    std::vector<size_t> bytes;
    for (int rows = 1; rows <= std::max(cfg.max_seqs, 1); ++rows) bytes.push_back(st->dev->step_weight_bytes(rows));
    cfg.on_backend_up(bytes);
  }
  self->send(supervisor, up_atom::value);
  return {
      [=](step_atom, step_work& w) -> step_output {
        const auto t0 = std::chrono::steady_clock::now();
        st->dev->copy_blocks(w.copies);
        step_output out;
        out.step = w.step;
        if (w.batch.empty()) return out;
        // Decodes planned ahead take the token this executor sampled for them in the step before.
        std::unordered_map<uint64_t, engine::token_id> fed;
        for (auto& e : w.batch)
          if (e.tokens.size() == 1 && e.tokens[0] == ahead_token) {
            auto it = st->last_sampled.find(e.seq);
            if (it == st->last_sampled.end()) throw std::logic_error("executor: a decode planned ahead has no token from the step before");
            e.tokens[0] = it->second;
            fed.emplace(e.seq, it->second);
          }
        st->chunks.clear();
        for (const auto& e : w.batch) st->chunks.push_back({e.tokens, e.pos0, e.block_table, false, !e.need_logits});
        if (w.inject_hang_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(w.inject_hang_s));
        if (w.inject_device_loss) st->injected_loss = "cudaErrorIllegalAddress: injected device loss";
        if (w.inject_fault) throw std::runtime_error("injected executor fault");
        // One sampling spec per entry with logits, in batch order.
        size_t n_rows = 0;
        for (const auto& e : w.batch)
          if (e.need_logits && (n_rows >= w.sampling.size() || w.sampling[n_rows++].seq != e.seq))
            throw std::logic_error("executor: sampling specs out of order");
        if (n_rows != w.sampling.size()) throw std::logic_error("executor: sampling specs out of order");
        // Each row's penalty history: the sequence so far, plus the token fed to a decode planned
        // ahead (the scheduler has not seen it yet).
        std::vector<std::vector<engine::token_id>> fed_histories(n_rows);
        std::vector<std::span<const engine::token_id>> histories(n_rows);
        bool logprobs = false, grammar = false;
        size_t window_tokens = 0;
        for (size_t i = 0; i < n_rows; ++i) {
          const sample_spec& sp = w.sampling[i];
          histories[i] = sp.history;
          if (auto f = fed.find(sp.seq); f != fed.end() && !sp.history.empty()) {
            fed_histories[i] = sp.history;
            fed_histories[i].push_back(f->second);
            histories[i] = fed_histories[i];
          }
          logprobs = logprobs || sp.params->logprobs || sp.params->top_logprobs > 0;
          grammar = grammar || sp.params->grammar != nullptr;
          window_tokens += engine::penalty_window(*sp.params, histories[i]).size();
        }
        if (grammar && !st->vocab) st->vocab = std::make_unique<engine::vocab_index>(cfg.model->vocab());
        if (!logprobs && !grammar && st->dev->samples_on_device(n_rows, window_tokens)) {
          std::vector<device_sample_row> rows;
          for (size_t i = 0; i < n_rows; ++i) {
            const sample_spec& sp = w.sampling[i];
            rows.push_back({sp.params.get(), sp.params->seed, sp.draw_index, engine::penalty_window(*sp.params, histories[i])});
          }
          const std::vector<engine::token_id> tokens = st->dev->forward_sample(st->chunks, rows);
          for (size_t i = 0; i < tokens.size(); ++i) out.tokens.push_back({w.sampling[i].seq, engine::sample_result{tokens[i], 0.0f, {}}});
        } else {
          const std::vector<float>& logits = st->dev->forward(st->chunks);
          std::vector<uint64_t> grammar_seqs;
          const size_t n_vocab = (size_t)cfg.model->hparams().n_vocab;
          std::vector<float> row(n_vocab);
          for (size_t i = 0; i < n_rows; ++i) {
            const sample_spec& sp = w.sampling[i];
            std::copy_n(logits.begin() + (ptrdiff_t)(i * n_vocab), n_vocab, row.begin());
            if (sp.params->grammar) {  // structured output: the text so far, plus the token fed ahead
              std::vector<engine::token_id> output = sp.output;
              if (auto f = fed.find(sp.seq); f != fed.end()) output.push_back(f->second);
              engine::sampling_params p = *sp.params;
              p.seed = engine::mix_seed(p.seed, sp.draw_index);
              p.has_seed = true;
              auto c = st->grammars.find(sp.seq);
              if (c == st->grammars.end() || c->second.grammar() != p.grammar.get())
                c = st->grammars.insert_or_assign(sp.seq, engine::grammar_cursor(p.grammar, *st->vocab)).first;
              out.tokens.push_back({sp.seq, engine::sample_constrained(row, histories[i], c->second, output, p)});
              grammar_seqs.push_back(sp.seq);
            } else {
              out.tokens.push_back({sp.seq, sample_on_host(row, *sp.params, sp.params->seed, sp.draw_index, histories[i])});
            }
          }
          // Cursors live while their sequence is sampled every step; one that misses a step
          // (finished, preempted) is dropped and replayed from its tokens if it comes back.
          if (st->grammars.size() > grammar_seqs.size())
            std::erase_if(st->grammars, [&](const auto& kv) {
              return std::find(grammar_seqs.begin(), grammar_seqs.end(), kv.first) == grammar_seqs.end();
            });
        }
        std::unordered_map<uint64_t, engine::token_id> sampled_now;
        for (const auto& t : out.tokens) sampled_now[t.seq] = t.r.token;
        st->last_sampled = std::move(sampled_now);
        out.compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return out;
      },
  };
}

}  // namespace troupe::actors
