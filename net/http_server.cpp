// Beast + Asio coroutines. One strand per connection; I/O threads never block on the engine:
// a generation's events are awaited through a timer the stream's notify callback cancels.
#include "net/http_server.hpp"

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "net/auth.hpp"
#include "net/metrics.hpp"
#include "net/ws_session.hpp"

namespace troupe::net {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using asio::awaitable;
constexpr auto nothrow = asio::as_tuple(asio::use_awaitable);
using strand = asio::strand<asio::io_context::executor_type>;

using request = http::request<http::string_body>;
using response = http::response<http::string_body>;

// --- awaiting a generation's events without blocking the thread ---------------------------------

// The generations in flight, so a stopping server can cancel what outlives the grace period.
class active_set {
 public:
  void add(const std::shared_ptr<actors::generation_stream>& s) {
    std::lock_guard lk(mu_);
    set_.insert(s);
  }
  void remove(const std::shared_ptr<actors::generation_stream>& s) {
    std::lock_guard lk(mu_);
    set_.erase(s);
  }
  size_t size() const {
    std::lock_guard lk(mu_);
    return set_.size();
  }
  void cancel_all() {
    std::vector<std::shared_ptr<actors::generation_stream>> v;
    {
      std::lock_guard lk(mu_);
      v.assign(set_.begin(), set_.end());
    }
    for (auto& s : v) s->cancel();
  }

 private:
  mutable std::mutex mu_;
  std::set<std::shared_ptr<actors::generation_stream>> set_;
};

// Awaits the events of a request's generations (one per choice) without blocking the thread.
// Each stream's notify callback (an actor thread) marks `pending` and cancels the timer through
// the connection's strand, so a push between "queue empty" and "wait" is never lost: either the
// flag is seen before waiting, or the posted cancel runs after the wait began. The destructor
// cancels every generation that has not finished (client gone, error, server stopping).
class event_waiter {
 public:
  struct item {
    int32_t index;  // which stream (choice)
    actors::stream_event ev;
  };

  event_waiter(asio::any_io_executor ex, std::vector<std::shared_ptr<actors::generation_stream>> s, active_set& active)
      : streams_(std::move(s)), state_(std::make_shared<shared>(ex)), active_(active) {
    for (auto& st : streams_) {
      active_.add(st);
      st->set_notify([sh = state_] { shared::wake(sh); });
    }
  }
  ~event_waiter() {
    {
      std::lock_guard lk(state_->mu);
      state_->alive = false;
    }
    for (auto& st : streams_) {
      st->set_notify(nullptr);
      if (!st->finished()) st->cancel();  // client gone or server stopping: free the KV
      active_.remove(st);
    }
  }
  event_waiter(const event_waiter&) = delete;
  event_waiter& operator=(const event_waiter&) = delete;

  /// Watches `sock` for the client going away (EOF or reset) while the response is produced:
  /// next() then returns nullopt at once. Bytes of a pipelined next request end the watch.
  void watch_client(tcp::socket& sock) {
    sock.async_wait(tcp::socket::wait_read, [sh = state_, fd = sock.native_handle()](const boost::system::error_code& ec) {
      if (ec) return;
      {
        std::lock_guard lk(sh->mu);
        if (!sh->alive) return;  // the request is over; the socket may be serving the next one
      }
      char c;
      const ssize_t r = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        sh->client_gone = true;
        shared::wake(sh);
      }
    });
  }

  bool client_gone() const { return state_->client_gone; }

  /// The next event of any stream (round robin over those not finished), or nullopt when the
  /// client went away or every stream has delivered its final event.
  awaitable<std::optional<item>> next() {
    for (;;) {
      if (state_->client_gone) co_return std::nullopt;
      bool open = false;
      for (size_t k = 0; k < streams_.size(); ++k) {
        const size_t i = (rr_ + k) % streams_.size();
        if (streams_[i]->finished()) continue;
        open = true;
        if (auto ev = streams_[i]->next(std::chrono::milliseconds(0))) {
          rr_ = i + 1;
          co_return item{(int32_t)i, std::move(*ev)};
        }
      }
      if (!open) co_return std::nullopt;
      {
        std::lock_guard lk(state_->mu);
        if (std::exchange(state_->pending, false)) continue;
      }
      state_->timer.expires_after(std::chrono::milliseconds(200));  // a safety net only
      co_await state_->timer.async_wait(nothrow);
    }
  }

