// troupe_gpu_bench: device figures for docs/perf.md, one line each, "name value unit".
//
//   troupe_gpu_bench [--arch llama-3-8b] [--context 512] [--steps 20] [--device 0] [--decode-only B]
//                    [--streamed 0|1] [--fused 0|1] [--fold 0|1] [--prefetch BYTES] [--quant none|q4_k_m|q8_0]
//                    [--unroll 1|4|8]
//                    [--layers N] [--vocab V] [--d-model D] [--heads H] [--kv-heads H] [--d-ff F] [--smoke 0|1]
//
// --decode-only B: only the model and its decode steps at batch B (one line), for a profiler
// (scripts/gpu-profile); --streamed 1 makes those steps use gemv_bf16_streamed (default pipeline),
// --fused 1 the fused launches (launch_options::gemv_swiglu, gemv_rope, attention_last_cta_merge), --fold 1
// RMSNorm in the GEMVs (gemv_fold_norm), --prefetch launch_options::bf16_gemv_prefetch_bytes,
// --quant the layer weights as random GGUF blocks (decode_q4_k_m_* below; B up to 8), --unroll
// launch_options::quant_gemv_unroll.
// --layers, --vocab, --d-model, --heads, --kv-heads, --d-ff: the architecture with these instead
// (head_dim stays the architecture's).
// --smoke 1: every figure and variant at toy sizes (16 MiB copies, 256^3 GEMM, 64-token prefill,
// 2 MiB of weight copies a GEMM shape, two timed calls): a check that each runs, for the CPU
// emulation (troupe_gpu_bench_emu, tests/python/test_gpu_bench_emu.py); its figures mean nothing.
// Figures named by a size (gemm_bf16_8192, prefill_2048) take the size run.
//
// - d2d_copy_bandwidth: cudaMemcpy of 2 GiB device to device, best of 5, counting bytes read
//   plus bytes written (2 x 2 GiB per copy): the rate HBM sustains for a pure stream.
// - hbm_read_bandwidth: 2 GiB read by streaming 16-byte loads and nothing written (read_checksum),
//   best of 5 at 1 to 16 CTAs per SM (a line each), and over the copy rate: how far the weight
//   GEMVs, which only read, could go past the copy rate the roofline is drawn from.
// - gemm_*: cuBLASLt bf16 GEMM (fp32 accumulate) at 8192^3 and at the prefill shapes of the
//   architecture (2048 token rows times each fused weight matrix), mean of 20 after 3 warm-ups.
// - decode_b{1,8,64,256}: synthetic weights of the architecture, every sequence at a context that
//   ends at --context, one token per sequence per step through forward_sample (greedy, on the
//   device), host wall time per step (graph replay; b1 also eager). roofline: weight bytes plus
//   KV bytes read per step, over the measured copy bandwidth (read + write counted once each).
//   decode_b*_device_step: the device's part of it (events from the layout upload to the last
//   copy back), the rest being host overhead; decode_b*_gemm_only_step: the step's weight GEMMs
//   alone (cuBLASLt, weights not in L2), and
//   their share of the step: the rest is attention, norms, RoPE, sampling and launch gaps.
// - the same steps with other launch options than the defaults: decode_b*_gemv_* with
//   launch_options::bf16_gemv_rows covering the batch (gemv_bf16 for the layers' weights),
//   decode_b1_cublas_* with cuBLASLt, decode_b1_split_* with gemv_bf16 for the qkv and o
//   matrices only (bf16_gemv_max_bytes 64 MiB), decode_b{1,2}_streamed_* through
//   gemv_bf16_streamed, *_nopdl_* with launch_options::pdl off, *_fused_* with gemv_swiglu,
//   gemv_rope and attention_last_cta_merge on (decode_b1_merge_only_*, decode_b1_rope_only_*: one
//   of them alone), *_fold_* with gemv_fold_norm on, *_prefetch_Nk_* with
//   launch_options::bf16_gemv_prefetch_bytes N KiB, *_attn_kvN_* with attention_kv_per_split N,
//   decode_b1_sleep_wait_* with step_spin 0 (the host's wait sleeping after 1 ms, as before);
//   decode_b1_gemv[_pdl]_gemm_*: the GEMVs alone as the GEMMs above, launched plainly or with
//   programmatic dependent launch. Batch-1 variants are the best of three 20-step means
//   (decode_b1_default_*: the default options measured so); decode_b1_best_time_over_roofline:
//   the fastest of them (its name in a "# fastest" line). A variant that fails prints "# NAME failed".
// - decode_{q4_k_m,q8_0}_b{1,8}: the same steps (best of 3 at batch 1) with the layer weights as
//   random GGUF blocks in llama.cpp's Q4_K_M mix (q4_k; V and down q6_k every other layer) and in
//   q8_0 (an output head in q6_k or q8_0), read by gemv_quant; *_unroll{4,8}_* with
//   launch_options::quant_gemv_unroll 4 or 8. Roofline: that model's bytes per step
//   (decode_*_weight_bytes) plus KV over the copy rate. Run after the bf16 model is freed.
// - decode_gemma3_270m_b{1,64}: Gemma 3 270M's shapes (synthetic bf16; head_dim 256, one KV head,
//   windows of 512 in 15 of 18 layers, their KV in groups of their own: *_kv_groups) at a context
//   of 4096; roofline: weight bytes plus the KV a step reads (windows, not the whole context, in the
//   sliding layers) over the copy rate. Last.
// - prefill_2048: one 2048-token chunk, best of 3; FLOPs = 2 * layer params * tokens + 2 * head
//   params (one logits row) + causal attention 4 * n_heads * head_dim * T(T+1)/2 per layer.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/cuda_forward.hpp"

