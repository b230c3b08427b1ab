#include "engine/model.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "engine/unicode.hpp"
#include "kernels/dequant.hpp"
#include "kernels/fp16.hpp"

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

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1) from the top 24 bits of the next draw.
float uniform(uint64_t& state) { return (float)(splitmix64(state) >> 40) / (float)(1 << 24) * 2.0f - 1.0f; }

// fn(begin, end) over [0, n) in contiguous parts on up to one thread per core (parts of at least
// `grain`): drawing a large model's random weights on one thread takes seconds per GB.
template <class Fn>
void parallel_rows(int64_t n, int64_t grain, const Fn& fn) {
  const int64_t parts = std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, std::max(1u, std::thread::hardware_concurrency()));
  if (parts == 1) return fn(int64_t{0}, n);
  std::vector<std::thread> threads;
  for (int64_t p = 0; p < parts; ++p) threads.emplace_back([&fn, p, parts, n] { fn(n * p / parts, n * (p + 1) / parts); });
  for (auto& t : threads) t.join();
}

uint64_t name_hash(const std::string& name) {  // FNV-1a: each tensor's random stream depends on its name only
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// Where load() takes the weights from: the file (f), or random ones of the same shapes (dummy),
// checked against the file's tensors where there is a file.
class weight_source {
 public:
  weight_source(const gguf_file* f, const load_options& o, std::vector<std::unique_ptr<uint8_t[]>>& owned)
      : f_(f), o_(o), owned_(owned) {}

  // Random weights are uniform with standard deviation 1/sqrt(n_in): activations stay O(1) through
  // any depth; the token embeddings too (trained models' are small; unit variance made a tied
  // output head's logits large). The text a random model writes is noise, often one token repeated
  // (deep random transformers map every context to nearly the same state): it measures speed only.
  kernels::weight_view matrix(const std::string& name, int64_t n_in, int64_t n_out) {
    if (!o_.dummy) return engine::matrix(*f_, name, n_in, n_out, owned_);
    check_shape(name, {n_in, n_out});
    return random(name, n_in, n_out);
  }

  std::vector<kernels::weight_view> matrices(const std::string& name, int64_t n_in, int64_t n_out, int64_t n_expert) {
    if (!o_.dummy) return engine::matrices(*f_, name, n_in, n_out, n_expert, owned_);
    check_shape(name, {n_in, n_out, n_expert});
    std::vector<kernels::weight_view> out;
    for (int64_t e = 0; e < n_expert; ++e) out.push_back(random(name + "#" + std::to_string(e), n_in, n_out));
    return out;
  }

  // Random: norm weights 1, biases uniform in [-0.1, 0.1].
  std::vector<float> vector(const std::string& name, int64_t n) {
    if (!o_.dummy) return vector_f32(*f_, name, n);
    check_shape(name, {n});
    std::vector<float> v((size_t)n, 1.0f);
    if (name.ends_with(".bias")) {
      uint64_t st = o_.seed ^ name_hash(name);
      for (float& x : v) x = uniform(st) * 0.1f;
    }
    return v;
  }

 private:
  // The file's tensor has these dimensions (gguf_error naming it if not); nothing to check without a file.
  void check_shape(const std::string& name, std::initializer_list<int64_t> ne) const {
    if (f_) f_->tensor(name, std::span(ne.begin(), ne.size()));
  }

  kernels::weight_view random(const std::string& name, int64_t n_in, int64_t n_out) {
    const float a = std::sqrt(3.0f / (float)n_in);  // uniform in [-a, a]: standard deviation 1/sqrt(n_in)
    if (!o_.host_weights) return {kernels::dtype::bf16, nullptr, n_out, n_in, (size_t)n_in * 2};
    const uint64_t base = o_.seed ^ name_hash(name);
    auto row_state = [base](int64_t row) { return base + (uint64_t)row * 0xd1342543de82ef95ULL; };  // a stream per row
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / n_in);  // rows of ~4M weights a thread at least
    if (n_in % 32 == 0) {  // q8_0: q uniform in [-127, 127], one scale a / 127
      const int64_t row_blocks = n_in / 32;
      owned_.push_back(std::make_unique<uint8_t[]>((size_t)(row_blocks * n_out) * sizeof(kernels::block_q8_0)));
      auto* b = reinterpret_cast<kernels::block_q8_0*>(owned_.back().get());
      const kernels::fp16_t d = kernels::f32_to_fp16(a / 127.0f);
      parallel_rows(n_out, grain, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          uint64_t st = row_state(r);
          for (int64_t i = r * row_blocks; i < (r + 1) * row_blocks; ++i) {
            b[i].d = d;
            for (int j = 0; j < 32; j += 8) {
              const uint64_t x = splitmix64(st);
              for (int k = 0; k < 8; ++k) b[i].qs[j + k] = (int8_t)((int)(((x >> (8 * k)) & 0xff) * 255 >> 8) - 127);
            }
          }
        }
      });
      return {kernels::dtype::q8_0, b, n_out, n_in, (size_t)row_blocks * sizeof(kernels::block_q8_0)};
    }
    owned_.push_back(std::make_unique<uint8_t[]>((size_t)(n_in * n_out) * sizeof(float)));
    auto* w = reinterpret_cast<float*>(owned_.back().get());
    parallel_rows(n_out, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        uint64_t st = row_state(r);
        for (int64_t i = r * n_in; i < (r + 1) * n_in; ++i)
          w[i] = uniform(st) * a;
      }
    });
    return {kernels::dtype::f32, w, n_out, n_in, (size_t)n_in * sizeof(float)};
  }

  const gguf_file* f_;
  const load_options& o_;
  std::vector<std::unique_ptr<uint8_t[]>>& owned_;
};

