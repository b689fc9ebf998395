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

// The F16 neighbours of a finite h toward -inf and +inf (an infinity past the largest).
uint16_t f16_down(uint16_t h) { return h == 0x0000 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1; }
uint16_t f16_up(uint16_t h) { return h == 0x8000 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1; }

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

namespace {

// The F16 zero (rounded down) and scale (rounded up) of a group with min mn and max mx, so
// [zero, zero + L * scale] covers the group and no value clamps: a nearest-rounded zero above a
// large minimum (a post-RoPE key channel far from 0 with a narrow range) would cost that
// rounding, not half a step. Codes are taken against the stored values. False when F16 cannot
// hold them.
bool group_params(float mn, float mx, int L, uint16_t* zh, uint16_t* sh, float* z, float* s) {
  *zh = f32_to_f16(mn);
  if (f16_to_f32(*zh) > mn) *zh = f16_down(*zh);
  *z = f16_to_f32(*zh);
  const float need = std::max(0.f, mx - *z) / float(L);
  *sh = f32_to_f16(need);
  if (f16_to_f32(*sh) < need) *sh = f16_up(*sh);
  *s = f16_to_f32(*sh);
  return std::isfinite(*z) && std::isfinite(*s);
}

// A value's code: round((x - z) / s) to nearest even, in [0, L]; 0 where s is 0. The loops below
// call it across contiguous elements, so it stays branch-free to vectorize.
inline int code_of(float x, float z, float s, float L) {
  const float t = s > 0.f ? std::nearbyint((x - z) / s) : 0.f;
  return int(std::clamp(t, 0.f, L));
}

// False for infinities and NaN (x - x is then NaN), vectorizably.
inline bool finite_of(float x) { return x - x == 0.f; }

Status nonfinite_group(KvEncoding e, bool keys) {
  return SF_ERR(kOutOfRange, std::string("kv_encode: ") + kv_encoding_name(e) + " " +
                                 (keys ? "key" : "value") +
                                 " group needs a zero or scale F16 cannot hold (a minimum below "
                                 "-65504, a scale past 65504, or NaN)");
}

// Codes of `m` contiguous values (m even for int4, starting at an even index) into `out` (their
// first byte), against one zero and scale or one a channel (z[i], s[i]).
template <bool kPerChannel>
void put_codes(KvEncoding e, const float* x, int64_t m, const float* z, const float* s,
               uint8_t* out) {
  const float L = float(levels(e));
  if (e == KvEncoding::kInt8) {
    for (int64_t i = 0; i < m; ++i)
      out[i] = uint8_t(code_of(x[i], z[kPerChannel ? i : 0], s[kPerChannel ? i : 0], L));
    return;
  }
  for (int64_t i = 0; i < m / 2; ++i) {
    const int lo = code_of(x[2 * i], z[kPerChannel ? 2 * i : 0], s[kPerChannel ? 2 * i : 0], L);
    const int hi =
        code_of(x[2 * i + 1], z[kPerChannel ? 2 * i + 1 : 0], s[kPerChannel ? 2 * i + 1 : 0], L);
    out[i] = uint8_t(lo | (hi << 4));
  }
}

// Values of `m` contiguous codes (m even for int4) from `q` (their first byte): zero + code *
// scale, against one zero and scale or one a channel.
template <bool kPerChannel>
void get_codes(KvEncoding e, const uint8_t* q, int64_t m, const float* z, const float* s,
               float* out) {
  if (e == KvEncoding::kInt8) {
    for (int64_t i = 0; i < m; ++i)
      out[i] = z[kPerChannel ? i : 0] + float(q[i]) * s[kPerChannel ? i : 0];
    return;
  }
  for (int64_t i = 0; i < m / 2; ++i) {
    out[2 * i] = z[kPerChannel ? 2 * i : 0] + float(q[i] & 0x0f) * s[kPerChannel ? 2 * i : 0];
    out[2 * i + 1] =
        z[kPerChannel ? 2 * i + 1 : 0] + float(q[i] >> 4) * s[kPerChannel ? 2 * i + 1 : 0];
  }
}

}  // namespace

