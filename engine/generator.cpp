#include "engine/generator.hpp"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "engine/block_manager.hpp"
#include "engine/json_grammar.hpp"

namespace troupe::engine {

namespace {
using clock_t_ = std::chrono::steady_clock;
double since(clock_t_::time_point t0) { return std::chrono::duration<double>(clock_t_::now() - t0).count(); }

struct seq_state {
  const generation_request* req;
  std::vector<token_id> tokens;  // prompt then generated
  int64_t n_done = 0;            // positions already in the KV cache
  sampler samp;
  stop_matcher stops;
  stream_decoder dec;
  generation_result res;
  std::unique_ptr<grammar_cursor> grammar;  // structured output (sampling.grammar)
  bool finished = false;
  seq_state(const generation_request& r, const tokenizer& tok)
      : req(&r), tokens(r.prompt), samp(r.sampling), stops(r.sampling.stop), dec(tok, false) {}
};

kv_groups groups_of(const kv_shape& shape, int step_tokens) { return {shape.n_groups, shape.window, step_tokens}; }

// The sequences' block tables, from a block manager over the forward's pool (blocks of a sliding
// group given back once out of the window, as the scheduler's are).
class kv_tables {
 public:
  kv_tables(const kv_shape& shape, int32_t n_blocks, int step_tokens)
      : bm_(shape.block_size, n_blocks, 0, kv_block_hash, groups_of(shape, step_tokens)) {}
  /// A new sequence; returns its positions already cached (a prompt prefix another computed).
  int64_t add(uint64_t id, std::span<const token_id> prompt) {
    const auto hit = bm_.allocate(id, prompt);
    if (!hit) throw std::logic_error("generator: the KV pool is smaller than its requests need");
    return *hit;
  }
  /// The table of a step over positions [n_done, n_done + n) of sequence `id`.
  std::vector<int32_t> step(uint64_t id, int64_t n_done, int64_t n, split_forward& fwd) {
    copies_.clear();
    if (!bm_.append(id, std::max<int64_t>(0, n_done + n - bm_.n_positions(id)), copies_))
      throw std::logic_error("generator: the KV pool is smaller than its requests need");
    if (!copies_.empty())  // copy-on-write of a shared last block
      fwd.for_each_kv([&](kv_storage& d, kv_storage&) {
        for (const block_copy& c : copies_) std::memcpy(d.block_data(c.dst), d.block_data(c.src), (size_t)d.shape().block_bytes());
      });
    return bm_.step_table(id, n_done + n);
  }
  /// Positions [0, tokens.size()) of `id` are computed.
  void commit(uint64_t id, std::span<const token_id> tokens) { bm_.commit(id, tokens); }
  void drop(uint64_t id) { bm_.free(id); }

