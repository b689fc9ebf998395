#include "kvstore/tiered_kv.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <limits>
#include <mutex>
#include <thread>

#include "common/timing.h"

namespace sf::kvstore {
namespace {
// Layers enqueued and not yet placed, at most, when a disk tier drains the host: the one being
// enqueued and the one before it (its copies and importance still in flight).
constexpr int kMaxInflight = 2;
// Blocks a demotion to disk moves under one hold of the pool's lock: the forward's allocations
// and placements wait at most this long behind the drain.
constexpr size_t kDrainBatch = 16;
}  // namespace

struct TieredKv::Drainer {
  std::thread thread;
  mutable std::mutex mu;
  // Signalled when a layer is queued, a batch has moved (host room), the drain goes idle, or it
  // must stop.
  mutable std::condition_variable cv;
  std::deque<int> queue;
  int current = -1;  // the layer being drained, -1: idle
  bool stop = false;
  Status error;
  int64_t keep = 0;  // host blocks a placed layer keeps (host_keep of the prompt being tiered)
};

Result<std::unique_ptr<TieredKv>> TieredKv::create(BlockPool* pool, const TieredKvConfig& cfg) {
  SF_ENSURE(pool != nullptr, kInvalidArgument, "tiered kv: pool is null");
  SF_ENSURE(cfg.n_layers > 0, kInvalidArgument, "tiered kv: n_layers must be positive");
  SF_ENSURE(cfg.sink_blocks >= 0 && cfg.recent_blocks >= 0, kInvalidArgument,
            "tiered kv: sink_blocks and recent_blocks must be >= 0");
  SF_ENSURE(int(cfg.fast) >= 0 && int(cfg.fast) + 1 < kNumTiers, kInvalidArgument,
            "tiered kv: the fast tier needs a slower tier below it");
  const int64_t want = int64_t(2) * kPoolBlockTokens * cfg.n_kv_heads * cfg.head_dim * 4;
  SF_ENSURE(cfg.n_kv_heads > 0 && cfg.head_dim > 0 && want == pool->block_bytes(),
            kInvalidArgument,
            "tiered kv: pool blocks are " + std::to_string(pool->block_bytes()) + " bytes, " +
                std::to_string(cfg.n_kv_heads) + " KV heads x head_dim " +
                std::to_string(cfg.head_dim) + " need " + std::to_string(want));
  std::unique_ptr<TieredKv> t(new TieredKv());
  t->pool_ = pool;
  t->cfg_ = cfg;
  const int64_t fast_blocks = pool->stats(cfg.fast).capacity_bytes / pool->block_bytes();
  SF_ENSURE(pool->stats(Tier(int(cfg.fast) + 1)).capacity_bytes > 0, kInvalidArgument,
            std::string("tiered kv: cold blocks need the tier below ") + tier_name(cfg.fast) +
                " (" + tier_name(Tier(int(cfg.fast) + 1)) + "), whose budget is 0");
  SF_ENSURE(fast_blocks > 0, kInvalidArgument,
            std::string("tiered kv: the fast tier (") + tier_name(cfg.fast) +
                ") has no room for one block of " + std::to_string(pool->block_bytes()) + " bytes");
  t->quota_.resize(size_t(cfg.n_layers));
  for (int l = 0; l < cfg.n_layers; ++l)
    t->quota_[size_t(l)] = fast_blocks / cfg.n_layers + (l < fast_blocks % cfg.n_layers ? 1 : 0);
  t->tokens_.assign(size_t(cfg.n_layers), 0);
  t->pending_.assign(size_t(cfg.n_layers), 0);
  t->pending_stream_.assign(size_t(cfg.n_layers), nullptr);
  t->blocks_.resize(size_t(cfg.n_layers));
  t->scores_.resize(size_t(cfg.n_layers));
  t->placed_.resize(size_t(cfg.n_layers));
  t->drained_.assign(size_t(cfg.n_layers), 0);
  t->kbuf_.resize(size_t(pool->half_floats()));
  t->vbuf_.resize(size_t(pool->half_floats()));
  if (cfg.fast == Tier::kDevice && pool->stats(Tier::kDisk).capacity_bytes > 0) {
    t->drain_ = std::make_unique<Drainer>();
    TieredKv* self = t.get();
    // A thread that cannot start (pid or memory limits) is an error, not an abort: the
    // destructor would otherwise join a thread that never ran.
    try {
      t->drain_->thread = std::thread([self] { self->drain_loop(); });
    } catch (const std::exception& e) {
      t->drain_.reset();
      return SF_ERR(kResourceExhausted,
                    std::string("tiered kv: cannot start the disk drain thread: ") + e.what());
    }
  }
  return t;
}

TieredKv::~TieredKv() {
  if (drain_) {
    {
      std::lock_guard<std::mutex> g(drain_->mu);
      drain_->stop = true;
    }
    drain_->cv.notify_all();
    drain_->thread.join();
  }
  for (size_t l = 0; l < blocks_.size(); ++l) release(int(l));  // empty when create() failed
}

void TieredKv::release(int layer) {
  if (blocks_[size_t(layer)].empty() && pending_[size_t(layer)] == 0) return;
  if (drain_) {
    // The drain must not move blocks that are being freed (their ids may be handed out again).
    std::unique_lock<std::mutex> lk(drain_->mu);
    auto& q = drain_->queue;
    q.erase(std::remove(q.begin(), q.end(), layer), q.end());
    drain_->cv.wait(lk, [&] { return drain_->current != layer; });
  }
  // A layer enqueued and not placed may still have copies into its blocks on the caller's
  // stream (a prefill that failed between the two, a second enqueue, the destructor): they land
  // before the blocks can be handed out again.
  if (pending_[size_t(layer)] != 0 && pending_stream_[size_t(layer)])
    (void)BlockPool::wait_stream(pending_stream_[size_t(layer)]);
  // Our blocks are never pinned by us and are live, so free() cannot fail here. Freed last to
  // first: the pool hands slots back last in, first out, so the layer's next blocks get them
  // in ascending order again (runs of consecutive slots copy as one).
  const auto& ids = blocks_[size_t(layer)];
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) (void)pool_->free(*it);
  blocks_[size_t(layer)].clear();
  scores_[size_t(layer)].clear();
  tokens_[size_t(layer)] = 0;
  pending_[size_t(layer)] = 0;
  pending_stream_[size_t(layer)] = nullptr;
  placed_[size_t(layer)] = {};
  drained_[size_t(layer)] = 0;
}

