#include "worker/model/tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "worker/model/unicode_data.h"

namespace sf::model {
namespace {

// ---- GPT-2 byte <-> unicode mapping --------------------------------------------------------
// Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7F..0xA0,
// 0xAD) take code points 256, 257, ... in byte order, so every byte is a visible character.
bool byte_is_printable(uint32_t b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct ByteMap {
  std::array<uint32_t, 256> byte_to_cp{};
  // Reverse map over code points 0..323 (the image of byte_to_cp); -1 where unmapped.
  std::array<int16_t, 324> cp_to_byte{};
  ByteMap() {
    cp_to_byte.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      byte_to_cp[b] = byte_is_printable(b) ? b : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;  // immutable after construction (thread-safe static init)
  return m;
}

// Raw bytes of a byte-level token spelling; false if some character is outside the map. Hugging
// Face's ByteLevel decoder then emits the spelling itself, and so do we.
bool byte_level_to_raw(std::string_view s, std::string* out) {
  const ByteMap& m = byte_map();
  out->clear();
  for (size_t i = 0; i < s.size();) {
    unicode::DecodedCodepoint d = unicode::utf8_decode(s, i);
    if (d.cp >= m.cp_to_byte.size() || m.cp_to_byte[d.cp] < 0) return false;
    out->push_back(static_cast<char>(m.cp_to_byte[d.cp]));
    i += d.len;
  }
  return true;
}

// ---- pre-tokenizers ------------------------------------------------------------------------
// The regexes are matched by hand on a decoded copy of the text: alternatives are tried in the
// regex's order at each start, exactly as a backtracking engine (Oniguruma) would pick them.
struct Char {
  uint64_t off;  // byte offset in the text (64-bit: a prompt may pass 4 GiB)
  uint32_t cp;
  uint8_t flags;
};

bool is_letter(const Char& c) { return c.flags & unicode::kLetter; }
bool is_number(const Char& c) { return c.flags & unicode::kNumber; }
bool is_space(const Char& c) { return c.flags & unicode::kSpace; }
bool is_other(const Char& c) { return c.flags == 0; }  // [^\s\p{L}\p{N}]
bool is_newline(const Char& c) { return c.cp == '\r' || c.cp == '\n'; }

// Simple case folding restricted to what (?i:'s|'t|'re|'ve|'m|'ll|'d) can meet: ASCII, plus
// U+017F LATIN SMALL LETTER LONG S, the only other code point that folds to one of these letters
// (Oniguruma matches "'ſ" as a contraction).
uint32_t fold_case(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp + 32;
  return cp == 0x17F ? 's' : cp;
}

// Length (in chars) of 's|'t|'re|'ve|'m|'ll|'d at c[i], or 0.
size_t match_contraction(const Char* c, size_t i, size_t n, bool ignore_case) {
  if (c[i].cp != '\'' || i + 1 >= n) return 0;
  auto at = [&](size_t k) { return ignore_case ? fold_case(c[k].cp) : c[k].cp; };
  uint32_t a = at(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 < n) {
    uint32_t b = at(i + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  }
  return 0;
}

// \s+(?!\S)|\s+ at a whitespace char: a run followed by a non-space gives up its last char so
// that char can prefix the next word (" ?\p{L}+"); a single char matches \s+ alone.
size_t match_space_run(const Char* c, size_t i, size_t n) {
  size_t j = i;
  while (j < n && is_space(c[j])) ++j;
  if (j == n || j - i == 1) return j;
  return j - 1;
}

// End (exclusive, in chars) of the GPT-2 pre-token starting at c[i].
size_t match_gpt2(const Char* c, size_t i, size_t n) {
  if (size_t k = match_contraction(c, i, n, false)) return i + k;
  size_t k = (c[i].cp == ' ' && i + 1 < n) ? i + 1 : i;  // optional leading space
  bool (*cls)(const Char&) = nullptr;
  if (is_letter(c[k]))
    cls = is_letter;
  else if (is_number(c[k]))
    cls = is_number;
  else if (is_other(c[k]))
    cls = is_other;
  if (cls) {
    do ++k;
    while (k < n && cls(c[k]));
    return k;
  }
  return match_space_run(c, i, n);  // c[i] is whitespace here
}

size_t match_llama3(const Char* c, size_t i, size_t n, size_t max_digits) {
  if (size_t k = match_contraction(c, i, n, true)) return i + k;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  size_t k = i;
  if (!is_letter(c[k]) && !is_number(c[k]) && !is_newline(c[k]) && k + 1 < n && is_letter(c[k + 1]))
    ++k;
  if (is_letter(c[k])) {
    while (k < n && is_letter(c[k])) ++k;
    return k;
  }
  // \p{N}{1,max_digits}
  if (is_number(c[i])) {
    k = i;
    while (k < n && k - i < max_digits && is_number(c[k])) ++k;
    return k;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  k = (c[i].cp == ' ' && i + 1 < n) ? i + 1 : i;
  if (is_other(c[k])) {
    while (k < n && is_other(c[k])) ++k;
    while (k < n && is_newline(c[k])) ++k;
    return k;
  }
  // \s*[\r\n]+ : the backtracking \s* stops right after the run's last newline.
  size_t j = i, last_newline = n;
  while (j < n && is_space(c[j])) {
    if (is_newline(c[j])) last_newline = j;
    ++j;
  }
  if (last_newline != n) return last_newline + 1;
  return match_space_run(c, i, n);
}

void decode_chars(std::string_view text, std::vector<Char>* chars) {
  chars->clear();
  chars->reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    unicode::DecodedCodepoint d = unicode::utf8_decode(text, i);
    chars->push_back({uint64_t(i), d.cp, unicode::codepoint_flags(d.cp)});
    i += d.len;
  }
}

// Runs one regex matcher over chars [b, e) and appends the pieces.
template <typename Matcher>
void split_range(std::string_view text, const std::vector<Char>& chars, size_t b, size_t e,
                 Matcher match, std::vector<std::string_view>* out) {
  const Char* c = chars.data() + b;
  const size_t n = e - b;
  const size_t end_off = e < chars.size() ? chars[e].off : text.size();
  auto offset = [&](size_t k) { return k < n ? c[k].off : end_off; };
  for (size_t i = 0; i < n;) {
    size_t j = match(c, i, n);
    out->push_back(text.substr(offset(i), offset(j) - offset(i)));
    i = j;
  }
}

// ---- merge table ---------------------------------------------------------------------------
uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

Status optional_id(const GgufFile& f, const char* key, int32_t* out) {
  Result<int64_t> r = f.get_int(key);
  if (!r.is_ok()) {
    if (r.status().code() == Code::kNotFound) return Status::ok();
    return r.status();
  }
  // Range against the vocabulary is checked by Tokenizer::create; -1 (as int) means none.
  if (*r < -1 || *r > INT32_MAX)
    return SF_ERR(kCorrupt, "tokenizer: " + std::string(key) + " = " + std::to_string(*r) +
                                " is not a valid token id");
  *out = static_cast<int32_t>(*r);
  return Status::ok();
}

Status optional_bool(const GgufFile& f, const char* key, bool* out) {
  Result<bool> r = f.get_bool(key);
  if (!r.is_ok()) {
    if (r.status().code() == Code::kNotFound) return Status::ok();
    return r.status();
  }
  *out = *r;
  return Status::ok();
}

}  // namespace

// ---- public pre-tokenizer API --------------------------------------------------------------

Result<PreTokenizer> pre_tokenizer_from_name(std::string_view name) {
  if (name == "gpt2" || name == "gpt-2") return PreTokenizer::kGpt2;
  if (name == "smollm") return PreTokenizer::kSmollm;
  if (name == "llama-bpe" || name == "llama3" || name == "llama-v3") return PreTokenizer::kLlama3;
  if (name == "qwen2") return PreTokenizer::kQwen2;
  return SF_ERR(kUnsupported, "tokenizer: pre-tokenizer '" + std::string(name) +
                                  "' is not supported (known: gpt2, smollm, llama-bpe, qwen2)");
}

void pre_tokenize(PreTokenizer kind, std::string_view text, std::vector<std::string_view>* out) {
  std::vector<Char> chars;
  decode_chars(text, &chars);
  const size_t n = chars.size();
  switch (kind) {
    case PreTokenizer::kGpt2:
      split_range(text, chars, 0, n, match_gpt2, out);
      break;
    case PreTokenizer::kSmollm: {
      // Digits are isolated first; the GPT-2 regex then runs inside each gap separately.
      size_t gap = 0;
      for (size_t i = 0; i <= n; ++i) {
        if (i < n && !is_number(chars[i])) continue;
        split_range(text, chars, gap, i, match_gpt2, out);
        if (i < n) split_range(text, chars, i, i + 1, match_gpt2, out);
        gap = i + 1;
      }
      break;
    }
    case PreTokenizer::kLlama3:
      split_range(
          text, chars, 0, n,
          [](const Char* c, size_t i, size_t m) { return match_llama3(c, i, m, 3); }, out);
      break;
    case PreTokenizer::kQwen2:
      split_range(
          text, chars, 0, n,
          [](const Char* c, size_t i, size_t m) { return match_llama3(c, i, m, 1); }, out);
      break;
  }
}

// ---- GGUF -> spec --------------------------------------------------------------------------

Result<TokenizerSpec> tokenizer_spec_from_gguf(const GgufFile& f, TokenizerCompat compat) {
  TokenizerSpec spec;
  SF_ASSIGN(spec.model, f.get_string("tokenizer.ggml.model"));
  if (spec.model != "gpt2")
    return SF_ERR(kUnsupported, "tokenizer: tokenizer.ggml.model '" + spec.model +
                                    "' is not supported; only 'gpt2' (byte-level BPE) is");
  Result<std::string> pre = f.get_string("tokenizer.ggml.pre");
  if (pre.is_ok())
    spec.pre = *pre;
  else if (pre.status().code() != Code::kNotFound)
    return pre.status();
  SF_ASSIGN(spec.tokens, f.get_string_array("tokenizer.ggml.tokens"));
  SF_ASSIGN(spec.merges, f.get_string_array("tokenizer.ggml.merges"));
  Result<std::vector<int64_t>> types = f.get_int_array("tokenizer.ggml.token_type");
  if (types.is_ok()) {
    spec.token_types.reserve(types->size());
    for (size_t i = 0; i < types->size(); ++i) {
      int64_t t = (*types)[i];
      if (t < kTokenUndefined || t > kTokenByte)
        return SF_ERR(kCorrupt, "tokenizer: tokenizer.ggml.token_type[" + std::to_string(i) +
                                    "] = " + std::to_string(t) + " is not a token type (0..6)");
      spec.token_types.push_back(static_cast<int32_t>(t));
    }
  } else if (types.status().code() != Code::kNotFound) {
    return types.status();
  }
  SF_TRY(optional_id(f, "tokenizer.ggml.bos_token_id", &spec.bos_id));
  SF_TRY(optional_id(f, "tokenizer.ggml.eos_token_id", &spec.eos_id));
  SF_TRY(optional_id(f, "tokenizer.ggml.unknown_token_id", &spec.unk_id));
  SF_TRY(optional_id(f, "tokenizer.ggml.padding_token_id", &spec.pad_id));
  SF_TRY(optional_bool(f, "tokenizer.ggml.add_bos_token", &spec.add_bos));
  SF_TRY(optional_bool(f, "tokenizer.ggml.add_eos_token", &spec.add_eos));
  if (spec.pre == "llama-bpe" || spec.pre == "llama3" || spec.pre == "llama-v3")
    spec.ignore_merges = true;  // llama.cpp does this for its LLAMA3 pre type

  if (compat == TokenizerCompat::kHfTransformers) {
    // transformers 4.46.3, integrations/ggml.py. GGUFLlamaConverter treats any non-SentencePiece
    // vocabulary as "Llama-3": a bare ByteLevel(use_regex=True) pre-tokenizer (tokenizer.ggml.pre
    // is never read, so SmolLM2's "smollm" digit splitting is lost) and LlamaTokenizerFast's
    // default add_bos_token=True (tokenizer.ggml.add_bos_token is never read). HF makes only
    // control tokens literal; we also match user-defined ones (none in SmolLM2).
    // GGUFQwen2Converter hard-codes the qwen2 split regex (plus NFC, which we do not apply).
    Result<std::string> arch = f.get_string("general.architecture");
    std::string a = arch.is_ok() ? *arch : std::string();
    if (a == "llama") {
      spec.pre = "gpt2";
      spec.add_bos = spec.bos_id >= 0;
      spec.add_eos = false;
      spec.ignore_merges = false;
    } else if (a == "qwen2" || a == "qwen2_moe") {
      spec.pre = "qwen2";
      spec.add_bos = false;
      spec.add_eos = false;
      spec.ignore_merges = false;
    }
  }
  if (spec.pre.empty())
    return SF_ERR(kUnsupported,
                  "tokenizer: tokenizer.ggml.pre is missing; the pre-tokenizer "
                  "cannot be chosen");
  SF_TRY(validate_tokenizer_spec(spec));
  return spec;
}

// ---- Tokenizer -----------------------------------------------------------------------------

Status validate_tokenizer_spec(const TokenizerSpec& spec) {
  if (spec.model != "gpt2")
    return SF_ERR(kUnsupported, "tokenizer: model '" + spec.model +
                                    "' is not supported; only 'gpt2' (byte-level BPE) is");
  SF_TRY(pre_tokenizer_from_name(spec.pre).status());
  const size_t n = spec.tokens.size();
  if (n == 0) return SF_ERR(kCorrupt, "tokenizer: empty vocabulary");
  if (n > static_cast<size_t>(INT32_MAX))
    return SF_ERR(kCorrupt, "tokenizer: vocabulary of " + std::to_string(n) + " tokens is too big");
  if (!spec.token_types.empty() && spec.token_types.size() != n)
    return SF_ERR(kCorrupt, "tokenizer: token_type has " + std::to_string(spec.token_types.size()) +
                                " entries for " + std::to_string(n) + " tokens");
  const std::pair<const char*, int32_t> ids[] = {{"bos_token_id", spec.bos_id},
                                                 {"eos_token_id", spec.eos_id},
                                                 {"unknown_token_id", spec.unk_id},
                                                 {"padding_token_id", spec.pad_id}};
  for (const auto& [name, id] : ids) {
    if (id < -1 || id >= static_cast<int64_t>(n))
      return SF_ERR(kCorrupt, std::string("tokenizer: ") + name + " " + std::to_string(id) +
                                  " out of range for a vocabulary of " + std::to_string(n));
  }
  if (spec.add_bos && spec.bos_id < 0)
    return SF_ERR(kCorrupt, "tokenizer: add_bos is set but there is no bos_token_id");
  if (spec.add_eos && spec.eos_id < 0)
    return SF_ERR(kCorrupt, "tokenizer: add_eos is set but there is no eos_token_id");
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    const std::string& m = spec.merges[r];
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == m.size() ||
        m.find(' ', sp + 1) != std::string::npos)
      return SF_ERR(kCorrupt, "tokenizer: merges[" + std::to_string(r) + "] '" + m +
                                  "' is not two tokens separated by one space");
  }
  return Status::ok();
}

Result<Tokenizer> Tokenizer::create(TokenizerSpec spec) {
  SF_TRY(validate_tokenizer_spec(spec));
  Tokenizer t;
  SF_ASSIGN(t.pre_, pre_tokenizer_from_name(spec.pre));
  const size_t n = spec.tokens.size();

  // Vocabulary. A duplicated spelling maps to its last id, like the Python dict HF builds.
  t.token_ids_.reserve(n);
  t.raw_pieces_.resize(n);
  std::string raw;
  for (size_t i = 0; i < n; ++i) {
    const std::string& tok = spec.tokens[i];
    t.token_ids_[tok] = static_cast<int32_t>(i);
    if (byte_level_to_raw(tok, &raw)) {
      t.raw_pieces_[i] = raw;
      if (spec.ignore_merges) t.raw_token_ids_[raw] = static_cast<int32_t>(i);
    } else {
      t.raw_pieces_[i] = tok;
    }
  }
  const ByteMap& bm = byte_map();
  for (uint32_t b = 0; b < 256; ++b) {
    std::string s;
    unicode::utf8_append(s, bm.byte_to_cp[b]);
    auto it = t.token_ids_.find(s);
    t.byte_ids_[b] = it == t.token_ids_.end() ? -1 : it->second;
  }

  // Merges (format checked above): both halves and their concatenation must be tokens.
  t.merges_.reserve(spec.merges.size());
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    const std::string& m = spec.merges[r];
    const size_t sp = m.find(' ');
    const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
    auto l = t.token_ids_.find(left), rr = t.token_ids_.find(right),
         merged = t.token_ids_.find(left + right);
    auto where = [&] { return "tokenizer: merges[" + std::to_string(r) + "] '" + m + "' "; };
    if (l == t.token_ids_.end() || rr == t.token_ids_.end())
      return SF_ERR(kCorrupt, where() + "uses a token missing from the vocabulary");
    if (merged == t.token_ids_.end())
      return SF_ERR(kCorrupt, where() + "produces a token missing from the vocabulary");
    // A repeated pair takes its last rank, as in HF's merge map (llama.cpp keeps the first).
    t.merges_.insert_or_assign(pair_key(l->second, rr->second),
                               Merge{static_cast<int32_t>(r), merged->second});
  }

