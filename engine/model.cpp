#include "engine/model.hpp"

#include <cmath>

#include "kernels/dequant.hpp"

namespace troupe::engine {

namespace {

[[noreturn]] void fail(const gguf_file& f, const std::string& what) { throw gguf_error(f.path() + ": " + what); }

int64_t require_int(const gguf_file& f, const std::string& key) {
  auto v = f.get_int(key);
  if (!v) fail(f, "missing metadata key '" + key + "'");
  if (*v <= 0 || *v > (1LL << 31)) fail(f, "metadata key '" + key + "' has an impossible value " + std::to_string(*v));
  return *v;
}

// A matrix of n_out rows of n_in weights, viewed in the file; q5_0 is repacked into `owned` as
// q8_0 (the same values exactly), the type the matmul kernels read.
kernels::weight_view matrix(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out,
                            std::vector<std::unique_ptr<uint8_t[]>>& owned) {
  const int64_t ne[2] = {n_in, n_out};
  const gguf_tensor& t = f.tensor(name, ne);
  kernels::weight_view w;
  w.type = t.type;
  w.data = t.data;
  w.n_in = n_in;
  w.n_out = n_out;
  if (t.type == kernels::dtype::q5_0) {
    const int64_t n_blocks = n_in * n_out / 32;
    owned.push_back(std::make_unique<uint8_t[]>((size_t)n_blocks * sizeof(kernels::block_q8_0)));
    kernels::repack_q5_0_to_q8_0(reinterpret_cast<const kernels::block_q5_0*>(t.data),
                                 reinterpret_cast<kernels::block_q8_0*>(owned.back().get()), n_blocks);
    w.type = kernels::dtype::q8_0;
    w.data = owned.back().get();
  }
  w.row_stride = (size_t)kernels::row_bytes(kernels::traits(w.type), n_in);
  return w;
}

// A stack of n_expert matrices of n_out rows of n_in weights (a 3-D tensor), one view per matrix.
std::vector<kernels::weight_view> matrices(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out,
                                           int64_t n_expert, std::vector<std::unique_ptr<uint8_t[]>>& owned) {
  const int64_t ne[3] = {n_in, n_out, n_expert};
  const gguf_tensor& t = f.tensor(name, ne);
  const uint8_t* data = t.data;
  kernels::dtype type = t.type;
  if (t.type == kernels::dtype::q5_0) {
    const int64_t n_blocks = n_in * n_out * n_expert / 32;
    owned.push_back(std::make_unique<uint8_t[]>((size_t)n_blocks * sizeof(kernels::block_q8_0)));
    kernels::repack_q5_0_to_q8_0(reinterpret_cast<const kernels::block_q5_0*>(t.data),
                                 reinterpret_cast<kernels::block_q8_0*>(owned.back().get()), n_blocks);
    type = kernels::dtype::q8_0;
    data = owned.back().get();
  }
  std::vector<kernels::weight_view> out;
  const auto stride = (size_t)kernels::row_bytes(kernels::traits(type), n_in);
  for (int64_t e = 0; e < n_expert; ++e) out.push_back({type, data + (size_t)(e * n_out) * stride, n_out, n_in, stride});
  return out;
}

// A 1-D tensor of n values, as floats.
std::vector<float> vector_f32(const gguf_file& f, const std::string& name, int64_t n) {
  const int64_t ne[1] = {n};
  const gguf_tensor& t = f.tensor(name, ne);
  std::vector<float> v((size_t)n);
  kernels::dequantize_row(t.type, t.data, v.data(), n);
  for (float x : v)
    if (!std::isfinite(x)) fail(f, "tensor '" + name + "' holds a non-finite value");
  return v;
}

}  // namespace

std::unique_ptr<model> model::load(const std::string& path) {
  std::unique_ptr<model> m(new model());
  m->file_ = gguf_file::open(path);
  const gguf_file& f = *m->file_;
  model_hparams& hp = m->hp_;

  hp.arch = f.get_string("general.architecture").value_or("");
  if (hp.arch == "llama" || hp.arch == "mistral") {
    hp.rope = kernels::rope_style::normal;
  } else if (hp.arch == "qwen2") {
    hp.rope = kernels::rope_style::neox;
  } else if (hp.arch == "gemma3") {
    hp.rope = kernels::rope_style::neox;
    hp.gemma = true;
  } else {
    fail(f, "unsupported architecture '" + hp.arch + "' (supported: llama, mistral, qwen2, gemma3)");
  }
  hp.name = f.get_string("general.name").value_or(hp.arch);
  const std::string a = hp.arch + ".";
  hp.n_layers = (int)require_int(f, a + "block_count");
  hp.d_model = (int)require_int(f, a + "embedding_length");
  hp.n_heads = (int)require_int(f, a + "attention.head_count");
  hp.n_kv_heads = (int)f.get_int(a + "attention.head_count_kv").value_or(hp.n_heads);
  hp.d_ff = (int)require_int(f, a + "feed_forward_length");
  hp.n_ctx_train = (int)require_int(f, a + "context_length");
  hp.head_dim = (int)f.get_int(a + "attention.key_length").value_or(hp.d_model / hp.n_heads);
  const int64_t v_len = f.get_int(a + "attention.value_length").value_or(hp.head_dim);
  hp.n_rot = (int)f.get_int(a + "rope.dimension_count").value_or(hp.head_dim);
  hp.rope_base = (float)f.get_float(a + "rope.freq_base").value_or(10000.0);
  hp.norm_eps = (float)f.get_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5);
  if (hp.n_kv_heads <= 0 || hp.n_heads % hp.n_kv_heads != 0)
    fail(f, "head_count " + std::to_string(hp.n_heads) + " is not a multiple of head_count_kv " + std::to_string(hp.n_kv_heads));
  if (v_len != hp.head_dim) fail(f, "key_length != value_length is not supported");
  if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim || hp.n_rot % 2) fail(f, "impossible rope.dimension_count " + std::to_string(hp.n_rot));
  if (hp.head_dim % 8) fail(f, "head size " + std::to_string(hp.head_dim) + " is not a multiple of 8");
  if (!(hp.norm_eps > 0) || !(hp.rope_base > 0)) fail(f, "impossible rms epsilon or rope base");
  hp.n_experts = (int)f.get_int(a + "expert_count").value_or(0);
  hp.n_experts_used = (int)f.get_int(a + "expert_used_count").value_or(0);
  if (hp.n_experts < 0 || hp.n_experts > 1024 || (hp.n_experts > 0 && (hp.n_experts_used < 1 || hp.n_experts_used > hp.n_experts)))
    fail(f, "impossible expert_count " + std::to_string(hp.n_experts) + " / expert_used_count " + std::to_string(hp.n_experts_used));
  if (hp.n_experts > 0 && hp.gemma) fail(f, "a mixture of experts is supported for llama-family models only");
  if (hp.gemma) {
    // As llama.cpp: every 6th layer attends globally (RoPE base from the file), the others to a
    // sliding window (base 10000); the 27B model (62 layers) scales queries by
    // 1/sqrt(d_model / n_heads), the others by 1/sqrt(head_dim).
    hp.sliding_window = (int)f.get_int(a + "attention.sliding_window").value_or(0);
    if (hp.sliding_window < 0) fail(f, "impossible attention.sliding_window " + std::to_string(hp.sliding_window));
    if (hp.n_layers == 62) hp.attn_scale = 1.0f / std::sqrt((float)hp.d_model / (float)hp.n_heads);
  }

  m->tok_ = tokenizer::from_gguf(f);
  const gguf_tensor* emb = f.find_tensor("token_embd.weight");
  if (!emb) fail(f, "missing tensor 'token_embd.weight'");
  if (emb->ne.size() != 2) fail(f, "tensor 'token_embd.weight' is not a matrix");
  hp.n_vocab = (int)emb->ne[1];
  if (hp.n_vocab < m->tok_->n_vocab())
    fail(f, "tensor 'token_embd.weight' has " + std::to_string(hp.n_vocab) + " rows for a vocabulary of " +
                std::to_string(m->tok_->n_vocab()) + " tokens");

  const int64_t d = hp.d_model, q_dim = (int64_t)hp.n_heads * hp.head_dim, kv_dim = (int64_t)hp.n_kv_heads * hp.head_dim;
  m->token_embd_ = matrix(f, "token_embd.weight", d, hp.n_vocab, m->owned_);
  hp.tied_output = f.find_tensor("output.weight") == nullptr;
  m->output_ = hp.tied_output ? m->token_embd_ : matrix(f, "output.weight", d, hp.n_vocab, m->owned_);
  m->output_norm_ = vector_f32(f, "output_norm.weight", d);
  if (f.find_tensor("rope_freqs.weight")) m->rope_freqs_ = vector_f32(f, "rope_freqs.weight", hp.n_rot / 2);

  m->layers_.resize((size_t)hp.n_layers);
  for (int il = 0; il < hp.n_layers; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    layer_weights& l = m->layers_[(size_t)il];
    l.attn_norm = vector_f32(f, p + "attn_norm.weight", d);
    l.ffn_norm = vector_f32(f, p + "ffn_norm.weight", d);
    l.wq = matrix(f, p + "attn_q.weight", d, q_dim, m->owned_);
    l.wk = matrix(f, p + "attn_k.weight", d, kv_dim, m->owned_);
    l.wv = matrix(f, p + "attn_v.weight", d, kv_dim, m->owned_);
    l.wo = matrix(f, p + "attn_output.weight", q_dim, d, m->owned_);
    if (hp.n_experts > 0) {
      l.router = matrix(f, p + "ffn_gate_inp.weight", d, hp.n_experts, m->owned_);
      l.expert_gate = matrices(f, p + "ffn_gate_exps.weight", d, hp.d_ff, hp.n_experts, m->owned_);
      l.expert_up = matrices(f, p + "ffn_up_exps.weight", d, hp.d_ff, hp.n_experts, m->owned_);
      l.expert_down = matrices(f, p + "ffn_down_exps.weight", hp.d_ff, d, hp.n_experts, m->owned_);
    } else {
      l.w_gate = matrix(f, p + "ffn_gate.weight", d, hp.d_ff, m->owned_);
      l.w_up = matrix(f, p + "ffn_up.weight", d, hp.d_ff, m->owned_);
      l.w_down = matrix(f, p + "ffn_down.weight", hp.d_ff, d, m->owned_);
    }
    if (hp.gemma) {
      l.q_norm = vector_f32(f, p + "attn_q_norm.weight", hp.head_dim);
      l.k_norm = vector_f32(f, p + "attn_k_norm.weight", hp.head_dim);
      l.post_attn_norm = vector_f32(f, p + "post_attention_norm.weight", d);
      l.post_ffn_norm = vector_f32(f, p + "post_ffw_norm.weight", d);
      l.sliding = hp.sliding_window > 0 && il % 6 < 5;
    }
    if (f.find_tensor(p + "attn_q.bias")) {
      l.bq = vector_f32(f, p + "attn_q.bias", q_dim);
      l.bk = vector_f32(f, p + "attn_k.bias", kv_dim);
      l.bv = vector_f32(f, p + "attn_v.bias", kv_dim);
    }
  }
  return m;
}

size_t model::weight_bytes_per_token() const {
  auto bytes = [](const kernels::weight_view& w) { return w.row_stride * (size_t)w.n_out; };
  size_t n = bytes(output_);
  for (const auto& l : layers_) {
    n += bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + bytes(l.w_gate) + bytes(l.w_up) + bytes(l.w_down);
    // A mixture of experts reads the router and, per token, the experts it uses.
    n += bytes(l.router);
    for (size_t e = 0; e < l.expert_gate.size() && (int)e < hp_.n_experts_used; ++e)
      n += bytes(l.expert_gate[e]) + bytes(l.expert_up[e]) + bytes(l.expert_down[e]);
  }
  return n;
}

}  // namespace troupe::engine
