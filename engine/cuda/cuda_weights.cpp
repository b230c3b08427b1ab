#include "engine/cuda/cuda_weights.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <stdexcept>

#include "kernels/dequant.hpp"
#include "kernels/fp16.hpp"

namespace troupe::engine::cuda {

namespace {

using kernels::dtype;

std::optional<kc::quant_type> gemv_type(dtype t) {
  switch (t) {
    case dtype::q8_0: return kc::quant_type::q8_0;
    case dtype::q4_0: return kc::quant_type::q4_0;
    case dtype::q4_1: return kc::quant_type::q4_1;
    case dtype::q4_k: return kc::quant_type::q4_k;
    case dtype::q5_k: return kc::quant_type::q5_k;
    case dtype::q6_k: return kc::quant_type::q6_k;
    default: return std::nullopt;
  }
}

// Bounded wait for everything enqueued on `stream` (a hung device throws, never hangs).
void wait_for(cudaStream_t stream, std::chrono::milliseconds timeout, const char* what) {
  event_handle ev;
  sync_stream(stream, ev.get(), timeout, what);
}

// Bytes a batch-1 step reads beside the matrices: its one embedding row (bf16), the norm weights
// and the q/k/v biases (fp32).
size_t small_bytes_per_token(const model_hparams& hp, bool biases) {
  const size_t d = (size_t)hp.d_model, qkv = (size_t)(hp.n_heads + 2 * hp.n_kv_heads) * (size_t)hp.head_dim;
  const size_t gemma = hp.gemma ? 2 * d + 2 * (size_t)hp.head_dim : 0;  // post norms, QK-norm
  return d * sizeof(bf16) + (size_t)hp.n_layers * (2 * d + (biases ? qkv : 0) + gemma) * sizeof(float) + d * sizeof(float);
}

}  // namespace

template <class T>
T* device_weights::alloc(int64_t count, const char* what) {
  buffers_.emplace_back((size_t)count * sizeof(T), what);
  device_bytes_ += buffers_.back().bytes();
  return buffers_.back().as<T>();
}

// Copies go on `stream`, in order with the kernels that read them (a pageable-source copy on the
// legacy stream may return before its DMA lands).
const float* device_weights::upload_floats(const std::vector<float>& v, const char* what, cudaStream_t stream) {
  float* p = alloc<float>((int64_t)v.size(), what);
  kc::check(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, stream), what);
  return p;
}

dev_matrix device_weights::raw_matrix(int64_t n_in, const std::vector<raw_spec>& parts, const weight_options& o,
                                      cudaStream_t stream, const char* what,
                                      const std::function<void(size_t, uint8_t*, size_t)>& fill, bool bf16_elsewhere) {
  dev_matrix m;
  m.n_in = n_in;
  size_t total = 0;  // each part's blocks start 256-byte aligned
  for (const raw_spec& p : parts) {
    m.n_out += p.n_out;
    total += align_up(kc::quant_row_bytes(p.qt, n_in) * (size_t)p.n_out);
  }
  const bool keep_raw = o.mode == weights_mode::quant_gemv_small_batch || bf16_elsewhere;
  device_buffer temp;
  uint8_t* raw = nullptr;
  if (keep_raw) {
    raw = alloc<uint8_t>((int64_t)total, what);
  } else {
    temp = device_buffer(total, what);
    raw = temp.as<uint8_t>();
  }
  std::vector<raw_part> placed;
  size_t off = 0;
  int64_t row0 = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const size_t bytes = kc::quant_row_bytes(parts[i].qt, n_in) * (size_t)parts[i].n_out;
    fill(i, raw + off, bytes);
    placed.push_back(raw_part{row0, parts[i].n_out, parts[i].qt, raw + off, bytes});
    off += align_up(bytes);
    row0 += parts[i].n_out;
  }
  if (!bf16_elsewhere && (!keep_raw || o.expand_quant)) {
    bf16* w = alloc<bf16>(m.n_out * n_in, what);
    for (const raw_part& p : placed) kc::dequant_to_bf16(p.qt, p.raw, p.n_out * n_in, w + p.row0 * n_in, stream);
    m.w = w;
    // The temporary raw copy must outlive the expansion.
    if (!keep_raw) wait_for(stream, o.sync_timeout, what);
  } else if (!bf16_elsewhere) {
    max_raw_only_elems_ = std::max(max_raw_only_elems_, m.n_out * n_in);
  }
  if (keep_raw) m.raw = std::move(placed);
  return m;
}

