#include "net/model_slot.hpp"

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"

namespace troupe::net {

namespace {

using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

// One greedy token through the new version: its executor has run a step (weights touched, kernels
// chosen) and it produces tokens before any client is sent to it.
void warm_up(served_model& m, double timeout_s) {
  const engine::tokenizer& tok = *m.api.tok;
  actors::generation_params gp;
  gp.prompt = tok.encode("Hello", true, false);
  if (gp.prompt.empty()) gp.prompt.push_back(0);
  gp.max_tokens = 1;
  gp.sampling.temperature = 0;
  gp.deadline_s = timeout_s;
  auto s = m.engine->submit(std::move(gp));
  const auto end = clock::now() + std::chrono::milliseconds((int64_t)(timeout_s * 1000));
  while (clock::now() < end) {
    auto ev = s->next(std::chrono::milliseconds(200));
    if (!ev || ev->type == actors::stream_event::kind::token) continue;
    if (ev->type == actors::stream_event::kind::done) return;
    throw reload_error(500, "the new version failed its warm-up generation: " + ev->message);
  }
  s->cancel();
  std::ostringstream msg;
  msg << "the new version did not finish its warm-up generation within " << timeout_s << " s";
  throw reload_error(500, msg.str());
}

}  // namespace

model_slot::model_slot(loader load, const std::string& path, model_slot_options opts)
    : load_(std::move(load)), opts_(opts), name_(std::filesystem::path(path).stem().string()) {
  current_ = build(path);
  current_->version = 1;
  reaper_ = std::thread([this] { reaper(); });
}

model_slot::~model_slot() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reaper_.join();
  // Whoever still holds a version keeps it alive; its engine ends when the last holder lets go.
  for (auto& r : retired_) r.m->engine->fail_all("the server is stopping");
}

std::shared_ptr<served_model> model_slot::build(const std::string& path) {
  const auto t0 = clock::now();
  std::shared_ptr<served_model> m = load_(path);
  m->path = path;
  // The served name stays the one clients were given; the new file's own names are aliases.
  const std::string stem = std::filesystem::path(path).stem().string();
  if (stem != name_) m->api.aliases.insert(m->api.aliases.begin(), stem);
  m->api.model_id = name_;
  warm_up(*m, opts_.warmup_timeout_s);
  m->load_s = seconds_since(t0);
  return m;
}

std::shared_ptr<const served_model> model_slot::current() const {
  std::lock_guard lk(mu_);
  return current_;
}

reload_result model_slot::reload(const std::string& requested) {
  std::unique_lock busy(reload_mu_, std::try_to_lock);
  if (!busy.owns_lock()) throw reload_error(409, "a reload is already in progress");
  std::shared_ptr<served_model> old;
  {
    std::lock_guard lk(mu_);
    old = current_;
  }
  const std::string path = requested.empty() ? old->path : requested;
  auto refuse = [&](int status, const std::string& why) -> reload_error {
    {
      std::lock_guard lk(mu_);
      ++reloads_failed_;
    }
    std::fprintf(stderr, "troupe serve: reload of %s refused: %s; version %llu keeps serving\n", path.c_str(), why.c_str(),
                 (unsigned long long)old->version);
    return reload_error(status, why);
  };
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw refuse(400, "'" + path + "' is not a readable regular file");
  std::shared_ptr<served_model> next;
  try {
    next = build(path);
  } catch (const reload_error& e) {
    throw refuse(e.status, e.what());
  } catch (const engine::gguf_error& e) {
    throw refuse(400, std::string("cannot load '") + path + "': " + e.what());
  } catch (const std::invalid_argument& e) {
    throw refuse(400, std::string("cannot serve '") + path + "': " + e.what());
  } catch (const std::exception& e) {
    throw refuse(500, std::string("cannot start '") + path + "': " + e.what());
  }
  reload_result r;
  {
    std::lock_guard lk(mu_);
    next->version = old->version + 1;
    r = {next->version, old->version, path, next->load_s};
    current_ = next;
    retired_.push_back({old, clock::now() + std::chrono::milliseconds((int64_t)(opts_.drain_timeout_s * 1000))});
    ++reloads_ok_;
  }
  cv_.notify_all();
  std::fprintf(stderr, "troupe serve: version %llu (%s) serving after %.2f s; version %llu finishes what it holds\n",
               (unsigned long long)r.version, path.c_str(), r.load_s, (unsigned long long)r.previous);
  return r;
}

model_slot_stats model_slot::stats() const {
  std::lock_guard lk(mu_);
  return {current_->version, reloads_ok_, reloads_failed_, retired_.size()};
}

// Every 50 ms while versions are retired: one that only this slot holds is destroyed here (never
// on an I/O thread: its engine joins its executor); one past its drain deadline has its
// generations ended, so their holders let go soon after.
void model_slot::reaper() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    if (retired_.empty()) {
      cv_.wait(lk, [&] { return stop_ || !retired_.empty(); });
      continue;
    }
    std::vector<std::shared_ptr<served_model>> done;
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (it->m.use_count() == 1) {  // nobody else can take it again: it is not current
        done.push_back(std::move(it->m));
        it = retired_.erase(it);
        continue;
      }
      if (!it->ended && clock::now() >= it->deadline) {
        it->ended = true;
        std::fprintf(stderr, "troupe serve: version %llu still runs generations after the drain timeout (%.0f s); ending them\n",
                     (unsigned long long)it->m->version, opts_.drain_timeout_s);
        it->m->engine->fail_all("version " + std::to_string(it->m->version) + " was replaced and its drain timeout ran out");
      }
      ++it;
    }
    lk.unlock();
    for (auto& m : done) {
      const uint64_t v = m->version;
      m.reset();  // stops its actors and executor
      std::fprintf(stderr, "troupe serve: version %llu drained and unloaded\n", (unsigned long long)v);
    }
    done.clear();
    lk.lock();
    cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stop_; });
  }
}

}  // namespace troupe::net
