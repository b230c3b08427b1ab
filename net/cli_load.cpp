// `troupe bench --concurrency N`: the serving runtime under a closed-loop load of N concurrent
// streams through the in-process engine handle (actors, continuous batching): aggregate decode
// tokens/s and TTFT / inter-token / end-to-end latency percentiles, next to the memory-bound
// roofline of a step at the batch size reached: on the CPU the weights as the file holds them over
// the host's copy rate (and the int8 kernels' compute rate), on a CUDA device the weights in the
// form it reads them at that batch (a quantized file's blocks up to gemv_max_batch rows, bf16
// above and for a dummy model; the executor's backend reports it) over the device's copy rate,
// measured before the engine starts.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "actors/engine_handle.hpp"
#include "engine/device_module.hpp"
#include "engine/model.hpp"
#include "kernels/matmul.hpp"
#include "kernels/thread_pool.hpp"
#include "net/cli.hpp"
#include "net/cli_load.hpp"

namespace troupe::cli {

namespace {

using clk = std::chrono::steady_clock;

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, (size_t)(p / 100.0 * (double)v.size()));
  return v[i];
}

double copy_bandwidth_gbs() {  // read + write bytes of a large memcpy, best of 5
  const size_t n = 256u << 20;
  std::vector<char> a(n, 1), b(n);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = clk::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(clk::now() - t0).count();
    best = std::max(best, 2.0 * (double)n / s / 1e9);
  }
  return best + (double)b[n / 2] * 0;  // keep b alive
}

// Multiply-add throughput of the int8 kernels on the model's largest layer matrix with 64
// activation rows, GFLOP/s: the compute ceiling of a decode step.
double kernel_gflops(const engine::model& m, int n_threads) {
  const auto& w = m.layer(0).expert_gate.empty() ? m.layer(0).w_gate : m.layer(0).expert_gate[0];
  const int64_t rows = 64;
  std::vector<float> x((size_t)(rows * w.n_in), 0.5f), y((size_t)(rows * w.n_out));
  kernels::thread_pool pool(n_threads);
  kernels::matmul(w, x.data(), w.n_in, rows, y.data(), w.n_out, pool);  // warm-up
  const int reps = 50;
  const auto t0 = clk::now();
  for (int i = 0; i < reps; ++i) kernels::matmul(w, x.data(), w.n_in, rows, y.data(), w.n_out, pool);
  const double s = std::chrono::duration<double>(clk::now() - t0).count();
  return 2.0 * (double)rows * (double)w.n_in * (double)w.n_out * reps / s / 1e9;
}

}  // namespace

