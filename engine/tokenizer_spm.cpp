// SentencePiece-style BPE on scores (tokenizer.ggml.model = "llama"), as llama.cpp's
// llm_tokenizer_spm_session: spaces become U+2581, a space is prefixed after BOS or a special token
// when add_space_prefix, then adjacent symbols merge highest score first (leftmost on ties) as long
// as their concatenation is a vocabulary entry; what is left outside the vocabulary falls back to
// byte tokens <0xXX>.
#include <array>
#include <queue>

#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"

namespace troupe::engine {

namespace {

class spm_tokenizer final : public tokenizer {
 public:
  explicit spm_tokenizer(const vocab_spec& v) : tokenizer(v, 1, 2, 0, true, true) {
    scores_.assign(texts_.size(), 0.0f);
    if (!v.scores.empty()) std::copy(v.scores.begin(), v.scores.begin() + (ptrdiff_t)texts_.size(), scores_.begin());
    static constexpr char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {  // llama.cpp's byte_to_token: <0xXX>, else the byte itself
      const char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
      token_id id = find(std::string_view(name, 6));
      if (id < 0) {
        const char c = (char)b;
        id = find(std::string_view(&c, 1));
      }
      byte_token_[(size_t)b] = id;
    }
    build_pieces();
  }

 private:
  struct symbol {
    uint32_t start, n;
    int32_t prev, next;
  };
  struct bigram {
    float score;
    int32_t left, right;
    uint32_t size;
    bool operator<(const bigram& o) const { return score < o.score || (score == o.score && left > o.left); }  // top: best, leftmost
  };

  std::string piece_of(token_id id) const override {
    const uint16_t a = attr_of(id);
    const std::string& text = texts_[(size_t)id];
    if (a & (attr_unknown | attr_control | attr_user_defined)) return text;
    if (a & attr_normal) {
      std::string out;
      for (size_t i = 0; i < text.size(); ++i) {
        if (text.compare(i, 3, "\xe2\x96\x81") == 0) {
          out.push_back(' ');
          i += 2;
        } else {
          out.push_back(text[i]);
        }
      }
      return out;
    }
    if (a & attr_byte) return byte_piece(text);
    return {};
  }

  void encode_fragment(std::string_view text, bool after_special, std::vector<token_id>& out) const override {
    std::string s;
    s.reserve(text.size() + 16);
    if (add_space_prefix_ && after_special) s = "\xe2\x96\x81";
    for (char c : text) {
      if (c == ' ')
        s += "\xe2\x96\x81";
      else
        s.push_back(c);
    }

    std::vector<symbol> syms;
    for (size_t off = 0; off < s.size();) {
      const uint32_t len = (uint32_t)std::min(unicode::utf8_len((uint8_t)s[off]), s.size() - off);
      const int32_t i = (int32_t)syms.size();
      syms.push_back({(uint32_t)off, len, i - 1, off + len == s.size() ? -1 : i + 1});
      off += len;
    }

    std::priority_queue<bigram> queue;
    auto try_add = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0) return;
      const uint32_t size = syms[(size_t)left].n + syms[(size_t)right].n;
      const token_id id = find(std::string_view(s).substr(syms[(size_t)left].start, size));
      if (id < 0) return;
      queue.push({scores_[(size_t)id], left, right, size});
    };
    for (int32_t i = 1; i < (int32_t)syms.size(); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      const bigram b = queue.top();
      queue.pop();
      symbol& l = syms[(size_t)b.left];
      symbol& r = syms[(size_t)b.right];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // stale
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[(size_t)r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }

    for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[(size_t)i].next) {
      const std::string_view piece = std::string_view(s).substr(syms[(size_t)i].start, syms[(size_t)i].n);
      if (token_id id = find(piece); id >= 0) {
        out.push_back(id);
        continue;
      }
      for (char c : piece) {
        // llama.cpp throws when a byte has no token; troupe uses <unk>, or drops the byte without one.
        const token_id t = byte_token_[(uint8_t)c] >= 0 ? byte_token_[(uint8_t)c] : unk_;
        if (t >= 0) out.push_back(t);
      }
    }
  }

  std::vector<float> scores_;
  std::array<token_id, 256> byte_token_{};
};

}  // namespace

std::unique_ptr<tokenizer> tokenizer::make_spm(const vocab_spec& v) { return std::make_unique<spm_tokenizer>(v); }

}  // namespace troupe::engine
