// Device sampling against engine::sampler and an independent reference of its survivor set:
// greedy and penalties give the CPU's token; stochastic draws stay inside the top-k / top-p /
// min-p survivors, follow the expected softmax (chi-square), and repeat for the same (seed, draw).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "engine/sampling.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/test_util.hpp"

using namespace troupe::kernels::cuda;
using namespace troupe::kernels::cuda::test;

namespace {

constexpr int vocab = 49153;  // not a multiple of any block or chunk size

struct sample_run {
  std::vector<int32_t> tokens;
  std::vector<float> logits_after;
};

/// One sample_tokens launch; histories empty means no history arrays at all.
sample_run run(const std::vector<float>& logits, int n, const std::vector<sample_row_params>& params,
               const std::vector<std::vector<int32_t>>& histories = {}) {
  const int rows = int(params.size());
  dev_buf<float> d_logits(logits);
  dev_buf<sample_row_params> d_params(params);
  std::vector<int32_t> flat, start = {0};
  for (const auto& h : histories) {
    flat.insert(flat.end(), h.begin(), h.end());
    start.push_back(int32_t(flat.size()));
  }
  dev_buf<int32_t> d_hist(flat), d_start(start), d_out{size_t(rows)};
  dev_buf<uint8_t> d_scratch{sample_scratch_bytes(rows, n)};
  d_scratch.poison();
  d_out.poison();
  const bool with_history = !histories.empty();
  sample_tokens(d_logits.p, rows, n, d_params.p, with_history ? d_hist.p : nullptr,
                with_history ? d_start.p : nullptr, d_scratch.p, d_out.p, nullptr);
  return {d_out.download(), d_logits.download()};
}

std::vector<float> normal_logits(size_t n, std::mt19937_64& g, float sigma) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

/// The CPU sampler's token for one row (it applies the penalties to its own copy).
int32_t cpu_token(std::vector<float> row, const sample_row_params& p, const std::vector<int32_t>& history) {
  troupe::engine::sampling_params sp;
  sp.temperature = std::max(p.temperature, 0.0f);
  sp.top_k = p.top_k;
  sp.top_p = p.top_p;
  sp.min_p = p.min_p;
  sp.repetition_penalty = p.repetition_penalty;
  sp.presence_penalty = p.presence_penalty;
  sp.frequency_penalty = p.frequency_penalty;
  sp.penalty_last_n = -1;
  sp.has_seed = true;
  troupe::engine::sampler s(sp);
  return s.sample(row, history).token;
}

/// Reference survivor set of top-k -> top-p (temperature 1, over the top-k set) -> min-p, with
/// engine::sampler's ranking: logit descending, ties to the lower id. Sums in double. NaN logits
/// are left out (they rank last and weigh nothing); at least one logit must be a number.
std::vector<int32_t> survivors(const float* l, int n, int top_k, float top_p, float min_p) {
  std::vector<int32_t> order;
  for (int32_t i = 0; i < n; ++i)
    if (!std::isnan(l[i])) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  if (top_k > 0 && top_k < n && size_t(top_k) < order.size()) order.resize(size_t(top_k));
  const float l_max = l[order[0]];
  if (top_p < 1.0f) {
    double total = 0.0;
    for (int32_t i : order) total += std::exp(double(l[i]) - l_max);
    double cum = 0.0;
    for (size_t j = 0; j < order.size(); ++j) {
      cum += std::exp(double(l[order[j]]) - l_max);
      if (cum >= double(top_p) * total) {
        order.resize(j + 1);
        break;
      }
    }
  }
  if (min_p > 0.0f) {
    const float min_logit = l_max + std::log(min_p);
    order.erase(std::remove_if(order.begin(), order.end(), [&](int32_t i) { return l[i] < min_logit; }), order.end());
  }
  return order;
}

sample_row_params stochastic(float temperature, int top_k, float top_p, float min_p, uint64_t seed, uint64_t draw) {
  sample_row_params p;
  p.temperature = temperature, p.top_k = top_k, p.top_p = top_p, p.min_p = min_p, p.seed = seed, p.draw = draw;
  return p;
}

struct draw_config {
  float temperature;
  int top_k;
  float top_p, min_p;
};

/// The tokens drawn from `rows` copies of the row `one` (n logits), each row with config c, the
/// seed and its own draw index.
std::vector<int32_t> draw_rows(const std::vector<float>& one, int n, int rows, const draw_config& c, uint64_t seed) {
  std::vector<float> logits;
  std::vector<sample_row_params> params;
  for (int r = 0; r < rows; ++r) {
    logits.insert(logits.end(), one.begin(), one.end());
    params.push_back(stochastic(c.temperature, c.top_k, c.top_p, c.min_p, seed, uint64_t(r)));
  }
  return run(logits, n, params).tokens;
}

/// Pearson chi-square of counts against probabilities, bins with an expectation below 5 merged.
double chi_square(const std::map<int32_t, int>& counts, const std::map<int32_t, double>& probs, int n, int& df) {
  double chi = 0.0, small_e = 0.0;
  int small_o = 0, bins = 0;
  for (const auto& [tok, p] : probs) {
    const double e = p * n;
    const auto it = counts.find(tok);
    const int o = it == counts.end() ? 0 : it->second;
    if (e < 5.0) {
      small_e += e, small_o += o;
      continue;
    }
    chi += (o - e) * (o - e) / e;
    ++bins;
  }
  if (small_e > 0.0) chi += (small_o - small_e) * (small_o - small_e) / small_e, ++bins;
  df = bins - 1;
  return chi;
}

}  // namespace