using namespace troupe::engine;
namespace ec = troupe::engine::cuda;
namespace kc = troupe::kernels::cuda;

namespace {

// Every wait on the device here ends within this (cuda_error past it): a kernel that hangs costs
// the bench this long per remaining figure, not scripts/gpu-check's whole stage.
constexpr std::chrono::milliseconds wait_limit{20000};

void line(const std::string& name, double value, const char* unit) { std::printf("%s %.4g %s\n", name.c_str(), value, unit); }

// Sizes of the figures: the device's (default) or toy ones (--smoke 1).
struct sizes {
  size_t stream_bytes = size_t{2} << 30;  // copy and read benchmarks
  int gemm = 8192;                        // the square GEMM
  int prefill = 2048;                     // prefill chunk, and the GEMM rows of its shapes
  size_t spill_bytes = size_t{256} << 20;  // weight copies a decode GEMM shape cycles through (past the L2)
  int warm = 3, timed = 20;                // time_on_stream's calls
};
sizes sz;

// Times `fn` (enqueueing on s) with events: seconds per call, mean of n after `warm` warm-ups.
template <class Fn>
double time_on_stream(cudaStream_t s, int warm, int n, Fn&& fn) {
  cudaEvent_t a, b;
  kc::check(cudaEventCreate(&a), "cudaEventCreate");
  kc::check(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < warm; ++i) fn();
  kc::check(cudaEventRecord(a, s), "cudaEventRecord");
  for (int i = 0; i < n; ++i) fn();
  kc::check(cudaEventRecord(b, s), "cudaEventRecord");
  ec::wait_event(b, wait_limit, "a timed benchmark loop");  // a hung kernel ends the run, not the call
  float ms = 0.0f;
  kc::check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3 / n;
}

// Bytes read per second by read_checksum over 2 GiB (streaming loads, nothing written), best of
// 5 at each grid size of 1 to 16 CTAs of 256 threads per SM: the read rate the weight GEMVs of a
// decode step could reach. Prints one line per grid size.
double read_bandwidth(cudaStream_t s, int dev) {
  const size_t bytes = sz.stream_bytes;
  ec::device_buffer a(bytes, "the read benchmark source"), sum(sizeof(uint32_t), "the read checksum");
  kc::check(cudaMemsetAsync(a.as<void>(), 1, bytes, s), "cudaMemset");
  int sms = 0;
  kc::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  double best_rate = 0.0;
  for (const int per_sm : {1, 2, 4, 8, 16}) {
    double best = 1e30;
    for (int i = 0; i < 5; ++i)
      best = std::min(best, time_on_stream(s, i == 0 ? 1 : 0, 1, [&] {
        ec::read_checksum(a.as<void>(), bytes, sum.as<uint32_t>(), sms * per_sm, s);
      }));
    line("hbm_read_bandwidth_" + std::to_string(per_sm) + "_ctas_per_sm", (double)bytes / best / 1e9, "GB/s");
    best_rate = std::max(best_rate, (double)bytes / best);
  }
  return best_rate;
}

// FLOP/s of y[m, n] = x[m, k] W^T in bf16.
double gemm_rate(ec::gemm_runner& g, cudaStream_t s, int m, int n, int k) {
  ec::device_buffer x((size_t)m * k * 2, "GEMM x"), w((size_t)n * k * 2, "GEMM w"), y((size_t)m * n * 2, "GEMM y");
  ec::fill_uniform_bf16(x.as<ec::bf16>(), (int64_t)m * k, 1.0f, 1, s);
  ec::fill_uniform_bf16(w.as<ec::bf16>(), (int64_t)n * k, 0.02f, 2, s);
  const double t = time_on_stream(s, sz.warm, sz.timed, [&] { g.run(x.as<ec::bf16>(), w.as<ec::bf16>(), y.as<void>(), ec::gemm_out::bf16, m, n, k, s); });
  return 2.0 * m * n * k / t;
}

// What multiplies a layer's weights in decode_gemm_time.
enum class layer_gemm { cublas, gemv, gemv_streamed };

// Seconds of a decode step's weight GEMMs alone at `batch` rows: every layer's four matrices
// and the output head (fp32 logits). Each shape has enough weight copies, used in turn, that the
// L2 (60 MB) never holds the next one, as in the model, where every layer reads fresh weights.
// With the step time this splits a decode step into GEMMs and the rest (attention, norms, RoPE,
// sampling, launch gaps). path: the layers' matrices through cuBLASLt, kernels::cuda::gemv_bf16
// or gemv_bf16_streamed (the head stays on cuBLASLt: fp32 logits); pdl: programmatic
// dependent launch. Prints each shape's weight read rate (GB/s) as `tag`_N_K_GBps.
double decode_gemm_time(ec::gemm_runner& g, cudaStream_t s, const model_hparams& hp, int batch, layer_gemm path, bool pdl,
                        const std::string& tag, const kc::gemv_stream_config& stream_cfg = {}) {
  const kc::pdl_scope scope(pdl);
  const int64_t d = hp.d_model, qd = (int64_t)hp.n_heads * hp.head_dim;
  const int64_t qkv = qd + 2 * (int64_t)hp.n_kv_heads * hp.head_dim;
  const int64_t shapes[5][2] = {{qkv, d}, {d, qd}, {2 * (int64_t)hp.d_ff, d}, {d, hp.d_ff}, {hp.n_vocab, d}};
  const int64_t max_k = std::max<int64_t>(d, hp.d_ff), max_n = std::max<int64_t>(hp.n_vocab, 2 * (int64_t)hp.d_ff);
  ec::device_buffer x((size_t)(batch * max_k * 2), "decode GEMM x"), y((size_t)(batch * max_n * 4), "decode GEMM y");
  ec::fill_uniform_bf16(x.as<ec::bf16>(), batch * max_k, 1.0f, 5, s);
  double total = 0.0;
  for (int i = 0; i < 5; ++i) {
    const int n = (int)shapes[i][0], k = (int)shapes[i][1];
    const size_t bytes = (size_t)n * k * 2;
    const int copies = std::max(2, (int)(sz.spill_bytes / bytes) + 1);
    std::vector<ec::device_buffer> w;
    for (int c = 0; c < copies; ++c) {
      w.emplace_back(bytes, "decode GEMM weights");
      ec::fill_uniform_bf16(w.back().as<ec::bf16>(), (int64_t)n * k, 0.02f, 10 + c, s);
    }
    int next = 0;
    const bool head = i == 4;
    const ec::gemm_out out = head ? ec::gemm_out::f32 : ec::gemm_out::bf16;
    const double t = time_on_stream(s, copies, std::min(4 * copies, sz.timed), [&] {
      const ec::bf16* wi = w[(size_t)(next++ % copies)].as<ec::bf16>();
      if (head || path == layer_gemm::cublas)
        g.run(x.as<ec::bf16>(), wi, y.as<void>(), out, batch, n, k, s);
      else if (path == layer_gemm::gemv_streamed)
        kc::gemv_bf16_streamed(wi, n, k, x.as<ec::bf16>(), y.as<ec::bf16>(), batch, s, stream_cfg);
      else
        kc::gemv_bf16(wi, n, k, x.as<ec::bf16>(), y.as<ec::bf16>(), batch, s);
    });
    line(tag + "_" + std::to_string(n) + "_" + std::to_string(k) + "_GBps", (double)bytes / t / 1e9, "GB/s");
    total += (head ? 1 : hp.n_layers) * t;
  }
  return total;
}

struct args {
  std::string arch = "llama-3-8b";
  int context = 512;
  int steps = 20;
  int device = 0;
  int decode_only = 0;  // > 0: only decode steps at this batch (for a profiler), no other figures
  bool streamed = false;  // --decode-only steps through gemv_bf16_streamed
  bool fused = false;     // ... with launch_options::gemv_swiglu, gemv_rope and attention_last_cta_merge
  bool fold = false;      // ... with launch_options::gemv_fold_norm
  int prefetch = 0;       // ... and bf16_gemv_prefetch_bytes
  int layers = 0, vocab = 0, d_model = 0, heads = 0, kv_heads = 0, d_ff = 0;  // > 0: instead of the architecture's
  bool smoke = false;         // toy sizes (sizes above)
  ec::synthetic_quant quant = ec::synthetic_quant::none;  // --decode-only's layer weights
  int unroll = 1;                                         // ... and launch_options::quant_gemv_unroll
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
    const std::string v = argv[++i];
    if (k == "--arch") a.arch = v;
    else if (k == "--context") a.context = std::stoi(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--device") a.device = std::stoi(v);
    else if (k == "--decode-only") a.decode_only = std::stoi(v);
    else if (k == "--streamed") a.streamed = std::stoi(v) != 0;
    else if (k == "--fused") a.fused = std::stoi(v) != 0;
    else if (k == "--fold") a.fold = std::stoi(v) != 0;
    else if (k == "--prefetch") a.prefetch = std::stoi(v);
    else if (k == "--layers") a.layers = std::stoi(v);
    else if (k == "--vocab") a.vocab = std::stoi(v);
    else if (k == "--d-model") a.d_model = std::stoi(v);
    else if (k == "--heads") a.heads = std::stoi(v);
    else if (k == "--kv-heads") a.kv_heads = std::stoi(v);
    else if (k == "--d-ff") a.d_ff = std::stoi(v);
    else if (k == "--smoke") a.smoke = std::stoi(v) != 0;
    else if (k == "--unroll") a.unroll = std::stoi(v);
    else if (k == "--quant") {
      if (v == "q4_k_m") a.quant = ec::synthetic_quant::q4_k_m;
      else if (v == "q8_0") a.quant = ec::synthetic_quant::q8_0;
      else if (v != "none") throw std::invalid_argument("--quant: none, q4_k_m or q8_0");
    }
    else throw std::invalid_argument("unknown option " + k + " (--arch, --context, --steps, --device, --decode-only, --streamed, --fused, --fold, --prefetch, --quant, --unroll, --layers, --vocab, --d-model, --heads, --kv-heads, --d-ff, --smoke)");
  }
  if (a.quant != ec::synthetic_quant::none && (a.decode_only < 1 || a.decode_only > ec::gemv_max_batch))
    throw std::invalid_argument("--quant takes --decode-only 1 to 8 (the rows gemv_quant serves)");
  if (a.context < a.steps + 4 || a.steps < 1) throw std::invalid_argument("--context must exceed --steps + 3, --steps >= 1");
  if (std::min({a.layers, a.vocab, a.d_model, a.heads, a.kv_heads, a.d_ff}) < 0)
    throw std::invalid_argument("--layers, --vocab, --d-model, --heads, --kv-heads and --d-ff must be positive (0: the architecture's)");
  return a;
}

// `o` for a synthetic model of quantized layer weights `q` (blocks only: steps of up to 8 rows
// read them through gemv_quant), KV for `seqs` sequences of `context` positions.
ec::cuda_options quant_options(ec::cuda_options o, ec::synthetic_quant q, int seqs, int context) {
  o.synthetic_weights = q;
  o.weights.mode = ec::weights_mode::quant_gemv_small_batch;
  o.weights.expand_quant = false;
  o.max_seqs = seqs;
  o.max_context = context;
  o.n_blocks = seqs * kv_blocks_for(context, o.block_size);
  return o;
}

// Decode steps of `batch` sequences whose contexts end at a.context; seconds per step. With KV
// layer groups (Gemma 3's sliding windows) each sequence has a table per group, every block its own
// (so the KV needs groups x blocks of the context x batch blocks).
double decode_step_time(ec::cuda_forward& f, int batch, const args& a, double* device_s = nullptr) {
  const int warm = 3;
  const int bs = f.kv().block_size, groups = f.kv().n_groups;
  const int n_steps = warm + a.steps;
  const int pos_start = a.context - n_steps;  // the last step attends over a.context positions
  const int bps = kv_blocks_for(a.context, bs);
  std::vector<std::vector<int32_t>> tables((size_t)batch, std::vector<int32_t>((size_t)(bps * groups)));
  for (int s = 0; s < batch; ++s)
    for (int j = 0; j < bps * groups; ++j) tables[(size_t)s][(size_t)j] = j * batch + s;  // interleaved across sequences
  std::vector<token_id> tokens((size_t)batch, 1);
  std::vector<seq_chunk> chunks((size_t)batch);
  std::vector<kc::sample_row_params> params((size_t)batch);
  for (auto& p : params) p.temperature = 0.0f;
  double t = 0.0, dev = 0.0;
  for (int step = 0; step < n_steps; ++step) {
    for (int s = 0; s < batch; ++s)
      chunks[(size_t)s] = {std::span(&tokens[(size_t)s], 1), pos_start + step, tables[(size_t)s]};
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> next = f.forward_sample(chunks, params);
    if (step >= warm) {
      t += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      dev += f.last_step_device_ms() / 1e3;
    }
    std::copy(next.begin(), next.end(), tokens.begin());
  }
  if (device_s) *device_s = dev / a.steps;
  return t / a.steps;
}

void run(const args& a) {
  ec::select_device(a.device);
  cudaDeviceProp prop{};
  kc::check(cudaGetDeviceProperties(&prop, a.device), "cudaGetDeviceProperties");
  model_hparams hp = synthetic_hparams(a.arch);
  for (auto [v, field] : {std::pair{a.layers, &hp.n_layers}, {a.vocab, &hp.n_vocab}, {a.d_model, &hp.d_model},
                          {a.heads, &hp.n_heads}, {a.kv_heads, &hp.n_kv_heads}, {a.d_ff, &hp.d_ff}})
    if (v > 0) *field = v;
  if (hp.n_heads % hp.n_kv_heads != 0) throw std::invalid_argument("--heads must be a multiple of --kv-heads");
  if (a.smoke) sz = sizes{size_t{16} << 20, 256, 64, size_t{2} << 20, 1, 2};
  std::printf("# device %s, arch %s (%d layers, d_model %d, %d/%d heads of %d, d_ff %d, vocabulary %d), context %d, %d timed steps%s\n",
              prop.name, a.arch.c_str(), hp.n_layers, hp.d_model, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.d_ff, hp.n_vocab,
              a.context, a.steps, a.smoke ? ", toy sizes (--smoke 1)" : "");
  ec::stream_handle stream;
  const cudaStream_t s = stream.get();

  if (a.decode_only > 0) {  // a short run for a profiler: the model and its decode steps alone
    ec::cuda_options o;
    o.device = a.device;
    o.weights.mode = ec::weights_mode::bf16;
    o.max_seqs = a.decode_only;
    o.max_context = a.context;
    o.n_blocks = a.decode_only * kv_blocks_for(a.context, o.block_size);
    o.launch.bf16_gemv_streamed = a.streamed;
    o.launch.gemv_swiglu = o.launch.attention_last_cta_merge = o.launch.gemv_rope = a.fused;
    o.launch.gemv_fold_norm = a.fold;
    o.launch.bf16_gemv_prefetch_bytes = a.prefetch;
    if (a.quant != ec::synthetic_quant::none) o = quant_options(o, a.quant, a.decode_only, a.context);
    o.launch.quant_gemv_unroll = a.unroll;
    auto f = ec::cuda_forward::synthetic(hp, o);
    if (a.fold && !f->fold_norm(a.decode_only)) std::printf("# --fold 1: these steps do not fold RMSNorm (not all GEMVs are gemv_bf16)\n");
    line("decode_b" + std::to_string(a.decode_only) + "_step", decode_step_time(*f, a.decode_only, a) * 1e3, "ms");
    return;
  }
  const double bw = ec::copy_bandwidth(sz.stream_bytes, 5, s, wait_limit);  // 2 GiB copies (read + write), best of 5
  line("d2d_copy_bandwidth", bw / 1e9, "GB/s");
  try {  // first run on a device: a failure costs these lines only
    const double read_bw = read_bandwidth(s, a.device);
    line("hbm_read_bandwidth", read_bw / 1e9, "GB/s");
    line("hbm_read_over_copy", read_bw / bw, "x");
  } catch (const std::exception& e) {
    std::printf("# hbm_read_bandwidth failed: %s\n", e.what());
  }

  double gemm_8192 = 0.0, prefill_gemm_flops = 0.0, prefill_gemm_time = 0.0;
  {
    ec::gemm_runner g;
    gemm_8192 = gemm_rate(g, s, sz.gemm, sz.gemm, sz.gemm);
    line("gemm_bf16_" + std::to_string(sz.gemm), gemm_8192 / 1e12, "TFLOP/s");
    const int64_t qkv = (int64_t)(hp.n_heads + 2 * hp.n_kv_heads) * hp.head_dim, qd = (int64_t)hp.n_heads * hp.head_dim;
    const int64_t shapes[4][2] = {{qkv, hp.d_model}, {hp.d_model, qd}, {2 * (int64_t)hp.d_ff, hp.d_model}, {hp.d_model, hp.d_ff}};
    for (const auto& sh : shapes) {
      const double r = gemm_rate(g, s, sz.prefill, (int)sh[0], (int)sh[1]);
      line("gemm_bf16_m" + std::to_string(sz.prefill) + "_n" + std::to_string(sh[0]) + "_k" + std::to_string(sh[1]), r / 1e12,
           "TFLOP/s");
      prefill_gemm_flops += 2.0 * sz.prefill * (double)sh[0] * (double)sh[1];
      prefill_gemm_time += 2.0 * sz.prefill * (double)sh[0] * (double)sh[1] / r;
    }
    line("gemm_bf16_prefill_shapes", prefill_gemm_flops / prefill_gemm_time / 1e12, "TFLOP/s");
  }

  // One model for every figure: KV for 256 sequences at the context, plus a 2048-token prefill.
  const int bs = 16;
  ec::cuda_options o;
  o.device = a.device;
  o.sync_timeout = wait_limit;
  o.weights.mode = ec::weights_mode::bf16;
  o.block_size = bs;
  o.max_seqs = 256;
  o.max_context = std::max(a.context, sz.prefill);
  o.max_batch_tokens = sz.prefill;
  o.n_blocks = std::max(256 * kv_blocks_for(a.context, bs), kv_blocks_for(sz.prefill, bs));
  auto f = ec::cuda_forward::synthetic(hp, o);
  line("device_memory_used", (double)f->device_bytes() / (1 << 30), "GiB");
  const double weight_bytes = (double)f->decode_bytes_per_token();
  line("weight_bytes", weight_bytes / 1e9, "GB");
  const double kv_bytes_per_pos = (double)f->kv().block_bytes() / bs;

  // Weight and KV bytes of a step of `batch` rows over the copy rate; the average context over the
  // timed steps is about a.context - steps / 2.
  const auto roofline_with = [&](double weights, int batch) {
    return (weights + (double)batch * (a.context - a.steps / 2.0) * kv_bytes_per_pos) / bw;
  };
  const auto roofline_of = [&](int batch) { return roofline_with(weight_bytes, batch); };
  ec::gemm_runner decode_gemms;
  double best_b1 = 1e30;  // the fastest batch-1 step of any launch options, and its line's name
  std::string best_b1_name;
  for (int batch : {1, 8, 64, 256}) {
    const std::string b = "decode_b" + std::to_string(batch);
    double t_dev = 0.0;
    const double t = decode_step_time(*f, batch, a, &t_dev);
    line(b + "_device_step", t_dev * 1e3, "ms");
    const double t_gemm = decode_gemm_time(decode_gemms, s, hp, batch, layer_gemm::cublas, false, b + "_gemm");
    line(b + "_gemm_only_step", t_gemm * 1e3, "ms");
    line(b + "_gemm_share", t_gemm / t, "x");
    const double roofline = roofline_of(batch);
    line(b + "_step", t * 1e3, "ms");
    line(b + "_tokens_per_s", batch / t, "tok/s");
    line(b + "_roofline_step", roofline * 1e3, "ms");
    line(b + "_time_over_roofline", t / roofline, "x");
  }
  line("decode_graphs", (double)f->n_graphs(), "captured");
  if (!f->graph_error().empty()) std::printf("# CUDA graphs off after a failed capture: %s\n", f->graph_error().c_str());
  // Whole steps with other launch options than the defaults above (decode_bN); the streamed
  // GEMV's pipeline is the default one until its search (last, below) picks one.
  kc::gemv_stream_config best_stream;
  auto options = [&](int gemv_rows, bool pdl, size_t gemv_max_bytes = 0, bool streamed = false) {
    ec::launch_options l = o.launch;
    l.bf16_gemv_rows = gemv_rows;
    l.bf16_gemv_max_bytes = gemv_max_bytes;
    l.bf16_gemv_streamed = streamed;
    l.bf16_gemv_stream = best_stream;
    l.pdl = pdl;
    return l;
  };
  auto fused = [](ec::launch_options l) {
    l.gemv_swiglu = l.attention_last_cta_merge = l.gemv_rope = true;
    return l;
  };
  // A failing variant (options not yet run on a device) is reported and skipped; once a failure
  // leaves the device unusable (a hung or faulted kernel: a small copy no longer completes), the
  // variants after it are named as skipped instead of each waiting out wait_limit. A variant whose
  // capture failed ran eagerly, and says so. Batch 1: the best of three runs, as the variants
  // differ by a few percent.
  bool device_lost = false;
  ec::device_buffer probe(16, "the device probe");
  ec::event_handle probe_event;
  auto device_usable = [&] {
    try {
      kc::check(cudaMemsetAsync(probe.as<void>(), 0, 16, s), "cudaMemsetAsync");
      ec::sync_stream(s, probe_event.get(), std::chrono::milliseconds(2000), "the device probe");
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  auto run_variant = [&](int batch, const char* name, const ec::launch_options& l) {
    const std::string b = "decode_b" + std::to_string(batch) + name;
    if (device_lost) {
      std::printf("# %s skipped: the device was lost earlier\n", b.c_str());
      return;
    }
    try {
      f->set_launch_options(l);
      double t = decode_step_time(*f, batch, a);
      for (int rep = 1; batch == 1 && rep < 3; ++rep) t = std::min(t, decode_step_time(*f, batch, a));
      line(b + "_step", t * 1e3, "ms");
      line(b + "_tokens_per_s", batch / t, "tok/s");
      line(b + "_time_over_roofline", t / roofline_of(batch), "x");
      if (!f->graph_error().empty()) std::printf("# %s ran eagerly, its capture failed: %s\n", b.c_str(), f->graph_error().c_str());
      if (batch == 1 && t < best_b1) best_b1 = t, best_b1_name = b;
    } catch (const std::exception& e) {
      std::printf("# %s failed: %s\n", b.c_str(), e.what());
      device_lost = !device_usable();
      if (device_lost) std::printf("# the device no longer completes work: the remaining variants are skipped\n");
    }
  };
  auto variant = [&](int batch, const char* name, int gemv_rows, bool pdl, size_t gemv_max_bytes = 0,
                     bool streamed = false) { run_variant(batch, name, options(gemv_rows, pdl, gemv_max_bytes, streamed)); };
  {
    // The GEMVs alone: gemv_bf16 with plain launches, then programmatic ones; gemv_bf16_streamed
    // (programmatic) over pipeline shapes (CTAs per SM, stages, KiB a copy: _sC_S_K).
    for (bool pdl : {false, true}) {
      const std::string tag = pdl ? "decode_b1_gemv_pdl_gemm" : "decode_b1_gemv_gemm";
      const double t_gemv = decode_gemm_time(decode_gemms, s, hp, 1, layer_gemm::gemv, pdl, tag);
      line(tag + "_only_step", t_gemv * 1e3, "ms");
      line(tag + "_only_over_roofline", t_gemv / roofline_of(1), "x");
    }
    variant(1, "_cublas", 0, true);
    variant(1, "_cublas_nopdl", 0, false);
    variant(1, "_gemv_nopdl", 1, false);
    variant(1, "_split", 1, true, size_t{64} << 20);
    for (int batch : {2, 4, 8}) {
      variant(batch, "", o.launch.bf16_gemv_rows, o.launch.pdl, o.launch.bf16_gemv_max_bytes, o.launch.bf16_gemv_streamed);
      variant(batch, "_gemv", batch, true);
    }
    for (int batch : {8, 64})
      variant(batch, "_nopdl", o.launch.bf16_gemv_rows, false, o.launch.bf16_gemv_max_bytes, o.launch.bf16_gemv_streamed);
    f->set_launch_options(o.launch);
  }
  {
    ec::cuda_options eo = o;
    eo.use_graphs = false;
    eo.n_blocks = kv_blocks_for(a.context, bs) + 1;
    f.reset();  // one copy of the weights at a time
    auto e = ec::cuda_forward::synthetic(hp, eo);
    line("decode_b1_eager_step", decode_step_time(*e, 1, a) * 1e3, "ms");
    e.reset();
    f = ec::cuda_forward::synthetic(hp, o);
  }

  {
    const int T = sz.prefill;
    const std::string p = "prefill_" + std::to_string(T), g8 = "gemm_" + std::to_string(sz.gemm);
    std::vector<token_id> tokens(T);
    std::mt19937 g(3);
    for (auto& t : tokens) t = (token_id)(g() % (unsigned)hp.n_vocab);
    std::vector<int32_t> table((size_t)kv_blocks_for(T, bs));
    for (size_t j = 0; j < table.size(); ++j) table[j] = (int32_t)j;
    seq_chunk c{tokens, 0, table};
    kc::sample_row_params greedy;
    greedy.temperature = 0.0f;
    double best = 1e30;
    for (int i = 0; i < 4; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      f->forward_sample(std::span(&c, 1), std::span(&greedy, 1));
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) best = std::min(best, t);  // the first run chooses GEMM algorithms
    }
    const double d = hp.d_model, qd = (double)hp.n_heads * hp.head_dim, kvd = (double)hp.n_kv_heads * hp.head_dim;
    const double layer_params = d * (qd + 2 * kvd) + qd * d + 3.0 * d * hp.d_ff;
    const double flops = 2.0 * layer_params * hp.n_layers * T + 2.0 * d * hp.n_vocab +
                         (double)hp.n_layers * 4.0 * qd * ((double)T * (T + 1) / 2.0);
    line(p, best * 1e3, "ms");
    line(p + "_tflops", flops / best / 1e12, "TFLOP/s");
    line(p + "_fraction_of_" + g8, flops / best / gemm_8192, "x");
    line(p + "_fraction_of_gemm_prefill_shapes", flops / best / (prefill_gemm_flops / prefill_gemm_time), "x");
  }
  {
    // First runs on a device (written without one): the fused launches, the folded RMSNorm, the
    // L2 prefetch, then the streamed GEMV (the pipeline search, the best one in whole steps).
    // Last, so that a fault in them costs none of the figures above.
    run_variant(1, "_default", o.launch);  // measured as the variants below
    ec::launch_options sleep_wait = o.launch;  // the host's wait sleeping after 1 ms, as before step_spin
    sleep_wait.step_spin = std::chrono::milliseconds(0);
    run_variant(1, "_sleep_wait", sleep_wait);
    // In order of risk, the least new code first: a fault ends the variants after it.
    // Decode attention's split size (positions a split keeps at least; 64 by default).
    for (const int kv : {32, 128}) {
      ec::launch_options l = options(1, true);
      l.attention_kv_per_split = kv;
      run_variant(1, ("_attn_kv" + std::to_string(kv)).c_str(), l);
    }
    // L2 prefetch of each GEMV row's first KiB before the programmatic wait.
    for (const int kib : {1, 2, 4, 8}) {
      ec::launch_options l = options(1, true);
      l.bf16_gemv_prefetch_bytes = kib << 10;
      run_variant(1, ("_prefetch_" + std::to_string(kib) + "k").c_str(), l);
    }
    // The last-CTA attention merge, RoPE in the qkv GEMV, then with SwiGLU in the gate|up GEMV.
    ec::launch_options merge_only = options(1, true);
    merge_only.attention_last_cta_merge = true;
    run_variant(1, "_merge_only", merge_only);
    ec::launch_options rope_only = options(1, true);
    rope_only.gemv_rope = true;
    run_variant(1, "_rope_only", rope_only);
    run_variant(1, "_fused", fused(options(1, true)));
    run_variant(64, "_fused", fused(options(o.launch.bf16_gemv_rows, true)));
    // RMSNorm and the residual add in the GEMVs, alone and with the fused launches.
    ec::launch_options fold_only = options(1, true);
    fold_only.gemv_fold_norm = true;
    run_variant(1, "_fold", fold_only);
    if (!device_lost) line("decode_b1_fold_applies", f->fold_norm(1) ? 1.0 : 0.0, "bool");  // under the options just run
    run_variant(1, "_fold_fused", ec::fused_decode(options(1, true)));
    run_variant(2, "_fold_fused", ec::fused_decode(options(2, true)));
    for (const int kv : {32, 128}) {
      ec::launch_options l = options(1, true);
      l.attention_kv_per_split = kv;
      run_variant(1, ("_fold_fused_attn_kv" + std::to_string(kv)).c_str(), ec::fused_decode(l));
    }
    for (const int kib : {1, 2, 4, 8}) {
      ec::launch_options l = options(1, true);
      l.bf16_gemv_prefetch_bytes = kib << 10;
      run_variant(1, ("_fused_prefetch_" + std::to_string(kib) + "k").c_str(), fused(l));
      run_variant(1, ("_fold_fused_prefetch_" + std::to_string(kib) + "k").c_str(), ec::fused_decode(l));
    }
    double best_stream_t = 1e30;
    for (const kc::gemv_stream_config c : {kc::gemv_stream_config{2, 4, 16384}, {1, 8, 16384}, {2, 6, 16384},
                                           {3, 4, 16384}, {4, 3, 16384}, {2, 4, 32768}, {1, 6, 32768}, {2, 8, 8192}}) {
      const std::string tag = "decode_b1_gemv_streamed_s" + std::to_string(c.ctas_per_sm) + "_" + std::to_string(c.stages) +
                              "_" + std::to_string(c.chunk_bytes >> 10) + "_gemm";
      if (device_lost) break;
      try {
        const double t = decode_gemm_time(decode_gemms, s, hp, 1, layer_gemm::gemv_streamed, true, tag, c);
        line(tag + "_only_over_roofline", t / roofline_of(1), "x");
        if (t < best_stream_t) best_stream_t = t, best_stream = c;
      } catch (const std::exception& e) {
        std::printf("# %s: %s\n", tag.c_str(), e.what());
        device_lost = !device_usable();
      }
    }
    std::printf("# best streamed GEMV pipeline: %d CTAs per SM, %d stages, %d KiB\n", best_stream.ctas_per_sm,
                best_stream.stages, best_stream.chunk_bytes >> 10);
    if (best_stream_t < 1e30)
      line("decode_b1_gemv_streamed_best_gemm_only_over_roofline", best_stream_t / roofline_of(1), "x");
    variant(1, "_streamed", 1, true, 0, true);
    variant(2, "_streamed", 2, true, 0, true);
    variant(1, "_streamed_split", 1, true, size_t{64} << 20, true);
    run_variant(1, "_streamed_fused", fused(options(1, true, 0, true)));  // the merge only: no SwiGLU or RoPE GEMV streamed
    std::printf("# fastest batch-1 step: %s\n", best_b1_name.c_str());
    line("decode_b1_best_time_over_roofline", best_b1 / roofline_of(1), "x");
    f->set_launch_options(o.launch);
  }

  // Quantized weights decoded from their blocks (gemv_quant, up to 8 rows): the architecture as
  // llama.cpp's Q4_K_M and Q8_0 files hold it (random blocks, the head too; embeddings bf16), the
  // bf16 model freed first. Roofline: this model's bytes a step reads over the copy rate.
  if (device_lost) return;
  f.reset();
  for (const auto& [q, tag] : {std::pair{ec::synthetic_quant::q4_k_m, "q4_k_m"}, {ec::synthetic_quant::q8_0, "q8_0"}}) {
    const std::string b = std::string("decode_") + tag;
    try {
      auto qf = ec::cuda_forward::synthetic(hp, quant_options(o, q, 8, a.context));
      const double bytes = (double)qf->decode_bytes_per_token();
      line(b + "_weight_bytes", bytes / 1e9, "GB");
      // Plain, then with 4 and 8 units' loads in flight a lane (launch_options::quant_gemv_unroll),
      // then the fused launches (gemv_quant_swiglu in every layer, gemv_quant_rope_qkv where Q, K
      // and V share a type: the odd layers of the Q4_K_M mix, all of q8_0's; the norm folded into
      // the GEMVs; the attention merge).
      struct variant_q {
        int batch, unroll;
        bool fused;
      };
      for (const auto& [batch, unroll, fused] : {variant_q{1, 1, false}, {8, 1, false}, {1, 4, false}, {1, 8, false},
                                                 {8, 4, false}, {1, 1, true}, {1, 8, true}, {8, 1, true}}) {
        ec::launch_options l = fused ? ec::fused_decode(o.launch) : o.launch;
        l.quant_gemv_unroll = unroll;
        qf->set_launch_options(l);
        double t = decode_step_time(*qf, batch, a);
        for (int rep = 1; batch == 1 && rep < 3; ++rep) t = std::min(t, decode_step_time(*qf, batch, a));
        const double roofline = roofline_with((double)qf->step_weight_bytes(batch), batch);
        const std::string bb =
            b + "_b" + std::to_string(batch) + (unroll > 1 ? "_unroll" + std::to_string(unroll) : "") + (fused ? "_fused" : "");
        line(bb + "_step", t * 1e3, "ms");
        line(bb + "_tokens_per_s", batch / t, "tok/s");
        line(bb + "_time_over_roofline", t / roofline, "x");
      }
    } catch (const std::exception& e) {
      std::printf("# %s failed: %s\n", b.c_str(), e.what());
      if (!device_usable()) return;
    }
  }

  // Gemma 3 270M's shapes (bf16 weights made on the device): head_dim 256, one KV head, windows of
  // 512 positions in 15 of its 18 layers, their KV in groups of their own, at a context of 4096 so
  // that the windows bite. Roofline: the step's weight bytes, plus each sequence's KV read (the
  // whole context in the 3 global layers, the window in the others), over the copy rate.
  try {
    model_hparams g = synthetic_hparams("gemma3-270m");
    args ga = a;
    ga.context = 4096;
    if (a.smoke) g.n_layers = 6, g.n_vocab = 4096, g.d_ff = 512, g.sliding_window = 64, ga.context = 160;
    ec::cuda_options go = o;
    go.max_seqs = 64;
    go.max_context = ga.context;
    go.max_batch_tokens = 256;
    std::vector<bool> sliding((size_t)g.n_layers);
    for (int il = 0; il < g.n_layers; ++il) sliding[(size_t)il] = il % 6 < 5;
    const int groups = make_kv_shape(sliding, g.n_kv_heads, g.head_dim, go.block_size, g.sliding_window, true).n_groups;
    go.n_blocks = 64 * groups * kv_blocks_for(ga.context, go.block_size);  // decode_step_time's tables
    go.launch = ec::launch_options{};
    auto gf = ec::cuda_forward::synthetic(g, go);
    const double kv_pos_layer = 2.0 * g.n_kv_heads * g.head_dim * 2;  // K and V, fp16
    double kv_bytes = 0.0;  // one sequence's KV read in a step at the mean context of the timed steps
    for (int il = 0; il < g.n_layers; ++il)
      kv_bytes += kv_pos_layer * std::min(ga.context - ga.steps / 2.0, sliding[(size_t)il] ? (double)g.sliding_window : 1e30);
    line("decode_gemma3_270m_kv_groups", gf->kv().n_groups, "");
    for (int batch : {1, 64}) {
      const std::string b = "decode_gemma3_270m_b" + std::to_string(batch);
      const double t = decode_step_time(*gf, batch, ga);
      line(b + "_step", t * 1e3, "ms");
      line(b + "_tokens_per_s", batch / t, "tok/s");
      line(b + "_time_over_roofline", t / (((double)gf->step_weight_bytes(batch) + batch * kv_bytes) / bw), "x");
    }
  } catch (const std::exception& e) {
    std::printf("# decode_gemma3_270m failed: %s\n", e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time even into a file: a hang that scripts/gpu-check's timeout kills keeps every
  // figure printed before it.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    if (kc::device_count() == 0) {
      std::fprintf(stderr, "troupe_gpu_bench: no CUDA device\n");
      return 77;
    }
    run(parse(argc, argv));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_gpu_bench: %s\n", e.what());
    return 1;
  }
}
