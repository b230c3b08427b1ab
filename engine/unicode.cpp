#include "engine/unicode.hpp"

#include <utf8proc.h>

#include <array>

namespace troupe::engine::unicode {

namespace {

cpt_flags compute_flags(uint32_t cpt) {
  if (cpt > 0x10FFFF) return {cpt_flags::undefined};
  uint16_t bits = 0;
  switch (utf8proc_category((utf8proc_int32_t)cpt)) {
    case UTF8PROC_CATEGORY_CN: bits = cpt_flags::undefined; break;
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: bits = cpt_flags::letter; break;
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME: bits = cpt_flags::mark; break;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO: bits = cpt_flags::number; break;
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO: bits = cpt_flags::punctuation; break;
    case UTF8PROC_CATEGORY_SM:
    case UTF8PROC_CATEGORY_SC:
    case UTF8PROC_CATEGORY_SK:
    case UTF8PROC_CATEGORY_SO: bits = cpt_flags::symbol; break;
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP: bits = cpt_flags::separator | cpt_flags::whitespace; break;
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO: bits = cpt_flags::control; break;
  }
  // White_Space outside Z*: the C0 controls TAB..CR and NEL (PropList.txt).
  if ((cpt >= 0x09 && cpt <= 0x0D) || cpt == 0x85) bits |= cpt_flags::whitespace;
  return {bits};
}

// Latin-1 is by far the most frequent range: look it up in a table built once from utf8proc.
const std::array<cpt_flags, 256>& latin1_flags() {
  static const auto table = [] {
    std::array<cpt_flags, 256> t{};
    for (uint32_t c = 0; c < 256; ++c) t[c] = compute_flags(c);
    return t;
  }();
  return table;
}

struct byte_map {
  std::array<uint32_t, 256> to_cpt{};
  std::array<std::string, 256> to_utf8;
  std::array<int16_t, 512> from_cpt{};  // every mapped code point is below U+0144
};

const byte_map& gpt2_bytes() {
  static const byte_map m = [] {
    byte_map b;
    b.from_cpt.fill(-1);
    auto printable = [](uint32_t c) { return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF); };
    uint32_t n = 0;
    for (uint32_t c = 0; c < 256; ++c) {
      const uint32_t cpt = printable(c) ? c : 256 + n++;
      b.to_cpt[c] = cpt;
      append_utf8(b.to_utf8[c], cpt);
      b.from_cpt[cpt] = (int16_t)c;
    }
    return b;
  }();
  return m;
}

}  // namespace

cpt_flags flags_of(uint32_t cpt) { return cpt < 256 ? latin1_flags()[cpt] : compute_flags(cpt); }

uint32_t to_lower(uint32_t cpt) {
  if (cpt > 0x10FFFF) return cpt;
  return (uint32_t)utf8proc_tolower((utf8proc_int32_t)cpt);
}

void append_utf8(std::string& out, uint32_t cpt) {
  if (cpt < 0x80) {
    out.push_back((char)cpt);
  } else if (cpt < 0x800) {
    out.push_back((char)(0xC0 | (cpt >> 6)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  } else if (cpt < 0x10000) {
    out.push_back((char)(0xE0 | (cpt >> 12)));
    out.push_back((char)(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  } else {
    out.push_back((char)(0xF0 | ((cpt >> 18) & 0x07)));
    out.push_back((char)(0x80 | ((cpt >> 12) & 0x3F)));
    out.push_back((char)(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  }
}

void decode_lenient(std::string_view text, std::vector<uint32_t>& out) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  out.reserve(out.size() + n);
  auto cont = [&](size_t i) { return i < n && (s[i] & 0xC0) == 0x80; };
  size_t i = 0;
  while (i < n) {
    const uint8_t b0 = s[i];
    if (b0 < 0x80) {
      out.push_back(b0);
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && cont(i + 1)) {
      out.push_back(((b0 & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu));
      i += 2;
    } else if ((b0 & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2)) {
      out.push_back(((b0 & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu));
      i += 3;
    } else if ((b0 & 0xF8) == 0xF0 && cont(i + 1) && cont(i + 2) && cont(i + 3)) {
      const uint32_t c = ((b0 & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
      out.push_back(c <= 0x10FFFF ? c : replacement_char);
      i += 4;
    } else {
      out.push_back(replacement_char);  // a stray continuation byte, a bad lead or a cut sequence
      i += 1;
    }
  }
}

namespace {

// Classifies the sequence starting at s[0] (n >= 1 bytes available) per Unicode table 3-7 and sets
// len: complete -> its length; invalid -> the length of its maximal ill-formed subpart (>= 1), to be
// replaced by one U+FFFD; truncated -> valid so far but cut by the end of the buffer.
enum class seq_state { complete, truncated, invalid };

seq_state classify(const uint8_t* s, size_t n, size_t& len) {
  const uint8_t b0 = s[0];
  if (b0 < 0x80) {
    len = 1;
    return seq_state::complete;
  }
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // bounds of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    len = 1;  // C0, C1, F5..FF, or a continuation byte
    return seq_state::invalid;
  }
  for (size_t k = 1; k < need; ++k) {
    if (k >= n) {
      len = k;
      return seq_state::truncated;
    }
    const uint8_t b = s[k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
    if (!ok) {
      len = k;  // the maximal subpart: the bytes before the bad one
      return seq_state::invalid;
    }
  }
  len = need;
  return seq_state::complete;
}

}  // namespace

size_t append_complete_utf8(std::string_view sv, std::string& out) {
  const auto* s = reinterpret_cast<const uint8_t*>(sv.data());
  const size_t n = sv.size();
  size_t i = 0;
  while (i < n) {
    size_t len = 0;
    switch (classify(s + i, n - i, len)) {
      case seq_state::complete:
        out.append(sv.data() + i, len);
        i += len;
        break;
      case seq_state::invalid:
        append_utf8(out, replacement_char);
        i += len;
        break;
      case seq_state::truncated:
        return i;
    }
  }
  return i;
}

bool is_valid_utf8(std::string_view sv) {
  const auto* s = reinterpret_cast<const uint8_t*>(sv.data());
  size_t i = 0;
  while (i < sv.size()) {
    size_t len = 0;
    if (classify(s + i, sv.size() - i, len) != seq_state::complete) return false;
    i += len;
  }
  return true;
}

uint32_t byte_to_cpt(uint8_t byte) { return gpt2_bytes().to_cpt[byte]; }

std::string_view byte_to_utf8(uint8_t byte) { return gpt2_bytes().to_utf8[byte]; }

int cpt_to_byte(uint32_t cpt) { return cpt < 512 ? gpt2_bytes().from_cpt[cpt] : -1; }

}  // namespace troupe::engine::unicode
