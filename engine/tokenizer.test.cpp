// Unit tests of the tokenizer pieces that need no model file: UTF-8 handling, the GPT-2 byte map,
// the pre-tokenizer regexes (expected splits worked out by hand from each regex), BPE and
// SentencePiece merging on tiny hand-made vocabularies, special tokens and streaming decode.
// The comparison with llama.cpp on real vocabularies is tests/python/test_tokenizer.py.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <set>

#include "engine/gguf.hpp"
#include "engine/pretokenize.hpp"
#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"

using namespace troupe::engine;
namespace uni = troupe::engine::unicode;

namespace {

std::vector<std::string> split(pretokenizer_kind kind, std::string_view text) {
  std::vector<uint32_t> cpts, lengths;
  uni::decode_lenient(text, cpts);
  pretokenize(kind, cpts, lengths);
  std::vector<std::string> out;
  size_t start = 0;
  for (uint32_t len : lengths) {
    std::string w;
    for (size_t i = start; i < start + len; ++i) uni::append_utf8(w, cpts[i]);
    out.push_back(w);
    start += len;
  }
  REQUIRE(start == cpts.size());
  return out;
}

using words = std::vector<std::string>;

// A byte-level BPE vocabulary: the 256 byte characters, then the results of `merges` (in
// byte-level text, "a b"), then `extra` tokens of the given types.
vocab_spec byte_vocab(const std::vector<std::string>& merges, const std::vector<std::pair<std::string, token_type>>& extra = {}) {
  vocab_spec v;
  v.model = "gpt2";
  v.pre = "gpt-2";
  for (int b = 0; b < 256; ++b) {
    v.tokens.emplace_back(uni::byte_to_utf8((uint8_t)b));
    v.types.push_back((int32_t)token_type::normal);
  }
  for (const auto& m : merges) {
    const std::string joined = m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1);
    if (std::find(v.tokens.begin(), v.tokens.end(), joined) == v.tokens.end()) {
      v.tokens.push_back(joined);
      v.types.push_back((int32_t)token_type::normal);
    }
  }
  v.merges = merges;
  for (const auto& [text, type] : extra) {
    v.tokens.push_back(text);
    v.types.push_back((int32_t)type);
  }
  return v;
}

std::vector<token_id> ids_of(const tokenizer& t, std::initializer_list<std::string_view> texts) {
  std::vector<token_id> out;
  for (auto s : texts) {
    const token_id id = t.find(s);
    REQUIRE(id >= 0);
    out.push_back(id);
  }
  return out;
}

const std::string smiley = "\xF0\x9F\x98\x80";  // U+1F600
const std::string fffd = "\xEF\xBF\xBD";

}  // namespace

TEST_CASE("GPT-2 byte map: a bijection onto printable code points", "[tokenizer][unicode]") {
  std::set<uint32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const uint32_t c = uni::byte_to_cpt((uint8_t)b);
    CHECK(uni::cpt_to_byte(c) == b);
    const auto f = uni::flags_of(c);
    CHECK_FALSE(f.is_whitespace());
    CHECK((f.bits & (uni::cpt_flags::control | uni::cpt_flags::undefined)) == 0);
    std::string utf8;
    uni::append_utf8(utf8, c);
    CHECK(uni::byte_to_utf8((uint8_t)b) == utf8);
    seen.insert(c);
  }
  CHECK(seen.size() == 256);
  CHECK(uni::byte_to_cpt('A') == 'A');
  CHECK(uni::byte_to_cpt(' ') == 0x120);   // 'Ġ'
  CHECK(uni::byte_to_cpt('\n') == 0x10A);  // 'Ċ'
  CHECK(uni::byte_to_cpt(0xAD) == 0x143);  // soft hyphen: the last unprintable byte
  CHECK(uni::byte_to_cpt(0xAE) == 0xAE);
  CHECK(uni::cpt_to_byte('A') == 'A');
  CHECK(uni::cpt_to_byte(0x20) == -1);  // a space is not a byte-level character
  CHECK(uni::cpt_to_byte(0x1F600) == -1);
}

