#include "engine/cuda/cuda_weights.hpp"

#include <algorithm>
#include <cmath>
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
    default: return std::nullopt;
  }
}

// Bounded wait for everything enqueued on `stream` (a hung device throws, never hangs).
void wait_for(cudaStream_t stream, std::chrono::milliseconds timeout, const char* what) {
  event_handle ev;
  sync_stream(stream, ev.get(), timeout, what);
}

size_t raw_bytes(const kernels::weight_view& w) { return w.row_stride * (size_t)w.n_out; }

// Bytes a batch-1 step reads beside the matrices: its one embedding row (bf16), the norm weights
// and the q/k/v biases (fp32).
size_t small_bytes_per_token(const model_hparams& hp, bool biases) {
  const size_t d = (size_t)hp.d_model, qkv = (size_t)(hp.n_heads + 2 * hp.n_kv_heads) * (size_t)hp.head_dim;
  return d * sizeof(bf16) + (size_t)hp.n_layers * (2 * d + (biases ? qkv : 0)) * sizeof(float) + d * sizeof(float);
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

// Parts share n_in and are stacked by rows in the order given.
dev_matrix device_weights::upload_fused(std::initializer_list<const kernels::weight_view*> parts, const weight_options& o,
                                        cudaStream_t stream, const char* what) {
  dev_matrix m;
  const kernels::weight_view& first = **parts.begin();
  m.n_in = first.n_in;
  bool same_type = true;
  size_t total_raw = 0;
  for (const auto* p : parts) {
    m.n_out += p->n_out;
    same_type = same_type && p->type == first.type;
    total_raw += raw_bytes(*p);
  }
  const std::optional<kc::quant_type> qt = same_type ? gemv_type(first.type) : std::nullopt;
  const int64_t n = m.n_out * m.n_in;

  if (qt) {
    // Raw blocks on the device; rows of equal type and n_in stack byte for byte.
    const bool keep_raw = o.mode == weights_mode::quant_gemv_small_batch;
    device_buffer temp;
    uint8_t* raw = nullptr;
    if (keep_raw) {
      raw = alloc<uint8_t>((int64_t)total_raw, what);
    } else {
      temp = device_buffer(total_raw, what);
      raw = temp.as<uint8_t>();
    }
    size_t off = 0;
    for (const auto* p : parts) {
      kc::check(cudaMemcpyAsync(raw + off, p->data, raw_bytes(*p), cudaMemcpyHostToDevice, stream), what);
      off += raw_bytes(*p);
    }
    if (keep_raw) {
      m.raw = raw;
      m.qt = *qt;
      m.raw_bytes = total_raw;
    }
    if (!keep_raw || o.expand_quant) {
      bf16* w = alloc<bf16>(n, what);
      kc::dequant_to_bf16(*qt, raw, n, w, stream);
      m.w = w;
      // The temporary raw copy must outlive the expansion.
      if (!keep_raw) wait_for(stream, o.sync_timeout, what);
    } else {
      max_raw_only_elems_ = std::max(max_raw_only_elems_, n);
    }
    return m;
  }

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
  decode_bytes_ += m.raw ? m.raw_bytes : (size_t)(m.n_out * m.n_in) * sizeof(bf16);
}

device_weights::device_weights(const model& mdl, const weight_options& o, cudaStream_t stream) : hp_(mdl.hparams()) {
  const weight_options bf16_only{weights_mode::bf16, true};
  const kernels::weight_view& emb = mdl.token_embd();
  token_embd_ = upload_fused({&emb}, bf16_only, stream, "the token embeddings").w;
  output_ = hp_.tied_output ? dev_matrix{emb.n_out, emb.n_in, token_embd_, nullptr, {}}
                            : upload_fused({&mdl.output()}, bf16_only, stream, "the output head");
  output_norm_ = upload_floats(mdl.output_norm(), "the output norm", stream);
  if (!mdl.rope_freq_factors().empty()) rope_freqs_ = upload_floats(mdl.rope_freq_factors(), "the rope frequency factors", stream);

  layers_.resize((size_t)hp_.n_layers);
  for (int il = 0; il < hp_.n_layers; ++il) {
    const layer_weights& L = mdl.layer(il);
    dev_layer& d = layers_[(size_t)il];
    d.attn_norm = upload_floats(L.attn_norm, "a norm weight", stream);
    d.ffn_norm = upload_floats(L.ffn_norm, "a norm weight", stream);
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
  return dev_matrix{n_out, n_in, w, nullptr, {}};
}

device_weights::device_weights(const model_hparams& hp, uint64_t seed, cudaStream_t stream, const std::vector<float>& rope_freqs)
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
  // As engine::model's dummy weights: the embeddings at every matrix's scale (trained models'
  // are small too), not of unit variance, which a tied output head turned into large logits.
  token_embd_ = random_matrix(hp.n_vocab, d, in_d, s(), stream, "the token embeddings").w;
  output_ = hp.tied_output ? dev_matrix{hp.n_vocab, d, token_embd_, nullptr, {}}
                           : random_matrix(hp.n_vocab, d, in_d, s(), stream, "the output head");
  output_norm_ = ones(d);
  if (!rope_freqs.empty()) rope_freqs_ = upload_floats(rope_freqs, "the rope frequency factors", stream);
  layers_.resize((size_t)hp.n_layers);
  for (auto& L : layers_) {
    L.attn_norm = ones(d);
    L.ffn_norm = ones(d);
    if (hp.arch == "qwen2") {
      L.bq = small(qd);
      L.bk = small(kvd);
      L.bv = small(kvd);
    }
    L.qkv = random_matrix(qd + 2 * kvd, d, in_d, s(), stream, "the fused QKV weights");
    L.o = random_matrix(d, qd, 1.0f / std::sqrt((float)qd), s(), stream, "the attention output weights");
    L.gate_up = random_matrix(2 * (int64_t)hp.d_ff, d, in_d, s(), stream, "the fused gate|up weights");
    L.down = random_matrix(d, hp.d_ff, 1.0f / std::sqrt((float)hp.d_ff), s(), stream, "the down projection weights");
    for (const dev_matrix* m : {&L.qkv, &L.o, &L.gate_up, &L.down}) count_decode_bytes(*m);
  }
  count_decode_bytes(output_);
  decode_bytes_ += small_bytes_per_token(hp_, hp.arch == "qwen2");
  wait_for(stream, weight_options{}.sync_timeout, "generating the weights");
}

}  // namespace troupe::engine::cuda