int64_t TieredKv::host_keep(int64_t n_tokens) const {
  const int64_t nb = (n_tokens + kPoolBlockTokens - 1) / kPoolBlockTokens;
  if (!drain_) return nb;
  int64_t landing = 0;
  for (int64_t q : quota_) landing = std::max(landing, nb - q);
  const int64_t host = pool_->stats(Tier::kHost).capacity_bytes / pool_->block_bytes();
  const int64_t avail = host - kMaxInflight * landing - 1;
  return avail < 0 ? -1 : avail / cfg_.n_layers;
}

void TieredKv::wait_idle() const {
  if (!drain_) return;
  std::unique_lock<std::mutex> lk(drain_->mu);
  drain_->cv.wait(lk, [&] { return drain_->queue.empty() && drain_->current < 0; });
}

Status TieredKv::wait_drained() const {
  wait_idle();
  return drain_error();
}

Status TieredKv::drain_error() const {
  if (!drain_) return Status::ok();
  std::lock_guard<std::mutex> g(drain_->mu);
  return drain_->error;
}

void TieredKv::drain_loop() {
  Drainer& d = *drain_;
  std::unique_lock<std::mutex> lk(d.mu);
  for (;;) {
    d.cv.wait(lk, [&] { return d.stop || !d.queue.empty(); });
    if (d.stop) return;
    d.current = d.queue.front();
    d.queue.pop_front();
    lk.unlock();
    // An exception (bad_alloc in the layer's bookkeeping) must not leave the thread, which
    // would end the process: it becomes the drain's error, reported as any other.
    Status st = Status::ok();
    try {
      st = drain_layer(d.current);
    } catch (const std::exception& e) {
      st = SF_ERR(kResourceExhausted, std::string("tiered kv: disk drain failed: ") + e.what());
    }
    lk.lock();
    if (!st.is_ok() && d.error.is_ok()) {
      d.error = st;
      d.queue.clear();
    }
    d.current = -1;
    d.cv.notify_all();
  }
}

