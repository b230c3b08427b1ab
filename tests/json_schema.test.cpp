// Structured output. The JSON matcher (engine/json_grammar) against nlohmann's parser as the
// reference for what JSON is; its allowed-token masks against token-by-token checks on the default
// model's vocabulary; JSON Schema compilation (net/json_schema) and generation under the masks,
// each result checked with nlohmann. (tests/python/test_structured_output.py validates served
// outputs with the `jsonschema` package.)
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <random>
#include <string>
#include <vector>

#include "engine/gguf.hpp"
#include "engine/json_grammar.hpp"
#include "engine/sampling.hpp"
#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"
#include "net/json_schema.hpp"

using namespace troupe::engine;
using troupe::net::compile_json_schema;
using troupe::net::schema_error;
using ojson = nlohmann::ordered_json;

namespace {

// 256 byte tokens and an end token: the matcher sees raw bytes, one per token.
const vocab_index& byte_vocab() {
  static const auto v = [] {
    vocab_spec s;
    s.model = "gpt2";
    s.pre = "gpt-2";
    for (int b = 0; b < 256; ++b) {
      s.tokens.emplace_back(unicode::byte_to_utf8((uint8_t)b));
      s.types.push_back((int32_t)token_type::normal);
    }
    s.tokens.emplace_back("<|end|>");
    s.types.push_back((int32_t)token_type::control);
    s.eos = 256;
    auto tok = tokenizer::from_vocab(s);
    return std::make_unique<vocab_index>(*tok);
  }();
  return *v;
}

const vocab_index* model_vocab() {
  static const std::unique_ptr<vocab_index> v = []() -> std::unique_ptr<vocab_index> {
    const auto path = std::filesystem::path(TROUPE_SOURCE_DIR) / "models/default.gguf";
    if (!std::filesystem::exists(path)) return nullptr;
    return std::make_unique<vocab_index>(*tokenizer::from_gguf(*gguf_file::open(path.string())));
  }();
  return v.get();
}

std::shared_ptr<const json_grammar> any_value() {
  auto g = std::make_shared<json_grammar>();
  g->set_root(json_grammar::any);
  REQUIRE(g->finalize().empty());
  return g;
}

// Whole text accepted, and the value complete at its end.
bool matches(const json_grammar& g, std::string_view text) {
  json_matcher m(g, byte_vocab());
  return m.advance_bytes(text) && m.can_end();
}

std::string random_string(std::mt19937_64& rng) {
  static const std::vector<std::string> pieces{"a", "Z", " ", "\"", "\\", "/", "\n", "\t", std::string(1, '\x01'),
                                               std::string(1, '\x7f'), "\xc3\xa9", "\xe6\x97\xa5", "\xf0\x9f\x98\x80",
                                               "0", "{", "]", ",", ":", "\xe2\x80\xa8"};
  std::string s;
  for (int n = (int)(rng() % 8); n > 0; --n) s += pieces[rng() % pieces.size()];
  return s;
}

ojson random_value(std::mt19937_64& rng, int depth) {
  switch (rng() % (depth > 0 ? 8 : 6)) {
    case 0: return nullptr;
    case 1: return rng() % 2 == 0;
    case 2: return (int64_t)(rng() % 2000001) - 1000000;
    case 3: {
      const double mant = std::uniform_real_distribution<double>(-1.0, 1.0)(rng);
      return std::ldexp(mant, (int)(rng() % 200) - 100);
    }
    case 4: return (uint64_t)rng();
    case 5: return random_string(rng);
    case 6: {
      ojson a = ojson::array();
      for (int n = (int)(rng() % 4); n > 0; --n) a.push_back(random_value(rng, depth - 1));
      return a;
    }
    default: {
      ojson o = ojson::object();
      for (int n = (int)(rng() % 4); n > 0; --n) o[random_string(rng)] = random_value(rng, depth - 1);
      return o;
    }
  }
}

// One random walk under the grammar: tokens drawn uniformly from the allowed set, half of the
// time among the allowed one-byte tokens (so strings close and values end), the end token taken
// with probability 1/2 once allowed. Returns the text, or nullopt past max_tokens.
std::optional<std::string> random_walk(const json_grammar& g, const vocab_index& v, std::mt19937_64& rng,
                                       int max_tokens = 400) {
  json_matcher m(g, v);
  std::string text;
  std::vector<uint64_t> bits;
  std::vector<int32_t> allowed, short_ones;
  for (int step = 0; step < max_tokens; ++step) {
    if (m.can_end() && rng() % 2 == 0) return text;
    REQUIRE(m.allowed_tokens(bits) > 0);
    allowed.clear();
    short_ones.clear();
    for (int32_t id = 0; id < v.n_vocab(); ++id)
      if ((bits[(size_t)id >> 6] >> (id & 63)) & 1) {
        if (v.is_eog(id)) continue;
        allowed.push_back(id);
        if (v.bytes(id).size() == 1) short_ones.push_back(id);
      }
    if (allowed.empty()) {
      REQUIRE(m.can_end());
      return text;
    }
    const auto& from = !short_ones.empty() && rng() % 2 == 0 ? short_ones : allowed;
    const int32_t id = from[rng() % from.size()];
    REQUIRE(m.advance_token(id));
    text += v.bytes(id);
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("json matcher: every valid document is accepted, compact, pretty-printed and ASCII-escaped", "[json][grammar]") {
  const auto g = any_value();
  std::mt19937_64 rng(7);
  for (int i = 0; i < 400; ++i) {
    const ojson doc = random_value(rng, 4);
    for (const std::string& text : {doc.dump(), doc.dump(2), doc.dump(-1, ' ', true), doc.dump(1, '\t', true)}) {
      INFO(text);
      REQUIRE(nlohmann::json::accept(text));
      CHECK(matches(*g, text));
    }
  }
  // The json_object mode: objects only.
  const auto obj = json_grammar::any_object();
  CHECK(matches(*obj, R"({"a": [1, {"b": null}], "c": "d"})"));
  CHECK(matches(*obj, "{}"));
  CHECK_FALSE(matches(*obj, "[1]"));
  CHECK_FALSE(matches(*obj, "\"x\""));
  CHECK_FALSE(matches(*obj, "12"));
}

TEST_CASE("json matcher: a mutated text is accepted only where nlohmann accepts it", "[json][grammar]") {
  const auto g = any_value();
  std::mt19937_64 rng(11);
  const std::string alphabet = "{}[]\",:\\/ \n\t0123456789.-+eEtrufalsnbuDdCc\x01\x7f\xc3\xa9\xed\xa0\x80\xff";
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string text = random_value(rng, 3).dump(rng() % 2 ? -1 : 1, ' ', rng() % 2);
    for (int k = 1 + (int)(rng() % 3); k > 0; --k) {
      const size_t at = text.empty() ? 0 : rng() % (text.size() + 1);
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0: text.insert(text.begin() + (ptrdiff_t)at, c); break;
        case 1: if (at < text.size()) text.erase(at, 1); break;
        default: if (at < text.size()) text[at] = c;
      }
    }
    const bool ours = matches(*g, text);
    INFO(nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    if (ours) {
      CHECK(nlohmann::json::accept(text));
      ++accepted;
    } else {
      ++rejected;
    }
  }
  CHECK(accepted > 100);  // the check above ran on a fair share of both kinds
  CHECK(rejected > 100);
}

TEST_CASE("json matcher: limits and the edges of the JSON grammar", "[json][grammar]") {
  const auto g = any_value();
  // Whitespace: llama.cpp's rule (nothing, one space, or a newline and up to 20 spaces/tabs).
  CHECK(matches(*g, "[1, 2]"));
  CHECK(matches(*g, "[\n" + std::string(20, ' ') + "1]"));
  CHECK_FALSE(matches(*g, "[\n" + std::string(21, ' ') + "1]"));
  CHECK_FALSE(matches(*g, "[1,  2]"));
  CHECK_FALSE(matches(*g, "[1,\n\n2]"));
  // Numbers: no leading zeros, digits after '.', 'e'; the digit limits.
  CHECK(matches(*g, "-0.5e+10"));
  CHECK_FALSE(matches(*g, "01"));
  CHECK_FALSE(matches(*g, "1."));
  CHECK_FALSE(matches(*g, "1e"));
  CHECK(matches(*g, std::string(20, '9')));
  CHECK_FALSE(matches(*g, std::string(21, '9')));
  CHECK(matches(*g, "1e99"));
  CHECK_FALSE(matches(*g, "1e100"));  // at most 2 exponent digits: every number fits a double
  // Strings: escapes, surrogate pairs, UTF-8.
  CHECK(matches(*g, R"("\ud83d\ude00 \u00e9 \n")"));
  CHECK_FALSE(matches(*g, R"("\ud83d")"));        // a high surrogate alone
  CHECK_FALSE(matches(*g, R"("\ude00")"));        // a low one alone
  CHECK_FALSE(matches(*g, R"("\ud83d\u0041")"));  // not followed by a low one
  CHECK_FALSE(matches(*g, "\"\xed\xa0\x80\""));   // UTF-8 of a surrogate
  CHECK_FALSE(matches(*g, "\"\xc0\xaf\""));       // overlong
  CHECK_FALSE(matches(*g, "\"a\nb\""));           // raw control character
  CHECK_FALSE(matches(*g, R"("\x")"));
  // Depth.
  CHECK(matches(*g, std::string(json_matcher::kMaxDepth - 1, '[') + std::string(json_matcher::kMaxDepth - 1, ']')));
  json_matcher deep(*g, byte_vocab());
  CHECK_FALSE(deep.advance_bytes(std::string(json_matcher::kMaxDepth + 1, '[')));
  // Bare (guided_choice): exactly one of the texts, no whitespace around it.
  auto choice = std::make_shared<json_grammar>();
  json_node lit;
  lit.k = json_node::kind::literal;
  lit.literals = {"yes", "yesterday", "no way"};
  choice->set_root(choice->add(lit));
  choice->set_bare(true);
  REQUIRE(choice->finalize().empty());
  for (const char* ok : {"yes", "yesterday", "no way"}) CHECK(matches(*choice, ok));
  for (const char* bad : {" yes", "yes ", "yes\n", "\"yes\"", "no", "yesterdays"}) CHECK_FALSE(matches(*choice, bad));
  // A rejected byte leaves the state as it was.
  json_matcher m(*g, byte_vocab());
  REQUIRE(m.advance_bytes("{\"a\":"));
  CHECK_FALSE(m.advance_bytes("}"));
  CHECK(m.advance_bytes("1}"));
  CHECK(m.done());
}

TEST_CASE("json schema: properties in order, required, optional, extras, enums, bounds", "[json][schema]") {
  const auto compile = [](const char* s) { return compile_json_schema(ojson::parse(s)); };
  const auto person = compile(R"({"type": "object",
      "properties": {"name": {"type": "string", "maxLength": 3}, "age": {"type": "integer"},
                     "tags": {"type": "array", "items": {"enum": ["x", 1, null]}, "minItems": 1, "maxItems": 2}},
      "required": ["name", "tags"]})");
  CHECK(matches(*person, R"({"name": "Bob", "age": 31, "tags": ["x"]})"));
  CHECK(matches(*person, R"({"name": "é\"", "tags": [1, null]})"));       // optional skipped; escapes count as one
  CHECK_FALSE(matches(*person, R"({"age": 31, "name": "Bob", "tags": ["x"]})"));  // schema order
  CHECK_FALSE(matches(*person, R"({"name": "Bobby", "tags": ["x"]})"));   // maxLength
  CHECK_FALSE(matches(*person, R"({"name": "Bob", "age": 3.5, "tags": ["x"]})"));  // integer
  CHECK_FALSE(matches(*person, R"({"name": "Bob"})"));                     // required
  CHECK_FALSE(matches(*person, R"({"name": "Bob", "tags": []})"));        // minItems
  CHECK_FALSE(matches(*person, R"({"name": "Bob", "tags": ["x", 1, null]})"));  // maxItems
  CHECK_FALSE(matches(*person, R"({"name": "Bob", "tags": ["y"]})"));     // enum
  CHECK_FALSE(matches(*person, R"({"name": "Bob", "tags": ["x"], "z": 1})"));  // no extras

  const auto extras = compile(R"({"properties": {"a": {"const": 5}}, "additionalProperties": {"type": "boolean"}})");
  CHECK(matches(*extras, R"({"a": 5, "b": true, "c": false})"));
  CHECK(matches(*extras, R"({"q": true})"));
  CHECK_FALSE(matches(*extras, R"({"a": 6})"));
  CHECK_FALSE(matches(*extras, R"({"a": 5, "b": 1})"));
  CHECK(matches(*extras, R"({"b": true, "a": 5})"));
  CHECK_FALSE(matches(*extras, R"({"a": true})"));          // a declared name is not an extra key
  CHECK_FALSE(matches(*extras, R"({"a": 5, "a": false})"));

  // $ref with recursion and anyOf (a tree); nullable through a type list.
  const auto tree = compile(R"({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
      "properties": {"v": {"type": ["integer", "null"]}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["v", "kids"]}}})");
  CHECK(matches(*tree, R"({"v": 1, "kids": [{"v": null, "kids": []}, {"v": 2, "kids": [{"v": 3, "kids": []}]}]})"));
  CHECK_FALSE(matches(*tree, R"({"v": 1, "kids": [{"v": "x", "kids": []}]})"));
  const auto either = compile(R"({"anyOf": [{"type": "string", "minLength": 2}, {"type": "number"}, {"enum": [[1, 2]]}]})");
  CHECK(matches(*either, R"("ab")"));
  CHECK(matches(*either, "-1.5"));
  CHECK(matches(*either, "[1,2]"));  // enum and const values are written compact
  CHECK_FALSE(matches(*either, "[1, 2]"));
  CHECK_FALSE(matches(*either, R"("a")"));
  CHECK_FALSE(matches(*either, "[1, 3]"));
}

