#include "engine/chat_template.hpp"

#include <array>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace troupe::engine {

// ---------------------------------------------------------------------------------------------
// python_strip

namespace {

bool python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

/// Decodes one UTF-8 code point at s[i]; returns its length, 0 when invalid.
size_t decode_utf8(std::string_view s, size_t i, uint32_t& cp) {
  const auto b = uint8_t(s[i]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
  if (len == 0 || i + len > s.size()) return 0;
  cp = len == 1 ? b : len == 2 ? b & 0x1f : len == 3 ? b & 0x0f : b & 0x07;
  for (size_t k = 1; k < len; ++k) {
    const auto c = uint8_t(s[i + k]);
    if ((c >> 6) != 0x2) return 0;
    cp = (cp << 6) | (c & 0x3f);
  }
  static constexpr std::array<uint32_t, 5> min_cp = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return len;
}

}  // namespace

std::string_view python_strip(std::string_view s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    uint32_t cp = 0;
    const size_t len = decode_utf8(s.substr(0, end), begin, cp);
    if (len == 0 || !python_space(cp)) break;
    begin += len;
  }
  while (end > begin) {
    size_t start = end - 1;  // back up to the lead byte (at most 3 continuation bytes)
    while (start > begin && end - start < 4 && (uint8_t(s[start]) >> 6) == 0x2) --start;
    uint32_t cp = 0;
    const size_t len = decode_utf8(s.substr(0, end), start, cp);
    if (len != end - start || !python_space(cp)) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

// ---------------------------------------------------------------------------------------------
// Template normalization: the template text is reduced to a canonical form in which templates
// that Jinja renders identically for our inputs compare equal. That form keeps only the tags
// (the literal text between them must vanish under Hugging Face's trim_blocks, lstrip_blocks
// and `-` whitespace control), drops whitespace except one space between two identifier
// characters, writes every string literal single-quoted with \n \r \t \\ \' escapes, merges
// 'a'+'b' into 'ab', writes x.role / x.content as x['role'] / x['content'], names the loop
// variable `message`, and replaces the messages of raise_exception() by *.

namespace {

bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
bool space_char(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/// Reads the Jinja string literal starting at s[i] (a quote); Python escape semantics for the
/// escapes templates use. Returns false on an unterminated literal or an escape we do not
/// decode (octal, \x, \u, \N).
bool read_literal(std::string_view s, size_t& i, std::string& out) {
  const char quote = s[i++];
  out.clear();
  while (i < s.size() && s[i] != quote) {
    char c = s[i++];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i >= s.size()) return false;
    c = s[i++];
    switch (c) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\\': case '\'': case '"': out += c; break;
      case '\n': break;  // line continuation
      case 'x': case 'u': case 'U': case 'N': return false;
      default:
        if (c >= '0' && c <= '7') return false;
        out += '\\';  // Python keeps unknown escapes as they are
        out += c;
    }
  }
  if (i >= s.size()) return false;
  ++i;  // closing quote
  return true;
}

std::string quote_literal(std::string_view v) {
  std::string q = "'";
  for (char c : v) {
    switch (c) {
      case '\n': q += "\\n"; break;
      case '\r': q += "\\r"; break;
      case '\t': q += "\\t"; break;
      case '\\': q += "\\\\"; break;
      case '\'': q += "\\'"; break;
      default: q += c;
    }
  }
  return q + "'";
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
}

/// x.name -> x['name'] in code (no literals in it).
std::string attribute_to_item(std::string_view code, std::string_view name) {
  std::string out;
  for (size_t i = 0; i < code.size();) {
    const size_t end = i + 1 + name.size();
    if (code[i] == '.' && code.substr(i + 1, name.size()) == name &&
        (end >= code.size() || !ident_char(code[end]))) {
      out += "['";
      out.append(name);
      out += "']";
      i = end;
    } else {
      out += code[i++];
    }
  }
  return out;
}

/// Appends the canonical form of one tag body (between the delimiters, markers removed).
bool compact_tag(std::string_view body, std::string& out) {
  std::string code;  // the current run outside literals; \x01 marks a space that stays
  size_t last_literal_end = std::string::npos;  // in out, just after the last literal's quote
  auto flush_code = [&] {
    code = attribute_to_item(code, "role");
    code = attribute_to_item(code, "content");
    for (char c : code) {
      if (c == '\x01') {
        out += ' ';
      } else if (!space_char(c)) {
        out += c;
      }
    }
    code.clear();
  };
  bool pending_space = false;
  for (size_t i = 0; i < body.size();) {
    const char c = body[i];
    if (c == '\'' || c == '"') {
      std::string value;
      if (!read_literal(body, i, value)) return false;
      flush_code();
      pending_space = false;
      // 'a'+'b' -> 'ab'
      if (last_literal_end != std::string::npos && out.size() == last_literal_end + 1 && out.back() == '+') {
        out.resize(last_literal_end - 1);  // drop "'+"
        out += quote_literal(value).substr(1);
      } else {
        out += quote_literal(value);
      }
      last_literal_end = out.size();
      continue;
    }
    if (space_char(c)) {
      pending_space = true;
    } else {
      // One space survives between identifier characters ("for x in y").
      const char prev = !code.empty() ? code.back() : (out.empty() ? ' ' : out.back());
      if (pending_space && ident_char(prev) && ident_char(c)) code += '\x01';
      pending_space = false;
      code += c;
    }
    ++i;
  }
  flush_code();
  return true;
}

/// Renames identifier `from` to `to` outside literals.
std::string rename_identifier(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '\'') {  // canonical literal: skip it whole
      size_t j = i + 1;
      while (j < s.size() && s[j] != '\'') j += s[j] == '\\' ? 2 : 1;
      out.append(s.substr(i, j + 1 - i));
      i = j + 1;
      continue;
    }
    if (ident_char(s[i]) && (i == 0 || !ident_char(s[i - 1]))) {
      size_t j = i;
      while (j < s.size() && ident_char(s[j])) ++j;
      const auto word = s.substr(i, j - i);
      const bool attribute = i > 0 && s[i - 1] == '.';
      out.append(word == from && !attribute ? to : word);
      i = j;
      continue;
    }
    out += s[i++];
  }
  return out;
}

