#include "decode/kv_client.h"

#include <algorithm>
#include <boost/json.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/checksum.h"
#include "common/safetensors.h"
#include "common/thread_pool.h"
#include "kvstore/kv_export.h"
#include "kvstore/position_runs.h"

namespace sf::decode {
namespace fs = std::filesystem;
namespace json = boost::json;
namespace {

constexpr uint64_t kMaxManifestBytes = uint64_t(1) << 30;

Status corrupt(const std::string& where, const std::string& what) {
  return SF_ERR(kCorrupt, "kv export " + where + ": " + what);
}

Result<const json::value*> field(const json::object& o, const char* key, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end()) return corrupt(where, std::string("missing field '") + key + "'");
  return &it->value();
}

Result<int64_t> get_int(const json::object& o, const char* key, const std::string& where) {
  SF_ASSIGN(const json::value* v, field(o, key, where));
  if (v->is_int64()) return v->as_int64();
  if (v->is_uint64() && v->as_uint64() <= uint64_t(INT64_MAX)) return int64_t(v->as_uint64());
  return corrupt(where, std::string("field '") + key + "' is not an integer");
}

Result<std::string> get_str(const json::object& o, const char* key, const std::string& where) {
  SF_ASSIGN(const json::value* v, field(o, key, where));
  if (!v->is_string()) return corrupt(where, std::string("field '") + key + "' is not a string");
  return std::string(v->as_string());
}

Result<double> get_num(const json::object& o, const char* key, const std::string& where) {
  SF_ASSIGN(const json::value* v, field(o, key, where));
  if (v->is_double()) return v->as_double();
  if (v->is_int64()) return double(v->as_int64());
  if (v->is_uint64()) return double(v->as_uint64());
  return corrupt(where, std::string("field '") + key + "' is not a number");
}

Result<const json::object*> get_obj(const json::object& o, const char* key,
                                    const std::string& where) {
  SF_ASSIGN(const json::value* v, field(o, key, where));
  if (!v->is_object()) return corrupt(where, std::string("field '") + key + "' is not an object");
  return &v->as_object();
}

Result<const json::array*> get_arr(const json::object& o, const char* key,
                                   const std::string& where) {
  SF_ASSIGN(const json::value* v, field(o, key, where));
  if (!v->is_array()) return corrupt(where, std::string("field '") + key + "' is not an array");
  return &v->as_array();
}

// The tensor `name`, checked to have the dtype and exact shape.
Result<const SafetensorsTensor*> find_tensor(const SafetensorsFile& f, const std::string& name,
                                             const char* dtype, const std::vector<int64_t>& shape,
                                             const std::string& where) {
  const SafetensorsTensor* t = f.find(name);
  if (!t) return corrupt(where, "tensor '" + name + "' missing");
  if (t->dtype != dtype)
    return corrupt(where, "tensor '" + name + "' has dtype " + t->dtype + ", expected " + dtype);
  if (t->shape != shape) {
    std::string a, b;
    for (int64_t x : t->shape) a += std::to_string(x) + ",";
    for (int64_t x : shape) b += std::to_string(x) + ",";
    return corrupt(where, "tensor '" + name + "' has shape [" + a + "], expected [" + b + "]");
  }
  return t;
}

// Copies the part [first, first + count) (in elements of T) of a checked tensor; the data
// section is not aligned in general. count < 0: all of it.
template <typename T>
Status read_tensor(const SafetensorsFile& f, const std::string& name, const char* dtype,
                   const std::vector<int64_t>& shape, const std::string& where, std::vector<T>* out,
                   int64_t first = 0, int64_t count = -1) {
  SF_ASSIGN(const SafetensorsTensor* t, find_tensor(f, name, dtype, shape, where));
  out->resize(size_t(count < 0 ? int64_t(t->n_bytes() / sizeof(T)) : count));
  if (!out->empty())
    std::memcpy(out->data(), t->data + first * int64_t(sizeof(T)), out->size() * sizeof(T));
  return Status::ok();
}

// Head j (of `heads` in the tensors named name + sfx) of a shard's K or V: its n rows read in
// the export's encoding and decoded to F32; int8: the rows as stored into *codes too.
Status read_kv(const SafetensorsFile& f, kvstore::KvEncoding enc, bool keys, const std::string& sfx,
               int64_t heads, int64_t j, int64_t n, int64_t hd, const std::string& where,
               std::vector<float>* out, kvstore::EncodedRows* codes) {
  const std::string base = keys ? "key" : "value";
  const DType et = kvstore::kv_encoding_element(enc);
  const int64_t width = kvstore::kv_encoding_row_elems(enc, int(hd));
  const int64_t esize = int64_t(dtype_size(et));
  kvstore::EncodedRows rows;
  SF_TRY(read_tensor<uint8_t>(f, base + sfx, dtype_name(et), {1, heads, n, width}, where,
                              &rows.data, j * n * width * esize, n * width * esize));
  if (const int64_t per = kvstore::kv_param_groups(enc, keys, n, int(hd)); per > 0) {
    const std::vector<int64_t> shape = kvstore::kv_param_shape(keys, heads, n, int(hd));
    SF_TRY(read_tensor<uint16_t>(f, base + "_scale" + sfx, "F16", shape, where, &rows.scale,
                                 j * per, per));
    SF_TRY(read_tensor<uint16_t>(f, base + "_zero" + sfx, "F16", shape, where, &rows.zero, j * per,
                                 per));
  }
  out->resize(size_t(n * hd));
  const Status st = kvstore::kv_decode(enc, keys, rows, n, int(hd), out->data());
  if (!st.is_ok()) return corrupt(where, base + sfx + ": " + st.message());
  if (enc == kvstore::KvEncoding::kInt8) *codes = std::move(rows);
  return Status::ok();
}

// Rows [r0, r1) of a head's int8 keys or values (key groups whole blocks of bs rows) appended.
void append_codes(const kvstore::EncodedRows& src, bool keys, int64_t r0, int64_t r1, int64_t hd,
                  int64_t bs, kvstore::EncodedRows* dst) {
  dst->data.insert(dst->data.end(), src.data.begin() + r0 * hd, src.data.begin() + r1 * hd);
  const int64_t p0 = keys ? r0 / bs * hd : r0, p1 = keys ? (r1 + bs - 1) / bs * hd : r1;
  dst->scale.insert(dst->scale.end(), src.scale.begin() + p0, src.scale.begin() + p1);
  dst->zero.insert(dst->zero.end(), src.zero.begin() + p0, src.zero.begin() + p1);
}

// A head's two tiers as one list in position order. The files' blocks are per tier, so the
// merged blocks' key min / max / mean come from the decoded keys; importance is not carried.
HeadKv merge_tiers(const HeadKv& a, const HeadKv& b, int64_t hd) {
  HeadKv m;
  const size_t n = a.positions.size() + b.positions.size();
  m.positions.reserve(n);
  m.k.reserve(n * size_t(hd));
  m.v.reserve(n * size_t(hd));
  for (size_t i = 0, j = 0; i + j < n;) {
    const bool from_a = j == b.positions.size() ||
                        (i < a.positions.size() && a.positions[i] < b.positions[j]);
    const HeadKv& s = from_a ? a : b;
    const size_t r = from_a ? i++ : j++;
    m.positions.push_back(s.positions[r]);
    m.k.insert(m.k.end(), s.k.begin() + int64_t(r) * hd, s.k.begin() + int64_t(r + 1) * hd);
    m.v.insert(m.v.end(), s.v.begin() + int64_t(r) * hd, s.v.begin() + int64_t(r + 1) * hd);
  }
  const int64_t nb = (int64_t(n) + kvstore::kKvBlockSize - 1) / kvstore::kKvBlockSize;
  m.block_kmin.assign(size_t(nb * hd), 0.f);
  m.block_kmax.assign(size_t(nb * hd), 0.f);
  m.block_kmean.assign(size_t(nb * hd), 0.f);
  kvstore::block_key_stats(m.k.data(), int64_t(n), int(hd), m.block_kmin.data(),
                           m.block_kmax.data(), m.block_kmean.data());
  return m;
}

// A head's positions are exactly the declared ranges (their count is, by the tensor shapes;
// this walk is bounded by it).
Status check_positions(const std::vector<int32_t>& pos,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges,
                       const std::string& where, int64_t head, const std::string& whose) {
  size_t i = 0;
  bool same = true;
  for (const auto& [a, b] : ranges)
    for (int64_t t = a; same && t < b; ++t, ++i) same = i < pos.size() && pos[i] == t;
  if (same && i == pos.size()) return Status::ok();
  return corrupt(where, "positions.h" + std::to_string(head) + " differ from the " + whose +
                            " retention ranges");
}

// A shard head's block_key_min/max/mean are its stored keys' (k: their decoding, [n, hd]), bit
// for bit: the writer computed them with block_key_stats from the same decoded keys.
Status check_block_stats(const std::vector<float>& k, const std::vector<float>& kmin,
                         const std::vector<float>& kmax, const std::vector<float>& kmean,
                         int64_t n, int64_t hd, const std::string& where, const std::string& sfx) {
  // A tier the head keeps no token of has no block: nothing to compare (and memcmp must not see
  // an empty vector's null data).
  if (kmin.empty() && kmax.empty() && kmean.empty()) return Status::ok();
  std::vector<float> st[3];
  for (auto& x : st) x.resize(kmin.size());
  kvstore::block_key_stats(k.data(), n, int(hd), st[0].data(), st[1].data(), st[2].data());
  const std::vector<float>* file[3] = {&kmin, &kmax, &kmean};
  const char* name[3] = {"block_key_min", "block_key_max", "block_key_mean"};
  for (int i = 0; i < 3; ++i)
    if (std::memcmp(st[i].data(), file[i]->data(), st[i].size() * sizeof(float)) != 0) {
      size_t at = 0;
      while (at < st[i].size() && std::memcmp(&st[i][at], &(*file[i])[at], sizeof(float)) == 0)
        ++at;
      return corrupt(where, std::string(name[i]) + sfx + " is not its keys' (block " +
                                std::to_string(int64_t(at) / hd) + ", channel " +
                                std::to_string(int64_t(at) % hd) + ")");
    }
  return Status::ok();
}

// The shard file's own metadata (layer, KV heads, encoding, tier) and tensor names agree with
// its manifest entry. Metadata keys a file lacks are not required: files before they were
// written.
Status check_shard_file(const SafetensorsFile& f, const KvManifest::Shard& S,
                        kvstore::KvEncoding e, bool two_tiers, const std::string& where) {
  const auto& md = f.metadata();
  const auto expect = [&](const char* key, const std::string& want) -> Status {
    const auto it = md.find(key);
    if (it != md.end() && it->second != want)
      return corrupt(where, std::string("the file's metadata says ") + key + " " + it->second +
                                ", its manifest entry " + want);
    return Status::ok();
  };
  SF_TRY(expect("layer", std::to_string(S.layer)));
  SF_TRY(expect("kv_heads", std::to_string(S.kv_head0) + "-" + std::to_string(S.kv_head1)));
  SF_TRY(expect("kv_dtype", kvstore::kv_encoding_name(e)));
  if (two_tiers) SF_TRY(expect("tier", S.low ? "low" : "high"));
  if (!S.tensors.empty()) {
    std::vector<std::string> want = S.tensors, have;
    for (const SafetensorsTensor& t : f.tensors()) have.push_back(t.name);
    std::sort(want.begin(), want.end());
    std::sort(have.begin(), have.end());
    if (want != have)
      return corrupt(where, "its tensors are not the " + std::to_string(want.size()) +
                                " its manifest entry lists (the file has " +
                                std::to_string(have.size()) + ")");
  }
  return Status::ok();
}

}  // namespace