// Parts share n_in and are stacked by rows in the order given.
dev_matrix device_weights::upload_fused(std::initializer_list<const kernels::weight_view*> parts, const weight_options& o,
                                        cudaStream_t stream, const char* what) {
  const kernels::weight_view& first = **parts.begin();
  std::vector<raw_spec> specs;  // every part of a type gemv_quant reads (the types may differ): raw blocks
  for (const auto* p : parts) {
    const std::optional<kc::quant_type> qt = gemv_type(p->type);
    if (!qt || kc::quant_row_bytes(*qt, p->n_in) != p->row_stride) break;
    specs.push_back(raw_spec{p->n_out, *qt});
  }
  if (specs.size() == parts.size()) {
    const std::vector<const kernels::weight_view*> list(parts);
    return raw_matrix(first.n_in, specs, o, stream, what, [&](size_t i, uint8_t* dst, size_t bytes) {
      kc::check(cudaMemcpyAsync(dst, list[i]->data, bytes, cudaMemcpyHostToDevice, stream), what);
    });
  }

  dev_matrix m;
  m.n_in = first.n_in;
  for (const auto* p : parts) m.n_out += p->n_out;
  const int64_t n = m.n_out * m.n_in;
  // Host dequantization to bf16, uploaded in slices of about 16 MiB of floats.
  bf16* w = alloc<bf16>(n, what);
  const int64_t rows_per_slice = std::max<int64_t>(1, (int64_t{4} << 20) / m.n_in);
  std::vector<float> f((size_t)(rows_per_slice * m.n_in));
  std::vector<uint16_t> h(f.size());
  int64_t row0 = 0;
  for (const auto* p : parts) {
    for (int64_t r = 0; r < p->n_out; r += rows_per_slice) {
      const int64_t nr = std::min(rows_per_slice, p->n_out - r);
      for (int64_t i = 0; i < nr; ++i)
        kernels::dequantize_row(p->type, (const uint8_t*)p->data + (size_t)(r + i) * p->row_stride, &f[(size_t)(i * m.n_in)],
                                m.n_in);
      for (size_t i = 0; i < (size_t)(nr * m.n_in); ++i) h[i] = kernels::f32_to_bf16(f[i]);
      kc::check(cudaMemcpyAsync(w + (row0 + r) * m.n_in, h.data(), (size_t)(nr * m.n_in) * sizeof(uint16_t),
                                cudaMemcpyHostToDevice, stream),
                what);
    }
    row0 += p->n_out;
  }
  m.w = w;
  return m;
}

void device_weights::count_decode_bytes(const dev_matrix& m) {
  decode_bytes_ += !m.raw.empty() ? m.raw_bytes() : (size_t)(m.n_out * m.n_in) * sizeof(bf16);
}

