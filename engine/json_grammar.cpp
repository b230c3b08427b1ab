#include "engine/json_grammar.hpp"

#include <algorithm>
#include <bit>
#include <limits>
#include <stdexcept>

#include "engine/tokenizer.hpp"

namespace troupe::engine {

// --- byte_trie -----------------------------------------------------------------------------------

byte_trie byte_trie::build(const std::vector<std::string>& strings) {
  byte_trie t;
  std::vector<uint32_t> order(strings.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return strings[a] < strings[b]; });
  struct item {
    uint32_t node, lo, hi, depth;
  };
  t.nodes.push_back({});
  std::vector<item> queue{{0, 0, (uint32_t)order.size(), 0}};
  for (size_t qi = 0; qi < queue.size(); ++qi) {
    const item it = queue[qi];
    uint64_t below = 0;
    for (uint32_t k = it.lo; k < it.hi; ++k)
      if (order[k] < 64) below |= uint64_t(1) << order[k];
    t.nodes[it.node].below = below;
    uint32_t k = it.lo;
    while (k < it.hi && strings[order[k]].size() == it.depth) {  // ends here (first index wins)
      if (t.nodes[it.node].value < 0) t.nodes[it.node].value = (int32_t)order[k];
      ++k;
    }
    const auto first = (uint32_t)t.nodes.size();
    uint16_t n = 0;
    while (k < it.hi) {
      const uint8_t b = (uint8_t)strings[order[k]][it.depth];
      uint32_t e = k;
      while (e < it.hi && (uint8_t)strings[order[e]][it.depth] == b) ++e;
      node child;
      child.byte = b;
      t.nodes.push_back(child);
      queue.push_back({first + n, k, e, it.depth + 1});
      ++n;
      k = e;
    }
    t.nodes[it.node].first_child = first;
    t.nodes[it.node].n_children = n;
  }
  return t;
}

int32_t byte_trie::child(int32_t n, uint8_t b) const {
  const node& p = nodes[(size_t)n];
  uint32_t lo = p.first_child, hi = p.first_child + p.n_children;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (nodes[mid].byte < b)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < p.first_child + p.n_children && nodes[lo].byte == b ? (int32_t)lo : -1;
}

// --- json_grammar ----------------------------------------------------------------------------------

json_grammar::json_grammar() {
  json_node any;  // 0
  add(any);
  json_node obj;  // 1: members of any value under any key
  obj.k = json_node::kind::object;
  obj.additional = json_grammar::any;
  add(obj);
  json_node arr;  // 2
  arr.k = json_node::kind::array;
  arr.items = json_grammar::any;
  add(arr);
  json_node str;  // 3
  str.k = json_node::kind::string;
  add(str);
  json_node num;  // 4
  num.k = json_node::kind::number;
  add(num);
  json_node lit;  // 5
  lit.k = json_node::kind::literal;
  lit.literals = {"true", "false", "null"};
  add(lit);
}

int32_t json_grammar::add(json_node n) {
  nodes_.push_back(std::move(n));
  return (int32_t)nodes_.size() - 1;
}

