// Structured output: generation constrained to JSON, or to JSON that a schema describes
// (OpenAI's response_format json_object / json_schema; llama.cpp's and vLLM's structured output).
//
// json_grammar is the compiled form of a schema: a graph of value nodes (object with properties
// in order, array, string, number, literal alternatives, any-of). net/json_schema.cpp builds it
// from a JSON Schema; json_grammar::any_object() is the json_object mode. The engine never sees
// JSON Schema itself.
//
// json_matcher runs the grammar byte by byte as a pushdown automaton. Its state is a set of
// alternatives (stacks of frames), so any-of branches and optional/extra object keys are followed
// in parallel until the bytes tell them apart. Every state it reaches can still be completed, so
// a token it accepts never leads to a dead end. Limits (each rejects the byte that would pass it):
//  - whitespace between tokens follows llama.cpp's JSON grammar: nothing, one space, or one
//    newline and up to 20 spaces or tabs (so a model cannot loop on blank lines);
//  - numbers: up to 20 integer digits, 20 fraction digits and 2 exponent digits (finite doubles);
//  - nesting: kMaxDepth frames; alternatives: kMaxAlternatives (extra ones are dropped).
// Strings are checked as JSON strings of valid UTF-8 (escapes included); minLength/maxLength
// count code points, an escape counting as one.
//
// Object properties are emitted in the schema's order (as llama.cpp's schema converter does):
// each declared property at most once, required ones never skipped, optional ones may be; extra
// properties (additionalProperties true or a schema) may come before or after any of them, under
// any key but a declared one (compared as written: a declared name spelled with \u escapes gets
// through).
//
// sampling_params::grammar carries the grammar; the executor owns the vocab_index of its model.
// vocab_index is the tokenizer's vocabulary as bytes, in a trie, built once per model; with it
// the matcher computes the set of allowed tokens in one walk that stops at the first rejected
// byte of each branch. Inside a free string (no length bound hit, no pending escape or UTF-8
// sequence) every "plain" token (printable, no quote or backslash, whole UTF-8) is allowed at
// once and only the others are walked.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/code_nfa.hpp"

namespace troupe::engine {

class tokenizer;

/// A trie over byte strings: node 0 is the root; each node's children are contiguous and sorted
/// by byte.
struct byte_trie {
  struct node {
    uint32_t first_child = 0;
    uint16_t n_children = 0;
    uint8_t byte = 0;
    int32_t value = -1;     // the string ending here (index into the inserted list), -1: none
    uint64_t below = 0;     // bit i: string i (i < 64) ends at or below this node
  };
  std::vector<node> nodes;
  /// Builds the trie of `strings` (duplicates keep the first index).
  static byte_trie build(const std::vector<std::string>& strings);
  /// The child of n for byte b, or -1.
  int32_t child(int32_t n, uint8_t b) const;
};

struct json_node {
  enum class kind : uint8_t { any, object, array, string, number, literal, any_of };
  kind k = kind::any;
  // object: declared properties in emission order; `key` is the JSON string body as emitted
  // (already escaped). additional: the node of extra properties' values, -1 when none are allowed.
  struct property {
    std::string key;
    int32_t value = 0;
    bool required = false;
  };
  std::vector<property> properties;
  int32_t additional = -1;
  // array
  int32_t items = 0;
  int64_t min_items = 0, max_items = -1;  // -1: no bound
  // string
  int64_t min_length = 0, max_length = -1;
  std::string pattern;  // anchored regular expression over the decoded value (code_nfa.hpp); empty: none
  // number
  bool integer = false;
  // literal: the alternatives as serialized JSON (enum, const, true/false/null)
  std::vector<std::string> literals;
  // any_of
  std::vector<int32_t> branches;

  // Filled by json_grammar::finalize.
  byte_trie trie;  // object: the keys; literal: the alternatives
  std::shared_ptr<const code_nfa> nfa;  // string: the compiled pattern
};

class json_grammar {
 public:
  /// Nodes 0..5 are built in: any value, an object of any members, an array of any values, a
  /// string, a number, and the literals true/false/null.
  static constexpr int32_t any = 0, any_object_node = 1, any_array = 2, any_string = 3, any_number = 4,
                           true_false_null = 5;
  json_grammar();

  /// Adds a node and returns its index. Node references may point forward ($ref cycles).
  int32_t add(json_node n);
  json_node& at(int32_t i) { return nodes_.at((size_t)i); }
  const json_node& node(int32_t i) const { return nodes_[(size_t)i]; }
  int32_t size() const { return (int32_t)nodes_.size(); }
  void set_root(int32_t r) { root_ = r; }
  int32_t root() const { return root_; }
  /// No whitespace before or after the root value (vLLM's guided_choice: the text is exactly one
  /// of the choices); JSON whitespace inside it is unchanged.
  void set_bare(bool b) { bare_ = b; }
  bool bare() const { return bare_; }