struct jinja_tag {
  char kind;  // '{' expression, '%' statement, '#' comment
  bool strip_before, strip_after;  // `-` markers
  bool keep_lstrip, keep_trim;     // `+` markers
  std::string_view body;
};

/// The canonical form of a template, nullopt when its literal text would not vanish or it
/// cannot be read.
std::optional<std::string> normalize(std::string_view src) {
  if (!src.empty() && src.back() == '\n') src.remove_suffix(1);  // keep_trailing_newline=False
  std::vector<std::string_view> data;
  std::vector<jinja_tag> tags;
  size_t pos = 0;
  while (true) {
    size_t open = pos;
    while ((open = src.find('{', open)) != std::string_view::npos &&
           (open + 1 >= src.size() || (src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')))
      ++open;
    if (open == std::string_view::npos) {
      data.emplace_back(src.substr(pos));
      break;
    }
    data.emplace_back(src.substr(pos, open - pos));
    jinja_tag t{src[open + 1], false, false, false, false, {}};
    size_t i = open + 2;
    if (i < src.size() && (src[i] == '-' || src[i] == '+')) {
      t.strip_before = src[i] == '-';
      t.keep_lstrip = src[i] == '+';
      ++i;
    }
    const char close = t.kind == '{' ? '}' : t.kind;
    size_t j = i;
    std::string scratch;
    while (j + 1 < src.size() && !(src[j] == close && src[j + 1] == '}')) {
      if (t.kind != '#' && (src[j] == '\'' || src[j] == '"')) {
        if (!read_literal(src, j, scratch)) return std::nullopt;
      } else {
        ++j;
      }
    }
    if (j + 1 >= src.size()) return std::nullopt;  // unterminated tag
    size_t body_end = j;
    if (body_end > i && (src[body_end - 1] == '-' || src[body_end - 1] == '+')) {
      t.strip_after = src[body_end - 1] == '-';
      t.keep_trim = src[body_end - 1] == '+';
      --body_end;
    }
    t.body = src.substr(i, body_end - i);
    tags.push_back(t);
    pos = j + 2;
  }
  // Whitespace handling of the text around each tag, as Jinja does with Hugging Face's
  // trim_blocks=True, lstrip_blocks=True; both ends are judged on the original text.
  for (size_t k = 0; k < data.size(); ++k) {
    const std::string_view d = data[k];
    size_t lo = 0, hi = d.size();
    if (k > 0) {
      const auto& prev = tags[k - 1];
      if (prev.strip_after) {
        while (lo < d.size() && space_char(d[lo])) ++lo;
      } else if (prev.kind != '{' && !prev.keep_trim) {
        lo = d.compare(0, 1, "\n") == 0 ? 1 : d.compare(0, 2, "\r\n") == 0 ? 2 : 0;
      }
    }
    if (k < tags.size()) {
      const auto& next = tags[k];
      if (next.strip_before) {
        while (hi > 0 && space_char(d[hi - 1])) --hi;
      } else if (next.kind != '{' && !next.keep_lstrip) {
        size_t b = hi;
        while (b > 0 && (d[b - 1] == ' ' || d[b - 1] == '\t')) --b;
        if (b == 0 ? k == 0 : d[b - 1] == '\n') hi = b;
      }
    }
    if (lo < hi) return std::nullopt;  // literal text: not a template we model
  }
  std::string out;
  for (const auto& t : tags) {
    if (t.kind == '#') continue;
    out += t.kind == '{' ? "{{" : "{%";
    if (!compact_tag(t.body, out)) return std::nullopt;
    out += t.kind == '{' ? "}}" : "%}";
  }
  // raise_exception('...') -> raise_exception(*)
  for (size_t p = out.find("raise_exception('"); p != std::string::npos;
       p = out.find("raise_exception('", p + 1)) {
    size_t j = p + 17;
    while (j < out.size() && out[j] != '\'') j += out[j] == '\\' ? 2 : 1;
    if (j >= out.size()) return std::nullopt;
    out = out.substr(0, p + 16) + '*' + out.substr(j + 1);
  }
  replace_all(out, "{%if not add_generation_prompt is defined%}{%set add_generation_prompt=false%}{%endif%}", "");
  // The loop variable is called `message`.
  if (const size_t f = out.find("{%for "); f != std::string::npos) {
    const size_t e = out.find(" in ", f);
    if (e != std::string::npos) {
      const std::string var = out.substr(f + 6, e - (f + 6));
      if (var != "message" && out.find("message") == std::string::npos)
        out = rename_identifier(out, var, "message");
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Known templates, in canonical form. "@" marks where a default system prompt goes.

constexpr std::string_view chatml_message =
    "{{'<|im_start|>'+message['role']+'\\n'+message['content']+'<|im_end|>\\n'}}{%endfor%}"
    "{%if add_generation_prompt%}{{'<|im_start|>assistant\\n'}}{%endif%}";
constexpr std::string_view chatml_default_system_open =
    "{%if loop.first and messages[0]['role']!='system'%}{{'<|im_start|>system\\n";
constexpr std::string_view chatml_default_system_close = "<|im_end|>\\n'}}{%endif%}";

constexpr std::string_view llama3_body =
    "{%set loop_messages=messages%}{%for message in loop_messages%}"
    "{%set content='<|start_header_id|>'+message['role']+'<|end_header_id|>\\n\\n'+"
    "message['content']|trim+'<|eot_id|>'%}{%if loop.index0==0%}{%set content=bos_token+content%}"
    "{%endif%}{{content}}{%endfor%}";
constexpr std::string_view llama3_header = "{{'<|start_header_id|>assistant<|end_header_id|>\\n\\n'}}";

constexpr std::string_view gemma_alternation =
    "{%if(message['role']=='user')!=(loop.index0%2==0)%}{{raise_exception(*)}}{%endif%}"
    "{%if(message['role']=='assistant')%}{%set role='model'%}{%else%}{%set role=message['role']%}{%endif%}";
constexpr std::string_view gemma_tail =
    "{%if add_generation_prompt%}{{'<start_of_turn>model\\n'}}{%endif%}";
constexpr std::string_view gemma3_body =
    "{%if messages[0]['role']=='system'%}{%if messages[0]['content']is string%}"
    "{%set first_user_prefix=messages[0]['content']+'\\n\\n'%}{%else%}"
    "{%set first_user_prefix=messages[0]['content'][0]['text']+'\\n\\n'%}{%endif%}"
    "{%set loop_messages=messages[1:]%}{%else%}{%set first_user_prefix=''%}"
    "{%set loop_messages=messages%}{%endif%}{%for message in loop_messages%}";
constexpr std::string_view gemma3_turn =
    "{{'<start_of_turn>'+role+'\\n'+(first_user_prefix if loop.first else'')}}"
    "{%if message['content']is string%}{{message['content']|trim}}"
    "{%elif message['content']is iterable%}{%for item in message['content']%}"
    "{%if item['type']=='image'%}{{'<start_of_image>'}}{%elif item['type']=='text'%}"
    "{{item['text']|trim}}{%endif%}{%endfor%}{%else%}{{raise_exception(*)}}{%endif%}"
    "{{'<end_of_turn>\\n'}}{%endfor%}";
constexpr std::string_view gemma2_head =
    "{%if messages[0]['role']=='system'%}{{raise_exception(*)}}{%endif%}{%for message in messages%}";
constexpr std::string_view gemma2_turn =
    "{{'<start_of_turn>'+role+'\\n'+message['content']|trim+'<end_of_turn>\\n'}}{%endfor%}";

constexpr std::string_view mistral_alternation =
    "{%if(message['role']=='user')!=(loop.index0%2==0)%}{{raise_exception(*)}}{%endif%}";
constexpr std::string_view mistral_v1_body =
    "{%if message['role']=='user'%}{{'[INST] '+message['content']+' [/INST]'}}"
    "{%elif message['role']=='assistant'%}{{message['content']+eos_token+' '}}"
    "{%else%}{{raise_exception(*)}}{%endif%}{%endfor%}";
constexpr std::string_view mistral_v2_body =
    "{%if message['role']=='user'%}{{'[INST] '+message['content']+' [/INST]'}}"
    "{%elif message['role']=='assistant'%}{{message['content']+eos_token}}"
    "{%else%}{{raise_exception(*)}}{%endif%}{%endfor%}";
constexpr std::string_view mistral_system_head =
    "{%if messages[0]['role']=='system'%}{%set system_message=messages[0]['content']%}"
    "{%set loop_messages=messages[1:]%}{%else%}{%set loop_messages=messages%}{%endif%}"
    "{{bos_token}}{%for message in loop_messages%}";
constexpr std::string_view mistral_system_body =
    "{%if message['role']=='user'%}{%if loop.first and system_message is defined%}"
    "{{' [INST] '+system_message+'\\n\\n'+message['content']+' [/INST]'}}"
    "{%else%}{{' [INST] '+message['content']+' [/INST]'}}{%endif%}"
    "{%elif message['role']=='assistant'%}{{' '+message['content']+eos_token}}"
    "{%else%}{{raise_exception(*)}}{%endif%}{%endfor%}";

bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

/// Decodes the body of a canonical literal (no quotes); nullopt if it holds an unescaped quote.
std::optional<std::string> unquote_canonical(std::string_view body) {
  std::string q = "'";
  q.append(body);
  q += '\'';
  size_t i = 0;
  std::string out;
  if (!read_literal(q, i, out) || i != q.size()) return std::nullopt;
  return out;
}

}  // namespace

std::optional<chat_template> chat_template::detect(std::string_view jinja_source, std::string bos_text,
                                                   std::string eos_text) {
  const auto canonical = normalize(jinja_source);
  if (!canonical) return std::nullopt;
  std::string_view rest = *canonical;
  const bool leading_bos = consume(rest, "{{bos_token}}");
  chat_template t(chat_family::chatml, std::move(bos_text), std::move(eos_text));
  t.leading_bos_ = leading_bos;

  // ChatML, with or without a default system prompt.
  if (std::string_view s = rest; consume(s, "{%for message in messages%}")) {
    std::optional<std::string> default_system;
    if (consume(s, chatml_default_system_open)) {
      const size_t close = s.find(chatml_default_system_close);
      if (close != std::string_view::npos) default_system = unquote_canonical(s.substr(0, close));
      if (default_system) s.remove_prefix(close + chatml_default_system_close.size());
    }
    if (s == chatml_message) {
      t.default_system_ = std::move(default_system);
      return t;
    }
  }
  // Llama 3: BOS before the first message; the assistant header always or on request.
  if (std::string_view s = rest; !leading_bos && consume(s, llama3_body)) {
    t.family_ = chat_family::llama3;
    t.always_generation_prompt_ = s == llama3_header;
    if (t.always_generation_prompt_ ||
        (consume(s, "{%if add_generation_prompt%}") && consume(s, llama3_header) && s == "{%endif%}"))
      return t;
  }
  // Gemma 3 folds a system message into the first user turn; Gemma 2 and 1.1 reject it.
  for (const bool gemma3 : {true, false}) {
    std::string_view s = rest;
    if (consume(s, gemma3 ? gemma3_body : gemma2_head) && consume(s, gemma_alternation) &&
        consume(s, gemma3 ? gemma3_turn : gemma2_turn) && s == gemma_tail) {
      t.family_ = chat_family::gemma;
      t.fold_system_ = gemma3;
      return t;
    }
  }
  // Mistral v0.1 / v0.2 as released: user and assistant only.
  if (std::string_view s = rest; leading_bos && consume(s, "{%for message in messages%}") &&
                                 consume(s, mistral_alternation) && (s == mistral_v1_body || s == mistral_v2_body)) {
    t.family_ = chat_family::mistral;
    t.fold_system_ = false;
    t.assistant_suffix_ = s == mistral_v1_body ? " " : "";
    return t;
  }
  // Mistral v0.2's 2024 template: the canonical "mistral".
  if (std::string_view s = rest; !leading_bos && consume(s, mistral_system_head) &&
                                 consume(s, mistral_alternation) && s == mistral_system_body)
    return from_name("mistral", std::move(t.bos_), std::move(t.eos_));
  return std::nullopt;
}

std::optional<chat_template> chat_template::from_name(std::string_view name, std::string bos_text,
                                                      std::string eos_text) {
  if (name == "chatml") return chat_template(chat_family::chatml, std::move(bos_text), std::move(eos_text));
  if (name == "llama3") return chat_template(chat_family::llama3, std::move(bos_text), std::move(eos_text));
  if (name == "gemma") {
    chat_template t(chat_family::gemma, std::move(bos_text), std::move(eos_text));
    t.leading_bos_ = true;
    return t;
  }
  if (name == "mistral") {
    chat_template t(chat_family::mistral, std::move(bos_text), std::move(eos_text));
    t.leading_bos_ = true;
    t.inst_open_ = std::string(" [INST] ");
    t.assistant_prefix_ = std::string(" ");
    return t;
  }
  return std::nullopt;
}

std::string_view chat_template::name() const {
  switch (family_) {
    case chat_family::chatml: return "chatml";
    case chat_family::llama3: return "llama3";
    case chat_family::gemma: return "gemma";
    case chat_family::mistral: return "mistral";
  }
  return "unknown";
}

bool chat_template::renders_bos() const {
  return !bos_.empty() && (family_ == chat_family::llama3 || leading_bos_);
}

// ---------------------------------------------------------------------------------------------
// Rendering

namespace {

void check_roles(std::span<const chat_message> messages) {
  if (messages.empty()) throw std::invalid_argument("chat template: at least one message is required");
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      throw std::invalid_argument("chat template: message " + std::to_string(i) + " has role '" + r +
                                  "'; expected system, user or assistant");
  }
}

/// The templates' `(role == 'user') != (index % 2 == 0)` check.
void check_alternation(std::span<const chat_message> messages, size_t offset, const char* what) {
  for (size_t i = 0; i < messages.size(); ++i) {
    if ((messages[i].role == "user") != (i % 2 == 0))
      throw std::invalid_argument(std::string("chat template: ") + what + " (message " +
                                  std::to_string(i + offset) + " is '" + messages[i].role + "')");
  }
}

constexpr const char* alternate_message = "conversation roles must alternate user/assistant/user/assistant/...";

}  // namespace

std::string chat_template::render(std::span<const chat_message> messages, bool add_generation_prompt) const {
  check_roles(messages);
  switch (family_) {
    case chat_family::chatml: return render_chatml(messages, add_generation_prompt);
    case chat_family::llama3: return render_llama3(messages, add_generation_prompt);
    case chat_family::gemma: return render_gemma(messages, add_generation_prompt);
    case chat_family::mistral: return render_mistral(messages);
  }
  throw std::logic_error("chat_template: bad family");
}

std::string chat_template::render_chatml(std::span<const chat_message> m, bool gen) const {
  std::string out = leading_bos_ ? bos_ : std::string();
  if (default_system_ && m[0].role != "system") out += "<|im_start|>system\n" + *default_system_ + "<|im_end|>\n";
  for (const auto& msg : m) out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

std::string chat_template::render_llama3(std::span<const chat_message> m, bool gen) const {
  std::string out = bos_;
  for (const auto& msg : m) {
    out += "<|start_header_id|>" + msg.role + "<|end_header_id|>\n\n";
    out += python_strip(msg.content);
    out += "<|eot_id|>";
  }
  if (gen || always_generation_prompt_) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

std::string chat_template::render_gemma(std::span<const chat_message> m, bool gen) const {
  std::string out = leading_bos_ ? bos_ : std::string();
  std::string first_user_prefix;
  size_t offset = 0;
  if (m[0].role == "system") {
    if (!fold_system_) throw std::invalid_argument("chat template: this model does not support a system role");
    first_user_prefix = m[0].content + "\n\n";
    m = m.subspan(1);
    offset = 1;
  }
  check_alternation(m, offset, alternate_message);
  for (size_t i = 0; i < m.size(); ++i) {
    out += "<start_of_turn>";
    out += m[i].role == "assistant" ? "model" : m[i].role;
    out += '\n';
    if (i == 0) out += first_user_prefix;
    out += python_strip(m[i].content);
    out += "<end_of_turn>\n";
  }
  if (gen) out += "<start_of_turn>model\n";
  return out;
}

std::string chat_template::render_mistral(std::span<const chat_message> m) const {
  // The Mistral templates ignore add_generation_prompt: a prompt ends with [/INST] anyway.
  const std::string* system = nullptr;
  size_t offset = 0;
  if (fold_system_ && m[0].role == "system") {
    system = &m[0].content;
    m = m.subspan(1);
    offset = 1;
  }
  check_alternation(m, offset, fold_system_ ? "after the optional system message, conversation roles must alternate "
                                              "user/assistant/user/assistant/..."
                                            : alternate_message);
  std::string out = leading_bos_ ? bos_ : std::string();
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].role == "user") {
      out += inst_open_;
      if (i == 0 && system) out += *system + "\n\n";
      out += m[i].content + inst_close_;
    } else if (m[i].role == "assistant") {
      out += assistant_prefix_ + m[i].content + eos_ + assistant_suffix_;
    } else {
      throw std::invalid_argument(fold_system_ ? "chat template: only user and assistant roles are supported, "
                                                 "with the exception of an initial optional system message"
                                               : "chat template: only user and assistant roles are supported");
    }
  }
  return out;
}

}  // namespace troupe::engine
