// Tokenizer: exact ids against Hugging Face (tests/golden/tokenizer_ids.json, made by
// tools/golden/gen_tokenizer_golden.py), pre-tokenizer splits against HF's Oniguruma regexes,
// round trips, invalid UTF-8, spec validation and encode speed.
#include <gtest/gtest.h>

#include <array>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/test_seed.h"
#include "tests/worker/model/gguf_builder.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/gguf.h"
#include "worker/model/tokenizer.h"
#include "worker/model/unicode_data.h"

namespace sf::model {
namespace {

namespace json = boost::json;

// One seed a process (printed; SF_TEST_SEED replays it).
uint64_t test_seed() {
  static const uint64_t seed = testing::fresh_seed();
  return seed;
}

const json::value& golden() {
  static const json::value v = [] {
    const std::string path = std::string(SF_SOURCE_DIR) + "/tests/golden/tokenizer_ids.json";
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    json::error_code ec;
    json::value parsed = json::parse(ss.str(), ec);
    if (ec || !parsed.is_object()) {
      ADD_FAILURE() << "cannot read " << path << ": " << ec.message()
                    << " (regenerate with tools/golden/gen_tokenizer_golden.py)";
      return json::value(json::object{{"cases", json::array{}}});
    }
    return parsed;
  }();
  return v;
}

const json::array& golden_cases() { return golden().at("cases").as_array(); }

std::vector<int32_t> to_ids(const json::value& v) {
  std::vector<int32_t> out;
  for (const json::value& x : v.as_array())
    out.push_back(static_cast<int32_t>(x.to_number<int64_t>()));
  return out;
}

std::string show(const std::string& s) {  // printable form for failure messages
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c < 0x20 || c == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else
      out.push_back(static_cast<char>(c));
  }
  return out.size() > 120 ? out.substr(0, 117) + "..." : out;
}

// Exact equality; on failure reports the first differing position and the ids around it.
::testing::AssertionResult same_ids(const std::vector<int32_t>& got,
                                    const std::vector<int32_t>& want, const Tokenizer* tok) {
  if (got == want) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  auto around = [&](const std::vector<int32_t>& v) {
    std::string s;
    for (size_t k = i >= 2 ? i - 2 : 0; k < v.size() && k < i + 4; ++k) {
      s += std::to_string(v[k]);
      if (tok) s += "'" + show(tok->token_to_piece(v[k])) + "'";
      s += " ";
    }
    return s;
  };
  return ::testing::AssertionFailure()
         << "first mismatch at position " << i << " (got " << got.size() << " ids, want "
         << want.size() << ")\n  got : " << around(got) << "\n  want: " << around(want);
}

// Tokenizers from the default model, built once; nullptr (and a failure) when it is missing.
const Tokenizer* model_tokenizer(TokenizerCompat compat) {
  struct Loaded {
    std::unique_ptr<Tokenizer> hf, gguf;
    std::string error;
  };
  static const Loaded loaded = [] {
    Loaded l;
    if (!sf::testing::default_model_present()) {
      l.error = sf::testing::missing_model_msg();
      return l;
    }
    Result<GgufFile> f = GgufFile::open(sf::testing::default_model_path());
    if (!f.is_ok()) {
      l.error = f.status().to_string();
      return l;
    }
    for (auto [compat, dst] : {std::pair{TokenizerCompat::kHfTransformers, &l.hf},
                               std::pair{TokenizerCompat::kGguf, &l.gguf}}) {
      Result<TokenizerSpec> spec = tokenizer_spec_from_gguf(*f, compat);
      if (!spec.is_ok()) {
        l.error = spec.status().to_string();
        return l;
      }
      Result<Tokenizer> t = Tokenizer::create(std::move(spec).value());
      if (!t.is_ok()) {
        l.error = t.status().to_string();
        return l;
      }
      *dst = std::make_unique<Tokenizer>(std::move(t).value());
    }
    return l;
  }();
  if (!loaded.error.empty()) {
    ADD_FAILURE() << loaded.error;
    return nullptr;
  }
  return compat == TokenizerCompat::kHfTransformers ? loaded.hf.get() : loaded.gguf.get();
}

TEST(Tokenizer, GoldenIdsMatchHuggingFace) {
  const Tokenizer* tok = model_tokenizer(TokenizerCompat::kHfTransformers);
  ASSERT_NE(tok, nullptr);
  size_t n_corpus = 0;
  for (const json::value& c : golden_cases()) n_corpus += c.at("source") == "corpus";
  ASSERT_GE(n_corpus, 24u);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::kGpt2);  // HF ignores tokenizer.ggml.pre
  for (const json::value& c : golden_cases()) {
    const std::string text(c.at("text").as_string());
    EXPECT_TRUE(same_ids(tok->encode(text), to_ids(c.at("ids")), tok)) << "text: " << show(text);
    EXPECT_TRUE(
        same_ids(tok->encode(text, /*add_special=*/false), to_ids(c.at("ids_no_special")), tok))
        << "add_special=false, text: " << show(text);
  }
}