int run_load_bench(const load_opts& o) {
  if (o.concurrency < 1 || o.requests < 1 || o.prompt_len < 1 || o.gen_len < 1)
    throw std::runtime_error("--concurrency, --requests, --prompt-len and --gen-len must be >= 1");
  config::engine_config ec = o.engine;
  // Validates the config, resolves the default model; its shapes size the KV pools (a dummy
  // model's weights are drawn once, by the engine).
  auto probe = load_model(ec, true);
  actors::engine_options eo;
  eo.model_path = ec.model_path;
  eo.dummy_weights = ec.load_format == "dummy";
  eo.dummy_seed = (uint64_t)ec.dummy_seed;
  eo.n_threads = ec.n_threads;
  eo.kv_block_size = ec.kv_block_size;
  eo.kv_window_groups = !ec.swa_full;
  eo.cuda_device = config::parse_device(ec.device);
  eo.cuda_graphs = ec.cuda_graphs;
  eo.cuda_fused_decode = ec.cuda_fused_decode;
  eo.pipeline_parallel = ec.pipeline_parallel;
  // Room for every sequence at once with every layer's KV: with sliding-window groups, as many
  // blocks per group (the same memory; a block holds a group's layers).
  const int n_groups = actors::engine_kv_shape(*probe, eo).n_groups;
  const int32_t per_seq = (engine::kv_blocks_for((int64_t)o.prompt_len + o.gen_len, ec.kv_block_size) + 1) * n_groups;
  eo.n_device_blocks = per_seq * o.concurrency;
  eo.n_host_blocks = per_seq * o.concurrency;
  eo.sched.max_num_seqs = std::max(o.concurrency, 1);
  eo.sched.max_batched_tokens = ec.n_batch;
  eo.sched.plan_ahead = o.plan_ahead;
  eo.sched.target_itl_ms = o.target_itl_ms;
  eo.tensor_parallel = ec.tensor_parallel;
  eo.expert_parallel = ec.expert_parallel;
  probe.reset();
  // The weight bytes a step of r rows reads on the executor's backend (its table, r up to
  // max_num_seqs): a CUDA device holds bf16 weights, but reads a quantized file's blocks in steps
  // of up to 8 rows.
  std::mutex step_bytes_mu;
  std::vector<size_t> step_bytes;
  eo.on_backend_up = [&](const std::vector<size_t>& b) {
    const std::lock_guard lock(step_bytes_mu);
    step_bytes = b;
  };
  const bool on_device = eo.cuda_device >= 0;
  // The device's copy rate while its memory is still free: 1 GiB copies, best of 5.
  const double device_bw = on_device ? engine::cuda_copy_bandwidth(eo.cuda_device, size_t{1} << 30, 5) / 1e9 : 0;
  auto eng = actors::engine_handle::start(eo);
  const engine::model& m = eng->model();
  const int n_vocab = m.vocab().n_vocab();
  int64_t n_params = m.output().n_in * m.output().n_out;
  for (int il = 0; il < m.hparams().n_layers; ++il) {
    const auto& l = m.layer(il);
    for (const auto* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) n_params += w->n_in * w->n_out;
    if (!l.expert_gate.empty())  // the experts a token goes through
      for (const auto* w : {&l.expert_gate[0], &l.expert_up[0], &l.expert_down[0]})
        n_params += m.hparams().n_experts_used * w->n_in * w->n_out;
  }
  size_t weight_bytes = 0;
  {
    const std::lock_guard lock(step_bytes_mu);
    if (step_bytes.empty()) throw std::runtime_error("troupe bench: the executor reported no step sizes");
    weight_bytes = step_bytes[(size_t)std::min(o.concurrency, (int)step_bytes.size()) - 1];
  }

  struct record {
    double ttft = 0, e2e = 0;
    std::vector<double> itl;
    int n = 0;
    bool ok = false;
  };
  std::vector<record> recs((size_t)o.requests);
  std::atomic<int> next{0};
  const auto t0 = clk::now();
  auto client = [&](int cid) {
    std::mt19937 rng(1000 + cid);
    std::uniform_int_distribution<int> pick(100, n_vocab - 1);
    for (int r; (r = next++) < o.requests;) {
      actors::generation_params p;
      for (int i = 0; i < o.prompt_len; ++i) p.prompt.push_back(pick(rng));
      p.sampling.temperature = 0;
      p.sampling.ignore_eos = true;
      p.max_tokens = o.gen_len;
      const auto ts = clk::now();
      auto s = eng->submit(std::move(p));
      record& rec = recs[(size_t)r];
      auto last = ts;
      for (;;) {
        auto ev = s->next(std::chrono::seconds(300));
        if (!ev) break;
        const auto now = clk::now();
        if (ev->type != actors::stream_event::kind::token) {
          rec.ok = ev->type == actors::stream_event::kind::done;
          break;
        }
        if (rec.n == 0) rec.ttft = std::chrono::duration<double>(now - ts).count();
        else rec.itl.push_back(std::chrono::duration<double>(now - last).count());
        last = now;
        ++rec.n;
      }
      rec.e2e = std::chrono::duration<double>(clk::now() - ts).count();
    }
  };
  std::vector<std::thread> ths;
  for (int c = 0; c < o.concurrency; ++c) ths.emplace_back(client, c);
  for (auto& t : ths) t.join();
  const double wall = std::chrono::duration<double>(clk::now() - t0).count();

  std::vector<double> ttft, itl, e2e;
  int64_t n_tok = 0, n_ok = 0;
  for (const auto& r : recs) {
    n_tok += r.n;
    n_ok += r.ok;
    if (r.n > 0) ttft.push_back(r.ttft * 1e3);
    for (double x : r.itl) itl.push_back(x * 1e3);
    e2e.push_back(r.e2e * 1e3);
  }
  const auto st = eng->stats();
  const double bw = on_device ? device_bw : copy_bandwidth_gbs();
  // Step roofline at batch B = concurrency: memory-bound, one step reads every weight once
  // whatever the batch (B tokens per weight_bytes / bandwidth); compute-bound (CPU), every token
  // costs 2 multiply-adds per weight (output head included) at the kernels' measured rate.
  const double mem_roof = (double)o.concurrency * bw * 1e9 / (double)weight_bytes;
  const double flop_per_tok = 2.0 * (double)n_params;
  const double gflops = on_device ? 0 : kernel_gflops(m, ec.n_threads);
  const double compute_roof = gflops * 1e9 / flop_per_tok;
  const double roof_tok_s = gflops > 0 ? std::min(mem_roof, compute_roof) : mem_roof;
  const double tok_s = (double)n_tok / wall;
  if (o.json) {
    std::printf("{\"concurrency\":%d,\"requests\":%d,\"ok\":%lld,\"prompt_len\":%d,\"gen_len\":%d,\"threads\":%d,"
                "\"tok_s\":%.2f,\"req_s\":%.3f,\"copy_gbs\":%.1f,\"weight_gb\":%.6f,\"ttft_p50_ms\":%.2f,\"ttft_p99_ms\":%.2f,\"itl_p50_ms\":%.2f,\"itl_p99_ms\":%.2f,"
                "\"e2e_p50_ms\":%.1f,\"e2e_p99_ms\":%.1f,\"roofline_tok_s\":%.1f,\"mem_roofline_tok_s\":%.1f,\"compute_roofline_tok_s\":%.1f,\"kernel_gflops\":%.1f,\"preemptions\":%lld,"
                "\"steps\":%lld,\"steps_ahead\":%lld,\"admitted_ahead\":%lld,\"itl_capped_steps\":%lld,\"sched_us_per_step\":%.1f}\n",
                o.concurrency, o.requests, (long long)n_ok, o.prompt_len, o.gen_len, ec.n_threads, tok_s, n_ok / wall, bw,
                (double)weight_bytes / 1e9, pct(ttft, 50), pct(ttft, 99), pct(itl, 50), pct(itl, 99), pct(e2e, 50), pct(e2e, 99), roof_tok_s, mem_roof, compute_roof, gflops,
                (long long)(st.sched.n_preempted_swap + st.sched.n_preempted_recompute), (long long)st.n_steps,
                (long long)st.n_steps_ahead, (long long)st.sched.n_admitted_ahead, (long long)st.sched.n_itl_capped, st.n_steps > 0 ? st.sched_s / (double)st.n_steps * 1e6 : 0.0);
  } else {
    std::printf("concurrency %d | %d requests (%lld ok) | prompt %d | gen %d | threads %d\n", o.concurrency, o.requests,
                (long long)n_ok, o.prompt_len, o.gen_len, ec.n_threads);
    std::printf("generated  %10.1f tok/s   %.2f req/s\n", tok_s, n_ok / wall);
    if (gflops > 0)
      std::printf("roofline   %10.0f tok/s   at batch %d (memory %.0f: %.1f GB/s copy; compute %.0f: %.0f GFLOP/s kernels)\n",
                  roof_tok_s, o.concurrency, mem_roof, bw, compute_roof, gflops);
    else
      std::printf("roofline   %10.0f tok/s   at batch %d (memory: %.2f GB of weights a step, as the device reads them / %.0f GB/s device copy)\n",
                  roof_tok_s, o.concurrency, (double)weight_bytes / 1e9, bw);
    std::printf("TTFT ms    p50 %8.1f   p99 %8.1f\n", pct(ttft, 50), pct(ttft, 99));
    std::printf("ITL ms     p50 %8.2f   p99 %8.2f\n", pct(itl, 50), pct(itl, 99));
    std::printf("E2E ms     p50 %8.1f   p99 %8.1f\n", pct(e2e, 50), pct(e2e, 99));
    if (st.n_steps > 0)
      std::printf("per step   scheduler %.1f us (plan + results), executor %.2f ms (%lld steps, %lld planned ahead, "
                  "%lld admissions in them, %lld cut to the ITL target)\n",
                  st.sched_s / (double)st.n_steps * 1e6, st.executor_s / (double)st.n_steps * 1e3, (long long)st.n_steps,
                  (long long)st.n_steps_ahead, (long long)st.sched.n_admitted_ahead, (long long)st.sched.n_itl_capped);
  }
  if (!st.device_lost.empty()) {  // the executor's thread may be wedged: destroying the engine would wait for it
    std::fprintf(stderr, "troupe bench: the model is unavailable: %s\n", st.device_lost.c_str());
    std::fflush(nullptr);
    std::_Exit(1);
  }
  return n_ok == o.requests ? 0 : 1;
}

}  // namespace troupe::cli
