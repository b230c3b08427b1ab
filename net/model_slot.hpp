// The served models and their versions: hot reload without failed requests, models added and
// removed while serving (the model registry of docs/architecture.md). A model_slot is one model
// (its versions); model_registry (below) routes names to slots.
//
//   model_slot slot(load, path, opts);        // loads and warms version 1
//   auto m = slot.current();                  // a request holds its version until it ends
//   m->engine->submit(...); m->api.tok ...    // tokenizer, template and engine of one version
//   slot.reload("new.gguf");                  // loads + warms version 2, then switches to it
//
// A reload builds the new version beside the serving one (its own actors, executor and KV pools),
// runs one warm-up generation through it, and only then makes it current: requests that arrive
// during the load go to the old version, those after the switch to the new one. The old version is
// retired: it admits what is submitted to it still (a request that took it just before the
// switch) and finishes every generation it holds; it is destroyed once no request holds it, on the
// slot's own thread. A retired version that still runs generations after `drain_timeout_s` has
// them ended with an error ("unavailable") — the one way a reload can fail a request, by the
// operator's limit. A version that fails to load or warm is dropped and the old one keeps serving.
//
// No Boost here; the HTTP and WebSocket layers hold `std::shared_ptr<const served_model>`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <map>
#include <thread>
#include <vector>

#include "actors/engine_handle.hpp"
#include "net/openai_api.hpp"

namespace troupe::net {

/// One loaded version of the served model: its engine and what the API layer knows of it (the
/// tokenizer pointer in `api` points into `engine`'s model, so `engine` is declared first).
struct served_model {
  std::unique_ptr<actors::engine_handle> engine;
  api_context api;
  std::string path;       // the GGUF file it was loaded from
  uint64_t version = 0;   // 1 for the model loaded at start, +1 per successful reload
  double load_s = 0;      // loading, starting the executor and the warm-up generation
  // Published for fronts (data parallel): generations from other processes run on it that no
  // local request holds, so a retired version is unloaded only once its engine is idle too.
  bool serves_remote = false;
  // Called once this version is current, with the version it replaced (still loaded): e.g. takes
  // over the published port. An exception is logged; the switch stands.
  std::function<void(served_model& old)> on_current;
};

struct model_slot_options {
  double drain_timeout_s = 600;  // a retired version's generations are ended after this long
  double warmup_timeout_s = 120; // the warm-up generation of a new version must finish within it
};

/// Why a reload was refused; the HTTP layer sends `status` (400 bad file, 409 busy, 500 other).
struct reload_error : std::runtime_error {
  reload_error(int status, const std::string& what) : std::runtime_error(what), status(status) {}
  int status;
};

struct reload_result {
  uint64_t version = 0, previous = 0;
  std::string path;
  double load_s = 0;
};

/// Figures for /metrics.
struct model_slot_stats {
  uint64_t version = 0;
  uint64_t reloads_ok = 0, reloads_failed = 0;
  size_t n_retired = 0;  // retired versions still held by requests (draining)
  size_t n_models = 1;   // models served (model_registry)
};

class model_slot {
 public:
  /// Builds one version from a GGUF path: loads the model, starts its engine, fills `api` (the
  /// served name is then set by the slot). Throws on a bad file or option.
  using loader = std::function<std::unique_ptr<served_model>(const std::string& path)>;

  /// Loads version 1 (throws what the loader throws). `name`: the served model id ("": the file
  /// stem); `aliases`: further names every version answers to.
  model_slot(loader load, const std::string& path, model_slot_options opts, std::string name = "",
             std::vector<std::string> aliases = {});
  /// Ends the retired versions' generations and destroys every version.
  ~model_slot();
  model_slot(const model_slot&) = delete;
  model_slot& operator=(const model_slot&) = delete;

  /// The version new requests go to.
  std::shared_ptr<const served_model> current() const;

