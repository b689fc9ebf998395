#include "worker/runtime/sharded_export.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <filesystem>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/free_list.h"
#include "common/thread_pool.h"

namespace sf::runtime {
namespace fs = std::filesystem;

namespace {

// Retention other than full keeps a different number of tokens of each layer and head on each
// CP chunk, but a shard's blocks (runs of 64 kept tokens) must not straddle shards
// (docs/kv-format.md "Shards"). So per (layer, KV head) the kept tokens are cut on block
// boundaries: the run of chunk c starts at kept index 64 * floor(i_c / 64), i_c the number kept
// before the chunk, so it takes over the tail of the block its predecessor began; those rows (at
// most 63 per chunk boundary) move to its rank. A run covers the positions from its first kept
// token (0 for the first run) up to the next run's, so every position is covered once; each rank
// writes one part per (layer, head) holding its runs (file tag .rR.hH).
struct HeadCut {
  std::vector<int64_t> first;  // per chunk (and the end): kept index of its first kept token
  std::vector<int64_t> start;  // per chunk (and the end): kept index where its run starts
  std::vector<std::array<int64_t, 2>> runs;  // [pos begin, pos end) of each non-empty run
  std::vector<int32_t> run_rank;             // per run: its writer's CP rank
};

int chunk_owner(int ch, int cp) { return ch < cp ? ch : 2 * cp - 1 - ch; }

HeadCut cut_head(const std::vector<int32_t>& kept, const std::vector<TokenRange>& chunks, int cp,
                 int64_t n_tokens) {
  const int nc = int(chunks.size());
  const int64_t n = int64_t(kept.size());
  HeadCut h;
  h.first.resize(size_t(nc) + 1);
  h.start.resize(size_t(nc) + 1);
  for (int ch = 0; ch < nc; ++ch) {
    h.first[size_t(ch)] =
        std::lower_bound(kept.begin(), kept.end(), chunks[size_t(ch)].begin) - kept.begin();
    h.start[size_t(ch)] =
        ch == 0 ? 0 : h.first[size_t(ch)] / kvstore::kKvBlockSize * kvstore::kKvBlockSize;
  }
  h.first[size_t(nc)] = h.start[size_t(nc)] = n;
  for (int ch = 0; ch < nc; ++ch) {
    if (h.start[size_t(ch)] == h.start[size_t(ch) + 1]) continue;
    h.runs.push_back({h.runs.empty() ? 0 : int64_t(kept[size_t(h.start[size_t(ch)])]), n_tokens});
    if (h.runs.size() > 1) h.runs[h.runs.size() - 2][1] = h.runs.back()[0];
    h.run_rank.push_back(chunk_owner(ch, cp));
  }
  // A head that keeps nothing here (a two-tier retention's empty low tier) is still one part
  // covering the prompt, with no rows, as the gathered export writes it: the manifest needs
  // every (tier, layer, head) covered. The first chunk's owner writes it; no row moves.
  if (h.runs.empty()) {
    h.runs.push_back({0, n_tokens});
    h.run_rank.push_back(chunk_owner(0, cp));
  }
  return h;
}

// Calls f(k, owner, dest) for every kept index whose row changes rank, ascending: the rows of
// chunk c past the next chunk's run start (dest: the last chunk whose run starts at or before k).
template <typename F>
void for_each_moved(const HeadCut& h, int cp, F&& f) {
  const int nc = int(h.first.size()) - 1;
  for (int ch = 0; ch < nc; ++ch)
    for (int64_t k = std::max(h.first[size_t(ch)], h.start[size_t(ch) + 1]);
         k < h.first[size_t(ch) + 1]; ++k) {
      const int dest =
          int(std::upper_bound(h.start.begin(), h.start.end() - 1, k) - h.start.begin()) - 1;
      f(k, chunk_owner(ch, cp), chunk_owner(dest, cp));
    }
}

// d values of a local K (value false) or V row as F32: copied, or widened from a bf16 local KV
// (PrefillOptions::kv_host_bf16), so a retention's cut and exchange are the same either way.
void row_f32(const model::KvCache& kv, int l, int64_t row, int64_t d, bool value, float* out) {
  if (kv.bf16()) {
    const uint16_t* p = (value ? kv.v16 : kv.k16)[size_t(l)].data() + row * d;
    for (int64_t c = 0; c < d; ++c) out[c] = bf16_to_f32(p[c]);
  } else {
    std::copy_n((value ? kv.v : kv.k)[size_t(l)].data() + row * d, d, out);
  }
}

// The local row of prompt position p on a rank holding `ranges` (its rows in prompt order).
int64_t local_row(const std::array<TokenRange, 2>& ranges, int64_t p) {
  return p < ranges[1].begin || ranges[1].size() == 0 ? p - ranges[0].begin
                                                      : ranges[0].size() + p - ranges[1].begin;
}

}  // namespace

// tier: -1 every kept token (one-tier exports); 0 / 1 the high / low tier of a two-tier one,
// which is cut on its own blocks and written as its own parts.
struct ShardedExport::Tier {
  int tier = -1;
  std::vector<std::vector<int32_t>> built;  // the high tier's positions (tier 0)
  std::vector<const std::vector<int32_t>*> pos;  // per (layer, local head): the tier's positions
  std::vector<HeadCut> cuts;
  // Rows received from other ranks, per (layer, head, kept index): K then V.
  std::map<std::array<int64_t, 3>, std::vector<float>> moved;
};

ShardedExport::~ShardedExport() = default;

namespace {

// A tier's cut, and the rows that change rank at its block boundaries moved (collective over
// the CP group: every rank cuts the tiers in the same order, so their exchanges pair up).
Result<std::unique_ptr<ShardedExport::Tier>> exchange_tier(GridComms& g,
                                                           const kvstore::KvExportSpec& spec,
                                                           const model::KvCache& local, int tier) {
  const int CP = g.shape.cp, me = g.cp_rank;
  const int64_t S = spec.n_tokens, d = spec.head_dim;
  const int hl = local.n_kv_heads, h0 = g.tp_rank * hl, nl = spec.n_layers;
  const auto chunks = zigzag_chunks(S, CP);
  const auto ranges = cp_rank_ranges(S, CP, me);
  auto t = std::make_unique<ShardedExport::Tier>();
  t->tier = tier;
  // The tier's positions per (layer, head): the retention's own lists, or the high tier built.
  t->built.resize(tier == 0 ? size_t(nl * hl) : 0);
  t->pos.resize(size_t(nl * hl));
  for (int l = 0; l < nl; ++l)
    for (int h = 0; h < hl; ++h) {
      const size_t i = size_t(l * hl + h);
      if (tier < 0) {
        t->pos[i] = &spec.retention->positions(l, h0 + h);
      } else if (tier == 1) {
        t->pos[i] = &spec.retention->low[size_t(l) * size_t(spec.n_kv_heads) + size_t(h0 + h)];
      } else {
        t->built[i] = spec.retention->high_positions(l, h0 + h);
        t->pos[i] = &t->built[i];
      }
    }
  t->cuts.resize(size_t(nl * hl));
  for (size_t i = 0; i < t->cuts.size(); ++i) t->cuts[i] = cut_head(*t->pos[i], chunks, CP, S);
  for (int step = 1; step < CP; ++step) {
    const int to = (me + step) % CP, from = (me + CP - step) % CP;
    std::vector<float> send, recv;
    std::vector<std::array<int64_t, 3>> take;
    for (int l = 0; l < nl; ++l)
      for (int h = 0; h < hl; ++h) {
        const auto& kept = *t->pos[size_t(l * hl + h)];
        for_each_moved(t->cuts[size_t(l * hl + h)], CP, [&](int64_t k, int owner, int dest) {
          if (owner == me && dest == to) {
            const int64_t row = local_row(ranges, kept[size_t(k)]) * hl + h;
            send.resize(send.size() + 2 * size_t(d));
            row_f32(local, l, row, d, false, send.data() + send.size() - 2 * size_t(d));
            row_f32(local, l, row, d, true, send.data() + send.size() - size_t(d));
          }
          if (owner == from && dest == me) take.push_back({l, h, k});
        });
      }
    recv.resize(take.size() * 2 * size_t(d));
    SF_TRY(g.cp->sendrecv(send.data(), int64_t(send.size()), to, recv.data(), int64_t(recv.size()),
                          from, DType::kF32, 900 + step));
    for (size_t i = 0; i < take.size(); ++i)
      t->moved[take[i]].assign(recv.begin() + std::ptrdiff_t(2 * i * size_t(d)),
                               recv.begin() + std::ptrdiff_t(2 * (i + 1) * size_t(d)));
  }
  return t;
}

// The (layer, KV head) parts of a tier this rank writes: one per head with runs on this rank.
struct TierParts {
  std::vector<kvstore::KvShardPart> parts;
  std::vector<int> item;  // l * hl + h
  int64_t max_span = 0;   // the longest span of positions one covers
};
TierParts tier_parts(const ShardedExport::Tier& t, int nl, int hl, int h0, int me, int rank) {
  TierParts tp;
  auto& parts = tp.parts;
  auto& part_item = tp.item;
  int64_t& max_span = tp.max_span;
  for (int l = 0; l < nl; ++l)
    for (int h = 0; h < hl; ++h) {
      const HeadCut& hc = t.cuts[size_t(l * hl + h)];
      kvstore::KvShardPart part;
      part.tier = t.tier;
      int64_t span = 0;
      for (size_t r = 0; r < hc.runs.size(); ++r)
        if (hc.run_rank[r] == me) {
          part.tokens.push_back(hc.runs[r]);
          span += hc.runs[r][1] - hc.runs[r][0];
        }
      if (part.tokens.empty()) continue;
      max_span = std::max(max_span, span);
      part.n_kv_heads = 1;
      part.kv_head0 = h0 + h;
      part.rank = rank;
      part.layer = l;
      part.file_tag = ".r" + std::to_string(rank) + ".h" + std::to_string(h0 + h);
      parts.push_back(std::move(part));
      part_item.push_back(l * hl + h);
    }
  return tp;
}

// One part per (layer, head) with runs on this rank: its rows laid out over the runs'
// positions (the writer reads only the kept rows, so the rest is never filled). Parts are
// gathered and written `width` at a time (run_items), each in a buffer pair taken from a free
// list, so at most `width` pairs are ever faulted in; entries are added in part order. No
// communication. part_done(l) after each part written (from the writing threads).
template <typename Add, typename Done>
void write_tier(const ShardedExport::Tier& t, const TierParts& tp, const std::string& tmp,
                const kvstore::KvExportSpec& spec, const model::KvCache& local, int cp, int me,
                int width, Add&& add, Done&& part_done) {
  const int64_t d = spec.head_dim;
  const int hl = local.n_kv_heads;
  const auto ranges = cp_rank_ranges(spec.n_tokens, cp, me);
  const auto& parts = tp.parts;
  const auto& part_item = tp.item;
  const int64_t max_span = tp.max_span;
  FreeList<std::array<std::vector<float>, 2>> buffers;  // K, V of a part in flight
  std::vector<Result<std::vector<std::string>>> done(parts.size(),
                                                     Result<std::vector<std::string>>(
                                                         SF_ERR(kInternal, "not written")));
  const auto write_part = [&](size_t i) -> Status {
    const int l = part_item[i] / hl, h = part_item[i] % hl;
    const auto& kept = *t.pos[size_t(part_item[i])];
    const auto buf = buffers.take();
    std::vector<float>&kbuf = (*buf)[0], &vbuf = (*buf)[1];
    kbuf.resize(size_t(max_span * d));  // once per pair
    vbuf.resize(size_t(max_span * d));
    for (int64_t base = 0; const auto& tok : parts[i].tokens) {
      const auto lo = std::lower_bound(kept.begin(), kept.end(), int32_t(tok[0])) - kept.begin();
      for (auto k = lo; k < std::ptrdiff_t(kept.size()) && kept[size_t(k)] < tok[1]; ++k) {
        const int64_t p = kept[size_t(k)];
        float* kd = kbuf.data() + (base + p - tok[0]) * d;
        float* vd = vbuf.data() + (base + p - tok[0]) * d;
        const bool mine = (p >= ranges[0].begin && p < ranges[0].end) ||
                          (p >= ranges[1].begin && p < ranges[1].end);
        if (mine) {
          const int64_t row = local_row(ranges, p) * hl + h;
          row_f32(local, l, row, d, false, kd);
          row_f32(local, l, row, d, true, vd);
        } else {
          const std::vector<float>& m = t.moved.at({l, h, int64_t(k)});
          std::copy_n(m.data(), d, kd);
          std::copy_n(m.data() + d, d, vd);
        }
      }
      base += tok[1] - tok[0];
    }
    // The spec is validated with the first part (written before the others start).
    done[i] = kvstore::export_kv_shards(
        tmp, spec, parts[i], [&](int, bool v) { return (v ? vbuf : kbuf).data(); },
        /*validate=*/i == 0);
    if (done[i].is_ok()) part_done(l);
    return done[i].status();
  };
  if (parts.empty()) return;
  // The first part alone (it validates the spec), then the rest; run_items stops starting parts
  // after a failure and the first failure in part order is the one added.
  if (write_part(0).is_ok())
    (void)run_items(parts.size() - 1, std::max(width, 1),
                    [&](size_t i) { return write_part(i + 1); });
  for (size_t i = 0; i < parts.size(); ++i) {
    add(done[i]);
    if (!done[i].is_ok()) break;
  }
}

}  // namespace

namespace {

Status bcast_str(comm::Communicator& c, std::string* str) {
  int64_t n = int64_t(str->size());
  SF_TRY(c.bcast(&n, 1, DType::kI64, 0));
  str->resize(size_t(n));
  return c.bcast(str->data(), n, DType::kU8, 0);
}

}  // namespace

Result<std::unique_ptr<ShardedExport>> ShardedExport::begin(GridComms& g, const std::string& dir,
                                                            const kvstore::KvExportSpec& spec,
                                                            const model::KvCache& local) {
  comm::Communicator& c = *g.group_comm;
  std::unique_ptr<ShardedExport> x(new ShardedExport());
  x->dir_ = dir;
  x->spec_ = &spec;
  x->local_ = &local;
  x->cp_ = g.shape.cp;
  x->cp_rank_ = g.cp_rank;
  x->tp_rank_ = g.tp_rank;
  x->rank_ = c.rank();
  x->kv_heads_ = spec.n_kv_heads / g.shape.tp;
  Status opened = Status::ok();
  if (g.leader()) {
    auto t = kvstore::begin_export(dir, /*force=*/true);
    if (t.is_ok())
      x->tmp_ = t.value();
    else
      opened = t.status();
  }
  SF_TRY(bcast_str(c, &x->tmp_));
  if (x->tmp_.empty())
    return g.leader() ? opened : SF_ERR(kIo, "the leader could not open the export");
  // With a retention other than full, block-aligned runs per layer and head
  // (cut_head); two tiers are each cut on their own blocks.
  // A failed exchange (the communicator aborted) leaves no temporary directory behind.
  const auto dropped = [&](const Status& st) {
    std::error_code ec;
    if (g.leader()) fs::remove_all(x->tmp_, ec);
    return st;
  };
  if (spec.retention && spec.retention->has_low()) {
    for (int tier : {0, 1}) {
      auto t = exchange_tier(g, spec, local, tier);
      if (!t.is_ok()) return dropped(t.status());
      x->tiers_.push_back(std::move(t).value());
    }
  } else if (spec.retention && !spec.retention->is_full()) {
    auto t = exchange_tier(g, spec, local, -1);
    if (!t.is_ok()) return dropped(t.status());
    x->tiers_.push_back(std::move(t).value());
  }
  return x;
}

std::string ShardedExport::write(const kvstore::ExportOptions& eo) {
  const kvstore::KvExportSpec& spec = *spec_;
  const model::KvCache& local = *local_;
  std::string mine = "ok";
  auto add = [&](const Result<std::vector<std::string>>& e) {
    if (mine.starts_with("error")) return;  // the first failure is the one reported
    if (!e.is_ok()) {
      mine = "error\nrank " + std::to_string(rank_) + ": " + e.status().message();
      return;
    }
    for (const std::string& x : e.value()) mine += "\n" + x;
  };
  if (!tiers_.empty()) {
    // A retention's parts are (layer, KV head) files, each tier in turn, reading `local`: a
    // layer is free once its parts in every tier are written (at once where it has none here).
    const int hl = local.n_kv_heads;
    std::vector<TierParts> parts;
    std::vector<std::atomic<int>> left(static_cast<size_t>(spec.n_layers));
    for (const auto& t : tiers_) {
      parts.push_back(tier_parts(*t, spec.n_layers, hl, tp_rank_ * hl, cp_rank_, rank_));
      for (const int it : parts.back().item) left[size_t(it / hl)].fetch_add(1);
    }
    for (size_t l = 0; l < left.size(); ++l)
      if (left[l].load() == 0 && eo.on_layer_written) eo.on_layer_written(int(l));
    const auto part_done = [&](int l) {
      if (eo.on_layer_written && left[size_t(l)].fetch_sub(1) == 1) eo.on_layer_written(l);
    };
    for (size_t i = 0; i < tiers_.size(); ++i)
      write_tier(*tiers_[i], parts[i], tmp_, spec, local, cp_, cp_rank_,
                 std::max(eo.layers_in_flight, 1), add, part_done);
    return mine;
  }
  return write_full(
      [&](int l, bool v) {
        return local.bf16() ? kvstore::LayerRows::bf16((v ? local.v16 : local.k16)[size_t(l)].data())
                            : kvstore::LayerRows((v ? local.v : local.k)[size_t(l)].data());
      },
      eo);
}

std::string ShardedExport::write_streamed(LayerGate& gate, kvstore::ExportOptions eo) {
  if (!tiers_.empty())
    return "error\nrank " + std::to_string(rank_) +
           ": a streamed export takes full retention only (a retention's cut needs the whole "
           "prefill)";
  eo.wait_layer = [&gate](int l) { return gate.wait(l); };
  return write_full([&gate](int l, bool v) { return gate.rows(l, v); }, eo);
}

// Full retention: this rank's CP chunks (merged when adjacent) of its TP slice's KV heads.
std::string ShardedExport::write_full(const kvstore::LayerSource& src,
                                      const kvstore::ExportOptions& eo) {
  kvstore::KvShardPart part;
  for (const TokenRange& p : cp_rank_pieces(spec_->n_tokens, cp_, cp_rank_))
    part.tokens.push_back({p.begin, p.end});
  part.n_kv_heads = kv_heads_;
  part.kv_head0 = tp_rank_ * kv_heads_;
  part.rank = rank_;
  part.file_tag = ".r" + std::to_string(rank_);
  if (part.tokens.empty()) {
    // Nothing of the prompt here: every layer is done with at once.
    if (eo.on_layer_written)
      for (int l = 0; l < spec_->n_layers; ++l) eo.on_layer_written(l);
    return "ok";
  }
  auto e = kvstore::export_kv_shards(tmp_, *spec_, part, src, /*validate=*/true, eo);
  if (!e.is_ok()) return "error\nrank " + std::to_string(rank_) + ": " + e.status().message();
  std::string mine = "ok";
  for (const std::string& x : e.value()) mine += "\n" + x;
  return mine;
}

LayerGate::LayerGate(int n_layers)
    : rows_(static_cast<size_t>(std::max(n_layers, 0))),
      ready_(static_cast<size_t>(std::max(n_layers, 0)), 0) {}

Status LayerGate::publish(int l, const model::KvCache& kv) {
  if (l < 0 || size_t(l) >= rows_.size())
    return SF_ERR(kInvalidArgument, "layer gate: layer " + std::to_string(l) + " of " +
                                        std::to_string(rows_.size()));
  const bool b = kv.bf16();
  if (size_t(l) >= (b ? kv.k16.size() : kv.k.size()))
    return SF_ERR(kInvalidArgument, "layer gate: the cache has no layer " + std::to_string(l));
  std::array<kvstore::LayerRows, 2> r;
  for (int v = 0; v < 2; ++v)
    r[size_t(v)] = b ? kvstore::LayerRows::bf16((v ? kv.v16 : kv.k16)[size_t(l)].data())
                     : kvstore::LayerRows((v ? kv.v : kv.k)[size_t(l)].data());
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ready_[size_t(l)])
      return SF_ERR(kInternal, "layer gate: layer " + std::to_string(l) + " published twice");
    rows_[size_t(l)] = r;
    ready_[size_t(l)] = 1;
    ++n_ready_;
  }
  cv_.notify_all();
  return Status::ok();
}

