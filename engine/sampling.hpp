// Token sampling over one row of logits: penalties, temperature, top-k, top-p, min-p, seeded
// draws, log-probabilities; and stop-string matching that is safe to stream.
//
// The chain follows llama.cpp's common sampler: penalties -> (temperature 0: argmax) ->
// top-k -> top-p -> min-p -> temperature -> softmax -> seeded draw. top-p and min-p therefore
// look at the distribution at temperature 1 (after penalties), as llama.cpp does.
//
// Log-probabilities (`sample_result::logprob`, `top`) are the log-softmax of the RAW logits, as
// the model produced them, before penalties, temperature or truncation: this is what OpenAI and
// vLLM report (the model's distribution, not the sampler's). They are computed stably (maximum
// subtracted, sums accumulated in double).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::engine {

class json_grammar;
class vocab_index;
class json_matcher;

struct sampling_params {
  float temperature = 1.0f;        // 0: greedy (argmax)
  int32_t top_k = 0;               // 0: off
  float top_p = 1.0f;              // 1: off
  float min_p = 0.0f;              // 0: off
  float repetition_penalty = 1.0f; // 1: off (llama.cpp / CTRL style: divide positive, multiply negative logits)
  float presence_penalty = 0.0f;   // OpenAI style, in [-2, 2]
  float frequency_penalty = 0.0f;  // OpenAI style, in [-2, 2]
  int32_t penalty_last_n = 64;     // how many recent tokens the penalties look at (-1: all)
  uint64_t seed = 0;
  bool has_seed = false;           // false: seeded from std::random_device
  int32_t top_logprobs = 0;        // 0..20 alternatives reported per step
  bool logprobs = false;
  std::vector<int32_t> stop_tokens;  // besides the model's end-of-generation tokens
  std::vector<std::string> stop;     // stop strings (not included in the output)
  bool ignore_eos = false;
  /// Structured output (response_format): the tokens drawn must keep the text a prefix of a value
  /// of this grammar, and the end of generation comes only once the value is complete. Null: free.
  std::shared_ptr<const json_grammar> grammar;

  /// Empty when valid, else one sentence naming the bad field and its allowed range.
  std::string validate() const;
};

struct token_logprob {
  int32_t token;
  float logprob;
};

struct sample_result {
  int32_t token;
  float logprob = 0.0f;                // of the chosen token under the unmodified model distribution
  std::vector<token_logprob> top;      // top_logprobs alternatives, most likely first
};

/// The tokens of `history` (the sequence so far) that the penalties of `p` count: its last
/// penalty_last_n (all for -1), none when no penalty is active or penalty_last_n is 0.
std::span<const int32_t> penalty_window(const sampling_params& p, std::span<const int32_t> history);

/// One sampler per sequence: it owns the random stream, so the same seed and the same logits
/// give the same tokens. Not thread-safe; cheap to construct.
///
/// Draw procedure (stable across releases, so seeded runs reproduce):
///  - the surviving candidates are ordered: by id when top-k is off (min-p and top-p then only
///    zero the weights of the tokens they drop), else by logit descending, ties to the lower id;
///  - weight w_i = exp((l_i - l_max) * (1 / T)) in float, with troupe's own exp (so draws do
///    not depend on the C library), summed in double to W;
///  - one 64-bit output r of the mt19937_64 gives u = (r >> 11) * 2^-53 in [0, 1);
///  - the token is the first candidate whose running sum of weights exceeds u * W (the last
///    candidate with a non-zero weight if rounding leaves none). Over the whole vocabulary the
///    running sum skips whole blocks of 64 weights by their pre-summed totals.
/// If no logit is finite the result is token 0.
/// Greedy (temperature 0, or top_k = 1 at any temperature) consumes no random number and picks
/// the lowest id among tied maxima.
class sampler {
 public:
  /// `p` should have passed validate(); the constructor does not re-check it.
  explicit sampler(const sampling_params& p);
  /// Picks the next token. `logits` (n_vocab floats, non-empty; a NaN is never chosen while
  /// some logit is finite) is scratch and may be
  /// modified (penalties are applied in place); `history` is the sequence so far (prompt and
  /// generated) for the penalties; ids outside [0, n_vocab) in it are ignored.
  /// `logprob` and `top` are filled only when `params().logprobs` or `top_logprobs > 0`.
  /// Throws std::invalid_argument on empty logits.
  /// `allowed` (n_vocab bits, empty: all): only these tokens may be drawn (their logits are
  /// masked after the penalties; log-probabilities stay those of the raw logits).
  sample_result sample(std::span<float> logits, std::span<const int32_t> history, std::span<const uint64_t> allowed = {});
  const sampling_params& params() const { return p_; }

