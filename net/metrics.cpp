#include "net/metrics.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>

#include "net/model_slot.hpp"

namespace troupe::net {

namespace {

// Prometheus sample values: integers exactly, floats with enough digits to round-trip.
std::string fmt(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that round-trips
  return std::string(buf, r.ptr);
}
std::string fmt(uint64_t v) { return std::to_string(v); }
std::string fmt(int64_t v) { return std::to_string(v); }

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

template <class T>
void sample(std::string& out, const char* name, T value, const char* type, const char* help) {
  header(out, name, type, help);
  out += name;
  out += ' ';
  out += fmt(value);
  out += '\n';
}

constexpr double micro = 1e6;

}  // namespace

histogram::histogram(std::span<const double> bounds) : bounds_(bounds) {
  if (bounds.size() > max_buckets) throw std::invalid_argument("histogram: too many buckets");
  if (!std::is_sorted(bounds.begin(), bounds.end())) throw std::invalid_argument("histogram: bounds must ascend");
}

void histogram::observe(double v) {
  if (!(v >= 0)) v = 0;  // latencies only; a NaN or a clock step back counts as 0
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();  // first bound >= v: le
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_micro_.fetch_add((uint64_t)std::llround(v * micro), std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

void histogram::render(std::string& out, const std::string& name) const {
  // Read the buckets once; count is their total, so _count and the +Inf bucket always agree even
  // while other threads observe.
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    out += name + "_bucket{le=\"" + (i < bounds_.size() ? fmt(bounds_[i]) : std::string("+Inf")) + "\"} " + fmt(cumulative) + "\n";
  }
  out += name + "_sum " + fmt((double)sum_micro_.load(std::memory_order_relaxed) / micro) + "\n";
  out += name + "_count " + fmt(cumulative) + "\n";
}

void metrics_registry::count_status(int status) {
  by_status_[(status >= 100 && status < 600) ? status : 0].fetch_add(1, std::memory_order_relaxed);
}

void metrics_registry::add_tokens(int64_t n_prompt, int64_t n_generated) {
  n_prompt_tokens_.fetch_add((uint64_t)std::max<int64_t>(0, n_prompt), std::memory_order_relaxed);
  n_generated_tokens_.fetch_add((uint64_t)std::max<int64_t>(0, n_generated), std::memory_order_relaxed);
}

std::string metrics_registry::render(const actors::engine_stats* engine, const model_slot_stats* models) const {
  std::string out;
  out.reserve(8192);

  header(out, "troupe_requests_total", "counter", "HTTP responses by status code (code=\"other\": outside 100-599).");
  for (size_t code = 0; code < by_status_.size(); ++code) {
    const uint64_t n = by_status_[code].load(std::memory_order_relaxed);
    if (n == 0) continue;
    out += "troupe_requests_total{code=\"" + (code == 0 ? std::string("other") : std::to_string(code)) + "\"} " + fmt(n) + "\n";
  }
  sample(out, "troupe_prompt_tokens_total", n_prompt_tokens_.load(std::memory_order_relaxed), "counter",
         "Prompt tokens of the generations that reached their first token.");
  sample(out, "troupe_generation_tokens_total", n_generated_tokens_.load(std::memory_order_relaxed), "counter",
         "Tokens generated.");

  header(out, "troupe_time_to_first_token_seconds", "histogram", "Submit to the first token, as the HTTP layer sees it.");
  ttft.render(out, "troupe_time_to_first_token_seconds");
  header(out, "troupe_inter_token_latency_seconds", "histogram", "Gap between consecutive tokens of a generation, as the HTTP layer takes them.");
  itl.render(out, "troupe_inter_token_latency_seconds");
  header(out, "troupe_e2e_request_latency_seconds", "histogram", "Submit to the last token of a successful generation.");
  e2e.render(out, "troupe_e2e_request_latency_seconds");
  header(out, "troupe_request_queue_time_seconds", "histogram",
         "Estimated wait before the first step: time to first token minus the request's mean inter-token latency.");
  queue.render(out, "troupe_request_queue_time_seconds");

  if (models) {
    sample(out, "troupe_models_loaded", (int64_t)models->n_models, "gauge", "Models served: the default and those loaded with /admin/models/load.");
    sample(out, "troupe_model_version", (int64_t)models->version, "gauge", "Version of the default model new requests go to (1 at start, +1 per reload).");
    header(out, "troupe_model_reloads_total", "counter", "Reloads of the default model (POST /admin/reload, SIGHUP) by result.");
    out += "troupe_model_reloads_total{result=\"ok\"} " + fmt(models->reloads_ok) + "\n";
    out += "troupe_model_reloads_total{result=\"failed\"} " + fmt(models->reloads_failed) + "\n";
    sample(out, "troupe_model_versions_draining", (int64_t)models->n_retired, "gauge",
           "Replaced versions of the default model still finishing the generations they hold.");
  }
  sample(out, "troupe_engine_up", (int64_t)(engine != nullptr), "gauge", "1 when the engine answered the stats query of this scrape.");
  if (!engine) return out;
  const actors::engine_stats& s = *engine;
  sample(out, "troupe_num_requests_running", (int64_t)s.n_running, "gauge", "Sequences running (scheduled for decode or prefill).");
  sample(out, "troupe_num_requests_waiting", (int64_t)s.n_waiting, "gauge", "Sequences waiting for admission.");
  sample(out, "troupe_kv_blocks_total", (int64_t)s.n_device_blocks, "gauge", "Device KV cache blocks.");
  sample(out, "troupe_kv_blocks_used", (int64_t)(s.n_device_blocks - s.n_free_device - s.n_cached), "gauge",
         "Device KV blocks held by sequences.");
  sample(out, "troupe_kv_blocks_cached", (int64_t)s.n_cached, "gauge", "Device KV blocks kept only by the prefix cache (evictable).");
  sample(out, "troupe_kv_host_blocks_total", (int64_t)s.n_host_blocks, "gauge", "Host (swap) KV blocks.");
  sample(out, "troupe_kv_host_blocks_used", (int64_t)(s.n_host_blocks - s.n_free_host), "gauge", "Host KV blocks in use.");
  header(out, "troupe_preemptions_total", "counter", "Sequences preempted for KV space, by mode.");
  out += "troupe_preemptions_total{mode=\"swap\"} " + fmt(s.sched.n_preempted_swap) + "\n";
  out += "troupe_preemptions_total{mode=\"recompute\"} " + fmt(s.sched.n_preempted_recompute) + "\n";
  sample(out, "troupe_prefix_cache_queries_total", s.kv.n_lookup_tokens, "counter", "Prompt tokens offered to the prefix cache.");
  sample(out, "troupe_prefix_cache_hits_total", s.kv.n_hit_tokens, "counter", "Prompt tokens served from cached KV blocks.");
  sample(out, "troupe_scheduler_refused_total", s.sched.n_refused, "counter", "Requests the scheduler refused at admission.");
  sample(out, "troupe_scheduler_timed_out_total", s.sched.n_timed_out, "counter", "Requests that waited past their queue timeout.");
  sample(out, "troupe_scheduler_steps_total", s.sched.n_steps, "counter", "Engine steps run.");
  sample(out, "troupe_scheduler_itl_capped_steps_total", s.sched.n_itl_capped, "counter",
         "Steps whose prefill tokens the inter-token latency target cut.");
  sample(out, "troupe_executor_restarts_total", (int64_t)s.executor_restarts, "counter", "Times the supervisor restarted the executor.");
  sample(out, "troupe_executor_alive", (int64_t)s.executor_alive, "gauge", "1 while an executor is running.");
  sample(out, "troupe_circuit_open", (int64_t)s.circuit_open, "gauge", "1 when the executor failed too often and requests are refused.");
  return out;
}

void request_timer::on_token(clock::time_point now) {
  if (n_tokens_ == 0) {
    first_ = now;
    m_.ttft.observe(std::chrono::duration<double>(now - submit_).count());
  } else {
    m_.itl.observe(std::chrono::duration<double>(now - last_).count());
  }
  last_ = now;
  ++n_tokens_;
}

void request_timer::on_done(const actors::stream_event& done, clock::time_point now) {
  if (ended_) return;
  ended_ = true;
  m_.add_tokens(done.n_prompt, done.n_generated);
  m_.e2e.observe(std::chrono::duration<double>(now - submit_).count());
  if (n_tokens_ == 0) return;
  const double ttft_s = std::chrono::duration<double>(first_ - submit_).count();
  const double mean_itl = n_tokens_ > 1 ? std::chrono::duration<double>(last_ - first_).count() / (double)(n_tokens_ - 1) : 0.0;
  m_.queue.observe(std::max(0.0, ttft_s - mean_itl));
}

void request_timer::on_error() {
  if (ended_) return;
  ended_ = true;
  if (n_tokens_ > 0) m_.add_tokens(n_prompt_, n_tokens_);
}

}  // namespace troupe::net