// Runs on the drain thread. The layer's blocks and scores stay put meanwhile: release() waits
// for this layer to be done, and nothing else changes a placed layer.
Status TieredKv::drain_layer(int layer) {
  Drainer& d = *drain_;
  int64_t keep;
  {
    std::lock_guard<std::mutex> g(d.mu);
    keep = d.keep;
  }
  const std::vector<BlockId>& ids = blocks_[size_t(layer)];
  // The layer's host blocks in placement order: the first `keep` stay, the rest go to disk.
  std::vector<int64_t> down;
  int64_t kept = 0;
  for (int64_t b : placement_order(scores_[size_t(layer)], cfg_.sink_blocks, cfg_.recent_blocks)) {
    const BlockId id = ids[size_t(b)];
    SF_ASSIGN(const Tier t, pool_->tier_of(id));
    SF_ASSIGN(const int pins, pool_->pins(id));
    if (t != Tier::kHost || pins > 0) continue;
    if (kept < keep)
      ++kept;
    else
      down.push_back(b);
  }
  // In position order: the host slots were taken in ascending order, so runs copy as one write.
  std::sort(down.begin(), down.end());
  std::vector<BlockId> batch;
  for (size_t i = 0; i < down.size(); i += kDrainBatch) {
    batch.clear();
    for (size_t j = i; j < std::min(down.size(), i + kDrainBatch); ++j)
      batch.push_back(ids[size_t(down[j])]);
    const Status st = pool_->move_batch(batch, Tier::kDisk);
    if (!st.is_ok())
      return Status(st.code(), "tiered kv: layer " + std::to_string(layer) +
                                   ": demoting cold host blocks to disk: " + st.message());
    drained_[size_t(layer)] += int64_t(batch.size());
    {
      std::lock_guard<std::mutex> g(d.mu);
      if (d.stop) return Status::ok();
    }
    d.cv.notify_all();  // host room for a waiting enqueue_device()
  }
  return Status::ok();
}

float block_score(std::span<const float> importance, int n_kv_heads, int64_t n_tokens, int64_t t0,
                  int64_t t1) {
  if (importance.empty()) return 0.f;
  float s = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < n_kv_heads; ++g)
    for (int64_t j = t0; j < t1; ++j) s = std::max(s, importance[size_t(g * n_tokens + j)]);
  return s;
}

Status TieredKv::on_layer(int layer, const TensorView& k, const TensorView& v,
                          std::span<const float> importance) {
  SF_ENSURE(layer >= 0 && layer < cfg_.n_layers, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " out of range");
  const int hkv = cfg_.n_kv_heads, d = cfg_.head_dim;
  const int64_t n = k.shape[0];
  auto shape_ok = [&](const TensorView& t) {
    return t.data && t.dtype == DType::kF32 && t.device == Device::kCpu && t.ndim == 3 &&
           t.shape[0] == n && t.shape[1] == hkv && t.shape[2] == d && t.stride[2] == 1 &&
           t.stride[1] == d && t.stride[0] == int64_t(hkv) * d;
  };
  SF_ENSURE(shape_ok(k) && shape_ok(v), kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " K/V must be contiguous F32 host [" +
                std::to_string(n) + ", " + std::to_string(hkv) + ", " + std::to_string(d) + "]");
  SF_ENSURE(importance.empty() || int64_t(importance.size()) == int64_t(hkv) * n,
            kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " importance has " +
                std::to_string(importance.size()) + " scores, want " + std::to_string(hkv * n));
  release(layer);
  const int64_t row = int64_t(hkv) * d;
  const int64_t nb = (n + kPoolBlockTokens - 1) / kPoolBlockTokens;
  const float* kp = static_cast<const float*>(k.data);
  const float* vp = static_cast<const float*>(v.data);
  std::vector<BlockId>& ids = blocks_[size_t(layer)];
  Status st;
  for (int64_t b = 0; b < nb && st.is_ok(); ++b) {
    const int64_t t0 = b * kPoolBlockTokens, t1 = std::min(n, t0 + kPoolBlockTokens);
    // Written to the fast tier first (as on GPU, where the KV is produced there); alloc spills
    // to a slower tier when the fast one is full and place() sorts it out below.
    Result<BlockId> id = pool_->alloc(cfg_.fast);
    if (!id.is_ok()) {
      st = SF_ERR(kResourceExhausted, "tiered kv: layer " + std::to_string(layer) + " block " +
                                          std::to_string(b) + " of " + std::to_string(nb) +
                                          " fits no tier: " + id.status().message());
      break;
    }
    ids.push_back(id.value());
    if (t1 - t0 == kPoolBlockTokens) {
      // A full block is already laid out as the pool's: written straight from the forward's KV.
      st = pool_->write(id.value(), kp + t0 * row, vp + t0 * row);
    } else {
      // A partial last block is zero-padded: pool blocks are always 64 tokens.
      std::fill(kbuf_.begin(), kbuf_.end(), 0.f);
      std::fill(vbuf_.begin(), vbuf_.end(), 0.f);
      std::memcpy(kbuf_.data(), kp + t0 * row, size_t((t1 - t0) * row) * sizeof(float));
      std::memcpy(vbuf_.data(), vp + t0 * row, size_t((t1 - t0) * row) * sizeof(float));
      st = pool_->write(id.value(), kbuf_.data(), vbuf_.data());
    }
  }
  if (st.is_ok()) st = rank_and_place(layer, n, importance);
  if (!st.is_ok()) release(layer);
  return st;
}