TEST_CASE("code point categories come from utf8proc", "[tokenizer][unicode]") {
  using f = uni::cpt_flags;
  CHECK(uni::flags_of('a').bits == f::letter);
  CHECK(uni::flags_of(0x65E5).bits == f::letter);  // 日
  CHECK(uni::flags_of('7').bits == f::number);
  CHECK(uni::flags_of(0xB2).bits == f::number);    // ² (No)
  CHECK(uni::flags_of(0x2163).bits == f::number);  // Ⅳ (Nl)
  CHECK(uni::flags_of(0x301).bits == f::mark);
  CHECK(uni::flags_of('!').bits == f::punctuation);
  CHECK(uni::flags_of(0x3002).bits == f::punctuation);  // 。
  CHECK(uni::flags_of('$').bits == f::symbol);
  CHECK(uni::flags_of(0x1F600).bits == f::symbol);
  CHECK(uni::flags_of(' ').bits == (f::separator | f::whitespace));
  CHECK(uni::flags_of(0xA0).is_whitespace());
  CHECK(uni::flags_of(0x3000).is_whitespace());
  CHECK(uni::flags_of(0x2028).is_whitespace());
  CHECK(uni::flags_of('\t').bits == (f::control | f::whitespace));
  CHECK(uni::flags_of(0x85).bits == (f::control | f::whitespace));
  CHECK_FALSE(uni::flags_of(0x200B).is_whitespace());  // zero width space is Cf, not White_Space
  CHECK(uni::flags_of(0x378).bits == f::undefined);    // unassigned
  CHECK(uni::flags_of(0x110000).bits == f::undefined);
  CHECK(uni::to_lower('S') == 's');
  CHECK(uni::to_lower(0x391) == 0x3B1);  // Α -> α
}

TEST_CASE("lenient UTF-8 decoding follows llama.cpp", "[tokenizer][unicode]") {
  auto dec = [](std::string_view s) {
    std::vector<uint32_t> c;
    uni::decode_lenient(s, c);
    return c;
  };
  CHECK(dec("a\xC3\xA9" + smiley) == std::vector<uint32_t>{'a', 0xE9, 0x1F600});
  CHECK(dec("a\xFF" "b") == std::vector<uint32_t>{'a', 0xFFFD, 'b'});
  CHECK(dec("\x80") == std::vector<uint32_t>{0xFFFD});
  CHECK(dec("\xE2\x82") == std::vector<uint32_t>{0xFFFD, 0xFFFD});  // cut: each byte alone
  CHECK(dec("\xC3(") == std::vector<uint32_t>{0xFFFD, '('});
  CHECK(dec("\xC0\x80") == std::vector<uint32_t>{0});            // overlong: structure only
  CHECK(dec("\xED\xA0\x80") == std::vector<uint32_t>{0xD800});   // surrogate passes
  CHECK(dec("\xF5\x80\x80\x80") == std::vector<uint32_t>{0xFFFD});  // past U+10FFFF
  CHECK(dec("").empty());
}

TEST_CASE("strict UTF-8: complete characters, maximal subparts replaced", "[tokenizer][unicode]") {
  auto run = [](std::string_view s, size_t expect_used) {
    std::string out;
    CHECK(uni::append_complete_utf8(s, out) == expect_used);
    return out;
  };
  CHECK(run("ab" + smiley, 6) == "ab" + smiley);
  CHECK(run("ab\xF0\x9F\x98", 2) == "ab");        // held: valid but cut
  CHECK(run("\xE2\x82" "A", 3) == fffd + "A");     // cut by a non-continuation
  CHECK(run("\xFF" "A", 2) == fffd + "A");
  CHECK(run("\xC0\x80", 2) == fffd + fffd);        // overlong: C0 is never valid
  CHECK(run("\xED\xA0\x80", 3) == fffd + fffd + fffd);  // surrogate: ED then two strays
  CHECK(run("\xF4\x90\x80\x80", 4) == fffd + fffd + fffd + fffd);  // past U+10FFFF
  CHECK(run("\xE0\x80", 2) == fffd + fffd);        // E0 needs A0..BF next
  CHECK(uni::is_valid_utf8("h\xC3\xA9llo " + smiley));
  CHECK_FALSE(uni::is_valid_utf8("\xC3"));
  CHECK_FALSE(uni::is_valid_utf8("\xED\xA0\x80"));
}

