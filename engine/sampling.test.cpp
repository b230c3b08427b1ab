#include "engine/sampling.hpp"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

using namespace troupe::engine;

namespace {

std::vector<float> random_logits(size_t n, uint64_t seed, float scale = 4.0f) {
  std::mt19937 g{uint32_t(seed)};
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

sampling_params seeded(float temperature, uint64_t seed = 1234) {
  sampling_params p;
  p.temperature = temperature;
  p.seed = seed;
  p.has_seed = true;
  p.penalty_last_n = 0;
  return p;
}

/// Draws `n` tokens from one sampler over a fresh copy of `logits` each time.
std::vector<int32_t> draw(const sampling_params& p, const std::vector<float>& logits, int n) {
  sampler s(p);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    auto l = logits;
    out.push_back(s.sample(l, {}).token);
  }
  return out;
}

/// Double-precision softmax, written independently of the sampler.
std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  double m = -INFINITY;
  for (float l : logits) m = std::max(m, double(l));
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp((double(logits[i]) - m) / temperature);
  for (auto& x : p) x /= z;
  return p;
}

/// Pearson chi-square statistic of observed counts against expected probabilities.
double chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int n) {
  double chi = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * n;
    if (e == 0) {
      REQUIRE(counts[i] == 0);
      continue;
    }
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

std::vector<int> histogram(const std::vector<int32_t>& tokens, size_t n) {
  std::vector<int> c(n, 0);
  for (auto t : tokens) c.at(size_t(t))++;
  return c;
}

}  // namespace

TEST_CASE("sampling_params::validate accepts defaults and rejects each bad value", "[sampling]") {
  CHECK(sampling_params{}.validate().empty());
  sampling_params ok;
  ok.temperature = 0;
  ok.top_p = 1;
  ok.min_p = 1;
  ok.repetition_penalty = 10;
  ok.presence_penalty = -2;
  ok.frequency_penalty = 2;
  ok.top_logprobs = 20;
  ok.penalty_last_n = -1;
  ok.stop = std::vector<std::string>(16, std::string(256, 'x'));
  CHECK(ok.validate().empty());

  const float nan = std::nanf("");
  const float inf = INFINITY;
  struct bad_case {
    const char* field;
    void (*apply)(sampling_params&, float);
    std::vector<float> values;
  };
  const std::vector<bad_case> cases = {
      {"temperature", [](sampling_params& p, float v) { p.temperature = v; }, {-0.01f, 100.5f, nan, inf}},
      {"top_k", [](sampling_params& p, float v) { p.top_k = int32_t(v); }, {-1}},
      {"top_p", [](sampling_params& p, float v) { p.top_p = v; }, {0.0f, -0.1f, 1.01f, nan, inf}},
      {"min_p", [](sampling_params& p, float v) { p.min_p = v; }, {-0.01f, 1.01f, nan}},
      {"repetition_penalty", [](sampling_params& p, float v) { p.repetition_penalty = v; },
       {0.0f, -1.0f, 10.5f, nan, inf}},
      {"presence_penalty", [](sampling_params& p, float v) { p.presence_penalty = v; }, {-2.01f, 2.01f, nan}},
      {"frequency_penalty", [](sampling_params& p, float v) { p.frequency_penalty = v; }, {-2.5f, 2.5f, -inf}},
      {"top_logprobs", [](sampling_params& p, float v) { p.top_logprobs = int32_t(v); }, {-1, 21}},
      {"penalty_last_n", [](sampling_params& p, float v) { p.penalty_last_n = int32_t(v); }, {-2}},
  };
  for (const auto& c : cases) {
    for (float v : c.values) {
      sampling_params p;
      c.apply(p, v);
      const auto msg = p.validate();
      INFO(c.field << " = " << v << ": " << msg);
      CHECK(msg.find(c.field) != std::string::npos);
    }
  }
  sampling_params p;
  p.stop = {"ok", ""};
  CHECK(p.validate().find("stop") != std::string::npos);
  p.stop = std::vector<std::string>(17, "x");
  CHECK(p.validate().find("stop") != std::string::npos);
  p.stop = {std::string(257, 'x')};
  CHECK(p.validate().find("stop") != std::string::npos);
}

