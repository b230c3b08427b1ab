// How long a step of n tokens takes on this executor, learned from the steps it ran. The
// scheduler uses it to size prefill chunks so that a step carrying decodes ends within the
// inter-token latency target (Sarathi-Serve's stall-free batching, with the token budget
// measured rather than profiled offline).
//
// Steps are grouped by token count in power-of-two buckets (1, 2-3, 4-7, ...); each bucket keeps
// a moving average of its steps' token count and time. A prediction interpolates between the
// buckets' points (made non-decreasing), takes the first point's time below it, and extrapolates
// above the last point in proportion to tokens: with a fixed per-step cost that over-predicts,
// so a budget taken from it errs short and grows as larger steps are seen. A bucket not seen in
// the last `stale_after` observations is forgotten (one slow outlier cannot cap budgets forever).
#pragma once

#include <array>
#include <cstdint>
#include <optional>

namespace troupe::actors {

class step_time_model {
 public:
  static constexpr int n_buckets = 24;  // up to 2^24 tokens per step

  /// weight: the moving average's weight of a new step (0, 1]; stale_after: observations.
  explicit step_time_model(double weight = 0.25, int64_t stale_after = 512);

  /// Records a step of n_tokens (>= 1) that took `seconds` (finite, >= 0); anything else is ignored.
  void observe(int32_t n_tokens, double seconds);
  /// Predicted seconds for a step of n_tokens; nullopt before any observation.
  std::optional<double> predict(int32_t n_tokens) const;
  /// The most tokens in [0, max_tokens] whose predicted step time is within `seconds`;
  /// max_tokens before any observation.
  int32_t tokens_within(double seconds, int32_t max_tokens) const;
  int64_t n_observed() const { return n_observed_; }

 private:
  struct bucket {
    double n = 0, t = 0;   // moving averages of token count and seconds
    int64_t last_seen = -1;  // observation index; -1: empty
  };
  bool live(const bucket& b) const;

  double weight_;
  int64_t stale_after_;
  int64_t n_observed_ = 0;
  std::array<bucket, n_buckets> b_{};
};

}  // namespace troupe::actors
