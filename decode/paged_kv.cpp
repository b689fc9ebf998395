#include "decode/paged_kv.h"

#include <type_traits>

#include <algorithm>
#include <string>

namespace sf::decode {
namespace {

// rotate-half channel order (i, i + d/2) back to adjacent pairs (2i, 2i + 1).
void to_interleaved(const float* src, int d, float* dst) {
  for (int c = 0; c < d / 2; ++c) {
    dst[2 * c] = src[c];
    dst[2 * c + 1] = src[c + d / 2];
  }
}

// The same, in place, for any element type (int8 codes, F16 scales and zeros).
template <typename T>
void to_interleaved(T* row, int d) {
  std::vector<T> tmp(row, row + d);
  for (int c = 0; c < d / 2; ++c) {
    row[2 * c] = tmp[size_t(c)];
    row[2 * c + 1] = tmp[size_t(c + d / 2)];
  }
}

}  // namespace

int32_t PagedKvCache::new_block() {
  // A block an undone append opened, not at the pool's end, is reused first.
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    id = int32_t(pool_.size());
    pool_.emplace_back();
  }
  KvBlock& b = pool_[size_t(id)];
  b.n = 0;
  b.pos.assign(kBlockTokens, -1);
  b.k.assign(size_t(kBlockTokens) * size_t(head_dim_), 0.f);
  b.v.assign(size_t(kBlockTokens) * size_t(head_dim_), 0.f);
  b.kmin.assign(size_t(head_dim_), 0.f);
  b.kmax.assign(size_t(head_dim_), 0.f);
  b.kq = b.vq = kvstore::EncodedRows{};
  return id;
}

Result<PagedKvCache> PagedKvCache::from_export(const KvExport& e, bool keys_interleaved) {
  return page_export(e, keys_interleaved);
}

Result<PagedKvCache> PagedKvCache::take_from_export(KvExport& e, bool keys_interleaved) {
  return page_export(e, keys_interleaved);
}

template <typename Export>
Result<PagedKvCache> PagedKvCache::page_export(Export& e, bool keys_interleaved) {
  if (e.block_size != kBlockTokens)
    return SF_ERR(kUnsupported,
                  "paged kv: block size " + std::to_string(e.block_size) + " is not 64");
  PagedKvCache c;
  c.n_layers_ = e.n_layers;
  c.n_kv_heads_ = e.n_kv_heads;
  c.head_dim_ = e.head_dim;
  c.pages_.resize(size_t(e.n_layers) * size_t(e.n_kv_heads));
  const int d = e.head_dim;
  std::vector<float> tmp(static_cast<size_t>(d));
  for (int l = 0; l < e.n_layers; ++l)
    for (int h = 0; h < e.n_kv_heads; ++h) {
      const HeadKv& H = e.head(l, h);
      const int64_t n = int64_t(H.positions.size()), nb = (n + kBlockTokens - 1) / kBlockTokens;
      auto& pages = c.pages_[c.idx(l, h)];
      for (int64_t b = 0; b < nb; ++b) {
        const int32_t id = c.new_block();
        pages.push_back(id);
        KvBlock& B = c.pool_[size_t(id)];
        B.n = int32_t(std::min<int64_t>(kBlockTokens, n - b * kBlockTokens));
        for (int32_t t = 0; t < B.n; ++t) {
          const int64_t src = b * kBlockTokens + t;
          B.pos[size_t(t)] = H.positions[size_t(src)];
          const float* kr = H.k.data() + src * d;
          if (keys_interleaved)
            to_interleaved(kr, d, B.k.data() + size_t(t) * size_t(d));
          else
            std::copy(kr, kr + d, B.k.begin() + t * d);
          std::copy(H.v.begin() + src * d, H.v.begin() + (src + 1) * d, B.v.begin() + t * d);
        }
        if (!H.kq.data.empty()) {  // int8: the codes as stored, in the model's channel order
          const int64_t r0 = b * kBlockTokens, r1 = r0 + B.n;
          B.kq.data.assign(H.kq.data.begin() + r0 * d, H.kq.data.begin() + r1 * d);
          B.kq.scale.assign(H.kq.scale.begin() + b * d, H.kq.scale.begin() + (b + 1) * d);
          B.kq.zero.assign(H.kq.zero.begin() + b * d, H.kq.zero.begin() + (b + 1) * d);
          B.vq.data.assign(H.vq.data.begin() + r0 * d, H.vq.data.begin() + r1 * d);
          B.vq.scale.assign(H.vq.scale.begin() + r0, H.vq.scale.begin() + r1);
          B.vq.zero.assign(H.vq.zero.begin() + r0, H.vq.zero.begin() + r1);
          if (keys_interleaved) {
            for (int32_t t = 0; t < B.n; ++t) to_interleaved(B.kq.data.data() + t * d, d);
            to_interleaved(B.kq.scale.data(), d);
            to_interleaved(B.kq.zero.data(), d);
          }
        }
        // The export's block metadata, in the model's channel order.
        const float* mn = H.block_kmin.data() + b * d;
        const float* mx = H.block_kmax.data() + b * d;
        if (keys_interleaved) {
          to_interleaved(mn, d, B.kmin.data());
          to_interleaved(mx, d, B.kmax.data());
        } else {
          std::copy(mn, mn + d, B.kmin.begin());
          std::copy(mx, mx + d, B.kmax.begin());
        }
      }
      if constexpr (!std::is_const_v<Export>)  // take_from_export: this head's copy is paged
        e.heads[size_t(l) * size_t(e.n_kv_heads) + size_t(h)] = HeadKv{};
    }
  return c;
}

