#include "kvstore/kv_export.h"

#include <unistd.h>

#include <boost/json.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "common/checksum.h"
#include "common/dtype.h"
#include "common/file_io.h"
#include "common/free_list.h"
#include "common/safetensors.h"
#include "common/thread_pool.h"
#include "kvstore/position_runs.h"

namespace sf::kvstore {
namespace fs = std::filesystem;
namespace {

// Rows rows[0..n) of head h of a token-major [rows, Hkv, d] layer into dst [n, d], undoing the
// adjacent-pair interleave if asked (GGUF llama keys -> HF rotate-half order).
template <typename T>
void gather_head_as(const T* src, int hkv, int d, int h, const int64_t* rows, int64_t n,
                    bool deinterleave, float* dst) {
  const auto f32 = [](T x) {
    if constexpr (std::is_same_v<T, float>)
      return x;
    else
      return bf16_to_f32(x);
  };
  for (int64_t i = 0; i < n; ++i) {
    const T* r = src + (rows[i] * hkv + h) * d;
    float* o = dst + i * d;
    if (deinterleave) {
      for (int c = 0; c < d / 2; ++c) {
        o[c] = f32(r[2 * c]);
        o[c + d / 2] = f32(r[2 * c + 1]);
      }
    } else if constexpr (std::is_same_v<T, float>) {
      std::copy(r, r + d, o);
    } else {
      for (int c = 0; c < d; ++c) o[c] = f32(r[c]);
    }
  }
}

// F32 rows, or BF16 ones widened.
void gather_head(const LayerRows& src, int hkv, int d, int h, const int64_t* rows, int64_t n,
                 bool deinterleave, float* dst) {
  if (src.dtype == DType::kBF16)
    gather_head_as(static_cast<const uint16_t*>(src.data), hkv, d, h, rows, n, deinterleave, dst);
  else
    gather_head_as(static_cast<const float*>(src.data), hkv, d, h, rows, n, deinterleave, dst);
}

// Per-block metadata of one head: blocks are runs of kKvBlockSize kept tokens in position order.
struct HeadMeta {
  std::vector<float> kmin, kmax, kmean, importance;  // [n_blocks, d] x3, [n_blocks]
};

// Storage of uninitialized bytes: every byte of an export's K/V buffers is written before it is
// read, so the zero fill a vector would do is a wasted pass over hundreds of megabytes.
struct RawBytes {
  std::unique_ptr<uint8_t[]> p;
  size_t n = 0;
  RawBytes() = default;
  explicit RawBytes(size_t bytes) : p(new uint8_t[bytes]), n(bytes) {}
  uint8_t* data() { return p.get(); }
};

// A shard's K and V bytes, reused by the shards one export call writes in turn (a FreeList):
// each is up to a few hundred MB, and a fresh allocation is page-faulted in again for every
// layer (an F32 export on the build box: 2.5 s -> 2.0 s with reuse, bench/NOTES.md forty-eighth
// session). At most one set per shard in flight; all go when the call returns.
struct ShardBuffers {
  RawBytes kv[2];  // keys, values
};

// Half-open [a, b) runs of a sorted position list: compact for windows and sinks.
Status check_retention(const KvExportSpec& spec, const Retention& r) {
  if (r.n_layers != spec.n_layers || r.n_kv_heads != spec.n_kv_heads || r.n_tokens != spec.n_tokens ||
      int64_t(r.kept.size()) != int64_t(spec.n_layers) * spec.n_kv_heads)
    return SF_ERR(kInvalidArgument, "export_kv: retention geometry does not match the cache");
  for (size_t i = 0; i < r.kept.size(); ++i) {
    const auto& k = r.kept[i];
    if (k.empty())
      return SF_ERR(kInvalidArgument, "export_kv: retention keeps no token for layer " +
                                          std::to_string(i / size_t(spec.n_kv_heads)) + " head " +
                                          std::to_string(i % size_t(spec.n_kv_heads)));
    for (size_t j = 0; j < k.size(); ++j)
      if (k[j] < 0 || k[j] >= spec.n_tokens || (j > 0 && k[j] <= k[j - 1]))
        return SF_ERR(kInvalidArgument, "export_kv: retention positions must be ascending and in [0, n_tokens)");
  }
  if (r.has_low() != spec.encoding_low.has_value())
    return SF_ERR(kInvalidArgument, r.has_low()
                                        ? "export_kv: the retention has a low tier but the export "
                                          "names one encoding (give HIGH+LOW)"
                                        : "export_kv: two encodings but the retention has no low "
                                          "tier (give the policy high=TOKENS)");
  if (!r.has_low()) return Status::ok();
  if (r.low.size() != r.kept.size())
    return SF_ERR(kInvalidArgument, "export_kv: retention low tier geometry does not match");
  for (size_t i = 0; i < r.low.size(); ++i) {
    const auto& k = r.kept[i];
    const auto& lo = r.low[i];
    if (!std::is_sorted(lo.begin(), lo.end()) || std::adjacent_find(lo.begin(), lo.end()) != lo.end() ||
        !std::includes(k.begin(), k.end(), lo.begin(), lo.end()))
      return SF_ERR(kInvalidArgument, "export_kv: a low tier must be ascending kept positions");
    if (lo.size() == k.size())
      return SF_ERR(kInvalidArgument, "export_kv: the high tier keeps no token for layer " +
                                          std::to_string(i / size_t(spec.n_kv_heads)) + " head " +
                                          std::to_string(i % size_t(spec.n_kv_heads)));
  }
  return Status::ok();
}

// The positions of (layer, head) in one tier: every kept one without a low tier (no copy);
// the high tier of two is built in *scratch.
const std::vector<int32_t>& tier_positions(const Retention& r, int l, int h, bool low,
                                           std::vector<int32_t>* scratch) {
  if (!r.has_low()) return r.positions(l, h);
  if (low) return r.low[size_t(l) * size_t(r.n_kv_heads) + size_t(h)];
  *scratch = r.high_positions(l, h);
  return *scratch;
}

}  // namespace

int64_t kv_bytes(const Retention& r, int head_dim, KvEncoding enc, std::optional<KvEncoding> low) {
  int64_t total = 0;
  for (size_t i = 0; i < r.kept.size(); ++i) {
    const int64_t n_low = r.has_low() ? int64_t(r.low[i].size()) : 0;
    total += kv_encoded_bytes(enc, int64_t(r.kept[i].size()) - n_low, head_dim);
    if (n_low > 0) total += kv_encoded_bytes(low.value_or(enc), n_low, head_dim);
  }
  return total;
}

// Key groups are the metadata's blocks (kv_quant.h); the writer sizes key scales by blocks.
static_assert(kKvQuantKeyRows == kKvBlockSize);

std::string compat_hash(const KvExportSpec& s) {
  std::string str = "sparsefill-kv/" + std::to_string(kKvCompatVersion) + ";model=" + s.model_name +
                    ";arch=" + s.arch + ";dtype=F32;layers=" + std::to_string(s.n_layers) +
                    ";kv_heads=" + std::to_string(s.n_kv_heads) +
                    ";head_dim=" + std::to_string(s.head_dim);
  char theta[64];
  std::snprintf(theta, sizeof theta, ";rope_theta=%.6g", double(s.rope_theta));
  str += theta;
  str += ";rope=rotate_half;block=" + std::to_string(kKvBlockSize);
  if (!s.rope_variant.empty()) str += ";rope_variant=" + s.rope_variant;
  return hex64(xxh64_bytes(str.data(), str.size()));
}

std::string rope_variant(const kernels::RopeParams& rope, int head_dim, const float* freq_factors,
                         size_t n_freq_factors) {
  std::string v;
  char buf[160];
  if (freq_factors != nullptr && n_freq_factors > 0) {
    // The divisors override the scaling formula, so they alone describe the frequencies.
    v = "freq_factors=" + hex64(xxh64_bytes(freq_factors, n_freq_factors * sizeof(float)));
  } else if (rope.scaling_factor != 0.f) {
    std::snprintf(buf, sizeof buf, "llama3(factor=%.6g,low=%.6g,high=%.6g,original=%d)",
                  double(rope.scaling_factor), double(rope.low_freq_factor),
                  double(rope.high_freq_factor), rope.original_max_pos);
    v = buf;
  }
  if (rope.rot_dim != 0 && rope.rot_dim != head_dim)
    v += (v.empty() ? "" : ",") + std::string("rot_dim=") + std::to_string(rope.rot_dim);
  return v;
}

KvExportSpec model_export_spec(const model::Model& m) {
  const model::ModelConfig& c = m.config();
  const model::OwnedTensor& freqs = m.weights().rope_freqs;
  KvExportSpec s;
  s.model_name = c.name;
  s.arch = model::arch_name(c.arch);
  s.n_layers = c.n_layers;
  s.n_kv_heads = c.n_kv_heads;
  s.head_dim = c.head_dim;
  s.rope_theta = c.rope.theta;
  s.rope_variant = rope_variant(c.rope, c.head_dim, freqs.empty() ? nullptr : freqs.data.data(),
                                freqs.data.size());
  s.keys_interleaved = !c.rope.neox;
  return s;
}

namespace {

Status check_spec(const KvExportSpec& spec) {
  if (spec.n_layers <= 0 || spec.n_kv_heads <= 0 || spec.head_dim <= 0 || spec.n_tokens <= 0)
    return SF_ERR(kInvalidArgument, "export_kv: empty geometry");
  if (int64_t(spec.token_ids.size()) != spec.n_tokens)
    return SF_ERR(kInvalidArgument, "export_kv: token_ids size does not match n_tokens");
  if (spec.retention) SF_TRY(check_retention(spec, *spec.retention));
  else if (spec.encoding_low)
    return SF_ERR(kInvalidArgument, "export_kv: two encodings but no retention with a low tier");
  if (spec.encoding_low && kv_encoded_bytes(*spec.encoding_low, kKvBlockSize, spec.head_dim) >=
                               kv_encoded_bytes(spec.encoding, kKvBlockSize, spec.head_dim))
    return SF_ERR(kInvalidArgument, "export_kv: the low tier's encoding must be narrower");
  if (const ImportanceScores* is = spec.importance) {
    bool ok = is->n_layers == spec.n_layers && is->n_kv_heads == spec.n_kv_heads && is->n_tokens == spec.n_tokens &&
              int64_t(is->layers.size()) == spec.n_layers;
    for (size_t l = 0; ok && l < is->layers.size(); ++l)
      ok = int64_t(is->layers[l].size()) == int64_t(spec.n_kv_heads) * spec.n_tokens;
    if (!ok) return SF_ERR(kInvalidArgument, "export_kv: importance geometry does not match the cache");
  }
  return Status::ok();
}

// Runs ascending, disjoint, non-empty and inside [0, n).
bool runs_valid(const std::vector<std::array<int64_t, 2>>& runs, int64_t n) {
  int64_t prev = 0;
  for (const auto& r : runs) {
    if (r[0] < prev || r[0] >= r[1] || r[1] > n) return false;
    prev = r[1];
  }
  return !runs.empty();
}

// The positions of `kept` (ascending) inside the runs, and each one's row in the part's layout
// (runs back to back).
void intersect(const std::vector<int32_t>& kept, const std::vector<std::array<int64_t, 2>>& runs,
               std::vector<int32_t>* pos, std::vector<int64_t>* rows) {
  size_t i = 0;
  int64_t base = 0;
  for (const auto& r : runs) {
    while (i < kept.size() && kept[i] < r[0]) ++i;
    for (; i < kept.size() && kept[i] < r[1]; ++i) {
      pos->push_back(kept[i]);
      rows->push_back(base + (kept[i] - r[0]));
    }
    base += r[1] - r[0];
  }
}

// How many of the sorted positions `kept` fall inside the runs.
int64_t count_in(const std::vector<int32_t>& kept, const std::vector<std::array<int64_t, 2>>& runs) {
  int64_t n = 0;
  for (const auto& r : runs)
    n += std::lower_bound(kept.begin(), kept.end(), int32_t(r[1])) -
         std::lower_bound(kept.begin(), kept.end(), int32_t(r[0]));
  return n;
}

}  // namespace

KvShardPart whole_part(const KvExportSpec& spec) {
  KvShardPart p;
  p.tokens = {{0, spec.n_tokens}};
  p.kv_head0 = 0;
  p.n_kv_heads = spec.n_kv_heads;
  return p;
}

namespace {

// The directory an export lands in, resolved: "runs/kv/" and "runs/./kv" name "runs/kv" (its
// temporary sibling must sit beside it, not inside it), and symbolic links are followed (a
// linked export directory is replaced where it lives; "link/../x" is what the system resolves,
// not what the text reads). A path with no name of its own (".", "..", "/") is refused:
// replacing it would remove the directory that holds it.
Result<fs::path> export_dir_path(const std::string& dir) {
  fs::path lex = fs::path(dir).lexically_normal();
  if (!lex.empty() && lex.filename().empty()) lex = lex.parent_path();
  const std::string name = lex.filename().string();
  const auto refuse = [&] {
    return SF_ERR(kInvalidArgument, "export dir '" + dir +
                                        "' names no directory of its own (give one such as out/kv)");
  };
  if (dir.empty() || name.empty() || name == "." || name == ".." || lex == lex.root_path())
    return refuse();
  std::error_code ec;
  fs::path out = fs::weakly_canonical(fs::path(dir), ec);
  if (ec) return lex;
  if (!out.empty() && out.filename().empty()) out = out.parent_path();
  if (out.filename().empty() || out == out.root_path()) return refuse();
  return out;
}

}  // namespace

Status export_dir_check(const std::string& dir, bool force) {
  SF_ASSIGN(const fs::path out, export_dir_path(dir));
  std::error_code ec;
  if (!fs::exists(out, ec)) return Status::ok();
  if (!fs::is_directory(out, ec))
    return SF_ERR(kAlreadyExists, "export dir '" + dir + "' exists and is not a directory");
  if (fs::is_empty(out, ec)) return Status::ok();
  if (!force)
    return SF_ERR(kAlreadyExists,
                  "export dir '" + dir + "' exists and is not empty (use --force to replace it)");
  // --force replaces an earlier export, never an arbitrary directory (a typo such as
  // --export-kv ~ would otherwise remove a home directory).
  if (!fs::is_regular_file(out / "manifest.json", ec))
    return SF_ERR(kAlreadyExists, "export dir '" + dir +
                                      "' is not empty and holds no manifest.json, so it is not a "
                                      "KV export; --force replaces only an earlier export");
  return Status::ok();
}

Result<std::string> begin_export(const std::string& dir, bool force) {
  SF_TRY(export_dir_check(dir, force));
  SF_ASSIGN(const fs::path out, export_dir_path(dir));
  std::error_code ec;
  const fs::path tmp =
      out.parent_path() / (out.filename().string() + std::string(kExportPartialTag) +
                           host_name() + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec)
    return SF_ERR(kIo, "cannot create the export '" + dir + "' (its temporary directory '" +
                           tmp.string() + "'): " + ec.message());
  return tmp.string();
}

Status finish_export(const std::string& tmp, const std::string& dir, bool force) {
  SF_TRY(export_dir_check(dir, force));
  SF_ASSIGN(const fs::path out, export_dir_path(dir));
  std::error_code ec;
  // An earlier export is renamed aside, then removed once the new one is in place: removing it
  // in place (hundreds of gigabytes, or files a consumer holds open on NFS) could stop part way
  // and leave a directory without a manifest, which no later export may replace. The aside name
  // is a temporary one ('+' is in no request id) that a later job's start-up removes should
  // this process die first.
  const fs::path aside = out.parent_path() / (out.filename().string() + "+replaced" +
                                              std::string(kExportPartialTag) + host_name() + "-" +
                                              std::to_string(::getpid()));
  const bool replacing = fs::exists(out, ec);
  if (replacing) {
    fs::remove_all(aside, ec);
    fs::rename(out, aside, ec);
    if (ec) return SF_ERR(kIo, "cannot replace '" + dir + "': " + ec.message());
  }
  fs::rename(tmp, out, ec);
  if (ec) {
    std::error_code back;
    if (replacing) fs::rename(aside, out, back);  // the earlier export stays as it was
    return SF_ERR(kIo, "cannot move export into '" + dir + "': " + ec.message());
  }
  sync_dir(out.parent_path().string());  // the move survives a power loss
  if (replacing) fs::remove_all(aside, ec);  // a failure leaves it to the stale cleanup
  return Status::ok();
}

Result<std::vector<std::string>> export_kv_shards(const std::string& tmp, const KvExportSpec& spec,
                                                  const KvShardPart& part, const LayerSource& src,
                                                  bool validate, const ExportOptions& opt) {
  if (validate) SF_TRY(check_spec(spec));
  // Cheap even unvalidated: the tiers below read the low encoding exactly when there is one.
  if ((spec.retention && spec.retention->has_low()) != spec.encoding_low.has_value())
    return SF_ERR(kInvalidArgument, "export_kv: a retention's low tier and the export's low "
                                    "encoding must come together");
  const int64_t S = spec.n_tokens;
  const int hp = part.n_kv_heads, h0 = part.kv_head0, d = spec.head_dim;
  if (h0 < 0 || hp <= 0 || h0 + hp > spec.n_kv_heads)
    return SF_ERR(kInvalidArgument, "export_kv: shard KV heads [" + std::to_string(h0) + ", " +
                                        std::to_string(h0 + hp) + ") outside the model's " +
                                        std::to_string(spec.n_kv_heads));
  if (!runs_valid(part.tokens, S))
    return SF_ERR(kInvalidArgument,
                  "export_kv: shard token runs must be non-empty, ascending, "
                  "disjoint and inside the prompt");
  const Retention* ret = spec.retention;
  std::vector<int32_t> all_pos(ret ? 0 : static_cast<size_t>(S));  // full retention's positions
  for (size_t t = 0; t < all_pos.size(); ++t) all_pos[t] = int32_t(t);
  boost::json::array tok_json;
  for (const auto& r : part.tokens) tok_json.push_back(boost::json::array{r[0], r[1]});
  if (part.layer < -1 || part.layer >= spec.n_layers)
    return SF_ERR(kInvalidArgument, "export_kv: shard layer " + std::to_string(part.layer) +
                                        " outside the model's " + std::to_string(spec.n_layers));
  const int l_end = part.layer < 0 ? spec.n_layers : part.layer + 1;
  // Each tier is its own shard file: the high one (every kept token without a low tier), then
  // the low one.
  const int n_tiers = ret && ret->has_low() ? 2 : 1;
  std::vector<std::array<int, 2>> items;  // (layer, tier), in the order the entries are listed
  for (int l = std::max(part.layer, 0); l < l_end; ++l)
    for (int tier = 0; tier < n_tiers; ++tier)
      if (part.tier < 0 || tier == part.tier) items.push_back({l, tier});
  FreeList<ShardBuffers> buffers;
  // One shard file: gathered, encoded, written (hashed and fsynced) and described in *entry.
  const auto one = [&](int l, int tier, std::string* entry) -> Status {
    std::error_code ec;
    const bool low = tier == 1;
    if (opt.wait_layer) SF_TRY(opt.wait_layer(l));
    const LayerRows k = src(l, false);
    const LayerRows v = src(l, true);
    if (!k.data || !v.data)
      return SF_ERR(kInvalidArgument, "export_kv: layer " + std::to_string(l) + " has no KV");
    if ((k.dtype != DType::kF32 && k.dtype != DType::kBF16) || v.dtype != k.dtype)
      return SF_ERR(kInvalidArgument, "export_kv: layer " + std::to_string(l) +
                                          "'s K and V must both be F32 or both BF16");
    std::vector<std::vector<int32_t>> pos(static_cast<size_t>(hp));
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(hp));
    std::vector<int32_t> scratch;
    for (int h = 0; h < hp; ++h)
      intersect(ret ? tier_positions(*ret, l, h0 + h, low, &scratch) : all_pos, part.tokens,
                &pos[size_t(h)], &rows[size_t(h)]);
    bool uniform = true;
    for (int h = 1; h < hp; ++h) uniform = uniform && pos[size_t(h)].size() == pos[0].size();
    // Per head K/V rows [n_h, d]; in the uniform layout they sit back to back as [hp, n, d].
    std::vector<int64_t> off(static_cast<size_t>(hp) + 1, 0);
    for (int h = 0; h < hp; ++h) off[size_t(h) + 1] = off[size_t(h)] + int64_t(pos[size_t(h)].size());
    // K and V as stored, every head back to back (each head its own groups): F32 rows, or their
    // encoding. Each block of kKvBlockSize rows is gathered, encoded and described (key min, max
    // and mean of the keys as stored, decoded back; importance) while it is in cache, straight
    // into the shard's buffers: the source is read once and no whole-layer F32 copy is made.
    const KvEncoding enc = low ? *spec.encoding_low : spec.encoding;
    const bool raw = enc == KvEncoding::kF32;
    const DType elem = kv_encoding_element(enc);
    const int64_t width = kv_encoding_row_elems(enc, d), esize = int64_t(dtype_size(elem));
    const size_t row_bytes = size_t(width * esize);
    // Per head, where its key and value groups start (their F16 scales and zeros).
    std::vector<int64_t> kgrp(static_cast<size_t>(hp) + 1, 0), vgrp(static_cast<size_t>(hp) + 1, 0);
    for (int h = 0; h < hp; ++h) {
      const int64_t n = int64_t(pos[size_t(h)].size());
      kgrp[size_t(h) + 1] = kgrp[size_t(h)] + kv_param_groups(enc, true, n, d);
      vgrp[size_t(h) + 1] = vgrp[size_t(h)] + kv_param_groups(enc, false, n, d);
    }
    // Keys and values, from the call's reused buffers (returned however this shard ends).
    const auto bufs = buffers.take();  // returned however this shard ends
    for (RawBytes& b : bufs->kv)
      if (b.n < size_t(off.back()) * row_bytes + 1) b = RawBytes(size_t(off.back()) * row_bytes + 1);
    RawBytes* data = bufs->kv;
    std::vector<uint16_t> scale[2] = {std::vector<uint16_t>(size_t(kgrp.back())),
                                      std::vector<uint16_t>(size_t(vgrp.back()))};
    std::vector<uint16_t> zero[2] = {std::vector<uint16_t>(size_t(kgrp.back())),
                                     std::vector<uint16_t>(size_t(vgrp.back()))};
    std::vector<float> blk(raw ? 0 : size_t(2 * kKvBlockSize * d));  // one block's F32 K, V
    std::vector<HeadMeta> meta(static_cast<size_t>(hp));
    for (int h = 0; h < hp; ++h) {
      const int64_t n = int64_t(pos[size_t(h)].size()), nb = (n + kKvBlockSize - 1) / kKvBlockSize;
      const float* imp = spec.importance ? spec.importance->layers[size_t(l)].data() + int64_t(h0 + h) * S : nullptr;
      HeadMeta& m = meta[size_t(h)];
      m.kmin.resize(size_t(nb * d));
      m.kmax.resize(size_t(nb * d));
      m.kmean.resize(size_t(nb * d));
      if (imp) m.importance.assign(size_t(nb), 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t t0 = b * kKvBlockSize, nt = std::min<int64_t>(kKvBlockSize, n - t0);
        const int64_t* rr = rows[size_t(h)].data() + t0;
        uint8_t* kd = data[0].data() + size_t(off[size_t(h)] + t0) * row_bytes;
        uint8_t* vd = data[1].data() + size_t(off[size_t(h)] + t0) * row_bytes;
        float* kf = raw ? reinterpret_cast<float*>(kd) : blk.data();
        float* vf = raw ? reinterpret_cast<float*>(vd) : blk.data() + kKvBlockSize * d;
        gather_head(k, hp, d, h, rr, nt, spec.keys_interleaved, kf);
        gather_head(v, hp, d, h, rr, nt, false, vf);
        if (imp) {
          double sum = 0;
          for (int64_t t = t0; t < t0 + nt; ++t) sum += imp[pos[size_t(h)][size_t(t)]];
          m.importance[size_t(b)] = float(sum);
        }
        float* const kmin = m.kmin.data() + b * d;
        float* const kmax = m.kmax.data() + b * d;
        float* const kmean = m.kmean.data() + b * d;
        if (raw) {
          block_key_stats(kf, nt, d, kmin, kmax, kmean);
          continue;
        }
        // A key block is its own groups ([n_blocks, d]); values have one a row. bf16 has none
        // (its scale and zero buffers are empty: no pointer into them is formed).
        const bool grouped = kgrp.back() > 0;
        const size_t kp = size_t(kgrp[size_t(h)] + b * d);
        const size_t vp = size_t(vgrp[size_t(h)] + kv_param_groups(enc, false, t0, d));
        SF_TRY(kv_encode_into(enc, true, kf, nt, d, kd, grouped ? scale[0].data() + kp : nullptr,
                              grouped ? zero[0].data() + kp : nullptr));
        SF_TRY(kv_encode_into(enc, false, vf, nt, d, vd, grouped ? scale[1].data() + vp : nullptr,
                              grouped ? zero[1].data() + vp : nullptr));
        // The statistics of the keys as stored: bf16 rounding, or a code's step (half of it up or
        // down), can put a stored key outside the F32 keys' min and max, and PSA's bound on q.k
        // (decode/decode_attention.h) must hold for the keys a node reads.
        SF_TRY(kv_decode_into(enc, true, kd, grouped ? scale[0].data() + kp : nullptr,
                              grouped ? zero[0].data() + kp : nullptr, nt, d, kf));
        block_key_stats(kf, nt, d, kmin, kmax, kmean);
      }
    }
    SafetensorsWriter w;
    boost::json::array names;
    auto add = [&](const std::string& name, DType t, std::vector<int64_t> shape, const void* p, size_t bytes) {
      w.add(name, t, std::move(shape), p, bytes);
      names.push_back(boost::json::string(name));
    };
    // The K/V tensors of `heads` heads of n rows each, from head h on: F32 rows, or codes and,
    // for the integer encodings, their F16 scales and zeros.
    auto add_kv = [&](const std::string& sfx, int64_t heads, int64_t n, int h) {
      for (int kv = 0; kv < 2; ++kv) {
        const std::string name = kv ? "value" : "key";
        add(name + sfx, raw ? DType::kF32 : elem, {1, heads, n, raw ? d : width},
            data[kv].data() + size_t(off[size_t(h)]) * row_bytes, size_t(heads * n) * row_bytes);
        const int64_t per = kv_param_groups(enc, kv == 0, n, d);
        if (per == 0) continue;
        const std::vector<int64_t> shape = kv_param_shape(kv == 0, heads, n, d);
        const size_t count = size_t(heads * per);
        const int64_t p0 = (kv ? vgrp : kgrp)[size_t(h)];
        add(name + "_scale" + sfx, DType::kF16, shape, scale[kv].data() + p0, count * 2);
        add(name + "_zero" + sfx, DType::kF16, shape, zero[kv].data() + p0, count * 2);
      }
    };
    if (uniform) add_kv("", hp, int64_t(pos[0].size()), 0);
    for (int h = 0; h < hp; ++h) {
      const std::string sfx = ".h" + std::to_string(h0 + h);
      const int64_t n = int64_t(pos[size_t(h)].size()), nb = (n + kKvBlockSize - 1) / kKvBlockSize;
      if (!uniform) add_kv(sfx, 1, n, h);
      const HeadMeta& m = meta[size_t(h)];
      add("positions" + sfx, DType::kI32, {n}, pos[size_t(h)].data(), size_t(n) * 4);
      add("block_key_min" + sfx, DType::kF32, {nb, d}, m.kmin.data(), m.kmin.size() * 4);
      add("block_key_max" + sfx, DType::kF32, {nb, d}, m.kmax.data(), m.kmax.size() * 4);
      add("block_key_mean" + sfx, DType::kF32, {nb, d}, m.kmean.data(), m.kmean.size() * 4);
      if (!m.importance.empty())
        add("block_importance" + sfx, DType::kF32, {nb}, m.importance.data(), m.importance.size() * 4);
    }
    w.set_metadata("layer", std::to_string(l));
    w.set_metadata("layout", uniform ? "key/value [batch, kv_heads, tokens, head_dim]; keys post-RoPE, rotate-half"
                                     : "key.hH/value.hH [batch, 1, tokens, head_dim] per KV head; keys post-RoPE, rotate-half");
    w.set_metadata("kv_heads", std::to_string(h0) + "-" + std::to_string(h0 + hp));
    // The key/value tensors' encoding (their last dimension is head_dim / 2 in int4).
    w.set_metadata("kv_dtype", kv_encoding_name(enc));
    if (n_tiers == 2) w.set_metadata("tier", low ? "low" : "high");
    char name[64];
    std::snprintf(name, sizeof name, "layer_%03d%s%s.safetensors", l, part.file_tag.c_str(),
                  low ? ".low" : "");
    const fs::path p = fs::path(tmp) / name;
    auto r = w.write(p.string());
    if (!r.is_ok()) return r.status();
    boost::json::object sh;
    sh["file"] = name;
    sh["layer"] = l;
    sh["layout"] = uniform ? "uniform" : "per_head";
    sh["tokens"] = tok_json;
    sh["kv_heads"] = boost::json::array{h0, h0 + hp};
    sh["rank"] = part.rank;
    if (n_tiers == 2) sh["tier"] = low ? "low" : "high";
    sh["tensors"] = std::move(names);
    sh["bytes"] = uint64_t(fs::file_size(p, ec));
    sh["xxh64"] = hex64(r.value());
    *entry = boost::json::serialize(sh);
    return Status::ok();
  };
  std::vector<std::string> entries(items.size());
  // Files left to write per layer, for on_layer_written.
  std::vector<std::atomic<int>> left(static_cast<size_t>(spec.n_layers));
  for (const auto& it : items) left[size_t(it[0])].fetch_add(1, std::memory_order_relaxed);
  SF_TRY(run_items(items.size(), opt.layers_in_flight, [&](size_t i) {
    SF_TRY(one(items[i][0], items[i][1], &entries[i]));
    if (opt.on_layer_written && left[size_t(items[i][0])].fetch_sub(1) == 1)
      opt.on_layer_written(items[i][0]);
    return Status::ok();
  }));
  return entries;
}