  /// Checks every reference and bound, builds the tries. Empty when valid, else the reason
  /// (e.g. an any-of cycle, an object of more than 64 properties, no value satisfies a node).
  std::string finalize();

  /// The json_object mode: one JSON object, members of any value.
  static std::shared_ptr<const json_grammar> any_object();

  /// The nodes as added (with the built-in ones), for the wire: json_grammar(nodes, root) and
  /// finalize() rebuild the same grammar.
  const std::vector<json_node>& nodes() const { return nodes_; }
  json_grammar(std::vector<json_node> nodes, int32_t root, bool bare = false)
      : nodes_(std::move(nodes)), root_(root), bare_(bare) {}

 private:
  std::vector<json_node> nodes_;
  int32_t root_ = any_object_node;
  bool bare_ = false;
};

/// The vocabulary as bytes: what each token emits, and the tries the matcher walks.
class vocab_index {
 public:
  /// Control, unknown and unused tokens, and tokens of no bytes, are never allowed by a grammar;
  /// the end-of-generation tokens are allowed once the value is complete.
  explicit vocab_index(const tokenizer& tok);
  int32_t n_vocab() const { return n_vocab_; }
  std::string_view bytes(int32_t id) const;
  bool is_eog(int32_t id) const;
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }

 private:
  friend class json_matcher;
  int32_t n_vocab_ = 0;
  std::vector<std::string> bytes_;
  std::vector<uint8_t> eog_;
  std::vector<int32_t> eog_ids_;
  // A trie of token byte strings, with the tokens each string is (several tokens may share one).
  struct token_trie {
    byte_trie trie;
    std::vector<uint32_t> offsets;  // string i's tokens: ids[offsets[i] .. offsets[i + 1])
    std::vector<int32_t> ids;
  };
  static token_trie build_trie(const std::vector<int32_t>& tokens, const std::vector<std::string>& bytes);
  token_trie all_, non_plain_;                                // every allowed token; the non-plain ones
  std::vector<std::pair<int64_t, int32_t>> plain_by_length_;  // (code points, token), sorted
};

class json_matcher {
 public:
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaxAlternatives = 64;

  /// Both must outlive the matcher.
  json_matcher(const json_grammar& g, const vocab_index& v);

  /// Feeds the bytes of one token (end-of-generation tokens feed nothing once the value can
  /// end). False, state unchanged, when the grammar rejects it.
  bool advance_token(int32_t id);
  /// Feeds raw bytes; false (state unchanged) when rejected.
  bool advance_bytes(std::string_view bytes);
  bool accepts_token(int32_t id) const;
  /// The value is complete: the end of generation is allowed here.
  bool can_end() const;
  /// The whole value is done and only trailing whitespace may follow.
  bool done() const;
  /// Bit t of `bits` (n_vocab bits) set when token t is allowed; at least the end-of-generation
  /// tokens when can_end(). Returns the number of allowed tokens.
  int64_t allowed_tokens(std::vector<uint64_t>& bits) const;

  struct frame {
    int32_t node = 0;
    uint8_t phase = 0;
    uint8_t esc = 0;      // string: 0, 1 after a backslash, 2..11 inside \u escapes (json_grammar.cpp)
    uint16_t pos = 0;     // object: next declared property
    int32_t t = 0;        // object: trie node or chosen property; string: UTF-8 state; literal: trie node
    int64_t count = 0;    // array: items started; string: code points, or the pattern's NFA set; number: digits
    uint32_t cp = 0;      // string: the code point being read (UTF-8 bytes, a surrogate pair's high half)
  };
  struct alt_header {
    uint32_t begin = 0, size = 0;  // frames in the arena
    uint8_t ws = 0;                // whitespace run state
    bool done = false;             // the root value is complete
  };
  /// A set of alternatives, frames in one arena (reused between calls: no allocation once warm).
  struct state {
    std::vector<frame> frames;
    std::vector<alt_header> alts;
    void clear() {
      frames.clear();
      alts.clear();
    }
    bool empty() const { return alts.empty(); }
  };

 private:
  void advance(const state& in, uint8_t c, state& out) const;
  void step_alt(state& out, uint32_t alt, uint8_t c, int fuel) const;
  bool alt_can_end(const state& s, const alt_header& a) const;
  void walk(const vocab_index::token_trie& t, int32_t node, size_t depth, std::vector<uint64_t>& bits) const;
  bool free_string(const state& s, const alt_header& a, int64_t& room) const;

  const json_grammar* g_;
  const vocab_index* v_;
  state cur_;
  mutable std::vector<state> levels_;  // scratch for walks, one per byte depth
  mutable state tmp_;
};

}  // namespace troupe::engine