TEST_CASE("sample_tokens greedy picks the CPU argmax, lowest id on ties", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const int rows = 5;
  auto logits = normal_logits(size_t(rows) * vocab, g, 4.0f);
  std::vector<sample_row_params> params(rows, stochastic(0.0f, 0, 1.0f, 0.0f, 1, 0));
  params[1] = stochastic(1.0f, 1, 1.0f, 0.0f, 1, 7);  // top_k 1 is greedy at any temperature
  params[4].temperature = -1.0f;
  float* tie = &logits[2 * size_t(vocab)];
  // Ties in different threads (100, 40000) and in one thread's batch of loads (100 + 3 * 1024).
  tie[40000] = tie[100 + 3 * 1024] = tie[100] = *std::max_element(tie, tie + vocab) + 1.0f;
  std::fill_n(&logits[3 * size_t(vocab)], vocab, std::numeric_limits<float>::quiet_NaN());
  float* last = &logits[4 * size_t(vocab)];  // the maximum past the batched rounds, in the tail
  last[vocab - 1] = *std::max_element(last, last + vocab) + 1.0f;
  const auto got = run(logits, vocab, params).tokens;
  for (int r = 0; r < rows; ++r) {
    INFO("row " << r);
    const std::vector<float> row(&logits[size_t(r) * vocab], &logits[size_t(r + 1) * vocab]);
    CHECK(got[size_t(r)] == cpu_token(row, params[size_t(r)], {}));
  }
  CHECK(got[2] == 100);
  CHECK(got[3] == 0);
  CHECK(got[4] == vocab - 1);
}

TEST_CASE("sample_tokens applies repetition, presence and frequency penalties as the CPU sampler", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const int rows = 4;
  const auto logits = normal_logits(size_t(rows) * vocab, g, 2.0f);
  std::vector<sample_row_params> params(rows, stochastic(0.0f, 0, 1.0f, 0.0f, 1, 0));
  params[0].repetition_penalty = 1.3f;
  params[1].presence_penalty = 0.7f, params[1].frequency_penalty = 0.5f;
  params[2].repetition_penalty = 0.8f, params[2].presence_penalty = -0.3f, params[2].frequency_penalty = 1.1f;
  params[3].repetition_penalty = 2.0f, params[3].frequency_penalty = 2.0f;
  // Histories repeat the best tokens (so the penalties move the argmax) and hold ids out of range.
  std::vector<std::vector<int32_t>> histories(rows);
  for (int r = 0; r < rows; ++r) {
    const float* l = &logits[size_t(r) * vocab];
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 30, order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    for (int j = 0; j < 60; ++j) histories[size_t(r)].push_back(order[g() % 30]);
    histories[size_t(r)].push_back(g() % vocab);  // a token with a negative logit, probably
    histories[size_t(r)].push_back(-1);
    histories[size_t(r)].push_back(vocab);
  }
  const auto got = run(logits, vocab, params, histories);
  for (int r = 0; r < rows; ++r) {
    INFO("row " << r);
    const auto& p = params[size_t(r)];
    std::vector<float> want(&logits[size_t(r) * vocab], &logits[size_t(r + 1) * vocab]);
    std::map<int32_t, int> count;
    for (int32_t t : histories[size_t(r)])
      if (t >= 0 && t < vocab) ++count[t];
    for (const auto& [t, c] : count) {
      float& x = want[size_t(t)];
      x = x <= 0.0f ? x * p.repetition_penalty : x / p.repetition_penalty;
      x -= float(c) * p.frequency_penalty + p.presence_penalty;
    }
    const std::vector<float> got_row(&got.logits_after[size_t(r) * vocab], &got.logits_after[size_t(r + 1) * vocab]);
    CHECK(normalized_error(got_row, want) <= 1e-6);
    const std::vector<float> raw(&logits[size_t(r) * vocab], &logits[size_t(r + 1) * vocab]);
    CHECK(got.tokens[size_t(r)] == cpu_token(raw, p, histories[size_t(r)]));
  }
}