TEST_CASE("greedy picks the argmax, ties to the lowest id", "[sampling]") {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto logits = random_logits(5000, seed);
    size_t expect = 0;
    for (size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[expect]) expect = i;
    sampler s(seeded(0.0f, seed));
    CHECK(s.sample(logits, {}).token == int32_t(expect));
  }
  std::vector<float> tie = {1.0f, 3.0f, -2.0f, 3.0f, 3.0f};
  sampler s(seeded(0.0f));
  CHECK(s.sample(tie, {}).token == 1);
}

TEST_CASE("top_k = 1 is greedy at any temperature", "[sampling]") {
  for (float t : {0.1f, 1.0f, 5.0f, 100.0f}) {
    for (uint64_t seed = 0; seed < 10; ++seed) {
      auto logits = random_logits(3000, seed + 100);
      auto greedy = logits;
      const auto expect = sampler(seeded(0.0f)).sample(greedy, {}).token;
      auto p = seeded(t, seed);
      p.top_k = 1;
      for (auto tok : draw(p, logits, 5)) CHECK(tok == expect);
    }
  }
  std::vector<float> tie = {0.5f, 2.0f, 2.0f};
  auto p = seeded(2.0f);
  p.top_k = 1;
  for (auto tok : draw(p, tie, 20)) CHECK(tok == 1);
}

TEST_CASE("top-k restricts draws to exactly the k largest", "[sampling]") {
  for (int k : {3, 40, 300}) {
    auto logits = random_logits(2000, uint64_t(k), 1.0f);
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    const std::set<int32_t> allowed(order.begin(), order.begin() + k);
    std::set<int32_t> seen;
    for (uint64_t seed = 0; seed < 200; ++seed) {
      auto p = seeded(3.0f, seed);
      p.top_k = k;
      for (auto tok : draw(p, logits, 10)) {
        CHECK(allowed.count(tok) == 1);
        seen.insert(tok);
      }
    }
    if (k == 3) CHECK(seen == allowed);
    if (k == 40) CHECK(seen.size() >= 35);
  }
}

TEST_CASE("top-p keeps the minimal set with mass >= p", "[sampling]") {
  // Hand-made distribution at permuted ids: 0.4, 0.25, 0.15, 0.1, 0.06, 0.04.
  const std::vector<double> probs = {0.4, 0.25, 0.15, 0.1, 0.06, 0.04};
  const std::vector<int32_t> ids = {4, 0, 5, 2, 1, 3};
  std::vector<float> logits(6);
  for (size_t i = 0; i < 6; ++i) logits[size_t(ids[i])] = float(std::log(probs[i]));
  const std::vector<std::pair<float, size_t>> cases = {{0.3f, 1}, {0.6f, 2}, {0.7f, 3}, {0.85f, 4}, {0.97f, 6}};
  for (const auto& [top_p, n_keep] : cases) {
    const std::set<int32_t> allowed(ids.begin(), ids.begin() + ptrdiff_t(n_keep));
    auto p = seeded(1.0f, 7);
    p.top_p = top_p;
    std::set<int32_t> seen;
    for (auto tok : draw(p, logits, 3000)) {
      CHECK(allowed.count(tok) == 1);
      seen.insert(tok);
    }
    INFO("top_p " << top_p);
    CHECK(seen == allowed);
    // Combined with top-k the mass is renormalised over the k survivors: with k = 3 the masses
    // are 0.5, 0.3125, 0.1875, so p = 0.7 keeps two tokens.
  }
  auto p = seeded(1.0f, 9);
  p.top_k = 3;
  p.top_p = 0.7f;
  const std::set<int32_t> two(ids.begin(), ids.begin() + 2);
  std::set<int32_t> seen;
  for (auto tok : draw(p, logits, 2000)) seen.insert(tok);
  CHECK(seen == two);
}

TEST_CASE("top-p without top-k on a large vocabulary keeps the sorted prefix", "[sampling]") {
  // Flat-ish logits so the kept set is far beyond the first sorted prefix.
  auto logits = random_logits(20000, 5, 0.5f);
  const auto probs = softmax(logits);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  double cum = 0;
  size_t keep = 0;
  while (cum < 0.5) cum += probs[size_t(order[keep++])];
  REQUIRE(keep > 2000);
  const std::set<int32_t> allowed(order.begin(), order.begin() + ptrdiff_t(keep));
  auto p = seeded(1.0f, 11);
  p.top_p = 0.5f;
  std::set<int32_t> seen;
  for (auto tok : draw(p, logits, 5000)) {
    CHECK(allowed.count(tok) == 1);
    seen.insert(tok);
  }
  CHECK(seen.size() > keep * 4 / 10);  // ~5000 draws spread over ~6000 tokens
}