std::string json_grammar::finalize() {
  const auto n = (int32_t)nodes_.size();
  const auto ref_ok = [&](int32_t r) { return r >= 0 && r < n; };
  if (!ref_ok(root_)) return "the root refers to no node";
  for (int32_t i = 0; i < n; ++i) {
    json_node& x = nodes_[(size_t)i];
    switch (x.k) {
      case json_node::kind::object: {
        if (x.properties.size() > 64) return "an object may declare at most 64 properties";
        std::vector<std::string> keys;
        for (const auto& p : x.properties) {
          if (!ref_ok(p.value)) return "a property refers to no node";
          keys.push_back(p.key);
        }
        for (size_t a = 0; a < keys.size(); ++a)
          for (size_t b = a + 1; b < keys.size(); ++b)
            if (keys[a] == keys[b]) return "the property \"" + keys[a] + "\" is declared twice";
        if (x.additional != -1 && !ref_ok(x.additional)) return "additionalProperties refers to no node";
        x.trie = byte_trie::build(keys);
        break;
      }
      case json_node::kind::array:
        if (!ref_ok(x.items)) return "items refers to no node";
        if (x.min_items < 0 || (x.max_items >= 0 && x.max_items < x.min_items))
          return "minItems must be >= 0 and at most maxItems";
        break;
      case json_node::kind::string:
        if (x.min_length < 0 || (x.max_length >= 0 && x.max_length < x.min_length))
          return "minLength must be >= 0 and at most maxLength";
        if (!x.pattern.empty()) {
          if (x.min_length > 0 || x.max_length >= 0) return "pattern together with minLength or maxLength is not supported";
          auto nfa = std::make_shared<code_nfa>();
          std::string err;
          if (!code_nfa::compile(x.pattern, *nfa, err)) return "pattern \"" + x.pattern + "\": " + err;
          x.nfa = std::move(nfa);
        }
        break;
      case json_node::kind::literal:
        if (x.literals.empty()) return "an enum must list at least one value";
        for (const auto& l : x.literals)
          if (l.empty()) return "an enum value is empty";
        x.trie = byte_trie::build(x.literals);
        break;
      case json_node::kind::any_of:
        if (x.branches.empty()) return "anyOf/oneOf must list at least one schema";
        for (int32_t b : x.branches)
          if (!ref_ok(b)) return "an anyOf branch refers to no node";
        break;
      default:
        break;
    }
  }
  // An any-of that reaches itself through any-ofs only would never start a value.
  for (int32_t i = 0; i < n; ++i) {
    if (nodes_[(size_t)i].k != json_node::kind::any_of) continue;
    std::vector<int32_t> stack{i};
    std::vector<uint8_t> seen((size_t)n, 0);
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      for (int32_t b : nodes_[(size_t)x].branches) {
        if (b == i) return "an anyOf refers to itself without a value in between";
        if (nodes_[(size_t)b].k == json_node::kind::any_of && !seen[(size_t)b]) {
          seen[(size_t)b] = 1;
          stack.push_back(b);
        }
      }
    }
  }
  return {};
}

std::shared_ptr<const json_grammar> json_grammar::any_object() {
  auto g = std::make_shared<json_grammar>();
  g->set_root(any_object_node);
  if (auto err = g->finalize(); !err.empty()) throw std::logic_error("json_grammar::any_object: " + err);
  return g;
}

// --- vocab_index -----------------------------------------------------------------------------------

namespace {

// A UTF-8 lead byte c >= 0x80: the continuation bytes that follow (more) and the range of the first
// of them ([lo, hi]; the later ones are 80-BF), refusing overlongs, surrogates and > U+10FFFF.
// False for a byte that cannot lead.
bool utf8_lead(uint8_t c, uint32_t& more, uint32_t& lo, uint32_t& hi) {
  lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) more = 1;
  else if (c == 0xe0) more = 2, lo = 0xa0;
  else if (c >= 0xe1 && c <= 0xec) more = 2;
  else if (c == 0xed) more = 2, hi = 0x9f;
  else if (c >= 0xee && c <= 0xef) more = 2;
  else if (c == 0xf0) more = 3, lo = 0x90;
  else if (c >= 0xf1 && c <= 0xf3) more = 3;
  else if (c == 0xf4) more = 3, hi = 0x8f;
  else return false;
  return true;
}

// Code points of `s` when every byte is a JSON string character that needs no escape and the
// UTF-8 is whole and valid; -1 otherwise.
int64_t plain_length(std::string_view s) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size();) {
    const auto c = (uint8_t)s[i];
    if (c < 0x80) {
      if (c < 0x20 || c == '"' || c == '\\' || c == 0x7f) return -1;
      ++i;
    } else {
      uint32_t more, lo, hi;
      if (!utf8_lead(c, more, lo, hi)) return -1;
      if (i + (size_t)more >= s.size()) return -1;  // the sequence goes on in the next token
      for (uint32_t k = 1; k <= more; ++k) {
        const auto d = (uint8_t)s[i + (size_t)k];
        if (d < lo || d > hi) return -1;
        lo = 0x80, hi = 0xbf;
      }
      i += (size_t)more + 1;
    }
    ++n;
  }
  return n;
}

}  // namespace

vocab_index::token_trie vocab_index::build_trie(const std::vector<int32_t>& tokens, const std::vector<std::string>& bytes) {
  token_trie t;
  std::vector<int32_t> sorted = tokens;
  std::stable_sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) { return bytes[(size_t)a] < bytes[(size_t)b]; });
  std::vector<std::string> unique;
  t.offsets.push_back(0);
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i == 0 || bytes[(size_t)sorted[i]] != bytes[(size_t)sorted[i - 1]]) {
      if (i > 0) t.offsets.push_back((uint32_t)t.ids.size());
      unique.push_back(bytes[(size_t)sorted[i]]);
    }
    t.ids.push_back(sorted[i]);
  }
  if (!sorted.empty()) t.offsets.push_back((uint32_t)t.ids.size());
  t.trie = byte_trie::build(unique);
  return t;
}