  /// Loads `path` (empty: the current version's file again), warms it and makes it current.
  /// Blocks for the load. Throws reload_error: 409 while another reload runs, 400 when the file
  /// is missing, not a regular file, or not a model the engine can serve (the old version keeps
  /// serving), 500 when the new version fails its warm-up.
  reload_result reload(const std::string& path);

  model_slot_stats stats() const;

  /// Unloading: the current version is retired like a replaced one (its generations finish, or end
  /// after drain_timeout_s); current() returns null from now on.
  void close();
  /// After close(): every version is gone.
  bool drained() const;
  const std::string& name() const { return name_; }

 private:
  void reaper();
  std::shared_ptr<served_model> build(const std::string& path);

  loader load_;
  model_slot_options opts_;
  std::string name_;                 // the served model id, kept across reloads
  std::vector<std::string> aliases_;
  std::mutex reload_mu_;             // one reload at a time (try_lock: a second gets 409)
  mutable std::mutex mu_;            // current_, retired_, counters
  std::condition_variable cv_;
  std::shared_ptr<served_model> current_;
  struct retired {
    std::shared_ptr<served_model> m;
    std::chrono::steady_clock::time_point deadline;
    bool ended = false;  // its generations were ended at the deadline
  };
  std::vector<retired> retired_;
  uint64_t reloads_ok_ = 0, reloads_failed_ = 0;
  bool stop_ = false;
  std::thread reaper_;  // destroys retired versions no request holds any more
};

/// The models `troupe serve` serves, by name: the one it started with (the default: requests
/// that name no model, or "default", go to it) and those an operator loaded since
/// (POST /admin/models/load). Each is a model_slot (its versions, hot reload). Unloading one
/// (POST /admin/models/unload) stops routing to it at once; what it runs finishes (or is ended
/// after drain_timeout_s) and its engine is destroyed on the slot's thread.
class model_registry {
 public:
  /// Loads the default model (throws what the loader throws) with `load_default` (null: `load`),
  /// which builds its versions; `load` builds those of the models loaded later.
  model_registry(model_slot::loader load, const std::string& path, model_slot_options opts, size_t max_models,
                 model_slot::loader load_default = nullptr);
  ~model_registry();

  /// The current version of the model whose id or alias is `name` ("": the default). Throws
  /// api_exception 404 naming the served models when there is none.
  std::shared_ptr<const served_model> find(const std::string& name) const;
  /// As find(), but the default model for an unknown name (its own check then refuses the name).
  std::shared_ptr<const served_model> find_or_default(const std::string& name) const;
  /// The current version of every model, the default first.
  std::vector<std::shared_ptr<const served_model>> all() const;
  /// Every model's current version with its slot's figures, the default first.
  std::vector<std::pair<std::shared_ptr<const served_model>, model_slot_stats>> snapshot() const;

  /// Loads `path` as a new model `name` (blocks for the load). reload_error: 400 a bad name or
  /// file, 409 the name is taken, 507 max_models are loaded, 500 it failed to start.
  std::shared_ptr<const served_model> load(const std::string& name, const std::string& path);
  /// Stops serving `name`. reload_error: 404 unknown, 400 the default model.
  void unload(const std::string& name);
  /// Hot reload of `name` ("": the default), as model_slot::reload; 404 unknown. Loads, unloads
  /// and reloads run one at a time: another one meanwhile gets 409.
  reload_result reload(const std::string& name, const std::string& path);

  /// The default model's figures, and how many models are loaded.
  model_slot_stats stats() const;
  size_t n_models() const;

 private:
  model_slot* slot_locked(const std::string& name) const;  // id first, then aliases; null: none
  void sweep();                                            // destroys closed slots that drained
  std::unique_lock<std::mutex> one_at_a_time();            // load_mu_, or reload_error 409

  model_slot::loader load_;
  model_slot_options opts_;
  size_t max_models_;
  std::string default_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<model_slot>> slots_;    // the default first
  std::vector<std::unique_ptr<model_slot>> closing_;  // unloaded, still draining
  std::mutex load_mu_;                                // one load, unload or reload at a time
};

}  // namespace troupe::net
