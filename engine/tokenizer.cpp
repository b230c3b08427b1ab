// The model-independent half of the tokenizer: vocabulary tables, special ids and the EOG set
// (llama.cpp's llama_vocab::impl::load), special-token partitioning, pieces, streaming decode.
#include "engine/tokenizer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "engine/gguf.hpp"
#include "engine/unicode.hpp"

namespace troupe::engine {

namespace {

bool in_list(std::string_view s, std::span<const std::string_view> list) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

// llama.cpp recognizes these by text (its "auto-detect special tokens by text" block).
constexpr std::string_view eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
    "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "<end_of_utterance>"};
constexpr std::string_view eom_texts[] = {"<|eom_id|>"};
constexpr std::string_view fim_pre_texts[] = {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>", "<PRE>",
    "\xe2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view fim_suf_texts[] = {
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81hole\xef\xbd\x9c>", "<SUF>",
    "\xe2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view fim_mid_texts[] = {
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>", "<MID>",
    "\xe2\x96\x81<MID>", "<|code_middle|>", "<|middle|>"};
constexpr std::string_view fim_pad_texts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
constexpr std::string_view fim_rep_texts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
constexpr std::string_view fim_sep_texts[] = {"<|file_sep|>"};
constexpr std::string_view always_rendered_texts[] = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"};  // gpt-oss
constexpr std::string_view eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<turn|>", "<|tool_response>", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "[e~["};

}  // namespace

tokenizer::tokenizer(const vocab_spec& v, token_id default_bos, token_id default_eos, token_id default_unk,
                     bool default_add_bos, bool default_add_space_prefix) {
  const size_t n = v.tokens.size();
  if (n == 0) throw std::invalid_argument("tokenizer.ggml.tokens is missing or empty");
  if (n > (size_t)INT32_MAX) throw std::invalid_argument("tokenizer.ggml.tokens has too many entries");
  if (!v.scores.empty() && v.scores.size() < n)
    throw std::invalid_argument("tokenizer.ggml.scores has " + std::to_string(v.scores.size()) + " entries for " + std::to_string(n) + " tokens");
  if (!v.types.empty() && v.types.size() < n)
    throw std::invalid_argument("tokenizer.ggml.token_type has " + std::to_string(v.types.size()) + " entries for " + std::to_string(n) + " tokens");

  auto attr_of_type = [](int32_t type) -> uint16_t {
    switch (type) {
      case (int32_t)token_type::normal: return attr_normal;
      case (int32_t)token_type::unknown: return attr_unknown;
      case (int32_t)token_type::control: return attr_control;
      case (int32_t)token_type::user_defined: return attr_user_defined;
      case (int32_t)token_type::unused: return attr_unused;
      case (int32_t)token_type::byte: return attr_byte;
      default: return 0;  // undefined: never rendered, never matched as special
    }
  };
  texts_.resize(n);
  types_.resize(n);
  attrs_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    texts_[i] = v.tokens[i].empty() ? "[EMPTY_" + std::to_string(i) + "]" : v.tokens[i];
    types_[i] = v.types.empty() ? (int32_t)token_type::normal : v.types[i];
    attrs_[i] = attr_of_type(types_[i]);
  }
  ids_.build(texts_);

  // Special ids: the family's default unless out of range, then the metadata's unless out of range.
  auto resolve = [&](const char* key, token_id def, const std::optional<int64_t>& meta) -> token_id {
    if (def >= 0 && (size_t)def >= n) def = -1;
    if (!meta) return def;
    if (*meta < 0 || (uint64_t)*meta >= n) {
      std::fprintf(stderr, "troupe: tokenizer.ggml.%s = %lld is outside the vocabulary, ignored\n", key, (long long)*meta);
      return def;
    }
    return (token_id)*meta;
  };
  bos_ = resolve("bos_token_id", default_bos, v.bos);
  eos_ = resolve("eos_token_id", default_eos, v.eos);
  unk_ = resolve("unknown_token_id", default_unk, v.unk);
  const token_id eot = resolve("eot_token_id", -1, v.eot);
  const token_id eom = resolve("eom_token_id", -1, v.eom);

  add_bos_ = v.add_bos.value_or(default_add_bos);
  add_eos_ = v.add_eos.value_or(false);
  add_space_prefix_ = v.add_space_prefix.value_or(default_add_space_prefix);
  if (add_bos_ && bos_ < 0) throw std::invalid_argument("tokenizer.ggml.add_bos_token is true but the vocabulary has no BOS token");
  if (add_eos_ && eos_ < 0) throw std::invalid_argument("tokenizer.ggml.add_eos_token is true but the vocabulary has no EOS token");

  build_eog(v, eot, eom);
  build_specials();
}

tokenizer::~tokenizer() = default;

void tokenizer::text_index::build(const std::vector<std::string>& texts) {
  size_t cap = 16;
  while (cap < texts.size() * 2) cap <<= 1;
  slots_.assign(cap, slot{0, -1});
  mask_ = cap - 1;
  for (size_t i = 0; i < texts.size(); ++i) {
    const size_t h = std::hash<std::string_view>{}(texts[i]);
    for (size_t j = h & mask_;; j = (j + 1) & mask_) {
      slot& s = slots_[j];
      if (s.id < 0 || (s.hash == (uint32_t)(h >> 32) && texts[(size_t)s.id] == texts[i])) {
        s = {(uint32_t)(h >> 32), (token_id)i};
        break;
      }
    }
  }
}

token_id tokenizer::text_index::find(std::string_view text, const std::vector<std::string>& texts) const {
  if (slots_.empty()) return -1;
  const size_t h = std::hash<std::string_view>{}(text);
  for (size_t j = h & mask_;; j = (j + 1) & mask_) {
    const slot& s = slots_[j];
    if (s.id < 0) return -1;
    if (s.hash == (uint32_t)(h >> 32) && texts[(size_t)s.id] == text) return s.id;
  }
}

// llama.cpp: ids named by text become control tokens (so that they are matched only with
// parse_special and rendered only with render_special), and make up the end-of-generation set.
void tokenizer::build_eog(const vocab_spec& v, token_id eot, token_id eom) {
  const size_t n = texts_.size();
  auto meta_id = [&](const std::optional<int64_t>& m) -> token_id { return m && *m >= 0 && (uint64_t)*m < n ? (token_id)*m : -1; };
  token_id fim_pre = meta_id(v.fim_pre), fim_suf = meta_id(v.fim_suf), fim_mid = meta_id(v.fim_mid);
  token_id fim_pad = meta_id(v.fim_pad), fim_rep = meta_id(v.fim_rep), fim_sep = meta_id(v.fim_sep);

  auto detect = [&](token_id& id, std::span<const std::string_view> texts, size_t i) {
    if (id < 0 && in_list(texts_[i], texts)) {
      id = (token_id)i;
      attrs_[i] |= attr_control;
    }
  };
  for (size_t i = 0; i < n; ++i) {
    detect(eot, eot_texts, i);
    detect(eom, eom_texts, i);
    detect(fim_pre, fim_pre_texts, i);
    detect(fim_suf, fim_suf_texts, i);
    detect(fim_mid, fim_mid_texts, i);
    detect(fim_pad, fim_pad_texts, i);
    detect(fim_rep, fim_rep_texts, i);
    detect(fim_sep, fim_sep_texts, i);
  }

  std::vector<token_id> eog;
  for (token_id id : {fim_pad, fim_rep, fim_sep})
    if (id >= 0) eog.push_back(id);
  for (size_t i = 0; i < n; ++i)
    if (in_list(texts_[i], eog_texts)) {
      eog.push_back((token_id)i);
      attrs_[i] |= attr_control;
    }
  for (size_t i = 0; i < n; ++i)
    if (in_list(texts_[i], always_rendered_texts)) attrs_[i] = attr_user_defined;
  for (token_id id : {eos_, eot, eom})
    if (id >= 0) eog.push_back(id);
  std::sort(eog.begin(), eog.end());
  eog.erase(std::unique(eog.begin(), eog.end()), eog.end());

  auto has = [&](std::string_view text) {
    return std::any_of(eog.begin(), eog.end(), [&](token_id id) { return texts_[id] == text; });
  };
  auto drop = [&](std::string_view text, uint16_t new_attr) {
    for (auto it = eog.begin(); it != eog.end(); ++it)
      if (texts_[*it] == text) {
        attrs_[*it] = new_attr;
        eog.erase(it);
        return;
      }
  };
  // o200k_harmony and solar-open: <|end|> ends a message, not the generation.
  if (has("<|end|>") && ((has("<|return|>") && has("<|call|>")) || ((has("<|call|>") || has("<|calls|>")) && has("<|flush|>"))))
    drop("<|end|>", attr_user_defined);
  // gemma4 and plamo: </s> is an ordinary token.
  if (has("</s>") && (has("<|tool_response>") || has("<|plamo:eos|>"))) drop("</s>", attr_normal);
  eog_ = std::move(eog);
}

void tokenizer::build_specials() {
  specials_.clear();
  for (size_t i = 0; i < texts_.size(); ++i)
    if (attrs_[i] & (attr_control | attr_user_defined | attr_unknown)) specials_.push_back((token_id)i);
  std::stable_sort(specials_.begin(), specials_.end(),
                   [&](token_id a, token_id b) { return texts_[a].size() > texts_[b].size(); });
  trie_root_.fill(0);
  trie_next_.clear();
  trie_special_.assign(1, -1);  // node 0: the root
  for (size_t k = 0; k < specials_.size(); ++k) {
    const std::string& text = texts_[(size_t)specials_[k]];
    uint32_t node = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const unsigned char c = (unsigned char)text[i];
      uint32_t& child = i == 0 ? trie_root_[c] : trie_next_[(uint64_t)node << 8 | c];
      if (child == 0) {
        child = (uint32_t)trie_special_.size();
        trie_special_.push_back(-1);
      }
      node = child;
    }
    if (trie_special_[node] < 0) trie_special_[node] = (int32_t)k;  // the same text twice: the first one matches
  }
}

std::string tokenizer::byte_piece(const std::string& text) {
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return {};
  return std::string(1, (char)std::strtol(text.substr(3, 2).c_str(), nullptr, 16));
}

void tokenizer::build_pieces() {
  pieces_.resize(texts_.size());
  for (size_t i = 0; i < texts_.size(); ++i) pieces_[i] = piece_of((token_id)i);
}

// llama.cpp's tokenizer_st_partition: for each special token in turn, longest text first, every
// occurrence of its text in what is still plain text (leftmost first, not overlapping) becomes that
// token. Computed here as: walk the occurrences of each special, in that order, and take one when
// none of its bytes is taken yet. One pass over the trie finds which specials occur at all and, as
// long as they are not too many (long whitespace runs with Gemma's space tokens), all occurrences;
// past that bound they are searched again special by special.
void tokenizer::partition_special(std::string_view text, bool parse_special, std::vector<fragment>& frags) const {
  frags.clear();
  if (text.empty()) return;
  const size_t n = text.size();
  struct occurrence {
    uint32_t special;  // index in specials_: the order of processing
    uint32_t pos;
    bool operator<(const occurrence& o) const { return special < o.special || (special == o.special && pos < o.pos); }
  };
  std::vector<occurrence> occ;
  std::vector<bool> seen(specials_.size());
  bool any = false, overflow = false;
  const size_t max_occ = n + 4096;
  for (size_t p = 0; p < n && !specials_.empty(); ++p) {
    uint32_t node = trie_root_[(unsigned char)text[p]];
    for (size_t q = p + 1; node != 0; ++q) {
      if (const int32_t k = trie_special_[node]; k >= 0) {
        if (parse_special || !(attrs_[(size_t)specials_[(size_t)k]] & (attr_control | attr_unknown))) {
          any = seen[(size_t)k] = true;
          if (!overflow && occ.size() < max_occ) {
            occ.push_back({(uint32_t)k, (uint32_t)p});
          } else {
            overflow = true;
          }
        }
      }
      if (q == n) break;
      auto it = trie_next_.find((uint64_t)node << 8 | (unsigned char)text[q]);
      node = it == trie_next_.end() ? 0 : it->second;
    }
  }
  if (!any) {
    frags.push_back({-1, 0, n});
    return;
  }

  std::vector<bool> taken(n);
  std::vector<fragment> matches;
  // Takes the occurrence of specials_[k] at pos if it is free; returns where the next occurrence
  // that can be free may start.
  auto take = [&](size_t k, size_t pos) {
    const token_id id = specials_[k];
    const size_t len = texts_[(size_t)id].size();
    for (size_t i = pos + len; i-- > pos;)
      if (taken[i]) return i + 1;
    for (size_t i = pos; i < pos + len; ++i) taken[i] = true;
    matches.push_back({id, pos, len});
    return pos + len;
  };
  if (!overflow) {
    std::sort(occ.begin(), occ.end());
    for (const occurrence& o : occ) take(o.special, o.pos);
  } else {
    for (size_t k = 0; k < specials_.size(); ++k) {
      if (!seen[k]) continue;
      const std::string_view s = texts_[(size_t)specials_[k]];
      for (size_t pos = text.find(s); pos != std::string_view::npos; pos = text.find(s, take(k, pos))) {
      }
    }
  }

  std::sort(matches.begin(), matches.end(), [](const fragment& a, const fragment& b) { return a.offset < b.offset; });
  size_t p = 0;
  for (const fragment& m : matches) {
    if (m.offset > p) frags.push_back({-1, p, m.offset - p});
    frags.push_back(m);
    p = m.offset + m.length;
  }
  if (p < n) frags.push_back({-1, p, n - p});
}

std::vector<token_id> tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  if (text.size() > (size_t)INT32_MAX) throw std::length_error("the text to tokenize is 2 GiB or more");
  std::vector<token_id> out;
  std::vector<fragment> frags;
  partition_special(text, parse_special, frags);
  if (add_special && add_bos_) out.push_back(bos_);
  bool after_special = true;  // the start of the text counts as following a special token
  for (const fragment& f : frags) {
    if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else {
      encode_fragment(text.substr(f.offset, f.length), after_special, out);
      after_special = false;
    }
  }
  if (add_special && add_eos_) out.push_back(eos_);
  return out;
}