vocab_index::vocab_index(const tokenizer& tok) : n_vocab_(tok.n_vocab()) {
  bytes_.resize((size_t)n_vocab_);
  eog_.assign((size_t)n_vocab_, 0);
  std::vector<int32_t> all, non_plain;
  for (int32_t id = 0; id < n_vocab_; ++id) {
    if (tok.is_eog(id)) {
      eog_[(size_t)id] = 1;
      eog_ids_.push_back(id);
      continue;
    }
    if (tok.is_control(id)) continue;
    bytes_[(size_t)id] = tok.token_to_piece(id, false);
    if (bytes_[(size_t)id].empty()) continue;
    all.push_back(id);
    const int64_t len = plain_length(bytes_[(size_t)id]);
    if (len < 0)
      non_plain.push_back(id);
    else
      plain_by_length_.emplace_back(len, id);
  }
  std::sort(plain_by_length_.begin(), plain_by_length_.end());
  all_ = build_trie(all, bytes_);
  non_plain_ = build_trie(non_plain, bytes_);
}

std::string_view vocab_index::bytes(int32_t id) const { return bytes_.at((size_t)id); }
bool vocab_index::is_eog(int32_t id) const { return id >= 0 && id < n_vocab_ && eog_[(size_t)id]; }

// --- json_matcher ----------------------------------------------------------------------------------

namespace {

enum phase : uint8_t {
  start = 0,
  obj_open,        // after '{'
  obj_key,         // in a declared key: t = key trie node
  obj_after_key,   // expects ':'; t = the property, or -1 for an extra one
  obj_after_value, // expects ',' or '}'
  obj_expect_key,  // after ','
  arr_open,
  arr_after_value,
  arr_after_comma,
  str_in,
  num_minus,
  num_zero,
  num_int,
  num_dot,
  num_frac,
  num_e,
  num_esign,
  num_exp,
  lit,  // t = literal trie node
};

// At most 10^119 in magnitude, so every number the grammar lets through parses as a finite
// double (1e400 is valid JSON, but nlohmann refuses it and Python reads it as inf).
constexpr int kMaxIntDigits = 20, kMaxFracDigits = 20, kMaxExpDigits = 2;
constexpr int kMaxWsRun = 20;

bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
int hex_value(uint8_t c) { return is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10; }
bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// llama.cpp's JSON whitespace: nothing, " ", or "\n" followed by up to 20 spaces or tabs.
// ws: 0 none yet; 1 after a single space; 2 + k after a newline and k spaces or tabs.
bool take_ws(uint8_t& ws, uint8_t c) {
  if (c == ' ') {
    if (ws == 0) return ws = 1, true;
    if (ws >= 2 && ws - 2 < kMaxWsRun) return ++ws, true;
    return false;
  }
  if (c == '\n') {
    if (ws == 0) return ws = 2, true;
    return false;
  }
  if (c == '\t') {
    if (ws >= 2 && ws - 2 < kMaxWsRun) return ++ws, true;
    return false;
  }
  return false;
}

// Declared properties of object `x` that may come next after `pos`: those before and including
// the first required one.
uint64_t allowed_keys(const json_node& x, uint32_t pos) {
  const size_t n = x.properties.size();
  if (pos >= n) return 0;
  uint64_t m = 0;
  for (size_t i = pos; i < n; ++i) {
    m |= uint64_t(1) << i;
    if (x.properties[i].required) break;
  }
  return m;
}

bool required_left(const json_node& x, uint32_t pos) {
  for (size_t i = pos; i < x.properties.size(); ++i)
    if (x.properties[i].required) return true;
  return false;
}

// Some state of `set` takes a code point in [lo, hi].
bool nfa_meets(uint64_t set, const code_nfa& nfa, uint32_t lo, uint32_t hi) {
  if (lo > hi) return false;
  while (set) {
    const int st = std::countr_zero(set);
    set &= set - 1;
    for (const code_nfa::edge& e : nfa.edges[(size_t)st])
      if (e.lo <= hi && lo <= e.hi) return true;
  }
  return false;
}

bool number_can_end(uint8_t p) { return p == num_zero || p == num_int || p == num_frac || p == num_exp; }

}  // namespace