 private:
  block_manager bm_;
  std::vector<block_copy> copies_;
};

}  // namespace

const char* to_string(finish_reason r) {
  switch (r) {
    case finish_reason::stop: return "stop";
    case finish_reason::length: return "length";
  }
  return "?";
}

generator::generator(const model& m, const generator_options& opt)
    : m_(m),
      opt_(opt),
      n_ctx_(opt.n_ctx > 0 ? opt.n_ctx : m.hparams().n_ctx_train),
      shape_(model_kv_shape(m, opt.block_size, opt.kv_window_groups && opt.pipeline_parallel == 1)) {
  if (std::string err = parallel_error(m, parallel()); !err.empty()) throw std::invalid_argument(err);
}

generator::~generator() = default;

void generator::ensure_kv(int64_t n_blocks) {
  if (kv_blocks_ >= n_blocks) return;
  fwd_.reset();  // the old cache first: both are never held at once
  fwd_ = std::make_unique<split_forward>(m_, parallel(), shape_, (int32_t)n_blocks, 1, opt_.n_threads);
  kv_blocks_ = n_blocks;
}

std::vector<float> generator::logits_all(std::span<const token_id> tokens) {
  if (tokens.empty()) throw std::invalid_argument("no tokens");
  if ((int64_t)tokens.size() > n_ctx_)
    throw std::invalid_argument(std::to_string(tokens.size()) + " tokens exceed the context of " + std::to_string(n_ctx_));
  const int32_t nb = kv_peak_blocks((int64_t)tokens.size(), opt_.block_size, groups_of(shape_, opt_.n_batch));
  ensure_kv(nb);
  kv_tables kv(shape_, nb, opt_.n_batch);
  kv.add(0, tokens);  // a fresh pool: nothing cached
  const int n_vocab = m_.hparams().n_vocab;
  std::vector<float> out;
  out.reserve(tokens.size() * (size_t)n_vocab);
  for (size_t p = 0; p < tokens.size(); p += (size_t)opt_.n_batch) {
    const size_t len = std::min(tokens.size() - p, (size_t)opt_.n_batch);
    const std::vector<int32_t> table = kv.step(0, (int64_t)p, (int64_t)len, *fwd_);
    seq_chunk c{tokens.subspan(p, len), (int64_t)p, table, true};
    const auto& l = fwd_->forward(std::span(&c, 1));
    out.insert(out.end(), l.begin(), l.begin() + (ptrdiff_t)(len * (size_t)n_vocab));
    kv.commit(0, tokens.first(p + len));
  }
  return out;
}

std::vector<generation_result> generator::run(std::span<const generation_request> reqs, const on_token_fn& on_token) {
  const tokenizer& tok = m_.vocab();
  const int n_vocab = m_.hparams().n_vocab;
  int64_t total_blocks = 0;
  for (const auto& r : reqs) {
    if (r.prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if (r.max_tokens < 1) throw std::invalid_argument("max_tokens must be at least 1, got " + std::to_string(r.max_tokens));
    if ((int64_t)r.prompt.size() + r.max_tokens > n_ctx_)
      throw std::invalid_argument("prompt of " + std::to_string(r.prompt.size()) + " tokens + max_tokens " +
                                  std::to_string(r.max_tokens) + " exceed the context of " + std::to_string(n_ctx_) + " tokens");
    for (token_id t : r.prompt)
      if (t < 0 || t >= n_vocab) throw std::invalid_argument("prompt token " + std::to_string(t) + " outside the vocabulary");
    if (auto err = r.sampling.validate(); !err.empty()) throw std::invalid_argument(err);
    total_blocks += kv_peak_blocks((int64_t)r.prompt.size() + r.max_tokens, opt_.block_size, groups_of(shape_, opt_.n_batch));
  }
  if (total_blocks > INT32_MAX) throw std::invalid_argument("the requests need more than 2^31 KV blocks");
  ensure_kv(total_blocks);
  kv_tables kv(shape_, (int32_t)total_blocks, opt_.n_batch);

  std::vector<seq_state> seqs;
  seqs.reserve(reqs.size());
  for (const auto& r : reqs) seqs.emplace_back(r, tok);
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i].n_done = kv.add(i, reqs[i].prompt);

  const auto t0 = clock_t_::now();
  std::vector<seq_chunk> batch;
  std::vector<size_t> owner;                 // batch entry -> sequence index
  std::vector<std::vector<int32_t>> tables;  // batch entry -> its block tables
  for (;;) {
    // Plan the step: decodes first, then prefill chunks under the token budget.
    batch.clear();
    owner.clear();
    tables.clear();
    int64_t budget = opt_.n_batch;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seq_state& s = seqs[i];
      if (s.finished || s.n_done < (int64_t)s.req->prompt.size()) continue;
      tables.push_back(kv.step(i, s.n_done, 1, *fwd_));
      batch.push_back({std::span(s.tokens).subspan((size_t)s.n_done, 1), s.n_done, {}, false});
      owner.push_back(i);
      --budget;
    }
    for (size_t i = 0; i < seqs.size() && budget > 0; ++i) {
      seq_state& s = seqs[i];
      const int64_t left = (int64_t)s.req->prompt.size() - s.n_done;
      if (s.finished || left <= 0) continue;
      const int64_t len = std::min(left, budget);
      tables.push_back(kv.step(i, s.n_done, len, *fwd_));
      batch.push_back({std::span(s.tokens).subspan((size_t)s.n_done, (size_t)len), s.n_done, {}, false, len < left});
      owner.push_back(i);
      budget -= len;
    }
    if (batch.empty()) break;
    for (size_t b = 0; b < batch.size(); ++b) batch[b].block_table = tables[b];  // tables no longer grows

    const std::vector<float>& logits = fwd_->forward(batch);
    for (size_t b = 0; b < batch.size(); ++b) {
      seq_state& s = seqs[owner[b]];
      s.n_done += (int64_t)batch[b].tokens.size();
      kv.commit(owner[b], std::span(s.tokens).first((size_t)s.n_done));
    }
    for (size_t b = 0, row_i = 0; b < batch.size(); ++b) {
      seq_state& s = seqs[owner[b]];
      if (batch[b].no_logits) continue;  // mid-prompt chunk: no token yet
      const auto first = logits.begin() + (ptrdiff_t)(row_i++ * (size_t)n_vocab);
      std::vector<float> row(first, first + n_vocab);
      sample_result sr;
      if (s.req->sampling.grammar) {  // structured output, each draw seeded as the server seeds it
        if (!vocab_) vocab_ = std::make_unique<vocab_index>(tok);
        if (!s.grammar) s.grammar = std::make_unique<grammar_cursor>(s.req->sampling.grammar, *vocab_);
        sampling_params p = s.req->sampling;
        p.seed = mix_seed(p.seed, s.res.tokens.size());
        sr = sample_constrained(row, s.tokens, *s.grammar, s.res.tokens, p);
      } else {
        sr = s.samp.sample(row, s.tokens);
      }
      if (s.res.tokens.empty()) s.res.prefill_s = since(t0);
      const sampling_params& sp = s.req->sampling;
      bool by_string = false;
      bool stop_token = !sp.ignore_eos && tok.is_eog(sr.token);
      for (int32_t st : sp.stop_tokens) stop_token |= sr.token == st;
      if (stop_token) {
        s.finished = true;
        s.res.finish = finish_reason::stop;
      } else {
        s.tokens.push_back(sr.token);
        s.res.tokens.push_back(sr.token);
        if (sp.logprobs) s.res.samples.push_back(sr);
        const auto piece = s.stops.push(s.dec.push(sr.token));
        s.res.text += piece.text;
        const bool keep = on_token ? on_token(owner[b], sr.token, piece.text) : true;
        if (piece.stopped || !keep) {
          by_string = piece.stopped;
          s.finished = true;
          s.res.finish = finish_reason::stop;
        } else if ((int32_t)s.res.tokens.size() >= s.req->max_tokens) {
          s.finished = true;
          s.res.finish = finish_reason::length;
        }
      }
      if (s.finished) {
        if (!by_string) {  // text held back for an incomplete character or a possible stop string
          std::string rest = s.stops.push(s.dec.flush()).text + s.stops.flush();
          s.res.text += rest;
          if (on_token && !rest.empty()) on_token(owner[b], -1, rest);
        }
        s.res.total_s = since(t0);
        kv.drop(owner[b]);
      }
    }
  }
  std::vector<generation_result> out;
  out.reserve(seqs.size());
  for (auto& s : seqs) out.push_back(std::move(s.res));
  return out;
}

}  // namespace troupe::engine