Status TieredKv::rank_and_place(int layer, int64_t n, std::span<const float> importance) {
  const std::vector<BlockId>& ids = blocks_[size_t(layer)];
  std::vector<float>& sc = scores_[size_t(layer)];
  sc.clear();
  for (size_t b = 0; b < ids.size(); ++b) {
    const int64_t t0 = int64_t(b) * kPoolBlockTokens;
    sc.push_back(block_score(importance, cfg_.n_kv_heads, n, t0,
                             std::min(n, t0 + kPoolBlockTokens)));
  }
  SF_ASSIGN(placed_[size_t(layer)], pool_->place(ids, sc, cfg_.sink_blocks, cfg_.recent_blocks,
                                                 cfg_.fast, quota_[size_t(layer)]));
  tokens_[size_t(layer)] = n;
  return Status::ok();
}

Status TieredKv::enqueue_device(int layer, const float* k, const float* v, int64_t n_rows,
                                void* stream) {
  SF_ENSURE(layer >= 0 && layer < cfg_.n_layers, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " out of range");
  SF_ENSURE(cfg_.fast == Tier::kDevice, kInvalidArgument,
            "tiered kv: K/V from device memory need the device as the fast tier");
  SF_ENSURE(k && v && n_rows > 0, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " enqueue_device needs K/V rows");
  SF_TRY(drain_error());
  // With a disk tier, a prompt starting at layer 0 gives back every layer of the one before:
  // host_keep() and the wait for room count only this prompt's layers, and an earlier prompt's
  // layers would still hold their own (other) share of the host.
  if (drain_ && layer == 0)
    for (int l = 0; l < cfg_.n_layers; ++l) release(l);
  release(layer);
  const int64_t nb = (n_rows + kPoolBlockTokens - 1) / kPoolBlockTokens;
  // The layer's device share goes, before any score exists, to the blocks place() keeps first
  // (sink, recent window), then to those nearest the end; the rest go straight to pinned host.
  // So each layer starts within its quota, and place_device() only swaps within the layer.
  const int64_t sink = std::min(cfg_.sink_blocks, nb);
  const int64_t recent = std::min(cfg_.recent_blocks, nb - sink);
  std::vector<char> fast(size_t(nb), 0);
  int64_t left = quota_[size_t(layer)];
  const auto take = [&](int64_t b) {
    if (left > 0 && !fast[size_t(b)]) {
      fast[size_t(b)] = 1;
      --left;
    }
  };
  for (int64_t b = 0; b < sink; ++b) take(b);
  for (int64_t b = nb - 1; b >= nb - recent; --b) take(b);
  for (int64_t b = nb - 1; b >= 0; --b) take(b);
  std::vector<Tier> where(static_cast<size_t>(nb));
  int64_t host_blocks = 0;
  for (int64_t b = 0; b < nb; ++b) {
    where[size_t(b)] = fast[size_t(b)] ? Tier::kDevice : Tier::kHost;
    host_blocks += !fast[size_t(b)];
  }
  if (drain_) {
    // Host room for this layer's landing plus one block to swap through: earlier layers' cold
    // blocks leave for disk in the background. When the drain has nothing left to move, the
    // allocation below says what does not fit.
    const int64_t keep = host_keep(n_rows);
    SF_ENSURE(keep >= 0, kResourceExhausted,
              "tiered kv: layer " + std::to_string(layer) + ": the host tier cannot hold " +
                  std::to_string(kMaxInflight) + " layers' landings of " +
                  std::to_string(host_blocks) + " blocks plus one (see check_room)");
    const int64_t bb = pool_->block_bytes();
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lk(drain_->mu);
    drain_->keep = keep;
    drain_->cv.wait(lk, [&] {
      const TierStats h = pool_->stats(Tier::kHost);
      return !drain_->error.is_ok() || (h.capacity_bytes - h.used_bytes) / bb > host_blocks ||
             (drain_->queue.empty() && drain_->current < 0);
    });
    host_wait_s_ += sf::seconds_since(t0);
    SF_TRY(drain_->error);
  }
  Result<std::vector<BlockId>> got = pool_->alloc_batch(where, Tier::kHost);
  if (!got.is_ok())
    return SF_ERR(kResourceExhausted, "tiered kv: layer " + std::to_string(layer) + ": " +
                                          got.status().message() +
                                          " (it fits neither the device nor the host tier)");
  std::vector<BlockId>& ids = blocks_[size_t(layer)];
  ids = std::move(got).value();
  // Nothing is left in flight when this fails, so the blocks can go back at once.
  const Status st = pool_->write_from_device_async(ids, k, v, n_rows, stream);
  if (!st.is_ok()) {
    release(layer);
    return st;
  }
  pending_[size_t(layer)] = n_rows;
  pending_stream_[size_t(layer)] = stream;
  return Status::ok();
}

