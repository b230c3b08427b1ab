// The Prometheus metrics of `troupe serve` (GET /metrics, text exposition format 0.0.4).
// The HTTP handlers feed a `metrics_registry` (lock-free atomics, safe from every I/O thread);
// the engine's counters and gauges are read from an engine_stats snapshot at scrape time.
// No Boost here: tests and other front ends (WebSocket) can feed it too.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include <optional>
#include <vector>

#include "actors/engine_handle.hpp"
#include "net/model_slot.hpp"

namespace troupe::net {

/// A histogram with fixed upper bounds (seconds), cumulative on output. Thread-safe.
class histogram {
 public:
  static constexpr size_t max_buckets = 24;
  /// `bounds` ascending, at most max_buckets; +Inf is implicit.
  explicit histogram(std::span<const double> bounds);
  void observe(double v);

  /// Appends `name_bucket{le=...}`, `name_sum` and `name_count` lines.
  void render(std::string& out, const std::string& name) const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::span<const double> bounds_;
  std::array<std::atomic<uint64_t>, max_buckets + 1> buckets_{};  // per bucket (not cumulative); last: +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_micro_{0};  // the sum in microunits, so it can be an integer atomic
};

/// Bucket upper bounds in seconds, chosen for CPU/GPU LLM serving.
struct latency_buckets {
  /// Time to first token and queue time: 1 ms (a cached prompt on a GPU) to 2 min (a long queue).
  static constexpr double ttft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                    1.0,   2.5,   5.0,  7.5,  10,   20,   40,   80,  120};
  /// Inter-token latency: 1 ms (fast batched decode) to 2.5 s (a CPU under heavy batching).
  static constexpr double itl[] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                   0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5};
  /// End-to-end request latency: 50 ms to 10 min (the default request timeout).
  static constexpr double e2e[] = {0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 600};
};

class metrics_registry {
 public:
  /// Counts one HTTP response by status (100..599; anything else is counted as 0 ("other")).
  void count_status(int status);
  /// Adds a generation's token counts.
  void add_tokens(int64_t n_prompt, int64_t n_generated);

  histogram ttft{latency_buckets::ttft};
  histogram itl{latency_buckets::itl};
  histogram e2e{latency_buckets::e2e};
  histogram queue{latency_buckets::ttft};

  /// One served model's figures for a scrape: its versions and reloads, and its engine's stats
  /// (nullopt: the engine did not answer; rendered as troupe_engine_up 0).
  struct model_figures {
    std::string model;
    model_slot_stats slot;
    std::optional<actors::engine_stats> engine;
    std::vector<actors::replica_stats> replicas;  // local first; rendered when it has remote replicas
  };
  /// The whole exposition: the HTTP-side metrics, then per served model (label model="ID") its
  /// versions, reloads and engine figures.
  std::string render(std::span<const model_figures> models) const;

 private:
  std::array<std::atomic<uint64_t>, 600> by_status_{};
  std::atomic<uint64_t> n_prompt_tokens_{0}, n_generated_tokens_{0};
};

/// One generation's timing as the HTTP layer sees it, fed to the registry:
///   submit (construction) -> first token -> each token -> done.
/// TTFT = first token - submit. ITL = gap between consecutive token events as they are taken
/// from the stream. E2E = done - submit (successful requests only). Queue time is an estimate
/// (the HTTP layer sees no scheduling timestamps): TTFT minus the request's mean ITL, i.e. one
/// engine step standing in for its own prefill; TTFT itself when it produced a single token.
class request_timer {
 public:
  using clock = std::chrono::steady_clock;
  /// `n_prompt`: the request's prompt tokens, counted when it ends without a done event.
  request_timer(metrics_registry& m, int64_t n_prompt, clock::time_point submit = clock::now())
      : m_(m), n_prompt_(n_prompt), submit_(submit) {}
  /// A generation that ended without on_done/on_error (client gone) counts like an error.
  ~request_timer() { on_error(); }
  request_timer(const request_timer&) = delete;
  request_timer& operator=(const request_timer&) = delete;

  /// A token event arrived.
  void on_token(clock::time_point now = clock::now());
  /// The done event: counts its tokens and records the latencies.
  void on_done(const actors::stream_event& done, clock::time_point now = clock::now());
  /// An error ended the generation: when it had begun (a token came), its prompt and the tokens
  /// generated are counted (their compute happened); E2E and queue time are not recorded.
  void on_error();

 private:
  metrics_registry& m_;
  int64_t n_prompt_ = 0;
  clock::time_point submit_, first_{}, last_{};
  int64_t n_tokens_ = 0;
  bool ended_ = false;
};

}  // namespace troupe::net