int default_layers_in_flight() { return std::clamp(num_threads() / 2, 1, 8); }

Status export_kv_manifest(const std::string& tmp, const KvExportSpec& spec,
                          const std::vector<std::string>& entries) {
  SF_TRY(check_spec(spec));
  const int64_t S = spec.n_tokens;
  const int hkv = spec.n_kv_heads, d = spec.head_dim, nl = spec.n_layers;
  const Retention* ret = spec.retention;
  std::vector<int32_t> all_pos(static_cast<size_t>(S));
  for (int64_t t = 0; t < S; ++t) all_pos[size_t(t)] = int32_t(t);
  // Coverage and block alignment per (layer, head): every shard run over that head, with the
  // head's kept tokens in it.
  struct Run {
    int64_t begin, end, kept;
  };
  // Per tier: [tier][layer * hkv + head].
  const int n_tiers = ret && ret->has_low() ? 2 : 1;
  std::vector<std::vector<std::vector<Run>>> cover(
      size_t(n_tiers), std::vector<std::vector<Run>>(static_cast<size_t>(nl * hkv)));
  boost::json::array shards;
  for (const std::string& e : entries) {
    boost::json::error_code jec;
    boost::json::value v = boost::json::parse(e, jec);
    if (jec || !v.is_object()) return SF_ERR(kInvalidArgument, "export_kv: a shard entry is not a JSON object");
    const boost::json::object& o = v.as_object();
    const int64_t l = o.at("layer").to_number<int64_t>();
    const auto& kh = o.at("kv_heads").as_array();
    const int64_t a = kh[0].to_number<int64_t>(), b = kh[1].to_number<int64_t>();
    std::vector<std::array<int64_t, 2>> runs;
    for (const auto& rv : o.at("tokens").as_array())
      runs.push_back({rv.as_array()[0].to_number<int64_t>(), rv.as_array()[1].to_number<int64_t>()});
    const std::string file(o.at("file").as_string());
    if (l < 0 || l >= nl || a < 0 || b > hkv || a >= b || !runs_valid(runs, S))
      return SF_ERR(kInvalidArgument,
                    "export_kv: shard '" + file +
                        "' has a layer, head range or token runs outside the model");
    // Writers on other ranks put their shards here too: each must be in place, whole.
    std::error_code ec;
    const fs::path fp = fs::path(tmp) / file;
    if (!fs::is_regular_file(fp, ec) ||
        fs::file_size(fp, ec) != o.at("bytes").to_number<uint64_t>())
      return SF_ERR(kNotFound, "export_kv: shard '" + file + "' is not in '" + tmp + "' with " +
                                   std::to_string(o.at("bytes").to_number<uint64_t>()) + " bytes");
    std::vector<int32_t> scratch;
    const auto* tier_v = o.if_contains("tier");
    const bool low = tier_v && tier_v->is_string() && tier_v->as_string() == "low";
    if (low && n_tiers == 1)
      return SF_ERR(kInvalidArgument, "export_kv: shard '" + file + "' is a low tier's, but the retention has none");
    for (int64_t h = a; h < b; ++h) {
      const auto& kept = ret ? tier_positions(*ret, int(l), int(h), low, &scratch) : all_pos;
      for (const auto& r : runs)
        cover[size_t(low)][size_t(l * hkv + h)].push_back({r[0], r[1], count_in(kept, {r})});
    }
    shards.push_back(std::move(v));
  }
  for (int tier = 0; tier < n_tiers; ++tier)
    for (int64_t l = 0; l < nl; ++l)
      for (int64_t h = 0; h < hkv; ++h) {
        auto& rs = cover[size_t(tier)][size_t(l * hkv + h)];
        std::sort(rs.begin(), rs.end(), [](const Run& x, const Run& y) { return x.begin < y.begin; });
        const std::string where = std::string("export_kv: the ") + (tier ? "low tier's " : "") +
                                  "shards of layer " + std::to_string(l) + " KV head " + std::to_string(h);
        int64_t next = 0, last = -1;
        for (size_t i = 0; i < rs.size(); ++i) {
          if (rs[i].begin != next)
            return SF_ERR(kInvalidArgument, where + (rs[i].begin < next ? " overlap" : " leave a gap") + " at token " +
                                                std::to_string(std::min(rs[i].begin, next)));
          next = rs[i].end;
          if (rs[i].kept > 0) last = int64_t(i);
        }
        if (next != S)
          return SF_ERR(kInvalidArgument, where + " stop at token " + std::to_string(next) + " of " + std::to_string(S));
        // Blocks are runs of 64 kept tokens within a shard: they add up to the head's only if every
        // run before the one holding its last kept token keeps whole blocks.
        for (int64_t i = 0; i < last; ++i)
          if (rs[size_t(i)].kept % kKvBlockSize != 0)
            return SF_ERR(kInvalidArgument, where + ": the run [" + std::to_string(rs[size_t(i)].begin) + ", " +
                                                std::to_string(rs[size_t(i)].end) + ") keeps " +
                                                std::to_string(rs[size_t(i)].kept) +
                                                " tokens, not whole blocks of 64, before the head's last block");
      }

  boost::json::array ret_layers;
  for (int l = 0; l < nl; ++l) {
    boost::json::array heads_json;
    for (int h = 0; h < hkv; ++h) {
      const auto& kept = ret ? ret->positions(l, h) : all_pos;
      boost::json::object hj;
      hj["n"] = int64_t(kept.size());
      hj["runs"] = encode_position_runs(position_runs(kept));
      if (n_tiers == 2) {
        const auto& lo = ret->low[size_t(l) * size_t(hkv) + size_t(h)];
        boost::json::object lj;
        lj["n"] = int64_t(lo.size());
        lj["runs"] = encode_position_runs(position_runs(lo));
        hj["low"] = std::move(lj);
      }
      heads_json.push_back(std::move(hj));
    }
    boost::json::object lj;
    lj["layer"] = l;
    lj["heads"] = std::move(heads_json);
    ret_layers.push_back(std::move(lj));
  }
  boost::json::object model;
  model["name"] = spec.model_name;
  model["arch"] = spec.arch;
  model["n_layers"] = spec.n_layers;
  model["n_kv_heads"] = spec.n_kv_heads;
  model["head_dim"] = spec.head_dim;
  model["rope_theta"] = double(spec.rope_theta);
  if (!spec.rope_variant.empty()) model["rope_variant"] = spec.rope_variant;
  boost::json::object man;
  man["format"] = "sparsefill-kv";
  man["format_version"] = kKvFormatVersion;
  man["model"] = std::move(model);
  man["compat_hash"] = compat_hash(spec);
  man["dtype"] = "F32";
  man["kv_dtype"] = kv_encoding_name(spec.encoding);
  if (n_tiers == 2) man["kv_dtype_low"] = kv_encoding_name(*spec.encoding_low);
  man["layout"] =
      "key/value: [1, shard kv_heads, n_kept, head_dim] (per shard layout uniform) or "
      "key.hH/value.hH: "
      "[1, 1, n_kept_H, head_dim] (per_head); keys after RoPE in rotate-half order. kv_dtype "
      "int8/int4: "
      "U8 codes (int4: two a byte, even channel low, last dim head_dim/2), x = zero + code * scale "
      "with "
      "F16 key_scale/key_zero [1, heads, n_blocks, head_dim] (per channel per 64 kept tokens) and "
      "value_scale/value_zero [1, heads, n_kept] (per token)";
  if (n_tiers == 2)
    man["layout"] = std::string(man["layout"].as_string()) +
                    ". Each layer's low tier (retention heads' low ranges) is in its own shards "
                    "(tier \"low\", files *.low.safetensors) in kv_dtype_low, the other kept "
                    "tokens in kv_dtype";
  man["block_size"] = kKvBlockSize;
  man["n_tokens"] = S;
  boost::json::array ids;
  for (int32_t t : spec.token_ids) ids.push_back(t);
  man["token_ids"] = std::move(ids);
  man["first_token"] = spec.first_token;
  boost::json::object rj;
  rj["policy"] = ret ? ret->policy : "full";
  rj["params"] = ret ? ret->params : "";
  const int64_t kept = ret ? ret->kept_total() : S * nl * hkv;
  rj["kept_tokens"] = kept;
  const int64_t full_bytes = nl * hkv * kv_encoded_bytes(spec.encoding, S, d);
  rj["kv_bytes"] = ret ? kv_bytes(*ret, d, spec.encoding, spec.encoding_low) : full_bytes;
  rj["kv_bytes_full"] = full_bytes;
  rj["layers"] = std::move(ret_layers);
  man["retention"] = std::move(rj);
  if (spec.importance) {
    boost::json::object ij;
    ij["method"] = spec.importance->method;
    ij["window"] = spec.importance->window;
    ij["pool"] = spec.importance->pool;
    man["importance"] = std::move(ij);
  } else {
    man["importance"] = nullptr;
  }
  man["checksum"] = "xxh64 of each whole shard file, seed 0";
  man["shards"] = std::move(shards);
  // Synced (file and directory) like the shards: a worker's summary, written after it, makes the
  // request count as done, and an empty manifest after a power loss would never be redone.
  return write_file_atomic((fs::path(tmp) / "manifest.json").string(),
                           boost::json::serialize(man) + "\n");
}

Status export_kv(const std::string& dir, const KvExportSpec& spec, const LayerSource& src, bool force,
                 const ExportOptions& opt) {
  SF_TRY(check_spec(spec));
  SF_ASSIGN(const std::string tmp, begin_export(dir, force));
  // The temporary directory goes on any way out but success, an exception from the caller's
  // LayerSource or an allocation included (a 1M-token export's is hundreds of gigabytes).
  struct RemoveUnlessMoved {
    const std::string& dir;
    bool moved = false;
    ~RemoveUnlessMoved() {
      std::error_code ec;
      if (!moved) fs::remove_all(dir, ec);
    }
  } guard{tmp};
  auto entries = export_kv_shards(tmp, spec, whole_part(spec), src, /*validate=*/true, opt);
  SF_TRY(entries.status());
  SF_TRY(export_kv_manifest(tmp, spec, entries.value()));
  SF_TRY(finish_export(tmp, dir, force));
  guard.moved = true;
  return Status::ok();
}

}  // namespace sf::kvstore
