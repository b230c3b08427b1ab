#include "engine/sampling.hpp"

#include "engine/json_grammar.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace troupe::engine {

namespace {

constexpr float neg_inf = -std::numeric_limits<float>::infinity();

/// Above this k a min-heap scan costs more than nth_element over the whole vocabulary.
constexpr size_t heap_top_k_limit = 256;
/// Mass quickselect (top-p without top-k) sorts what is left below this size, or after this
/// many partition rounds (a bound on the worst case).
constexpr size_t top_p_sort_below = 64;
constexpr int top_p_max_rounds = 48;

/// NaN would break the strict weak order the selection algorithms need: it ranks as -inf.
float rank_key(float x) { return std::isnan(x) ? neg_inf : x; }

/// Strict "better than": higher logit first, ties to the lower id. A total order, so the top-k
/// set and the sorted order are unique.
bool better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

/// exp(x) for x <= 0: Cephes' expf polynomial (relative error ~1e-7), exactly 0 below -87 (and
/// for -inf); NaN propagates. Our own function rather than libm's so that seeded draws do not
/// depend on the C library. Written once for scalars and for 8-float vectors (GCC/Clang vector
/// extensions, so it vectorises without -ffast-math).
template <typename F, typename I>
inline void exp_nonpositive_impl(const F& x, const F& zero, F& out) {
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const F lo = zero - 87.0f;
  const F xc = x < lo ? lo : x;
  const F n = (xc * log2e + round_magic) - round_magic;
  F r = xc - n * ln2_hi;
  r = r - n * ln2_lo;
  F poly = zero + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const F y = poly * r * r + r + 1.0f;
  F scale;
  if constexpr (std::is_same_v<F, float>) {
    scale = std::bit_cast<float>(uint32_t(int32_t(n) + 127) << 23);
  } else {
    scale = (F)((__builtin_convertvector(n, I) + 127) << 23);
  }
  out = x < lo ? zero : y * scale;
}

using v8f = float __attribute__((vector_size(32)));
using v8i = int32_t __attribute__((vector_size(32)));
using v4d = double __attribute__((vector_size(32)));
using v4u64 = uint64_t __attribute__((vector_size(32)));

// Vectors travel by reference: passing them by value has a different ABI with and without AVX,
// which GCC reports.
inline float exp_nonpositive(float x) {
  float out;
  exp_nonpositive_impl<float, int32_t>(x, 0.0f, out);
  return out;
}
inline void exp_nonpositive(const v8f& x, v8f& out) { exp_nonpositive_impl<v8f, v8i>(x, v8f{}, out); }
inline void load8(const float* p, v8f& v) { std::memcpy(&v, p, sizeof v); }

/// Largest non-NaN value (-inf when there is none).
float max_value(std::span<const float> x) {
  const size_t n = x.size();
  v8f m8 = v8f{} + neg_inf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f v;
    load8(&x[i], v);
    m8 = v > m8 ? v : m8;
  }
  float m = neg_inf;
  for (int j = 0; j < 8; ++j) m = m8[j] > m ? m8[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

/// Floats per block of the draw weights: block sums let the draw skip whole blocks.
constexpr size_t weight_block = 64;

/// w[i] = exp((x[i] - shift) * scale) where x[i] >= min_x (NaN never is), else 0; block_sums
/// gets one double per weight_block floats. Returns the total (the sum of block_sums).
/// Precondition: shift >= every x[i] >= min_x, so the exponents are <= 0.
double weigh(std::span<const float> x, float shift, float scale, float min_x, std::vector<float>& w,
             std::vector<double>& block_sums) {
  const size_t n = x.size();
  w.resize(n);
  block_sums.resize((n + weight_block - 1) / weight_block);
  double total = 0.0;
  for (size_t b = 0; b < block_sums.size(); ++b) {
    const size_t i0 = b * weight_block, i1 = std::min(n, i0 + weight_block);
    v4d acc_lo{}, acc_hi{};  // double accumulation, in 8 lanes
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) {
      v8f v, e;
      load8(&x[i], v);
      exp_nonpositive((v - shift) * scale, e);
      const v8f we = v >= min_x ? e : v8f{};
      std::memcpy(&w[i], &we, sizeof we);
      acc_lo += __builtin_convertvector(__builtin_shufflevector(we, we, 0, 1, 2, 3), v4d);
      acc_hi += __builtin_convertvector(__builtin_shufflevector(we, we, 4, 5, 6, 7), v4d);
    }
    const v4d acc = acc_lo + acc_hi;
    double sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i < i1; ++i) {
      w[i] = x[i] >= min_x ? exp_nonpositive((x[i] - shift) * scale) : 0.0f;
      sum += w[i];
    }
    block_sums[b] = sum;
    total += sum;
  }
  return total;
}

