// Tokenizer built from GGUF metadata (tokenizer.ggml.*): GPT-2 byte-level BPE with the
// pre-tokenizer of the model family (tokenizer.ggml.pre), and SentencePiece-style BPE ("llama").
// Matches llama.cpp's tokenizer on the same file.
//
// Encoding runs in two steps, as llama.cpp's: special tokens are split out of the text first (see
// encode), then each remaining fragment goes through the model's algorithm. Decoding is the
// concatenation of token pieces; stream_decoder turns pieces into valid UTF-8 as they come.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace troupe::engine {

class gguf_file;

using token_id = int32_t;

/// The vocabulary as tokenizer.ggml.* describes it. from_gguf reads a file into one of these;
/// tests and tools may fill one by hand. Optional fields are those whose key may be absent.
struct vocab_spec {
  std::string model;                // tokenizer.ggml.model: "gpt2" or "llama"
  std::string pre;                  // tokenizer.ggml.pre (gpt2 only), empty when absent
  std::vector<std::string> tokens;  // tokenizer.ggml.tokens
  std::vector<float> scores;        // tokenizer.ggml.scores; empty: all 0
  std::vector<int32_t> types;       // tokenizer.ggml.token_type; empty: all normal
  std::vector<std::string> merges;  // tokenizer.ggml.merges ("left right", rank = index)
  std::optional<int64_t> bos, eos, eot, eom, unk;                          // *_token_id
  std::optional<int64_t> fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;  // fim_*_token_id
  std::optional<bool> add_bos, add_eos, add_space_prefix;
};

/// Token types of tokenizer.ggml.token_type.
enum class token_type : int32_t { undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

class tokenizer {
 public:
  /// Throws gguf_error when the vocabulary metadata is missing, inconsistent or of an unknown model.
  static std::unique_ptr<tokenizer> from_gguf(const gguf_file& f);
  /// Throws std::invalid_argument when `v` is inconsistent or of an unknown model. Writes one warning
  /// line to stderr for an absent or unknown pre-tokenizer (then llama.cpp's default regexes apply).
  static std::unique_ptr<tokenizer> from_vocab(const vocab_spec& v);
  virtual ~tokenizer();
  tokenizer(const tokenizer&) = delete;
  tokenizer& operator=(const tokenizer&) = delete;

  /// add_special: prepend BOS (and append EOS) as the model's metadata asks.
  /// parse_special: text such as "<|im_start|>" becomes that special token rather than plain text.
  /// User-defined tokens (type 4) are always split out; control tokens only with parse_special.
  /// Special tokens are matched longest first, each over the whole text, as llama.cpp does.
  /// Invalid UTF-8 in `text` never throws: it is encoded as llama.cpp does (byte fallback or U+FFFD).
  /// Throws std::length_error for a text of 2 GiB or more. Thread-safe (const, no shared state).
  std::vector<token_id> encode(std::string_view text, bool add_special, bool parse_special) const;

  /// The bytes of one token (not necessarily valid UTF-8 on its own). Control and unknown tokens
  /// render as their text only when render_special; unused tokens render as nothing.
  /// Throws std::out_of_range for an id outside [0, n_vocab).
  std::string token_to_piece(token_id id, bool render_special) const { return std::string(piece(id, render_special)); }
  /// As token_to_piece, without a copy; valid as long as the tokenizer.
  std::string_view piece(token_id id, bool render_special) const;

  /// Concatenated pieces of `ids`. Throws std::out_of_range for an id outside the vocabulary.
  std::string decode(std::span<const token_id> ids, bool render_special) const;

  int32_t n_vocab() const { return (int32_t)texts_.size(); }
  token_id bos() const { return bos_; }  // -1 when none
  token_id eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  /// End of generation: EOS, EOT, EOM, <|im_end|>, <|eot_id|>, <end_of_turn> and the like.
  bool is_eog(token_id id) const;
  /// The EOG ids, ascending.
  const std::vector<token_id>& eog_ids() const { return eog_; }
  bool is_control(token_id id) const;
  const std::string& token_text(token_id id) const { return texts_.at(id); }
  /// Token id of an exact vocabulary entry, or -1.
  token_id find(std::string_view text) const;