// Expected splits below are worked out from the regexes in pretokenize.hpp, not from the code.
TEST_CASE("pre-tokenizer gpt2", "[tokenizer][pretokenize]") {
  const auto k = pretokenizer_kind::gpt2;
  CHECK(split(k, "Hello world") == words{"Hello", " world"});
  CHECK(split(k, "I'm fine, it's 2024!") == words{"I", "'m", " fine", ",", " it", "'s", " 2024", "!"});
  CHECK(split(k, "a   b") == words{"a", "  ", " b"});  // \s+(?!\S) leaves one space to the word
  CHECK(split(k, "hi   ") == words{"hi", "   "});
  CHECK(split(k, "don'T") == words{"don", "'", "T"});  // contractions are case-sensitive here
  CHECK(split(k, "3.14159") == words{"3", ".", "14159"});
  CHECK(split(k, "cafe\xCC\x81!") == words{"cafe", "\xCC\x81!"});  // a mark is not \p{L}
  CHECK(split(k, "a \n\n b") == words{"a", " \n\n", " b"});
  CHECK(split(k, "\tx") == words{"\t", "x"});
  CHECK(split(k, "").empty());
}

TEST_CASE("pre-tokenizer digits then gpt2 (SmolLM, StarCoder)", "[tokenizer][pretokenize]") {
  const auto k = pretokenizer_kind::digits_gpt2;
  CHECK(split(k, "x 2024") == words{"x", " ", "2", "0", "2", "4"});  // the space ends its word
  CHECK(split(k, "abc123def") == words{"abc", "1", "2", "3", "def"});
  CHECK(split(k, "v1.5") == words{"v", "1", ".", "5"});
  CHECK(split(k, "x\xC2\xB2") == words{"x", "\xC2\xB2"});  // ² is \p{N}
}

TEST_CASE("pre-tokenizer llama3", "[tokenizer][pretokenize]") {
  const auto k = pretokenizer_kind::llama3;
  CHECK(split(k, "Hello  world") == words{"Hello", " ", " world"});
  CHECK(split(k, "1234567") == words{"123", "456", "7"});
  CHECK(split(k, "I'M here") == words{"I", "'M", " here"});  // (?i:...)
  CHECK(split(k, "x = 1;\n") == words{"x", " =", " ", "1", ";\n"});
  CHECK(split(k, "...\n\n  hello") == words{"...\n\n", " ", " hello"});
  CHECK(split(k, "\t\tfoo") == words{"\t", "\tfoo"});  // [^\r\n\p{L}\p{N}]? leads the letters
  CHECK(split(k, "a\n\nb") == words{"a", "\n\n", "b"});
  CHECK(split(k, " \n x") == words{" \n", " x"});  // \s*[\r\n]+
  CHECK(split(k, "$100") == words{"$", "100"});
  CHECK(split(k, "(abc)") == words{"(abc", ")"});
}

TEST_CASE("pre-tokenizer qwen2 and qwen35", "[tokenizer][pretokenize]") {
  CHECK(split(pretokenizer_kind::qwen2, "1234567") == words{"1", "2", "3", "4", "5", "6", "7"});
  CHECK(split(pretokenizer_kind::qwen2, "a1b") == words{"a", "1", "b"});
  CHECK(split(pretokenizer_kind::qwen2, "cafe\xCC\x81 x") == words{"cafe", "\xCC\x81", " x"});
  CHECK(split(pretokenizer_kind::qwen35, "cafe\xCC\x81 x") == words{"cafe\xCC\x81", " x"});  // [\p{L}\p{M}]+
  CHECK(split(pretokenizer_kind::qwen35, " \xCC\x81" "a") == words{" \xCC\x81" "a"});
}

TEST_CASE("pre-tokenizers of several regexes: llama.cpp's default and falcon", "[tokenizer][pretokenize]") {
  const auto d = pretokenizer_kind::fallback;
  CHECK(split(d, "hello world!!") == words{"hello", " world", "!!"});
  CHECK(split(d, "1234567") == words{"123", "456", "7"});
  CHECK(split(d, "a+b") == words{"a", "+", "b"});
  CHECK(split(d, "x 12345") == words{"x", " ", "123", "45"});
  CHECK(split(d, "a `b") == words{"a", " `", "b"});  // ` is not in the first class
  const auto f = pretokenizer_kind::falcon;
  CHECK(split(f, "a `b") == words{"a", " ", "`", "b"});
  CHECK(split(f, "12345") == words{"123", "45"});
}

