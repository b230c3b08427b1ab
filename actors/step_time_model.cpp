#include "actors/step_time_model.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>

namespace troupe::actors {

step_time_model::step_time_model(double weight, int64_t stale_after) : weight_(weight), stale_after_(stale_after) {
  if (!(weight > 0 && weight <= 1) || stale_after < 1)
    throw std::invalid_argument("step_time_model: weight must be in (0, 1] and stale_after >= 1");
}

bool step_time_model::live(const bucket& b) const { return b.last_seen >= 0 && n_observed_ - b.last_seen <= stale_after_; }

void step_time_model::observe(int32_t n_tokens, double seconds) {
  if (n_tokens < 1 || !std::isfinite(seconds) || seconds < 0) return;
  const int k = std::min(n_buckets - 1, (int)std::bit_width((uint32_t)n_tokens) - 1);
  bucket& b = b_[(size_t)k];
  if (!live(b)) {
    b.n = n_tokens;
    b.t = seconds;
  } else {
    b.n += weight_ * (n_tokens - b.n);
    b.t += weight_ * (seconds - b.t);
  }
  b.last_seen = n_observed_++;
}

std::optional<double> step_time_model::predict(int32_t n_tokens) const {
  // The live buckets' points in token order, times made non-decreasing.
  double pn[n_buckets], pt[n_buckets];
  int m = 0;
  for (const bucket& b : b_) {
    if (!live(b)) continue;
    pn[m] = b.n;
    pt[m] = m > 0 ? std::max(pt[m - 1], b.t) : b.t;
    ++m;
  }
  if (m == 0) return std::nullopt;
  const double n = n_tokens;
  if (n <= pn[0]) return pt[0];
  for (int i = 1; i < m; ++i)
    if (n <= pn[i]) return pt[i - 1] + (pt[i] - pt[i - 1]) * (n - pn[i - 1]) / (pn[i] - pn[i - 1]);
  return pt[m - 1] * n / pn[m - 1];
}

int32_t step_time_model::tokens_within(double seconds, int32_t max_tokens) const {
  if (max_tokens <= 0) return 0;
  if (!predict(1)) return max_tokens;
  // predict() is non-decreasing in n: the largest n within `seconds` by bisection.
  int32_t lo = 0, hi = max_tokens;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (*predict(mid) <= seconds) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace troupe::actors