// A byte-level BPE vocabulary of n tokens for a built-in architecture: the 256 bytes, ChatML's
// special tokens (<|endoftext|> the EOS), then words " w<N>" that encoding never produces (there
// are no merges) but a random model samples and decoding renders.
std::unique_ptr<tokenizer> synthetic_vocab(int n) {
  vocab_spec v;
  v.model = "gpt2";
  v.pre = "gpt-2";
  for (int b = 0; b < 256; ++b) {
    v.tokens.emplace_back(unicode::byte_to_utf8((uint8_t)b));
    v.types.push_back((int32_t)token_type::normal);
  }
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.emplace_back(special);
    v.types.push_back((int32_t)token_type::control);
  }
  v.eos = 256;
  v.add_bos = false;
  const std::string space(unicode::byte_to_utf8((uint8_t)' '));
  for (int i = (int)v.tokens.size(); i < n; ++i) {
    v.tokens.push_back(space + "w" + std::to_string(i));
    v.types.push_back((int32_t)token_type::normal);
  }
  return tokenizer::from_vocab(v);
}

// The hyper-parameters in f's metadata, checked.
model_hparams hparams_of(const gguf_file& f) {
  model_hparams hp;
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

  return hp;
}

}  // namespace

const std::vector<std::string>& synthetic_architectures() {
  static const std::vector<std::string> names = {"llama-3-8b", "qwen2.5-7b", "smollm2-135m", "gemma3-270m"};
  return names;
}