  // Literal tokens: control (and user-defined) ones, matched leftmost-longest.
  for (size_t i = 0; i < spec.token_types.size(); ++i) {
    int32_t ty = spec.token_types[i];
    if ((ty == kTokenControl || ty == kTokenUserDefined) && !spec.tokens[i].empty())
      t.add_special(spec.tokens[i], static_cast<int32_t>(i));
  }
  t.spec_ = std::move(spec);
  return t;
}

namespace {
// Where byte b's child is, or would go, in a trie node's sorted (byte, node) list.
template <typename Next>
auto child_slot(Next& next, uint8_t b) {
  return std::lower_bound(next.begin(), next.end(), b,
                          [](const std::pair<uint8_t, int32_t>& e, uint8_t v) { return e.first < v; });
}
}  // namespace

void Tokenizer::add_special(std::string_view text, int32_t id) {
  int32_t node = 0;
  for (char ch : text) {
    const auto b = static_cast<uint8_t>(ch);
    auto& next = specials_[size_t(node)].next;
    auto it = child_slot(next, b);
    if (it != next.end() && it->first == b) {
      node = it->second;
      continue;
    }
    const auto child = static_cast<int32_t>(specials_.size());
    next.insert(it, {b, child});  // (before the push_back below, which may move `next`)
    specials_.emplace_back();
    node = child;
  }
  // Ids are added in order: two tokens of the same text keep the lower id.
  if (specials_[size_t(node)].id < 0) specials_[size_t(node)].id = id;
}

std::pair<int32_t, size_t> Tokenizer::longest_special(std::string_view text, size_t i) const {
  std::pair<int32_t, size_t> best{-1, 0};
  int32_t node = 0;
  for (size_t j = i; j < text.size(); ++j) {
    const auto b = static_cast<uint8_t>(text[j]);
    const auto& next = specials_[size_t(node)].next;
    auto it = child_slot(next, b);
    if (it == next.end() || it->first != b) break;
    node = it->second;
    if (specials_[size_t(node)].id >= 0) best = {specials_[size_t(node)].id, j + 1 - i};
  }
  return best;
}

int32_t Tokenizer::find_token(std::string_view token) const {
  auto it = token_ids_.find(std::string(token));
  return it == token_ids_.end() ? -1 : it->second;
}

const Tokenizer::Merge* Tokenizer::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && spec_.add_bos) out.push_back(spec_.bos_id);
  if (!parse_special || specials_[0].next.empty()) {
    encode_text(text, &out);
  } else {
    // Leftmost-longest literal match of special tokens; text between them is encoded alone,
    // so regex context never crosses a special token (as in HF and llama.cpp).
    size_t seg = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto [id, len] = longest_special(text, i);
      if (id < 0) continue;
      encode_text(text.substr(seg, i - seg), &out);
      out.push_back(id);
      i += len - 1;
      seg = i + 1;
    }
    encode_text(text.substr(seg), &out);
  }
  if (add_special && spec_.add_eos) out.push_back(spec_.eos_id);
  return out;
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  std::vector<std::string_view> pieces;
  pre_tokenize(pre_, text, &pieces);
  for (std::string_view p : pieces) encode_piece(p, out);
}

