// `troupe bench`: prefill and decode throughput of the CPU engine at a given prompt length,
// generation length, batch size and thread count (in the spirit of llama-bench's pp/tg tests).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "engine/forward.hpp"
#include "kernels/matmul.hpp"
#include "kernels/thread_pool.hpp"
#include "net/cli.hpp"
#include "net/cli_load.hpp"

namespace troupe::cli {

namespace {

struct bench_opts {
  config::engine_config engine;
  int prompt_len = 512, gen_len = 128, batch = 1, reps = 3;
  int concurrency = 0, requests = 0;
  bool json = false;
  bool no_plan_ahead = false;
  double target_itl_ms = 0;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_bench(bench_opts& o) {
  if (o.concurrency > 0) {
#ifdef TROUPE_HAVE_ACTORS
    load_opts l{o.engine, o.concurrency, o.requests > 0 ? o.requests : 4 * o.concurrency, o.prompt_len, o.gen_len, o.json, !o.no_plan_ahead, o.target_itl_ms};
    return run_load_bench(l);
#else
    throw std::runtime_error("--concurrency needs the actor runtime: this build has no CAF (TROUPE_SERVICE=OFF)");
#endif
  }
  if (o.prompt_len < 1 || o.gen_len < 0 || o.batch < 1 || o.reps < 1)
    throw std::runtime_error("--prompt-len and --batch must be >= 1, --gen-len >= 0, --reps >= 1");
  auto m = load_model(o.engine);
  const auto& hp = m->hparams();
  const int64_t per_seq = (int64_t)o.prompt_len + o.gen_len;
  const int n_ctx = o.engine.n_ctx > 0 ? o.engine.n_ctx : hp.n_ctx_train;
  if (per_seq > n_ctx)
    throw std::runtime_error("prompt-len + gen-len = " + std::to_string(per_seq) + " exceeds the context of " + std::to_string(n_ctx));
  const int bs = o.engine.kv_block_size;
  const int32_t blocks_per_seq = engine::kv_blocks_for(per_seq, bs);
  kernels::thread_pool pool(o.engine.n_threads);
  engine::kv_storage kv({hp.n_layers, hp.n_kv_heads, hp.head_dim, bs}, blocks_per_seq * o.batch);
  engine::cpu_forward fwd(*m, kv, pool);

  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> pick(0, m->vocab().n_vocab() - 1);
  std::vector<std::vector<int32_t>> prompts(o.batch), tables(o.batch);
  for (int s = 0; s < o.batch; ++s) {
    for (int i = 0; i < o.prompt_len; ++i) prompts[s].push_back(pick(rng));
    for (int32_t b = 0; b < blocks_per_seq; ++b) tables[s].push_back(s * blocks_per_seq + b);
  }

  std::vector<double> pp, tg;
  for (int rep = 0; rep <= o.reps; ++rep) {  // rep 0 warms up
    // Prefill: all prompts, chunks of at most n_batch tokens per step.
    const double t0 = now_s();
    std::vector<int32_t> last(o.batch);
    for (int s = 0; s < o.batch; ++s)
      for (int p = 0; p < o.prompt_len; p += o.engine.n_batch) {
        const int len = std::min(o.engine.n_batch, o.prompt_len - p);
        engine::seq_chunk c{std::span(prompts[s]).subspan(p, len), p, tables[s], false};
        const auto& l = fwd.forward(std::span(&c, 1));
        last[s] = (int32_t)(std::max_element(l.begin(), l.begin() + hp.n_vocab) - l.begin());
      }
    const double t1 = now_s();
    // Decode: gen_len steps of one token per sequence, greedy.
    std::vector<engine::seq_chunk> batch(o.batch);
    for (int step = 0; step < o.gen_len; ++step) {
      for (int s = 0; s < o.batch; ++s) batch[s] = {std::span(&last[s], 1), o.prompt_len + step, tables[s], false};
      const auto& l = fwd.forward(batch);
      for (int s = 0; s < o.batch; ++s)
        last[s] = (int32_t)(std::max_element(l.begin() + (ptrdiff_t)s * hp.n_vocab, l.begin() + (ptrdiff_t)(s + 1) * hp.n_vocab) -
                            (l.begin() + (ptrdiff_t)s * hp.n_vocab));
    }
    const double t2 = now_s();
    if (rep > 0) {
      pp.push_back((double)o.batch * o.prompt_len / (t1 - t0));
      if (o.gen_len > 0) tg.push_back((double)o.batch * o.gen_len / (t2 - t1));
    }
  }
  const double pp_tps = median(pp), tg_tps = tg.empty() ? 0.0 : median(tg);
  const double gb_per_step = (double)m->weight_bytes_per_token() / 1e9;
  const double eff_bw = tg_tps > 0 ? gb_per_step * tg_tps / o.batch : 0.0;  // weight GB/s during decode
  if (o.json) {
    std::printf("{\"model\":\"%s\",\"threads\":%d,\"isa\":\"%s\",\"prompt_len\":%d,\"gen_len\":%d,\"batch\":%d,"
                "\"prefill_tok_s\":%.2f,\"decode_tok_s\":%.2f,\"weight_gb_per_step\":%.4f,\"decode_weight_gb_s\":%.2f}\n",
                hp.name.c_str(), pool.size(), kernels::matmul_isa(), o.prompt_len, o.gen_len, o.batch, pp_tps, tg_tps,
                gb_per_step, eff_bw);
  } else {
    std::printf("model %s | threads %d | isa %s | batch %d\n", hp.name.c_str(), pool.size(), kernels::matmul_isa(), o.batch);
    std::printf("prefill  pp%-5d %10.1f tok/s\n", o.prompt_len, pp_tps);
    std::printf("decode   tg%-5d %10.1f tok/s   (%.1f GB/s of weights, %.1f MB per step)\n", o.gen_len, tg_tps, eff_bw,
                gb_per_step * 1e3);
  }
  return 0;
}

}  // namespace

action add_bench(CLI::App& app) {
  auto o = std::make_shared<bench_opts>();
  CLI::App* cmd = app.add_subcommand("bench", "measure prefill and decode tokens/s");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--prompt-len", o->prompt_len, "prompt tokens per sequence")->capture_default_str();
  cmd->add_option("--gen-len", o->gen_len, "generated tokens per sequence")->capture_default_str();
  cmd->add_option("--batch", o->batch, "sequences decoded together")->capture_default_str();
  cmd->add_option("--reps", o->reps, "measured repetitions (median reported; one warm-up first)")->capture_default_str();
  cmd->add_flag("--json", o->json, "one JSON line");
  cmd->add_option("--concurrency", o->concurrency,
                  "serving benchmark: N concurrent closed-loop streams through the actor runtime (0: engine only)");
  cmd->add_option("--requests", o->requests, "requests in the serving benchmark (default 4 x concurrency)");
  cmd->add_option("--device", o->engine.device, "serving benchmark: executor device (cpu, cuda, cuda:N)")->capture_default_str();
  cmd->add_option("--cuda-graphs", o->engine.cuda_graphs, "serving benchmark, device cuda: decode steps from CUDA graphs (true/false)")
      ->capture_default_str();
  cmd->add_option("--cuda-fused-decode", o->engine.cuda_fused_decode,
                  "serving benchmark, device cuda: the fused decode launches (true/false)")
      ->capture_default_str();
  cmd->add_option("--target-itl-ms", o->target_itl_ms, "serving benchmark: the scheduler's inter-token latency target (0: off)")
      ->capture_default_str();
  cmd->add_flag("--no-plan-ahead", o->no_plan_ahead, "serving benchmark: one step in flight (no pipelining), for comparison");
  return [o] { return run_bench(*o); };
}

}  // namespace troupe::cli