Status TieredKv::place_device(int layer, std::span<const float> importance) {
  SF_ENSURE(layer >= 0 && layer < cfg_.n_layers, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " out of range");
  const int64_t n = pending_[size_t(layer)];
  SF_ENSURE(n > 0, kInvalidArgument,
            "tiered kv: place_device of layer " + std::to_string(layer) +
                " without enqueue_device");
  SF_ENSURE(importance.empty() || int64_t(importance.size()) == int64_t(cfg_.n_kv_heads) * n,
            kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " importance has " +
                std::to_string(importance.size()) + " scores, want " +
                std::to_string(int64_t(cfg_.n_kv_heads) * n));
  // The caller let the stream pass the copies (the contract above).
  pending_[size_t(layer)] = 0;
  pending_stream_[size_t(layer)] = nullptr;
  Status st = drain_error();
  if (st.is_ok()) st = rank_and_place(layer, n, importance);
  if (!st.is_ok()) {
    release(layer);
    return st;
  }
  if (drain_) {
    {
      std::lock_guard<std::mutex> g(drain_->mu);
      drain_->queue.push_back(layer);
    }
    drain_->cv.notify_all();
  }
  return Status::ok();
}

Status TieredKv::check_room(int64_t n_tokens) const {
  const int64_t bb = pool_->block_bytes();
  const int64_t nb = (n_tokens + kPoolBlockTokens - 1) / kPoolBlockTokens;
  if (cfg_.fast != Tier::kDevice) {
    const int64_t have = (pool_->stats(Tier::kHost).capacity_bytes +
                          pool_->stats(Tier::kDisk).capacity_bytes) / bb;
    const int64_t need = int64_t(cfg_.n_layers) * nb;
    if (have < need)
      return SF_ERR(kResourceExhausted,
                    "tiered kv: the host and disk tiers hold " + std::to_string(have) +
                        " blocks of " + std::to_string(bb) + " bytes; " + std::to_string(n_tokens) +
                        " tokens need " + std::to_string(nb) + " a layer, " + std::to_string(need) +
                        " for " + std::to_string(cfg_.n_layers) + " layers: " +
                        std::to_string(need * bb) + " bytes of host and disk budget or more");
    return Status::ok();
  }
  if (drain_) {
    int64_t landing = 0;
    for (int64_t q : quota_) landing = std::max(landing, nb - q);
    const int64_t keep = host_keep(n_tokens);
    const int64_t host = pool_->stats(Tier::kHost).capacity_bytes / bb;
    if (keep < 0)
      return SF_ERR(kResourceExhausted,
                    "tiered kv: the host tier holds " + std::to_string(host) + " blocks of " +
                        std::to_string(bb) + " bytes; with a disk tier it must hold " +
                        std::to_string(kMaxInflight) + " layers' blocks beyond the device's share (" +
                        std::to_string(landing) + " each at " + std::to_string(n_tokens) +
                        " tokens) plus one to swap through: a host budget of " +
                        std::to_string((kMaxInflight * landing + 1) * bb) + " bytes or more");
    int64_t disk_need = 0;
    for (int64_t q : quota_) disk_need += std::max<int64_t>(0, nb - q - keep);
    const int64_t disk = pool_->stats(Tier::kDisk).capacity_bytes / bb;
    if (disk >= disk_need) return Status::ok();
    return SF_ERR(kResourceExhausted,
                  "tiered kv: the disk tier holds " + std::to_string(disk) + " blocks of " +
                      std::to_string(bb) + " bytes; " + std::to_string(n_tokens) +
                      " tokens need " + std::to_string(disk_need) +
                      " beyond the device's share and the host's (" + std::to_string(keep) +
                      " a layer): a disk budget of " + std::to_string(disk_need * bb) +
                      " bytes or more");
  }
  int64_t need = 1;
  for (int64_t q : quota_) need += std::max<int64_t>(0, nb - q);
  const int64_t host = pool_->stats(Tier::kHost).capacity_bytes;
  if (host / bb >= need) return Status::ok();
  return SF_ERR(kResourceExhausted,
                "tiered kv: the host tier holds " + std::to_string(host / bb) + " blocks of " +
                    std::to_string(bb) + " bytes; " + std::to_string(n_tokens) +
                    " tokens need " + std::to_string(need - 1) +
                    " beyond the device's share, plus one to swap through: a host budget of " +
                    std::to_string(need * bb) + " bytes or more");
}