Result<PagedKvCache> PagedKvCache::from_prefill(const model::KvCache& kv,
                                                const kvstore::Retention& r,
                                                kvstore::KvEncoding enc,
                                                std::optional<kvstore::KvEncoding> low) {
  if (kv.bf16())
    return SF_ERR(kUnsupported, "paged kv: a bf16 host cache (kv_host_bf16) is read through its "
                                "export, not in process");
  if (r.n_layers != kv.n_layers || r.n_kv_heads != kv.n_kv_heads || r.n_tokens != kv.n_tokens ||
      int64_t(kv.k.size()) != kv.n_layers)
    return SF_ERR(kInvalidArgument,
                  "paged kv: retention geometry does not match the prefill cache");
  PagedKvCache c;
  c.n_layers_ = kv.n_layers;
  c.n_kv_heads_ = kv.n_kv_heads;
  c.head_dim_ = kv.head_dim;
  c.pages_.resize(size_t(kv.n_layers) * size_t(kv.n_kv_heads));
  const int hkv = kv.n_kv_heads, d = kv.head_dim;
  if (r.has_low() != low.has_value())
    return SF_ERR(kInvalidArgument, "paged kv: a low tier needs its encoding, and only it");
  if (r.has_low()) {
    // Each tier's rows of a head round-tripped together, then appended in position order.
    std::vector<float> rows[2][2];  // [tier][k, v]
    for (int l = 0; l < kv.n_layers; ++l)
      for (int h = 0; h < hkv; ++h) {
        const std::vector<int32_t> pos[2] = {r.high_positions(l, h),
                                             r.low[size_t(l) * size_t(hkv) + size_t(h)]};
        for (int t = 0; t < 2; ++t) {
          const int64_t n = int64_t(pos[t].size());
          for (int w = 0; w < 2; ++w) {
            const std::vector<float>& src = w ? kv.v[size_t(l)] : kv.k[size_t(l)];
            rows[t][w].resize(size_t(n * d));
            for (int64_t i = 0; i < n; ++i) {
              const int32_t p = pos[t][size_t(i)];
              if (p < 0 || p >= kv.n_tokens)
                return SF_ERR(kInvalidArgument, "paged kv: retention position out of range");
              std::copy_n(src.data() + (size_t(p) * size_t(hkv) + size_t(h)) * size_t(d), d,
                          rows[t][w].data() + i * d);
            }
            SF_TRY(kvstore::kv_round_trip(t ? *low : enc, w == 0, rows[t][w].data(), n, d));
          }
        }
        for (size_t i = 0, j = 0; i < pos[0].size() || j < pos[1].size();) {
          const int t = j == pos[1].size() || (i < pos[0].size() && pos[0][i] < pos[1][j]) ? 0 : 1;
          const size_t at = t ? j++ : i++;
          c.append(l, h, pos[t][at], rows[t][0].data() + at * size_t(d),
                   rows[t][1].data() + at * size_t(d));
        }
      }
    return c;
  }
  for (int l = 0; l < kv.n_layers; ++l)
    for (int h = 0; h < hkv; ++h)
      for (int32_t p : r.positions(l, h)) {
        if (p < 0 || p >= kv.n_tokens)
          return SF_ERR(kInvalidArgument, "paged kv: retention position out of range");
        const size_t off = (size_t(p) * size_t(hkv) + size_t(h)) * size_t(d);
        c.append(l, h, p, kv.k[size_t(l)].data() + off, kv.v[size_t(l)].data() + off);
      }
  // Every page but a head's last is a full block, so the pages are the export's key groups.
  SF_TRY(c.round_trip(enc));
  return c;
}