json_matcher::json_matcher(const json_grammar& g, const vocab_index& v) : g_(&g), v_(&v) {
  cur_.clear();
  cur_.frames.push_back({g_->root(), start, 0, 0, 0, 0, 0});
  cur_.alts.push_back({0, 1, 0, false});
}

void json_matcher::advance(const state& in, uint8_t c, state& out) const {
  out.clear();
  for (const alt_header& a : in.alts) {
    if (out.alts.size() >= (size_t)kMaxAlternatives) break;
    const auto idx = (uint32_t)out.alts.size();
    out.alts.push_back({(uint32_t)out.frames.size(), a.size, a.ws, a.done});
    out.frames.insert(out.frames.end(), in.frames.begin() + a.begin, in.frames.begin() + a.begin + a.size);
    step_alt(out, idx, c, 16);
  }
  // Drop the dead (size UINT32_MAX) and duplicate alternatives.
  size_t w = 0;
  for (size_t i = 0; i < out.alts.size(); ++i) {
    const alt_header a = out.alts[i];
    if (a.size == UINT32_MAX) continue;
    bool dup = false;
    for (size_t j = 0; j < w && !dup; ++j) {
      const alt_header& b = out.alts[j];
      if (b.size != a.size || b.ws != a.ws || b.done != a.done) continue;
      dup = std::equal(out.frames.begin() + a.begin, out.frames.begin() + a.begin + a.size, out.frames.begin() + b.begin,
                       [](const frame& x, const frame& y) {
                         return x.node == y.node && x.phase == y.phase && x.esc == y.esc && x.pos == y.pos && x.t == y.t &&
                                x.count == y.count && x.cp == y.cp;
                       });
    }
    if (!dup) out.alts[w++] = a;
  }
  out.alts.resize(w);
}