TEST_CASE("json schema: unsupported or malformed schemas are refused by name", "[json][schema]") {
  const auto refused = [](const char* s, const std::string& word) {
    INFO(s);
    try {
      compile_json_schema(ojson::parse(s));
      FAIL("accepted");
    } catch (const schema_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(word));
    }
  };
  refused(R"({"type": "string", "pattern": "^a"})", "pattern");
  refused(R"({"type": "string", "format": "email"})", "format");
  refused(R"({"type": "string", "pattern": "a+$"})", "anchored");
  refused(R"({"type": "string", "pattern": "^(a)\\1$"})", "backreference");
  refused(R"({"type": "string", "pattern": "^(?=a)a$"})", "lookaround");
  refused(R"({"type": "string", "pattern": "^a\\bc$"})", "boundar");
  refused(R"({"type": "string", "pattern": "^a{100}$"})", "64 states");
  refused(R"({"type": "string", "pattern": "^[b-a]$"})", "order");
  refused(R"({"type": "string", "pattern": "^(ab$"})", "group");
  refused(R"({"type": "string", "pattern": "^a$", "maxLength": 3})", "maxLength");
  refused(("{\"pattern\": \"^" + std::string(70, '(') + "a" + std::string(70, ')') + "$\"}").c_str(), "nested");
  refused(("{\"pattern\": \"^a" + std::string(1200, '*') + "$\"}").c_str(), "1000 characters");
  refused(R"({"pattern": "^((()){999}){999}$"})", "too large");
  refused(R"({"type": "integer", "minimum": 3})", "minimum");
  refused(R"({"type": "object", "properties": {"a": {"not": {}}}})", "not");
  refused(R"({"type": "teapot"})", "teapot");
  refused(R"({"type": "array", "minItems": 3, "maxItems": 2})", "minItems");
  refused(R"({"$ref": "#/$defs/missing"})", "missing");
  refused(R"({"$ref": "http://example.com/s.json"})", "$ref");
  refused(R"({"type": "object", "properties": {"a": 5}})", "schema");
  refused(R"({"enum": []})", "enum");
  CHECK_NOTHROW(compile_json_schema(ojson::parse(R"({"title": "t", "description": "d", "type": "object"})")));
}

TEST_CASE("json schema: string patterns agree with std::regex, escapes and UTF-8 decoded", "[json][schema][pattern]") {
  const std::vector<std::string> patterns{
      "^[0-9]{3}-[0-9]{4}$", "^(ab|cd)+x?$", "^[a-c]*b[^b]{1,2}$", "^\\d+(\\.\\d{1,2})?$", "^a.c$",
      "^[\\w-]+@[a-z]+\\.(com|org)$", "^(?:x|y){2,3}z*?$", "^\\s?\\S$", "^\"q\"\\\\/$", "^$",
      "^[^\\n]{0,3}\\n?$"};
  const std::string alphabet = "0123456789-abcdxyz.@_ \"\\/\n\tqmo";
  std::mt19937_64 rng(17);
  int matched = 0, total = 0;
  for (const auto& pat : patterns) {
    ojson schema = {{"type", "string"}, {"pattern", pat}};
    const auto g = compile_json_schema(schema);
    const std::regex re(pat.substr(1, pat.size() - 2), std::regex::ECMAScript);
    std::vector<std::string> candidates;
    for (int i = 0; i < 400; ++i) {
      std::string c;
      for (int n = (int)(rng() % 10); n > 0; --n) c += alphabet[rng() % alphabet.size()];
      candidates.push_back(c);
    }
    for (const char* c : {"555-1234", "abcdx", "abab", "cb12", "12.50", "x_y-z@abc.org", "xyzz", " a", "\"q\"\\/", "", "ab\n"})
      candidates.push_back(c);
    for (const auto& c : candidates) {
      const bool want = std::regex_match(c, re);
      INFO(pat << " on " << ojson(c).dump());
      CHECK(matches(*g, ojson(c).dump()) == want);
      CHECK(matches(*g, ojson(c).dump(-1, ' ', true)) == want);  // ASCII-escaped: the same value
      matched += want;
      ++total;
    }
  }
  CHECK(matched > 40);  // both outcomes ran
  CHECK(total - matched > 1000);

  // Code points, not bytes; escapes only where JSON needs one (a model cannot drift into \u
  // escapes of letters).
  const auto accents = compile_json_schema(ojson::parse(R"({"pattern": "^[à-ÿ]{2}é?😀*[\\n\"]?$"})"));
  CHECK(matches(*accents, "\"àÿé😀😀\""));
  CHECK(matches(*accents, "\"àÿ\\n\""));
  CHECK(matches(*accents, "\"àÿ\\u000a\""));
  CHECK(matches(*accents, "\"àÿ\\\"\""));
  CHECK_FALSE(matches(*accents, "\"à\""));
  CHECK_FALSE(matches(*accents, "\"àÿ😁\""));
  CHECK_FALSE(matches(*accents, "\"\\u00e0ÿ\""));  // a letter as \u: refused in pattern strings
  CHECK_FALSE(matches(*accents, "\"àÿ\\/\""));
  // No dead end: a byte or hex digit that cannot start an allowed code point is refused at once.
  json_matcher m(*accents, byte_vocab());
  CHECK(m.advance_bytes("\"àÿ\\u00"));
  CHECK_FALSE(m.advance_bytes("1"));  // U+001x: not \n
  CHECK(m.advance_bytes("0a\""));
  json_matcher u(*accents, byte_vocab());
  CHECK_FALSE(u.advance_bytes("\"\xe6"));  // U+6000-U+6FFF: none allowed
  CHECK(u.advance_bytes("\"\xc3"));        // U+00C0-U+00FF: some
  json_matcher v(*accents, byte_vocab());
  CHECK_FALSE(v.advance_bytes("\"\\"));    // no escape can start the value (letters first)
  const auto plain = compile_json_schema(ojson::parse(R"({"pattern": "^[a-z]+$"})"));
  json_matcher q(*plain, byte_vocab());
  CHECK_FALSE(q.advance_bytes("\"\\"));

  // Formats as patterns.
  const auto date = compile_json_schema(ojson::parse(R"({"type": "string", "format": "date-time"})"));
  CHECK(matches(*date, "\"2024-02-29T13:05:59.123+01:00\""));
  CHECK(matches(*date, "\"1999-12-31T23:59:59Z\""));
  CHECK_FALSE(matches(*date, "\"2024-13-01T00:00:00Z\""));
  CHECK_FALSE(matches(*date, "\"2024-01-01 00:00:00Z\""));
  const auto uuid = compile_json_schema(ojson::parse(R"({"format": "uuid"})"));
  CHECK(matches(*uuid, "\"123e4567-e89b-12d3-a456-426614174000\""));
  CHECK_FALSE(matches(*uuid, "\"123e4567-e89b-12d3-a456-42661417400\""));
}

TEST_CASE("json matcher: allowed-token masks agree with token-by-token checks on the default vocabulary",
          "[json][grammar][model]") {
  const vocab_index* v = model_vocab();
  if (!v) {
    WARN("models/default.gguf missing: skipped (scripts/setup.sh)");
    return;
  }
  const auto schema = compile_json_schema(ojson::parse(R"({"type": "object",
      "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 4},
                     "kind": {"enum": ["cat", "caterpillar", "dog"]}, "ok": {"type": "boolean"},
                     "xs": {"type": "array", "items": {"type": "number"}}, "code": {"pattern": "^[A-Z]{2}-[0-9]+$"}},
      "required": ["id", "kind"]})"));
  const std::string doc = R"({"id": -12, "name": "é\"b", "kind": "caterpillar", "ok": true, "xs": [1.5e3, 2], "code": "AB-123"})";
  std::vector<uint64_t> bits;
  int states = 0;
  for (size_t cut = 0; cut <= doc.size(); cut += 3) {
    json_matcher m(*schema, *v);
    REQUIRE(m.advance_bytes(doc.substr(0, cut)));
    m.allowed_tokens(bits);
    INFO("after " << doc.substr(0, cut));
    int64_t mismatches = 0, allowed = 0;
    for (int32_t id = 0; id < v->n_vocab(); ++id) {
      const bool bit = (bits[(size_t)id >> 6] >> (id & 63)) & 1;
      allowed += bit;
      if (bit != m.accepts_token(id)) ++mismatches;
    }
    CHECK(mismatches == 0);
    CHECK(allowed > 0);
    ++states;
  }
  CHECK(states > 20);
}

