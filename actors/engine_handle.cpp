#include "actors/engine_handle.hpp"

#include <caf/io/all.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <unistd.h>

#include <atomic>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "actors/runtime.hpp"
#include "engine/device_module.hpp"
#include "engine/forward.hpp"
#include "engine/split_forward.hpp"

namespace troupe::actors {

const char* to_string(gen_error e) {
  switch (e) {
    case gen_error::none: return "none";
    case gen_error::invalid: return "invalid_request";
    case gen_error::too_long: return "context_length_exceeded";
    case gen_error::overloaded: return "overloaded";
    case gen_error::queue_timeout: return "queue_timeout";
    case gen_error::deadline: return "deadline_exceeded";
    case gen_error::cancelled: return "cancelled";
    case gen_error::unavailable: return "unavailable";
    case gen_error::internal: return "internal_error";
  }
  return "?";
}

// --- generation_stream ---------------------------------------------------------------------------

std::optional<stream_event> generation_stream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return !q_.empty() || final_taken_; })) return std::nullopt;
  if (q_.empty()) return std::nullopt;
  stream_event ev = std::move(q_.front());
  q_.pop_front();
  if (ev.type != stream_event::kind::token) final_taken_ = true;
  return ev;
}

void generation_stream::push(stream_event ev) {
  std::function<void()> notify;
  {
    std::lock_guard lk(mu_);
    if (final_pushed_) return;  // one final event; nothing after it
    if (ev.type != stream_event::kind::token) final_pushed_ = true;
    // Bounded by construction (max_tokens + 2); a breach is a bug, not a client's doing.
    if (q_.size() >= capacity_ && ev.type == stream_event::kind::token) return;
    q_.push_back(std::move(ev));
    notify = notify_;
  }
  cv_.notify_all();
  if (notify) notify();
}

void generation_stream::cancel() {
  std::function<void()> c;
  {
    std::lock_guard lk(mu_);
    if (final_pushed_) return;
    c = canceller_;
  }
  if (c) c();
}

void generation_stream::set_priority(priority_class cls, int32_t priority) {
  std::function<void(priority_class, int32_t)> f;
  {
    std::lock_guard lk(mu_);
    if (final_pushed_) return;
    f = reprioritizer_;
  }
  if (f) f(cls, priority);
}

void generation_stream::set_reprioritizer(std::function<void(priority_class, int32_t)> fn) {
  std::lock_guard lk(mu_);
  reprioritizer_ = std::move(fn);
}

void generation_stream::set_notify(std::function<void()> fn) {
  std::lock_guard lk(mu_);
  notify_ = std::move(fn);
}

bool generation_stream::finished() const {
  std::lock_guard lk(mu_);
  return final_taken_;
}

void generation_stream::set_canceller(std::function<void()> fn, uint64_t id) {
  std::lock_guard lk(mu_);
  canceller_ = std::move(fn);
  id_ = id;
}

// --- engine_handle -------------------------------------------------------------------------------

namespace {

// CAF 0.17 keeps a strong reference to an actor system's logger in a thread-local of each thread
// that built the system or a scoped_actor on it, and ~actor_system waits until the logger is
// destroyed. A thread that used an engine and lives on (main, an HTTP pool thread) would make
// destroying that engine from any other thread wait forever — what hot reload does (two engines,
// the old one destroyed on the model slot's thread). Every entry point that touches the system on
// the caller's thread lets go of it on return.
struct caf_thread_release {
  caf_thread_release() = default;
  caf_thread_release(const caf_thread_release&) = delete;
  caf_thread_release& operator=(const caf_thread_release&) = delete;
  ~caf_thread_release() { caf::logger::set_current_actor_system(nullptr); }
};

}  // namespace

struct engine_handle::impl {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::shared_ptr<const engine::model> model;
  caf::actor scheduler, supervisor, keeper;
  std::shared_ptr<replica_router> router;
  int published_port = -1;
  // Request ids are unique across every front that shares a replica: a random high half.
  std::atomic<uint64_t> next_id{(uint64_t)std::random_device{}() << 32 | 1};
  int32_t max_tokens_cap = 0;
};

engine::kv_shape engine_kv_shape(const engine::model& m, const engine_options& o) {
  return engine::model_kv_shape(m, o.kv_block_size, o.kv_window_groups && o.pipeline_parallel == 1);
}