/// Index of the first weight at which the running sum exceeds target: whole blocks first, then
/// element by element; the last non-zero weight when rounding leaves none.
size_t pick(std::span<const float> w, std::span<const double> block_sums, double target) {
  double cum = 0.0;
  size_t b = 0;
  while (b + 1 < block_sums.size() && cum + block_sums[b] <= target) cum += block_sums[b++];
  size_t last_positive = w.size();
  for (size_t i = b * weight_block; i < w.size(); ++i) {
    if (!(w[i] > 0.0f)) continue;
    cum += w[i];
    last_positive = i;
    if (cum > target) return i;
  }
  if (last_positive == w.size()) {  // nothing positive from block b on: search backwards
    for (size_t i = std::min(w.size(), b * weight_block); i-- > 0;)
      if (w[i] > 0.0f) return i;
    return 0;
  }
  return last_positive;
}

std::string range_error(const char* field, const char* range, double got) {
  std::ostringstream os;
  os << field << " must be in " << range << " (got " << got << ")";
  return os.str();
}

bool in_closed(float x, float lo, float hi) { return std::isfinite(x) && x >= lo && x <= hi; }

}  // namespace

std::string sampling_params::validate() const {
  if (!in_closed(temperature, 0.0f, 100.0f)) return range_error("temperature", "[0, 100]", temperature);
  if (top_k < 0) return range_error("top_k", "[0, inf) (0 = off)", top_k);
  if (!(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f))
    return range_error("top_p", "(0, 1]", top_p);
  if (!in_closed(min_p, 0.0f, 1.0f)) return range_error("min_p", "[0, 1]", min_p);
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f && repetition_penalty <= 10.0f))
    return range_error("repetition_penalty", "(0, 10]", repetition_penalty);
  if (!in_closed(presence_penalty, -2.0f, 2.0f))
    return range_error("presence_penalty", "[-2, 2]", presence_penalty);
  if (!in_closed(frequency_penalty, -2.0f, 2.0f))
    return range_error("frequency_penalty", "[-2, 2]", frequency_penalty);
  if (top_logprobs < 0 || top_logprobs > max_top_logprobs)
    return range_error("top_logprobs", "[0, 20]", top_logprobs);
  if (penalty_last_n < -1) return range_error("penalty_last_n", "[-1, inf) (-1 = all)", penalty_last_n);
  if (stop.size() > max_stop_strings)
    return "stop must hold at most " + std::to_string(max_stop_strings) + " strings (got " +
           std::to_string(stop.size()) + ")";
  for (const auto& s : stop) {
    if (s.empty()) return "stop strings must not be empty";
    if (s.size() > max_stop_string_bytes)
      return "each stop string must be at most " + std::to_string(max_stop_string_bytes) +
             " bytes (got " + std::to_string(s.size()) + ")";
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// sampler

sampler::sampler(const sampling_params& p) : p_(p) {
  if (p_.has_seed) {
    rng_.seed(p_.seed);
  } else {
    std::random_device rd;
    rng_.seed((uint64_t(rd()) << 32) ^ uint64_t(rd()));
  }
}

double sampler::next_unit() { return double(rng_() >> 11) * 0x1.0p-53; }

std::span<const int32_t> penalty_window(const sampling_params& p, std::span<const int32_t> history) {
  const bool active = p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  if (!active || p.penalty_last_n == 0) return {};
  if (p.penalty_last_n > 0 && history.size() > size_t(p.penalty_last_n))
    return history.subspan(history.size() - size_t(p.penalty_last_n));
  return history;
}

void sampler::apply_penalties(std::span<float> logits, std::span<const int32_t> history) {
  saved_.clear();
  const auto window = penalty_window(p_, history);
  if (window.empty()) return;
  window_.assign(window.begin(), window.end());
  std::sort(window_.begin(), window_.end());
  const auto n_vocab = int64_t(logits.size());
  for (size_t i = 0; i < window_.size();) {
    const int32_t tok = window_[i];
    size_t j = i;
    while (j < window_.size() && window_[j] == tok) ++j;
    const auto count = float(j - i);
    i = j;
    if (tok < 0 || tok >= n_vocab) continue;
    float& l = logits[size_t(tok)];
    saved_.emplace_back(tok, l);
    // llama.cpp (CTRL) repetition penalty, then OpenAI frequency and presence penalties.
    l = l <= 0.0f ? l * p_.repetition_penalty : l / p_.repetition_penalty;
    l -= count * p_.frequency_penalty + p_.presence_penalty;
  }
}

void sampler::select_top_k(std::span<const float> logits, size_t k) {
  cand_.clear();
  const auto n = logits.size();
  if (k <= heap_top_k_limit) {
    // Heap of the k best so far with the worst on top. Ids only grow, so a later token beats the
    // top exactly when its logit is strictly greater: one predictable comparison per token.
    const auto worse_on_top = [](const auto& a, const auto& b) { return better(a, b); };
    for (size_t i = 0; i < k; ++i) cand_.emplace_back(rank_key(logits[i]), int32_t(i));
    std::make_heap(cand_.begin(), cand_.end(), worse_on_top);
    float threshold = cand_.front().first;
    const auto offer = [&](size_t i) {
      if (!(logits[i] > threshold)) return;  // NaN ranks as -inf: never enters
      std::pop_heap(cand_.begin(), cand_.end(), worse_on_top);
      cand_.back() = {logits[i], int32_t(i)};
      std::push_heap(cand_.begin(), cand_.end(), worse_on_top);
      threshold = cand_.front().first;
    };
    size_t i = k;
    for (; i + 8 <= n; i += 8) {  // skip groups of 8 that hold no candidate
      v8f v;
      load8(&logits[i], v);
      const v4u64 beats = (v4u64)(v > threshold);
      if ((beats[0] | beats[1] | beats[2] | beats[3]) == 0) continue;
      for (size_t j = i; j < i + 8; ++j) offer(j);
    }
    for (; i < n; ++i) offer(i);
  } else {
    cand_.resize(n);
    for (size_t i = 0; i < n; ++i) cand_[i] = {rank_key(logits[i]), int32_t(i)};
    std::nth_element(cand_.begin(), cand_.begin() + ptrdiff_t(k), cand_.end(), better);
    cand_.resize(k);
  }
  std::sort(cand_.begin(), cand_.end(), better);
}

std::pair<float, int32_t> sampler::top_p_boundary(std::span<const float> logits, float l_max) {
  const auto n = logits.size();
  const double total = weigh(logits, l_max, 1.0f, neg_inf, weights_, block_sums_);
  const double target = double(p_.top_p) * total;
  const auto w = [&](const std::pair<float, int32_t>& c) { return double(weights_[size_t(c.second)]); };
  // Every token of the top-p set has weight >= (1 - p) * total / n: were one lighter, all the
  // tokens after it (lighter still, more than 1 - p of the mass) would weigh less than n times
  // that. So the lighter tokens are dropped before any selection (halved: a rounding margin).
  const float floor_w = float(0.5 * (1.0 - double(p_.top_p)) * total / double(n));
  cand_.clear();
  for (size_t i = 0; i < n; ++i) {
    if (weights_[i] >= floor_w && weights_[i] > 0.0f) cand_.emplace_back(logits[i], int32_t(i));
  }
  if (cand_.empty()) return {l_max, int32_t(std::find(logits.begin(), logits.end(), l_max) - logits.begin())};
  // Quickselect by mass: [0, lo) is known to be in the set, in no particular order; the
  // boundary (the last token of the sorted prefix) lies in [lo, hi).
  size_t lo = 0, hi = cand_.size();
  double mass = 0.0;  // of [0, lo)
  for (int round = 0; hi - lo > top_p_sort_below && round < top_p_max_rounds; ++round) {
    const auto first = cand_.begin() + ptrdiff_t(lo), last = cand_.begin() + ptrdiff_t(hi);
    // Median of three as the pivot.
    auto a = first, b = first + ptrdiff_t((hi - lo) / 2), c = last - 1;
    if (better(*b, *a)) std::swap(a, b);
    if (better(*c, *b)) std::swap(b, c);
    if (better(*b, *a)) std::swap(a, b);
    const auto pivot = *b;
    const auto mid = std::partition(first, last, [&](const auto& x) { return better(x, pivot); });
    double mass_better = 0.0;
    for (auto it = first; it != mid; ++it) mass_better += w(*it);
    if (mass + mass_better >= target) {
      hi = size_t(mid - cand_.begin());
      continue;
    }
    mass += mass_better;
    std::iter_swap(mid, std::find(mid, last, pivot));
    mass += w(*mid);
    lo = size_t(mid - cand_.begin()) + 1;
    if (mass >= target) return *mid;
  }
  std::sort(cand_.begin() + ptrdiff_t(lo), cand_.begin() + ptrdiff_t(hi), better);
  for (size_t i = lo; i < hi; ++i) {
    mass += w(cand_[i]);
    if (mass >= target) return cand_[i];
  }
  return cand_[hi - 1];  // rounding: everything up to here
}

int32_t sampler::draw_sorted(float temperature) {
  // cand_ is non-empty and sorted best first, so cand_[0] holds the maximum.
  const float l_max = cand_.front().first;
  const float inv_t = 1.0f / temperature;
  weights_.resize(cand_.size());
  double total = 0.0;
  for (size_t i = 0; i < cand_.size(); ++i) {
    weights_[i] = exp_nonpositive((cand_[i].first - l_max) * inv_t);
    total += weights_[i];
  }
  const double target = next_unit() * total;
  double cum = 0.0;
  int32_t last_positive = cand_.front().second;
  for (size_t i = 0; i < cand_.size(); ++i) {
    if (!(weights_[i] > 0.0f)) continue;
    cum += weights_[i];
    last_positive = cand_[i].second;
    if (cum > target) return cand_[i].second;
  }
  return last_positive;
}

int32_t sampler::draw_full(std::span<const float> logits, float l_max, float temperature,
                           float min_logit, int32_t last_tied) {
  const double total = weigh(logits, l_max, 1.0f / temperature, min_logit, weights_, block_sums_);
  double adjusted = total;
  // Tokens tied with the boundary logit after the boundary id are outside the set.
  for (size_t i = size_t(last_tied) + 1; i < logits.size(); ++i) {
    if (logits[i] == min_logit && weights_[i] > 0.0f) {
      block_sums_[i / weight_block] -= weights_[i];
      adjusted -= weights_[i];
      weights_[i] = 0.0f;
    }
  }
  return int32_t(pick(weights_, block_sums_, next_unit() * adjusted));
}

sample_result sampler::sample(std::span<float> logits, std::span<const int32_t> history, std::span<const uint64_t> allowed) {
  if (logits.empty()) throw std::invalid_argument("sampler::sample: empty logits");
  const size_t n = logits.size();
  sample_result out{};
  const bool want_logprobs = p_.logprobs || p_.top_logprobs > 0;

  // Raw log-softmax normaliser and the top alternatives, before anything modifies the logits.
  double log_z = 0.0;
  if (want_logprobs) {
    const float l_max = max_value(logits);
    log_z = double(l_max) + std::log(weigh(logits, l_max, 1.0f, neg_inf, weights_, block_sums_));
    if (p_.top_logprobs > 0) {
      select_top_k(logits, std::min(n, size_t(p_.top_logprobs)));
      out.top.reserve(cand_.size());
      for (const auto& [l, id] : cand_) out.top.push_back({id, float(double(l) - log_z)});
    }
  }

  apply_penalties(logits, history);
  if (!allowed.empty()) {
    if (allowed.size() * 64 < n) throw std::invalid_argument("sampler::sample: the allowed set is shorter than the logits");
    for (size_t i = 0; i < n; ++i)
      if (!((allowed[i >> 6] >> (i & 63)) & 1)) logits[i] = neg_inf;
  }

  const size_t k = (p_.top_k > 0 && size_t(p_.top_k) < n) ? size_t(p_.top_k) : 0;
  if (p_.temperature == 0.0f || k == 1) {
    // Greedy: first maximum in id order, i.e. ties go to the lowest id.
    const float l_max = max_value(logits);
    const auto it = std::find(logits.begin(), logits.end(), l_max);
    out.token = it == logits.end() ? 0 : int32_t(it - logits.begin());
  } else if (k == 0) {
    // No sorting: min-p is a threshold on the logit, l >= l_max + log(min_p), and the top-p set
    // is every token ranked at or above a boundary token; draw over the vocabulary in id order.
    const float l_max = max_value(logits);
    if (l_max == neg_inf) {
      out.token = 0;  // no finite logit: nothing to draw from (greedy agrees)
    } else {
      float min_logit = p_.min_p > 0.0f ? l_max + std::log(p_.min_p) : neg_inf;
      int32_t last_tied = int32_t(n - 1);
      if (p_.top_p < 1.0f) {
        const auto [l_b, id_b] = top_p_boundary(logits, l_max);
        if (l_b >= min_logit) {
          min_logit = l_b;
          last_tied = id_b;
        }
      }
      out.token = draw_full(logits, l_max, p_.temperature, min_logit, last_tied);
    }
  } else {
    select_top_k(logits, k);
    if (p_.top_p < 1.0f) {
      // top-p over the top-k survivors, at temperature 1.
      const float l_max = cand_.front().first;
      double total = 0.0;
      for (const auto& c : cand_) total += exp_nonpositive(c.first - l_max);
      const double target = double(p_.top_p) * total;
      double cum = 0.0;
      for (size_t i = 0; i < cand_.size(); ++i) {
        cum += exp_nonpositive(cand_[i].first - l_max);
        if (cum >= target) {
          cand_.resize(i + 1);
          break;
        }
      }
    }
    if (p_.min_p > 0.0f) {
      const float min_logit = cand_.front().first + std::log(p_.min_p);
      const auto end = std::find_if(cand_.begin(), cand_.end(),
                                    [&](const auto& c) { return c.first < min_logit; });
      cand_.erase(end, cand_.end());  // sorted: the survivors are a prefix (never empty)
    }
    out.token = draw_sorted(p_.temperature);
  }

  if (want_logprobs) {
    float raw = logits[size_t(out.token)];
    for (const auto& [id, l] : saved_) {
      if (id == out.token) raw = l;
    }
    out.logprob = float(double(rank_key(raw)) - log_z);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// stop_matcher

stop_matcher::stop_matcher(std::vector<std::string> stops) {
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

size_t stop_matcher::held_prefix_length() const {
  size_t best = 0;
  const size_t n = held_.size();
  for (const auto& s : stops_) {
    // Longest L < |s| with held_ ending in s[0, L); only L longer than the best so far matter.
    for (size_t len = std::min(n, s.size() - 1); len > best; --len) {
      if (held_[n - len] == s[0] && held_.compare(n - len, len, s, 0, len) == 0) {
        best = len;
        break;
      }
    }
  }
  return best;
}

stop_matcher::result stop_matcher::push(std::string_view text) {
  result r;
  if (stopped_) {
    r.stopped = true;
    return r;
  }
  held_.append(text);
  // The first stop to complete wins (the longest if several end at the same byte), which is
  // what a byte-by-byte feed would report: the result does not depend on the push sizes.
  size_t first = std::string::npos;
  size_t first_end = std::string::npos;
  for (const auto& s : stops_) {
    const size_t pos = held_.find(s);
    if (pos == std::string::npos) continue;
    const size_t end = pos + s.size();
    if (end < first_end || (end == first_end && pos < first)) {
      first = pos;
      first_end = end;
    }
  }
  if (first != std::string::npos) {
    r.text = held_.substr(0, first);
    r.stopped = true;
    stopped_ = true;
    held_.clear();
    return r;
  }
  const size_t keep = held_prefix_length();
  r.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return r;
}

std::string stop_matcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

// ---------------------------------------------------------------------------------------------
// structured output

uint64_t mix_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

grammar_cursor::grammar_cursor(std::shared_ptr<const json_grammar> g, const vocab_index& v)
    : g_(std::move(g)), v_(&v), m_(std::make_unique<json_matcher>(*g_, v)) {}
grammar_cursor::~grammar_cursor() = default;
grammar_cursor::grammar_cursor(grammar_cursor&&) noexcept = default;
grammar_cursor& grammar_cursor::operator=(grammar_cursor&&) noexcept = default;

bool grammar_cursor::sync(std::span<const int32_t> generated) {
  if (fed_.size() > generated.size() || !std::equal(fed_.begin(), fed_.end(), generated.begin())) {
    m_ = std::make_unique<json_matcher>(*g_, *v_);
    fed_.clear();
    ok_ = true;
  }
  for (size_t i = fed_.size(); i < generated.size(); ++i) {
    fed_.push_back(generated[i]);
    if (ok_ && !m_->advance_token(generated[i])) ok_ = false;
  }
  return ok_;
}

sample_result sample_constrained(std::span<float> logits, std::span<const int32_t> history, grammar_cursor& cursor,
                                 std::span<const int32_t> generated, const sampling_params& p) {
  const vocab_index& vocab = cursor.vocab();
  const auto end_token = [&] {
    sample_result r{};
    if (!vocab.eog_ids().empty()) r.token = vocab.eog_ids().front();
    return r;
  };
  if (!cursor.sync(generated)) return end_token();
  const json_matcher& m = cursor.matcher();
  // The raw row for a second draw (the first one's penalties modify `logits`).
  std::vector<float> raw(logits.begin(), logits.end());
  sample_result first = sampler(p).sample(logits, history);
  if (m.accepts_token(first.token)) return first;
  std::vector<uint64_t> allowed;
  if (m.allowed_tokens(allowed) == 0) return end_token();
  sampling_params again = p;
  again.seed = p.seed ^ 0x6a09e667f3bcc909ULL;  // a second, still reproducible, draw
  sample_result r = sampler(again).sample(raw, history, allowed);
  if (r.token < 0 || !((allowed[(size_t)r.token >> 6] >> (r.token & 63)) & 1)) {
    // No allowed token had a finite logit: the first allowed one.
    for (size_t w = 0; w < allowed.size(); ++w)
      if (allowed[w]) {
        r.token = (int32_t)(w * 64 + (size_t)std::countr_zero(allowed[w]));
        break;
      }
  }
  return r;
}

}  // namespace troupe::engine