TEST_CASE("pre-tokenizer names map as in llama.cpp", "[tokenizer][pretokenize]") {
  CHECK(pretokenizer_from_name("smollm")->kind == pretokenizer_kind::digits_gpt2);
  CHECK(pretokenizer_from_name("llama-bpe")->kind == pretokenizer_kind::llama3);
  CHECK(pretokenizer_from_name("llama-bpe")->ignore_merges);
  CHECK(pretokenizer_from_name("llama-bpe")->add_bos_default);
  CHECK(pretokenizer_from_name("qwen2")->kind == pretokenizer_kind::qwen2);
  CHECK(pretokenizer_from_name("gpt-2")->kind == pretokenizer_kind::gpt2);
  CHECK(pretokenizer_from_name("")->kind == pretokenizer_kind::fallback);
  CHECK_FALSE(pretokenizer_from_name("no-such-model").has_value());
}

TEST_CASE("BPE merges: lowest rank first, leftmost on ties", "[tokenizer][bpe]") {
  SECTION("a chain of merges") {
    auto t = tokenizer::from_vocab(byte_vocab({"a b", "b c", "ab c"}));
    CHECK(t->encode("abc", false, false) == ids_of(*t, {"abc"}));
  }
  SECTION("a lower rank wins even when it blocks a longer token") {
    auto t = tokenizer::from_vocab(byte_vocab({"b c", "a b", "ab c"}));
    CHECK(t->encode("abc", false, false) == ids_of(*t, {"a", "bc"}));
  }
  SECTION("equal ranks merge the leftmost pair") {
    auto t = tokenizer::from_vocab(byte_vocab({"a a"}));
    CHECK(t->encode("aaa", false, false) == ids_of(*t, {"aa", "a"}));
    CHECK(t->encode("aaaa", false, false) == ids_of(*t, {"aa", "aa"}));
  }
  SECTION("a vocabulary entry without a merge is not formed") {
    auto t = tokenizer::from_vocab(byte_vocab({}, {{"xy", token_type::normal}}));
    CHECK(t->encode("xy", false, false) == ids_of(*t, {"x", "y"}));
  }
  SECTION("words do not merge across pre-tokenizer boundaries; spaces are byte-level") {
    auto t = tokenizer::from_vocab(byte_vocab({"\xC4\xA0 a", "a a"}));  // "Ġ a"
    CHECK(t->encode("a aa", false, false) == ids_of(*t, {"a", "\xC4\xA0" "a", "a"}));
    CHECK(t->decode(t->encode("a aa", false, false), false) == "a aa");
  }
}

TEST_CASE("special tokens: split out longest first, each over the whole text", "[tokenizer][special]") {
  auto t = tokenizer::from_vocab(byte_vocab({}, {{"<a>", token_type::control},
                                                 {"<b>", token_type::user_defined},
                                                 {"XYZ", token_type::control},
                                                 {"WX", token_type::control}}));
  const token_id a = t->find("<a>"), b = t->find("<b>"), xyz = t->find("XYZ");
  SECTION("control tokens only with parse_special; user-defined always") {
    CHECK(t->encode("x<a>y", false, true) == std::vector<token_id>{t->find("x"), a, t->find("y")});
    CHECK(t->encode("x<a>y", false, false) == ids_of(*t, {"x", "<", "a", ">", "y"}));
    CHECK(t->encode("x<b>y", false, false) == std::vector<token_id>{t->find("x"), b, t->find("y")});
    CHECK(t->encode("<a><a>", false, true) == std::vector<token_id>{a, a});
  }
  SECTION("the longer special is taken first even when a shorter one starts earlier") {
    // leftmost-longest would give WX + "YZ"; llama.cpp's order gives "W" + XYZ
    CHECK(t->encode("WXYZ", false, true) == std::vector<token_id>{t->find("W"), xyz});
  }
  SECTION("pieces of special tokens") {
    CHECK(t->token_to_piece(a, false).empty());
    CHECK(t->token_to_piece(a, true) == "<a>");
    CHECK(t->token_to_piece(b, false) == "<b>");
    CHECK(t->is_control(a));
    CHECK_FALSE(t->is_control(b));
    CHECK_THROWS_AS(t->token_to_piece(t->n_vocab(), false), std::out_of_range);
    CHECK_THROWS_AS(t->token_to_piece(-1, false), std::out_of_range);
  }
}

