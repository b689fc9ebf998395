#include "kvstore/position_runs.h"

#include <algorithm>
#include <array>

namespace sf::kvstore {
namespace {

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void put_varint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out->push_back(char(v));
}

Status corrupt(const std::string& what) {
  return SF_ERR(kCorrupt, "position runs: " + what);
}

}  // namespace

std::vector<PositionRun> position_runs(std::span<const int32_t> pos) {
  std::vector<PositionRun> out;
  for (size_t i = 0; i < pos.size();) {
    size_t j = i + 1;
    while (j < pos.size() && pos[j] == pos[j - 1] + 1) ++j;
    out.emplace_back(pos[i], int64_t(pos[j - 1]) + 1);
    i = j;
  }
  return out;
}

std::string encode_position_runs(std::span<const PositionRun> runs) {
  std::string bytes;
  bytes.reserve(runs.size() * 4);
  int64_t prev_end = 0;
  for (const auto& [b, e] : runs) {
    put_varint(uint64_t(b - prev_end), &bytes);
    put_varint(uint64_t(e - b), &bytes);
    prev_end = e;
  }
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t w = uint32_t(uint8_t(bytes[i])) << 16;
    if (n > 1) w |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    if (n > 2) w |= uint32_t(uint8_t(bytes[i + 2]));
    out.push_back(kB64[(w >> 18) & 63]);
    out.push_back(kB64[(w >> 12) & 63]);
    out.push_back(n > 1 ? kB64[(w >> 6) & 63] : '=');
    out.push_back(n > 2 ? kB64[w & 63] : '=');
  }
  return out;
}

Result<std::vector<PositionRun>> decode_position_runs(std::string_view text, int64_t n_tokens) {
  static const std::array<int8_t, 256> kValue = [] {
    std::array<int8_t, 256> v{};
    v.fill(-1);
    for (int i = 0; i < 64; ++i) v[uint8_t(kB64[i])] = int8_t(i);
    return v;
  }();
  if (text.size() % 4 != 0)
    return corrupt("length " + std::to_string(text.size()) + " is not a multiple of 4 (base64)");
  std::string bytes;
  bytes.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int pad = 0;
    uint32_t w = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i + size_t(k)];
      if (c == '=' && last && k >= 2) {
        ++pad;
        w <<= 6;
        continue;
      }
      if (pad > 0 || kValue[uint8_t(c)] < 0)
        return corrupt("character " + std::to_string(i + size_t(k)) + " is not base64");
      w = (w << 6) | uint32_t(kValue[uint8_t(c)]);
    }
    bytes.push_back(char(w >> 16));
    if (pad < 2) bytes.push_back(char(w >> 8));
    if (pad < 1) bytes.push_back(char(w));
  }
  std::vector<PositionRun> out;
  size_t at = 0;
  auto varint = [&](uint64_t* v) -> bool {
    *v = 0;
    for (int shift = 0; at < bytes.size() && shift < 63; shift += 7) {
      const uint8_t b = uint8_t(bytes[at++]);
      *v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  int64_t prev_end = 0;
  while (at < bytes.size()) {
    uint64_t gap = 0, len = 0;
    if (!varint(&gap) || !varint(&len))
      return corrupt("run " + std::to_string(out.size()) + " is cut off or too large");
    if (len == 0) return corrupt("run " + std::to_string(out.size()) + " is empty");
    if (gap > uint64_t(n_tokens) || len > uint64_t(n_tokens) ||
        prev_end + int64_t(gap) + int64_t(len) > n_tokens)
      return corrupt("run " + std::to_string(out.size()) + " ends past the prompt's " +
                     std::to_string(n_tokens) + " tokens");
    const int64_t b = prev_end + int64_t(gap);
    out.emplace_back(b, b + int64_t(len));
    prev_end = b + int64_t(len);
  }
  return out;
}

}  // namespace sf::kvstore