void LayerGate::fail(Status st) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_.is_ok()) failed_ = st.is_ok() ? SF_ERR(kInternal, "layer gate: failed") : st;
  }
  cv_.notify_all();
}

Status LayerGate::wait(int l) {
  if (l < 0 || size_t(l) >= rows_.size())
    return SF_ERR(kInvalidArgument, "layer gate: layer " + std::to_string(l) + " of " +
                                        std::to_string(rows_.size()));
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return ready_[size_t(l)] || !failed_.is_ok(); });
  return failed_;  // (ok unless failed)
}

kvstore::LayerRows LayerGate::rows(int l, bool value) const {
  std::lock_guard<std::mutex> lk(mu_);
  return l >= 0 && size_t(l) < rows_.size() && ready_[size_t(l)] ? rows_[size_t(l)][value ? 1 : 0]
                                                                 : kvstore::LayerRows();
}

bool LayerGate::published(int l) const {
  std::lock_guard<std::mutex> lk(mu_);
  return l >= 0 && size_t(l) < ready_.size() && ready_[size_t(l)];
}

int LayerGate::n_published() const {
  std::lock_guard<std::mutex> lk(mu_);
  return n_ready_;
}

Status LayerGate::check_in_place(const model::KvCache& kv) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t l = 0; l < rows_.size(); ++l) {
    if (!ready_[l]) continue;
    const bool b = kv.bf16();
    const void* k = l < (b ? kv.k16.size() : kv.k.size())
                        ? (b ? static_cast<const void*>(kv.k16[l].data()) : kv.k[l].data())
                        : nullptr;
    const void* v = l < (b ? kv.v16.size() : kv.v.size())
                        ? (b ? static_cast<const void*>(kv.v16[l].data()) : kv.v[l].data())
                        : nullptr;
    if (k != rows_[l][0].data || v != rows_[l][1].data)
      return SF_ERR(kInternal, "streamed export: layer " + std::to_string(l) +
                                   "'s K/V moved after the prefill published it");
  }
  return Status::ok();
}

