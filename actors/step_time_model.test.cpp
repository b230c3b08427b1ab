// The step-time model against a known cost (a fixed part plus a part per token, as a step that
// reads all weights once and then computes per token), and its behaviour on noise and outliers.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "actors/step_time_model.hpp"

using troupe::actors::step_time_model;

namespace {

double cost(int32_t n) { return 0.010 + 0.0015 * n; }  // 10 ms per step + 1.5 ms per token

// The most tokens whose true cost is within `seconds`.
int32_t true_tokens_within(double seconds) { return (int32_t)std::floor((seconds - 0.010) / 0.0015 + 1e-9); }

}  // namespace

TEST_CASE("step-time model: nothing observed, nothing bounded", "[scheduler][itl]") {
  step_time_model m;
  CHECK_FALSE(m.predict(8).has_value());
  CHECK(m.tokens_within(0.001, 256) == 256);
  CHECK(m.tokens_within(0.001, 0) == 0);
  // Inputs that are not steps are ignored.
  m.observe(0, 0.1);
  m.observe(-3, 0.1);
  m.observe(8, -1);
  m.observe(8, std::numeric_limits<double>::quiet_NaN());
  m.observe(8, std::numeric_limits<double>::infinity());
  CHECK(m.n_observed() == 0);
  CHECK_THROWS_AS(step_time_model(0.0), std::invalid_argument);
  CHECK_THROWS_AS(step_time_model(0.5, 0), std::invalid_argument);
}

TEST_CASE("step-time model: interpolates between observed step sizes", "[scheduler][itl]") {
  step_time_model m;
  for (int rep = 0; rep < 3; ++rep)
    for (int32_t n : {4, 16, 64, 256}) m.observe(n, cost(n));
  for (int32_t n : {4, 16, 64, 256}) CHECK(*m.predict(n) == Approx(cost(n)));
  for (int32_t n : {5, 20, 40, 100, 200}) CHECK(*m.predict(n) == Approx(cost(n)));  // a line between points
  CHECK(*m.predict(1) == Approx(cost(4)));  // below the first point: its time (an upper bound)
  for (double target : {0.020, 0.050, 0.105, 0.300})
    CHECK(m.tokens_within(target, 1024) == true_tokens_within(target));
  CHECK(m.tokens_within(0.005, 1024) == 0);   // faster than any step can be
  CHECK(m.tokens_within(10.0, 300) == 300);   // capped by the caller's maximum
}

TEST_CASE("step-time model: above the largest step seen it errs short, then learns", "[scheduler][itl]") {
  step_time_model m;
  m.observe(4, cost(4));  // only small (decode) steps seen so far
  const int32_t first = m.tokens_within(0.050, 1024);
  CHECK(first == (int32_t)(0.050 / cost(4) * 4));  // in proportion: 12
  CHECK(first < true_tokens_within(0.050));       // 26: short, never over
  // Each step run at the budget teaches the next: the budget grows to the truth and never
  // overshoots the target on the way.
  int32_t n = first;
  for (int i = 0; i < 30; ++i) {
    CHECK(cost(n) <= 0.050 + 1e-12);
    m.observe(n, cost(n));
    n = m.tokens_within(0.050, 1024);
  }
  CHECK(n >= true_tokens_within(0.050) - 1);  // 25 or 26
  CHECK(n <= true_tokens_within(0.050));
}

TEST_CASE("step-time model: follows a change of speed, forgets a stale outlier", "[scheduler][itl]") {
  step_time_model m(0.25, 64);
  for (int i = 0; i < 10; ++i)
    for (int32_t n : {4, 32}) m.observe(n, cost(n));
  const int32_t before = m.tokens_within(0.050, 1024);
  CHECK(before == true_tokens_within(0.050));
  // The machine gets twice as slow (another tenant): the budget halves within a few steps.
  for (int i = 0; i < 20; ++i)
    for (int32_t n : {4, 32}) m.observe(n, 2 * cost(n));
  CHECK(*m.predict(32) == Approx(2 * cost(32)).epsilon(0.01));
  CHECK(m.tokens_within(0.100, 1024) == Approx(before).margin(1));

  // One very slow large step (a first run loading kernels) caps every prediction above it...
  step_time_model o(0.25, 64);
  o.observe(200, 5.0);
  for (int32_t n : {4, 32}) o.observe(n, cost(n));
  CHECK(*o.predict(100) > 1.0);
  // ...and the made-monotone points keep any larger step at least that slow, until the bucket
  // has not been seen for stale_after observations; then the small steps alone predict.
  for (int i = 0; i < 40; ++i)
    for (int32_t n : {4, 32}) o.observe(n, cost(n));
  CHECK(*o.predict(100) == Approx(cost(32) * 100 / 32));
}

TEST_CASE("step-time model: predictions never decrease with more tokens", "[scheduler][itl]") {
  step_time_model m;
  m.observe(4, 0.030);   // a noisy small bucket slower than the next
  m.observe(16, 0.020);
  m.observe(64, 0.080);
  double last = 0;
  for (int32_t n = 1; n <= 300; ++n) {
    const double t = *m.predict(n);
    CHECK(t >= last);
    last = t;
  }
  CHECK(*m.predict(16) == Approx(0.030));
}