TEST_CASE("min-p keeps tokens with p >= min_p * p_max", "[sampling]") {
  // p relative to the max: 1, 0.5, 0.3, 0.2, 0.05.
  const std::vector<double> rel = {1.0, 0.5, 0.3, 0.2, 0.05};
  std::vector<float> logits;
  for (double r : rel) logits.push_back(float(std::log(r) + 2.0));
  for (bool with_top_k : {false, true}) {
    for (float min_p : {0.25f, 0.4f, 0.6f, 1.0f}) {
      std::set<int32_t> allowed;
      for (size_t i = 0; i < rel.size(); ++i)
        if (rel[i] >= min_p) allowed.insert(int32_t(i));
      auto p = seeded(1.5f, 3);
      p.min_p = min_p;
      if (with_top_k) p.top_k = 4;  // drops 0.05, which min_p >= 0.25 drops anyway
      std::set<int32_t> seen;
      for (auto tok : draw(p, logits, 3000)) seen.insert(tok);
      INFO("min_p " << min_p << " top_k " << with_top_k);
      CHECK(seen == allowed);
    }
  }
}

TEST_CASE("penalties follow the llama.cpp arithmetic", "[sampling]") {
  std::vector<float> logits = {2.0f, -1.5f, 0.5f, 3.0f, -0.25f, 1.3f};
  // Token 0 three times, 1 twice, 3 once, 4 once but outside the window, 99 out of range.
  const std::vector<int32_t> history = {4, 0, 1, 0, 3, 99, 1, 0};
  auto p = seeded(0.0f);
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = 0.7f;
  p.penalty_last_n = 7;
  // Expected values computed by hand from the definitions: divide positive / multiply
  // negative by the repetition penalty, then subtract count * freq + presence.
  const std::vector<double> expect = {
      2.0 / 1.3 - 3 * 0.4 - 0.7,    // 3 occurrences
      -1.5 * 1.3 - 2 * 0.4 - 0.7,   // 2 occurrences
      0.5,                          // absent
      3.0 / 1.3 - 1 * 0.4 - 0.7,    // 1 occurrence: 1.2077
      -0.25,                        // only before the window
      1.3,                          // absent
  };
  auto work = logits;
  sampler s(p);
  const auto r = s.sample(work, history);
  for (size_t i = 0; i < expect.size(); ++i) CHECK(work[i] == Approx(expect[i]).epsilon(1e-6));
  // Unpenalised the argmax is token 3 (3.0); penalised it falls to 1.2077 below token 5 (1.3).
  CHECK(r.token == 5);

  // -1 looks at the whole history, 0 disables the penalties.
  p.penalty_last_n = -1;
  work = logits;
  sampler(p).sample(work, history);
  CHECK(work[4] == Approx(-0.25 * 1.3 - 0.4 - 0.7));
  p.penalty_last_n = 0;
  work = logits;
  sampler(p).sample(work, history);
  CHECK(work == logits);

  // A strong repetition penalty moves the greedy choice away from a repeated token.
  p = seeded(0.0f);
  p.repetition_penalty = 2.0f;
  p.penalty_last_n = 64;
  std::vector<float> two = {3.0f, 2.0f};
  CHECK(sampler(p).sample(two, std::vector<int32_t>{0}).token == 1);
}

TEST_CASE("penalty_window: the last penalty_last_n tokens, none when no penalty is active", "[sampling]") {
  const std::vector<int32_t> h = {5, 6, 7, 8};
  sampling_params p;
  CHECK(penalty_window(p, h).empty());  // every penalty off
  p.presence_penalty = 0.5f;
  p.penalty_last_n = 3;
  CHECK(std::vector<int32_t>(penalty_window(p, h).begin(), penalty_window(p, h).end()) == std::vector<int32_t>{6, 7, 8});
  p.penalty_last_n = 64;
  CHECK(penalty_window(p, h).size() == 4);
  p.penalty_last_n = -1;
  CHECK(penalty_window(p, h).size() == 4);
  p.penalty_last_n = 0;
  CHECK(penalty_window(p, h).empty());
}