TEST(Tokenizer, GoldenIdsMatchGgufSemantics) {
  const Tokenizer* tok = model_tokenizer(TokenizerCompat::kGguf);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::kSmollm);
  EXPECT_FALSE(tok->spec().add_bos);
  for (const json::value& c : golden_cases()) {
    const std::string text(c.at("text").as_string());
    EXPECT_TRUE(same_ids(tok->encode(text), to_ids(c.at("ids_gguf")), tok))
        << "text: " << show(text);
  }
}

TEST(Tokenizer, PreTokenizerSplitsMatchHuggingFace) {
  size_t checked = 0;
  for (const json::value& c : golden_cases()) {
    const std::string text(c.at("text").as_string());
    for (const auto& kv : c.at("pieces").as_object()) {
      Result<PreTokenizer> kind = pre_tokenizer_from_name(std::string(kv.key()));
      ASSERT_TRUE(kind.is_ok()) << kind.status().to_string();
      std::vector<std::string_view> pieces;
      pre_tokenize(*kind, text, &pieces);
      std::vector<std::string> got, want;
      for (std::string_view p : pieces) got.emplace_back(p);
      for (const json::value& be : kv.value().as_array()) {
        const auto b = be.as_array()[0].to_number<size_t>(),
                   e = be.as_array()[1].to_number<size_t>();
        want.push_back(text.substr(b, e - b));
      }
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      EXPECT_EQ(got, want) << kv.key() << " on \"" << show(text) << "\": first difference at piece "
                           << i << ": got '" << (i < got.size() ? show(got[i]) : "<end>")
                           << "' want '" << (i < want.size() ? show(want[i]) : "<end>") << "'";
      ++checked;
    }
  }
  EXPECT_GE(checked, 4 * 24u);
}

// True when text holds a byte the vocabulary has no symbol for (SmolLM2 lacks 21 of the 256,
// e.g. 0x04 and 0xFF): it encodes to unk, as in HF, and cannot round-trip.
bool has_unmapped_bytes(const Tokenizer& tok, std::string_view text) {
  for (int32_t id : tok.encode(text, false, false))
    if (id == tok.spec().unk_id) return true;
  return false;
}