model_hparams synthetic_hparams(const std::string& arch) {
  model_hparams hp;
  hp.name = arch;
  if (arch == "llama-3-8b") {
    hp.arch = "llama";
    hp.n_layers = 32, hp.d_model = 4096, hp.n_heads = 32, hp.n_kv_heads = 8, hp.head_dim = 128;
    hp.d_ff = 14336, hp.n_vocab = 128256, hp.n_ctx_train = 8192, hp.rope_base = 500000.0f;
  } else if (arch == "qwen2.5-7b") {
    hp.arch = "qwen2";
    hp.n_layers = 28, hp.d_model = 3584, hp.n_heads = 28, hp.n_kv_heads = 4, hp.head_dim = 128;
    hp.d_ff = 18944, hp.n_vocab = 152064, hp.n_ctx_train = 32768, hp.rope_base = 1000000.0f, hp.norm_eps = 1e-6f;
    hp.rope = kernels::rope_style::neox;
  } else if (arch == "smollm2-135m") {
    hp.arch = "llama";
    hp.n_layers = 30, hp.d_model = 576, hp.n_heads = 9, hp.n_kv_heads = 3, hp.head_dim = 64;
    hp.d_ff = 1536, hp.n_vocab = 49152, hp.n_ctx_train = 8192, hp.rope_base = 100000.0f, hp.tied_output = true;
  } else if (arch == "gemma3-270m") {  // as its GGUF (models/gemma3-270m.gguf): every 6th layer global
    hp.arch = "gemma3", hp.gemma = true, hp.rope = kernels::rope_style::neox;
    hp.n_layers = 18, hp.d_model = 640, hp.n_heads = 4, hp.n_kv_heads = 1, hp.head_dim = 256;
    hp.d_ff = 2048, hp.n_vocab = 262144, hp.n_ctx_train = 32768, hp.rope_base = 1000000.0f, hp.norm_eps = 1e-6f;
    hp.sliding_window = 512, hp.tied_output = true;
  } else {
    std::string known;
    for (const auto& n : synthetic_architectures()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown architecture '" + arch + "' (built in: " + known + ")");
  }
  hp.n_rot = hp.head_dim;
  return hp;
}

std::unique_ptr<model> model::load(const std::string& path, const load_options& o) {
  std::unique_ptr<model> m(new model());
  m->load_ = o;
  const bool builtin = std::find(synthetic_architectures().begin(), synthetic_architectures().end(), path) !=
                       synthetic_architectures().end();
  if (builtin && !o.dummy && !std::filesystem::exists(path))
    throw std::invalid_argument("'" + path + "' is a built-in architecture, not a file: its random weights need --load-format dummy");
  if (o.dummy && !builtin && !std::filesystem::exists(path)) {
    std::string known;
    for (const auto& n : synthetic_architectures()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("'" + path + "' is neither a file nor a built-in architecture (" + known + ")");
  }
  if (!o.dummy || !builtin || std::filesystem::exists(path)) m->file_ = gguf_file::open(path);
  const gguf_file* f = m->file_.get();
  model_hparams& hp = m->hp_;
  weight_source src(f, o, m->owned_);

  if (f) {
    hp = hparams_of(*f);
    m->tok_ = tokenizer::from_gguf(*f);
    const gguf_tensor* emb = f->find_tensor("token_embd.weight");
    if (!emb) fail(*f, "missing tensor 'token_embd.weight'");
    if (emb->ne.size() != 2) fail(*f, "tensor 'token_embd.weight' is not a matrix");
    hp.n_vocab = (int)emb->ne[1];
    if (hp.n_vocab < m->tok_->n_vocab())
      fail(*f, "tensor 'token_embd.weight' has " + std::to_string(hp.n_vocab) + " rows for a vocabulary of " +
                   std::to_string(m->tok_->n_vocab()) + " tokens");
    hp.tied_output = f->find_tensor("output.weight") == nullptr;
  } else {
    hp = synthetic_hparams(path);
    m->tok_ = synthetic_vocab(hp.n_vocab);
  }

  const int64_t d = hp.d_model, q_dim = (int64_t)hp.n_heads * hp.head_dim, kv_dim = (int64_t)hp.n_kv_heads * hp.head_dim;
  m->token_embd_ = src.matrix("token_embd.weight", d, hp.n_vocab);
  m->output_ = hp.tied_output ? m->token_embd_ : src.matrix("output.weight", d, hp.n_vocab);
  m->output_norm_ = src.vector("output_norm.weight", d);
  // RoPE's frequency factors are configuration (Llama 3.1's scaling), not learned: from the file.
  if (f && f->find_tensor("rope_freqs.weight")) m->rope_freqs_ = vector_f32(*f, "rope_freqs.weight", hp.n_rot / 2);

  m->layers_.resize((size_t)hp.n_layers);
  for (int il = 0; il < hp.n_layers; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    layer_weights& l = m->layers_[(size_t)il];
    l.attn_norm = src.vector(p + "attn_norm.weight", d);
    l.ffn_norm = src.vector(p + "ffn_norm.weight", d);
    l.wq = src.matrix(p + "attn_q.weight", d, q_dim);
    l.wk = src.matrix(p + "attn_k.weight", d, kv_dim);
    l.wv = src.matrix(p + "attn_v.weight", d, kv_dim);
    l.wo = src.matrix(p + "attn_output.weight", q_dim, d);
    if (hp.n_experts > 0) {
      l.router = src.matrix(p + "ffn_gate_inp.weight", d, hp.n_experts);
      l.expert_gate = src.matrices(p + "ffn_gate_exps.weight", d, hp.d_ff, hp.n_experts);
      l.expert_up = src.matrices(p + "ffn_up_exps.weight", d, hp.d_ff, hp.n_experts);
      l.expert_down = src.matrices(p + "ffn_down_exps.weight", hp.d_ff, d, hp.n_experts);
    } else {
      l.w_gate = src.matrix(p + "ffn_gate.weight", d, hp.d_ff);
      l.w_up = src.matrix(p + "ffn_up.weight", d, hp.d_ff);
      l.w_down = src.matrix(p + "ffn_down.weight", hp.d_ff, d);
    }
    if (hp.gemma) {
      l.q_norm = src.vector(p + "attn_q_norm.weight", hp.head_dim);
      l.k_norm = src.vector(p + "attn_k_norm.weight", hp.head_dim);
      l.post_attn_norm = src.vector(p + "post_attention_norm.weight", d);
      l.post_ffn_norm = src.vector(p + "post_ffw_norm.weight", d);
      l.sliding = hp.sliding_window > 0 && il % 6 < 5;
    }
    // Attention biases: where the file has them, or for a built-in Qwen2 (whose checkpoints do).
    if (f ? f->find_tensor(p + "attn_q.bias") != nullptr : hp.arch == "qwen2") {
      l.bq = src.vector(p + "attn_q.bias", q_dim);
      l.bk = src.vector(p + "attn_k.bias", kv_dim);
      l.bv = src.vector(p + "attn_v.bias", kv_dim);
    }
  }
  return m;
}

std::string model::chat_template() const {
  return file_ ? file_->get_string("tokenizer.chat_template").value_or("") : std::string();
}

std::string model::default_chat_family() const {
  if (hp_.arch == "gemma3") return "gemma";
  return file_ ? "" : "chatml";
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