model::DeviceLayerKvSink TieredKv::device_sink() {
  model::DeviceLayerKvSink s;
  s.enqueue = [this](int layer, const float* k, const float* v, int64_t n_rows, void* stream) {
    return enqueue_device(layer, k, v, n_rows, stream);
  };
  s.place = [this](int layer, std::span<const float> importance) {
    return place_device(layer, importance);
  };
  s.max_inflight = drain_ ? kMaxInflight : 0;
  s.abandon = [this] { abandon_pending(); };
  return s;
}

void TieredKv::abandon_pending() {
  for (size_t l = 0; l < pending_.size(); ++l)
    if (pending_[l] != 0) release(int(l));
}

model::LayerKvHook TieredKv::hook() {
  return [this](int layer, const TensorView& k, const TensorView& v,
                std::span<const float> importance) { return on_layer(layer, k, v, importance); };
}

Status TieredKv::read_layer(int layer, std::vector<float>* k, std::vector<float>* v) const {
  SF_ENSURE(layer >= 0 && layer < cfg_.n_layers, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " out of range");
  SF_ENSURE(k && v, kInvalidArgument, "tiered kv: read_layer needs k and v");
  SF_ENSURE(pending_[size_t(layer)] == 0, kInvalidArgument,
            "tiered kv: layer " + std::to_string(layer) + " is enqueued but not placed yet");
  // No prompt is empty: a layer without tokens was never placed, or was released after a failure,
  // and an empty read would pass for its K/V.
  SF_ENSURE(tokens_[size_t(layer)] > 0, kNotFound,
            "tiered kv: layer " + std::to_string(layer) +
                " holds no K/V (never placed, or released after a failure)");
  wait_idle();  // the drain's moves are whole, but the layer is read where it ends up
  const int64_t n = tokens_[size_t(layer)], row = int64_t(cfg_.n_kv_heads) * cfg_.head_dim;
  k->resize(size_t(n * row));
  v->resize(size_t(n * row));
  std::vector<float> kb(size_t(pool_->half_floats())), vb(size_t(pool_->half_floats()));
  const auto& ids = blocks_[size_t(layer)];
  for (size_t b = 0; b < ids.size(); ++b) {
    SF_TRY(pool_->read(ids[b], kb.data(), vb.data()));
    const int64_t t0 = int64_t(b) * kPoolBlockTokens, t1 = std::min(n, t0 + kPoolBlockTokens);
    std::memcpy(k->data() + t0 * row, kb.data(), size_t((t1 - t0) * row) * sizeof(float));
    std::memcpy(v->data() + t0 * row, vb.data(), size_t((t1 - t0) * row) * sizeof(float));
  }
  return Status::ok();
}