TEST(Tokenizer, DecodeInvertsEncode) {
  const Tokenizer* tok = model_tokenizer(TokenizerCompat::kHfTransformers);
  ASSERT_NE(tok, nullptr);
  size_t skipped = 0;
  for (const json::value& c : golden_cases()) {
    const std::string text(c.at("text").as_string());
    if (has_unmapped_bytes(*tok, text)) {
      ++skipped;
      continue;
    }
    EXPECT_EQ(tok->decode(tok->encode(text, false)), text);
    EXPECT_EQ(tok->decode(tok->encode(text, false, /*parse_special=*/false)), text);
  }
  EXPECT_LE(skipped, 1u);
  // BOS decodes to its text; special tokens as plain text are not matched.
  EXPECT_EQ(tok->decode(tok->encode("hi")), "<|im_start|>hi");
  std::vector<int32_t> plain = tok->encode("<|im_end|>", false, false);
  EXPECT_GT(plain.size(), 1u);
  EXPECT_EQ(tok->encode("<|im_end|>", false, true), std::vector<int32_t>{2});
  EXPECT_EQ(tok->encode(""), std::vector<int32_t>{tok->bos_id()});
  EXPECT_EQ(tok->decode({-5, tok->vocab_size(), 1 << 30}), "");
  EXPECT_EQ(tok->token_to_piece(-1), "");
}

TEST(Tokenizer, InvalidUtf8NeverCrashesAndRoundTrips) {
  const Tokenizer* tok = model_tokenizer(TokenizerCompat::kHfTransformers);
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> inputs = {"\xff",
                                     "\xc0\x80",
                                     "abc\xe4\xbd",
                                     "\x80\x80 x",
                                     "\xed\xa0\x80",
                                     "\xf4\x90\x80\x80",
                                     "ok \xf0\x9f\x98 truncated emoji",
                                     std::string("nul\0inside", 10),
                                     "\xc3\x28 \xe2\x28\xa1"};
  std::mt19937_64 rng(test_seed());
  for (int k = 0; k < 200; ++k) {
    std::string s(rng() % 64, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() & 0xFF);
    inputs.push_back(s);
  }
  // SmolLM2's vocabulary lacks 21 byte symbols (0x04, 0xC0, 0xFF, ...); like HF we emit unk
  // for them, so only the other bytes can round-trip.
  const int32_t unk = tok->spec().unk_id;
  const std::string unk_text = tok->token_to_piece(unk);
  std::array<bool, 256> missing{};
  for (int b = 0; b < 256; ++b) {
    missing[b] = tok->encode(std::string(1, static_cast<char>(b)), false, false) ==
                 std::vector<int32_t>{unk};
  }
  for (const std::string& s : inputs) {
    for (PreTokenizer kind : {PreTokenizer::kGpt2, PreTokenizer::kSmollm, PreTokenizer::kLlama3,
                              PreTokenizer::kQwen2}) {
      std::vector<std::string_view> pieces;
      pre_tokenize(kind, s, &pieces);
      std::string joined;
      for (std::string_view p : pieces) {
        EXPECT_FALSE(p.empty());
        joined += p;
      }
      EXPECT_EQ(joined, s) << "pre-tokenizer " << static_cast<int>(kind) << " on " << show(s);
    }
    std::vector<int32_t> ids = tok->encode(s, false, false);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size()) << show(s);
    std::string kept, decoded;
    for (unsigned char c : s)
      if (!missing[c]) kept.push_back(static_cast<char>(c));
    for (int32_t id : ids)
      if (id != unk) decoded += tok->token_to_piece(id);
    EXPECT_EQ(decoded, kept) << show(s);
    if (kept.size() == s.size()) EXPECT_EQ(tok->decode(ids), s) << show(s);
  }
}

// A tiny hand-made vocabulary: spec validation and merge order without the model.
TokenizerSpec tiny_spec() {
  TokenizerSpec s;
  s.model = "gpt2";
  s.pre = "gpt2";
  s.tokens = {"a", "b", "c", "Ġ", "bc", "ab", "abc", "Ġa", "<|x|>", "<|xy|>"};
  s.merges = {"b c", "a b", "ab c", "Ġ a"};
  s.token_types = {1, 1, 1, 1, 1, 1, 1, 1, 3, 3};
  s.unk_id = 3;
  return s;
}

