// How an exported KV cache stores its keys and values (docs/kv-format.md, "Encodings").
// The prefill computes K/V in F32; an export may store them narrower so that fewer bytes cross
// to the decode node:
//   f32   as computed;
//   bf16  rounded to bfloat16;
//   int8, int4  asymmetric integer codes in KIVI's layout (Liu et al. 2024): keys per channel
//         over each block of 64 kept tokens of a head (the block the export's metadata already
//         describes), values per token over the head's channels; each group has an F16 scale
//         and zero (rounded down and up, so the group fits), x ~= zero + code * scale, within
//         half a scale of the value. int4 packs two codes a byte, the even channel in
//         the low nibble.
// The decode node turns every encoding back into F32 on load; what it attends over is then
// exactly kv_decode(kv_encode(x)), which the in-process evaluation reproduces by kv_round_trip.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace sf::kvstore {

enum class KvEncoding : uint8_t { kF32 = 0, kBF16, kInt8, kInt4 };

// "f32", "bf16", "int8", "int4"; anything else is kInvalidArgument naming the choices.
Result<KvEncoding> kv_encoding_parse(std::string_view s);
const char* kv_encoding_name(KvEncoding e);

// An export's encodings: every kept token in `high`, or, with a low tier, the retention's
// low-tier tokens (Retention::low) in `low` and the rest in `high`. Written "int8" or "int8+int4"
// (the second narrower than the first, so the split spends fewer bytes on the tokens that matter
// less).
struct KvEncodings {
  KvEncoding high = KvEncoding::kF32;
  std::optional<KvEncoding> low;
};
// "ENC" or "HIGH+LOW"; LOW must take fewer bytes a token than HIGH (kInvalidArgument otherwise).
Result<KvEncodings> kv_encodings_parse(std::string_view s);
// As kv_encodings_parse, and also "auto": the dtype the model computes K/V in (`compute`), as
// vLLM's kv_cache_dtype "auto" takes the model's: bf16 for BF16 weights (the device forward),
// f32 otherwise (the CPU forward). The device forward's cuDNN attention reads K/V rounded to
// bf16, so exporting F32 would double the bytes for precision the prefill itself did not use
// (without cuDNN its F32 reference kernel does use it; ask for f32 there).
Result<KvEncodings> kv_encodings_parse(std::string_view s, DType compute);
std::string kv_encodings_name(const KvEncodings& e);

// The element type of an encoding's K/V tensors (F32, BF16, or U8 codes) and how many elements a
// row of head_dim channels takes (int4: head_dim / 2 bytes).
DType kv_encoding_element(KvEncoding e);
int64_t kv_encoding_row_elems(KvEncoding e, int head_dim);

// Rows of one quantization group of keys (the export's block of kept tokens).
constexpr int kKvQuantKeyRows = 64;

// The F16 scale/zero groups of one head's n rows of keys or values (0 for f32 and bf16), and the
// shape their tensors take for `heads` heads: keys [1, heads, n_blocks, head_dim], values
// [1, heads, n].
int64_t kv_param_groups(KvEncoding e, bool keys, int64_t n, int head_dim);
std::vector<int64_t> kv_param_shape(bool keys, int64_t heads, int64_t n, int head_dim);

// Per-channel key min, max and mean of each block of kKvQuantKeyRows rows of keys [n, d] (the
// last block may be short), into [n_blocks, d] each: an export's block metadata
// (kvstore/kv_export.h), also what a reader recomputes for blocks it merges.
void block_key_stats(const float* keys, int64_t n, int d, float* kmin, float* kmax, float* kmean);

// Folds one key row r[d] into a block's running per-channel bounds lo / hi. A NaN key makes its
// channel's bounds NaN, and they stay NaN (std::min / max would drop it unless first), so PSA
// visits the block and the NaN reaches the output as with full attention. block_key_stats and
// the decode node's appends use it.
inline void fold_key_bounds(const float* r, int d, float* lo, float* hi) {
  for (int c = 0; c < d; ++c) {
    lo[c] = r[c] < lo[c] || r[c] != r[c] ? r[c] : lo[c];
    hi[c] = r[c] > hi[c] || r[c] != r[c] ? r[c] : hi[c];
  }
}

// Stored bytes of one head's n kept tokens, keys and values together, with the scales and
// zeros of the integer encodings (blocks of kKvQuantKeyRows rows for keys, one group per row for
// values). This is what the retention evaluation counts as kv_bytes.
int64_t kv_encoded_bytes(KvEncoding e, int64_t n, int head_dim);

// One head's keys or values, encoded. data: F32 / BF16 little-endian bytes, or the codes (int4
// packed). scale, zero: F16 bits; keys [n_blocks, head_dim], values [n]; empty for f32/bf16.
struct EncodedRows {
  std::vector<uint8_t> data;
  std::vector<uint16_t> scale, zero;
};

// rows: [n, head_dim] F32. int4 needs an even head_dim. A group holding a NaN or infinity, with a
// minimum below -65504 (no F16 zero under it) or a scale past 65504 is kOutOfRange; a minimum
// above 65504 is stored as a zero of 65504 with the scale covering the rest.
Result<EncodedRows> kv_encode(KvEncoding e, bool keys, const float* rows, int64_t n, int head_dim);

// kv_encode into the caller's buffers: data of n x kv_encoding_row_elems elements of
// kv_encoding_element, scale and zero of kv_param_groups each (unused for f32 and bf16). Every
// group lies inside one block of kKvQuantKeyRows rows, so blocks encoded one call each (from a
// block boundary, at their offsets) store exactly what one call over all the rows does: an
// export encodes a block while its rows are in cache.
Status kv_encode_into(KvEncoding e, bool keys, const float* rows, int64_t n, int head_dim,
                      uint8_t* data, uint16_t* scale, uint16_t* zero);

// The inverse into out [n, head_dim]. Checks that every buffer has the size n and head_dim
// imply (kInvalidArgument otherwise), so a reader can hand it what a file declared.
Status kv_decode(KvEncoding e, bool keys, const EncodedRows& in, int64_t n, int head_dim,
                 float* out);

// kv_decode from the caller's buffers (kv_encode_into's layout), unchecked for size: an export
// decodes each key block it wrote, so its block statistics are those of the stored keys.
Status kv_decode_into(KvEncoding e, bool keys, const uint8_t* data, const uint16_t* scale,
                      const uint16_t* zero, int64_t n, int head_dim, float* out);

// rows <- kv_decode(kv_encode(rows)): what a decode node holds after loading the encoding.
Status kv_round_trip(KvEncoding e, bool keys, float* rows, int64_t n, int head_dim);

}  // namespace sf::kvstore
