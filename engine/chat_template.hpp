// Chat prompt rendering without a Jinja engine.
//
// GGUF models carry a Jinja chat template in `tokenizer.chat_template`. troupe recognizes the
// template's family (and the variant within it) from the template text and renders with a
// hand-written formatter that produces exactly what Jinja would produce with Hugging Face's
// settings (trim_blocks, lstrip_blocks, `bos_token`, `eos_token`, `raise_exception`). Supported:
//  - chatml:  `<|im_start|>role\ncontent<|im_end|>\n`, optionally with a default system prompt
//             when the first message is not a system message (SmolLM2, Qwen2, OpenHermes);
//  - llama3:  `<|start_header_id|>role<|end_header_id|>\n\n` + trimmed content + `<|eot_id|>`,
//             BOS before the first message (Llama-3-Instruct; both the first release, which
//             always appends the assistant header, and the later one);
//  - gemma:   `<start_of_turn>user\n…<end_of_turn>\n`, assistant -> `model`, trimmed content,
//             system folded into the first user turn (gemma-3) or rejected (gemma-2, 1.1);
//  - mistral: `[INST] … [/INST]` (Mistral-7B-Instruct v0.1, v0.2, and v0.2's 2024 template
//             that folds a system message into the first user turn).
// Templates that use features these formatters do not model (tools, dates, reasoning, literal
// text, unexpected role conditions) are not recognized: detect() returns nullopt and the caller
// may pick a family by name instead.
//
// Beyond what each template enforces, render() accepts only the roles system, user and
// assistant, and at least one message.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace troupe::engine {

struct chat_message {
  std::string role, content;
};

enum class chat_family { chatml, llama3, gemma, mistral };

class chat_template {
 public:
  /// Recognizes `jinja_source`; nullopt when it is not a template we render exactly.
  /// `bos_text` / `eos_text` are what the template's `bos_token` / `eos_token` expand to (the
  /// text of the model's BOS / EOS tokens).
  static std::optional<chat_template> detect(std::string_view jinja_source, std::string bos_text,
                                             std::string eos_text);
  /// The canonical variant of a family by name: "chatml" (no default system prompt), "llama3"
  /// (assistant header only with add_generation_prompt), "gemma" (gemma-3: system folded into
  /// the first user turn), "mistral" (v0.2 of 2024: system folded, ` [INST] … [/INST]`).
  /// nullopt for any other name.
  static std::optional<chat_template> from_name(std::string_view name, std::string bos_text,
                                                std::string eos_text);

  /// Renders the conversation. Throws std::invalid_argument (message says what is wrong) for
  /// no messages, a role other than system/user/assistant, or an order the template rejects.
  std::string render(std::span<const chat_message> messages, bool add_generation_prompt) const;

  chat_family family() const { return family_; }
  /// "chatml", "llama3", "gemma" or "mistral".
  std::string_view name() const;
  /// True when the rendered text starts with the BOS text (callers must not add another BOS).
  bool renders_bos() const;

 private:
  chat_template(chat_family f, std::string bos, std::string eos)
      : family_(f), bos_(std::move(bos)), eos_(std::move(eos)) {}

  std::string render_chatml(std::span<const chat_message> m, bool gen) const;
  std::string render_llama3(std::span<const chat_message> m, bool gen) const;
  std::string render_gemma(std::span<const chat_message> m, bool gen) const;
  std::string render_mistral(std::span<const chat_message> m) const;

  chat_family family_;
  std::string bos_, eos_;
  // chatml
  std::optional<std::string> default_system_;  // emitted when messages[0] is not a system one
  bool leading_bos_ = false;                   // chatml, gemma, mistral: `{{ bos_token }}` first
  // llama3, gemma
  bool trim_content_ = true;
  bool always_generation_prompt_ = false;  // llama3 first release
  // gemma, mistral
  bool fold_system_ = true;  // false: a system message is rejected
  // mistral
  std::string inst_open_ = "[INST] ", inst_close_ = " [/INST]";
  std::string assistant_prefix_, assistant_suffix_;  // around content, suffix after eos
};

/// Python's str.strip() (what Jinja's `trim` filter does) on UTF-8 text: removes the code points
/// Python considers whitespace from both ends. Invalid UTF-8 counts as non-whitespace.
std::string_view python_strip(std::string_view s);

}  // namespace troupe::engine
