#include "engine/code_nfa.hpp"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <utility>

namespace troupe::engine {

namespace {

constexpr uint32_t kMaxCode = 0x10ffff;
using ranges = std::vector<std::pair<uint32_t, uint32_t>>;

struct pattern_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

ranges normalized(ranges r) {
  std::sort(r.begin(), r.end());
  ranges out;
  for (const auto& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1) out.back().second = std::max(out.back().second, x.second);
    else out.push_back(x);
  }
  return out;
}

ranges complement(const ranges& in) {
  const ranges r = normalized(in);
  ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : r) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCode) out.emplace_back(next, kMaxCode);
  return out;
}

const ranges& digits() {
  static const ranges r{{'0', '9'}};
  return r;
}
const ranges& word() {
  static const ranges r{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
  return r;
}
const ranges& space() {  // ECMAScript's WhiteSpace and LineTerminator
  static const ranges r{{'\t', '\r'}, {' ', ' '}, {0xa0, 0xa0}, {0x1680, 0x1680}, {0x2000, 0x200a}, {0x2028, 0x2029},
                        {0x202f, 0x202f}, {0x205f, 0x205f}, {0x3000, 0x3000}, {0xfeff, 0xfeff}};
  return r;
}
const ranges& line_terminators() {
  static const ranges r{{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}};
  return r;
}

// The pattern as code points.
std::vector<uint32_t> decode(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = (uint8_t)s[i];
    int n = c < 0x80 ? 0 : c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : -1;
    if (n < 0 || i + (size_t)n >= s.size() + (n == 0 ? 1 : 0)) throw pattern_error("the pattern is not valid UTF-8");
    uint32_t cp = n == 0 ? c : c & (0x3f >> n);
    for (int k = 1; k <= n; ++k) {
      const auto d = (uint8_t)s[i + (size_t)k];
      if ((d & 0xc0) != 0x80) throw pattern_error("the pattern is not valid UTF-8");
      cp = (cp << 6) | (d & 0x3f);
    }
    out.push_back(cp);
    i += (size_t)n + 1;
  }
  return out;
}

// ---- parse: pattern -> tree ----

struct re {
  enum class kind { chars, concat, alt, repeat } k = kind::concat;
  ranges set;            // chars
  std::vector<int> kids;  // concat, alt; repeat: one
  int min = 0, max = 0;   // repeat; max -1: unbounded
};

class parser {
 public:
  explicit parser(std::vector<uint32_t> p) : p_(std::move(p)) {}
  std::vector<re> nodes;

  int run() {
    const int root = alt();
    if (i_ != p_.size()) throw pattern_error(p_[i_] == ')' ? "an unmatched ')'" : "an unexpected character");
    return root;
  }

 private:
  bool more() const { return i_ < p_.size(); }
  uint32_t peek() const { return p_[i_]; }
  int add(re n) {
    nodes.push_back(std::move(n));
    return (int)nodes.size() - 1;
  }

  int alt() {
    re a;
    a.k = re::kind::alt;
    a.kids.push_back(concat());
    while (more() && peek() == '|') {
      ++i_;
      a.kids.push_back(concat());
    }
    return a.kids.size() == 1 ? a.kids[0] : add(std::move(a));
  }

  int concat() {
    re c;
    c.k = re::kind::concat;
    while (more() && peek() != '|' && peek() != ')') c.kids.push_back(repeat());
    return add(std::move(c));
  }

