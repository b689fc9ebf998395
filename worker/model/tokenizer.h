// Byte-level BPE tokenizer (GPT-2 family) built from GGUF metadata.
//
// Pipeline: literal special-token split -> pre-tokenizer (hand-written regex matchers, see
// PreTokenizer) -> bytes mapped to byte-level symbols -> rank-ordered BPE merges. A Tokenizer is
// immutable after create(); encode/decode are const and safe to call from many threads.
//
// Reference behaviour is Hugging Face transformers 4.46.3 / tokenizers 0.20.3 loading the GGUF
// (AutoTokenizer.from_pretrained(dir, gguf_file=...)); tests/golden/tokenizer_ids.json pins it.
// Where that differs from the GGUF metadata, TokenizerCompat picks the side (see below).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "worker/model/gguf.h"

namespace sf::model {

// llama.cpp token types (tokenizer.ggml.token_type).
enum TokenType : int32_t {
  kTokenUndefined = 0,
  kTokenNormal = 1,
  kTokenUnknown = 2,
  kTokenControl = 3,
  kTokenUserDefined = 4,
  kTokenUnused = 5,
  kTokenByte = 6,
};

struct TokenizerSpec {
  std::string model;                 // tokenizer.ggml.model; only "gpt2" (byte-level BPE)
  std::string pre;                   // pre-tokenizer name, see pre_tokenizer_from_name
  std::vector<std::string> tokens;   // byte-level strings ("Ġthe")
  std::vector<std::string> merges;   // "left right", rank = index
  std::vector<int32_t> token_types;  // empty, or one TokenType per token
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;  // -1: none
  bool add_bos = false, add_eos = false;
  // Whole pre-tokens already in the vocabulary skip the merges (Llama-3 hub tokenizer).
  bool ignore_merges = false;
};

// Which reference the GGUF reading follows when the two disagree.
enum class TokenizerCompat {
  // What transformers 4.46.3 builds from the GGUF (the golden reference). For
  // general.architecture "llama" with a gpt2 tokenizer it ignores tokenizer.ggml.pre and
  // tokenizer.ggml.add_bos_token: pre-tokenizer = plain GPT-2 ByteLevel regex (no digit
  // split, even for "smollm"/"llama-bpe") and BOS is always prepended. For "qwen2" it uses the
  // qwen2 regex without BOS (its NFC normalizer is not reproduced). Other architectures fall
  // back to kGguf. (HF also sets eos_token = tokens[bos_id], a converter bug that does not
  // affect encoding.)
  kHfTransformers,
  // The metadata as written (llama.cpp semantics; for SmolLM2 this also matches the tokenizer
  // shipped on the Hub: digits split one by one, no BOS).
  kGguf,
};

// Reads tokenizer.ggml.* (and general.architecture). kUnsupported for anything but byte-level
// BPE ("gpt2") or an unknown pre-tokenizer; kCorrupt for out-of-range ids or malformed merges.
Result<TokenizerSpec> tokenizer_spec_from_gguf(
    const GgufFile& f, TokenizerCompat compat = TokenizerCompat::kHfTransformers);

// Cheap structural checks (model, pre-tokenizer, id ranges, merge format); create() also checks
// that every merge's tokens are in the vocabulary.
Status validate_tokenizer_spec(const TokenizerSpec& spec);

enum class PreTokenizer {
  kGpt2,    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kSmollm,  // every \p{N} on its own, then kGpt2 on the rest
  kLlama3,  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
            //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kQwen2,   // kLlama3 with \p{N} instead of \p{N}{1,3}
};
// Accepts llama.cpp's names: "gpt2"/"gpt-2", "smollm", "llama-bpe"/"llama3"/"llama-v3", "qwen2".
Result<PreTokenizer> pre_tokenizer_from_name(std::string_view name);

// Splits text into pre-tokens (views into text, covering every byte once, in order). Invalid
// UTF-8 bytes are single "other" characters.
void pre_tokenize(PreTokenizer kind, std::string_view text, std::vector<std::string_view>* out);

class Tokenizer {
 public:
  static Result<Tokenizer> create(TokenizerSpec spec);

  // add_special: prepend BOS / append EOS as the spec says. parse_special: control and
  // user-defined tokens written literally in text map to their ids (leftmost-longest match);
  // otherwise they are encoded as plain text.
  std::vector<int32_t> encode(std::string_view text, bool add_special = true,
                              bool parse_special = true) const;
  // Concatenated raw bytes (special tokens as their text); out-of-range ids are skipped. Not
  // UTF-8-sanitised (HF replaces broken sequences with U+FFFD): decode(encode(s)) == s for any
  // byte string whose bytes all have a vocabulary symbol. Bytes without one (SmolLM2 lacks 21,
  // e.g. 0x04 and 0xFF) encode to unk, consecutive ones fused, as in HF.
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string token_to_piece(int32_t id) const;  // "" when out of range

  int32_t vocab_size() const { return static_cast<int32_t>(spec_.tokens.size()); }
  int32_t bos_id() const { return spec_.bos_id; }
  int32_t eos_id() const { return spec_.eos_id; }
  PreTokenizer pre_tokenizer() const { return pre_; }
  const TokenizerSpec& spec() const { return spec_; }
  // Id of a token given by its byte-level spelling ("Ġthe"), or -1.
  int32_t find_token(std::string_view token) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t id;  // id of the merged token
  };
  void encode_text(std::string_view text, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  TokenizerSpec spec_;
  PreTokenizer pre_ = PreTokenizer::kGpt2;
  std::unordered_map<std::string, int32_t> token_ids_;      // byte-level spelling -> id
  std::unordered_map<std::string, int32_t> raw_token_ids_;  // raw bytes -> id (ignore_merges)
  std::unordered_map<uint64_t, Merge> merges_;              // (left << 32 | right)
  std::array<int32_t, 256> byte_ids_{};                     // -1 when not in the vocab
  std::vector<std::string> raw_pieces_;                     // decoded bytes per id
  // Literal-matched tokens (control and user-defined) as a byte trie: the longest one starting
  // at a text position is found in as many steps as its length, however many there are.
  struct SpecialNode {
    std::vector<std::pair<uint8_t, int32_t>> next;  // (byte, node), sorted by byte
    int32_t id = -1;                                // a token ending here (the lowest id)
  };
  std::vector<SpecialNode> specials_{1};  // [0]: the root
  void add_special(std::string_view text, int32_t id);
  // The longest special token at text[i...]: {id, length}, or {-1, 0}.
  std::pair<int32_t, size_t> longest_special(std::string_view text, size_t i) const;
};

}  // namespace sf::model
