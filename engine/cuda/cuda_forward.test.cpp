// The CUDA forward against the CPU forward (the reference): whole-model logits over a prefill and
// decode steps in a paged cache with non-contiguous block tables, greedy continuations, CUDA
// graph replays against eager runs, device sampling against the logits rows, KV block copies,
// synthetic weights, the errors, and the benchmark's read kernel (read_checksum).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/cuda_forward.hpp"
#include "kernels/thread_pool.hpp"

using namespace troupe::engine;
namespace ec = troupe::engine::cuda;
namespace kc = troupe::kernels::cuda;

namespace {

std::filesystem::path source_dir() {
  if (const char* env = std::getenv("TROUPE_SOURCE_DIR")) return env;
#ifdef TROUPE_SOURCE_DIR
  return TROUPE_SOURCE_DIR;
#else
  return std::filesystem::current_path();
#endif
}

// The model at `rel` under the source tree, or null (with a warning) where it is absent.
std::unique_ptr<model> load_model(const std::string& rel) {
  const auto path = source_dir() / rel;
  if (!std::filesystem::exists(path)) {
    WARN(rel + " missing: case skipped (scripts/setup.sh; generated fixtures: scripts/gen_tiny_model.py --preset all)");
    return nullptr;
  }
  return model::load(path.string());
}

// Prompt of exactly n tokens (the text's tokens repeated as needed).
std::vector<token_id> prompt(const model& m, const std::string& text, size_t n) {
  const std::vector<token_id> t = m.vocab().encode(text, true, false);
  std::vector<token_id> out;
  while (out.size() < n) out.push_back(t[out.size() % t.size()]);
  return out;
}

// max |gpu - cpu| / max(1e-6, max |cpu|) over one row.
double row_error(const float* gpu, const float* cpu, int n) {
  double err = 0.0, ref = 0.0;
  for (int i = 0; i < n; ++i) {
    err = std::max(err, (double)std::fabs(gpu[i] - cpu[i]));
    ref = std::max(ref, (double)std::fabs(cpu[i]));
  }
  return err / std::max(1e-6, ref);
}

int argmax(const float* row, int n) { return (int)(std::max_element(row, row + n) - row); }

ec::cuda_options small_options(int32_t n_blocks) {
  ec::cuda_options o;
  o.n_blocks = n_blocks;
  o.n_host_blocks = 4;
  o.max_seqs = 4;
  o.max_context = 1024;
  o.max_batch_tokens = 256;
  o.max_logit_rows = 16;  // a 41-row step pages through the output GEMM
  o.sync_timeout = std::chrono::milliseconds(60000);
  return o;
}

// The CPU reference and the GPU backend with the same number of blocks and the same KV layout
// (the GPU's: Gemma 3's sliding-window layers in groups of their own unless o.kv_window_groups is off).
struct pair_of_forwards {
  pair_of_forwards(const model& m, const ec::cuda_options& o) : gpu(m, o), kv(gpu.kv(), o.n_blocks), pool(2), cpu(m, kv, pool) {}
  ec::cuda_forward gpu;
  kv_storage kv;
  troupe::kernels::thread_pool pool;
  cpu_forward cpu;
};

// Sequence `seq`'s block table in the layout ks: `base` where there is one KV group; else one table
// of base's length per group, group after group, each a distinct run of a fixed shuffle of the
// n_blocks ids (so no two groups or sequences share a block).
std::vector<int32_t> in_groups(const kv_shape& ks, const std::vector<int32_t>& base, int32_t n_blocks, int seq) {
  if (ks.n_groups == 1) return base;
  std::vector<int32_t> ids((size_t)n_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  const size_t len = base.size(), first = (size_t)seq * ks.n_groups * len;
  REQUIRE(first + ks.n_groups * len <= ids.size());
  return {ids.begin() + (ptrdiff_t)first, ids.begin() + (ptrdiff_t)(first + ks.n_groups * len)};
}

// t with the sliding-window groups' blocks before the window of pos0 given back (-1), as the block
// manager leaves a table: neither backend may read them.
std::vector<int32_t> given_back(const kv_shape& ks, std::vector<int32_t> t, int64_t pos0) {
  const size_t len = t.size() / (size_t)ks.n_groups;
  const auto live = (size_t)(std::max<int64_t>(0, pos0 - ks.window + 1) / ks.block_size);
  for (int g = 1; g < ks.n_groups; ++g)
    for (size_t k = 0; k < std::min(live, len); ++k) t[(size_t)g * len + k] = -1;
  return t;
}

// Prefill of two sequences (40 tokens with every row's logits, 23 with the last) in one step, then
// 8 decode steps of both, in non-contiguous block tables; every logits row within tol of the CPU.
void compare_with_cpu(const model& m, const ec::cuda_options& o, double tol) {
  const int n_vocab = m.hparams().n_vocab;
  pair_of_forwards f(m, o);
  if (o.launch.gemv_fold_norm) CHECK(f.gpu.fold_norm(2));  // the decode steps below take the folded path
  std::vector<token_id> a = prompt(m, "Paged attention keeps every sequence in its own blocks, and the GPU", 40);
  std::vector<token_id> b = prompt(m, "def fibonacci(n):\n    if n < 2:", 23);
  const kv_shape& ks = f.gpu.kv();
  const std::vector<int32_t> ta = in_groups(ks, {37, 5, 22, 50}, o.n_blocks, 0), tb = in_groups(ks, {12, 40, 3, 61}, o.n_blocks, 1);

  double worst = 0.0;
  auto check_rows = [&](const std::vector<float>& gpu, const std::vector<float>& cpu, const char* step) {
    REQUIRE(gpu.size() == cpu.size());
    for (size_t r = 0; r < cpu.size() / (size_t)n_vocab; ++r) {
      const double e = row_error(&gpu[r * n_vocab], &cpu[r * n_vocab], n_vocab);
      worst = std::max(worst, e);
      INFO(step << " row " << r << ": normalized error " << e);
      CHECK(e <= tol);
    }
  };

  seq_chunk prefill[2] = {{a, 0, ta, true, false}, {b, 0, tb, false, false}};
  std::vector<float> cpu = f.cpu.forward(prefill);
  check_rows(f.gpu.forward(prefill), cpu, "prefill");
  for (int step = 0; step < 8; ++step) {
    const size_t rows = cpu.size() / (size_t)n_vocab;
    const token_id na = argmax(&cpu[(step == 0 ? a.size() - 1 : 0) * n_vocab], n_vocab);
    const token_id nb = argmax(&cpu[(rows - 1) * n_vocab], n_vocab);
    const token_id ta1[1] = {na}, tb1[1] = {nb};
    const std::vector<int32_t> live_a = given_back(ks, ta, (int64_t)a.size()), live_b = given_back(ks, tb, (int64_t)b.size());
    seq_chunk decode[2] = {{ta1, (int64_t)a.size(), live_a, false, false}, {tb1, (int64_t)b.size(), live_b, false, false}};
    a.push_back(na);
    b.push_back(nb);
    cpu = f.cpu.forward(decode);
    check_rows(f.gpu.forward(decode), cpu, "decode");
  }
  WARN("largest normalized logits error against the CPU: " << worst);
}

}  // namespace

TEST_CASE("CUDA forward: default model logits match the CPU over a prefill and 8 decode steps", "[cuda]") {
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  compare_with_cpu(*m, small_options(64), 5e-2);
}

TEST_CASE("CUDA forward: RMSNorm folded into the GEMVs (with the fused launches): default model logits match the CPU", "[cuda]") {
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  ec::cuda_options o = small_options(64);
  o.weights.mode = ec::weights_mode::bf16;  // every layer GEMV of the 2-row decode steps is gemv_bf16
  o.launch.bf16_gemv_rows = 8;
  o.launch.gemv_fold_norm = true;
  SECTION("fold alone") { compare_with_cpu(*m, o, 5e-2); }
  SECTION("fold, SwiGLU and RoPE GEMVs, last-CTA merge, prefetch") {
    o.launch.gemv_swiglu = o.launch.attention_last_cta_merge = o.launch.gemv_rope = true;
    o.launch.bf16_gemv_prefetch_bytes = 2048;
    compare_with_cpu(*m, o, 5e-2);
  }
}

TEST_CASE("CUDA forward: generated models (quantized GEMV decode, qwen2 biases and neox rope, f32)", "[cuda]") {
  for (const char* name : {"llama_q4_k", "qwen2_q6_k_gqa4", "llama_q4_k_m", "llama_f32_hd64", "llama_q4_k_bf16", "llama_q4_k_bf16_gemv",
                           "llama_q4_k_bf16_gemv_split", "llama_q4_k_bf16_gemv_streamed", "llama_q4_k_bf16_gemv_fused",
                           "llama_q4_k_bf16_gemv_fold", "llama_q4_k_bf16_gemv_fold_fused", "qwen2_q6_k_gqa4_bf16_gemv_fold_fused"}) {
    const std::string file = std::string(name).substr(0, std::string(name).find("_bf16"));  // "_bf16...": variants
    const bool bf16_mode = file != name;
    const auto m = load_model("tests/fixtures/generated/" + file + ".gguf");
    if (!m) continue;
    SECTION(name) {
      ec::cuda_options o = small_options(64);
      if (bf16_mode) o.weights.mode = ec::weights_mode::bf16;
      o.launch.bf16_gemv_rows = std::string(name).find("_gemv") != std::string::npos ? 8 : 0;  // decode through gemv_bf16
      if (std::string(name).ends_with("_split"))  // ... for the matrices up to O's size, cuBLASLt for the larger ones
        o.launch.bf16_gemv_max_bytes = (size_t)m->hparams().d_model * m->hparams().n_heads * m->hparams().head_dim * 2;
      o.launch.bf16_gemv_streamed = std::string(name).ends_with("_streamed");  // 2-row decode steps, rows of 256k
      o.launch.gemv_swiglu = o.launch.attention_last_cta_merge = o.launch.gemv_rope = std::string(name).ends_with("_fused");
      o.launch.gemv_fold_norm = std::string(name).find("_fold") != std::string::npos;  // RMSNorm in the GEMVs
      compare_with_cpu(*m, o, 5e-2);
    }
  }
}

TEST_CASE("CUDA forward: quantized weights kept raw only still run batches above the GEMV limit", "[cuda]") {
  const auto m = load_model("tests/fixtures/generated/llama_q4_k.gguf");
  if (!m) return;
  ec::cuda_options o = small_options(64);
  o.weights.expand_quant = false;
  compare_with_cpu(*m, o, 5e-2);
}

TEST_CASE("CUDA forward: a Q4_K_M mix (q4_k layers, q6_k V and down in some) decodes from the file's blocks", "[cuda]") {
  const auto m = load_model("tests/fixtures/generated/llama_q4_k_m.gguf");
  if (!m) return;
  REQUIRE(m->layer(0).wv.type != m->layer(0).wq.type);  // a fused Q|K|V of two types
  REQUIRE(m->layer(0).w_down.type != m->layer(1).w_down.type);
  // Every layer matrix and the head kept as blocks: the bytes a batch-1 step reads fall from the
  // bf16 mode's by exactly their bf16 size less their size in the file.
  const troupe::kernels::weight_view& head = m->output();  // q6_k: read as blocks by one-row steps too
  size_t file_bytes = head.row_stride * (size_t)head.n_out, bf16_bytes = (size_t)(head.n_out * head.n_in) * 2;
  for (int il = 0; il < m->hparams().n_layers; ++il) {
    const layer_weights& L = m->layer(il);
    for (const auto* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      file_bytes += w->row_stride * (size_t)w->n_out;
      bf16_bytes += (size_t)(w->n_out * w->n_in) * 2;
    }
  }
  ec::cuda_options quant = small_options(64), bf16 = quant;
  bf16.weights.mode = ec::weights_mode::bf16;
  const size_t b = ec::cuda_forward(*m, bf16).decode_bytes_per_token();
  {
    const ec::cuda_forward f(*m, quant);
    const size_t q = f.decode_bytes_per_token();
    CHECK(b - q == bf16_bytes - file_bytes);
    // Steps of up to 8 rows read the blocks; larger ones every matrix in bf16, as the bf16 mode.
    CHECK(f.step_weight_bytes(1) == q);
    CHECK(f.step_weight_bytes(8) == q);
    CHECK(f.step_weight_bytes(9) == b);
  }
  SECTION("blocks only: steps above the GEMV limit expand them part by part") {
    quant.weights.expand_quant = false;
    compare_with_cpu(*m, quant, 5e-2);
  }
  SECTION("4 or 8 units' loads in flight a lane: the same logits bit for bit") {
    const std::vector<token_id> seq = {3, 77, 41, 200, 9};
    const std::vector<int32_t> table = {0};
    seq_chunk prefill{std::span(seq).first(4), 0, table, false};
    const token_id last[1] = {seq.back()};
    seq_chunk step{last, 4, table, false};
    std::vector<std::vector<float>> logits;
    for (const int unroll : {1, 4, 8}) {
      quant.launch.quant_gemv_unroll = unroll;
      ec::cuda_forward f(*m, quant);
      f.forward(std::span(&prefill, 1));
      logits.push_back(f.forward(std::span(&step, 1)));  // one row: gemv_quant, the head's too
    }
    CHECK(logits[1] == logits[0]);
    CHECK(logits[2] == logits[0]);
  }
  SECTION("the fused launches on the blocks (SwiGLU GEMV in every layer, RoPE GEMV in the layer whose Q, K, V share a type): the same logits bit for bit") {
    REQUIRE(m->layer(1).wv.type == m->layer(1).wq.type);
    ec::cuda_options fused_o = quant;
    fused_o.launch = ec::fused_decode(quant.launch);
    fused_o.launch.gemv_fold_norm = false;  // the one fusion that rounds differently (below)
    fused_o.launch.quant_gemv_unroll = 4;
    ec::cuda_forward plain(*m, quant), fused(*m, fused_o);
    const int n_vocab = m->hparams().n_vocab;
    std::vector<std::vector<token_id>> seqs = {prompt(*m, "Quantized blocks, fused launches", 19), prompt(*m, "def f(x):", 7)};
    const std::vector<std::vector<int32_t>> tables = {{5, 2}, {9}};
    std::vector<seq_chunk> batch;
    for (size_t s = 0; s < seqs.size(); ++s) batch.push_back({seqs[s], 0, tables[s]});
    std::vector<float> a = plain.forward(batch);
    REQUIRE(a == fused.forward(batch));
    for (int step = 0; step < 6; ++step) {
      const size_t n_seqs = step < 3 ? 2 : 1;  // two rows, then one (another graph bucket)
      batch.clear();
      for (size_t s = 0; s < n_seqs; ++s) {
        seqs[s].push_back(argmax(&a[s * n_vocab], n_vocab));  // one logits row a sequence
        batch.push_back({std::span(seqs[s]).last(1), (int64_t)seqs[s].size() - 1, tables[s]});
      }
      a = plain.forward(batch);
      INFO("decode step " << step);
      REQUIRE(a == fused.forward(batch));
    }
    CHECK(fused.graph_error().empty());
  }
  SECTION("every fusion, the RMSNorm folded into the quantized GEMVs: logits within 5e-2 of the CPU") {
    quant.launch = ec::fused_decode(quant.launch);
    quant.launch.quant_gemv_unroll = 8;
    REQUIRE(ec::cuda_forward(*m, quant).fold_norm(8));
    REQUIRE_FALSE(ec::cuda_forward(*m, quant).fold_norm(9));  // cuBLASLt over the expansion: no fold
    compare_with_cpu(*m, quant, 5e-2);
  }
}

namespace {

// 24 greedy tokens after a 30-token prompt: the CPU's argmax against the device's sampler.
void greedy_matches_cpu(const model& m) {
  const int n_vocab = m.hparams().n_vocab;
  pair_of_forwards f(m, small_options(64));
  const std::vector<token_id> p = prompt(m, "The three largest cities of France are Paris,", 30);
  const kv_shape& ks = f.gpu.kv();
  const std::vector<int32_t> table = in_groups(ks, {9, 31, 2, 44, 17}, 64, 0);

  // CPU: argmax of its logits; every step's row kept to judge a disagreement.
  std::vector<token_id> cpu_tokens;
  std::vector<std::vector<float>> cpu_rows;
  {
    std::vector<token_id> seq = p;
    seq_chunk c{seq, 0, table};
    std::vector<float> row = f.cpu.forward(std::span(&c, 1));
    for (int i = 0; i < 24; ++i) {
      const token_id t = argmax(row.data(), n_vocab);
      cpu_tokens.push_back(t);
      cpu_rows.push_back(row);
      seq.push_back(t);
      const std::vector<int32_t> live = given_back(ks, table, (int64_t)seq.size() - 1);
      seq_chunk d{std::span(seq).last(1), (int64_t)seq.size() - 1, live};
      row = f.cpu.forward(std::span(&d, 1));
    }
  }
  // GPU: sampled on the device, greedy.
  std::vector<token_id> gpu_tokens;
  {
    kc::sample_row_params greedy;
    greedy.temperature = 0.0f;
    std::vector<token_id> seq = p;
    seq_chunk c{seq, 0, table};
    token_id t = f.gpu.forward_sample(std::span(&c, 1), std::span(&greedy, 1))[0];
    for (int i = 0; i < 24; ++i) {
      gpu_tokens.push_back(t);
      seq.push_back(t);
      if (i == 23) break;
      const std::vector<int32_t> live = given_back(ks, table, (int64_t)seq.size() - 1);
      seq_chunk d{std::span(seq).last(1), (int64_t)seq.size() - 1, live};
      t = f.gpu.forward_sample(std::span(&d, 1), std::span(&greedy, 1))[0];
    }
  }
  // Identical, except at a near tie on the CPU side: logits within the 5e-2 bound of the logits
  // test can swap two tokens whose CPU logits differ by less than that much of the largest one.
  // The sequences differ after such a swap, so the comparison stops there.
  for (size_t i = 0; i < cpu_tokens.size(); ++i) {
    if (gpu_tokens[i] == cpu_tokens[i]) continue;
    const std::vector<float>& row = cpu_rows[i];
    const float top = row[(size_t)cpu_tokens[i]];
    const float margin = top - row[(size_t)gpu_tokens[i]];
    float scale = 0.0f;
    for (float v : row) scale = std::max(scale, std::fabs(v));
    INFO("token " << i << ": CPU " << cpu_tokens[i] << ", GPU " << gpu_tokens[i] << ", CPU margin " << margin);
    REQUIRE(margin <= 5e-2f * scale);
    WARN("greedy paths part at a near tie, token " << i);
    break;
  }
}

}  // namespace

TEST_CASE("CUDA forward: greedy continuation of 24 tokens matches the CPU", "[cuda]") {
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  greedy_matches_cpu(*m);
}

// Gemma 3's parts on the device: embeddings x sqrt(d), QK-norm, the norms of each block's output,
// GeGLU, head_dim 256 (Gemma 3 270M's 4 query heads over one KV head), and sliding windows of 24
// positions in 5 of the 6 layers, which the 40-token prefill and the decode steps pass (the
// fixture's CPU logits are within 2.6e-4 of tests/python/gemma3_ref.py's float64 forward).
TEST_CASE("CUDA forward: Gemma 3 (head_dim 256, QK-norm, sandwich norms, GeGLU, sliding windows) matches the CPU", "[cuda]") {
  const auto m = load_model("tests/fixtures/generated/gemma3_bf16_hd256.gguf");
  if (!m) return;
  REQUIRE(m->hparams().gemma);
  REQUIRE(m->hparams().sliding_window == 24);
  ec::cuda_options o = small_options(64);
  SECTION("logits over a prefill and 8 decode steps, the windows' KV in groups of their own") {
    pair_of_forwards f(*m, o);
    CHECK(f.gpu.kv().n_groups == 6);  // the global layer, and one group per sliding-window layer
    CHECK(f.gpu.kv().n_layers == 1);
    compare_with_cpu(*m, o, 5e-2);
  }
  SECTION("one KV group: every layer keeps every position (--swa-full)") {
    o.kv_window_groups = false;
    pair_of_forwards f(*m, o);
    CHECK(f.gpu.kv().n_groups == 1);
    compare_with_cpu(*m, o, 5e-2);
  }
  SECTION("decode rows split inside the window (7 positions a split)") {
    o.launch.attention_kv_per_split = 7;
    compare_with_cpu(*m, o, 5e-2);
  }
  SECTION("the Llama-family fusions asked for are not taken: logits as without them") {
    o.weights.mode = ec::weights_mode::bf16;
    o.launch.bf16_gemv_rows = 8;
    o.launch.gemv_swiglu = o.launch.gemv_rope = o.launch.gemv_fold_norm = o.launch.attention_last_cta_merge = true;
    pair_of_forwards f(*m, o);
    CHECK_FALSE(f.gpu.fold_norm(1));
    o.launch.gemv_fold_norm = false;  // compare_with_cpu checks that a fold asked for applies
    compare_with_cpu(*m, o, 5e-2);
  }
  SECTION("greedy continuation") { greedy_matches_cpu(*m); }
}

TEST_CASE("CUDA forward: decode steps replayed from CUDA graphs equal eager runs bit for bit", "[cuda]") {
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  const int n_vocab = m->hparams().n_vocab;
  ec::cuda_options o = small_options(64);
  ec::cuda_options eager_o = o, plain_o = o;
  eager_o.use_graphs = false;
  plain_o.launch.pdl = false;  // ordinary launches: the same kernels, so the same results
  ec::cuda_forward graph(*m, o), eager(*m, eager_o), plain(*m, plain_o);

  std::vector<std::vector<token_id>> seqs = {prompt(*m, "One two three four five", 17), prompt(*m, "Hello there, general", 5),
                                             prompt(*m, "Le petit prince dit", 33)};
  const std::vector<std::vector<int32_t>> tables = {{3, 7, 11}, {20, 1, 8}, {30, 15, 40, 2}};
  std::vector<seq_chunk> batch;
  for (size_t s = 0; s < seqs.size(); ++s) batch.push_back({seqs[s], 0, tables[s]});
  std::vector<float> a = graph.forward(batch);
  REQUIRE(a == eager.forward(batch));
  REQUIRE(a == plain.forward(batch));
  for (int step = 0; step < 6; ++step) {
    std::vector<token_id> next(seqs.size());
    for (size_t s = 0; s < seqs.size(); ++s) next[s] = argmax(&a[s * n_vocab], n_vocab);
    batch.clear();
    for (size_t s = 0; s < seqs.size(); ++s) {
      seqs[s].push_back(next[s]);
      batch.push_back({std::span(seqs[s]).last(1), (int64_t)seqs[s].size() - 1, tables[s]});
    }
    if (step == 3) plain.set_launch_options({8, 1 << 20, false, {}, true});  // programmatic launches, gemv_bf16 for the
                                                                  // matrices up to 1 MiB, new graphs
    a = graph.forward(batch);
    INFO("decode step " << step);
    REQUIRE(a == eager.forward(batch));
    const std::vector<float>& b = plain.forward(batch);
    if (step < 3) {
      REQUIRE(a == b);
    } else {  // where bf16 matrices go through gemv_bf16, it sums in another order than cuBLASLt: close
      for (size_t s = 0; s < seqs.size(); ++s) CHECK(row_error(&b[s * n_vocab], &a[s * n_vocab], n_vocab) < 5e-2);
    }
  }
  CHECK(plain.graph_error().empty());
  CHECK(plain.n_graphs() >= 1);
  INFO("graph_error: " << graph.graph_error());
  CHECK(graph.graph_error().empty());
  CHECK(graph.n_graphs() >= 1);
  CHECK(eager.n_graphs() == 0);
}

TEST_CASE("CUDA forward: fused launches (GEMVs with SwiGLU and with RoPE, last-CTA attention merge, prefetch) equal the unfused bit for bit", "[cuda]") {
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  const int n_vocab = m->hparams().n_vocab;
  ec::cuda_options o = small_options(64);
  o.weights.mode = ec::weights_mode::bf16;  // no raw q4_1 matrices: every layer GEMV is gemv_bf16
  o.launch.bf16_gemv_rows = 8;              // decode steps of up to 8 rows through gemv_bf16
  ec::cuda_options fused_o = o;
  fused_o.launch.gemv_swiglu = true;
  fused_o.launch.attention_last_cta_merge = true;
  fused_o.launch.gemv_rope = true;
  fused_o.launch.bf16_gemv_prefetch_bytes = 2048;  // L2 prefetch changes no value either
  ec::cuda_forward plain(*m, o), fused(*m, fused_o);

  // Contexts past 64 positions, so decode attention splits (and merges) in every layer; replayed
  // graphs run the counted merge again and again on the same counters.
  std::vector<std::vector<token_id>> seqs = {prompt(*m, "One two three four five", 66), prompt(*m, "Hello there, general", 80),
                                             prompt(*m, "Le petit prince dit", 100)};  // 246 <= max_batch_tokens
  const std::vector<std::vector<int32_t>> tables = {{3, 7, 11, 50, 51}, {20, 1, 8, 9, 10, 12},
                                                    {30, 31, 32, 33, 34, 35, 36}};
  std::vector<seq_chunk> batch;
  for (size_t s = 0; s < seqs.size(); ++s) batch.push_back({seqs[s], 0, tables[s]});
  std::vector<float> a = plain.forward(batch);
  REQUIRE(a == fused.forward(batch));
  for (int step = 0; step < 8; ++step) {
    const size_t n_seqs = step < 4 ? seqs.size() : 1;  // 3 rows, then 1 (another graph bucket)
    std::vector<token_id> next(n_seqs);
    for (size_t s = 0; s < n_seqs; ++s) next[s] = argmax(&a[s * n_vocab], n_vocab);
    batch.clear();
    for (size_t s = 0; s < n_seqs; ++s) {
      seqs[s].push_back(next[s]);
      batch.push_back({std::span(seqs[s]).last(1), (int64_t)seqs[s].size() - 1, tables[s]});
    }
    a = plain.forward(batch);
    INFO("decode step " << step);
    REQUIRE(a == fused.forward(batch));
  }
  CHECK(fused.graph_error().empty());
  CHECK(fused.n_graphs() >= 2);
}

TEST_CASE("CUDA forward: copy_blocks moves blocks device -> host -> device byte for byte", "[cuda]") {
  ec::cuda_options o = small_options(16);
  auto f = ec::cuda_forward::synthetic("smollm2-135m", o);
  const size_t bb = (size_t)f->kv().block_bytes();
  auto* dev = reinterpret_cast<std::byte*>(f->kv_view().base);
  std::mt19937_64 g(std::random_device{}());
  std::vector<std::byte> src(3 * bb);
  for (auto& x : src) x = (std::byte)(g() & 0xff);
  kc::check(cudaMemcpy(dev + 3 * bb, src.data(), 3 * bb, cudaMemcpyHostToDevice), "upload");  // blocks 3, 4, 5
  kc::check(cudaDeviceSynchronize(), "sync");

  using k = block_copy::kind;
  const std::vector<block_copy> ops = {
      {k::device_to_host, 3, 1}, {k::host_to_device, 1, 7}, {k::device_to_device, 7, 9},   // one block, three hops
      {k::device_to_host, 4, 2}, {k::device_to_host, 5, 3},                                // a coalesced run
      {k::host_to_device, 2, 12}, {k::host_to_device, 3, 13},                              // and back
      {k::device_to_device, 12, 13},                                                       // overwritten in order
  };
  f->copy_blocks(ops);
  f->synchronize();
  auto block = [&](int32_t b) {
    std::vector<std::byte> out(bb);
    kc::check(cudaMemcpy(out.data(), dev + (size_t)b * bb, bb, cudaMemcpyDeviceToHost), "download");
    return out;
  };
  auto same = [&](const std::vector<std::byte>& got, size_t src_block) { return std::memcmp(got.data(), src.data() + src_block * bb, bb) == 0; };
  CHECK(std::memcmp(f->host_block(1), src.data(), bb) == 0);
  CHECK(same(block(7), 0));
  CHECK(same(block(9), 0));
  CHECK(same(block(12), 1));
  CHECK(same(block(13), 1));  // the last op copied 12 over 13
  CHECK(std::memcmp(f->host_block(3), src.data() + 2 * bb, bb) == 0);

  const block_copy bad[1] = {{k::device_to_host, 0, 4}};  // host pool has blocks 0..3
  CHECK_THROWS_AS(f->copy_blocks(bad), std::invalid_argument);
}

TEST_CASE("CUDA forward: a sequence swapped out and back into other blocks decodes as before", "[cuda]") {
  // The preemption path, four times over: KV blocks copied to the host and back (on the copy
  // stream) into other device blocks, then a decode step over the new table (on the compute
  // stream, which must wait for the copies). Each decode must match the CPU's over the blocks it
  // never moved. (Under the CPU emulation, a step that skipped the wait fails each round with odds
  // of about a third: the emulated device runs the streams in a random order.)
  const auto m = load_model("models/default.gguf");
  if (!m) return;
  const int n_vocab = m->hparams().n_vocab;
  pair_of_forwards f(*m, small_options(32));
  std::vector<token_id> seq = prompt(*m, "Swapped out under memory pressure, the sequence waits on the host", 24);
  const std::vector<int32_t> cpu_table = {3, 7};
  const std::vector<std::vector<int32_t>> gpu_tables = {{3, 7}, {20, 21}, {9, 12}, {30, 2}, {14, 15}};
  seq_chunk c{seq, 0, cpu_table};
  std::vector<float> cpu = f.cpu.forward(std::span(&c, 1));
  REQUIRE(row_error(f.gpu.forward(std::span(&c, 1)).data(), cpu.data(), n_vocab) <= 5e-2);

  using k = block_copy::kind;
  for (size_t round = 1; round < gpu_tables.size(); ++round) {
    const std::vector<int32_t>& from = gpu_tables[round - 1];
    const std::vector<int32_t>& to = gpu_tables[round];
    const std::vector<block_copy> out = {{k::device_to_host, from[0], 0}, {k::device_to_host, from[1], 1}};
    const std::vector<block_copy> in = {{k::host_to_device, 0, to[0]}, {k::host_to_device, 1, to[1]}};
    f.gpu.copy_blocks(out);
    f.gpu.copy_blocks(in);  // no synchronize(): the step's own waits must order it after the copies

    seq.push_back(argmax(cpu.data(), n_vocab));
    const seq_chunk cpu_step{std::span(seq).last(1), (int64_t)seq.size() - 1, cpu_table};
    const seq_chunk gpu_step{std::span(seq).last(1), (int64_t)seq.size() - 1, to};
    cpu = f.cpu.forward(std::span(&cpu_step, 1));
    const double e = row_error(f.gpu.forward(std::span(&gpu_step, 1)).data(), cpu.data(), n_vocab);
    INFO("decode after swap " << round << ": normalized error " << e);
    CHECK(e <= 5e-2);
  }
}

TEST_CASE("read_checksum XORs every 32-bit word once (the bench's read-bandwidth kernel)", "[cuda]") {
  std::mt19937_64 g(std::random_device{}());
  // 62,501 vectors: not a multiple of any grid's trip (4 x 256 x CTAs), so the tail loop runs.
  const size_t words = 4 * 62501;
  std::vector<uint32_t> host(words);
  for (auto& w : host) w = (uint32_t)g();
  ec::device_buffer d(words * 4, "read_checksum input"), sum(4, "read_checksum output");
  kc::check(cudaMemcpy(d.as<void>(), host.data(), words * 4, cudaMemcpyHostToDevice), "upload");
  for (const size_t n : {size_t{0}, size_t{4}, size_t{1024}, words}) {  // words: a prefix of the buffer
    uint32_t want = 0;
    for (size_t i = 0; i < n; ++i) want ^= host[i];
    for (const int ctas : {1, 3, 264}) {
      INFO("words " << n << " ctas " << ctas);
      kc::check(cudaMemset(sum.as<void>(), 0, 4), "cudaMemset");
      ec::read_checksum(d.as<void>(), n * 4, sum.as<uint32_t>(), ctas, nullptr);
      uint32_t got = 0;
      kc::check(cudaMemcpy(&got, sum.as<void>(), 4, cudaMemcpyDeviceToHost), "download");
      CHECK(got == want);
    }
  }
  CHECK_THROWS_AS(ec::read_checksum(d.as<void>(), 12, sum.as<uint32_t>(), 1, nullptr), kc::cuda_error);
  CHECK_THROWS_AS(ec::read_checksum(d.as<char>() + 4, 16, sum.as<uint32_t>(), 1, nullptr), kc::cuda_error);
}

TEST_CASE("CUDA forward: synthetic weights run and give finite logits", "[cuda]") {
  auto f = ec::cuda_forward::synthetic("smollm2-135m", small_options(32));
  const int n_vocab = f->hparams().n_vocab;
  std::mt19937 g(7);
  std::vector<token_id> seq(21);
  for (auto& t : seq) t = (token_id)(g() % (unsigned)n_vocab);
  const std::vector<int32_t> table = {4, 9};
  seq_chunk c{seq, 0, table, true};
  const std::vector<float>& l = f->forward(std::span(&c, 1));
  REQUIRE(l.size() == seq.size() * (size_t)n_vocab);
  CHECK(std::all_of(l.begin(), l.end(), [](float v) { return std::isfinite(v); }));
  kc::sample_row_params sp;
  sp.seed = 42;
  for (int i = 0; i < 3; ++i) {
    const token_id last[1] = {seq.back()};
    seq_chunk d{last, (int64_t)seq.size(), table};
    const auto t = f->forward_sample(std::span(&d, 1), std::span(&sp, 1));
    REQUIRE(t.size() == 1);
    CHECK((t[0] >= 0 && t[0] < n_vocab));
    seq.push_back(t[0]);
    ++sp.draw;
  }
  CHECK_THROWS_AS(ec::cuda_forward::synthetic("gpt-5", small_options(4)), std::invalid_argument);
}

TEST_CASE("CUDA forward: synthetic quantized weights (Q4_K_M's mix, q8_0) decode from their blocks as their expansion does", "[cuda]") {
  model_hparams hp = synthetic_hparams("llama-3-8b");  // cut: rows of 512 and 1024, 512 tokens
  hp.n_layers = 2, hp.d_model = 512, hp.n_heads = 4, hp.n_kv_heads = 2, hp.d_ff = 1024, hp.n_vocab = 512;
  const int64_t d = hp.d_model, qd = hp.n_heads * hp.head_dim, kvd = hp.n_kv_heads * hp.head_dim, ff = hp.d_ff;
  ec::cuda_options o = small_options(8);
  const size_t bf16_bytes = ec::cuda_forward::synthetic(hp, o)->decode_bytes_per_token();
  for (const auto q : {ec::synthetic_quant::q4_k_m, ec::synthetic_quant::q8_0}) {
    INFO((q == ec::synthetic_quant::q4_k_m ? "q4_k_m" : "q8_0"));
    o.synthetic_weights = q;
    auto f = ec::cuda_forward::synthetic(hp, o);
    // Every layer matrix and the head held as blocks: the bytes a batch-1 step reads fall from the
    // bf16 model's by their bf16 size less their blocks' (layer 0: V and down in q6_k under
    // Q4_K_M, and the head).
    size_t blocks = kc::quant_row_bytes(q == ec::synthetic_quant::q8_0 ? kc::quant_type::q8_0 : kc::quant_type::q6_k, d) *
                    (size_t)hp.n_vocab;
    for (int il = 0; il < hp.n_layers; ++il) {
      const auto base = q == ec::synthetic_quant::q8_0 ? kc::quant_type::q8_0 : kc::quant_type::q4_k;
      const auto more = q == ec::synthetic_quant::q4_k_m && il % 2 == 0 ? kc::quant_type::q6_k : base;
      blocks += kc::quant_row_bytes(base, d) * (size_t)(qd + kvd + 2 * ff) + kc::quant_row_bytes(more, d) * (size_t)kvd +
                kc::quant_row_bytes(base, qd) * (size_t)d + kc::quant_row_bytes(more, ff) * (size_t)d;
    }
    const size_t matrices_bf16 =
        (size_t)hp.n_layers * (size_t)(d * (qd + 2 * kvd) + qd * d + 2 * ff * d + ff * d) * 2 + (size_t)(hp.n_vocab * d) * 2;
    CHECK(bf16_bytes - f->decode_bytes_per_token() == matrices_bf16 - blocks);
    // Position 11's logits: from a 12-token prefill (cuBLASLt over the bf16 expansion), and from an
    // 11-token prefill then a one-token decode step (gemv_quant over the blocks).
    const int n_vocab = hp.n_vocab;
    std::vector<token_id> seq(12);
    for (size_t i = 0; i < seq.size(); ++i) seq[i] = (token_id)((37 * i + 5) % (size_t)n_vocab);
    const std::vector<int32_t> ta = {1}, tb = {2};
    seq_chunk whole{seq, 0, ta, false};
    const std::vector<float> a = f->forward(std::span(&whole, 1));
    REQUIRE(a.size() == (size_t)n_vocab);
    CHECK(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
    const std::vector<token_id> head(seq.begin(), seq.end() - 1);
    seq_chunk first{head, 0, tb, false};
    f->forward(std::span(&first, 1));
    const token_id last[1] = {seq.back()};
    seq_chunk step{last, (int64_t)head.size(), tb, false};
    const std::vector<float> b = f->forward(std::span(&step, 1));
    REQUIRE(b.size() == (size_t)n_vocab);
    CHECK(row_error(b.data(), a.data(), n_vocab) <= 5e-2);
  }
  o.synthetic_weights = ec::synthetic_quant::q4_k_m;  // smollm2's d_model 576 is not whole q4_k blocks
  CHECK_THROWS_AS(ec::cuda_forward::synthetic("smollm2-135m", o), std::invalid_argument);
}

TEST_CASE("CUDA forward: a dummy model's weights are the synthetic ones of its seed, made on the device", "[cuda]") {
  const auto path = source_dir() / "tests/fixtures/generated/llama_f32_hd64.gguf";
  if (!std::filesystem::exists(path)) {
    WARN("llama_f32_hd64.gguf missing: case skipped (scripts/gen_tiny_model.py --preset all)");
    return;
  }
  auto dummy = model::load(path.string(), {.dummy = true, .seed = 11, .host_weights = false});
  REQUIRE_FALSE(dummy->has_host_weights());  // nothing to upload: the device generates them
  ec::cuda_options o = small_options(8);
  ec::cuda_forward from_model(*dummy, o);
  o.synthetic_seed = 11;
  auto same = ec::cuda_forward::synthetic(dummy->hparams(), o);
  o.synthetic_seed = 12;
  auto other = ec::cuda_forward::synthetic(dummy->hparams(), o);
  const std::vector<token_id> seq = {1, 7, 42, 99, 250, 3};
  const std::vector<int32_t> table = {2};
  seq_chunk c{seq, 0, table, true};
  const std::vector<float> a = from_model.forward(std::span(&c, 1));
  REQUIRE(a.size() == seq.size() * (size_t)dummy->hparams().n_vocab);
  CHECK(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
  CHECK(a == same->forward(std::span(&c, 1)));
  CHECK(a != other->forward(std::span(&c, 1)));
}

TEST_CASE("CUDA forward: forward_sample greedy equals the argmax of the forward logits, row for row", "[cuda]") {
  // Gathered prefill rows (all, none and last-only chunks), then a decode of 5 sequences padded to
  // a bucket of 8 with a no-logits row: forward() runs each step eagerly (capturing the decode),
  // forward_sample() reruns it (the decode from the graph) and must map every row back.
  ec::cuda_options o = small_options(16);
  o.max_seqs = 8;
  auto f = ec::cuda_forward::synthetic("smollm2-135m", o);
  const int n_vocab = f->hparams().n_vocab;
  std::mt19937 g(11);
  auto random_tokens = [&](size_t n) {
    std::vector<token_id> t(n);
    for (auto& x : t) x = (token_id)(g() % (unsigned)n_vocab);
    return t;
  };
  const std::vector<std::vector<int32_t>> tables = {{0}, {1}, {2}, {3}, {4}};
  auto check_step = [&](std::span<const seq_chunk> batch, const char* step) {
    const std::vector<float> logits = f->forward(batch);
    const size_t rows = logits.size() / (size_t)n_vocab;
    kc::sample_row_params greedy;
    greedy.temperature = 0.0f;
    const std::vector<kc::sample_row_params> params(rows, greedy);
    const std::vector<int32_t> got = f->forward_sample(batch, params);
    REQUIRE(got.size() == rows);
    for (size_t r = 0; r < rows; ++r) {
      INFO(step << " row " << r);
      CHECK(got[r] == argmax(&logits[r * (size_t)n_vocab], n_vocab));
    }
    return rows;
  };
  const std::vector<token_id> a = random_tokens(5), b = random_tokens(7), c = random_tokens(9);
  const seq_chunk prefill[3] = {{a, 0, tables[0], true, false}, {b, 0, tables[1], false, true}, {c, 0, tables[2]}};
  CHECK(check_step(prefill, "prefill") == 6);
  const std::vector<token_id> next = random_tokens(5);
  const int64_t pos[5] = {5, 7, 9, 0, 0};
  std::vector<seq_chunk> decode;
  for (size_t s = 0; s < 5; ++s) decode.push_back({std::span(&next[s], 1), pos[s], tables[s], false, s == 1});
  CHECK(check_step(decode, "decode") == 4);
  CHECK(f->n_graphs() == 1);
}

TEST_CASE("CUDA forward: errors are reported, not hung or crashed on", "[cuda]") {
  ec::cuda_options bad_device = small_options(4);
  bad_device.device = 1000;
  CHECK_THROWS_AS(ec::cuda_forward::synthetic("smollm2-135m", bad_device), kc::cuda_error);

  ec::cuda_options huge = small_options(1 << 30);  // 2^30 blocks: far beyond any device
  try {
    ec::cuda_forward::synthetic("smollm2-135m", huge);
    FAIL("allocation of 2^30 KV blocks succeeded");
  } catch (const kc::cuda_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("asked") != std::string::npos);
    CHECK(what.find("free") != std::string::npos);
  }

  auto f = ec::cuda_forward::synthetic("smollm2-135m", small_options(8));
  const std::vector<int32_t> table = {1};
  const token_id out_of_vocab[1] = {f->hparams().n_vocab};
  seq_chunk c{out_of_vocab, 0, table};
  CHECK_THROWS_AS(f->forward(std::span(&c, 1)), std::invalid_argument);
  const token_id ok[1] = {1};
  const std::vector<int32_t> bad_table = {8};  // blocks are 0..7
  seq_chunk d{ok, 0, bad_table};
  CHECK_THROWS_AS(f->forward(std::span(&d, 1)), std::invalid_argument);
  seq_chunk e{ok, 16, table};  // position 16 needs a second block
  CHECK_THROWS_AS(f->forward(std::span(&e, 1)), std::invalid_argument);
  // Still usable after refused requests.
  seq_chunk good{ok, 0, table};
  CHECK(f->forward(std::span(&good, 1)).size() == (size_t)f->hparams().n_vocab);
}