 protected:
  // Attribute bits, as llama.cpp's llama_token_attr.
  enum attr : uint16_t { attr_unknown = 1, attr_unused = 2, attr_normal = 4, attr_control = 8, attr_user_defined = 16, attr_byte = 32 };

  /// Reads texts, types, special ids, add_* flags, the EOG set and the special-token list from `v`.
  /// bos/eos/unk defaults and add_bos/add_space_prefix defaults are the model family's.
  tokenizer(const vocab_spec& v, token_id default_bos, token_id default_eos, token_id default_unk, bool default_add_bos,
            bool default_add_space_prefix);
  /// Fills the piece cache from piece_of(); derived constructors call it last.
  void build_pieces();
  /// The piece of `id` as rendered with render_special.
  virtual std::string piece_of(token_id id) const = 0;
  /// Encodes one fragment of plain text; after_special: the fragment follows BOS or a special token
  /// (or starts the text), where SentencePiece adds its space prefix.
  virtual void encode_fragment(std::string_view text, bool after_special, std::vector<token_id>& out) const = 0;

  uint16_t attr_of(token_id id) const { return attrs_[(size_t)id]; }
  /// The byte a byte token "<0xXX>" stands for (empty for another text).
  static std::string byte_piece(const std::string& text);

  std::vector<std::string> texts_;
  std::vector<int32_t> types_;  // tokenizer.ggml.token_type (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte)
  std::vector<uint16_t> attrs_;
  /// Exact text -> id over texts_ (open addressing; the last id of a repeated text wins).
  class text_index {
   public:
    void build(const std::vector<std::string>& texts);
    token_id find(std::string_view text, const std::vector<std::string>& texts) const;

   private:
    struct slot {
      uint32_t hash;
      token_id id;  // -1: empty
    };
    std::vector<slot> slots_;
    size_t mask_ = 0;
  };
  text_index ids_;
  std::vector<token_id> eog_;
  std::vector<token_id> specials_;  // control, user-defined and unknown tokens, longest text first
  std::vector<std::string> pieces_;  // render_special = true
  token_id bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false;

 private:
  struct fragment {
    token_id token;  // -1: text [offset, offset + length)
    size_t offset, length;
  };
  void partition_special(std::string_view text, bool parse_special, std::vector<fragment>& frags) const;
  void build_eog(const vocab_spec& v, token_id eot, token_id eom);
  void build_specials();

  // A byte trie of the special texts, to find all their occurrences in one pass over a text.
  std::array<uint32_t, 256> trie_root_{};             // first byte -> node (0: none)
  std::unordered_map<uint64_t, uint32_t> trie_next_;  // (node << 8 | byte) -> child
  std::vector<int32_t> trie_special_;                 // node -> index in specials_ of the text ending there, or -1

  static std::unique_ptr<tokenizer> make_bpe(const vocab_spec& v);  // tokenizer_bpe.cpp
  static std::unique_ptr<tokenizer> make_spm(const vocab_spec& v);  // tokenizer_spm.cpp
};

/// Turns a stream of token ids into text that is always valid UTF-8: bytes of a character split
/// across tokens are held back until the character is complete. Invalid sequences become U+FFFD.
class stream_decoder {
 public:
  stream_decoder(const tokenizer& tok, bool render_special) : tok_(&tok), render_special_(render_special) {}
  /// Text made complete by this token (possibly empty). Throws std::out_of_range for a bad id.
  std::string push(token_id id);
  /// Whatever is still held back, with incomplete sequences replaced by U+FFFD.
  std::string flush();

 private:
  const tokenizer* tok_;
  bool render_special_;
  std::string pending_;
};

}  // namespace troupe::engine