TEST_CASE("sample_tokens draws only from the top-k / top-p / min-p survivors, reproducibly", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const draw_config configs[] = {{1.0f, 0, 1.0f, 0.0f},   {1.0f, 0, 0.9f, 0.0f},    {0.7f, 40, 1.0f, 0.0f},
                            {1.3f, 1000, 0.8f, 0.0f}, {1.0f, 0, 1.0f, 0.05f},   {0.8f, 50, 0.95f, 0.1f},
                            {2.0f, 0, 0.5f, 0.0f},    {1.0f, 20000, 0.999f, 0.0f}};
  const int rows = 24;
  for (const auto& c : configs) {
    INFO("T " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p);
    const auto one = normal_logits(size_t(vocab), g, 3.0f);
    std::vector<float> logits;
    std::vector<sample_row_params> params;
    for (int r = 0; r < rows; ++r) {
      logits.insert(logits.end(), one.begin(), one.end());
      params.push_back(stochastic(c.temperature, c.top_k, c.top_p, c.min_p, seed, uint64_t(r)));
    }
    const auto kept = survivors(one.data(), vocab, c.top_k, c.top_p, c.min_p);
    std::vector<char> in_set(size_t(vocab), 0);
    for (int32_t t : kept) in_set[size_t(t)] = 1;
    const auto first = run(logits, vocab, params).tokens;
    const auto second = run(logits, vocab, params).tokens;
    for (int r = 0; r < rows; ++r) {
      INFO("row " << r << " token " << first[size_t(r)] << " survivors " << kept.size());
      REQUIRE(first[size_t(r)] >= 0);
      REQUIRE(first[size_t(r)] < vocab);
      CHECK(in_set[size_t(first[size_t(r)])]);
      CHECK(first[size_t(r)] == second[size_t(r)]);
    }
  }
}

TEST_CASE("sample_tokens cuts ties at the top-k and top-p boundaries by lowest id", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const std::vector<float> flat(size_t(vocab), 0.0f);
  struct config {
    int top_k;
    float top_p;
    int32_t bound;  // survivors are exactly ids [0, bound)
  };
  // The last: a top-p whose boundary falls at the fifth token (flat logits: p * vocab = 4.5).
  for (const config c : {config{5, 1.0f, 5}, config{0, 0.5f, 24577}, config{100, 0.5f, 50},
                         config{0, 4.5f / float(vocab), 5}}) {
    INFO("top_k " << c.top_k << " top_p " << c.top_p);
    REQUIRE(survivors(flat.data(), vocab, c.top_k, c.top_p, 0.0f).size() == size_t(c.bound));
    const int rows = 64;
    std::vector<float> logits;
    std::vector<sample_row_params> params;
    for (int r = 0; r < rows; ++r) {
      logits.insert(logits.end(), flat.begin(), flat.end());
      params.push_back(stochastic(1.0f, c.top_k, c.top_p, 0.0f, seed, uint64_t(r)));
    }
    const auto got = run(logits, vocab, params).tokens;
    int32_t highest = 0;
    std::vector<int> drawn(size_t(c.bound), 0);
    for (int32_t t : got) {
      CHECK(t >= 0);
      CHECK(t < c.bound);
      highest = std::max(highest, t);
      if (t >= 0 && t < c.bound) ++drawn[size_t(t)];
    }
    CHECK(highest > c.bound / 4);  // the draws spread over the tied survivors
    // Few survivors: 64 uniform draws reach each of them (a miss has odds below 1e-5), so a cut
    // that keeps one tie too few fails here.
    if (c.bound <= 8)
      for (int32_t id = 0; id < c.bound; ++id) CHECK(drawn[size_t(id)] > 0);
  }
}