 private:
  void apply_penalties(std::span<float> logits, std::span<const int32_t> history);
  /// Fills cand_ with the top-k (k < n) candidates, sorted best first.
  void select_top_k(std::span<const float> logits, size_t k);
  /// The last token (logit, id) of the smallest best-first prefix whose softmax mass reaches
  /// top_p, found without sorting the vocabulary.
  std::pair<float, int32_t> top_p_boundary(std::span<const float> logits, float l_max);
  /// Draws from cand_ (sorted best first).
  int32_t draw_sorted(float temperature);
  /// Draws over the whole vocabulary in id order from the tokens with logit >= min_logit,
  /// except those tied at min_logit with an id above last_tied.
  int32_t draw_full(std::span<const float> logits, float l_max, float temperature, float min_logit,
                    int32_t last_tied);
  double next_unit();

  sampling_params p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;      // scratch: (logit, id)
  std::vector<float> weights_;                       // scratch: draw weights
  std::vector<double> block_sums_;                   // scratch: weights_ summed per block
  std::vector<int32_t> window_;                      // scratch: sorted penalty window
  std::vector<std::pair<int32_t, float>> saved_;     // scratch: raw logits overwritten by penalties
};

/// The seed of draw `index` of a sequence seeded with `seed` (splitmix64 of the pair): a
/// sequence's draws are independent and reproducible whatever steps they fall in.
uint64_t mix_seed(uint64_t seed, uint64_t index);

/// One sequence's place in its grammar (sampling_params::grammar), kept across steps: sync()
/// feeds the matcher only the tokens generated since the last call, or replays all of them when
/// the history is not the one it followed (a preempted and recomputed sequence).
class grammar_cursor {
 public:
  grammar_cursor(std::shared_ptr<const json_grammar> g, const vocab_index& v);
  ~grammar_cursor();
  grammar_cursor(grammar_cursor&&) noexcept;
  grammar_cursor& operator=(grammar_cursor&&) noexcept;
  /// False when `generated` leaves the grammar.
  bool sync(std::span<const int32_t> generated);
  const json_matcher& matcher() const { return *m_; }
  const vocab_index& vocab() const { return *v_; }
  const json_grammar* grammar() const { return g_.get(); }

 private:
  std::shared_ptr<const json_grammar> g_;
  const vocab_index* v_;
  std::unique_ptr<json_matcher> m_;
  std::vector<int32_t> fed_;
  bool ok_ = true;
};

/// Samples under the cursor's grammar after `generated` (the tokens generated so far): a token is
/// drawn as sampler::sample would; when the grammar rejects it, it is drawn again from the allowed
/// tokens only (llama.cpp's order: cheap while the model already follows the grammar; greedy
/// takes the best allowed token either way). When no token is allowed (the history left the
/// grammar, or a depth limit closes every way on), the first end-of-generation token. `logits`
/// is scratch.
sample_result sample_constrained(std::span<float> logits, std::span<const int32_t> history, grammar_cursor& cursor,
                                 std::span<const int32_t> generated, const sampling_params& p);

/// Limits enforced by `sampling_params::validate()`.
inline constexpr int32_t max_top_logprobs = 20;
inline constexpr size_t max_stop_strings = 16;
inline constexpr size_t max_stop_string_bytes = 256;

/// Streams text through a set of stop strings: releases text as soon as it can no longer be the
/// start of a stop string, and reports the stop when one completes (the stop text is dropped).
/// Holds back only the longest suffix of the text seen so far that is a prefix of some stop
/// string. The first stop string to complete wins (the longest, i.e. earliest-starting, if
/// several complete at the same byte), so the result does not depend on how the text is split
/// into pushes: the text before the match is returned with stopped = true, everything after it
/// is discarded, and later pushes return nothing. Empty stop strings are ignored.
class stop_matcher {
 public:
  explicit stop_matcher(std::vector<std::string> stops);
  struct result {
    std::string text;   // safe to emit now
    bool stopped = false;
  };
  result push(std::string_view text);
  /// Text held back at the end of generation (it did not become a stop string); empty after a
  /// stop.
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  /// Length of the longest suffix of held_ that is a proper prefix of some stop string.
  size_t held_prefix_length() const;

  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace troupe::engine
