#include "kvstore/kv_export.h"

#include <unistd.h>

#include <boost/json.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "common/checksum.h"
#include "common/safetensors.h"

namespace sf::kvstore {
namespace fs = std::filesystem;
namespace {

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// [S, Hkv, d] token-major -> [Hkv, S, d] head-major, undoing adjacent-pair interleave if asked.
void to_hf_layout(const float* src, int64_t S, int hkv, int d, bool deinterleave, float* dst) {
  for (int64_t t = 0; t < S; ++t)
    for (int h = 0; h < hkv; ++h) {
      const float* r = src + (t * hkv + h) * d;
      float* o = dst + (int64_t(h) * S + t) * d;
      if (deinterleave) {
        for (int i = 0; i < d / 2; ++i) {
          o[i] = r[2 * i];
          o[i + d / 2] = r[2 * i + 1];
        }
      } else {
        std::copy(r, r + d, o);
      }
    }
}

}  // namespace

std::string compat_hash(const KvExportSpec& s) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "sparsefill-kv/%d;model=%s;arch=%s;dtype=F32;layers=%d;kv_heads=%d;head_dim=%d;"
                "rope_theta=%.6g;rope=rotate_half;block=%d",
                kKvFormatVersion, s.model_name.c_str(), s.arch.c_str(), s.n_layers, s.n_kv_heads, s.head_dim,
                double(s.rope_theta), kKvBlockSize);
  const std::string str(buf);
  return hex64(xxh64_bytes(str.data(), str.size()));
}

Status export_kv(const std::string& dir, const KvExportSpec& spec, const LayerSource& src, bool force) {
  if (spec.n_layers <= 0 || spec.n_kv_heads <= 0 || spec.head_dim <= 0 || spec.n_tokens <= 0)
    return SF_ERR(kInvalidArgument, "export_kv: empty geometry");
  if (int64_t(spec.token_ids.size()) != spec.n_tokens)
    return SF_ERR(kInvalidArgument, "export_kv: token_ids size does not match n_tokens");
  std::error_code ec;
  const fs::path out(dir);
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec)) return SF_ERR(kAlreadyExists, "export dir '" + dir + "' exists and is not a directory");
    if (!fs::is_empty(out, ec) && !force)
      return SF_ERR(kAlreadyExists, "export dir '" + dir + "' exists and is not empty (use --force to replace it)");
  }
  const fs::path tmp = out.parent_path() / (out.filename().string() + ".partial-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec)
    return SF_ERR(kIo, "cannot create '" + tmp.string() + "': " + ec.message());
  auto fail = [&](Status st) {
    std::error_code e2;
    fs::remove_all(tmp, e2);
    return st;
  };

  const int64_t S = spec.n_tokens;
  const int hkv = spec.n_kv_heads, d = spec.head_dim;
  const size_t n = size_t(S) * size_t(hkv) * size_t(d);
  std::vector<float> kbuf(n), vbuf(n);
  boost::json::array shards;
  for (int l = 0; l < spec.n_layers; ++l) {
    const float* k = src(l, false);
    const float* v = src(l, true);
    if (!k || !v) return fail(SF_ERR(kInvalidArgument, "export_kv: layer " + std::to_string(l) + " has no KV"));
    to_hf_layout(k, S, hkv, d, spec.keys_interleaved, kbuf.data());
    to_hf_layout(v, S, hkv, d, false, vbuf.data());
    SafetensorsWriter w;
    w.add("key", DType::kF32, {1, hkv, S, d}, kbuf.data(), n * 4);
    w.add("value", DType::kF32, {1, hkv, S, d}, vbuf.data(), n * 4);
    w.set_metadata("layer", std::to_string(l));
    w.set_metadata("layout", "[batch, kv_heads, tokens, head_dim]; keys post-RoPE, rotate-half");
    char name[32];
    std::snprintf(name, sizeof name, "layer_%03d.safetensors", l);
    const fs::path p = tmp / name;
    auto r = w.write(p.string());
    if (!r.is_ok()) return fail(r.status());
    boost::json::object sh;
    sh["file"] = name;
    sh["layer"] = l;
    sh["tensors"] = boost::json::array{"key", "value"};
    sh["bytes"] = uint64_t(fs::file_size(p, ec));
    sh["xxh64"] = hex64(r.value());
    shards.push_back(std::move(sh));
  }

  boost::json::object model;
  model["name"] = spec.model_name;
  model["arch"] = spec.arch;
  model["n_layers"] = spec.n_layers;
  model["n_kv_heads"] = spec.n_kv_heads;
  model["head_dim"] = spec.head_dim;
  model["rope_theta"] = double(spec.rope_theta);
  boost::json::object man;
  man["format"] = "sparsefill-kv";
  man["format_version"] = kKvFormatVersion;
  man["model"] = std::move(model);
  man["compat_hash"] = compat_hash(spec);
  man["dtype"] = "F32";
  man["layout"] = "key/value: [1, n_kv_heads, n_tokens, head_dim]; keys after RoPE in rotate-half order";
  man["block_size"] = kKvBlockSize;
  man["n_tokens"] = S;
  boost::json::array ids;
  for (int32_t t : spec.token_ids) ids.push_back(t);
  man["token_ids"] = std::move(ids);
  man["first_token"] = spec.first_token;
  boost::json::object ret;
  ret["policy"] = "full";
  man["retention"] = std::move(ret);
  man["checksum"] = "xxh64 of each whole shard file, seed 0";
  man["shards"] = std::move(shards);
  {
    std::ofstream f(tmp / "manifest.json");
    f << boost::json::serialize(man) << "\n";
    if (!f) return fail(SF_ERR(kIo, "cannot write manifest.json in '" + tmp.string() + "'"));
  }
  if (fs::exists(out, ec)) fs::remove_all(out, ec);
  if (ec) return fail(SF_ERR(kIo, "cannot replace '" + dir + "': " + ec.message()));
  fs::rename(tmp, out, ec);
  if (ec) return fail(SF_ERR(kIo, "cannot move export into '" + dir + "': " + ec.message()));
  return Status::ok();
}

}  // namespace sf::kvstore
