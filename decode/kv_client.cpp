#include "decode/kv_client.h"

#include <boost/json.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/checksum.h"
#include "common/safetensors.h"
#include "kvstore/kv_export.h"

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

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// Copies an F32/I32 tensor of the exact shape; the data section is not aligned in general.
template <typename T>
Status read_tensor(const SafetensorsFile& f, const std::string& name, const char* dtype,
                   const std::vector<int64_t>& shape, const std::string& where,
                   std::vector<T>* out) {
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
  out->resize(t->n_bytes() / sizeof(T));
  if (!out->empty()) std::memcpy(out->data(), t->data, out->size() * sizeof(T));
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
  if (version != kvstore::kKvFormatVersion)
    return SF_ERR(kUnsupported, "kv export: format_version " + std::to_string(version) +
                                    " is not supported (this reader reads " +
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
  int64_t kept_total = 0;
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
      SF_ASSIGN(int64_t n, get_int(hv.as_object(), "n", "retention head"));
      if (n <= 0 || n > out.n_tokens) return corrupt("retention", "kept count out of range");
      SF_ASSIGN(const json::array* ranges, get_arr(hv.as_object(), "ranges", "retention head"));
      auto& rr = mf.ranges[size_t(l * nh + hh)];
      int64_t sum = 0, prev_end = 0;
      for (const auto& rv : *ranges) {
        if (!rv.is_array() || rv.as_array().size() != 2 || !rv.as_array()[0].is_int64() ||
            !rv.as_array()[1].is_int64())
          return corrupt("retention", "a range is not [begin, end)");
        const int64_t a = rv.as_array()[0].as_int64(), b = rv.as_array()[1].as_int64();
        if (a < prev_end || b > out.n_tokens || a >= b)
          return corrupt("retention", "ranges of layer " + std::to_string(l) + " head " +
                                          std::to_string(hh) + " are out of bounds or order");
        rr.emplace_back(a, b);
        sum += b - a;
        prev_end = b;
      }
      if (sum != n)
        return corrupt("retention", "ranges of layer " + std::to_string(l) + " head " +
                                        std::to_string(hh) + " cover " + std::to_string(sum) +
                                        " positions, n says " + std::to_string(n));
      mf.kept[size_t(l * nh + hh)] = n;
      kept_total += n;
    }
  }
  if (out.kv_bytes != kept_total * hd * 2 * 4)
    return corrupt("retention",
                   "kv_bytes " + std::to_string(out.kv_bytes) + " does not match the kept tokens");

  SF_ASSIGN(const json::array* shards, get_arr(man, "shards", W));
  if (int64_t(shards->size()) != nl)
    return corrupt(W, "shards has " + std::to_string(shards->size()) + " entries, expected " +
                          std::to_string(nl));
  mf.shards.resize(size_t(nl));
  std::vector<bool> seen(static_cast<size_t>(nl), false);
  for (const auto& sv : *shards) {
    if (!sv.is_object()) return corrupt(W, "a shard entry is not an object");
    const json::object& sh = sv.as_object();
    SF_ASSIGN(std::string file, get_str(sh, "file", "shard"));
    const std::string where = "shard '" + file + "'";
    SF_ASSIGN(int64_t layer, get_int(sh, "layer", where));
    if (layer < 0 || layer >= nl || seen[size_t(layer)])
      return corrupt(where, "layer " + std::to_string(layer) + " out of range or repeated");
    seen[size_t(layer)] = true;
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      return corrupt(where, "file is not a plain file name");
    KvManifest::Shard& S = mf.shards[size_t(layer)];
    S.file = file;
    SF_ASSIGN(S.bytes, get_int(sh, "bytes", where));
    SF_ASSIGN(S.xxh64, get_str(sh, "xxh64", where));
    SF_ASSIGN(std::string layout, get_str(sh, "layout", where));
    S.uniform = layout == "uniform";
    if (!S.uniform && layout != "per_head")
      return corrupt(where, "layout '" + layout + "' is not uniform or per_head");
    if (S.uniform)
      for (int64_t hh = 1; hh < nh; ++hh)
        if (mf.kept[size_t(layer * nh + hh)] != mf.kept[size_t(layer * nh)])
          return corrupt(where, "uniform layout with different kept counts per head");
  }
  return mf;
}

