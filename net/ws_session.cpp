// One WebSocket connection: a reader (client messages -> submits, cancels), a writer (engine
// events -> a bounded outgoing queue -> frames) and a watchdog (a blocked write -> close 1008), as
// three coroutines on the connection's strand, all sharing one `session`.
//
// Backpressure: the writer takes engine events only while the queue holds less than
// max_queue_bytes, and the reader reads the next client message only then, so the queue never
// exceeds the limit by more than one message per source; events the writer has not taken wait in
// each generation's own bounded stream (max_tokens + 2 events).
#include "net/ws_session.hpp"

#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>

namespace troupe::net {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace websocket = beast::websocket;
using asio::awaitable;
using clock = std::chrono::steady_clock;
constexpr auto nothrow = asio::as_tuple(asio::use_awaitable);

// The safety net of every wait: a missed wake-up costs at most this long.
constexpr auto poll_interval = std::chrono::milliseconds(200);
// After close 1008 was asked for behind a blocked write, the TCP connection is dropped this much later.
constexpr auto close_grace = std::chrono::seconds(2);

std::chrono::milliseconds to_ms(double s) { return std::chrono::milliseconds((int64_t)(s * 1000)); }

// Wakes the writer from an actor thread (a generation's notify callback): marks `pending` and
// cancels the timer through the strand, so a push between "nothing to take" and "wait" is never
// lost: either the flag is seen before waiting, or the posted cancel runs after the wait began.
struct waker : std::enable_shared_from_this<waker> {
  explicit waker(asio::any_io_executor ex) : timer(std::move(ex)) {}
  void notify() {
    pending = true;
    std::lock_guard lk(mu);
    if (alive) asio::post(timer.get_executor(), [self = shared_from_this()] { self->timer.cancel(); });
  }
  void retire() {
    std::lock_guard lk(mu);
    alive = false;
  }
  std::mutex mu;
  bool alive = true;
  std::atomic<bool> pending{false};
  asio::steady_timer timer;  // used on the strand only
};

struct generation {
  std::shared_ptr<const served_model> model;  // the version it runs on, held until it ends (hot reload)
  std::shared_ptr<actors::generation_stream> stream;
  bool logprobs = false;
  actors::priority_class cls = actors::priority_class::normal;  // as last asked by the client
  std::unique_ptr<request_timer> timer;  // its latencies and tokens for /metrics
};

class session : public std::enable_shared_from_this<session> {
 public:
  session(beast::tcp_stream&& s, ws_context ctx)
      : ws_(std::move(s)), ctx_(std::move(ctx)), wake_(std::make_shared<waker>(ws_.get_executor())),
        space_(ws_.get_executor()), writer_exit_(ws_.get_executor()) {}

  awaitable<void> run(beast::http::request<beast::http::string_body> req) {
    auto self = shared_from_this();
    const ws_options& o = ctx_.opts;
    if (o.send_buffer_bytes > 0) {
      beast::error_code ignored;
      beast::get_lowest_layer(ws_).socket().set_option(asio::socket_base::send_buffer_size(o.send_buffer_bytes), ignored);
    }
    beast::get_lowest_layer(ws_).expires_never();  // the websocket stream's own timeouts apply
    auto t = websocket::stream_base::timeout::suggested(beast::role_type::server);
    t.idle_timeout = to_ms(o.idle_timeout_s);
    ws_.set_option(t);
    ws_.set_option(websocket::stream_base::decorator([](websocket::response_type& res) { res.set(beast::http::field::server, "troupe"); }));
    ws_.read_message_max(o.max_message_bytes);
    ws_.text(true);
    if (auto [ec] = co_await ws_.async_accept(req, nothrow); ec) co_return;

    asio::co_spawn(ws_.get_executor(), self->write_loop(), asio::detached);
    asio::co_spawn(ws_.get_executor(), self->watchdog(), asio::detached);
    co_await read_loop();

    // The client is gone, or we closed: every generation still running is cancelled (its KV freed
    // within a step), then the writer is let go of; a write still blocked ends with the socket.
    closing_ = true;
    release_all();
    wake_->timer.cancel();
    space_.cancel();
    const auto give_up = clock::now() + std::chrono::seconds(1);
    while (writer_running_) {
      if (clock::now() > give_up) drop();
      writer_exit_.expires_after(std::chrono::milliseconds(20));
      co_await writer_exit_.async_wait(nothrow);
    }
    drop();
  }

 private:
  // --- client messages ---------------------------------------------------------------------------