// Consumes byte c in alternative `ai` of `out` (its frames already copied there). Forks append
// alternatives; a rejected one gets size UINT32_MAX.
void json_matcher::step_alt(state& out, uint32_t ai, uint8_t c, int fuel) const {
  const auto kill = [&] { out.alts[ai].size = UINT32_MAX; };
  // Moves the alternative's frames to the end of the arena so it can push.
  const auto to_tail = [&] {
    alt_header& h = out.alts[ai];
    if (h.begin + h.size == out.frames.size()) return;
    const uint32_t b = (uint32_t)out.frames.size();
    for (uint32_t k = 0; k < h.size; ++k) out.frames.push_back(out.frames[h.begin + k]);
    out.alts[ai].begin = b;
  };
  const auto push = [&](int32_t node, uint8_t ph) {
    if (out.alts[ai].size >= (uint32_t)kMaxDepth) return false;
    to_tail();
    out.frames.push_back({node, ph, 0, 0, 0, 0, 0});
    ++out.alts[ai].size;
    return true;
  };
  const auto fork = [&]() -> uint32_t {
    const alt_header h = out.alts[ai];
    const auto j = (uint32_t)out.alts.size();
    out.alts.push_back({(uint32_t)out.frames.size(), h.size, h.ws, h.done});
    for (uint32_t k = 0; k < h.size; ++k) out.frames.push_back(out.frames[h.begin + k]);
    return j;
  };
  // Pops the finished value; the parent's phase was set when it was pushed.
  const auto complete = [&] {
    alt_header& h = out.alts[ai];
    --h.size;
    if (h.size == 0) h.done = true;
  };

  for (int guard = 0; guard < 4 * kMaxDepth + 8; ++guard) {
    alt_header& h = out.alts[ai];
    if (h.size == 0) {  // the root value is complete: trailing whitespace only
      if (g_->bare() || !take_ws(h.ws, c)) kill();
      return;
    }
    frame& f = out.frames[h.begin + h.size - 1];
    const json_node& x = g_->node(f.node);
    const bool ws = is_ws(c);
    if (!ws && f.phase != str_in) h.ws = 0;
    // Whitespace between tokens: where a value, key, ':', ',' or a closing bracket may come next
    // (a bare grammar's root value takes none before it).
    if (ws && (f.phase == start || f.phase == obj_open || f.phase == obj_expect_key || f.phase == obj_after_key ||
               f.phase == obj_after_value || f.phase == arr_open || f.phase == arr_after_comma || f.phase == arr_after_value)) {
      if ((g_->bare() && f.phase == start && h.size == 1) || !take_ws(h.ws, c)) kill();
      return;
    }
    switch (f.phase) {
      case start: {
        switch (x.k) {
          case json_node::kind::any: {
            int32_t n;
            if (c == '{') n = json_grammar::any_object_node;
            else if (c == '[') n = json_grammar::any_array;
            else if (c == '"') n = json_grammar::any_string;
            else if (c == '-' || is_digit(c)) n = json_grammar::any_number;
            else if (c == 't' || c == 'f' || c == 'n') n = json_grammar::true_false_null;
            else return kill();
            f.node = n;
            continue;
          }
          case json_node::kind::any_of: {
            if (fuel <= 0) return kill();
            for (int32_t b : x.branches) {
              const uint32_t j = fork();
              out.frames[out.alts[j].begin + out.alts[j].size - 1].node = b;
              step_alt(out, j, c, fuel - 1);
            }
            return kill();
          }
          case json_node::kind::object:
            if (c != '{') return kill();
            f.phase = obj_open;
            return;
          case json_node::kind::array:
            if (c != '[') return kill();
            f.phase = arr_open;
            f.count = 0;
            return;
          case json_node::kind::string:
            if (c != '"') return kill();
            f.phase = str_in;
            if (x.nfa) f.count = (int64_t)x.nfa->start;
            return;
          case json_node::kind::number:
            if (c == '-') f.phase = num_minus;
            else if (c == '0') f.phase = num_zero;
            else if (is_digit(c)) f.phase = num_int, f.count = 1;
            else return kill();
            return;
          case json_node::kind::literal: {
            const int32_t t = x.trie.child(0, c);
            if (t < 0) return kill();
            f.phase = lit;
            f.t = t;
            return;
          }
        }
        return kill();
      }

      case obj_open:
      case obj_expect_key:
        if (c == '}' && f.phase == obj_open) {
          if (required_left(x, f.pos)) return kill();
          complete();
          return;
        }
        if (c != '"') return kill();
        {
          const bool declared = allowed_keys(x, f.pos) != 0;
          const bool extra = x.additional >= 0;
          if (!declared && !extra) return kill();
          // An extra key: a string frame above the object, which walks the declared keys' trie
          // in count (node + 1; 0 once off it) so that a declared name is refused as extra.
          const auto start_extra = [&] {
            frame& g = out.frames[out.alts[ai].begin + out.alts[ai].size - 1];
            g.phase = obj_after_key;
            g.t = -1;
            g.count = 1;
            if (!push(json_grammar::any_string, str_in)) kill();
          };
          if (declared && extra) {
            uint32_t j = fork();
            std::swap(ai, j);  // set up the extra key on the fork, then come back
            start_extra();
            std::swap(ai, j);
          }
          if (declared) {
            frame& g = out.frames[out.alts[ai].begin + out.alts[ai].size - 1];
            g.phase = obj_key;
            g.t = 0;
          } else {
            start_extra();
          }
        }
        return;

      case obj_key: {
        const uint64_t allowed = allowed_keys(x, f.pos);
        if (c == '"') {
          const int32_t v = x.trie.nodes[(size_t)f.t].value;
          if (v < 0 || !((allowed >> v) & 1)) return kill();
          f.phase = obj_after_key;
          f.t = v;
          return;
        }
        const int32_t t = x.trie.child(f.t, c);
        if (t < 0 || !(x.trie.nodes[(size_t)t].below & allowed)) return kill();
        f.t = t;
        return;
      }

      case obj_after_key: {
        if (c != ':') return kill();
        int32_t value = x.additional;
        if (f.t >= 0) {
          value = x.properties[(size_t)f.t].value;
          f.pos = (uint16_t)(f.t + 1);
        }
        f.phase = obj_after_value;
        if (!push(value, start)) kill();
        return;
      }

      case obj_after_value:
        if (c == ',') {
          if (allowed_keys(x, f.pos) == 0 && x.additional < 0) return kill();
          f.phase = obj_expect_key;
          return;
        }
        if (c == '}') {
          if (required_left(x, f.pos)) return kill();
          complete();
          return;
        }
        return kill();

      case arr_open:
      case arr_after_comma:
        if (c == ']' && f.phase == arr_open) {
          if (x.min_items > 0) return kill();
          complete();
          return;
        }
        if (x.max_items >= 0 && f.count >= x.max_items) return kill();
        ++f.count;
        f.phase = arr_after_value;
        if (!push(x.items, start)) return kill();
        continue;  // the byte starts the item

      case arr_after_value:
        if (c == ',') {
          if (x.max_items >= 0 && f.count >= x.max_items) return kill();
          f.phase = arr_after_comma;
          return;
        }
        if (c == ']') {
          if (f.count < x.min_items) return kill();
          complete();
          return;
        }
        return kill();

      case str_in: {
        const bool room = x.max_length < 0 || f.count < x.max_length;
        const bool closing = c == '"' && f.esc == 0 && (f.t & 3) == 0;
        if (h.size >= 2) {  // an object's extra key? (escapes are walked as written)
          frame& p = out.frames[h.begin + h.size - 2];
          if (p.phase == obj_after_key && p.t < 0 && p.count > 0) {
            const byte_trie& keys = g_->node(p.node).trie;
            if (closing && keys.nodes[(size_t)p.count - 1].value >= 0) return kill();  // a declared name
            if (!closing) p.count = keys.child((int32_t)p.count - 1, c) + 1;
          }
        }
        // A whole code point of the value: counted, or stepped through the pattern.
        const code_nfa* nfa = x.nfa.get();
        const auto take = [&](uint32_t cp) {
          if (!nfa) return ++f.count, true;
          f.count = (int64_t)nfa->step((uint64_t)f.count, cp);
          return f.count != 0;
        };
        // With a pattern, a partly read code point must still be able to become one it takes:
        // [lo, hi] the code points the bytes so far leave possible.
        const auto possible = [&](uint32_t lo, uint32_t hi) { return !nfa || nfa_meets((uint64_t)f.count, *nfa, lo, hi); };
        if (f.esc == 1) {  // after a backslash
          uint32_t cp = 0;
          if (nfa && c == '/') return kill();  // pattern strings: only what must be escaped is
          if (nfa && c == 'u' && !possible(0, 0x1f)) return kill();
          switch (c) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = 8; break;
            case 'f': cp = 12; break;
            case 'n': cp = 10; break;
            case 'r': cp = 13; break;
            case 't': cp = 9; break;
            case 'u':
              f.esc = 2;
              f.t = 0;
              return;
            default: return kill();
          }
          f.esc = 0;
          if (!take(cp)) kill();
          return;
        }
        // \uXXXX: esc 2..5 for its hex digits, the value gathered in t. A high surrogate
        // (D800-DBFF) must be followed by "\u" and a low one (DC00-DFFF): esc 6 and 7 for those
        // two bytes, 8..11 for its digits, the high half kept in cp; a low surrogate alone is
        // refused at its second digit, so no accepted prefix is a dead end.
        if (f.esc == 6) {
          if (c != '\\') return kill();
          f.esc = 7;
          return;
        }
        if (f.esc == 7) {
          if (c != 'u') return kill();
          f.esc = 8;
          f.t = 0;
          return;
        }
        if (f.esc >= 2) {
          if (!is_hex(c)) return kill();
          const int d = hex_value(c);
          if ((f.esc == 3 && f.t == 0xd && d >= 0xc) || (f.esc == 8 && d != 0xd) || (f.esc == 9 && d < 0xc))
            return kill();
          const int32_t v = f.t * 16 + d;
          const int left = (f.esc <= 5 ? 5 : 11) - f.esc;  // hex digits still to come
          const uint32_t lo = (uint32_t)v << (4 * left), hi = lo + (1u << (4 * left)) - 1;
          // A pattern string escapes control characters only (below).
          if (nfa && (lo > 0x1f || !possible(lo, std::min(hi, 0x1fu)))) return kill();
          f.t = v;
          ++f.esc;
          if (f.esc == 6) {
            if (f.t >= 0xd800 && f.t <= 0xdbff) {  // a high surrogate: its low half next
              f.cp = (uint32_t)f.t;
              f.t = 0;
              return;
            }
            f.esc = 0;
            const uint32_t cp = (uint32_t)f.t;
            f.t = 0;
            if (!take(cp)) kill();
          } else if (f.esc == 12) {
            f.esc = 0;
            const uint32_t cp = 0x10000 + ((f.cp - 0xd800) << 10) + ((uint32_t)f.t - 0xdc00);
            f.t = 0;
            f.cp = 0;
            if (!take(cp)) kill();
          }
          return;
        }
        const uint32_t pending = (uint32_t)f.t & 3;
        if (pending) {
          const uint8_t lo = (uint8_t)(f.t >> 8), hi = (uint8_t)(f.t >> 16);
          if (c < lo || c > hi) return kill();
          f.cp = (f.cp << 6) | (c & 0x3f);
          if (pending == 1) {
            f.t = 0;
            const uint32_t cp = f.cp;
            f.cp = 0;
            if (!take(cp)) kill();
          } else {
            const uint32_t left = 6 * (pending - 1);
            if (!possible(f.cp << left, (f.cp << left) | ((1u << left) - 1))) return kill();
            f.t = (int32_t)((pending - 1) | (0x80u << 8) | (0xbfu << 16));
          }
          return;
        }
        if (c == '"') {
          if (nfa ? !nfa->accepts((uint64_t)f.count) : f.count < x.min_length) return kill();
          complete();
          return;
        }
        if (!room) return kill();
        if (c == '\\') {
          // A pattern string is written as JSON writers do (nlohmann, Python's json without
          // ensure_ascii): an escape only for '"', '\\' and control characters, so a model cannot
          // wander into \u escapes of letters (seen: "n\u0065\u0077..." until max_tokens).
          if (nfa && !possible('"', '"') && !possible('\\', '\\') && !possible(0, 0x1f)) return kill();
          f.esc = 1;
          return;
        }
        if (c < 0x20) return kill();
        if (c < 0x80) {
          if (!take(c)) kill();
          return;
        }
        uint32_t more, lo, hi;
        if (!utf8_lead(c, more, lo, hi)) return kill();
        f.cp = c & (0x3fu >> more);
        if (nfa) {  // the code points this lead byte and the first continuation's range allow
          const uint32_t left = 6 * (more - 1), top = f.cp << (6 * more);
          if (!possible(top | ((lo & 0x3f) << left), top | ((hi & 0x3f) << left) | ((1u << left) - 1))) return kill();
        }
        f.t = (int32_t)(more | (lo << 8) | (hi << 16));
        return;
      }

      case num_minus:
        if (c == '0') f.phase = num_zero;
        else if (is_digit(c)) f.phase = num_int, f.count = 1;
        else kill();
        return;
      case num_zero:
      case num_int:
        if (is_digit(c) && f.phase == num_int) {
          if (f.count >= kMaxIntDigits) return kill();
          ++f.count;
          return;
        }
        if (c == '.' && !x.integer) {
          f.phase = num_dot;
          return;
        }
        if ((c == 'e' || c == 'E') && !x.integer) {
          f.phase = num_e;
          return;
        }
        if (is_digit(c)) return kill();  // no leading zeros
        complete();
        continue;  // the byte belongs to the parent
      case num_dot:
        if (!is_digit(c)) return kill();
        f.phase = num_frac;
        f.count = 1;
        return;
      case num_frac:
        if (is_digit(c)) {
          if (f.count >= kMaxFracDigits) return kill();
          ++f.count;
          return;
        }
        if (c == 'e' || c == 'E') {
          f.phase = num_e;
          return;
        }
        complete();
        continue;
      case num_e:
        if (c == '+' || c == '-') {
          f.phase = num_esign;
          return;
        }
        [[fallthrough]];
      case num_esign:
        if (!is_digit(c)) return kill();
        f.phase = num_exp;
        f.count = 1;
        return;
      case num_exp:
        if (is_digit(c)) {
          if (f.count >= kMaxExpDigits) return kill();
          ++f.count;
          return;
        }
        complete();
        continue;

      case lit: {
        const int32_t t = x.trie.child(f.t, c);
        const bool ends = x.trie.nodes[(size_t)f.t].value >= 0;
        if (t >= 0 && ends && fuel > 0) {  // both "1" then c, and the longer literal: follow both
          const uint32_t j = fork();
          out.alts[j].size -= 1;
          if (out.alts[j].size == 0) out.alts[j].done = true;
          step_alt(out, j, c, fuel - 1);
        }
        if (t >= 0) {
          out.frames[out.alts[ai].begin + out.alts[ai].size - 1].t = t;
          return;
        }
        if (!ends) return kill();
        complete();
        continue;
      }
    }
    return kill();
  }
  kill();
}