TEST_CASE("seeded sampling is reproducible and seed-dependent", "[sampling]") {
  auto logits = random_logits(49152, 1, 2.0f);
  for (int top_k : {0, 40}) {
    auto p = seeded(1.0f, 42);
    p.top_k = top_k;
    const auto a = draw(p, logits, 100);
    const auto b = draw(p, logits, 100);
    CHECK(a == b);
    p.seed = 43;
    const auto c = draw(p, logits, 100);
    CHECK(a != c);
  }
}

TEST_CASE("empirical frequencies match the softmax (chi-square)", "[sampling]") {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.0f, 1.5f, 0.7f, -2.0f, 0.3f};
  const int n_draws = 20000;
  // Chi-square critical value for 9 degrees of freedom at p = 0.001.
  const double crit_df9 = 27.877;
  for (float t : {1.0f, 0.7f}) {
    const auto probs = softmax(logits, t);
    const auto counts = histogram(draw(seeded(t, 2024), logits, n_draws), logits.size());
    INFO("temperature " << t);
    CHECK(chi_square(counts, probs, n_draws) < crit_df9);
  }
  // The sorted path (top-k) draws from the renormalised top k: drop the two smallest (ids 8, 5).
  auto p = seeded(1.0f, 77);
  p.top_k = 8;
  auto probs = softmax(logits);
  probs[8] = probs[5] = 0;
  const double z = std::accumulate(probs.begin(), probs.end(), 0.0);
  for (auto& x : probs) x /= z;
  const auto counts = histogram(draw(p, logits, n_draws), logits.size());
  CHECK(chi_square(counts, probs, n_draws) < 24.322);  // 7 degrees of freedom, p = 0.001
}

TEST_CASE("truncation happens at temperature 1, the draw at the requested temperature", "[sampling]") {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.0f, 1.5f, 0.7f, -2.0f, 0.3f};
  // Chi-square critical values at p = 0.001 by degrees of freedom.
  const double crit[] = {0, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877};
  struct trunc_case {
    int top_k;
    float top_p, min_p, temperature;
  };
  const trunc_case cases[] = {
      {0, 0.8f, 0.0f, 0.5f},  {0, 0.8f, 0.0f, 2.0f},  {0, 1.0f, 0.2f, 1.5f},
      {0, 0.9f, 0.3f, 0.7f},  {6, 0.85f, 0.0f, 1.3f}, {5, 1.0f, 0.25f, 0.8f},
  };
  const auto p1 = softmax(logits);
  std::vector<size_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  for (const auto& c : cases) {
    // Reference: keep by rank (top-k), by cumulative mass renormalised over the top-k survivors
    // (top-p), by ratio to the best (min-p), all at temperature 1; then softmax at T.
    const size_t k = c.top_k > 0 ? size_t(c.top_k) : logits.size();
    double mass_k = 0;
    for (size_t r = 0; r < k; ++r) mass_k += p1[order[r]];
    std::vector<bool> keep(logits.size(), false);
    double cum = 0;
    for (size_t r = 0; r < k; ++r) {
      const size_t id = order[r];
      if (p1[id] >= c.min_p * p1[order[0]]) keep[id] = true;
      cum += p1[id] / mass_k;
      if (cum >= c.top_p) break;
    }
    std::vector<double> expect(logits.size(), 0.0);
    double z = 0;
    size_t n_kept = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!keep[i]) continue;
      ++n_kept;
      z += expect[i] = std::exp(double(logits[i]) / c.temperature);
    }
    for (auto& e : expect) e /= z;
    REQUIRE(n_kept >= 2);
    auto p = seeded(c.temperature, 31);
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    const int n_draws = 20000;
    const auto counts = histogram(draw(p, logits, n_draws), logits.size());
    INFO("top_k " << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p << " T " << c.temperature);
    CHECK(chi_square(counts, expect, n_draws) < crit[n_kept - 1]);
  }
}

