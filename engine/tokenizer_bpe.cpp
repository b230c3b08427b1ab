// GPT-2 byte-level BPE (tokenizer.ggml.model = "gpt2"), as llama.cpp's llm_tokenizer_bpe_session:
// pre-tokenize into words, map each byte of a word to its printable code point, then apply the
// merges lowest rank first (leftmost on ties) until none applies.
//
// Symbols and merges work on interned ids rather than strings: every operand and result of a merge
// gets an id, a merge is looked up by the pair of ids, and a symbol's text is known by its id.
#include <array>
#include <cstdio>
#include <queue>
#include <stdexcept>

#include "engine/pretokenize.hpp"
#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"

namespace troupe::engine {

namespace {

struct merge_rule {
  int32_t rank;
  int32_t result;  // part id of left + right
};

// (left part, right part) -> rule, open addressing: the lookup of the inner loop.
class merge_map {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, slot{empty, {}});
    mask_ = cap - 1;
  }
  // Keeps the first rule of a pair, as llama.cpp (std::unordered_map::emplace).
  void insert(uint64_t key, merge_rule rule) {
    for (size_t j = index(key);; j = (j + 1) & mask_) {
      if (slots_[j].key == key) return;
      if (slots_[j].key == empty) {
        slots_[j] = {key, rule};
        return;
      }
    }
  }
  const merge_rule* find(uint64_t key) const {
    for (size_t j = index(key);; j = (j + 1) & mask_) {
      if (slots_[j].key == key) return &slots_[j].rule;
      if (slots_[j].key == empty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t empty = ~0ull;  // part ids are non-negative: no real key has all bits set
  struct slot {
    uint64_t key;
    merge_rule rule;
  };
  size_t index(uint64_t key) const { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask_; }
  std::vector<slot> slots_;
  size_t mask_ = 0;
};

class bpe_tokenizer final : public tokenizer {
 public:
  bpe_tokenizer(const vocab_spec& v, const pretokenizer_config& cfg)
      : tokenizer(v, cfg.no_bos ? -1 : 11, 11, -1, cfg.add_bos_default, false), cfg_(cfg) {
    std::unordered_map<std::string, int32_t> part_ids;
    std::vector<std::string_view> part_texts;  // views into part_ids' keys (node-based: stable)
    auto intern = [&](std::string s) {
      auto [it, added] = part_ids.try_emplace(std::move(s), (int32_t)part_texts.size());
      if (added) part_texts.push_back(it->first);
      return it->second;
    };
    merges_.reserve(v.merges.size());
    for (size_t i = 0; i < v.merges.size(); ++i) {
      const std::string& m = v.merges[i];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos) continue;  // not "left right": llama.cpp files it under ("", "") where it never matches
      std::string left = m.substr(0, sp), right = m.substr(sp + 1);
      const int32_t l = intern(left), r = intern(right), res = intern(left + right);
      merges_.insert(key(l, r), merge_rule{(int32_t)i, res});
    }
    part_token_.resize(part_texts.size());
    for (size_t p = 0; p < part_texts.size(); ++p) part_token_[p] = find(part_texts[p]);
    for (int b = 0; b < 256; ++b) {
      auto it = part_ids.find(std::string(unicode::byte_to_utf8((uint8_t)b)));
      byte_part_[b] = it == part_ids.end() ? -1 : it->second;
    }
    build_pieces();
  }

 private:
  struct symbol {
    uint32_t start, n;  // bytes of the word
    int32_t prev, next;
    int32_t part;  // -1: a byte whose character takes part in no merge
  };
  struct bigram {
    int32_t rank, left, right, result;
    uint32_t size;
    bool operator<(const bigram& o) const { return rank > o.rank || (rank == o.rank && left > o.left); }  // top: lowest rank, leftmost
  };
  struct scratch {
    std::vector<uint32_t> cpts, lengths;
    std::string word, encoded;
    std::vector<symbol> symbols;
    std::priority_queue<bigram> queue;
  };

  static uint64_t key(int32_t l, int32_t r) { return (uint64_t)(uint32_t)l << 32 | (uint32_t)r; }

  std::string piece_of(token_id id) const override {
    const uint16_t a = attr_of(id);
    const std::string& text = texts_[(size_t)id];
    if (a & (attr_unknown | attr_control | attr_user_defined)) return text;
    if (a & attr_normal) {  // back from byte-level characters to bytes
      std::vector<uint32_t> cpts;
      unicode::decode_lenient(text, cpts);
      std::string out;
      for (uint32_t c : cpts) {
        if (int b = unicode::cpt_to_byte(c); b >= 0) {
          out.push_back((char)b);
        } else {  // llama.cpp's marker for a character outside the byte map
          std::string utf8;
          unicode::append_utf8(utf8, c);
          out += "[UNK_BYTE_0x";
          for (unsigned char x : utf8) {
            char hex[3];
            std::snprintf(hex, sizeof hex, "%02x", x);
            out += hex;
          }
          out += text + "]";
        }
      }
      return out;
    }
    if (a & attr_byte) return byte_piece(text);
    return {};
  }

  void encode_fragment(std::string_view text, bool, std::vector<token_id>& out) const override {
    scratch s;
    unicode::decode_lenient(text, s.cpts);
    pretokenize(cfg_.kind, s.cpts, s.lengths);
    size_t start = 0;
    for (uint32_t len : s.lengths) {
      s.word.clear();
      for (size_t k = start; k < start + len; ++k) unicode::append_utf8(s.word, s.cpts[k]);
      start += len;
      encode_word(s, out);
    }
  }

  void add_bigram(scratch& s, int32_t left, int32_t right) const {
    if (left < 0 || right < 0) return;
    const symbol& l = s.symbols[(size_t)left];
    const symbol& r = s.symbols[(size_t)right];
    if (l.part < 0 || r.part < 0) return;
    const merge_rule* m = merges_.find(key(l.part, r.part));
    if (m == nullptr) return;
    s.queue.push({m->rank, left, right, m->result, l.n + r.n});
  }

  // The byte-level text of word bytes [start, start + n).
  void encode_bytes(const std::string& word, uint32_t start, uint32_t n, std::string& dst) const {
    dst.clear();
    for (uint32_t k = start; k < start + n; ++k) dst += unicode::byte_to_utf8((uint8_t)word[k]);
  }

  void encode_word(scratch& s, std::vector<token_id>& out) const {
    const std::string& w = s.word;
    if (cfg_.ignore_merges) {
      encode_bytes(w, 0, (uint32_t)w.size(), s.encoded);
      if (token_id id = find(s.encoded); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const int32_t n = (int32_t)w.size();
    s.symbols.resize((size_t)n);
    for (int32_t i = 0; i < n; ++i) s.symbols[(size_t)i] = {(uint32_t)i, 1, i - 1, i + 1 < n ? i + 1 : -1, byte_part_[(uint8_t)w[(size_t)i]]};
    s.queue = {};
    for (int32_t i = 1; i < n; ++i) add_bigram(s, i - 1, i);
    while (!s.queue.empty()) {
      const bigram b = s.queue.top();
      s.queue.pop();
      symbol& l = s.symbols[(size_t)b.left];
      symbol& r = s.symbols[(size_t)b.right];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // one side changed since: stale
      l.n += r.n;
      l.part = b.result;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) s.symbols[(size_t)r.next].prev = b.left;
      add_bigram(s, l.prev, b.left);
      add_bigram(s, b.left, l.next);
    }
    for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = s.symbols[(size_t)i].next) {
      const symbol& sym = s.symbols[(size_t)i];
      token_id id = sym.part >= 0 ? part_token_[(size_t)sym.part] : -1;
      if (id < 0) {
        encode_bytes(w, sym.start, sym.n, s.encoded);
        id = find(s.encoded);
      }
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      // Not in the vocabulary: each byte of its byte-level text as a one-byte token, when there is one.
      for (char c : s.encoded)
        if (token_id t = find(std::string_view(&c, 1)); t >= 0) out.push_back(t);
    }
  }

  pretokenizer_config cfg_;
  merge_map merges_;                                 // (left part, right part) -> rule
  std::vector<token_id> part_token_;                 // the token whose text a part is, or -1
  std::array<int32_t, 256> byte_part_{};             // the part of each byte's character, or -1
};

}  // namespace

std::unique_ptr<tokenizer> tokenizer::make_bpe(const vocab_spec& v) {
  auto cfg = pretokenizer_from_name(v.pre);
  if (!cfg) {
    std::fprintf(stderr, "troupe: unknown pre-tokenizer '%s' (tokenizer.ggml.pre), using the default regexes\n", v.pre.c_str());
    cfg = pretokenizer_config{};
  } else if (v.pre.empty()) {
    std::fprintf(stderr, "troupe: tokenizer.ggml.pre is missing, using the default regexes: tokenization may differ from the model's\n");
  }
  return std::make_unique<bpe_tokenizer>(v, *cfg);
}

}  // namespace troupe::engine