bool json_matcher::alt_can_end(const state& s, const alt_header& a) const {
  if (a.done) return true;
  if (a.size != 1) return false;
  const frame& f = s.frames[a.begin];
  if (number_can_end(f.phase)) return true;
  return f.phase == lit && g_->node(f.node).trie.nodes[(size_t)f.t].value >= 0;
}

bool json_matcher::can_end() const {
  for (const auto& a : cur_.alts)
    if (alt_can_end(cur_, a)) return true;
  return false;
}

bool json_matcher::done() const {
  for (const auto& a : cur_.alts)
    if (a.done) return true;
  return false;
}

bool json_matcher::advance_bytes(std::string_view bytes) {
  state a = cur_, b;
  for (char ch : bytes) {
    advance(a, (uint8_t)ch, b);
    if (b.empty()) return false;
    std::swap(a, b);
  }
  cur_ = std::move(a);
  return true;
}

bool json_matcher::accepts_token(int32_t id) const {
  if (v_->is_eog(id)) return can_end();
  if (id < 0 || id >= v_->n_vocab()) return false;
  const std::string_view bytes = v_->bytes(id);
  if (bytes.empty()) return false;
  if (levels_.size() < 2) levels_.resize(2);
  state* a = &levels_[0];
  state* b = &levels_[1];
  advance(cur_, (uint8_t)bytes[0], *a);
  for (size_t i = 1; i < bytes.size() && !a->empty(); ++i) {
    advance(*a, (uint8_t)bytes[i], *b);
    std::swap(a, b);
  }
  return !a->empty();
}