  int number() {
    if (!more() || peek() < '0' || peek() > '9') throw pattern_error("a malformed {n,m} quantifier");
    int n = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      n = n * 10 + int(peek() - '0');
      if (n > 1000) throw pattern_error("a repeat count above 1000");
      ++i_;
    }
    return n;
  }

  int repeat() {
    int x = atom();
    while (more()) {
      int lo, hi;
      const uint32_t c = peek();
      if (c == '*') lo = 0, hi = -1, ++i_;
      else if (c == '+') lo = 1, hi = -1, ++i_;
      else if (c == '?') lo = 0, hi = 1, ++i_;
      else if (c == '{') {
        ++i_;
        lo = hi = number();
        if (more() && peek() == ',') {
          ++i_;
          hi = more() && peek() == '}' ? -1 : number();
        }
        if (!more() || peek() != '}') throw pattern_error("a malformed {n,m} quantifier");
        ++i_;
        if (hi >= 0 && hi < lo) throw pattern_error("a {n,m} quantifier with m < n");
      } else {
        break;
      }
      if (more() && peek() == '?') ++i_;  // lazy: the same language
      re r;
      r.k = re::kind::repeat;
      r.kids = {x};
      r.min = lo, r.max = hi;
      x = add(std::move(r));
    }
    return x;
  }

  int chars(ranges r) {
    re n;
    n.k = re::kind::chars;
    n.set = normalized(std::move(r));
    return add(std::move(n));
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      if (!more()) throw pattern_error("a short \\u or \\x escape");
      const uint32_t c = peek();
      int d = c >= '0' && c <= '9' ? int(c - '0') : c >= 'a' && c <= 'f' ? int(c - 'a' + 10) : c >= 'A' && c <= 'F' ? int(c - 'A' + 10) : -1;
      if (d < 0) throw pattern_error("a malformed \\u or \\x escape");
      v = v * 16 + (uint32_t)d;
      ++i_;
    }
    return v;
  }

  // After a backslash: the set it stands for. in_class: \b is a backspace there.
  ranges escape(bool in_class) {
    if (!more()) throw pattern_error("a trailing backslash");
    const uint32_t c = peek();
    ++i_;
    switch (c) {
      case 'd': return digits();
      case 'D': return complement(digits());
      case 'w': return word();
      case 'W': return complement(word());
      case 's': return space();
      case 'S': return complement(space());
      case 'n': return {{'\n', '\n'}};
      case 'r': return {{'\r', '\r'}};
      case 't': return {{'\t', '\t'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0': return {{0, 0}};
      case 'u': {
        const uint32_t v = hex(4);
        return {{v, v}};
      }
      case 'x': {
        const uint32_t v = hex(2);
        return {{v, v}};
      }
      case 'b':
        if (in_class) return {{8, 8}};
        throw pattern_error("word boundaries (\\b) are not supported");
      case 'B': throw pattern_error("word boundaries (\\B) are not supported");
      default:
        if (c >= '1' && c <= '9') throw pattern_error("backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) throw pattern_error("an unknown escape \\" + std::string(1, char(c)));
        return {{c, c}};
    }
  }

  int cls() {
    bool negate = false;
    if (more() && peek() == '^') negate = true, ++i_;
    ranges r;
    while (true) {
      if (!more()) throw pattern_error("an unterminated [ class");
      if (peek() == ']') {
        ++i_;
        break;
      }
      const auto item = [&](ranges& single) -> bool {  // true: one code point
        if (peek() == '\\') {
          ++i_;
          single = escape(true);
          return single.size() == 1 && single[0].first == single[0].second;
        }
        single = {{peek(), peek()}};
        ++i_;
        return true;
      };
      ranges a;
      const bool one = item(a);
      if (one && i_ + 1 < p_.size() && peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        ranges b;
        if (!item(b)) throw pattern_error("a class range whose end is a class");
        if (b[0].first < a[0].first) throw pattern_error("a class range out of order");
        r.emplace_back(a[0].first, b[0].first);
      } else {
        r.insert(r.end(), a.begin(), a.end());
      }
    }
    return chars(negate ? complement(r) : r);
  }

  int atom() {
    const uint32_t c = peek();
    ++i_;
    switch (c) {
      case '(': {
        if (++depth_ > 64) throw pattern_error("groups nested more than 64 deep");
        if (more() && peek() == '?') {
          if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') i_ += 2;
          else throw pattern_error("lookaround and named groups are not supported");
        }
        const int x = alt();
        if (!more() || peek() != ')') throw pattern_error("an unterminated ( group");
        ++i_;
        --depth_;
        return x;
      }
      case '[': return cls();
      case '.': return chars(complement(line_terminators()));
      case '\\': return chars(escape(false));
      case '^':
      case '$': throw pattern_error("anchors are supported only at the pattern's two ends");
      case '*':
      case '+':
      case '?':
      case '{': throw pattern_error("a quantifier with nothing to repeat");
      default: return chars({{c, c}});
    }
  }

  std::vector<uint32_t> p_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---- tree -> Thompson NFA (epsilon edges) ----

struct thompson {
  struct state {
    std::vector<std::pair<std::pair<uint32_t, uint32_t>, int>> chars;
    std::vector<int> eps;
  };
  std::vector<state> s;
  int n_char_states = 0;
  const std::vector<re>* tree = nullptr;

  int add() {
    if (s.size() >= 4000) throw pattern_error("the pattern is too large (over 4000 NFA states before reduction)");
    s.emplace_back();
    return (int)s.size() - 1;
  }
  // Returns (start, end).
  std::pair<int, int> build(int node) {
    const re& n = (*tree)[(size_t)node];
    switch (n.k) {
      case re::kind::chars: {
        const int a = add(), b = add();
        for (const auto& r : n.set) s[(size_t)a].chars.push_back({r, b});
        if (++n_char_states > code_nfa::kMaxStates - 1)
          throw pattern_error("the pattern needs more than " + std::to_string(code_nfa::kMaxStates) + " states (long or counted repeats)");
        return {a, b};
      }
      case re::kind::concat: {
        const int a = add();
        int end = a;
        for (int k : n.kids) {
          const auto [ks, ke] = build(k);
          s[(size_t)end].eps.push_back(ks);
          end = ke;
        }
        return {a, end};
      }
      case re::kind::alt: {
        const int a = add(), b = add();
        for (int k : n.kids) {
          const auto [ks, ke] = build(k);
          s[(size_t)a].eps.push_back(ks);
          s[(size_t)ke].eps.push_back(b);
        }
        return {a, b};
      }
      case re::kind::repeat: {
        const int a = add();
        int end = a;
        for (int k = 0; k < n.min; ++k) {
          const auto [ks, ke] = build(n.kids[0]);
          s[(size_t)end].eps.push_back(ks);
          end = ke;
        }
        if (n.max < 0) {  // star
          const auto [ks, ke] = build(n.kids[0]);
          const int b = add();
          s[(size_t)end].eps.push_back(ks);
          s[(size_t)end].eps.push_back(b);
          s[(size_t)ke].eps.push_back(ks);
          s[(size_t)ke].eps.push_back(b);
          return {a, b};
        }
        const int b = add();
        for (int k = n.min; k < n.max; ++k) {  // optional copies, each may end the repeat
          s[(size_t)end].eps.push_back(b);
          const auto [ks, ke] = build(n.kids[0]);
          s[(size_t)end].eps.push_back(ks);
          end = ke;
        }
        s[(size_t)end].eps.push_back(b);
        return {a, b};
      }
    }
    throw std::logic_error("code_nfa: unknown node");
  }
};

}  // namespace

uint64_t code_nfa::step(uint64_t set, uint32_t cp) const {
  uint64_t next = 0;
  while (set) {
    const int st = std::countr_zero(set);
    set &= set - 1;
    for (const edge& e : edges[(size_t)st])
      if (cp >= e.lo && cp <= e.hi) next |= e.to;
  }
  return next;
}

bool code_nfa::compile(const std::string& pattern, code_nfa& out, std::string& error) {
  try {
    std::vector<uint32_t> cps = decode(pattern);
    if (cps.size() > 1000) throw pattern_error("patterns of more than 1000 characters are not supported");
    // Anchored: "^" first and an unescaped "$" last.
    size_t slashes = 0;
    for (size_t k = cps.size() >= 2 ? cps.size() - 1 : 0; k-- > 0 && cps[k] == '\\';) ++slashes;
    if (cps.size() < 2 || cps.front() != '^' || cps.back() != '$' || slashes % 2 == 1)
      throw pattern_error("only anchored patterns (\"^...$\") are supported");
    parser p(std::vector<uint32_t>(cps.begin() + 1, cps.end() - 1));
    const int root = p.run();
    thompson t;
    t.tree = &p.nodes;
    const auto [start, final] = t.build(root);
    const size_t n = t.s.size();

    // Epsilon closures, as state lists.
    std::vector<std::vector<int>> closure(n);
    std::vector<int> seen(n, -1), stack;
    for (size_t i = 0; i < n; ++i) {
      stack = {(int)i};
      seen[i] = (int)i;
      while (!stack.empty()) {
        const int x = stack.back();
        stack.pop_back();
        closure[i].push_back(x);
        for (int y : t.s[(size_t)x].eps)
          if (seen[(size_t)y] != (int)i) seen[(size_t)y] = (int)i, stack.push_back(y);
      }
    }
    // Important states: those with character edges, and the final one; numbered 0..k-1.
    std::vector<int> index(n, -1);
    int k = 0;
    for (size_t i = 0; i < n; ++i)
      if (!t.s[i].chars.empty() || (int)i == final) index[i] = k++;
    const auto set_of = [&](int x) {
      uint64_t m = 0;
      for (int y : closure[(size_t)x])
        if (index[(size_t)y] >= 0) m |= uint64_t(1) << index[(size_t)y];
      return m;
    };
    // Live states: those from which the final one is reachable.
    std::vector<std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint64_t>>> raw((size_t)k);
    for (size_t i = 0; i < n; ++i)
      if (index[i] >= 0)
        for (const auto& [r, to] : t.s[i].chars) raw[(size_t)index[i]].push_back({r, set_of(to)});
    const uint64_t final_bit = uint64_t(1) << index[(size_t)final];
    uint64_t live = final_bit;
    for (bool grew = true; grew;) {
      grew = false;
      for (int st = 0; st < k; ++st) {
        if ((live >> st) & 1) continue;
        for (const auto& e : raw[(size_t)st])
          if (e.second & live) {
            live |= uint64_t(1) << st;
            grew = true;
            break;
          }
      }
    }
    code_nfa r;
    r.edges.resize((size_t)k);
    for (int st = 0; st < k; ++st)
      for (const auto& [rg, to] : raw[(size_t)st])
        if (to & live) r.edges[(size_t)st].push_back({rg.first, rg.second, to & live});
    r.start = set_of(start) & live;
    r.accept = final_bit;
    if (r.start == 0) throw pattern_error("the pattern matches no string");
    out = std::move(r);
    return true;
  } catch (const pattern_error& e) {
    error = e.what();
    return false;
  }
}

}  // namespace troupe::engine
