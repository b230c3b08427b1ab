#include "net/metrics.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>


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

// A label value as the exposition format writes it: backslash, quote and newline escaped.
std::string label_value(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

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

std::string metrics_registry::render(std::span<const model_figures> models) const {
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

  sample(out, "troupe_models_loaded", (int64_t)models.size(), "gauge", "Models served: the default and those loaded with /admin/models/load.");
  // One family per metric, one line per model.
  auto family = [&](const char* name, const char* type, const char* help, auto value, bool engine_only = true,
                    const std::string& extra = "") {
    header(out, name, type, help);
    for (const auto& m : models) {
      if (engine_only && !m.engine) continue;
      out += name;
      out += "{model=\"" + label_value(m.model) + "\"" + extra + "} " + fmt(value(m)) + "\n";
    }
  };
  using F = model_figures;
  family("troupe_model_version", "gauge", "Version of the model new requests go to (1 when loaded, +1 per reload).",
         [](const F& m) { return (int64_t)m.slot.version; }, false);
  header(out, "troupe_model_reloads_total", "counter", "Reloads (POST /admin/reload, SIGHUP) by result.");
  for (const auto& m : models)
    for (const char* r : {"ok", "failed"})
      out += "troupe_model_reloads_total{model=\"" + label_value(m.model) + "\",result=\"" + r + "\"} " +
             fmt(r[0] == 'o' ? m.slot.reloads_ok : m.slot.reloads_failed) + "\n";
  family("troupe_model_versions_draining", "gauge", "Replaced versions still finishing the generations they hold.",
         [](const F& m) { return (int64_t)m.slot.n_retired; }, false);
  family("troupe_engine_up", "gauge", "1 when the model's engine answered the stats query of this scrape.",
         [](const F& m) { return (int64_t)m.engine.has_value(); }, false);
  family("troupe_num_requests_running", "gauge", "Sequences running (scheduled for decode or prefill).",
         [](const F& m) { return (int64_t)m.engine->n_running; });
  family("troupe_num_requests_waiting", "gauge", "Sequences waiting for admission.", [](const F& m) { return (int64_t)m.engine->n_waiting; });
  family("troupe_kv_blocks_total", "gauge", "Device KV cache blocks.", [](const F& m) { return (int64_t)m.engine->n_device_blocks; });
  family("troupe_kv_blocks_used", "gauge", "Device KV blocks held by sequences.", [](const F& m) {
    return (int64_t)(m.engine->n_device_blocks - m.engine->n_free_device - m.engine->n_cached);
  });
  family("troupe_kv_blocks_cached", "gauge", "Device KV blocks kept only by the prefix cache (evictable).",
         [](const F& m) { return (int64_t)m.engine->n_cached; });
  family("troupe_kv_host_blocks_total", "gauge", "Host (swap) KV blocks.", [](const F& m) { return (int64_t)m.engine->n_host_blocks; });
  family("troupe_kv_host_blocks_used", "gauge", "Host KV blocks in use.",
         [](const F& m) { return (int64_t)(m.engine->n_host_blocks - m.engine->n_free_host); });
  header(out, "troupe_preemptions_total", "counter", "Sequences preempted for KV space, by mode.");
  for (const auto& m : models) {
    if (!m.engine) continue;
    const std::string l = "troupe_preemptions_total{model=\"" + label_value(m.model) + "\",mode=";
    out += l + "\"swap\"} " + fmt(m.engine->sched.n_preempted_swap) + "\n";
    out += l + "\"recompute\"} " + fmt(m.engine->sched.n_preempted_recompute) + "\n";
  }
  family("troupe_prefix_cache_queries_total", "counter", "Prompt tokens offered to the prefix cache.",
         [](const F& m) { return m.engine->kv.n_lookup_tokens; });
  family("troupe_prefix_cache_hits_total", "counter", "Prompt tokens served from cached KV blocks.",
         [](const F& m) { return m.engine->kv.n_hit_tokens; });
  family("troupe_scheduler_refused_total", "counter", "Requests the scheduler refused at admission.",
         [](const F& m) { return m.engine->sched.n_refused; });
  family("troupe_scheduler_timed_out_total", "counter", "Requests that waited past their queue timeout.",
         [](const F& m) { return m.engine->sched.n_timed_out; });
  family("troupe_scheduler_steps_total", "counter", "Engine steps run.", [](const F& m) { return m.engine->sched.n_steps; });
  family("troupe_scheduler_itl_capped_steps_total", "counter", "Steps whose prefill tokens the inter-token latency target cut.",
         [](const F& m) { return m.engine->sched.n_itl_capped; });
  family("troupe_executor_restarts_total", "counter", "Times the supervisor restarted the executor.",
         [](const F& m) { return (int64_t)m.engine->executor_restarts; });
  family("troupe_executor_alive", "gauge", "1 while an executor is running.", [](const F& m) { return (int64_t)m.engine->executor_alive; });
  family("troupe_circuit_open", "gauge", "1 when the executor failed too often and requests are refused.",
         [](const F& m) { return (int64_t)m.engine->circuit_open; });
  family("troupe_device_lost", "gauge", "1 when the executor's device is lost (a sticky CUDA error): only a new process can serve.",
         [](const F& m) { return (int64_t)!m.engine->device_lost.empty(); });
  // Data parallel (--replica): one line per model and replica ("local" is this server's executor).
  auto replica_family = [&](const char* name, const char* type, const char* help, auto value) {
    bool any = false;
    for (const auto& m : models) any |= m.replicas.size() > 1;
    if (!any) return;
    header(out, name, type, help);
    for (const auto& m : models) {
      if (m.replicas.size() < 2) continue;
      for (const auto& r : m.replicas)
        out += std::string(name) + "{model=\"" + label_value(m.model) + "\",replica=\"" + label_value(r.name) + "\"} " + fmt(value(r)) + "\n";
    }
  };
  using R = actors::replica_stats;
  replica_family("troupe_replica_up", "gauge", "1 while generations can be routed to the replica.", [](const R& r) { return (int64_t)r.up; });
  replica_family("troupe_replica_in_flight", "gauge", "Generations running or queued at the replica.", [](const R& r) { return r.in_flight; });
  replica_family("troupe_replica_routed_total", "counter", "Generations routed to the replica (a moved one counts at each).",
                 [](const R& r) { return r.routed; });
  replica_family("troupe_replica_prefix_routed_total", "counter",
                 "Of the routed generations, those sent for a prompt prefix the replica had taken before (prefix routing).",
                 [](const R& r) { return r.prefix_routed; });
  replica_family("troupe_replica_lost_total", "counter", "Generations whose replica died or disconnected while they ran there.",
                 [](const R& r) { return r.lost; });
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