  awaitable<void> read_loop() {
    beast::flat_buffer buf;
    for (;;) {
      while (out_bytes_ >= ctx_.opts.max_queue_bytes && !closing_) {  // backpressure: stop reading
        space_.expires_after(poll_interval);
        co_await space_.async_wait(nothrow);
      }
      if (closing_) co_return;
      buf.clear();
      auto [ec, n] = co_await ws_.async_read(buf, nothrow);
      if (ec) co_return;  // closed by the client, a timeout, a reset, a protocol violation
                          // (Beast closes with 1007 for invalid UTF-8, 1009 for a message too big)
      if (!ws_.got_text()) {
        closing_ = true;
        co_await ws_.async_close(websocket::close_reason(websocket::close_code::unknown_data, "binary frames are not supported"), nothrow);
        co_return;
      }
      handle(beast::buffers_to_string(buf.data()));
    }
  }

  void handle(const std::string& text) {
    ws_message m;
    // Parsed and run by one version of the model the message names (an unknown name: the default
    // model's own check refuses it with the socket's error message).
    const json j = json::parse(text, nullptr, false);
    std::string name;
    if (j.is_object())
      if (auto it = j.find("model"); it != j.end() && it->is_string()) name = it->get<std::string>();
    std::shared_ptr<const served_model> model = ctx_.models->find_or_default(name);
    try {
      m = parse_ws_message(j, model->api);
    } catch (const ws_protocol_error& e) {
      // A refused generate ends that generation, unless a live one already has its id.
      const bool final = e.type == "generate" && !gens_.count(e.id);
      enqueue(ws_error(e.id, e.code, e.what(), final, e.param));
      return;
    } catch (const std::exception& e) {
      enqueue(ws_error("", "internal_error", e.what(), false));
      return;
    }
    auto it = gens_.find(m.id);
    switch (m.type) {
      case ws_message::kind::generate: {
        if (it != gens_.end()) return enqueue(ws_error(m.id, "duplicate_id", "a generation with id '" + m.id + "' is still running", false));
        if (ctx_.stopping && *ctx_.stopping) return enqueue(ws_engine_error(m.id, actors::gen_error::unavailable, "the server is stopping"));
        if ((int)gens_.size() >= ctx_.opts.max_generations)
          return enqueue(ws_error(m.id, "too_many_generations", "this socket already runs " + std::to_string(gens_.size()) + " generations (the limit)", true));
        actors::generation_params gp = m.req.gen;
        gp.deadline_s = ctx_.request_timeout_s;
        const int64_t n_prompt = (int64_t)gp.prompt.size();
        auto stream = model->engine->submit(std::move(gp));
        generation g{std::move(model), std::move(stream), m.req.logprobs, m.req.gen.cls, nullptr};
        if (ctx_.metrics) g.timer = std::make_unique<request_timer>(*ctx_.metrics, n_prompt);
        g.stream->set_notify([w = wake_] { w->notify(); });
        if (ctx_.on_start) ctx_.on_start(g.stream);
        gens_.emplace(m.id, std::move(g));
        wake_->timer.cancel();  // an event pushed before set_notify is taken now
        return;
      }
      case ws_message::kind::cancel:
        if (it == gens_.end()) return enqueue(ws_error(m.id, "unknown_id", "no generation with id '" + m.id + "' is running", false));
        it->second.stream->cancel();  // its final event (error "cancelled") follows
        return;
      case ws_message::kind::priority:
        if (it == gens_.end()) return enqueue(ws_error(m.id, "unknown_id", "no generation with id '" + m.id + "' is running", false));
        it->second.cls = m.cls;
        it->second.stream->set_priority(m.cls, 0);  // the scheduler orders it by the new class from its next step
        return enqueue(ws_priority_ack(m.id, m.cls, true));
    }
  }

  // --- engine events and the outgoing queue ------------------------------------------------------

  void enqueue(std::string msg) {
    out_bytes_ += msg.size();
    out_.push_back(std::move(msg));
    wake_->timer.cancel();
  }

