// Pre-tokenizers of the byte-level BPE families: the regexes of each model's tokenizer.json, as
// llama.cpp applies them (src/unicode.cpp), written as hand-made scanners over code points with
// utf8proc categories. Each scanner reproduces llama.cpp's result, quirks included: a stage splits
// every word of the previous stage on its own, and `\s+(?!\S)` keeps a whitespace run whole at
// the end of such a word.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace troupe::engine {

enum class pretokenizer_kind {
  /// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
  gpt2,
  /// \p{N} (each digit alone) then gpt2: StarCoder, SmolLM, Refact, Command-R, CodeShell, EXAONE
  digits_gpt2,
  /// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  llama3,
  /// as llama3 but \p{N} (one digit per word): Qwen2, StableLM2, Hunyuan
  qwen2,
  /// as qwen2 with letters runs taking marks: [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+ and ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*
  qwen35,
  /// [\p{P}\$\+<=>\^~\|`]+ , gpt2, [0-9][0-9][0-9]
  falcon,
  /// llama.cpp's fallback: [\p{P}\$\+<=>\^~\|]+ , gpt2, \p{N}+ , [0-9][0-9][0-9]
  fallback,
};

/// How tokenizer.ggml.pre configures the BPE tokenizer.
struct pretokenizer_config {
  pretokenizer_kind kind = pretokenizer_kind::fallback;
  bool ignore_merges = false;    // a word that is a whole vocabulary entry becomes that token
  bool add_bos_default = false;  // add_bos when tokenizer.ggml.add_bos_token is absent
  bool no_bos = false;           // the family has no BOS token (ChatGLM)
};

/// The configuration llama.cpp uses for `pre` (an empty name means the key is absent: fallback);
/// nullopt for a name it does not know.
std::optional<pretokenizer_config> pretokenizer_from_name(std::string_view pre);

/// Splits `cpts` into words; appends the length (in code points) of each word, in order, to
/// `lengths`. The lengths are all positive and add up to cpts.size().
void pretokenize(pretokenizer_kind kind, std::span<const uint32_t> cpts, std::vector<uint32_t>& lengths);

}  // namespace troupe::engine