device_weights::device_weights(const model& mdl, const weight_options& o, cudaStream_t stream) : hp_(mdl.hparams()) {
  const weight_options bf16_only{weights_mode::bf16, true};
  const kernels::weight_view& emb = mdl.token_embd();
  token_embd_ = upload_fused({&emb}, bf16_only, stream, "the token embeddings").w;
  output_ = hp_.tied_output ? dev_matrix{emb.n_out, emb.n_in, token_embd_, {}}
                            : upload_fused({&mdl.output()}, bf16_only, stream, "the output head");
  // Steps of up to gemv_max_batch rows read the head's own blocks (fp32 logits) where gemv_quant
  // takes their type: a Q4_K_M file's q6_k head is 0.41 of its bf16 bytes.
  const kernels::weight_view& head = hp_.tied_output ? emb : mdl.output();
  const std::optional<kc::quant_type> head_type = gemv_type(head.type);
  if (o.mode == weights_mode::quant_gemv_small_batch && head_type && kc::quant_row_bytes(*head_type, head.n_in) == head.row_stride)
    output_.raw = raw_matrix(head.n_in, {{head.n_out, *head_type}}, o, stream, "the output head's blocks",
                             [&](size_t, uint8_t* dst, size_t bytes) {
                               kc::check(cudaMemcpyAsync(dst, head.data, bytes, cudaMemcpyHostToDevice, stream), "the output head");
                             }, true).raw;
  output_norm_ = upload_floats(mdl.output_norm(), "the output norm", stream);
  if (!mdl.rope_freq_factors().empty()) rope_freqs_ = upload_floats(mdl.rope_freq_factors(), "the rope frequency factors", stream);

  layers_.resize((size_t)hp_.n_layers);
  for (int il = 0; il < hp_.n_layers; ++il) {
    const layer_weights& L = mdl.layer(il);
    dev_layer& d = layers_[(size_t)il];
    d.attn_norm = upload_floats(L.attn_norm, "a norm weight", stream);
    d.ffn_norm = upload_floats(L.ffn_norm, "a norm weight", stream);
    if (!L.q_norm.empty()) {
      d.q_norm = upload_floats(L.q_norm, "a QK-norm weight", stream);
      d.k_norm = upload_floats(L.k_norm, "a QK-norm weight", stream);
    }
    if (!L.post_attn_norm.empty()) d.post_attn_norm = upload_floats(L.post_attn_norm, "a norm weight", stream);
    if (!L.post_ffn_norm.empty()) d.post_ffn_norm = upload_floats(L.post_ffn_norm, "a norm weight", stream);
    d.sliding = L.sliding;
    if (!L.bq.empty()) {
      d.bq = upload_floats(L.bq, "a bias", stream);
      d.bk = upload_floats(L.bk, "a bias", stream);
      d.bv = upload_floats(L.bv, "a bias", stream);
    }
    d.qkv = upload_fused({&L.wq, &L.wk, &L.wv}, o, stream, "the fused QKV weights");
    d.o = upload_fused({&L.wo}, o, stream, "the attention output weights");
    d.gate_up = upload_fused({&L.w_gate, &L.w_up}, o, stream, "the fused gate|up weights");
    d.down = upload_fused({&L.w_down}, o, stream, "the down projection weights");
    for (const dev_matrix* m : {&d.qkv, &d.o, &d.gate_up, &d.down}) count_decode_bytes(*m);
  }
  count_decode_bytes(output_);
  decode_bytes_ += small_bytes_per_token(hp_, !layers_.empty() && layers_[0].bq != nullptr);
  wait_for(stream, o.sync_timeout, "uploading the weights");
}

dev_matrix device_weights::random_matrix(int64_t n_out, int64_t n_in, float stddev, uint64_t seed, cudaStream_t stream,
                                         const char* what) {
  bf16* w = alloc<bf16>(n_out * n_in, what);
  fill_uniform_bf16(w, n_out * n_in, stddev * std::sqrt(3.0f), seed, stream);  // uniform [-a, a]: std a / sqrt(3)
  return dev_matrix{n_out, n_in, w, {}};
}