std::string_view tokenizer::piece(token_id id, bool render_special) const {
  if (id < 0 || (size_t)id >= pieces_.size())
    throw std::out_of_range("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(pieces_.size()) + ")");
  if (!render_special && (attrs_[(size_t)id] & (attr_control | attr_unknown))) return {};
  return pieces_[(size_t)id];
}

std::string tokenizer::decode(std::span<const token_id> ids, bool render_special) const {
  std::string out;
  for (token_id id : ids) out += piece(id, render_special);
  return out;
}

bool tokenizer::is_eog(token_id id) const { return std::binary_search(eog_.begin(), eog_.end(), id); }

bool tokenizer::is_control(token_id id) const {
  return id >= 0 && (size_t)id < attrs_.size() && (attrs_[(size_t)id] & attr_control);
}

token_id tokenizer::find(std::string_view text) const {
  return ids_.find(text, texts_);
}

std::unique_ptr<tokenizer> tokenizer::from_vocab(const vocab_spec& v) {
  if (v.model == "gpt2") return make_bpe(v);
  if (v.model == "llama") return make_spm(v);
  throw std::invalid_argument("tokenizer.ggml.model '" + v.model + "' is not supported (troupe knows 'gpt2' and 'llama')");
}

std::unique_ptr<tokenizer> tokenizer::from_gguf(const gguf_file& f) {
  vocab_spec v;
  try {
    v.model = f.get_string("tokenizer.ggml.model").value_or("");
    if (v.model.empty()) throw std::invalid_argument("tokenizer.ggml.model is missing");
    v.pre = f.get_string("tokenizer.ggml.pre").value_or("");
    v.tokens = f.get_string_array("tokenizer.ggml.tokens").value_or(std::vector<std::string>{});
    v.scores = f.get_float_array("tokenizer.ggml.scores").value_or(std::vector<float>{});  // float32, or int32 as llama.cpp allows
    if (auto types = f.get_int_array("tokenizer.ggml.token_type"))
      for (int64_t t : *types) v.types.push_back((int32_t)std::clamp<int64_t>(t, INT32_MIN, INT32_MAX));
    if (v.model == "gpt2") {
      auto merges = f.get_string_array("tokenizer.ggml.merges");
      if (!merges) throw std::invalid_argument("tokenizer.ggml.merges is missing (required by the gpt2 tokenizer)");
      v.merges = std::move(*merges);
    }
    auto id = [&](const char* key) { return f.get_int(std::string("tokenizer.ggml.") + key); };
    v.bos = id("bos_token_id");
    v.eos = id("eos_token_id");
    v.eot = id("eot_token_id");
    v.eom = id("eom_token_id");
    v.unk = id("unknown_token_id");
    v.fim_pre = id("fim_pre_token_id");
    v.fim_suf = id("fim_suf_token_id");
    v.fim_mid = id("fim_mid_token_id");
    v.fim_pad = id("fim_pad_token_id");
    v.fim_rep = id("fim_rep_token_id");
    v.fim_sep = id("fim_sep_token_id");
    // Deprecated names of the first three (llama.cpp reads them after, so they win).
    if (auto x = id("prefix_token_id")) v.fim_pre = x;
    if (auto x = id("suffix_token_id")) v.fim_suf = x;
    if (auto x = id("middle_token_id")) v.fim_mid = x;
    v.add_bos = f.get_bool("tokenizer.ggml.add_bos_token");
    v.add_eos = f.get_bool("tokenizer.ggml.add_eos_token");
    v.add_space_prefix = f.get_bool("tokenizer.ggml.add_space_prefix");
    return from_vocab(v);
  } catch (const gguf_error&) {
    throw;
  } catch (const std::exception& e) {
    throw gguf_error(f.path() + ": " + e.what());
  }
}

std::string stream_decoder::push(token_id id) {
  pending_ += tok_->piece(id, render_special_);
  std::string out;
  const size_t used = unicode::append_complete_utf8(pending_, out);
  pending_.erase(0, used);
  return out;
}

std::string stream_decoder::flush() {
  std::string out;
  const size_t used = unicode::append_complete_utf8(pending_, out);
  if (used < pending_.size()) unicode::append_utf8(out, unicode::replacement_char);  // a character cut short
  pending_.clear();
  return out;
}

}  // namespace troupe::engine
