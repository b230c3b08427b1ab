// UTF-8 and Unicode helpers for the tokenizer: llama.cpp-compatible lenient decoding, strict
// validation for streaming output, code point categories (from utf8proc) and GPT-2's byte-level
// byte <-> code point map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::engine::unicode {

inline constexpr uint32_t replacement_char = 0xFFFD;

/// Category bits of one code point, as llama.cpp's unicode_cpt_flags: the general category
/// collapsed to its major class, plus White_Space. A code point of an unassigned category (Cn)
/// has only `undefined`; the empty value (bits == 0) stands for "outside the text".
struct cpt_flags {
  enum : uint16_t {
    undefined = 0x0001,
    number = 0x0002,       // \p{N}
    letter = 0x0004,       // \p{L}
    separator = 0x0008,    // \p{Z}
    mark = 0x0010,         // \p{M}
    punctuation = 0x0020,  // \p{P}
    symbol = 0x0040,       // \p{S}
    control = 0x0080,      // \p{C} except Cn
    whitespace = 0x0100,   // \s: White_Space (Z* and U+0009..U+000D, U+0085)
  };
  uint16_t bits = 0;

  bool any() const { return bits != 0; }
  bool is_number() const { return bits & number; }
  bool is_letter() const { return bits & letter; }
  bool is_mark() const { return bits & mark; }
  bool is_punctuation() const { return bits & punctuation; }
  bool is_symbol() const { return bits & symbol; }
  bool is_whitespace() const { return bits & whitespace; }
};

/// Category of `cpt` from utf8proc's tables (code points past U+10FFFF: `undefined`).
cpt_flags flags_of(uint32_t cpt);

/// Simple lowercase mapping (utf8proc_tolower); `cpt` itself when it has none.
uint32_t to_lower(uint32_t cpt);

/// Byte length of the UTF-8 sequence that `lead` starts, judged by its high nibble alone
/// (continuation bytes count as 1), as llama.cpp's unicode_len_utf8.
inline size_t utf8_len(uint8_t lead) {
  static constexpr uint8_t lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return lookup[lead >> 4];
}

/// Appends the UTF-8 encoding of `cpt` (must be <= U+10FFFF; surrogates are encoded as is).
void append_utf8(std::string& out, uint32_t cpt);

/// Decodes `text` the way llama.cpp does before pre-tokenizing: sequences are checked for their
/// structure only (overlong forms and surrogates pass), and each byte that does not start a
/// well-formed sequence becomes U+FFFD. Code points past U+10FFFF also become U+FFFD.
void decode_lenient(std::string_view text, std::vector<uint32_t>& out);

/// Strict UTF-8 (Unicode table 3-7). Appends to `out` the characters of `s` that are complete,
/// replacing each maximal ill-formed subpart by U+FFFD, and returns how many bytes of `s` it
/// consumed: the rest (at most 3 bytes) is the valid beginning of a character cut short.
size_t append_complete_utf8(std::string_view s, std::string& out);

/// True when `s` is well-formed UTF-8.
bool is_valid_utf8(std::string_view s);

/// GPT-2 byte-level encoding: each byte maps to one printable code point ('!'..'~', U+00A1..U+00AC
/// and U+00AE..U+00FF map to themselves, the other 68 bytes to U+0100.. in byte order).
uint32_t byte_to_cpt(uint8_t byte);
/// The UTF-8 text of byte_to_cpt(byte).
std::string_view byte_to_utf8(uint8_t byte);
/// Inverse of byte_to_cpt; -1 for a code point that encodes no byte.
int cpt_to_byte(uint32_t cpt);

}  // namespace troupe::engine::unicode