Status pool_metrics_export(const BlockPool& pool, MetricsRegistry* reg) {
  SF_ENSURE(reg != nullptr, kInvalidArgument, "pool metrics: registry is null");
  SF_TRY(reg->add_family("sparsefill_kv_pool_capacity_bytes", MetricKind::kGauge,
                         "KV block pool budget of a tier, whole blocks."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_bytes", MetricKind::kGauge,
                         "KV block pool bytes in use on a tier."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_blocks", MetricKind::kGauge,
                         "KV blocks resident on a tier."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_blocks_moved_total", MetricKind::kCounter,
                         "KV blocks moved out of a tier: down to a slower or up to a faster one."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_bytes_moved_total", MetricKind::kCounter,
                         "Bytes of KV blocks moved out of a tier, by direction."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_spilled_total", MetricKind::kCounter,
                         "KV blocks allocated on a tier because a faster one was full."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_full_refusals_total", MetricKind::kCounter,
                         "Allocations or moves refused because a tier was full."));
  SF_TRY(reg->add_family("sparsefill_kv_pool_io_errors_total", MetricKind::kCounter,
                         "Copy or file I/O failures on a tier."));
  for (int t = 0; t < kNumTiers; ++t) {
    const TierStats s = pool.stats(Tier(t));
    const std::string tn = tier_name(Tier(t));
    const MetricLabels tl = {{"tier", tn}};
    SF_TRY(reg->set("sparsefill_kv_pool_capacity_bytes", tl, double(s.capacity_bytes)));
    SF_TRY(reg->set("sparsefill_kv_pool_bytes", tl, double(s.used_bytes)));
    SF_TRY(reg->set("sparsefill_kv_pool_blocks", tl, double(s.blocks)));
    SF_TRY(reg->set("sparsefill_kv_pool_spilled_total", tl, double(s.spilled_in)));
    SF_TRY(reg->set("sparsefill_kv_pool_full_refusals_total", tl, double(s.full_refusals)));
    SF_TRY(reg->set("sparsefill_kv_pool_io_errors_total", tl, double(s.io_errors)));
    const MetricLabels down = {{"tier", tn}, {"direction", "down"}};
    const MetricLabels up = {{"tier", tn}, {"direction", "up"}};
    SF_TRY(reg->set("sparsefill_kv_pool_blocks_moved_total", down, double(s.demoted_out)));
    SF_TRY(reg->set("sparsefill_kv_pool_blocks_moved_total", up, double(s.promoted_out)));
    SF_TRY(reg->set("sparsefill_kv_pool_bytes_moved_total", down, double(s.bytes_down_out)));
    SF_TRY(reg->set("sparsefill_kv_pool_bytes_moved_total", up, double(s.bytes_up_out)));
  }
  return Status::ok();
}

Status tiering_metrics_export(const TieredKv& tiered, const BlockPool& pool, MetricsRegistry* reg) {
  SF_TRY(pool_metrics_export(pool, reg));
  SF_TRY(reg->add_family("sparsefill_kv_tiering_host_wait_seconds_total", MetricKind::kCounter,
                         "Seconds the device forward's KV tiering waited for host room while "
                         "cold blocks drained to disk."));
  return reg->set("sparsefill_kv_tiering_host_wait_seconds_total", {},
                  tiered.host_wait_seconds());
}