TEST_CASE("BOS, EOS and the end-of-generation set", "[tokenizer][special]") {
  auto v = byte_vocab({}, {{"<s>", token_type::control}, {"</s>", token_type::control}, {"<|im_end|>", token_type::normal}});
  v.bos = v.tokens.size() - 3;
  v.eos = v.tokens.size() - 2;
  v.add_bos = true;
  v.add_eos = true;
  auto t = tokenizer::from_vocab(v);
  const token_id bos = t->bos(), eos = t->eos(), im_end = t->find("<|im_end|>");
  CHECK(t->encode("a", true, false) == std::vector<token_id>{bos, t->find("a"), eos});
  CHECK(t->encode("a", false, false) == std::vector<token_id>{t->find("a")});
  CHECK(t->encode("", true, false) == std::vector<token_id>{bos, eos});
  CHECK(t->is_eog(eos));
  CHECK(t->is_eog(im_end));          // by its text, as llama.cpp
  CHECK(t->is_control(im_end));      // ... which also makes it a control token
  CHECK_FALSE(t->is_eog(bos));
  CHECK(t->eog_ids() == std::vector<token_id>{eos, im_end});

  vocab_spec no_bos = byte_vocab({});
  no_bos.pre = "chatglm-bpe";  // a family without BOS
  no_bos.add_bos = true;
  CHECK_THROWS_AS(tokenizer::from_vocab(no_bos), std::invalid_argument);
}

TEST_CASE("vocabulary errors", "[tokenizer]") {
  vocab_spec v = byte_vocab({});
  v.model = "bert";
  CHECK_THROWS_AS(tokenizer::from_vocab(v), std::invalid_argument);
  v.model = "gpt2";
  v.scores.assign(3, 0.0f);
  CHECK_THROWS_AS(tokenizer::from_vocab(v), std::invalid_argument);
  vocab_spec empty;
  empty.model = "llama";
  CHECK_THROWS_AS(tokenizer::from_vocab(empty), std::invalid_argument);
  vocab_spec unknown_pre = byte_vocab({"a b"});
  unknown_pre.pre = "no-such-pre";  // falls back to the default regexes, with a warning
  auto t = tokenizer::from_vocab(unknown_pre);
  CHECK(t->encode("ab!!", false, false) == ids_of(*t, {"ab", "!", "!"}));
}

namespace {

// A SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then scored pieces.
vocab_spec spm_vocab() {
  vocab_spec v;
  v.model = "llama";
  auto add = [&](std::string text, token_type type, float score) {
    v.tokens.push_back(std::move(text));
    v.types.push_back((int32_t)type);
    v.scores.push_back(score);
  };
  add("<unk>", token_type::unknown, 0);
  add("<s>", token_type::control, 0);
  add("</s>", token_type::control, 0);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    add(name, token_type::byte, 0);
  }
  const std::string sp = "\xE2\x96\x81";  // ▁
  add(sp, token_type::normal, -1.0f);
  add("a", token_type::normal, -2.0f);
  add("b", token_type::normal, -2.0f);
  add(sp + "a", token_type::normal, -1.5f);
  add("ab", token_type::normal, -1.0f);
  add(sp + "ab", token_type::normal, -0.5f);
  add("<start>", token_type::control, 0);
  return v;
}

}  // namespace

TEST_CASE("SentencePiece BPE: scores, space prefix, byte fallback", "[tokenizer][spm]") {
  auto t = tokenizer::from_vocab(spm_vocab());
  const std::string sp = "\xE2\x96\x81";
  CHECK(t->bos() == 1);
  CHECK(t->eos() == 2);
  CHECK(t->add_bos());
  // "▁ab": "ab" (-1) beats "▁a" (-1.5), then "▁ab" (-0.5)
  CHECK(t->encode("ab", true, false) == std::vector<token_id>{1, t->find(sp + "ab")});
  // é is no piece: its two bytes
  CHECK(t->encode("a\xC3\xA9", false, false) == std::vector<token_id>{t->find(sp + "a"), t->find("<0xC3>"), t->find("<0xA9>")});
  // after a special token the text gets the space prefix again
  CHECK(t->encode("<start>b", false, true) == std::vector<token_id>{t->find("<start>"), t->find(sp), t->find("b")});
  CHECK(t->token_to_piece(t->find(sp + "ab"), false) == " ab");
  CHECK(t->token_to_piece(t->find("<0x41>"), false) == "A");
  CHECK(t->token_to_piece(1, false).empty());
  CHECK(t->token_to_piece(1, true) == "<s>");
  CHECK(t->decode(t->encode("ab a\xC3\xA9", false, false), false) == " ab a\xC3\xA9");
}