Result<KvManifest> parse_kv_manifest(std::string_view text,
                                     const std::string& expected_compat_hash) {
  json::value root_v;
  {
    json::error_code jec;
    root_v = json::parse(text, jec);
    if (jec) return corrupt("manifest.json", "not valid JSON: " + jec.message());
  }
  if (!root_v.is_object()) return corrupt("manifest.json", "top level is not an object");
  const json::object& man = root_v.as_object();
  const std::string W = "manifest.json";

  SF_ASSIGN(std::string format, get_str(man, "format", W));
  if (format != "sparsefill-kv")
    return corrupt(W, "format '" + format + "' is not 'sparsefill-kv'");
  SF_ASSIGN(int64_t version, get_int(man, "format_version", W));
  if (version < 3 || version > kvstore::kKvFormatVersion)
    return SF_ERR(kUnsupported, "kv export: format_version " + std::to_string(version) +
                                    " is not supported (this reader reads 3 to " +
                                    std::to_string(kvstore::kKvFormatVersion) + ")");
  KvManifest mf;
  KvExport& out = mf.meta;
  SF_ASSIGN(out.compat_hash, get_str(man, "compat_hash", W));
  if (out.compat_hash != expected_compat_hash)
    return SF_ERR(kInvalidArgument, "kv export: compat_hash " + out.compat_hash +
                                        " does not match this model's " + expected_compat_hash +
                                        " (different model, dtype, geometry, rope or block size)");
  SF_ASSIGN(std::string dtype, get_str(man, "dtype", W));
  if (dtype != "F32")
    return SF_ERR(kUnsupported, "kv export: dtype " + dtype + " is not supported (F32)");
  // Version 3 has no kv_dtype: its K/V are F32.
  if (version >= 4) {
    SF_ASSIGN(out.kv_dtype, get_str(man, "kv_dtype", W));
  }
  auto enc_r = kvstore::kv_encoding_parse(out.kv_dtype);
  if (!enc_r.is_ok())
    return SF_ERR(kUnsupported, "kv export: kv_dtype '" + out.kv_dtype +
                                    "' is not supported (f32, bf16, int8, int4)");
  const kvstore::KvEncoding enc = enc_r.value();
  // Formats 5 and 6 may add a low tier in a second, narrower encoding.
  std::optional<kvstore::KvEncoding> enc_low;
  if (man.contains("kv_dtype_low")) {
    if (version < 5) return corrupt(W, "kv_dtype_low needs format_version 5 or later");
    SF_ASSIGN(out.kv_dtype_low, get_str(man, "kv_dtype_low", W));
    auto lo = kvstore::kv_encodings_parse(out.kv_dtype + "+" + out.kv_dtype_low);
    if (!lo.is_ok())
      return SF_ERR(kUnsupported, "kv export: kv_dtype_low '" + out.kv_dtype_low +
                                      "' is not supported: " + lo.status().message());
    enc_low = lo.value().low;
  }
  const int n_tiers = enc_low ? 2 : 1;
  SF_ASSIGN(int64_t bs, get_int(man, "block_size", W));
  if (bs != kvstore::kKvBlockSize)
    return corrupt(W, "block_size " + std::to_string(bs) + " is not 64");
  out.block_size = int(bs);
  SF_ASSIGN(const json::object* model, get_obj(man, "model", W));
  SF_ASSIGN(out.model_name, get_str(*model, "name", "model"));
  SF_ASSIGN(out.arch, get_str(*model, "arch", "model"));
  SF_ASSIGN(int64_t nl, get_int(*model, "n_layers", "model"));
  SF_ASSIGN(int64_t nh, get_int(*model, "n_kv_heads", "model"));
  SF_ASSIGN(int64_t hd, get_int(*model, "head_dim", "model"));
  if (nl <= 0 || nl > 4096 || nh <= 0 || nh > 4096 || hd <= 0 || hd > 4096 || hd % 2)
    return corrupt("model", "n_layers/n_kv_heads/head_dim out of range");
  out.n_layers = int(nl);
  out.n_kv_heads = int(nh);
  out.head_dim = int(hd);
  {
    // The hash must be the one of the manifest's own model fields: one edited after export
    // (a layer count, a head_dim) would otherwise pass the consumer's check with its old hash.
    kvstore::KvExportSpec own;
    own.model_name = out.model_name;
    own.arch = out.arch;
    own.n_layers = out.n_layers;
    own.n_kv_heads = out.n_kv_heads;
    own.head_dim = out.head_dim;
    SF_ASSIGN(double theta, get_num(*model, "rope_theta", "model"));
    own.rope_theta = float(theta);
    if (model->contains("rope_variant")) {
      SF_ASSIGN(own.rope_variant, get_str(*model, "rope_variant", "model"));
    }
    if (kvstore::compat_hash(own) != out.compat_hash)
      return corrupt("model", "its fields (name, arch, geometry, rope) do not hash to compat_hash " +
                                  out.compat_hash + ": the manifest was edited or is corrupt");
  }
  SF_ASSIGN(out.n_tokens, get_int(man, "n_tokens", W));
  if (out.n_tokens <= 0 || out.n_tokens > INT32_MAX) return corrupt(W, "n_tokens out of range");
  SF_ASSIGN(const json::array* ids, get_arr(man, "token_ids", W));
  if (int64_t(ids->size()) != out.n_tokens)
    return corrupt(W, "token_ids length differs from n_tokens");
  for (const auto& t : *ids) {
    if (!t.is_int64() || t.as_int64() < 0 || t.as_int64() > INT32_MAX)
      return corrupt(W, "token_ids holds a value that is not a token id");
    out.token_ids.push_back(int32_t(t.as_int64()));
  }
  SF_ASSIGN(int64_t first, get_int(man, "first_token", W));
  if (first < 0 || first > INT32_MAX) return corrupt(W, "first_token out of range");
  out.first_token = int32_t(first);

  SF_ASSIGN(const json::object* ret, get_obj(man, "retention", W));
  SF_ASSIGN(out.retention_policy, get_str(*ret, "policy", "retention"));
  SF_ASSIGN(out.retention_params, get_str(*ret, "params", "retention"));
  SF_ASSIGN(out.kv_bytes, get_int(*ret, "kv_bytes", "retention"));
  SF_ASSIGN(out.kv_bytes_full, get_int(*ret, "kv_bytes_full", "retention"));
  SF_ASSIGN(const json::array* rlayers, get_arr(*ret, "layers", "retention"));
  if (int64_t(rlayers->size()) != nl)
    return corrupt("retention", "layers has " + std::to_string(rlayers->size()) +
                                    " entries, expected " + std::to_string(nl));
  // Declared retention: counts and [begin, end) runs per head, checked for order and bounds
  // here (never expanded: a small manifest could declare billions of positions).
  mf.kept.resize(size_t(nl * nh));
  mf.ranges.resize(size_t(nl * nh));
  mf.tier_ranges.assign(size_t(n_tiers), std::vector<std::vector<std::pair<int64_t, int64_t>>>(
                                             size_t(nl * nh)));
  int64_t kept_bytes = 0;  // K/V bytes the kept tokens take in the export's encoding
  for (int64_t l = 0; l < nl; ++l) {
    const json::value& rlv = (*rlayers)[size_t(l)];
    if (!rlv.is_object()) return corrupt("retention", "layer entry is not an object");
    SF_ASSIGN(const json::array* rheads, get_arr(rlv.as_object(), "heads", "retention layer"));
    SF_ASSIGN(int64_t rlayer, get_int(rlv.as_object(), "layer", "retention layer"));
    if (rlayer != l || int64_t(rheads->size()) != nh)
      return corrupt("retention", "layer " + std::to_string(l) +
                                      " entry is out of order or has the wrong head count");
    for (int64_t hh = 0; hh < nh; ++hh) {
      const json::value& hv = (*rheads)[size_t(hh)];
      if (!hv.is_object()) return corrupt("retention", "head entry is not an object");
      const std::string lh = "layer " + std::to_string(l) + " head " + std::to_string(hh);
      // {"n": N, "runs": "<base64>"} (format 6, kvstore/position_runs.h) or
      // {"n": N, "ranges": [[begin, end), ...]} (3 to 5): ascending, disjoint, summing to n.
      // A head keeps at least one token; its low tier may be empty.
      auto read_ranges = [&](const json::object& o, const std::string& what,
                             std::vector<std::pair<int64_t, int64_t>>* rr) -> Result<int64_t> {
        SF_ASSIGN(int64_t n, get_int(o, "n", what));
        if (n < (what == "low" ? 0 : 1) || n > out.n_tokens)
          return corrupt("retention", what + " count out of range");
        if (version >= 6) {
          SF_ASSIGN(std::string runs, get_str(o, "runs", what));
          auto dr = kvstore::decode_position_runs(runs, out.n_tokens);
          if (!dr.is_ok())
            return corrupt("retention", what + " runs of " + lh + ": " + dr.status().message());
          *rr = std::move(dr).value();
        } else {
          SF_ASSIGN(const json::array* ranges, get_arr(o, "ranges", what));
          int64_t prev_end = 0;
          for (const auto& rv : *ranges) {
            if (!rv.is_array() || rv.as_array().size() != 2 || !rv.as_array()[0].is_int64() ||
                !rv.as_array()[1].is_int64())
              return corrupt("retention", "a range is not [begin, end)");
            const int64_t a = rv.as_array()[0].as_int64(), b = rv.as_array()[1].as_int64();
            if (a < prev_end || b > out.n_tokens || a >= b)
              return corrupt("retention",
                             what + " ranges of " + lh + " are out of bounds or order");
            rr->emplace_back(a, b);
            prev_end = b;
          }
        }
        int64_t sum = 0;
        for (const auto& [a, b] : *rr) sum += b - a;
        if (sum != n)
          return corrupt("retention", what + " ranges of " + lh + " cover " + std::to_string(sum) +
                                          " positions, n says " + std::to_string(n));
        return n;
      };
      auto& rr = mf.ranges[size_t(l * nh + hh)];
      SF_ASSIGN(int64_t n, read_ranges(hv.as_object(), "kept", &rr));
      mf.kept[size_t(l * nh + hh)] = n;
      if (!enc_low) {
        if (hv.as_object().contains("low"))
          return corrupt("retention", lh + " declares a low tier, but kv_dtype_low is missing");
        mf.tier_ranges[0][size_t(l * nh + hh)] = rr;
        kept_bytes += kvstore::kv_encoded_bytes(enc, n, int(hd));
        continue;
      }
      SF_ASSIGN(const json::object* lo, get_obj(hv.as_object(), "low", "retention head"));
      auto& lr = mf.tier_ranges[1][size_t(l * nh + hh)];
      SF_ASSIGN(int64_t n_low, read_ranges(*lo, "low", &lr));
      // The high tier: kept minus low, where low must lie inside kept and leave it non-empty.
      auto& hr = mf.tier_ranges[0][size_t(l * nh + hh)];
      size_t j = 0;
      int64_t inside = 0;
      for (const auto& [a, b] : rr) {
        int64_t at = a;
        for (; j < lr.size() && lr[j].first < b; ++j) {
          if (lr[j].first < at || lr[j].second > b)
            return corrupt("retention", "low ranges of " + lh + " are not inside its kept ranges");
          if (lr[j].first > at) hr.emplace_back(at, lr[j].first);
          inside += lr[j].second - lr[j].first;
          at = lr[j].second;
        }
        if (at < b) hr.emplace_back(at, b);
      }
      if (inside != n_low)
        return corrupt("retention", "low ranges of " + lh + " are not inside its kept ranges");
      if (n_low >= n) return corrupt("retention", "the high tier of " + lh + " keeps no token");
      kept_bytes += kvstore::kv_encoded_bytes(enc, n - n_low, int(hd)) +
                    kvstore::kv_encoded_bytes(*enc_low, n_low, int(hd));
    }
  }
  if (out.kv_bytes != kept_bytes)
    return corrupt("retention",
                   "kv_bytes " + std::to_string(out.kv_bytes) + " does not match the kept tokens");
  {
    // The other totals the writer records (kept_tokens since format 2): a consumer's accounting
    // reads them, so they must be the retention's. (Products of checked bounds: nl, nh < 4096,
    // n_tokens < 2^31, head_dim < 4096, so no overflow.)
    int64_t kept_total = 0;
    for (const int64_t k : mf.kept) kept_total += k;
    if (ret->contains("kept_tokens")) {
      SF_ASSIGN(int64_t kt, get_int(*ret, "kept_tokens", "retention"));
      if (kt != kept_total)
        return corrupt("retention", "kept_tokens " + std::to_string(kt) + " is not the heads' " +
                                        std::to_string(kept_total));
    }
    const int64_t full_bytes = nl * nh * kvstore::kv_encoded_bytes(enc, out.n_tokens, int(hd));
    if (out.kv_bytes_full != full_bytes)
      return corrupt("retention", "kv_bytes_full " + std::to_string(out.kv_bytes_full) +
                                      " is not the full cache's " + std::to_string(full_bytes));
  }
  if (man.contains("importance")) {
    const json::value& iv = man.at("importance");
    if (iv.is_null()) {
      mf.importance = KvManifest::Importance::kNull;
    } else {
      if (!iv.is_object()) return corrupt(W, "importance is neither null nor an object");
      SF_ASSIGN(int64_t window, get_int(iv.as_object(), "window", "importance"));
      SF_ASSIGN(int64_t pool, get_int(iv.as_object(), "pool", "importance"));
      if (window < 1 || pool < 1)
        return corrupt("importance", "window and pool must be at least 1");
      mf.importance = KvManifest::Importance::kPresent;
    }
  }

  SF_ASSIGN(const json::array* shards, get_arr(man, "shards", W));
  // Shard entries: each holds token runs of a KV head range of one layer. Their run x head
  // pairs are expanded below, so a manifest cannot declare more of them than it could back.
  constexpr int64_t kMaxRunHeads = int64_t(1) << 24;
  struct Run {
    int64_t begin, end;
    int shard;
    int64_t row;  // first row of the run among the shard's rows of this head
  };
  std::vector<std::vector<std::vector<Run>>> runs(
      size_t(n_tiers), std::vector<std::vector<Run>>(static_cast<size_t>(nl * nh)));
  mf.pieces.assign(size_t(n_tiers), std::vector<std::vector<KvManifest::Piece>>(size_t(nl * nh)));
  int64_t run_heads = 0;
  for (const auto& sv : *shards) {
    if (!sv.is_object()) return corrupt(W, "a shard entry is not an object");
    const json::object& sh = sv.as_object();
    SF_ASSIGN(std::string file, get_str(sh, "file", "shard"));
    const std::string where = "shard '" + file + "'";
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      return corrupt(where, "file is not a plain file name");
    KvManifest::Shard S;
    S.file = file;
    SF_ASSIGN(int64_t layer, get_int(sh, "layer", where));
    if (layer < 0 || layer >= nl)
      return corrupt(where, "layer " + std::to_string(layer) + " out of range");
    S.layer = int(layer);
    SF_ASSIGN(S.bytes, get_int(sh, "bytes", where));
    SF_ASSIGN(S.xxh64, get_str(sh, "xxh64", where));
    if (sh.contains("tensors")) {
      SF_ASSIGN(const json::array* tl, get_arr(sh, "tensors", where));
      for (const auto& tv : *tl) {
        if (!tv.is_string()) return corrupt(where, "tensors holds a name that is not a string");
        S.tensors.emplace_back(tv.as_string());
      }
    }
    SF_ASSIGN(std::string layout, get_str(sh, "layout", where));
    S.uniform = layout == "uniform";
    if (!S.uniform && layout != "per_head")
      return corrupt(where, "layout '" + layout + "' is not uniform or per_head");
    SF_ASSIGN(const json::array* kh, get_arr(sh, "kv_heads", where));
    if (kh->size() != 2 || !(*kh)[0].is_int64() || !(*kh)[1].is_int64())
      return corrupt(where, "kv_heads is not [first, end)");
    const int64_t h0 = (*kh)[0].as_int64(), h1 = (*kh)[1].as_int64();
    if (h0 < 0 || h1 > nh || h0 >= h1) return corrupt(where, "kv_heads out of range");
    S.kv_head0 = int(h0);
    S.kv_head1 = int(h1);
    // Every shard of a two-tier export names its tier; a one-tier export's name none.
    if (sh.contains("tier") != enc_low.has_value())
      return corrupt(where, enc_low ? "names no tier in a two-tier export"
                                    : "names a tier, but kv_dtype_low is missing");
    if (enc_low) {
      SF_ASSIGN(std::string tier, get_str(sh, "tier", where));
      if (tier != "high" && tier != "low") return corrupt(where, "tier '" + tier + "' is not high or low");
      S.low = tier == "low";
    }
    const int t = S.low ? 1 : 0;
    SF_ASSIGN(const json::array* toks, get_arr(sh, "tokens", where));
    int64_t prev = 0;
    for (const auto& rv : *toks) {
      if (!rv.is_array() || rv.as_array().size() != 2 || !rv.as_array()[0].is_int64() ||
          !rv.as_array()[1].is_int64())
        return corrupt(where, "a token run is not [begin, end)");
      const int64_t a = rv.as_array()[0].as_int64(), b = rv.as_array()[1].as_int64();
      if (a < prev || a >= b || b > out.n_tokens)
        return corrupt(where, "token runs are out of bounds or order");
      S.tokens.emplace_back(a, b);
      prev = b;
    }
    if (S.tokens.empty()) return corrupt(where, "holds no tokens");
    run_heads += int64_t(S.tokens.size()) * (h1 - h0);
    if (run_heads > kMaxRunHeads) return corrupt(W, "too many shard runs");
    const int si = int(mf.shards.size());
    for (int64_t hh = h0; hh < h1; ++hh) {
      // The head's kept tokens in each run of the shard: declared ranges intersected with it.
      const auto& rr = mf.tier_ranges[size_t(t)][size_t(layer * nh + hh)];
      int64_t row = 0;
      // The first declared range the shard can touch, by bisection: a walk from the head's first
      // range for each shard would cost shards x ranges (200,000 of each in a 25 MB manifest).
      size_t j = size_t(std::partition_point(rr.begin(), rr.end(),
                                             [&](const auto& x) {
                                               return x.second <= S.tokens.front().first;
                                             }) -
                        rr.begin());
      for (const auto& [a, b] : S.tokens) {
        while (j < rr.size() && rr[j].second <= a) ++j;
        int64_t k = 0;
        for (size_t i = j; i < rr.size() && rr[i].first < b; ++i)
          k += std::min(b, rr[i].second) - std::max(a, rr[i].first);
        runs[size_t(t)][size_t(layer * nh + hh)].push_back({a, b, si, row});
        mf.pieces[size_t(t)][size_t(layer * nh + hh)].push_back({si, k, row});
        row += k;
      }
      S.kept.push_back(row);
    }
    if (S.uniform)
      for (size_t i = 1; i < S.kept.size(); ++i)
        if (S.kept[i] != S.kept[0])
          return corrupt(where, "uniform layout with different kept counts per head");
    mf.shards.push_back(std::move(S));
  }
  // Per (layer, head): the runs tile [0, n_tokens), and every run before the one holding the
  // head's last kept token keeps whole blocks of 64 (blocks are counted within a shard).
  for (int t = 0; t < n_tiers; ++t)
    for (int64_t l = 0; l < nl; ++l)
      for (int64_t hh = 0; hh < nh; ++hh) {
        auto& rs = runs[size_t(t)][size_t(l * nh + hh)];
        auto& ps = mf.pieces[size_t(t)][size_t(l * nh + hh)];
        std::vector<size_t> order(rs.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::sort(order.begin(), order.end(),
                  [&](size_t x, size_t y) { return rs[x].begin < rs[y].begin; });
        const std::string where = "layer " + std::to_string(l) + " KV head " + std::to_string(hh) +
                                  (t ? " low tier shards" : " shards");
        int64_t next = 0;
        std::vector<KvManifest::Piece> sorted;
        for (size_t i : order) {
          if (rs[i].begin != next)
            return corrupt(where, std::string(rs[i].begin < next ? "overlap" : "leave a gap") +
                                      " at token " + std::to_string(std::min(rs[i].begin, next)));
          next = rs[i].end;
          sorted.push_back(ps[i]);
        }
        if (next != out.n_tokens)
          return corrupt(where, "cover tokens up to " + std::to_string(next) + " of " +
                                    std::to_string(out.n_tokens));
        int64_t last = -1;
        for (size_t i = 0; i < sorted.size(); ++i)
          if (sorted[i].kept > 0) last = int64_t(i);
        for (int64_t i = 0; i < last; ++i)
          if (sorted[size_t(i)].kept % bs != 0)
            return corrupt(where, "split a block of 64 kept tokens between runs");
        ps = std::move(sorted);
      }
  return mf;
}

Result<KvExport> load_kv_export(const std::string& dir, const std::string& expected_compat_hash,
                                int layers_in_flight) {
  const fs::path root(dir);
  const fs::path mpath = root / "manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(mpath, ec))
    return SF_ERR(kNotFound, "kv export: no manifest.json in '" + dir + "'");
  const uint64_t msize = fs::file_size(mpath, ec);
  if (ec)  // (an unreadable size is an I/O problem, not a corrupt export)
    return SF_ERR(kIo, "kv export: cannot read the size of '" + mpath.string() + "': " + ec.message());
  if (msize > kMaxManifestBytes)
    return corrupt("manifest.json", "size " + std::to_string(msize) + " above the 1 GiB limit");
  std::string text;
  {
    std::ifstream f(mpath, std::ios::binary);
    std::ostringstream ss;
    ss << f.rdbuf();
    if (!f) return SF_ERR(kIo, "kv export: cannot read '" + mpath.string() + "'");
    text = ss.str();
  }
  SF_ASSIGN(KvManifest mf, parse_kv_manifest(text, expected_compat_hash));
  KvExport out = std::move(mf.meta);
  const kvstore::KvEncoding enc = kvstore::kv_encoding_parse(out.kv_dtype).value();  // parsed
  const int n_tiers = out.kv_dtype_low.empty() ? 1 : 2;
  const kvstore::KvEncoding enc_low =
      n_tiers == 2 ? kvstore::kv_encoding_parse(out.kv_dtype_low).value() : enc;
  const int64_t nl = out.n_layers, nh = out.n_kv_heads, hd = out.head_dim, bs = out.block_size;
  out.heads.resize(size_t(nl * nh));
  // One shard's tensors of one head, as read.
  struct HeadData {
    std::vector<int32_t> positions;
    std::vector<float> k, v, kmin, kmax, kmean, imp;
    kvstore::EncodedRows kq, vq;  // int8 exports
  };
  // Layers are read on several threads at once (their checksums, reads and decoding overlap);
  // each writes only its own heads of `out`.
  const auto one_layer = [&](int64_t layer) -> Status {
    std::error_code fec;  // this layer's own
    // Every shard of the layer: verified, then its heads read.
    std::vector<std::vector<HeadData>> data(mf.shards.size());
    for (size_t si = 0; si < mf.shards.size(); ++si) {
      const KvManifest::Shard& S = mf.shards[si];
      if (S.layer != layer) continue;
      const std::string where = "shard '" + S.file + "'";
      const fs::path p = root / S.file;
      if (!fs::is_regular_file(p, fec))
        // (absent: missing; anything else, EACCES say, is an I/O problem, not a missing file)
        return fec && fec != std::errc::no_such_file_or_directory &&
                       fec != std::errc::not_a_directory
                   ? SF_ERR(kIo, "kv export: cannot stat shard file '" + p.string() + "': " +
                                     fec.message())
                   : SF_ERR(kNotFound, "kv export: shard file '" + p.string() + "' is missing");
      const uint64_t fsz = fs::file_size(p, fec);
      if (fec)
        return SF_ERR(kIo, "kv export: cannot read the size of shard file '" + p.string() +
                               "': " + fec.message());
      if (int64_t(fsz) != S.bytes)
        return corrupt(where, "file has " + std::to_string(fsz) + " bytes, the manifest says " +
                                  std::to_string(S.bytes));
      // Mapped once: the checksum and then the tensors read the same pages.
      SF_ASSIGN(MappedFile mapped, MappedFile::open(p.string(), /*populate=*/true));
      const ByteSpan bytes = mapped.bytes();
      if (int64_t(bytes.size) != S.bytes)  // changed since the size check above
        return corrupt(where, "file has " + std::to_string(bytes.size) +
                                  " bytes, the manifest says " + std::to_string(S.bytes));
      const uint64_t h = xxh64_bytes(bytes.data, bytes.size);
      if (hex64(h) != S.xxh64)
        return corrupt(where,
                       "xxh64 checksum mismatch: file " + hex64(h) + ", manifest " + S.xxh64);
      SF_ASSIGN(SafetensorsFile f, SafetensorsFile::open(std::move(mapped)));
      const kvstore::KvEncoding e = S.low ? enc_low : enc;
      // The file must be the one its entry describes: tensor names carry no layer, so a file
      // listed under another layer's entry (a leader's mislabelled part) would load silently.
      SF_TRY(check_shard_file(f, S, e, n_tiers == 2, where));
      const int64_t hs = S.kv_head1 - S.kv_head0;
      data[si].resize(size_t(hs));
      for (int64_t j = 0; j < hs; ++j) {
        HeadData& H = data[si][size_t(j)];
        const int64_t n = S.kept[size_t(j)], nb = (n + bs - 1) / bs;
        const std::string sfx = ".h" + std::to_string(S.kv_head0 + j);
        // Uniform: head j of the shared key/value tensors; per head: its own key.hH/value.hH.
        const std::string kv_sfx = S.uniform ? "" : sfx;
        const int64_t heads = S.uniform ? hs : 1, jj = S.uniform ? j : 0;
        SF_TRY(read_kv(f, e, true, kv_sfx, heads, jj, n, hd, where, &H.k, &H.kq));
        SF_TRY(read_kv(f, e, false, kv_sfx, heads, jj, n, hd, where, &H.v, &H.vq));
        SF_TRY(read_tensor<int32_t>(f, "positions" + sfx, "I32", {n}, where, &H.positions));
        SF_TRY(read_tensor<float>(f, "block_key_min" + sfx, "F32", {nb, hd}, where, &H.kmin));
        SF_TRY(read_tensor<float>(f, "block_key_max" + sfx, "F32", {nb, hd}, where, &H.kmax));
        SF_TRY(read_tensor<float>(f, "block_key_mean" + sfx, "F32", {nb, hd}, where, &H.kmean));
        // (A head keeping no token of a tier has no block, and so no importance tensor.)
        const bool has_imp = f.find("block_importance" + sfx) != nullptr;
        if (mf.importance != KvManifest::Importance::kAbsent &&
            has_imp != (mf.importance == KvManifest::Importance::kPresent && nb > 0))
          return corrupt(where, has_imp ? "carries block_importance" + sfx +
                                              ", but the manifest's importance is null"
                                        : "has no block_importance" + sfx +
                                              ", but the manifest names an importance");
        if (has_imp)
          SF_TRY(read_tensor<float>(f, "block_importance" + sfx, "F32", {nb}, where, &H.imp));
        // PSA's bound (decode/decode_attention.h) trusts the block statistics: they must be
        // those of the keys as stored, which the writer computed with the same function.
        SF_TRY(check_block_stats(H.k, H.kmin, H.kmax, H.kmean, n, hd, where, sfx));
      }
    }
    // Each head's pieces in position order: rows and (whole-block aligned) blocks appended.
    for (int64_t hh = 0; hh < nh; ++hh) {
      HeadKv tiers[2];
      for (int t = 0; t < n_tiers; ++t) {
        HeadKv& H = tiers[t];
        bool imp = true;
        const auto& pieces = mf.pieces[size_t(t)][size_t(layer * nh + hh)];
        for (const KvManifest::Piece& pc : pieces) {
          // A run where the head keeps nothing adds no row and no block (its row may fall inside
          // the shard's last, partial block, which the run before it appended already).
          if (pc.kept == 0) continue;
          const KvManifest::Shard& S = mf.shards[size_t(pc.shard)];
          HeadData& D = data[size_t(pc.shard)][size_t(hh - S.kv_head0)];
          const int64_t r0 = pc.row, r1 = pc.row + pc.kept, b0 = r0 / bs, b1 = (r1 + bs - 1) / bs;
          if (pieces.size() == 1 && r0 == 0 && r1 == int64_t(D.positions.size())) {
            // The head is this one piece (a one-shard layer, or a shard holding one run): its
            // data is taken as read, not copied again (a shard's head belongs to one piece list).
            H.positions = std::move(D.positions);
            H.k = std::move(D.k);
            H.v = std::move(D.v);
            H.kq = std::move(D.kq);
            H.vq = std::move(D.vq);
            H.block_kmin = std::move(D.kmin);
            H.block_kmax = std::move(D.kmax);
            H.block_kmean = std::move(D.kmean);
            imp = !D.imp.empty();
            H.block_importance = std::move(D.imp);
            continue;
          }
          H.positions.insert(H.positions.end(), D.positions.begin() + r0, D.positions.begin() + r1);
          H.k.insert(H.k.end(), D.k.begin() + r0 * hd, D.k.begin() + r1 * hd);
          H.v.insert(H.v.end(), D.v.begin() + r0 * hd, D.v.begin() + r1 * hd);
          if ((t ? enc_low : enc) == kvstore::KvEncoding::kInt8) {
            append_codes(D.kq, true, r0, r1, hd, bs, &H.kq);
            append_codes(D.vq, false, r0, r1, hd, bs, &H.vq);
          }
          H.block_kmin.insert(H.block_kmin.end(), D.kmin.begin() + b0 * hd, D.kmin.begin() + b1 * hd);
          H.block_kmax.insert(H.block_kmax.end(), D.kmax.begin() + b0 * hd, D.kmax.begin() + b1 * hd);
          H.block_kmean.insert(H.block_kmean.end(), D.kmean.begin() + b0 * hd,
                               D.kmean.begin() + b1 * hd);
          if (D.imp.empty()) {
            imp = false;
          } else {
            H.block_importance.insert(H.block_importance.end(), D.imp.begin() + b0,
                                      D.imp.begin() + b1);
          }
        }
        if (!imp) H.block_importance.clear();  // importance only when every shard carried it
        if (n_tiers == 2) H.kq = H.vq = kvstore::EncodedRows{};  // tiers differ in encoding
        // The positions must be exactly the manifest's declared retention, each tier its own
        // runs (checked before the merge, which would hide tokens moved between the tiers; the
        // tiers' runs partition the kept ones, so the merged list needs no check of its own).
        SF_TRY(check_positions(
            H.positions, mf.tier_ranges[size_t(t)][size_t(layer * nh + hh)],
            "layer " + std::to_string(layer) +
                (n_tiers == 1 ? " shards" : t ? " low tier shards" : " high tier shards"),
            hh, n_tiers == 1 ? "manifest's" : t ? "low tier's" : "high tier's"));
      }
      HeadKv& H = out.heads[size_t(layer * nh + hh)];
      H = n_tiers == 2 ? merge_tiers(tiers[0], tiers[1], hd) : std::move(tiers[0]);
    }
    return Status::ok();
  };
  SF_TRY(run_items(size_t(nl),
                   layers_in_flight > 0 ? layers_in_flight : kvstore::default_layers_in_flight(),
                   [&](size_t l) { return one_layer(int64_t(l)); }));
  return out;
}

}  // namespace sf::decode