// Vectorizable by layout, not by intrinsics: keys are walked a 64-row block at a time with the
// channel innermost (their groups are channels), values a row at a time (a row is a group), so
// every inner loop runs over contiguous elements; codes are the same as one group at a time.
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
    uint16_t buf[512];  // converted in blocks, then copied (data need not be 2-byte aligned)
    for (int64_t i0 = 0; i0 < n * d; i0 += 512) {
      const int64_t m = std::min<int64_t>(512, n * d - i0);
      for (int64_t i = 0; i < m; ++i) buf[i] = f32_to_bf16(rows[i0 + i]);
      std::memcpy(data + 2 * i0, buf, size_t(m) * 2);
    }
    return Status::ok();
  }
  const int L = levels(e);
  const int64_t row_bytes = kv_encoding_row_elems(e, d);  // bytes of one row's codes
  if (!keys) {
    for (int64_t r = 0; r < n; ++r) {
      const float* x = rows + r * d;
      // Eight lanes, so the min, max and finite check vectorize; the order does not change a
      // min or a max of finite values (but for the sign of a zero, below), and a non-finite one
      // fails the group either way.
      float mn[8], mx[8];
      bool fin[8];
      for (int j = 0; j < 8; ++j) mn[j] = mx[j] = x[0], fin[j] = true;
      int64_t c = 0;
      for (; c + 8 <= d; c += 8)
        for (int j = 0; j < 8; ++j) {
          mn[j] = x[c + j] < mn[j] ? x[c + j] : mn[j];
          mx[j] = x[c + j] > mx[j] ? x[c + j] : mx[j];
          fin[j] = fin[j] & finite_of(x[c + j]);
        }
      for (; c < d; ++c) {
        mn[0] = x[c] < mn[0] ? x[c] : mn[0];
        mx[0] = x[c] > mx[0] ? x[c] : mx[0];
        fin[0] = fin[0] & finite_of(x[c]);
      }
      float lo = mn[0], hi = mx[0];
      bool finite = fin[0];
      for (int j = 1; j < 8; ++j) lo = std::min(lo, mn[j]), hi = std::max(hi, mx[j]), finite &= fin[j];
      // A zero minimum is the row's first zero, +0 or -0, as a scan in order keeps it: the sign
      // reaches the stored zero (F16 0x8000 or 0x0000; the decoded values are the same).
      if (lo == 0.f)
        for (int64_t i = 0; i < d; ++i)
          if (x[i] == 0.f) {
            lo = x[i];
            break;
          }
      float z, s;
      if (!finite || !group_params(lo, hi, L, &zero[r], &scale[r], &z, &s))
        return nonfinite_group(e, keys);
      put_codes<false>(e, x, d, &z, &s, data + r * row_bytes);
    }
    return Status::ok();
  }
  const size_t dc = size_t(d);
  std::vector<float> mn(dc), mx(dc), z(dc), s(dc);
  std::vector<uint8_t> fin(dc);
  for (int64_t b = 0; b < key_blocks(n); ++b) {
    const int64_t r0 = b * kKvQuantKeyRows, cnt = std::min<int64_t>(kKvQuantKeyRows, n - r0);
    const float* x0 = rows + r0 * d;
    for (int c = 0; c < d; ++c) mn[size_t(c)] = mx[size_t(c)] = x0[c], fin[size_t(c)] = 1;
    for (int64_t r = 0; r < cnt; ++r) {
      const float* x = x0 + r * d;
      for (int c = 0; c < d; ++c) {
        mn[size_t(c)] = x[c] < mn[size_t(c)] ? x[c] : mn[size_t(c)];
        mx[size_t(c)] = x[c] > mx[size_t(c)] ? x[c] : mx[size_t(c)];
        fin[size_t(c)] = uint8_t(fin[size_t(c)] & uint8_t(finite_of(x[c])));
      }
    }
    for (int c = 0; c < d; ++c) {
      const int64_t g = b * d + c;
      if (!fin[size_t(c)] || !group_params(mn[size_t(c)], mx[size_t(c)], L, &zero[g], &scale[g],
                                           &z[size_t(c)], &s[size_t(c)]))
        return nonfinite_group(e, keys);
    }
    for (int64_t r = 0; r < cnt; ++r)
      put_codes<true>(e, x0 + r * d, d, z.data(), s.data(), data + (r0 + r) * row_bytes);
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

Status kv_decode_into(KvEncoding e, bool keys, const uint8_t* data, const uint16_t* scale,
                      const uint16_t* zero, int64_t n, int head_dim, float* out) {
  const int d = head_dim;
  if (n < 0 || d <= 0 || (e == KvEncoding::kInt4 && d % 2 != 0))
    return SF_ERR(kInvalidArgument, "kv_decode: bad geometry");
  if (e == KvEncoding::kF32) {
    if (n > 0) std::memcpy(out, data, size_t(data_bytes(e, n, d)));
    return Status::ok();
  }
  if (e == KvEncoding::kBF16) {
    uint16_t buf[512];  // copied out in blocks (the data need not be 2-byte aligned), widened
    for (int64_t i0 = 0; i0 < n * d; i0 += 512) {
      const int64_t m = std::min<int64_t>(512, n * d - i0);
      std::memcpy(buf, data + 2 * i0, size_t(m) * 2);
      for (int64_t i = 0; i < m; ++i) out[i0 + i] = bf16_to_f32(buf[i]);
    }
    return Status::ok();
  }
  // As the encoder: groups' parameters first, then each row's codes across contiguous elements
  // (keys against one zero and scale a channel, values against their row's).
  const int64_t row_bytes = kv_encoding_row_elems(e, d);
  std::vector<float> z(keys ? size_t(d) : 1), s(keys ? size_t(d) : 1);
  const auto params = [&](int64_t g, size_t at) -> bool {
    z[at] = f16_to_f32(zero[size_t(g)]);
    s[at] = f16_to_f32(scale[size_t(g)]);
    return std::isfinite(z[at]) && std::isfinite(s[at]) && s[at] >= 0;
  };
  for (int64_t r = 0; r < n; ++r) {
    if (!keys || r % kKvQuantKeyRows == 0) {
      const int64_t g0 = keys ? (r / kKvQuantKeyRows) * d : r;
      for (int64_t c = 0; c < int64_t(z.size()); ++c)
        if (!params(g0 + c, size_t(c)))
          return SF_ERR(kInvalidArgument, "kv_decode: a group's F16 zero or scale is not finite");
    }
    if (keys)
      get_codes<true>(e, data + r * row_bytes, d, z.data(), s.data(), out + r * d);
    else
      get_codes<false>(e, data + r * row_bytes, d, z.data(), s.data(), out + r * d);
  }
  return Status::ok();
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
  return kv_decode_into(e, keys, in.data.data(), in.scale.data(), in.zero.data(), n, d, out);
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
      fold_key_bounds(r, d, lo, hi);
      for (int c = 0; c < d; ++c) sum[size_t(c)] += r[c];
    }
    for (int c = 0; c < d; ++c) kmean[b * d + c] = float(sum[size_t(c)] / double(t1 - t0));
  }
}

}  // namespace sf::kvstore