std::unique_ptr<engine_handle> engine_handle::start(const engine_options& o) {
  caf_thread_release release;  // destroyed last: after the scoped_actor below, or the handle if we throw
  if (o.n_threads < 1) throw std::invalid_argument("n_threads must be at least 1");
  if (o.kv_block_size < 1) throw std::invalid_argument("kv_block_size must be at least 1");
  if (auto err = validate(o.sched); !err.empty()) throw std::invalid_argument(err);
  if (o.cuda_device >= 0) {  // refuse at start, not by opening the circuit after failed restarts
    int n = 0;
    try {
      n = engine::cuda_device_count();  // loads the CUDA module
    } catch (const std::runtime_error& e) {
      throw std::invalid_argument(e.what());
    }
    if (o.cuda_device >= n)
      throw std::invalid_argument("no CUDA device " + std::to_string(o.cuda_device) + ": this machine has " + std::to_string(n) +
                                  " usable (a driver and a GPU are needed; use the CPU)");
  }
  const int n_splits = (o.tensor_parallel > 1) + (o.pipeline_parallel > 1) + (o.expert_parallel > 1);
  if (n_splits > 0 && o.cuda_device >= 0)
    throw std::invalid_argument("tensor, pipeline and expert parallel run on the CPU backend only (NCCL between GPUs is not implemented): use --device cpu");
  // Data parallel: where the replicas are, whether this engine runs generations itself.
  std::vector<replica_endpoint> endpoints;
  for (const std::string& r : o.replicas) endpoints.push_back(parse_endpoint(r));
  if (!o.local_executor && endpoints.empty())
    throw std::invalid_argument("a server without a local executor routes to replicas: name at least one (--replica)");
  if (!o.local_executor && o.publish_port >= 0) throw std::invalid_argument("a server without a local executor has nothing to publish");
  if (o.publish_port > 65535) throw std::invalid_argument("publish port " + std::to_string(o.publish_port) + " is not in 0..65535");
  if (!(o.replica_retry_s > 0) || !(o.replica_timeout_s > 0))
    throw std::invalid_argument("the replica retry and timeout must be > 0 seconds");
  if (!(o.replica_heartbeat_s > 0) || !(o.replica_dead_after_s > o.replica_heartbeat_s))
    throw std::invalid_argument("the replica heartbeat must be > 0 s and shorter than the dead-after time");
  if (std::string err = replica_tls_error(o.replica_tls_cert, o.replica_tls_key, o.replica_tls_ca); !err.empty())
    throw std::invalid_argument(err);
  auto p = std::make_unique<impl>();
  p->model = std::shared_ptr<const engine::model>(engine::model::load(o.model_path, {o.dummy_weights, o.dummy_seed, o.cuda_device < 0}));
  if (std::string err = engine::parallel_error(*p->model, {o.tensor_parallel, o.pipeline_parallel, o.expert_parallel}); !err.empty())
    throw std::invalid_argument(err);
  const auto& hp = p->model->hparams();
  const engine::kv_shape shape = engine_kv_shape(*p->model, o);
  // A block id's bytes over every rank (copies included: replicated KV heads, expert parallel).
  const int64_t block_bytes = engine::split_block_bytes(shape, {o.tensor_parallel, o.pipeline_parallel, o.expert_parallel});
  const int64_t dev_blocks = o.n_device_blocks > 0 ? o.n_device_blocks : std::max<int64_t>(1, o.max_kv_bytes / block_bytes);
  const int64_t host_pool = o.n_host_blocks > 0 ? o.n_host_blocks : dev_blocks;
  // Host memory of the KV pools (both on the CPU; the swap pool alone, pinned, with a GPU): more
  // than the machine has would only fail later, slowly (or be killed), so refuse it here.
  const int64_t host_blocks = (o.cuda_device < 0 ? dev_blocks : 0) + host_pool;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0 && host_blocks > ((int64_t)pages * page) / block_bytes) {
    const auto mib = [](int64_t b) { return std::to_string(b >> 20) + " MiB"; };
    throw std::invalid_argument("the KV cache needs " + mib(host_blocks * block_bytes) + " of host memory (" +
                                std::to_string(dev_blocks) + " blocks and " + std::to_string(host_pool) + " swap blocks of " +
                                std::to_string(block_bytes >> 10) + " KiB); this machine has " +
                                mib((int64_t)pages * page) + ": lower --kv-mb");
  }
  if (dev_blocks > INT32_MAX || host_pool > INT32_MAX) throw std::invalid_argument("the KV cache has more than 2^31 blocks: lower --kv-mb");
  const auto n_dev = (int32_t)dev_blocks, n_host = (int32_t)host_pool;
  scheduler_config sc = o.sched;
  // The sliding-window groups hold blocks one step's tokens past the computed positions.
  const engine::kv_groups groups{shape.n_groups, shape.window, std::max(2, sc.max_batched_tokens)};
  const int64_t pool_positions = engine::kv_max_positions(o.kv_block_size, n_dev, groups);
  const int64_t limit = std::min<int64_t>(hp.n_ctx_train, pool_positions);
  if (sc.max_model_len == 0 || sc.max_model_len > limit) sc.max_model_len = limit;

  p->cfg.set("scheduler.max-threads", 2);  // message handling only: compute runs on the executor's threads
  add_wire_types(p->cfg);
  if (o.publish_port >= 0 || !endpoints.empty()) {
    p->cfg.load<caf::io::middleman>();
    // A peer that stops answering (stopped, hung, its machine gone without a FIN) is dropped after
    // dead_after_s: its proxies die, so monitors fire on both ends as for a closed connection.
    const auto span = [](double s) { return caf::timespan{(int64_t)(s * 1e9)}; };
    p->cfg.set("middleman.heartbeat-interval", span(o.replica_heartbeat_s));
    p->cfg.set("middleman.connection-timeout", span(o.replica_dead_after_s));
    if (!o.replica_tls_cert.empty()) {  // certificates required and checked on both ends
      p->cfg.load<caf::openssl::manager>();
      p->cfg.openssl_certificate = o.replica_tls_cert;
      p->cfg.openssl_key = o.replica_tls_key;
      p->cfg.openssl_cafile = o.replica_tls_ca;
    }
  }
  p->sys = std::make_unique<caf::actor_system>(p->cfg);
  scheduler_config_msg scm{sc, p->model, o.kv_block_size, n_dev, n_host, o.step_timeout_s, groups};
  p->scheduler = spawn_scheduler(*p->sys, scm);
  executor_config ec{p->model, o.n_threads, shape, n_dev, n_host, o.cuda_device, o.tensor_parallel, o.pipeline_parallel, o.expert_parallel,
                     sc.max_batched_tokens, sc.max_num_seqs, sc.max_model_len, o.fail_executor_start,
                     o.emulate_device_sampling, o.cuda_graphs, o.cuda_fused_decode, o.step_timeout_s, o.on_backend_up};
  if (o.local_executor)
    p->supervisor = p->sys->spawn(supervisor_actor, p->scheduler, ec,
                                  supervision{o.max_restarts, o.restart_window_s, o.step_timeout_s, o.executor_stop_timeout_s, o.circuit_reset_s,
                                              o.on_device_lost});
  auto h = std::unique_ptr<engine_handle>(new engine_handle(std::move(p)));  // stops the actors if we throw
  if (o.local_executor) {
    caf::scoped_actor self{*h->impl_->sys};
    const auto timeout = std::chrono::milliseconds((int64_t)(o.start_timeout_s * 1000));
    std::string err;
    self->request<caf::message_priority::high>(h->impl_->supervisor, timeout, ready_atom::value)
        .receive([](bool) {},
                 [&](caf::error& e) {
                   err = e == caf::sec::request_timeout
                             ? (std::ostringstream{} << "the executor did not start within " << o.start_timeout_s << " s").str()
                             : exit_text(self->system(), e);
                 });
    if (!err.empty()) throw std::runtime_error(err);
  }
  impl& im = *h->impl_;
  routing_options ro;
  ro.prefix = o.replica_prefix_routing;
  ro.max_imbalance = o.replica_max_imbalance;
  ro.affinity_blocks = (size_t)std::max<int64_t>(1, o.replica_affinity_blocks);
  ro.block_size = o.kv_block_size;
  im.router = std::make_shared<replica_router>(im.scheduler, o.local_executor, ro);
  if (o.publish_port >= 0 && o.publish_at_start) {
    try {
      h->publish(o.publish_host, o.publish_port);
    } catch (const std::runtime_error& e) {
      throw std::invalid_argument(e.what());
    }
  }
  if (!endpoints.empty()) {
    for (auto& e : endpoints) e.index = im.router->add_remote(e.host + ":" + std::to_string(e.port));
    im.keeper = im.sys->spawn(replica_keeper, im.router, endpoints, model_fingerprint(*im.model), o.replica_retry_s, o.replica_timeout_s,
                              im.sys->has_openssl_manager());
  }
  if (!o.local_executor) {  // a router only: ready once some replica serves
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds((int64_t)(o.start_timeout_s * 1000));
    while (!im.router->any_up()) {
      if (std::chrono::steady_clock::now() >= until)
        throw std::runtime_error((std::ostringstream{} << "no replica served within " << o.start_timeout_s << " s (a router without a local executor needs one)").str());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return h;
}

engine_handle::engine_handle(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

engine_handle::~engine_handle() {
  if (!impl_) return;
  if (impl_->keeper) caf::anon_send_exit(impl_->keeper, caf::exit_reason::user_shutdown);
  if (impl_->supervisor) caf::anon_send_exit(impl_->supervisor, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(impl_->scheduler, caf::exit_reason::user_shutdown);
  impl_->sys->await_all_actors_done();
}

std::shared_ptr<generation_stream> engine_handle::submit(generation_params params) {
  caf_thread_release release;
  const uint64_t id = impl_->next_id++;
  auto stream = std::make_shared<generation_stream>((size_t)std::max(0, params.max_tokens) + 2);
  // The canceller is in place before submit() returns, so a client's cancel() always reaches the
  // request actor (which then tells the scheduler with high priority).
  auto req = impl_->sys->spawn(request_actor, impl_->router, impl_->model, std::move(params), id, stream);
  stream->set_canceller([req] { caf::anon_send<caf::message_priority::high>(req, cancel_atom::value); }, id);
  stream->set_reprioritizer([req](priority_class cls, int32_t p) {
    caf::anon_send<caf::message_priority::high>(req, priority_atom::value, cls, p);
  });
  return stream;
}

engine_stats engine_handle::stats(std::chrono::milliseconds timeout) {
  caf_thread_release release;
  caf::scoped_actor self{*impl_->sys};
  engine_stats out;
  bool ok = false;
  std::string err;
  self->request<caf::message_priority::high>(impl_->scheduler, timeout, stats_atom::value)
      .receive([&](stats_reply& r) { out = std::move(r.s); ok = true; }, [&](caf::error& e) { err = self->system().render(e); });
  if (!ok) throw std::runtime_error("engine stats: " + err);
  return out;
}

bool engine_handle::drain(std::chrono::milliseconds timeout) {
  caf_thread_release release;
  caf::scoped_actor self{*impl_->sys};
  bool drained = false;
  self->request<caf::message_priority::high>(impl_->scheduler, timeout, drain_atom::value)
      .receive([&](bool ok) { drained = ok; }, [&](caf::error&) { drained = false; });
  return drained;
}

void engine_handle::fail_all(const std::string& why) {
  caf::anon_send<caf::message_priority::high>(impl_->scheduler, circuit_atom::value, why, false);
}

void engine_handle::inject_executor_fault(bool device_lost) { caf::anon_send(impl_->scheduler, fault_atom::value, device_lost); }

void engine_handle::inject_executor_hang(double seconds) { caf::anon_send(impl_->scheduler, hang_atom::value, seconds); }

const engine::model& engine_handle::model() const { return *impl_->model; }

std::vector<replica_stats> engine_handle::replicas() const { return impl_->router->stats(); }

int engine_handle::published_port() const { return impl_->published_port; }

int engine_handle::publish(const std::string& host, int port) {
  caf_thread_release release;
  if (!impl_->sys->has_middleman()) throw std::runtime_error("this engine was started without publishing (publish_port < 0)");
  // reuse_addr: a replica restarted on its port (or a reload handing it over) binds it despite the
  // last connections in TIME_WAIT; Linux still refuses a second listener.
  auto p = impl_->sys->has_openssl_manager() ? caf::openssl::publish(impl_->scheduler, (uint16_t)port, host.c_str(), true)
                                              : impl_->sys->middleman().publish(impl_->scheduler, (uint16_t)port, host.c_str(), true);
  if (!p)
    throw std::runtime_error("cannot publish the engine on " + host + ":" + std::to_string(port) + ": " + impl_->sys->render(p.error()));
  impl_->published_port = *p;
  return *p;
}

void engine_handle::retire_published() {
  caf_thread_release release;
  caf::anon_send<caf::message_priority::high>(impl_->scheduler, retire_atom::value);
  if (impl_->published_port >= 0) {
    if (impl_->sys->has_openssl_manager()) {  // its own listener, closed through its own middleman actor
      caf::scoped_actor self{*impl_->sys};
      self->request(impl_->sys->openssl_manager().actor_handle(), std::chrono::seconds(10), caf::unpublish_atom::value,
                    impl_->scheduler.address(), (uint16_t)impl_->published_port)
          .receive([] {}, [](caf::error&) {});
    } else {
      impl_->sys->middleman().unpublish(impl_->scheduler, (uint16_t)impl_->published_port);
    }
  }
  impl_->published_port = -1;
}

bool engine_handle::busy(std::chrono::milliseconds timeout) {
  try {
    const auto s = stats(timeout);
    return s.n_running > 0 || s.n_waiting > 0;
  } catch (const std::runtime_error&) {
    return true;
  }
}

}  // namespace troupe::actors
