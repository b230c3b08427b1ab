#include "engine/pretokenize.hpp"

#include <cstring>
#include <utility>

#include "engine/unicode.hpp"

namespace troupe::engine {

namespace {

using unicode::cpt_flags;

constexpr uint32_t out_of_range = 0xFFFFFFFF;

// One word of the previous stage, [ini, end), being split further. Reads past the word see an
// out-of-range code point and empty flags, as llama.cpp's _get_cpt/_get_flags.
struct word_scan {
  std::span<const uint32_t> cpts;
  std::span<const cpt_flags> fl;
  size_t ini, end, prev;
  std::vector<uint32_t>& out;

  uint32_t cpt(size_t pos) const { return pos < end ? cpts[pos] : out_of_range; }
  cpt_flags flags(size_t pos) const { return pos < end ? fl[pos] : cpt_flags{}; }
  // Closes the current piece at `to`; returns its length (0 adds nothing).
  size_t emit(size_t to) {
    const size_t len = to - prev;
    if (len > 0) out.push_back((uint32_t)len);
    prev = to;
    return len;
  }
  // 's 't 're 've 'm 'll 'd at pos (case-insensitive when `fold`); emits it and returns its length.
  size_t contraction(size_t pos, bool fold) {
    if (cpts[pos] != '\'' || pos + 1 >= end) return 0;
    auto low = [&](uint32_t c) { return fold ? unicode::to_lower(c) : c; };
    const uint32_t c1 = low(cpts[pos + 1]);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return emit(pos + 2);
    if (pos + 2 >= end) return 0;
    const uint32_t c2 = low(cpts[pos + 2]);
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return emit(pos + 3);
    return 0;
  }
  // A whitespace run at pos: `\s*[\r\n]+` (when `newlines`), `\s+(?!\S)`, `\s+`; else one code point.
  size_t whitespace(size_t pos, bool newlines) {
    size_t n_ws = 0, last_rn = 0;
    while (flags(pos + n_ws).is_whitespace()) {
      const uint32_t c = cpts[pos + n_ws];
      if (newlines && (c == '\r' || c == '\n')) last_rn = pos + n_ws + 1;
      ++n_ws;
    }
    if (last_rn > 0) return emit(last_rn);
    if (n_ws > 1 && pos + n_ws < end) return emit(pos + n_ws - 1);  // leave the last one to the next word
    if (n_ws > 0) return emit(pos + n_ws);
    return emit(pos + 1);
  }
};

constexpr uint16_t ws_l_n = cpt_flags::whitespace | cpt_flags::letter | cpt_flags::number;

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
void scan_gpt2(word_scan& s) {
  for (size_t pos = s.ini; pos < s.end;) {
    if (size_t n = s.contraction(pos, false)) {
      pos += n;
      continue;
    }
    const uint32_t c = s.cpts[pos];
    const cpt_flags f2 = c == ' ' ? s.flags(pos + 1) : s.fl[pos];
    const uint16_t cls = f2.is_letter() ? cpt_flags::letter : f2.is_number() ? cpt_flags::number : 0;
    if (cls != 0) {  // ` ?\p{L}+` or ` ?\p{N}+`
      pos += (c == ' ');
      while (s.flags(pos).bits & cls) ++pos;
      s.emit(pos);
      continue;
    }
    if (!(f2.bits & ws_l_n) && f2.any()) {  // ` ?[^\s\p{L}\p{N}]+`
      pos += (c == ' ');
      for (cpt_flags f = s.flags(pos); !(f.bits & ws_l_n) && f.any(); f = s.flags(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    pos += s.whitespace(pos, false);
  }
}

// The Llama-3 regex and its Qwen variants: contractions fold case; `[^\r\n\p{L}\p{N}]?` may lead a
// letter run; numbers go by at most `max_digits`; punctuation runs take trailing newlines.
template <int max_digits, bool marks>
void scan_llama3_family(word_scan& s) {
  constexpr uint16_t word_bits = cpt_flags::letter | (marks ? cpt_flags::mark : 0);
  constexpr uint16_t not_punct = ws_l_n | (marks ? cpt_flags::mark : 0);
  for (size_t pos = s.ini; pos < s.end;) {
    if (size_t n = s.contraction(pos, true)) {
      pos += n;
      continue;
    }
    const uint32_t c = s.cpts[pos];
    const cpt_flags f = s.fl[pos];
    if (!(c == '\r' || c == '\n' || f.is_number()) && ((f.bits & word_bits) || (s.flags(pos + 1).bits & word_bits))) {
      ++pos;  // the optional leader, or the first letter
      while (s.flags(pos).bits & word_bits) ++pos;
      s.emit(pos);
      continue;
    }
    if (f.is_number()) {  // \p{N}{1,max_digits}
      size_t run_start = pos;
      while (s.flags(pos).is_number()) {
        if (++pos - run_start >= (size_t)max_digits) {
          s.emit(pos);
          run_start = pos;
        }
      }
      s.emit(pos);
      continue;
    }
    const cpt_flags f2 = c == ' ' ? s.flags(pos + 1) : f;
    if (!(f2.bits & not_punct) && f.any()) {  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
      pos += (c == ' ');
      for (cpt_flags g = s.flags(pos); !(g.bits & not_punct) && g.any(); g = s.flags(pos)) ++pos;
      for (uint32_t g = s.cpt(pos); g == '\r' || g == '\n'; g = s.cpt(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    pos += s.whitespace(pos, true);
  }
}

// Single-class regexes, as llama.cpp runs them through std::regex: `[class]+` splits into runs
// of the class and the gaps between; `class` alone isolates each member.
template <class Pred>
void scan_class(word_scan& s, Pred in_class, bool runs) {
  size_t pos = s.ini;
  while (pos < s.end) {
    if (!in_class(pos)) {
      ++pos;
      continue;
    }
    s.emit(pos);  // the gap before, if any
    ++pos;
    if (runs)
      while (pos < s.end && in_class(pos)) ++pos;
    s.emit(pos);
  }
  s.emit(s.end);
}

// [0-9][0-9][0-9]: leftmost, non-overlapping triples of ASCII digits.
void scan_three_digits(word_scan& s) {
  auto digit = [&](size_t p) { return s.cpts[p] >= '0' && s.cpts[p] <= '9'; };
  size_t pos = s.ini;
  while (pos + 3 <= s.end) {
    if (digit(pos) && digit(pos + 1) && digit(pos + 2)) {
      s.emit(pos);
      s.emit(pos + 3);
      pos += 3;
    } else {
      ++pos;
    }
  }
  s.emit(s.end);
}

// \p{P} plus the listed ASCII symbols (the ASCII punctuation of \p{P} is the same in every engine).
struct punct_class {
  std::span<const uint32_t> cpts;
  std::span<const cpt_flags> fl;
  const char* extra;
  bool operator()(size_t p) const {
    const uint32_t c = cpts[p];
    return fl[p].is_punctuation() || (c < 128 && c != 0 && std::strchr(extra, (int)c) != nullptr);
  }
};

class stages {
 public:
  explicit stages(std::span<const uint32_t> cpts) : cpts_(cpts) {
    fl_.resize(cpts.size());
    for (size_t i = 0; i < cpts.size(); ++i) fl_[i] = unicode::flags_of(cpts[i]);
    words_.push_back((uint32_t)cpts.size());
  }

  // Runs fn(word_scan&) on every current word; its pieces become the new words.
  template <class Fn>
  void apply(Fn&& fn) {
    next_.clear();
    next_.reserve(words_.size() * 2);
    size_t start = 0;
    for (uint32_t len : words_) {
      word_scan s{cpts_, fl_, start, start + len, start, next_};
      fn(s);
      start += len;
    }
    std::swap(words_, next_);
  }

  std::span<const cpt_flags> flags() const { return fl_; }
  const std::vector<uint32_t>& words() const { return words_; }

 private:
  std::span<const uint32_t> cpts_;
  std::vector<cpt_flags> fl_;
  std::vector<uint32_t> words_, next_;
};

}  // namespace

void pretokenize(pretokenizer_kind kind, std::span<const uint32_t> cpts, std::vector<uint32_t>& lengths) {
  if (cpts.empty()) return;
  stages st(cpts);
  const auto fl = st.flags();
  auto number = [&](size_t p) { return fl[p].is_number(); };
  switch (kind) {
    case pretokenizer_kind::gpt2:
      st.apply(scan_gpt2);
      break;
    case pretokenizer_kind::digits_gpt2:
      st.apply([&](word_scan& s) { scan_class(s, number, false); });
      st.apply(scan_gpt2);
      break;
    case pretokenizer_kind::llama3:
      st.apply(scan_llama3_family<3, false>);
      break;
    case pretokenizer_kind::qwen2:
      st.apply(scan_llama3_family<1, false>);
      break;
    case pretokenizer_kind::qwen35:
      st.apply(scan_llama3_family<1, true>);
      break;
    case pretokenizer_kind::falcon:
      st.apply([&](word_scan& s) { scan_class(s, punct_class{cpts, fl, "$+<=>^~|`"}, true); });
      st.apply(scan_gpt2);
      st.apply(scan_three_digits);
      break;
    case pretokenizer_kind::fallback:
      st.apply([&](word_scan& s) { scan_class(s, punct_class{cpts, fl, "$+<=>^~|"}, true); });
      st.apply(scan_gpt2);
      st.apply([&](word_scan& s) { scan_class(s, number, true); });
      st.apply(scan_three_digits);
      break;
  }
  lengths.insert(lengths.end(), st.words().begin(), st.words().end());
}

std::optional<pretokenizer_config> pretokenizer_from_name(std::string_view pre) {
  using k = pretokenizer_kind;
  auto any_of = [&](std::initializer_list<std::string_view> names) {
    for (auto n : names)
      if (pre == n) return true;
    return false;
  };
  if (pre.empty() || pre == "default") return pretokenizer_config{k::fallback};
  if (any_of({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}))
    return pretokenizer_config{k::llama3, true, true};
  if (any_of({"dbrx", "smaug-bpe"})) return pretokenizer_config{k::llama3};
  if (pre == "chatglm-bpe") return pretokenizer_config{k::llama3, false, false, true};
  if (any_of({"glm4", "glm5"})) return pretokenizer_config{k::llama3, true, false, true};
  if (any_of({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"}))
    return pretokenizer_config{k::qwen2};
  if (pre == "qwen35") return pretokenizer_config{k::qwen35};
  if (any_of({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"}))
    return pretokenizer_config{k::digits_gpt2};
  if (any_of({"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
              "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
              "granite-docling"}))
    return pretokenizer_config{k::gpt2};
  if (pre == "falcon") return pretokenizer_config{k::falcon};
  return std::nullopt;
}

}  // namespace troupe::engine