Status PagedKvCache::round_trip(kvstore::KvEncoding enc) {
  const int d = head_dim_;
  std::vector<float> mean;
  for (size_t id = 0; id < pool_.size(); ++id) {
    if (std::find(free_.begin(), free_.end(), int32_t(id)) != free_.end()) continue;
    KvBlock& B = pool_[id];
    if (enc != kvstore::KvEncoding::kInt8) {
      SF_TRY(kvstore::kv_round_trip(enc, true, B.k.data(), B.n, d));
      SF_TRY(kvstore::kv_round_trip(enc, false, B.v.data(), B.n, d));
      B.kq = B.vq = kvstore::EncodedRows{};
    } else {
      SF_ASSIGN(B.kq, kvstore::kv_encode(enc, true, B.k.data(), B.n, d));
      SF_ASSIGN(B.vq, kvstore::kv_encode(enc, false, B.v.data(), B.n, d));
      SF_TRY(kvstore::kv_decode(enc, true, B.kq, B.n, d, B.k.data()));
      SF_TRY(kvstore::kv_decode(enc, false, B.vq, B.n, d, B.v.data()));
    }
    // The bounds of the keys as they now are, by the function an export's block statistics
    // come from: PSA's bound on q.k must hold for the stored keys, which the encoding may move
    // past the F32 ones' range. (A page is one 64-token key group; its mean is not kept.)
    mean.resize(size_t(d));
    kvstore::block_key_stats(B.k.data(), B.n, d, B.kmin.data(), B.kmax.data(), mean.data());
  }
  return Status::ok();
}

int64_t PagedKvCache::n_tokens(int layer, int head) const {
  int64_t n = 0;
  for (int32_t id : pages(layer, head)) n += pool_[size_t(id)].n;
  return n;
}

PagedKvCache::AppendUndo PagedKvCache::append_undoable(int layer, int head, int32_t pos,
                                                      const float* k, const float* v) {
  AppendUndo u;
  u.layer = layer;
  u.head = head;
  const auto& pages = pages_[idx(layer, head)];
  u.opened = pages.empty() || pool_[size_t(pages.back())].n == kBlockTokens;
  if (!u.opened) {
    KvBlock& B = pool_[size_t(pages.back())];
    u.kmin = B.kmin;
    u.kmax = B.kmax;
    u.kq = std::move(B.kq);
    u.vq = std::move(B.vq);
  }
  append(layer, head, pos, k, v);
  return u;
}

void PagedKvCache::undo_append(AppendUndo&& u) {
  auto& pages = pages_[idx(u.layer, u.head)];
  const int32_t id = pages.back();
  KvBlock& B = pool_[size_t(id)];
  const int32_t t = --B.n;
  B.pos[size_t(t)] = -1;
  std::fill(B.k.begin() + t * head_dim_, B.k.begin() + (t + 1) * head_dim_, 0.f);
  std::fill(B.v.begin() + t * head_dim_, B.v.begin() + (t + 1) * head_dim_, 0.f);
  if (u.opened) {  // the block this append opened goes back to the pool
    pages.pop_back();
    // Undone out of pool order (a verification pass keeps some heads' appends and not
    // others'), it is not the pool's last: it waits on the free list for the next block opened.
    if (size_t(id) + 1 == pool_.size())
      pool_.pop_back();
    else
      free_.push_back(id);
    return;
  }
  B.kmin = std::move(u.kmin);
  B.kmax = std::move(u.kmax);
  B.kq = std::move(u.kq);
  B.vq = std::move(u.vq);
}

void PagedKvCache::append(int layer, int head, int32_t pos, const float* k, const float* v) {
  auto& pages = pages_[idx(layer, head)];
  if (pages.empty() || pool_[size_t(pages.back())].n == kBlockTokens) pages.push_back(new_block());
  KvBlock& B = pool_[size_t(pages.back())];
  const int d = head_dim_;
  const int32_t t = B.n++;
  B.kq = B.vq = kvstore::EncodedRows{};  // no longer the block's encoding
  B.pos[size_t(t)] = pos;
  std::copy(k, k + d, B.k.begin() + t * d);
  std::copy(v, v + d, B.v.begin() + t * d);
  if (t == 0) {
    std::copy(k, k + d, B.kmin.begin());
    std::copy(k, k + d, B.kmax.begin());
  } else {
    kvstore::fold_key_bounds(k, d, B.kmin.data(), B.kmax.data());
  }
}

Status check_cache_geometry(const PagedKvCache& cache, int n_layers, int n_kv_heads, int head_dim,
                            const std::string& who) {
  if (cache.n_layers() == n_layers && cache.n_kv_heads() == n_kv_heads &&
      cache.head_dim() == head_dim)
    return Status::ok();
  return SF_ERR(kInvalidArgument, who + ": the cache is " + std::to_string(cache.n_layers()) +
                                      " layers x " + std::to_string(cache.n_kv_heads()) +
                                      " KV heads x head_dim " + std::to_string(cache.head_dim()) +
                                      ", the model " + std::to_string(n_layers) + " x " +
                                      std::to_string(n_kv_heads) + " x " + std::to_string(head_dim));
}

}  // namespace sf::decode