Status ShardedExport::finish(GridComms& g, const std::string& mine) {
  comm::Communicator& c = *g.group_comm;
  const int n = c.size();
  std::vector<int64_t> lens(static_cast<size_t>(n));
  const int64_t my_len = int64_t(mine.size());
  // A failed exchange ends the job (the communicator is aborted); the leader still removes its
  // temporary directory, which no later step would.
  const auto drop_tmp = [&](Status st) {
    std::error_code ec;
    if (g.leader() && !tmp_.empty()) fs::remove_all(tmp_, ec);
    return st;
  };
  if (Status st = c.all_gather(&my_len, lens.data(), 1, DType::kI64); !st.is_ok())
    return drop_tmp(st);
  int64_t total = 0;
  for (int64_t x : lens) total += x;
  std::string all(size_t(total), '\0');
  if (Status st = c.all_gatherv(mine.data(), my_len, all.data(), lens, DType::kU8); !st.is_ok())
    return drop_tmp(st);
  Status st = Status::ok();
  if (g.leader()) {
    std::vector<std::string> entries;
    int64_t off = 0;
    for (int r = 0; r < n && st.is_ok(); ++r) {
      std::istringstream in(all.substr(size_t(off), size_t(lens[size_t(r)])));
      off += lens[size_t(r)];
      std::string line;
      std::getline(in, line);
      if (line != "ok") {
        std::string msg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        st = SF_ERR(kIo, "sharded export: " + msg);
        break;
      }
      while (std::getline(in, line)) entries.push_back(line);
    }
    if (st.is_ok()) {
      st = kvstore::export_kv_manifest(tmp_, *spec_, entries);
      if (st.code() == Code::kNotFound)  // a shard the leader cannot see
        st = SF_ERR(kIo, "sharded export: " + st.message() +
                             " as the group leader sees it (--out must be on a filesystem every "
                             "rank of the group shares; --export gathered writes everything "
                             "from the leader)");
    }
    if (st.is_ok()) st = kvstore::finish_export(tmp_, dir_, /*force=*/true);  // (as begin)
    if (!st.is_ok()) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
    }
  }
  // Every rank learns the outcome (the leader's message).
  std::string msg = st.is_ok() ? std::string() : st.message();
  SF_TRY(bcast_str(c, &msg));
  return msg.empty() ? Status::ok() : SF_ERR(kIo, msg);
}

Status export_sharded(GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
                      const model::KvCache& local) {
  auto x = ShardedExport::begin(g, dir, spec, local);
  if (!x.is_ok()) return x.status();
  kvstore::ExportOptions eo;
  eo.layers_in_flight = kvstore::default_layers_in_flight();
  const std::string mine = x.value()->write(eo);
  return x.value()->finish(g, mine);
}

}  // namespace sf::runtime
