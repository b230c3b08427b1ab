#include "net/model_slot.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <filesystem>
#include <set>
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

// Runs `build` (loading a model from `path`) with its failures as reload_error: 400 for a path
// that is not a model file the engine can serve, 500 for one that fails to start; a
// reload_error (a failed warm-up) as it is.
template <class F>
auto load_or_refuse(const std::string& path, F&& build) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw reload_error(400, "'" + path + "' is not a readable regular file");
  try {
    return build();
  } catch (const reload_error&) {
    throw;
  } catch (const engine::gguf_error& e) {
    throw reload_error(400, std::string("cannot load '") + path + "': " + e.what());
  } catch (const std::invalid_argument& e) {
    throw reload_error(400, std::string("cannot serve '") + path + "': " + e.what());
  } catch (const std::exception& e) {
    throw reload_error(500, std::string("cannot start '") + path + "': " + e.what());
  }
}

}  // namespace

model_slot::model_slot(loader load, const std::string& path, model_slot_options opts, std::string name,
                       std::vector<std::string> aliases)
    : load_(std::move(load)),
      opts_(opts),
      name_(name.empty() ? std::filesystem::path(path).stem().string() : std::move(name)),
      aliases_(std::move(aliases)) {
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
  m->api.aliases.insert(m->api.aliases.end(), aliases_.begin(), aliases_.end());
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
  if (!old) throw reload_error(404, "the model '" + name_ + "' was unloaded");
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
  std::shared_ptr<served_model> next;
  try {
    next = load_or_refuse(path, [&] { return build(path); });
  } catch (const reload_error& e) {
    throw refuse(e.status, e.what());
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
  if (next->on_current) {
    try {
      next->on_current(*old);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe serve: version %llu: %s\n", (unsigned long long)r.version, e.what());
    }
  }
  std::fprintf(stderr, "troupe serve: version %llu (%s) serving after %.2f s; version %llu finishes what it holds\n",
               (unsigned long long)r.version, path.c_str(), r.load_s, (unsigned long long)r.previous);
  return r;
}

model_slot_stats model_slot::stats() const {
  std::lock_guard lk(mu_);
  return {current_ ? current_->version : 0, reloads_ok_, reloads_failed_, retired_.size()};
}

void model_slot::close() {
  {
    std::lock_guard busy(reload_mu_);  // after a reload in flight
    std::lock_guard lk(mu_);
    if (!current_) return;
    retired_.push_back({std::move(current_), clock::now() + std::chrono::milliseconds((int64_t)(opts_.drain_timeout_s * 1000))});
    current_.reset();
  }
  cv_.notify_all();
}

bool model_slot::drained() const {
  std::lock_guard lk(mu_);
  return !current_ && retired_.empty();
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
    // A version fronts reach runs generations no local request holds: ask its engine whether
    // anything runs (a bounded wait, without the lock).
    std::vector<std::shared_ptr<served_model>> ask;
    for (const auto& r : retired_)
      if (r.m->serves_remote && !r.ended && r.m.use_count() == 1) ask.push_back(r.m);
    std::set<const served_model*> busy;
    if (!ask.empty()) {
      lk.unlock();
      for (const auto& m : ask)
        if (m->engine->busy()) busy.insert(m.get());
      ask.clear();
      lk.lock();
      if (stop_) break;
    }
    std::vector<std::shared_ptr<served_model>> done;
    for (auto it = retired_.begin(); it != retired_.end();) {
      // Nobody else can take it again (it is not current), and no front's generation runs on it.
      if (it->m.use_count() == 1 && !busy.count(it->m.get())) {
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
#ifdef __GLIBC__
    if (!done.empty()) malloc_trim(0);  // a version's freed heap (repacked weights, scratch) back to the system
#endif
    done.clear();
    lk.lock();
    cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stop_; });
  }
}

// --- model_registry ------------------------------------------------------------------------------

namespace {

bool valid_name(const std::string& n) {
  if (n.empty() || n.size() > 128) return false;
  for (char c : n)
    if (!(std::isalnum((unsigned char)c) || c == '.' || c == '_' || c == '-' || c == ':' || c == '/')) return false;
  return true;
}

}  // namespace

model_registry::model_registry(model_slot::loader load, const std::string& path, model_slot_options opts, size_t max_models,
                               model_slot::loader load_default)
    : load_(std::move(load)), opts_(opts), max_models_(std::max<size_t>(1, max_models)) {
  slots_.push_back(std::make_unique<model_slot>(load_default ? std::move(load_default) : load_, path, opts_, "", std::vector<std::string>{"default"}));
  default_ = slots_.front()->name();
}