TEST_CASE("sample_tokens follows the softmax of the survivors at the temperature", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const int n = 4099, rows = 4000;
  // A dozen plausible tokens at random ids over a tail of unlikely ones.
  std::vector<float> one = random_floats(size_t(n), g, -12.0f, -6.0f);
  std::uniform_real_distribution<float> head(0.0f, 3.0f);
  for (int j = 0; j < 12; ++j) one[g() % n] = head(g);
  for (const draw_config c : {draw_config{0.8f, 8, 1.0f, 0.0f}, draw_config{1.2f, 0, 0.7f, 0.0f},
                              draw_config{1.0f, 0, 1.0f, 0.2f}, draw_config{1.5f, 10, 0.9f, 0.05f}}) {
    INFO("T " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p);
    const auto got = draw_rows(one, n, rows, c, seed);
    const auto kept = survivors(one.data(), n, c.top_k, c.top_p, c.min_p);
    std::map<int32_t, double> probs;
    double z = 0.0;
    for (int32_t t : kept) z += probs[t] = std::exp((double(one[size_t(t)]) - one[size_t(kept[0])]) / c.temperature);
    for (auto& [t, p] : probs) p /= z;
    std::map<int32_t, int> counts;
    for (int32_t t : got) {
      CHECK(probs.count(t) == 1);
      ++counts[t];
    }
    int df = 0;
    const double chi = chi_square(counts, probs, rows, df);
    INFO("chi2 " << chi << " df " << df);
    CHECK(chi <= df + 5.0 * std::sqrt(2.0 * std::max(df, 1)) + 10.0);
  }
}

TEST_CASE("sample_tokens skips NaN and -inf logits, at the real vocabulary sizes", "[cuda]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 g(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const draw_config configs[] = {{0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 0.9f, 0.0f},
                            {0.8f, 50, 0.95f, 0.0f}, {1.0f, 0, 1.0f, 0.1f}};
  for (const int n : {128256, 152064}) {
    // Token 0 and a few hundred others NaN, as many -inf: neither may ever be drawn.
    auto one = normal_logits(size_t(n), g, 3.0f);
    one[0] = nan;
    for (int j = 0; j < 300; ++j) one[g() % size_t(n)] = nan, one[g() % size_t(n)] = -inf;
    for (const auto& c : configs) {
      INFO("n " << n << " T " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p);
      const int rows = 8;
      const auto got = draw_rows(one, n, rows, c, seed);
      const auto kept = survivors(one.data(), n, c.top_k, c.top_p, c.min_p);
      std::vector<char> in_set(size_t(n), 0);
      for (int32_t t : kept) in_set[size_t(t)] = 1;
      for (int r = 0; r < rows; ++r) {
        const int32_t t = got[size_t(r)];
        INFO("row " << r << " token " << t);
        REQUIRE(t >= 0);
        REQUIRE(t < n);
        CHECK(std::isfinite(one[size_t(t)]));
        CHECK(in_set[size_t(t)]);
        if (c.temperature == 0.0f) CHECK(t == cpu_token(one, stochastic(c.temperature, c.top_k, c.top_p, c.min_p, seed, uint64_t(r)), {}));
      }
    }
  }
  // No finite logit: token 0, as the CPU sampler (greedy and stochastic alike).
  std::vector<float> hopeless(size_t(vocab), -inf);
  hopeless[7] = nan;
  const std::vector<sample_row_params> params = {stochastic(0.0f, 0, 1.0f, 0.0f, seed, 0),
                                                 stochastic(1.0f, 0, 0.9f, 0.0f, seed, 1)};
  std::vector<float> logits(hopeless);
  logits.insert(logits.end(), hopeless.begin(), hopeless.end());
  const auto got = run(logits, vocab, params).tokens;
  for (size_t r = 0; r < params.size(); ++r) {
    INFO("row " << r);
    CHECK(got[r] == 0);
    CHECK(got[r] == cpu_token(hopeless, params[r], {}));
  }
}