TEST(Tokenizer, MergesFollowRankOrder) {
  Result<Tokenizer> t = Tokenizer::create(tiny_spec());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  // "abc": (b,c) has rank 0 so it wins over (a,b), leaving a + bc ("ab c" never applies).
  EXPECT_EQ(t->encode("abc"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(t->encode("ab"), (std::vector<int32_t>{5}));
  EXPECT_EQ(t->encode(" a"), (std::vector<int32_t>{7}));
  // Bytes missing from the vocabulary map to unk (fused when consecutive).
  EXPECT_EQ(t->encode("zz"), (std::vector<int32_t>{3}));
  // Leftmost-longest literal specials.
  EXPECT_EQ(t->encode("<|xy|><|x|>"), (std::vector<int32_t>{9, 8}));
}

// Literal specials that share prefixes: the longest one at a position wins, a partial one is
// plain text, the lower of two ids spelled alike is matched, and text between specials is
// encoded on its own.
TEST(Tokenizer, SpecialTokensMatchLeftmostLongest) {
  TokenizerSpec s;
  s.model = "gpt2";
  s.pre = "gpt2";
  s.tokens = {"a", "b", "<s>", "<s>ab", "<s>", "<", "s", ">", "?"};
  s.token_types = {1, 1, 3, 4, 3, 1, 1, 1, 2};
  s.unk_id = 8;
  Result<Tokenizer> t = Tokenizer::create(s);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const auto enc = [&](const char* text) { return t->encode(text, false, true); };
  EXPECT_EQ(enc("<s>ab"), (std::vector<int32_t>{3}));        // the longer special
  EXPECT_EQ(enc("<s>a"), (std::vector<int32_t>{2, 0}));      // "<s>ab" breaks off: "<s>", then a
  EXPECT_EQ(enc("a<s>b<s>"), (std::vector<int32_t>{0, 2, 1, 2}));
  EXPECT_EQ(enc("<s"), (std::vector<int32_t>{5, 6}));        // a special's prefix is text
  EXPECT_EQ(enc("<<s>ab>"), (std::vector<int32_t>{5, 3, 7}));
  EXPECT_EQ(t->encode("<s>ab", false, false), (std::vector<int32_t>{5, 6, 7, 0, 1}));
}

TEST(Tokenizer, SpecValidation) {
  auto expect_code = [](TokenizerSpec s, Code code, const char* what) {
    Result<Tokenizer> t = Tokenizer::create(std::move(s));
    ASSERT_FALSE(t.is_ok()) << what;
    EXPECT_EQ(t.status().code(), code) << what << ": " << t.status().to_string();
  };
  TokenizerSpec s = tiny_spec();
  s.bos_id = static_cast<int32_t>(s.tokens.size());
  expect_code(s, Code::kCorrupt, "bos out of range");
  s = tiny_spec();
  s.eos_id = -7;
  expect_code(s, Code::kCorrupt, "negative eos");
  s = tiny_spec();
  s.add_bos = true;  // without a bos id
  expect_code(s, Code::kCorrupt, "add_bos without bos");
  s = tiny_spec();
  s.merges.push_back("a");
  expect_code(s, Code::kCorrupt, "merge without space");
  s = tiny_spec();
  s.merges.push_back("a  b");
  expect_code(s, Code::kCorrupt, "merge with two spaces");
  s = tiny_spec();
  s.merges.push_back("a q");
  expect_code(s, Code::kCorrupt, "merge of unknown token");
  s = tiny_spec();
  s.merges.push_back("c a");
  expect_code(s, Code::kCorrupt, "merge result not in vocab");
  s = tiny_spec();
  s.token_types.pop_back();
  expect_code(s, Code::kCorrupt, "token_type length");
  s = tiny_spec();
  s.model = "llama";
  expect_code(s, Code::kUnsupported, "SentencePiece model");
  s = tiny_spec();
  s.pre = "deepseek-coder";
  expect_code(s, Code::kUnsupported, "unknown pre-tokenizer");
  s = tiny_spec();
  s.tokens.clear();
  s.merges.clear();
  s.token_types.clear();
  expect_code(s, Code::kCorrupt, "empty vocabulary");
}

TEST(Tokenizer, SpecFromGgufRejectsSentencePiece) {
  sf::testing::GgufBuilder b;
  b.kv_string("general.architecture", "llama");
  b.kv_string("tokenizer.ggml.model", "llama");
  std::vector<uint8_t> bytes = b.build();
  Result<GgufFile> f = GgufFile::parse({bytes.data(), bytes.size()});
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  Result<TokenizerSpec> spec = tokenizer_spec_from_gguf(*f);
  ASSERT_FALSE(spec.is_ok());
  EXPECT_EQ(spec.status().code(), Code::kUnsupported);
  EXPECT_NE(spec.status().message().find("gpt2"), std::string::npos) << spec.status().to_string();
}

TEST(Tokenizer, UnicodeTableIsSortedAndAsciiFastPathAgrees) {
  for (size_t i = 0; i < unicode::kNumCodepointRanges; ++i) {
    const auto& r = unicode::kCodepointRanges[i];
    ASSERT_LE(r.lo, r.hi);
    ASSERT_NE(r.flags, 0);
    if (i > 0) ASSERT_LT(unicode::kCodepointRanges[i - 1].hi, r.lo);
  }
  for (uint32_t cp = 0; cp < 0x80; ++cp) {
    uint8_t from_table = 0;
    for (size_t i = 0; i < unicode::kNumCodepointRanges; ++i) {
      const auto& r = unicode::kCodepointRanges[i];
      if (r.lo <= cp && cp <= r.hi) from_table = r.flags;
    }
    EXPECT_EQ(unicode::codepoint_flags(cp), from_table) << "U+" << cp;
  }
  EXPECT_EQ(unicode::codepoint_flags(0x4E2D), unicode::kLetter);  // 中
  EXPECT_EQ(unicode::codepoint_flags(0x0663), unicode::kNumber);  // ٣
  EXPECT_EQ(unicode::codepoint_flags(0x3000), unicode::kSpace);   // ideographic space
  EXPECT_EQ(unicode::codepoint_flags(0x001C), 0);                 // not White_Space
  EXPECT_EQ(unicode::codepoint_flags(unicode::kInvalidCodepoint), 0);
}

TEST(Tokenizer, EncodeSpeed) {
  const Tokenizer* tok = model_tokenizer(TokenizerCompat::kHfTransformers);
  ASSERT_NE(tok, nullptr);
  std::string doc;
  while (doc.size() < 30000) {
    for (const json::value& c : golden_cases()) {
      const std::string text(c.at("text").as_string());
      if (c.at("source") != "corpus" || has_unmapped_bytes(*tok, text)) continue;
      doc += text;
      doc += "\n\n";
    }
  }
  using clock = std::chrono::steady_clock;
  std::vector<int32_t> ids;
  double best_ms = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clock::now();
    ids = tok->encode(doc);
    best_ms =
        std::min(best_ms, std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  std::printf("encode: %zu bytes -> %zu tokens in %.2f ms (best of 5)\n", doc.size(), ids.size(),
              best_ms);
  EXPECT_TRUE(tok->decode(ids) == tok->token_to_piece(tok->bos_id()) + doc);
  EXPECT_LT(best_ms, 250.0);  // milliseconds expected; generous for sanitizer builds

  // Pathological pre-tokens (one 200 KB whitespace run, one 100 KB word) stay near-linear.
  const std::string spaces(200000, ' '), word(100000, 'a');
  auto t0 = clock::now();
  std::vector<int32_t> a = tok->encode(spaces + "x", false), b = tok->encode(word, false);
  const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  std::printf("pathological: 300 KB in %.1f ms (%zu + %zu tokens)\n", ms, a.size(), b.size());
  EXPECT_TRUE(tok->decode(a) == spaces + "x");
  EXPECT_TRUE(tok->decode(b) == word);
  EXPECT_LT(ms, 2000.0);
}

}  // namespace
}  // namespace sf::model
