// A JSON Schema "pattern" for structured output: a regular expression over code points compiled to
// an NFA of at most 64 states, run as a bit set (json_matcher keeps it in a string's frame).
//
// The subset (ECMAScript syntax, as JSON Schema specifies, and what llama.cpp's converter takes):
// anchored patterns only, "^...$" (generation must know where the string ends); literals;
// escapes \d \D \w \W \s \S \n \r \t \f \v \uXXXX and \ before any non-alphanumeric character;
// '.' (any code point but a line terminator); classes [...] and [^...] with ranges and escapes;
// groups (...) and (?:...); alternation |; quantifiers * + ? {n} {n,} {n,m} (greedy or lazy:
// the same language). Refused with the reason: unanchored, backreferences, lookaround, word
// boundaries, other anchors inside, counted repeats that need more than 64 states; limits: 1000
// characters, groups 64 deep, 4000 states before reduction (bounded work on a request thread).
//
// Only live states are kept in a set (states from which the end is still reachable), so a
// non-empty set can always be completed: the matcher never accepts a dead end.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::engine {

struct code_nfa {
  static constexpr int kMaxStates = 64;
  struct edge {
    uint32_t lo = 0, hi = 0;  // code point range, inclusive
    uint64_t to = 0;          // the closed, live set reached
  };
  std::vector<std::vector<edge>> edges;  // per state
  uint64_t start = 0;                    // closed, live start set
  uint64_t accept = 0;                   // states that end a match

  /// The set after code point cp; 0 when no state takes it.
  uint64_t step(uint64_t set, uint32_t cp) const;
  bool accepts(uint64_t set) const { return (set & accept) != 0; }

  /// Compiles `pattern`; on failure returns false and says why in `error`.
  static bool compile(const std::string& pattern, code_nfa& out, std::string& error);
};

}  // namespace troupe::engine