TEST_CASE("json schema: random generation under the masks always gives valid documents", "[json][grammar][model]") {
  const vocab_index* v = model_vocab();
  if (!v) {
    WARN("models/default.gguf missing: skipped (scripts/setup.sh)");
    return;
  }
  const auto schema = compile_json_schema(ojson::parse(R"({"type": "object",
      "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6},
                     "e": {"enum": ["red", "green", 7]}, "a": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                     "o": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}]},
                     "p": {"type": "string", "pattern": "^[a-f0-9]{4}(-[xy]+)?$"}},
      "required": ["n", "e", "o", "p"]})"));
  const std::regex p_re("[a-f0-9]{4}(-[xy]+)?");
  std::mt19937_64 rng(5);
  int finished = 0;
  for (int i = 0; i < 60; ++i) {
    const auto text = random_walk(*schema, *v, rng);
    if (!text) continue;
    ++finished;
    INFO(*text);
    REQUIRE(nlohmann::json::accept(*text));
    const ojson d = ojson::parse(*text);
    REQUIRE(d.is_object());
    CHECK(d.at("n").is_number_integer());
    CHECK((d.at("e") == "red" || d.at("e") == "green" || d.at("e") == 7));
    CHECK((d.at("o").is_null() || d.at("o").at("x").is_number()));
    CHECK(std::regex_match(d.at("p").get<std::string>(), p_re));
    if (d.contains("s")) {
      const std::string s = d["s"].get<std::string>();
      CHECK(std::count_if(s.begin(), s.end(), [](char c) { return ((uint8_t)c & 0xc0) != 0x80; }) <= 6);  // code points
    }
    if (d.contains("a")) CHECK(d["a"].size() <= 3);
    for (const auto& [k, _] : d.items()) CHECK((k == "n" || k == "s" || k == "e" || k == "a" || k == "o" || k == "p"));
  }
  CHECK(finished >= 40);
}