device_weights::device_weights(const model_hparams& hp, uint64_t seed, cudaStream_t stream, const std::vector<float>& rope_freqs,
                               synthetic_quant quant, const weight_options& o)
    : hp_(hp) {
  const int64_t d = hp.d_model, qd = (int64_t)hp.n_heads * hp.head_dim, kvd = (int64_t)hp.n_kv_heads * hp.head_dim;
  uint64_t next = seed;
  auto s = [&] { return next += 0x9e3779b97f4a7c15ULL; };
  auto ones = [&](int64_t n) {
    float* p = alloc<float>(n, "a norm weight");
    fill_f32(p, n, 1.0f, stream);
    return (const float*)p;
  };
  auto small = [&](int64_t n) {
    float* p = alloc<float>(n, "a bias");
    fill_uniform_f32(p, n, 0.1f, s(), stream);
    return (const float*)p;
  };
  const float in_d = 1.0f / std::sqrt((float)d);
  if (quant != synthetic_quant::none) {
    const int64_t block = quant == synthetic_quant::q4_k_m ? 256 : 32;
    if (d % block != 0 || qd % block != 0 || hp.d_ff % block != 0)
      throw std::invalid_argument("synthetic quantized weights: d_model, heads x head size and d_ff must be multiples of " +
                                  std::to_string(block));
  }
  // As engine::model's dummy weights: the embeddings at every matrix's scale (trained models'
  // are small too), not of unit variance, which a tied output head turned into large logits.
  token_embd_ = random_matrix(hp.n_vocab, d, in_d, s(), stream, "the token embeddings").w;
  if (hp.tied_output || quant == synthetic_quant::none) {
    output_ = hp.tied_output ? dev_matrix{hp.n_vocab, d, token_embd_, {}}
                             : random_matrix(hp.n_vocab, d, in_d, s(), stream, "the output head");
  } else {  // q6_k as in llama.cpp's Q4_K_M files, or q8_0; its bf16 as `o` says (one model either way)
    const kc::quant_type qt = quant == synthetic_quant::q4_k_m ? kc::quant_type::q6_k : kc::quant_type::q8_0;
    const uint64_t sd = s();
    output_ = raw_matrix(d, {{hp.n_vocab, qt}}, o, stream, "the output head", [&](size_t, uint8_t* dst, size_t) {
      kc::fill_random_blocks(qt, dst, hp.n_vocab * d, in_d, sd, stream);
    });
  }
  output_norm_ = ones(d);
  if (!rope_freqs.empty()) rope_freqs_ = upload_floats(rope_freqs, "the rope frequency factors", stream);
  layers_.resize((size_t)hp.n_layers);
  for (auto& L : layers_) {
    L.attn_norm = ones(d);
    L.ffn_norm = ones(d);
    if (hp.gemma) {  // as engine::model's dummy Gemma 3: every 6th layer global
      L.q_norm = ones(hp.head_dim);
      L.k_norm = ones(hp.head_dim);
      L.post_attn_norm = ones(d);
      L.post_ffn_norm = ones(d);
      L.sliding = hp.sliding_window > 0 && (&L - layers_.data()) % 6 < 5;
    }
    if (hp.arch == "qwen2") {
      L.bq = small(qd);
      L.bk = small(kvd);
      L.bv = small(kvd);
    }
    if (quant == synthetic_quant::none) {
      L.qkv = random_matrix(qd + 2 * kvd, d, in_d, s(), stream, "the fused QKV weights");
      L.o = random_matrix(d, qd, 1.0f / std::sqrt((float)qd), s(), stream, "the attention output weights");
      L.gate_up = random_matrix(2 * (int64_t)hp.d_ff, d, in_d, s(), stream, "the fused gate|up weights");
      L.down = random_matrix(d, hp.d_ff, 1.0f / std::sqrt((float)hp.d_ff), s(), stream, "the down projection weights");
    } else {
      // As llama.cpp's Q4_K_M: q4_k, with V and down in q6_k every other layer (llama.cpp picks
      // some layers by position); or q8_0 throughout.
      const bool km = quant == synthetic_quant::q4_k_m;
      const kc::quant_type base = km ? kc::quant_type::q4_k : kc::quant_type::q8_0;
      const kc::quant_type more = km && (&L - layers_.data()) % 2 == 0 ? kc::quant_type::q6_k : base;
      auto random_raw = [&](std::vector<raw_spec> parts, int64_t n_in, const char* what) {
        const uint64_t sd = s();
        const float stddev = 1.0f / std::sqrt((float)n_in);
        return raw_matrix(n_in, parts, o, stream, what, [&](size_t i, uint8_t* dst, size_t) {
          kc::fill_random_blocks(parts[i].qt, dst, parts[i].n_out * n_in, stddev, sd + i, stream);
        });
      };
      L.qkv = random_raw({{qd, base}, {kvd, base}, {kvd, more}}, d, "the fused QKV weights");
      L.o = random_raw({{d, base}}, qd, "the attention output weights");
      L.gate_up = random_raw({{2 * (int64_t)hp.d_ff, base}}, d, "the fused gate|up weights");
      L.down = random_raw({{d, more}}, hp.d_ff, "the down projection weights");
    }
    for (const dev_matrix* m : {&L.qkv, &L.o, &L.gate_up, &L.down}) count_decode_bytes(*m);
  }
  count_decode_bytes(output_);
  decode_bytes_ += small_bytes_per_token(hp_, hp.arch == "qwen2");
  wait_for(stream, weight_options{}.sync_timeout, "generating the weights");
}

}  // namespace troupe::engine::cuda