  // Moves engine events into the queue while it has room, a few per generation at a time so one
  // fast generation does not starve the others.
  void take_events() {
    constexpr int n_per_turn = 8;
    bool progress = true;
    while (progress && out_bytes_ < ctx_.opts.max_queue_bytes) {
      progress = false;
      for (auto it = gens_.begin(); it != gens_.end() && out_bytes_ < ctx_.opts.max_queue_bytes;) {
        bool ended = false;
        for (int i = 0; i < n_per_turn && out_bytes_ < ctx_.opts.max_queue_bytes; ++i) {
          auto ev = it->second.stream->next(std::chrono::milliseconds(0));
          if (!ev) break;
          progress = true;
          if (request_timer* t = it->second.timer.get()) {
            if (ev->type == actors::stream_event::kind::token) t->on_token();
            else if (ev->type == actors::stream_event::kind::done) t->on_done(*ev);
            else t->on_error();
          }
          if (ev->type == actors::stream_event::kind::token) {
            enqueue(ws_token(it->first, *ev, it->second.logprobs));
            continue;
          }
          if (ev->type == actors::stream_event::kind::done) {
            enqueue(ws_done(it->first, *ev));
          } else if (ev->error == actors::gen_error::cancelled && ctx_.stopping && *ctx_.stopping) {
            enqueue(ws_engine_error(it->first, actors::gen_error::unavailable, "the server is stopping"));
          } else {
            enqueue(ws_engine_error(it->first, ev->error, ev->message));
          }
          ended = true;
          break;
        }
        if (ended) {
          release(it->second);
          it = gens_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  awaitable<void> write_loop() {
    auto self = shared_from_this();
    writer_running_ = true;
    while (!closing_) {
      wake_->pending = false;
      take_events();
      if (out_.empty()) {
        if (wake_->pending) continue;
        wake_->timer.expires_after(poll_interval);
        co_await wake_->timer.async_wait(nothrow);
        continue;
      }
      const std::string msg = std::move(out_.front());
      out_.pop_front();
      write_started_ = clock::now();
      writing_ = true;
      auto [ec, n] = co_await ws_.async_write(asio::buffer(msg), nothrow);
      writing_ = false;
      out_bytes_ -= msg.size();
      if (out_bytes_ < ctx_.opts.max_queue_bytes) space_.cancel();
      if (ec) break;
    }
    closing_ = true;
    space_.cancel();
    writer_running_ = false;
  }

  // A write blocked for send_timeout_s means a client that does not read: its generations are
  // cancelled, close 1008 is queued behind the blocked frame, and the connection is dropped when
  // that close has not gone out close_grace later.
  awaitable<void> watchdog() {
    auto self = shared_from_this();
    asio::steady_timer t(ws_.get_executor());
    const auto limit = to_ms(ctx_.opts.send_timeout_s);
    while (!closing_) {
      t.expires_after(std::min<clock::duration>(poll_interval, limit));
      co_await t.async_wait(nothrow);
      if (closing_ || !writing_ || clock::now() - write_started_ < limit) continue;
      std::fprintf(stderr, "troupe serve: a WebSocket client did not read for %.1f s; closing it (1008)\n", ctx_.opts.send_timeout_s);
      closing_ = true;
      release_all();
      asio::co_spawn(ws_.get_executor(),
                     [self]() -> awaitable<void> {
                       co_await self->ws_.async_close(websocket::close_reason(websocket::close_code::policy_error, "the client does not read"), nothrow);
                     },
                     asio::detached);
      t.expires_after(close_grace);
      co_await t.async_wait(nothrow);
      drop();
    }
  }

  // --- generations and teardown --------------------------------------------------------------------

  void release(generation& g) {
    g.stream->set_notify(nullptr);
    if (!g.stream->finished()) g.stream->cancel();
    if (ctx_.on_end) ctx_.on_end(g.stream);
  }

  void release_all() {
    for (auto& [id, g] : gens_) release(g);
    gens_.clear();
    wake_->retire();
  }

  void drop() {
    beast::error_code ignored;
    beast::get_lowest_layer(ws_).socket().close(ignored);
  }

  websocket::stream<beast::tcp_stream> ws_;
  ws_context ctx_;
  std::shared_ptr<waker> wake_;
  asio::steady_timer space_;        // the reader waits here for room in the queue
  asio::steady_timer writer_exit_;  // teardown waits here for the writer
  std::map<std::string, generation> gens_;  // live generations by client id
  std::deque<std::string> out_;
  size_t out_bytes_ = 0;  // queued plus the frame being written
  bool closing_ = false, writing_ = false, writer_running_ = false;
  clock::time_point write_started_{};
};

}  // namespace

awaitable<void> run_ws_session(beast::tcp_stream stream, beast::http::request<beast::http::string_body> req, ws_context ctx) {
  auto s = std::make_shared<session>(std::move(stream), std::move(ctx));
  co_await s->run(std::move(req));
}

}  // namespace troupe::net