// BPE over one pre-token: repeatedly merge the adjacent pair of lowest rank (leftmost on ties),
// via a min-heap with lazy invalidation, O(n log n) even for pathological 10K-byte pre-tokens.
void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  if (spec_.ignore_merges) {
    auto it = raw_token_ids_.find(std::string(piece));
    if (it != raw_token_ids_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (n == 1) {
    int32_t id = byte_ids_[static_cast<unsigned char>(piece[0])];
    if (id >= 0)
      out->push_back(id);
    else if (spec_.unk_id >= 0)
      out->push_back(spec_.unk_id);
    return;
  }
  struct Sym {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
  };
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Sym> syms(n);
  for (size_t i = 0; i < n; ++i) {
    syms[i] = {byte_ids_[static_cast<unsigned char>(piece[i])], static_cast<int32_t>(i) - 1,
               i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
  }
  std::vector<Cand> heap;
  heap.reserve(n);
  auto push = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t nx = syms[pos].next;
    if (nx < 0 || syms[pos].id < 0 || syms[nx].id < 0) return;
    if (const Merge* m = find_merge(syms[pos].id, syms[nx].id)) {
      heap.push_back({m->rank, pos, syms[pos].id, syms[nx].id});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Cand c = heap.back();
    heap.pop_back();
    Sym& s = syms[c.pos];
    // Stale if this symbol was absorbed or either side changed since the candidate was made.
    if (s.id != c.left || s.next < 0 || syms[s.next].id != c.right) continue;
    const Merge* m = find_merge(c.left, c.right);
    const int32_t gone = s.next;
    s.id = m->id;
    s.next = syms[gone].next;
    syms[gone].id = -2;  // dead; never matches a candidate's left/right
    if (s.next >= 0) syms[s.next].prev = c.pos;
    push(s.prev);
    push(c.pos);
  }
  bool last_unk = false;
  for (int32_t i = 0; i >= 0; i = syms[i].next) {
    if (syms[i].id >= 0) {
      out->push_back(syms[i].id);
      last_unk = false;
    } else if (spec_.unk_id >= 0 && !last_unk) {  // byte missing from the vocab; fused like HF
      out->push_back(spec_.unk_id);
      last_unk = true;
    }
  }
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) out += raw_pieces_[id];
  }
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id) const {
  return (id >= 0 && id < vocab_size()) ? raw_pieces_[id] : std::string();
}

}  // namespace sf::model