TEST_CASE("sample_constrained: draws only allowed tokens, greedy takes the best allowed one", "[json][sampling][model]") {
  const vocab_index* v = model_vocab();
  if (!v) {
    WARN("models/default.gguf missing: skipped (scripts/setup.sh)");
    return;
  }
  const auto g = json_grammar::any_object();
  std::mt19937_64 rng(9);
  std::vector<int32_t> generated;
  grammar_cursor cursor(g, *v);
  json_matcher m(*g, *v);
  std::vector<uint64_t> bits;
  for (int step = 0; step < 30; ++step) {
    std::vector<float> logits((size_t)v->n_vocab());
    for (auto& x : logits) x = std::normal_distribution<float>(0.0f, 3.0f)(rng);
    m.allowed_tokens(bits);
    sampling_params p;
    p.grammar = g;
    p.temperature = 0.0f;
    std::vector<float> copy = logits;
    const int32_t greedy = sample_constrained(copy, {}, cursor, generated, p).token;
    int32_t best = -1;
    for (int32_t id = 0; id < v->n_vocab(); ++id)
      if (((bits[(size_t)id >> 6] >> (id & 63)) & 1) && (best < 0 || logits[(size_t)id] > logits[(size_t)best])) best = id;
    CHECK(greedy == best);
    p.temperature = 1.0f;
    p.seed = step;
    p.has_seed = true;
    copy = logits;
    const int32_t drawn = sample_constrained(copy, {}, cursor, generated, p).token;
    CHECK(((bits[(size_t)drawn >> 6] >> (drawn & 63)) & 1));
    if (v->is_eog(drawn)) break;
    REQUIRE(m.advance_token(drawn));
    generated.push_back(drawn);
  }
  // A history that is not the one followed (a recomputed sequence) is replayed from the start.
  REQUIRE(generated.size() >= 4);
  const std::span<const int32_t> half = std::span<const int32_t>(generated).first(generated.size() / 2);
  REQUIRE(cursor.sync(half));
  json_matcher fresh(*g, *v);
  for (int32_t t : half) REQUIRE(fresh.advance_token(t));
  std::vector<uint64_t> a, b;
  CHECK(cursor.matcher().allowed_tokens(a) == fresh.allowed_tokens(b));
  CHECK(a == b);
  std::vector<int32_t> off = generated;
  off.push_back(v->n_vocab() - 1);  // a token the grammar refuses here (assumed below)
  if (!m.accepts_token(off.back())) CHECK_FALSE(cursor.sync(off));
}