model_registry::~model_registry() = default;  // each slot ends its retired versions and joins its thread

model_slot* model_registry::slot_locked(const std::string& name) const {
  if (name.empty()) return slots_.front().get();
  for (const auto& s : slots_)
    if (s->name() == name) return s.get();
  for (const auto& s : slots_) {
    auto m = s->current();
    for (const auto& a : m->api.aliases)
      if (a == name) return s.get();
  }
  return nullptr;
}

std::shared_ptr<const served_model> model_registry::find(const std::string& name) const {
  std::lock_guard lk(mu_);
  if (model_slot* s = slot_locked(name)) return s->current();
  std::string ids;
  for (const auto& s : slots_) ids += (ids.empty() ? "'" : ", '") + s->name() + "'";
  throw api_exception(http_error(404, "the model '" + name + "' does not exist; this server serves " + ids, "model_not_found", "model"));
}

std::shared_ptr<const served_model> model_registry::find_or_default(const std::string& name) const {
  std::lock_guard lk(mu_);
  model_slot* s = slot_locked(name);
  return (s ? s : slots_.front().get())->current();
}

std::vector<std::shared_ptr<const served_model>> model_registry::all() const {
  std::lock_guard lk(mu_);
  std::vector<std::shared_ptr<const served_model>> out;
  for (const auto& s : slots_) out.push_back(s->current());
  return out;
}

// One load, unload or reload at a time; a second is refused (409) rather than queued behind a load.
std::unique_lock<std::mutex> model_registry::one_at_a_time() {
  std::unique_lock<std::mutex> one(load_mu_, std::try_to_lock);
  if (!one.owns_lock()) throw reload_error(409, "another model load, unload or reload is in progress");
  return one;
}

std::vector<std::pair<std::shared_ptr<const served_model>, model_slot_stats>> model_registry::snapshot() const {
  std::lock_guard lk(mu_);
  std::vector<std::pair<std::shared_ptr<const served_model>, model_slot_stats>> out;
  for (const auto& s : slots_) out.emplace_back(s->current(), s->stats());
  return out;
}

std::shared_ptr<const served_model> model_registry::load(const std::string& name, const std::string& path) {
  auto one = one_at_a_time();
  sweep();
  if (!valid_name(name)) throw reload_error(400, "a model name is 1-128 characters of letters, digits and . _ - : /");
  {
    std::lock_guard lk(mu_);
    if (slot_locked(name)) throw reload_error(409, "a model named '" + name + "' is already served");
    if (slots_.size() >= max_models_)
      throw reload_error(507, std::to_string(slots_.size()) + " models are loaded, the most this server holds (--max-models)");
  }
  std::unique_ptr<model_slot> slot = load_or_refuse(path, [&] { return std::make_unique<model_slot>(load_, path, opts_, name); });
  auto m = slot->current();
  {
    std::lock_guard lk(mu_);
    slots_.push_back(std::move(slot));
  }
  std::fprintf(stderr, "troupe serve: model '%s' (%s) loaded in %.2f s\n", name.c_str(), path.c_str(), m->load_s);
  return m;
}

void model_registry::unload(const std::string& name) {
  auto one = one_at_a_time();
  std::unique_ptr<model_slot> slot;
  {
    std::lock_guard lk(mu_);
    for (auto it = slots_.begin(); it != slots_.end(); ++it)
      if ((*it)->name() == name) {
        if (it == slots_.begin()) throw reload_error(400, "'" + name + "' is the default model: reload it instead of unloading it");
        slot = std::move(*it);
        slots_.erase(it);
        break;
      }
  }
  if (!slot) throw reload_error(404, "no model named '" + name + "' is served");
  slot->close();
  closing_.push_back(std::move(slot));
  std::fprintf(stderr, "troupe serve: model '%s' unloaded: it takes no new requests and finishes what it holds\n", name.c_str());
  sweep();
}

reload_result model_registry::reload(const std::string& name, const std::string& path) {
  auto one = one_at_a_time();  // unload() takes it too: the slot stays while it reloads
  model_slot* s;
  {
    std::lock_guard lk(mu_);
    s = slot_locked(name);
  }
  if (!s) throw reload_error(404, "no model named '" + name + "' is served");
  return s->reload(path);
}

void model_registry::sweep() {
  std::erase_if(closing_, [](const std::unique_ptr<model_slot>& s) { return s->drained(); });
}

model_slot_stats model_registry::stats() const {
  std::lock_guard lk(mu_);
  model_slot_stats s = slots_.front()->stats();
  s.n_models = slots_.size();
  return s;
}

size_t model_registry::n_models() const {
  std::lock_guard lk(mu_);
  return slots_.size();
}

}  // namespace troupe::net