Result<KvExport> load_kv_export(const std::string& dir, const std::string& expected_compat_hash) {
  const fs::path root(dir);
  const fs::path mpath = root / "manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(mpath, ec))
    return SF_ERR(kNotFound, "kv export: no manifest.json in '" + dir + "'");
  const uint64_t msize = fs::file_size(mpath, ec);
  if (ec || msize > kMaxManifestBytes)
    return corrupt("manifest.json",
                   "size " + std::to_string(msize) + " unreadable or above the 1 GiB limit");
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
  const int64_t nl = out.n_layers, nh = out.n_kv_heads, hd = out.head_dim, bs = out.block_size;
  out.heads.resize(size_t(nl * nh));
  for (int64_t layer = 0; layer < nl; ++layer) {
    const KvManifest::Shard& S = mf.shards[size_t(layer)];
    const std::string where = "shard '" + S.file + "'";
    const fs::path p = root / S.file;
    if (!fs::is_regular_file(p, ec))
      return SF_ERR(kNotFound, "kv export: shard file '" + p.string() + "' is missing");
    const uint64_t fsz = fs::file_size(p, ec);
    if (ec || int64_t(fsz) != S.bytes)
      return corrupt(where, "file has " + std::to_string(fsz) + " bytes, the manifest says " +
                                std::to_string(S.bytes));
    SF_ASSIGN(uint64_t h, xxh64_file(p.string()));
    if (hex64(h) != S.xxh64)
      return corrupt(where, "xxh64 checksum mismatch: file " + hex64(h) + ", manifest " + S.xxh64);
    SF_ASSIGN(SafetensorsFile f, SafetensorsFile::open(p.string()));
    std::vector<float> kall, vall;
    if (S.uniform) {
      const int64_t n0 = mf.kept[size_t(layer * nh)];
      SF_TRY(read_tensor<float>(f, "key", "F32", {1, nh, n0, hd}, where, &kall));
      SF_TRY(read_tensor<float>(f, "value", "F32", {1, nh, n0, hd}, where, &vall));
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      HeadKv& H = out.heads[size_t(layer * nh + hh)];
      const int64_t n = mf.kept[size_t(layer * nh + hh)], nb = (n + bs - 1) / bs;
      const std::string sfx = ".h" + std::to_string(hh);
      if (S.uniform) {
        H.k.assign(kall.begin() + hh * n * hd, kall.begin() + (hh + 1) * n * hd);
        H.v.assign(vall.begin() + hh * n * hd, vall.begin() + (hh + 1) * n * hd);
      } else {
        SF_TRY(read_tensor<float>(f, "key" + sfx, "F32", {1, 1, n, hd}, where, &H.k));
        SF_TRY(read_tensor<float>(f, "value" + sfx, "F32", {1, 1, n, hd}, where, &H.v));
      }
      SF_TRY(read_tensor<int32_t>(f, "positions" + sfx, "I32", {n}, where, &H.positions));
      SF_TRY(read_tensor<float>(f, "block_key_min" + sfx, "F32", {nb, hd}, where, &H.block_kmin));
      SF_TRY(read_tensor<float>(f, "block_key_max" + sfx, "F32", {nb, hd}, where, &H.block_kmax));
      SF_TRY(read_tensor<float>(f, "block_key_mean" + sfx, "F32", {nb, hd}, where, &H.block_kmean));
      if (f.find("block_importance" + sfx))
        SF_TRY(read_tensor<float>(f, "block_importance" + sfx, "F32", {nb}, where,
                                  &H.block_importance));
      // The shard's positions must be exactly the manifest's declared retention (same count,
      // checked by the tensor shape, so this walk is bounded by the shard).
      size_t i = 0;
      for (const auto& [a, b] : mf.ranges[size_t(layer * nh + hh)])
        for (int64_t t = a; t < b; ++t, ++i)
          if (i >= H.positions.size() || H.positions[i] != t)
            return corrupt(where,
                           "positions" + sfx + " differ from the manifest's retention ranges");
    }
  }
  return out;
}

}  // namespace sf::decode