bool json_matcher::advance_token(int32_t id) {
  if (v_->is_eog(id)) return can_end();
  if (id < 0 || id >= v_->n_vocab() || v_->bytes(id).empty()) return false;
  return advance_bytes(v_->bytes(id));
}

bool json_matcher::free_string(const state& s, const alt_header& a, int64_t& room) const {
  if (a.done || a.size == 0) return false;
  const frame& f = s.frames[a.begin + a.size - 1];
  if (f.phase != str_in || f.esc != 0 || (f.t & 3) != 0) return false;
  const json_node& x = g_->node(f.node);
  if (x.nfa) return false;  // a pattern: every token is walked
  room = x.max_length < 0 ? std::numeric_limits<int64_t>::max() : x.max_length - f.count;
  return room > 0;
}

void json_matcher::walk(const vocab_index::token_trie& t, int32_t node, size_t depth, std::vector<uint64_t>& bits) const {
  if (levels_.size() < depth + 2) levels_.resize(depth + 2);
  const byte_trie::node& p = t.trie.nodes[(size_t)node];
  for (uint32_t ci = p.first_child; ci < p.first_child + p.n_children; ++ci) {
    const byte_trie::node& ch = t.trie.nodes[ci];
    advance(levels_[depth], ch.byte, levels_[depth + 1]);
    if (levels_[depth + 1].empty()) continue;
    if (ch.value >= 0)
      for (uint32_t k = t.offsets[(size_t)ch.value]; k < t.offsets[(size_t)ch.value + 1]; ++k) {
        const int32_t id = t.ids[k];
        bits[(size_t)id >> 6] |= uint64_t(1) << (id & 63);
      }
    if (ch.n_children) walk(t, (int32_t)ci, depth + 1, bits);
  }
}