TEST_CASE("stream_decoder emits whole characters only", "[tokenizer][stream]") {
  auto t = tokenizer::from_vocab(byte_vocab({}, {{"<ctl>", token_type::control}}));
  auto byte_ids = [&](std::string_view bytes) {
    std::vector<token_id> ids;
    for (unsigned char c : bytes) ids.push_back(t->find(uni::byte_to_utf8(c)));
    return ids;
  };
  SECTION("a character split over tokens is held until complete") {
    stream_decoder d(*t, false);
    const auto ids = byte_ids("a" + smiley + "b");
    REQUIRE(ids.size() == 6);
    std::vector<std::string> out;
    for (token_id id : ids) out.push_back(d.push(id));
    CHECK(out == std::vector<std::string>{"a", "", "", "", smiley, "b"});
    CHECK(d.flush().empty());
  }
  SECTION("CJK split in the middle, with a control token in between") {
    stream_decoder d(*t, false);
    const auto ids = byte_ids("\xE6\x97\xA5");  // 日
    CHECK(d.push(ids[0]).empty());
    CHECK(d.push(t->find("<ctl>")).empty());
    CHECK(d.push(ids[1]).empty());
    CHECK(d.push(ids[2]) == "\xE6\x97\xA5");
  }
  SECTION("invalid bytes become U+FFFD as soon as they cannot complete") {
    stream_decoder d(*t, false);
    CHECK(d.push(byte_ids("\xFF")[0]) == fffd);
    CHECK(d.push(byte_ids("\xE2")[0]).empty());
    CHECK(d.push(byte_ids("\x82")[0]).empty());
    CHECK(d.push(byte_ids("A")[0]) == fffd + "A");
  }
  SECTION("flush replaces a cut sequence") {
    stream_decoder d(*t, false);
    for (token_id id : byte_ids("x\xF0\x9F\x98")) d.push(id);
    CHECK(d.flush() == fffd);
    CHECK(d.flush().empty());
  }
  SECTION("render_special") {
    stream_decoder quiet(*t, false), loud(*t, true);
    CHECK(quiet.push(t->find("<ctl>")).empty());
    CHECK(loud.push(t->find("<ctl>")) == "<ctl>");
  }
}

#ifdef TROUPE_SOURCE_DIR
namespace {
std::unique_ptr<tokenizer> default_model_tokenizer() {
  const std::string path = std::string(TROUPE_SOURCE_DIR) + "/models/default.gguf";
  if (!std::filesystem::exists(path)) return nullptr;
  return tokenizer::from_gguf(*gguf_file::open(path));
}
}  // namespace

TEST_CASE("default model vocabulary: round trips and special tokens", "[tokenizer][model]") {
  auto t = default_model_tokenizer();
  if (!t) {
    WARN("models/default.gguf missing: skipped (scripts/setup.sh)");
    return;
  }
  CHECK(t->n_vocab() == 49152);
  for (const std::string& s : std::vector<std::string>{"Hello world", "  indented\n\tcode();\n", "日本語 " + smiley + " 1234567", ""})
    CHECK(t->decode(t->encode(s, false, false), false) == s);
  CHECK(t->encode("<|im_start|>", false, true) == std::vector<token_id>{1});
  CHECK(t->encode("<|im_start|>", false, false).size() > 1);
  CHECK(t->decode(t->encode("<|im_start|>hi", false, true), false) == "hi");
  CHECK(t->decode(t->encode("<|im_start|>hi", false, true), true) == "<|im_start|>hi");
}

TEST_CASE("encoding time is linear on long runs", "[tokenizer][model]") {
  auto t = default_model_tokenizer();
  if (!t) return;
  for (const std::string& s : {std::string(400000, ' '), std::string(400000, 'a'), std::string(200000, '7'),
                               std::string(200000, '\n'), std::string(100000, '!')}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = t->encode(s, false, false);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(t->decode(ids, false) == s);
    CHECK(secs < 3.0);  // well under 0.5 s when linear; a quadratic pass would take minutes
  }
}

TEST_CASE("tokenizer speed", "[tokenizer][!benchmark]") {
  auto t = default_model_tokenizer();
  if (!t) return;
  std::string text;
  while (text.size() < 1000000)
    text += "The quick brown fox jumps over the lazy dog; it's 3.14159 miles away. def f(x):\n    return x ** 2\n"
            "日本語のテキスト " + smiley + "\n";
  BENCHMARK("encode 1 MB") { return t->encode(text, false, false).size(); };
}
#endif
