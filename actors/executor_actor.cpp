// The executor: one per device (here the CPU). The only owner of its KV memory (device pool and
// host swap pool), its thread pool and its forward pass. Spawned detached, so a step's compute
// runs on the executor's own thread, never on CAF's scheduler threads. One step per message.
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include "actors/runtime.hpp"
#include "engine/forward.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::actors {

namespace {

struct executor_state {
  explicit executor_state(const executor_config& c)
      : cfg(c), pool(c.n_threads), device(c.kv, c.n_device_blocks), host(c.kv, c.n_host_blocks > 0 ? c.n_host_blocks : 1),
        fwd(*c.model, device, pool) {}
  executor_config cfg;
  kernels::thread_pool pool;
  engine::kv_storage device, host;
  engine::cpu_forward fwd;
  std::vector<engine::seq_chunk> chunks;
  // The tokens sampled by the last step, for decodes planned ahead (scheduler_core::ahead_token).
  std::unordered_map<uint64_t, engine::token_id> last_sampled, sampling_now;
};

uint64_t mix_seed(uint64_t seed, uint64_t index) {  // splitmix64 of the pair
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void run_copies(executor_state& st, const std::vector<engine::block_copy>& copies) {
  const size_t bytes = (size_t)st.cfg.kv.block_bytes();
  for (const auto& c : copies) {
    using k = engine::block_copy::kind;
    engine::kv_storage& src = c.dir == k::host_to_device ? st.host : st.device;
    engine::kv_storage& dst = c.dir == k::device_to_host ? st.host : st.device;
    if (c.src < 0 || c.src >= src.n_blocks() || c.dst < 0 || c.dst >= dst.n_blocks())
      throw std::logic_error("executor: block copy out of range");
    std::memcpy(dst.block_data(c.dst), src.block_data(c.src), bytes);
  }
}

}  // namespace

caf::behavior executor_actor(caf::event_based_actor* self, executor_config cfg) {
  auto st = std::make_shared<executor_state>(cfg);
  return {
      [=](step_atom, step_work& w) -> step_output {
        const auto t0 = std::chrono::steady_clock::now();
        run_copies(*st, w.copies);
        step_output out;
        out.step = w.step;
        if (w.batch.empty()) return out;
        // Decodes planned ahead take the token this executor sampled for them in the step before.
        std::unordered_map<uint64_t, engine::token_id> fed;
        for (auto& e : w.batch)
          if (e.tokens.size() == 1 && e.tokens[0] == ahead_token) {
            auto it = st->last_sampled.find(e.seq);
            if (it == st->last_sampled.end()) throw std::logic_error("executor: a decode planned ahead has no token from the step before");
            e.tokens[0] = it->second;
            fed.emplace(e.seq, it->second);
          }
        st->chunks.clear();
        for (const auto& e : w.batch) st->chunks.push_back({e.tokens, e.pos0, e.block_table, false, !e.need_logits});
        if (w.inject_fault) throw std::runtime_error("injected executor fault");
        const std::vector<float>& logits = st->fwd.forward(st->chunks);
        const int n_vocab = cfg.model->hparams().n_vocab;
        std::vector<float> row((size_t)n_vocab);
        size_t si = 0;
        for (size_t i = 0; i < w.batch.size(); ++i) {
          if (!w.batch[i].need_logits) continue;
          const sample_spec& sp = w.sampling.at(si);
          if (sp.seq != w.batch[i].seq) throw std::logic_error("executor: sampling specs out of order");
          std::memcpy(row.data(), logits.data() + si * (size_t)n_vocab, sizeof(float) * (size_t)n_vocab);
          ++si;
          engine::sampling_params p = *sp.params;
          p.seed = mix_seed(p.seed, sp.draw_index);
          p.has_seed = true;
          engine::sampler smp(p);
          std::vector<engine::token_id> history_fed;
          std::span<const engine::token_id> history = sp.history;
          if (auto f = fed.find(sp.seq); f != fed.end() && !sp.history.empty()) {
            history_fed = sp.history;
            history_fed.push_back(f->second);
            history = history_fed;
          }
          out.tokens.push_back({sp.seq, smp.sample(row, history)});
          st->sampling_now[sp.seq] = out.tokens.back().r.token;
        }
        std::swap(st->last_sampled, st->sampling_now);
        st->sampling_now.clear();
        out.compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return out;
      },
  };
}

}  // namespace troupe::actors