int64_t json_matcher::allowed_tokens(std::vector<uint64_t>& bits) const {
  bits.assign(((size_t)v_->n_vocab() + 63) / 64, 0);
  if (levels_.empty()) levels_.resize(2);
  // Alternatives inside a free string: every plain token that fits at once, the others walked.
  // The rest walked together over the whole vocabulary.
  state rest;
  for (const alt_header& a : cur_.alts) {
    int64_t room = 0;
    if (free_string(cur_, a, room)) {
      for (const auto& [len, id] : v_->plain_by_length_) {
        if (len > room) break;
        bits[(size_t)id >> 6] |= uint64_t(1) << (id & 63);
      }
      state& s = levels_[0];
      s.clear();
      s.alts.push_back({0, a.size, a.ws, a.done});
      s.frames.assign(cur_.frames.begin() + a.begin, cur_.frames.begin() + a.begin + a.size);
      walk(v_->non_plain_, 0, 0, bits);
    } else {
      rest.alts.push_back({(uint32_t)rest.frames.size(), a.size, a.ws, a.done});
      rest.frames.insert(rest.frames.end(), cur_.frames.begin() + a.begin, cur_.frames.begin() + a.begin + a.size);
    }
  }
  if (!rest.empty()) {
    levels_[0] = std::move(rest);
    walk(v_->all_, 0, 0, bits);
  }
  if (can_end())
    for (int32_t id : v_->eog_ids_) bits[(size_t)id >> 6] |= uint64_t(1) << (id & 63);
  int64_t n = 0;
  for (uint64_t w : bits) n += std::popcount(w);
  return n;
}

}  // namespace troupe::engine