 private:
  struct shared {
    explicit shared(asio::any_io_executor ex) : timer(ex) {}
    static void wake(const std::shared_ptr<shared>& sh) {
      std::lock_guard lk(sh->mu);
      if (!sh->alive) return;
      sh->pending = true;
      asio::post(sh->timer.get_executor(), [sh] { sh->timer.cancel(); });
    }
    std::mutex mu;
    bool alive = true, pending = false;
    std::atomic<bool> client_gone{false};
    asio::steady_timer timer;
  };
  std::vector<std::shared_ptr<actors::generation_stream>> streams_;
  std::shared_ptr<shared> state_;
  active_set& active_;
  size_t rr_ = 0;
};

// --- the server --------------------------------------------------------------------------------

class server {
 public:
  server(const server_options& o, model_registry& models) : opts_(o), models_(models), acceptor_(ioc_), signals_(ioc_, SIGINT, SIGTERM), hup_(ioc_, SIGHUP) {}

  int run() {
    tcp::endpoint ep(asio::ip::make_address(opts_.host), opts_.port);
    acceptor_.open(ep.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    beast::error_code ec;
    acceptor_.bind(ep, ec);
    if (ec) throw std::runtime_error("cannot listen on " + opts_.host + ":" + std::to_string(opts_.port) + ": " + ec.message());
    acceptor_.listen(asio::socket_base::max_listen_connections);
    const auto bound = acceptor_.local_endpoint();
    std::printf("troupe serve: listening on http://%s:%u (model %s)\n", bound.address().to_string().c_str(),
                (unsigned)bound.port(), models_.find("")->api.model_id.c_str());
    std::fflush(stdout);
    signals_.async_wait([this](const beast::error_code& e, int sig) {
      if (!e) stop("signal " + std::to_string(sig), 0);
    });
    if (opts_.exit_on_device_loss)
      opts_.device_loss->on_notice([this](const std::string&) {  // the supervisor has logged why
        asio::post(ioc_, [this] { stop("the device is lost", 1); });
      });
    on_hup();
    asio::co_spawn(ioc_, accept_loop(), asio::detached);
    std::vector<std::thread> threads;
    for (int i = 1; i < std::max(1, opts_.n_io_threads); ++i) threads.emplace_back([this] { ioc_.run(); });
    ioc_.run();
    for (auto& t : threads) t.join();
    opts_.device_loss->on_notice(nullptr);  // this server is gone
    return exit_code_;
  }

 private:
  // SIGINT, SIGTERM or a lost device (on an I/O thread): accept nothing new, drain, return `code`.
  void stop(const std::string& why, int code) {
    if (stopping_.exchange(true)) return;
    exit_code_ = code;
    std::fprintf(stderr, "troupe serve: %s: no new connections; %zu generations finishing (grace %.0f s)\n", why.c_str(), active_.size(),
                 opts_.shutdown_grace_s);
    beast::error_code ignored;
    acceptor_.close(ignored);
    signals_.cancel(ignored);
    asio::co_spawn(ioc_, drain(), asio::detached);
  }

  // SIGHUP: reload the served model from its file (as POST /admin/reload with no body), logged.
  void on_hup() {
    hup_.async_wait([this](const beast::error_code& e, int) {
      if (e || stopping_) return;
      asio::post(blocking_, [this] {
        try {
          models_.reload("", "");
        } catch (const std::exception&) {  // model_slot logged why; the old version serves on
        }
      });
      on_hup();
    });
  }

  // Lets generations in flight finish for the grace period, cancels the rest (their clients get an
  // error), then stops the I/O threads.
  awaitable<void> drain() {
    asio::steady_timer t(ioc_);
    const auto grace_end = std::chrono::steady_clock::now() + std::chrono::milliseconds((int64_t)(opts_.shutdown_grace_s * 1000));
    while (active_.size() > 0 && std::chrono::steady_clock::now() < grace_end) {
      t.expires_after(std::chrono::milliseconds(50));
      co_await t.async_wait(nothrow);
    }
    if (active_.size() > 0) {
      active_.cancel_all();
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (active_.size() > 0 && std::chrono::steady_clock::now() < end) {
        t.expires_after(std::chrono::milliseconds(20));
        co_await t.async_wait(nothrow);
      }
    }
    ioc_.stop();
  }

  awaitable<void> accept_loop() {
    for (;;) {
      auto [ec, sock] = co_await acceptor_.async_accept(asio::make_strand(ioc_), nothrow);
      if (ec) {
        if (!acceptor_.is_open()) co_return;
        continue;
      }
      asio::co_spawn(sock.get_executor(), session(std::move(sock)), asio::detached);
    }
  }

  std::chrono::steady_clock::duration idle_limit() const {
    return std::chrono::milliseconds((int64_t)(std::min(opts_.idle_timeout_s, 86400.0) * 1000));
  }

  awaitable<void> session(tcp::socket sock) {
    // Tokens are small writes that must leave at once: without TCP_NODELAY, Nagle holds the first
    // SSE event behind the response header until the client's delayed ACK (~40 ms of TTFT).
    boost::system::error_code nd_ec;
    sock.set_option(tcp::no_delay(true), nd_ec);
    beast::tcp_stream stream(std::move(sock));
    const int n_open = ++n_connections_;
    struct counter {
      std::atomic<int>& n;
      ~counter() { --n; }
    } guard{n_connections_};
    if (n_open > opts_.max_connections) {
      co_await write_response(stream, error_response(http_error(503, "too many connections", "too_many_connections"), 11, false));
      co_return;
    }
    beast::flat_buffer buf;
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(opts_.max_body_bytes);
      parser.header_limit(opts_.max_header_bytes);
      stream.expires_after(idle_limit());
      auto [ec, n] = co_await http::async_read_header(stream, buf, parser, nothrow);
      if (!ec) {  // the API key is checked before the body is read or any model work starts
        const auto& h = parser.get();
        if (auto denied = authorize(opts_.auth, std::string_view(h.target().data(), h.target().size()),
                                    std::string_view(h[http::field::authorization].data(), h[http::field::authorization].size()))) {
          co_await write_response(stream, error_response(*denied, h.version(), false));
          co_await linger(stream);
          co_return;
        }
        std::tie(ec, n) = co_await http::async_read(stream, buf, parser, nothrow);
      }
      if (ec == http::error::header_limit) {
        co_await write_response(stream, error_response(http_error(431, "the request line and headers exceed " + std::to_string(opts_.max_header_bytes) +
                                                                            " bytes (--max-header-bytes)", "headers_too_large"), 11, false));
        co_await linger(stream);
        co_return;
      }
      if (ec == http::error::body_limit) {
        co_await write_response(stream, error_response(http_error(413, "the request body exceeds " + std::to_string(opts_.max_body_bytes) +
                                                                            " bytes (--max-body-bytes)", "body_too_large"), 11, false));
        co_await linger(stream);
        co_return;
      }
      if (ec) {
        if (ec != http::error::end_of_stream && ec != asio::error::operation_aborted && ec != beast::error::timeout &&
            ec != asio::error::connection_reset && ec != asio::error::eof)
          co_await write_response(stream, error_response(http_error(400, "malformed HTTP request: " + ec.message(), "bad_request"), 11, false));
        break;
      }
      stream.expires_never();
      request req = parser.release();
      if (is_ws_upgrade(req)) {  // GET /v1/ws: the connection becomes a WebSocket (ws_session.cpp)
        co_await run_ws_session(std::move(stream), std::move(req), ws_context_());
        co_return;
      }
      const bool keep = co_await dispatch(stream, req);
      if (!keep) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  // After refusing a body: stop sending, read and drop what the client still sends (bounded), so
  // it sees the response rather than a reset.
  awaitable<void> linger(beast::tcp_stream& stream) {
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream.expires_after(std::chrono::seconds(2));
    std::array<char, 16384> sink;
    for (size_t total = 0; total < (64u << 20);) {
      auto [ec, n] = co_await stream.async_read_some(asio::buffer(sink), nothrow);
      if (ec) break;
      total += n;
    }
  }

  static response json_response(http::status st, std::string body, unsigned version, bool keep) {
    response res{st, version};
    res.set(http::field::server, "troupe");
    res.set(http::field::content_type, "application/json");
    res.keep_alive(keep);
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
  }

  static response error_response(const api_error& e, unsigned version, bool keep) {
    response res = json_response(static_cast<http::status>(e.status), error_body(e), version, keep);
    if (!e.retry_after.empty()) res.set(http::field::retry_after, e.retry_after);
    return res;
  }

  awaitable<bool> write_response(beast::tcp_stream& stream, response res) {
    metrics_.count_status(res.result_int());
    stream.expires_after(std::chrono::seconds(30));
    auto [ec, n] = co_await http::async_write(stream, res, nothrow);
    stream.expires_never();
    co_return !ec && res.keep_alive();
  }

  // Routes one request; returns whether the connection stays open.
  awaitable<bool> dispatch(beast::tcp_stream& stream, request& req) {
    const unsigned ver = req.version();
    const bool keep = req.keep_alive();
    std::string path(req.target());
    if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
    const auto method = req.method();
    struct route {
      const char* path;
      http::verb verb;
    };
    static const route routes[] = {{"/v1/completions", http::verb::post}, {"/v1/chat/completions", http::verb::post},
                                   {"/v1/models", http::verb::get},       {"/health", http::verb::get},
                                   {"/ready", http::verb::get},           {"/tokenize", http::verb::post},
                                   {"/detokenize", http::verb::post},     {"/metrics", http::verb::get},
                                   {"/v1/ws", http::verb::get},           {"/admin/reload", http::verb::post},
                                   {"/admin/models/load", http::verb::post}, {"/admin/models/unload", http::verb::post}};
    const route* found = nullptr;
    for (const auto& r : routes)
      if (path == r.path) found = &r;
    if (!found) co_return co_await write_response(stream, error_response(http_error(404, "no route " + path, "not_found"), ver, keep));
    if (method != found->verb) {
      response res = error_response(http_error(405, "use " + std::string(http::to_string(found->verb)) + " for " + path, "method_not_allowed"), ver, keep);
      res.set(http::field::allow, http::to_string(found->verb));
      co_return co_await write_response(stream, std::move(res));
    }
    api_error err;
    try {
      if (path == "/v1/ws") {  // a GET without the upgrade headers
        response res = error_response(http_error(426, "/v1/ws is a WebSocket endpoint: send an upgrade request", "upgrade_required"), ver, keep);
        res.set(http::field::upgrade, "websocket");
        co_return co_await write_response(stream, std::move(res));
      }
      if (path == "/health") co_return co_await write_response(stream, health(ver, keep));
      if (path == "/ready") co_return co_await write_response(stream, co_await ready(ver, keep));
      if (path == "/metrics") co_return co_await write_response(stream, co_await metrics_response(ver, keep));
      if (path == "/v1/models") co_return co_await write_response(stream, json_response(http::status::ok, dump(models_list()), ver, keep));
      const bool admin = path.starts_with("/admin/");
      const json body = req.body().empty() && admin ? json::object() : json::parse(req.body(), nullptr, false);
      if (body.is_discarded()) throw api_exception(http_error(400, "the request body is not valid JSON", "invalid_json"));
      if (admin) co_return co_await write_response(stream, co_await model_admin(path, body, ver, keep));
      // The version of the model the request names (none: the default), held to the request's end.
      std::string name;
      if (auto m = body.is_object() ? body.find("model") : body.end(); body.is_object() && m != body.end() && m->is_string()) name = m->get<std::string>();
      const std::shared_ptr<const served_model> model = models_.find(name);
      const api_context& api = model->api;
      if (path == "/tokenize") co_return co_await write_response(stream, json_response(http::status::ok, dump(tokenize(body, api)), ver, keep));
      if (path == "/detokenize") co_return co_await write_response(stream, json_response(http::status::ok, dump(detokenize(body, api)), ver, keep));
      const completion_request creq = parse_completion(body, path == "/v1/completions" ? endpoint::completions : endpoint::chat, api);
      co_return co_await generate(stream, creq, *model, ver, keep);
    } catch (const api_exception& e) {
      err = e.err;
    } catch (const std::exception& e) {
      err = http_error(500, e.what(), "internal_error");
    }
    co_return co_await write_response(stream, error_response(err, ver, keep));  // no co_await inside a handler
  }

  // The engine's stats, asked on the blocking pool so no I/O thread waits on the scheduler.
  awaitable<std::pair<std::optional<actors::engine_stats>, std::string>> engine_stats() {
    try {
      auto st = co_await asio::co_spawn(
          blocking_, [this]() -> awaitable<actors::engine_stats> { co_return models_.find("")->engine->stats(std::chrono::seconds(2)); },
          asio::use_awaitable);
      co_return std::pair{std::optional(std::move(st)), std::string()};
    } catch (const std::exception& e) {
      co_return std::pair{std::optional<actors::engine_stats>(), std::string(e.what())};
    }
  }

  // Liveness: the process answers and its device can still work. After a lost device nothing but a
  // new process helps, so an orchestrator probing this restarts it (vLLM's /health fails once its
  // engine is dead).
  response health(unsigned ver, bool keep) const {
    const std::string lost = opts_.device_loss->reason();
    if (lost.empty()) return json_response(http::status::ok, R"({"status":"ok"})", ver, keep);
    return json_response(http::status::service_unavailable, dump(json{{"status", "device_lost"}, {"error", lost}}), ver, keep);
  }

  awaitable<response> ready(unsigned ver, bool keep) {
    auto [st, err] = co_await engine_stats();
    if (!st) co_return error_response(http_error(503, "the engine does not answer: " + err, "unavailable"), ver, keep);
    // Ready while generations have somewhere to run: the local executor, or a remote replica.
    const auto replicas = models_.find("")->engine->replicas();
    bool ok = st->executor_alive && !st->circuit_open;
    json rj = json::array();
    for (size_t i = 0; i < replicas.size(); ++i) {
      if (i > 0) ok |= replicas[i].up;
      rj.push_back({{"name", replicas[i].name}, {"up", replicas[i].up}, {"status", replicas[i].status}, {"in_flight", replicas[i].in_flight}});
    }
    const model_slot_stats ms = models_.stats();
    json j{{"status", ok ? "ready" : "unavailable"}, {"running", st->n_running}, {"waiting", st->n_waiting},
           {"executor_alive", st->executor_alive}, {"circuit_open", st->circuit_open},
           {"model_version", ms.version}, {"draining_versions", ms.n_retired}};
    if (replicas.size() > 1) j["replicas"] = std::move(rj);
    co_return json_response(ok ? http::status::ok : http::status::service_unavailable, dump(j), ver, keep);
  }

  bool is_ws_upgrade(const request& req) const {
    std::string_view target(req.target().data(), req.target().size());
    return target.substr(0, target.find('?')) == "/v1/ws" && beast::websocket::is_upgrade(req);
  }

  ws_context ws_context_() {
    ws_context c;
    c.models = &models_;
    c.opts = opts_.ws;
    c.request_timeout_s = opts_.request_timeout_s;
    c.stopping = &stopping_;
    c.metrics = &metrics_;
    c.on_start = [this](const std::shared_ptr<actors::generation_stream>& s) { active_.add(s); };
    c.on_end = [this](const std::shared_ptr<actors::generation_stream>& s) { active_.remove(s); };
    return c;
  }

  // Every model's figures, its engine's stats asked on the blocking pool (an engine that does not
  // answer within 2 s is rendered as troupe_engine_up{model=...} 0).
  awaitable<std::vector<metrics_registry::model_figures>> model_figures() {
    co_return co_await asio::co_spawn(
        blocking_,
        [this]() -> awaitable<std::vector<metrics_registry::model_figures>> {
          std::vector<metrics_registry::model_figures> out;
          for (auto& [m, slot] : models_.snapshot()) {
            metrics_registry::model_figures f{m->api.model_id, slot, std::nullopt, m->engine->replicas()};
            try {
              f.engine = m->engine->stats(std::chrono::seconds(2));
            } catch (const std::exception&) {
            }
            out.push_back(std::move(f));
          }
          co_return out;
        },
        asio::use_awaitable);
  }

  // Prometheus text exposition 0.0.4: the HTTP-side metrics plus every model's figures of now.
  awaitable<response> metrics_response(unsigned ver, bool keep) {
    const auto figures = co_await model_figures();
    response res = json_response(http::status::ok, metrics_.render(figures), ver, keep);
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    co_return res;
  }

  // /v1/models: the current version of every model served, troupe's own fields beside OpenAI's.
  json models_list() const {
    json data = json::array();
    for (const auto& m : models_.all()) {
      json e = m->api.models_list()["data"][0];
      e["troupe"] = {{"version", m->version}, {"path", m->path}, {"load_s", m->load_s}};
      data.push_back(std::move(e));
    }
    return json{{"object", "list"}, {"data", std::move(data)}};
  }

  // The operator's model endpoints, run on the blocking pool (a load takes seconds). A member
  // coroutine, not a capturing lambda: its arguments live in its own frame.
  awaitable<json> model_admin_on_pool(std::string path, std::string name, std::string file) {
    if (path == "/admin/models/unload") {
      models_.unload(name);
      co_return json{{"object", "model.unload"}, {"model", name}};
    }
    if (path == "/admin/models/load") {
      const auto m = models_.load(name, file);
      co_return json{{"object", "model.load"}, {"model", m->api.model_id}, {"version", m->version}, {"path", m->path}, {"load_s", m->load_s}};
    }
    const reload_result r = models_.reload(name, file);
    co_return json{{"object", "reload"}, {"model", models_.find(name)->api.model_id}, {"version", r.version},
                   {"previous_version", r.previous}, {"path", r.path}, {"load_s", r.load_s}};
  }

  // POST /admin/reload {"model": NAME, "model_path": FILE}: both optional (the default model; its
  // served file again); the new version is loaded and warmed beside the serving one, then takes
  // new requests while those in flight finish on theirs.
  // POST /admin/models/load {"model": NAME, "model_path": FILE}; POST /admin/models/unload {"model": NAME}.
  awaitable<response> model_admin(const std::string& path, const json& body, unsigned ver, bool keep) {
    if (!body.is_object()) throw bad_param("", "the request body must be a JSON object");
    auto text = [&](const char* key, bool required) {
      auto it = body.find(key);
      if (it == body.end()) {
        if (required) throw bad_param(key, std::string("'") + key + "' is required");
        return std::string();
      }
      if (!it->is_string() || it->get<std::string>().empty()) throw bad_param(key, std::string("'") + key + "' must be a non-empty string");
      return it->get<std::string>();
    };
    const bool load = path == "/admin/models/load", unload = path == "/admin/models/unload";
    const std::string name = text("model", load || unload), file = unload ? std::string() : text("model_path", load);
    if (stopping_) throw api_exception(error_for(actors::gen_error::unavailable, "the server is stopping"));
    try {
      const json j = co_await asio::co_spawn(blocking_, model_admin_on_pool(path, name, file), asio::use_awaitable);
      co_return json_response(http::status::ok, dump(j), ver, keep);
    } catch (const reload_error& e) {
      const char* code = e.status == 409 ? "conflict" : e.status == 404 ? "model_not_found" : e.status == 400 ? "invalid_model" : "load_failed";
      const char* param = e.status == 404 ? "model" : e.status == 400 && !unload ? "model_path" : "";
      throw api_exception(http_error(e.status, e.what(), code, param));
    }
  }

  awaitable<bool> generate(beast::tcp_stream& stream, const completion_request& creq, const served_model& model, unsigned ver, bool keep) {
    if (stopping_) co_return co_await write_response(stream, error_response(error_for(actors::gen_error::unavailable, "the server is stopping"), ver, false));
    // One generation per choice; each feeds the metrics as its events are taken.
    std::vector<std::shared_ptr<actors::generation_stream>> gens;
    std::vector<std::unique_ptr<request_timer>> timers;
    for (int32_t i = 0; i < n_choices(creq); ++i) {
      actors::generation_params gp = choice_params(creq, i);
      gp.deadline_s = opts_.request_timeout_s;
      timers.push_back(std::make_unique<request_timer>(metrics_, (int64_t)gp.prompt.size()));
      gens.push_back(model.engine->submit(std::move(gp)));
    }
    event_waiter events(co_await asio::this_coro::executor, std::move(gens), active_);
    events.watch_client(stream.socket());
    auto observe = [&](const event_waiter::item& it) {
      request_timer& t = *timers[(size_t)it.index];
      if (it.ev.type == actors::stream_event::kind::token) t.on_token();
      else if (it.ev.type == actors::stream_event::kind::done) t.on_done(it.ev);
      else t.on_error();
    };
    // A cancel that is not the client's own is the server stopping.
    auto failure = [this](const actors::stream_event& e) {
      if (e.error == actors::gen_error::cancelled && stopping_) return error_for(actors::gen_error::unavailable, "the server is stopping");
      return error_for(e.error, e.message);
    };
    response_builder rb(creq, model.api);
    std::optional<event_waiter::item> it = co_await events.next();
    if (!it) co_return false;  // the client went away: the waiter's destructor cancels
    observe(*it);
    if (it->ev.type == actors::stream_event::kind::error)  // refused before any token: a plain error
      co_return co_await write_response(stream, error_response(failure(it->ev), ver, keep));

    if (!creq.stream) {
      for (bool first = true;; first = false) {
        if (!first) {
          if (!(it = co_await events.next())) break;
          observe(*it);
        }
        if (it->ev.type == actors::stream_event::kind::token) rb.add(it->index, it->ev);
        else if (it->ev.type == actors::stream_event::kind::done) rb.done(it->index, it->ev);
        else co_return co_await write_response(stream, error_response(failure(it->ev), ver, keep));
      }
      if (events.client_gone()) co_return false;
      co_return co_await write_response(stream, json_response(http::status::ok, dump(rb.finish()), ver, keep));
    }

    // SSE over chunked transfer: headers now, then one chunk per event, flushed as it comes.
    http::response<http::empty_body> head{http::status::ok, ver};
    head.set(http::field::server, "troupe");
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(keep);
    head.chunked(true);
    http::response_serializer<http::empty_body> sr{head};
    // Each write must finish within send_timeout (a client that stops reading is dropped); the
    // timer is disarmed between writes, since the next token may be long in coming (a queue).
    const auto send_timeout = std::chrono::seconds(60);
    metrics_.count_status(200);
    stream.expires_after(send_timeout);
    if (auto [ec, n] = co_await http::async_write_header(stream, sr, nothrow); ec) co_return false;
    stream.expires_never();
    auto send = [&](const std::string& data) -> awaitable<bool> {
      if (data.empty()) co_return true;
      stream.expires_after(send_timeout);
      auto [ec, n] = co_await asio::async_write(stream, http::make_chunk(asio::buffer(data)), nothrow);
      stream.expires_never();
      co_return !ec;
    };
    if (!co_await send(rb.sse_start())) co_return false;  // event_waiter's destructor cancels
    bool failed = false;
    for (bool first = true; !failed; first = false) {
      if (!first) {
        if (!(it = co_await events.next())) break;
        observe(*it);
      }
      std::string data;
      if (it->ev.type == actors::stream_event::kind::token) data = rb.sse_token(it->index, it->ev);
      else if (it->ev.type == actors::stream_event::kind::done) data = rb.sse_done(it->index, it->ev);
      else data = response_builder::sse_error(failure(it->ev));
      if (!co_await send(data)) co_return false;
      failed = it->ev.type == actors::stream_event::kind::error;  // [DONE] sent; the other choices are cancelled
    }
    if (events.client_gone()) co_return false;
    if (!failed && !co_await send(rb.sse_end())) co_return false;
    auto [ec, n] = co_await asio::async_write(stream, http::make_chunk_last(), nothrow);
    stream.expires_never();
    co_return !ec && keep;
  }

  server_options opts_;
  model_registry& models_;
  asio::io_context ioc_;
  tcp::acceptor acceptor_;
  asio::signal_set signals_, hup_;
  std::atomic<int> n_connections_{0};
  std::atomic<bool> stopping_{false};
  int exit_code_ = 0;  // set once, by stop()
  active_set active_;
  metrics_registry metrics_;
  asio::thread_pool blocking_{2};  // calls that wait on the engine (stats)
};

}  // namespace

void device_loss_notice::notify(const std::string& why) {
  std::lock_guard lk(mu_);
  if (!why_.empty()) return;
  why_ = why.empty() ? "the device is lost" : why;
  if (fn_) fn_(why_);  // under the lock: on_notice(nullptr) returns only once no call is running
}

void device_loss_notice::on_notice(std::function<void(const std::string&)> fn) {
  std::lock_guard lk(mu_);
  fn_ = std::move(fn);
  if (fn_ && !why_.empty()) fn_(why_);
}

std::string device_loss_notice::reason() const {
  std::lock_guard lk(mu_);
  return why_;
}

int run_http_server(const server_options& opts, model_registry& models) {
  server s(opts, models);
  return s.run();
}

}  // namespace troupe::net