TEST_CASE("logprobs are the log-softmax of the raw logits", "[sampling]") {
  auto logits = random_logits(32000, 8, 3.0f);
  // Reference log-softmax in double.
  double m = -INFINITY;
  for (float l : logits) m = std::max(m, double(l));
  double z = 0;
  for (float l : logits) z += std::exp(double(l) - m);
  const double log_z = m + std::log(z);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });

  auto p = seeded(0.8f, 5);
  p.logprobs = true;
  p.top_logprobs = 5;
  p.top_k = 50;
  p.repetition_penalty = 1.5f;
  p.presence_penalty = 1.0f;
  p.penalty_last_n = -1;
  const std::vector<int32_t> history = {order[0], order[1], order[0]};
  sampler s(p);
  for (int i = 0; i < 20; ++i) {
    auto work = logits;
    const auto r = s.sample(work, history);
    CHECK(r.logprob == Approx(double(logits[size_t(r.token)]) - log_z).margin(1e-5));
    REQUIRE(r.top.size() == 5);
    for (size_t j = 0; j < 5; ++j) {
      CHECK(r.top[j].token == order[j]);
      CHECK(r.top[j].logprob == Approx(double(logits[size_t(order[j])]) - log_z).margin(1e-5));
    }
  }
  // Greedy and without top alternatives too; off when not asked for.
  p = seeded(0.0f);
  p.logprobs = true;
  auto work = logits;
  auto r = sampler(p).sample(work, {});
  CHECK(r.token == order[0]);
  CHECK(r.logprob == Approx(double(logits[size_t(order[0])]) - log_z).margin(1e-5));
  CHECK(r.top.empty());
  // Stable for huge logits (a naive exp would overflow).
  std::vector<float> big = {1000.0f, 999.0f, 990.0f};
  r = sampler(p).sample(big, {});
  const double lz = 1000.0 + std::log(1.0 + std::exp(-1.0) + std::exp(-10.0));
  CHECK(r.logprob == Approx(1000.0 - lz).margin(1e-6));
}

