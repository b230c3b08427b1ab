// The served model and its versions: hot reload without failed requests (the model registry of
// docs/architecture.md, for the one model `troupe serve` serves).
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
};

class model_slot {
 public:
  /// Builds one version from a GGUF path: loads the model, starts its engine, fills `api` (the
  /// served name is then set by the slot). Throws on a bad file or option.
  using loader = std::function<std::unique_ptr<served_model>(const std::string& path)>;

  /// Loads version 1 (throws what the loader throws).
  model_slot(loader load, const std::string& path, model_slot_options opts);
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

 private:
  void reaper();
  std::shared_ptr<served_model> build(const std::string& path);

  loader load_;
  model_slot_options opts_;
  std::string name_;                 // the served model id: version 1's file stem, kept across reloads
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

}  // namespace troupe::net
