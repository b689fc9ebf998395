#include "kvstore/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.h"

namespace sf::kvstore {
namespace {

int levels(KvEncoding e) { return e == KvEncoding::kInt8 ? 255 : 15; }
bool is_int(KvEncoding e) { return e == KvEncoding::kInt8 || e == KvEncoding::kInt4; }
int64_t key_blocks(int64_t n) { return (n + kKvQuantKeyRows - 1) / kKvQuantKeyRows; }

// Payload bytes of n rows of one tensor (K or V).
int64_t data_bytes(KvEncoding e, int64_t n, int d) {
  return n * kv_encoding_row_elems(e, d) * int64_t(dtype_size(kv_encoding_element(e)));
}

void put_code(KvEncoding e, uint8_t* data, int64_t idx, int q) {
  if (e == KvEncoding::kInt8) {
    data[idx] = uint8_t(q);
  } else {
    uint8_t& b = data[idx / 2];
    b = (idx & 1) ? uint8_t((b & 0x0f) | (q << 4)) : uint8_t((b & 0xf0) | q);
  }
}

int get_code(KvEncoding e, const uint8_t* data, int64_t idx) {
  if (e == KvEncoding::kInt8) return data[idx];
  const uint8_t b = data[idx / 2];
  return (idx & 1) ? b >> 4 : b & 0x0f;
}

// The F16 neighbours of a finite h toward -inf and +inf (an infinity past the largest).
uint16_t f16_down(uint16_t h) { return h == 0x0000 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1; }
uint16_t f16_up(uint16_t h) { return h == 0x8000 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1; }

// The elements of one group: `count` of them, element i at rows[first + i * stride].
struct Group {
  int64_t first, stride, count;
};

Group group_of(bool keys, int64_t g, int64_t n, int d) {
  if (!keys) return {g * d, 1, d};
  const int64_t b = g / d, c = g % d, r0 = b * kKvQuantKeyRows;
  return {r0 * d + c, d, std::min<int64_t>(kKvQuantKeyRows, n - r0)};
}

}  // namespace

Result<KvEncoding> kv_encoding_parse(std::string_view s) {
  if (s == "f32") return KvEncoding::kF32;
  if (s == "bf16") return KvEncoding::kBF16;
  if (s == "int8") return KvEncoding::kInt8;
  if (s == "int4") return KvEncoding::kInt4;
  return SF_ERR(kInvalidArgument,
                "KV encoding '" + std::string(s) + "' is not f32, bf16, int8 or int4");
}

Result<KvEncodings> kv_encodings_parse(std::string_view s) {
  KvEncodings out;
  const size_t plus = s.find('+');
  SF_ASSIGN(out.high, kv_encoding_parse(s.substr(0, plus)));
  if (plus == std::string_view::npos) return out;
  SF_ASSIGN(KvEncoding low, kv_encoding_parse(s.substr(plus + 1)));
  if (kv_encoded_bytes(low, kKvQuantKeyRows, 64) >= kv_encoded_bytes(out.high, kKvQuantKeyRows, 64))
    return SF_ERR(kInvalidArgument, "KV encodings '" + std::string(s) +
                                        "': the low tier must be narrower than the high one "
                                        "(f32 > bf16 > int8 > int4)");
  out.low = low;
  return out;
}

Result<KvEncodings> kv_encodings_parse(std::string_view s, DType compute) {
  if (s != "auto") return kv_encodings_parse(s);
  KvEncodings out;
  out.high = compute == DType::kBF16 ? KvEncoding::kBF16 : KvEncoding::kF32;
  return out;
}

std::string kv_encodings_name(const KvEncodings& e) {
  std::string s = kv_encoding_name(e.high);
  if (e.low) s += std::string("+") + kv_encoding_name(*e.low);
  return s;
}

const char* kv_encoding_name(KvEncoding e) {
  switch (e) {
    case KvEncoding::kF32:
      return "f32";
    case KvEncoding::kBF16:
      return "bf16";
    case KvEncoding::kInt8:
      return "int8";
    case KvEncoding::kInt4:
      return "int4";
  }
  return "?";
}

DType kv_encoding_element(KvEncoding e) {
  return e == KvEncoding::kF32 ? DType::kF32 : e == KvEncoding::kBF16 ? DType::kBF16 : DType::kU8;
}

int64_t kv_encoding_row_elems(KvEncoding e, int head_dim) {
  return e == KvEncoding::kInt4 ? head_dim / 2 : head_dim;
}

int64_t kv_param_groups(KvEncoding e, bool keys, int64_t n, int head_dim) {
  if (!is_int(e)) return 0;
  return keys ? key_blocks(n) * head_dim : n;
}

std::vector<int64_t> kv_param_shape(bool keys, int64_t heads, int64_t n, int head_dim) {
  if (keys) return {1, heads, key_blocks(n), head_dim};
  return {1, heads, n};
}

int64_t kv_encoded_bytes(KvEncoding e, int64_t n, int head_dim) {
  const int64_t params = 2 * 2;  // F16 scale and zero
  return 2 * data_bytes(e, n, head_dim) +
         (kv_param_groups(e, true, n, head_dim) + kv_param_groups(e, false, n, head_dim)) * params;
}

Status kv_encode_into(KvEncoding e, bool keys, const float* rows, int64_t n, int head_dim,
                      uint8_t* data, uint16_t* scale, uint16_t* zero) {
  const int d = head_dim;
  if (n < 0 || d <= 0 || (e == KvEncoding::kInt4 && d % 2 != 0))
    return SF_ERR(kInvalidArgument, std::string("kv_encode: ") + kv_encoding_name(e) +
                                        " needs n >= 0 and a positive" +
                                        (e == KvEncoding::kInt4 ? ", even" : "") + " head_dim");
  if (e == KvEncoding::kF32) {
    if (n > 0) std::memcpy(data, rows, size_t(data_bytes(e, n, d)));
    return Status::ok();
  }
  if (e == KvEncoding::kBF16) {
    for (int64_t i = 0; i < n * d; ++i) {
      const uint16_t h = f32_to_bf16(rows[i]);
      std::memcpy(data + 2 * i, &h, 2);
    }
    return Status::ok();
  }
  const int L = levels(e);
  const int64_t ng = kv_param_groups(e, keys, n, d);
  // int4 codes share bytes: each nibble is set into its byte, so the bytes start defined.
  if (e == KvEncoding::kInt4 && n > 0) std::memset(data, 0, size_t(data_bytes(e, n, d)));
  for (int64_t g = 0; g < ng; ++g) {
    const Group G = group_of(keys, g, n, d);
    float mn = rows[G.first], mx = mn;
    bool finite = true;  // min/max skip a NaN, so it is looked for
    for (int64_t i = 0; i < G.count; ++i) {
      const float x = rows[G.first + i * G.stride];
      finite = finite && std::isfinite(x);
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    // The zero rounds down and the scale up to F16, so [zero, zero + L * scale] covers the
    // group and no value clamps: a nearest-rounded zero above a large minimum (a post-RoPE key
    // channel far from 0 with a narrow range) would cost that rounding, not half a step. Codes
    // are taken against the stored values.
    uint16_t zh = f32_to_f16(mn);
    if (f16_to_f32(zh) > mn) zh = f16_down(zh);
    const float z = f16_to_f32(zh);
    const float need = std::max(0.f, mx - z) / float(L);
    uint16_t sh = f32_to_f16(need);
    if (f16_to_f32(sh) < need) sh = f16_up(sh);
    const float s = f16_to_f32(sh);
    if (!finite || !std::isfinite(z) || !std::isfinite(s))
      return SF_ERR(kOutOfRange,
                    std::string("kv_encode: ") + kv_encoding_name(e) + " " +
                        (keys ? "key" : "value") +
                        " group needs a zero or scale F16 cannot hold (beyond 65504, or NaN)");
    zero[g] = zh;
    scale[g] = sh;
    for (int64_t i = 0; i < G.count; ++i) {
      const int64_t idx = G.first + i * G.stride;
      const int q = s > 0 ? int(std::lrint((rows[idx] - z) / s)) : 0;
      put_code(e, data, idx, std::clamp(q, 0, L));
    }
  }
  return Status::ok();
}

Result<EncodedRows> kv_encode(KvEncoding e, bool keys, const float* rows, int64_t n, int head_dim) {
  EncodedRows out;
  if (n >= 0 && head_dim > 0) {
    out.data.assign(size_t(data_bytes(e, n, head_dim)), 0);
    const int64_t ng = is_int(e) ? kv_param_groups(e, keys, n, head_dim) : 0;
    out.scale.resize(size_t(ng));
    out.zero.resize(size_t(ng));
  }
  SF_TRY(kv_encode_into(e, keys, rows, n, head_dim, out.data.data(), out.scale.data(),
                        out.zero.data()));
  return out;
}

Status kv_decode(KvEncoding e, bool keys, const EncodedRows& in, int64_t n, int head_dim,
                 float* out) {
  const int d = head_dim;
  if (n < 0 || d <= 0 || (e == KvEncoding::kInt4 && d % 2 != 0))
    return SF_ERR(kInvalidArgument, "kv_decode: bad geometry");
  const int64_t ng = kv_param_groups(e, keys, n, d);
  if (int64_t(in.data.size()) != data_bytes(e, n, d) || int64_t(in.scale.size()) != ng ||
      int64_t(in.zero.size()) != ng)
    return SF_ERR(kInvalidArgument, std::string("kv_decode: ") + kv_encoding_name(e) + " " +
                                        (keys ? "keys" : "values") + " of " + std::to_string(n) +
                                        " x " + std::to_string(d) +
                                        " need other buffer sizes than were given");
  if (e == KvEncoding::kF32) {
    if (n > 0) std::memcpy(out, in.data.data(), in.data.size());
    return Status::ok();
  }
  if (e == KvEncoding::kBF16) {
    for (int64_t i = 0; i < n * d; ++i) {
      uint16_t h;
      std::memcpy(&h, in.data.data() + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    }
    return Status::ok();
  }
  for (int64_t g = 0; g < ng; ++g) {
    const Group G = group_of(keys, g, n, d);
    const float z = f16_to_f32(in.zero[size_t(g)]), s = f16_to_f32(in.scale[size_t(g)]);
    if (!std::isfinite(z) || !std::isfinite(s) || s < 0)
      return SF_ERR(kInvalidArgument, "kv_decode: a group's F16 zero or scale is not finite");
    for (int64_t i = 0; i < G.count; ++i) {
      const int64_t idx = G.first + i * G.stride;
      out[idx] = z + float(get_code(e, in.data.data(), idx)) * s;
    }
  }
  return Status::ok();
}

Status kv_round_trip(KvEncoding e, bool keys, float* rows, int64_t n, int head_dim) {
  if (e == KvEncoding::kF32) return Status::ok();
  SF_ASSIGN(EncodedRows enc, kv_encode(e, keys, rows, n, head_dim));
  return kv_decode(e, keys, enc, n, head_dim, rows);
}

void block_key_stats(const float* keys, int64_t n, int d, float* kmin, float* kmax, float* kmean) {
  // Row by row over a block (each channel sees its rows in the same order as a column walk, so
  // the results are the same, but the loads are contiguous and the channels vectorize).
  thread_local std::vector<double> sum;  // the export calls this once a block: no allocation each
  sum.resize(static_cast<size_t>(d));
  for (int64_t b = 0; b * kKvQuantKeyRows < n; ++b) {
    const int64_t t0 = b * kKvQuantKeyRows, t1 = std::min(n, t0 + kKvQuantKeyRows);
    float* lo = kmin + b * d;
    float* hi = kmax + b * d;
    std::copy(keys + t0 * d, keys + (t0 + 1) * d, lo);
    std::copy(keys + t0 * d, keys + (t0 + 1) * d, hi);
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t t = t0; t < t1; ++t) {
      const float* r = keys + t * d;
      for (int c = 0; c < d; ++c) {
        lo[c] = std::min(lo[c], r[c]);
        hi[c] = std::max(hi[c], r[c]);
        sum[size_t(c)] += r[c];
      }
    }
    for (int c = 0; c < d; ++c) kmean[b * d + c] = float(sum[size_t(c)] / double(t1 - t0));
  }
}

}  // namespace sf::kvstore