TEST_CASE("sampler rejects empty logits", "[sampling]") {
  sampler s(seeded(1.0f));
  std::vector<float> none;
  CHECK_THROWS_AS(s.sample(none, {}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------

namespace {

/// Feeds `text` in pieces of `piece` bytes; returns everything emitted (flush included unless
/// stopped) and whether it stopped.
std::pair<std::string, bool> stream(std::vector<std::string> stops, std::string_view text, size_t piece) {
  stop_matcher m(std::move(stops));
  std::string out;
  for (size_t i = 0; i < text.size(); i += piece) {
    auto r = m.push(text.substr(i, piece));
    out += r.text;
    if (r.stopped) return {out, true};
  }
  return {out + m.flush(), false};
}

}  // namespace

TEST_CASE("stop_matcher finds stops across 1-byte pushes", "[sampling][stop]") {
  for (size_t piece : {1, 2, 3, 100}) {
    INFO("piece " << piece);
    CHECK(stream({"</end>"}, "hello </e world</end> tail", piece) == std::pair<std::string, bool>{"hello </e world", true});
    CHECK(stream({"STOP"}, "no stop here", piece) == std::pair<std::string, bool>{"no stop here", false});
    CHECK(stream({"STOP"}, "ends in STO", piece) == std::pair<std::string, bool>{"ends in STO", false});
    CHECK(stream({"abc"}, "abcdef", piece) == std::pair<std::string, bool>{"", true});
    CHECK(stream({"ab", "abc"}, "xxabcd", piece) == std::pair<std::string, bool>{"xx", true});
    CHECK(stream({"abc", "b"}, "xabc", piece) == std::pair<std::string, bool>{"xa", true});
    CHECK(stream({"aab"}, "aaab", piece) == std::pair<std::string, bool>{"a", true});
    CHECK(stream({"ab", "b"}, "xab", piece) == std::pair<std::string, bool>{"x", true});
  }
}

namespace {

/// Reference: the first byte position at which some stop string ends; among stops ending
/// there, the longest (earliest-starting). Returns the text before it.
std::pair<std::string, bool> reference_stop(const std::vector<std::string>& stops, const std::string& text) {
  for (size_t end = 1; end <= text.size(); ++end) {
    size_t best_len = 0;
    for (const auto& s : stops)
      if (!s.empty() && s.size() <= end && text.compare(end - s.size(), s.size(), s) == 0)
        best_len = std::max(best_len, s.size());
    if (best_len > 0) return {text.substr(0, end - best_len), true};
  }
  return {text, false};
}

}  // namespace

TEST_CASE("stop_matcher output does not depend on how the text is split", "[sampling][stop]") {
  std::mt19937 g(99);
  const std::string alphabet = "abc";
  auto random_string = [&](size_t lo, size_t hi) {
    std::string s(lo + g() % (hi - lo + 1), 'a');
    for (auto& c : s) c = alphabet[g() % alphabet.size()];
    return s;
  };
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<std::string> stops;
    for (size_t i = 0, n = 1 + g() % 3; i < n; ++i) stops.push_back(random_string(1, 5));
    const std::string text = random_string(0, 30);
    const auto expect = reference_stop(stops, text);
    // Random chunking.
    stop_matcher m(stops);
    std::string out;
    bool stopped = false;
    for (size_t i = 0; i < text.size() && !stopped;) {
      const size_t len = std::min(text.size() - i, size_t(1 + g() % 6));
      auto r = m.push(std::string_view(text).substr(i, len));
      out += r.text;
      stopped = r.stopped;
      i += len;
    }
    if (!stopped) out += m.flush();
    INFO("text " << text << " stops " << stops.size() << " first " << stops[0]);
    REQUIRE(out == expect.first);
    REQUIRE(stopped == expect.second);
  }
}

TEST_CASE("stop_matcher holds back only a possible stop prefix", "[sampling][stop]") {
  stop_matcher m({"abc", "xyz"});
  auto r = m.push("hello a");
  CHECK(r.text == "hello ");
  CHECK_FALSE(r.stopped);
  r = m.push("b");
  CHECK(r.text.empty());
  r = m.push("d x");
  CHECK(r.text == "abd ");
  r = m.push("y");
  CHECK(r.text.empty());
  r = m.push("z and more");
  CHECK(r.text.empty());
  CHECK(r.stopped);
  CHECK(m.stopped());
  r = m.push("later");
  CHECK(r.text.empty());
  CHECK(r.stopped);
  CHECK(m.flush().empty());

  // The earliest complete stop wins even when a later one completes in the same push.
  stop_matcher two({"world", "lo"});
  r = two.push("hello world");
  CHECK(r.text == "hel");
  CHECK(r.stopped);

  // No stops: everything passes straight through; empty stop strings are ignored.
  stop_matcher none({""});
  CHECK(none.push("abc").text == "abc");
  CHECK(none.flush().empty());
}

TEST_CASE("sampler throughput on a 262k vocabulary", "[sampling][!benchmark]") {
  // A flat worst case (top-p 0.95 keeps ~23k tokens) and a peaked head like a language model's
  // (a few tokens far above the rest).
  const bool peaked = GENERATE(false, true);
  auto logits = random_logits(262144, 3, peaked ? 1.5f : 3.0f);
  if (peaked)
    for (int i = 0; i < 8; ++i) logits[size_t(i) * 9973] += 20.0f - float(i);
  std::vector<float> work(logits.size());
  const std::vector<int32_t> history(64, 17);
  auto bench = [&](const char* name, sampling_params p) {
    sampler s(p);
    BENCHMARK(std::string(name) + (peaked ? " (peaked)" : " (flat)")) {
      std::copy(logits.begin(), logits.end(), work.begin());
      return s.sample(work, history).token;
    };
  };
  auto p = seeded(0.0f);
  bench("copy + greedy", p);
  p = seeded(0.8f);
  bench("no truncation", p);
  p.top_k = 40;
  bench("top_k 40", p);
  p.top_p = 0.95f;
  p.min_p = 0.05f;
  bench("top_k 40 + top_p + min_p", p);
  p.top_k = 0;
  bench("top_p 0.95 + min_p", p);
  p.min_p = 0.0f;
  bench("top_p 0.95 alone", p);
  p = seeded(0.8f);
  p.min_p = 0.05f;
  bench("min_p alone", p);
  p = seeded(0.8f);
  p.top_k = 40;
  p.repetition_penalty = 1.1f;
  p.penalty_last_n = 64;
  p.logprobs = true;
  p.top_logprobs = 5;
  bench("top_k 40 + penalties + logprobs", p);
}
