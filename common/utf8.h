// UTF-8 decoding that never fails and encoding, shared by the tokenizer (worker/model) and the
// text writers (common/text: JSON, Prometheus labels).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace sf::utf8 {

// Stands for one byte that is not part of a valid UTF-8 sequence; classed as "other".
inline constexpr uint32_t kInvalidCodepoint = 0x110000;

struct DecodedCodepoint {
  uint32_t cp;   // kInvalidCodepoint for a stray byte
  uint32_t len;  // bytes consumed, >= 1 whenever pos < s.size()
};

// Decodes the code point at s[pos] (pos < s.size()). Overlong forms, surrogates, values above
// U+10FFFF and truncated sequences consume exactly one byte and yield kInvalidCodepoint, so
// every byte of the input is covered exactly once.
inline DecodedCodepoint utf8_decode(std::string_view s, size_t pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  const size_t left = s.size() - pos;
  const uint32_t b0 = p[0];
  if (b0 < 0x80) return {b0, 1};
  uint32_t need, cp, min;
  if ((b0 & 0xE0) == 0xC0) {
    need = 1;
    cp = b0 & 0x1F;
    min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    need = 2;
    cp = b0 & 0x0F;
    min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    need = 3;
    cp = b0 & 0x07;
    min = 0x10000;
  } else
    return {kInvalidCodepoint, 1};
  if (left <= need) return {kInvalidCodepoint, 1};
  for (uint32_t k = 1; k <= need; ++k) {
    if ((p[k] & 0xC0) != 0x80) return {kInvalidCodepoint, 1};
    cp = (cp << 6) | (p[k] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalidCodepoint, 1};
  return {cp, need + 1};
}

// Appends the UTF-8 encoding of a valid code point (cp <= 0x10FFFF) to out.
template <typename String>
void utf8_append(String& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace sf::utf8