Result<int64_t> parse_byte_size(const std::string& s, const std::string& what) {
  const std::string bad = what + ": '" + s + "' is not a size (e.g. 4096, 64K, 64M, 2G, 1T)";
  if (s.empty() || s[0] < '0' || s[0] > '9') return SF_ERR(kInvalidArgument, bad);
  size_t i = 0;
  int64_t v = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    if (v > (std::numeric_limits<int64_t>::max() - 9) / 10)
      return SF_ERR(kOutOfRange, what + ": '" + s + "' is too large");
    v = v * 10 + (s[i] - '0');
  }
  int shift = 0;
  if (i < s.size()) {
    const char u = s[i];
    shift = u == 'K' || u == 'k' ? 10 : u == 'M' || u == 'm' ? 20 : u == 'G' || u == 'g' ? 30
          : u == 'T' || u == 't' ? 40 : -1;
    ++i;
    if (i < s.size() && (s[i] == 'B' || s[i] == 'b')) ++i;  // "64MB" reads as 64M
    if (shift < 0 || i != s.size()) return SF_ERR(kInvalidArgument, bad);
  }
  if (v > (std::numeric_limits<int64_t>::max() >> shift))
    return SF_ERR(kOutOfRange, what + ": '" + s + "' is too large");
  return v << shift;
}

Result<KvPoolSpec> kv_pool_spec_parse(const std::string& spec) {
  const std::string form =
      " (forms: host=BYTES,disk=DIR[:BYTES] or device=BYTES,host=BYTES[,disk=DIR[:BYTES]])";
  KvPoolSpec out;
  bool host = false, disk = false, device = false;
  size_t p = 0;
  while (p <= spec.size()) {
    const size_t c = spec.find(',', p);
    const std::string item = spec.substr(p, c == std::string::npos ? std::string::npos : c - p);
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      return SF_ERR(kInvalidArgument, "--kv-pool: '" + item + "' is not key=value" + form);
    const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    if (key == "device") {
      if (device) return SF_ERR(kInvalidArgument, "--kv-pool: device given twice");
      device = true;
      SF_ASSIGN(int64_t b, parse_byte_size(val, "--kv-pool device"));
      out.device_bytes = b;
    } else if (key == "host") {
      if (host) return SF_ERR(kInvalidArgument, "--kv-pool: host given twice");
      host = true;
      SF_ASSIGN(int64_t b, parse_byte_size(val, "--kv-pool host"));
      out.host_bytes = b;
    } else if (key == "disk") {
      if (disk) return SF_ERR(kInvalidArgument, "--kv-pool: disk given twice");
      disk = true;
      // DIR[:BYTES]: the last ':' splits off a size when no '/' follows it, so a directory
      // may hold ':' ("/data/run:1/kv"); what it splits off must then be a size.
      const size_t colon = val.rfind(':');
      std::string dir = val;
      if (colon != std::string::npos && val.find('/', colon) == std::string::npos) {
        dir = val.substr(0, colon);
        SF_ASSIGN(int64_t b, parse_byte_size(val.substr(colon + 1), "--kv-pool disk"));
        out.disk_bytes = b;
      }
      if (dir.empty()) return SF_ERR(kInvalidArgument, "--kv-pool: disk needs a directory" + form);
      out.disk_dir = dir;
    } else {
      return SF_ERR(kInvalidArgument, "--kv-pool: unknown tier '" + key + "'" + form);
    }
    if (c == std::string::npos) break;
    p = c + 1;
  }
  if (!host) return SF_ERR(kInvalidArgument, "--kv-pool: host=BYTES is required" + form);
  if (device) {
    // disk= is optional here: the coldest host blocks drain there while later layers compute.
    if (out.device_bytes == 0 || out.host_bytes == 0)
      return SF_ERR(kInvalidArgument,
                    "--kv-pool: device and host must be > 0 (the fast tier and the cold one)");
    return out;
  }
  if (!disk) return SF_ERR(kInvalidArgument, "--kv-pool: disk=DIR is required (cold blocks go there)" + form);
  if (out.host_bytes == 0)
    return SF_ERR(kInvalidArgument, "--kv-pool: host must be > 0 (it is the fast tier)");
  return out;
}

Status kv_pool_dir_check(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec))
    return SF_ERR(kIo, "--kv-pool: disk directory '" + dir + "' cannot be created" +
                           (ec ? ": " + ec.message() : std::string()));
  const std::string probe = (std::filesystem::path(dir) / ".sparsefill-write-probe").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return SF_ERR(kIo, "--kv-pool: disk directory '" + dir +
                           "' is not writable: " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::ok();
}

}  // namespace sf::kvstore
