#include "kvstore/block_pool.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "common/dtype.h"
#include "common/thread_pool.h"

namespace sf::kvstore {
namespace {

constexpr size_t kAlign = 4096;  // page-aligned host blocks: DMA-friendly, O_DIRECT-compatible

class HostStore final : public TierStore {
 public:
  HostStore(void* p, int64_t block_bytes, void (*release)(void*))
      : p_(static_cast<char*>(p)), bb_(block_bytes), release_(release) {}
  ~HostStore() override { release_(p_); }
  Status write(int64_t slot, const void* src, int64_t bytes) override {
    std::memcpy(p_ + slot * bb_, src, size_t(bytes));
    return Status::ok();
  }
  Status read(int64_t slot, void* dst, int64_t bytes) const override {
    std::memcpy(dst, p_ + slot * bb_, size_t(bytes));
    return Status::ok();
  }
  char* host_ptr(int64_t slot) const override { return p_ + slot * bb_; }

 private:
  char* p_;
  int64_t bb_;
  void (*release_)(void*);
};

class DiskStore final : public TierStore {
 public:
  DiskStore(int fd, std::string path, int64_t block_bytes)
      : fd_(fd), path_(std::move(path)), bb_(block_bytes) {}
  ~DiskStore() override {
    // Unlinked while still locked, so the next pool in this directory starts a fresh file.
    ::unlink(path_.c_str());  // the tier is scratch space: blocks do not outlive the pool
    ::close(fd_);
  }
  Status write(int64_t slot, const void* src, int64_t bytes) override {
    const char* s = static_cast<const char*>(src);
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pwrite(fd_, s + done, size_t(bytes - done), off_t(slot * bb_ + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == ENOSPC || errno == EDQUOT))
        return SF_ERR(kResourceExhausted, "block pool: disk tier '" + path_ + "' is full (" +
                                              (errno == ENOSPC ? "ENOSPC" : "EDQUOT: quota") +
                                              ") writing slot " + std::to_string(slot));
      if (n <= 0)  // 0: nothing written and no errno to name
        return SF_ERR(kIo, "block pool: disk tier write to '" + path_ + "' slot " +
                               std::to_string(slot) + " failed: " +
                               (n == 0 ? std::string("wrote nothing") : std::strerror(errno)));
      done += n;
    }
    return Status::ok();
  }
  Status read(int64_t slot, void* dst, int64_t bytes) const override {
    char* d = static_cast<char*>(dst);
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd_, d + done, size_t(bytes - done), off_t(slot * bb_ + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return SF_ERR(
            kIo, "block pool: disk tier read of '" + path_ + "' slot " + std::to_string(slot) +
                     " failed: " + (n == 0 ? std::string("short file") : std::strerror(errno)));
      done += n;
    }
    return Status::ok();
  }

 private:
  int fd_;
  std::string path_;
  int64_t bb_;
};

Result<std::unique_ptr<TierStore>> make_disk_store(const std::string& dir, int64_t block_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return SF_ERR(
        kIo, "block pool: disk tier directory '" + dir + "' cannot be created: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    return SF_ERR(kIo, "block pool: disk tier path '" + dir + "' is not a directory");
  const std::string path = (std::filesystem::path(dir) / "blocks.bin").string();
  // One pool a directory: two would write each other's slots, and the first to close would
  // unlink the other's file. The lock goes with the descriptor, so a crashed pool's file is
  // taken over. Only a regular file is locked (a test may point blocks.bin at a device). A file
  // unlinked by a closing pool between our open and our lock is not ours to use, whether we got
  // its lock (after it closed) or not (before): open again.
  int fd = -1;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
      return SF_ERR(kIo, "block pool: disk tier directory '" + dir +
                             "' is not writable: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) break;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      struct stat now {};
      const bool replaced = ::stat(path.c_str(), &now) != 0 || now.st_ino != st.st_ino ||
                            now.st_dev != st.st_dev;
      ::close(fd);
      fd = -1;
      if (err == EWOULDBLOCK && replaced) continue;  // a closing pool's unlinked file
      if (err == EWOULDBLOCK)
        return SF_ERR(kAlreadyExists, "block pool: disk tier directory '" + dir +
                                          "' is in use by another block pool (its blocks.bin is "
                                          "locked); give each pool its own directory");
      return SF_ERR(kIo, "block pool: cannot lock '" + path + "': " + std::strerror(err));
    }
    struct stat now {};
    if (::stat(path.c_str(), &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0)
    return SF_ERR(kIo, "block pool: '" + path + "' kept being replaced while it was opened");
  // A pool killed before its destructor (a signal, the OOM killer) leaves its file behind,
  // locked by nobody: emptied now, so its stale blocks stop holding disk (no slot is read
  // before it is written, so nothing reads them either way).
  struct stat own {};
  if (::fstat(fd, &own) == 0 && S_ISREG(own.st_mode) && own.st_size > 0 && ::ftruncate(fd, 0) != 0) {
    const int err = errno;
    ::close(fd);
    return SF_ERR(kIo, "block pool: cannot empty '" + path + "' left by an earlier pool: " +
                           std::strerror(err));
  }
  return std::unique_ptr<TierStore>(new DiskStore(fd, path, block_bytes));
}

}  // namespace

#ifndef SF_KV_CUDA
Status BlockPool::wait_stream(void*) { return Status::ok(); }
Status BlockPool::write_from_device_async(std::span<const BlockId>, const float*, const float*,
                                          int64_t, void*) {
  return SF_ERR(kUnsupported, "block pool: writes from device memory need a CUDA build");
}
Status BlockPool::read_to_device_async(std::span<const BlockId>, float*, float*, int64_t,
                                       void*) const {
  return SF_ERR(kUnsupported, "block pool: reads into device memory need a CUDA build");
}
Result<std::unique_ptr<TierStore>> make_device_store(int64_t, int64_t) {
  return SF_ERR(kUnsupported, "block pool: device tier needs a CUDA build (device_bytes > 0)");
}
Result<std::unique_ptr<TierStore>> make_host_store(int64_t slots, int64_t block_bytes) {
  return make_pageable_host_store(slots, block_bytes);
}
#endif

Result<std::unique_ptr<TierStore>> make_pageable_host_store(int64_t slots, int64_t block_bytes) {
  const size_t bytes = (size_t(slots * block_bytes) + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, bytes);
  if (!p)
    return SF_ERR(kResourceExhausted, "block pool: host tier allocation of " +
                                          std::to_string(slots * block_bytes) + " bytes failed");
  return make_host_arena_store(p, block_bytes, [](void* q) { std::free(q); });
}

std::unique_ptr<TierStore> make_host_arena_store(void* arena, int64_t block_bytes,
                                                 void (*release)(void*)) {
  return std::unique_ptr<TierStore>(new HostStore(arena, block_bytes, release));
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

Status TierStore::write_blocks(std::span<const int64_t> slots, std::span<const float* const> k,
                               std::span<const float* const> v, int64_t half_bytes,
                               std::vector<float>* scratch) {
  // K and V go into one buffer so the disk tier does one pwrite a block.
  scratch->resize(size_t(2 * half_bytes) / sizeof(float));
  char* buf = reinterpret_cast<char*>(scratch->data());
  for (size_t i = 0; i < slots.size(); ++i) {
    std::memcpy(buf, k[i], size_t(half_bytes));
    std::memcpy(buf + half_bytes, v[i], size_t(half_bytes));
    SF_TRY(write(slots[i], buf, 2 * half_bytes));
  }
  return Status::ok();
}

Result<std::unique_ptr<BlockPool>> BlockPool::create(const BlockPoolConfig& cfg) {
  SF_ENSURE(cfg.n_kv_heads > 0, kInvalidArgument, "block pool: n_kv_heads must be positive");
  SF_ENSURE(cfg.head_dim > 0, kInvalidArgument, "block pool: head_dim must be positive");
  SF_ENSURE(cfg.device_bytes >= 0 && cfg.host_bytes >= 0 && cfg.disk_bytes >= 0, kInvalidArgument,
            "block pool: tier budgets must be >= 0");
  SF_ENSURE(cfg.disk_bytes == 0 || !cfg.disk_dir.empty(), kInvalidArgument,
            "block pool: disk_dir is required when disk_bytes > 0");
  std::unique_ptr<BlockPool> p(new BlockPool());
  p->cfg_ = cfg;
  // 512 * heads * head_dim bytes: slots of the host arena are page-aligned once heads *
  // head_dim >= 8, which every real model meets.
  p->block_bytes_ = block_bytes_for(cfg);
  const std::array<int64_t, kNumTiers> budget = {cfg.device_bytes, cfg.host_bytes, cfg.disk_bytes};
  for (int t = 0; t < kNumTiers; ++t) {
    const int64_t slots = budget[size_t(t)] / p->block_bytes_;
    p->st_[size_t(t)].capacity_bytes = slots * p->block_bytes_;
    if (slots == 0) continue;
    Result<std::unique_ptr<TierStore>> s = t == 0 ? make_device_store(slots, p->block_bytes_)
                                           : t == 1
                                               ? make_host_store(slots, p->block_bytes_)
                                               : make_disk_store(cfg.disk_dir, p->block_bytes_);
    if (!s) return s.status();
    p->store_[size_t(t)] = std::move(s).value();
    auto& fs = p->free_slots_[size_t(t)];
    fs.resize(size_t(slots));
    // Popped from the back: low slots first, so the disk file grows front to back.
    std::iota(fs.rbegin(), fs.rend(), int64_t(0));
  }
  if (p->st_[0].capacity_bytes + p->st_[1].capacity_bytes + p->st_[2].capacity_bytes == 0)
    return SF_ERR(kInvalidArgument, "block pool: every tier budget is below one block (" +
                                        std::to_string(p->block_bytes_) + " bytes)");
  p->staging_.resize(size_t(p->block_bytes_ / 4));
  // Live blocks never outnumber slots: with both reserved here, alloc and free never allocate
  // (free runs in destructors, where a bad_alloc would end the process).
  const int64_t total = (p->st_[0].capacity_bytes + p->st_[1].capacity_bytes +
                         p->st_[2].capacity_bytes) / p->block_bytes_;
  p->entries_.reserve(size_t(total));
  p->free_ids_.reserve(size_t(total));
  return p;
}

BlockPool::~BlockPool() = default;

int64_t BlockPool::free_slots(int t) const { return int64_t(free_slots_[size_t(t)].size()); }

Status BlockPool::check_id(BlockId id) const {
  if (id < 0 || id >= int64_t(entries_.size()) || entries_[size_t(id)].tier < 0)
    return SF_ERR(kInvalidArgument, "block pool: no live block " + std::to_string(id));
  return Status::ok();
}

Result<BlockId> BlockPool::alloc(Tier preferred, Tier slowest) {
  std::lock_guard<std::mutex> g(mu_);
  return alloc_locked(int(preferred), int(slowest));
}

Result<std::vector<BlockId>> BlockPool::alloc_batch(std::span<const Tier> preferred,
                                                    Tier slowest) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<BlockId> ids;
  ids.reserve(preferred.size());
  // All or nothing, the counters too: a batch handed back counts as the one alloc that failed
  // (its refusals), not as allocs, spills and frees the caller never saw.
  const auto before = st_;
  for (size_t i = 0; i < preferred.size(); ++i) {
    const auto before_block = st_;
    Result<BlockId> id = alloc_locked(int(preferred[i]), int(slowest));
    if (!id.is_ok()) {
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) (void)free_locked(*it);
      for (size_t t = 0; t < st_.size(); ++t) {
        const int64_t refused = st_[t].full_refusals - before_block[t].full_refusals;
        st_[t] = before[t];
        st_[t].full_refusals += refused;
      }
      return Status(id.status().code(), "block " + std::to_string(i) + " of " +
                                            std::to_string(preferred.size()) + ": " +
                                            id.status().message());
    }
    ids.push_back(id.value());
  }
  return ids;
}

Result<BlockId> BlockPool::alloc_locked(int p, int last) {
  if (p < 0 || p >= kNumTiers || last < p || last >= kNumTiers)
    return SF_ERR(kInvalidArgument, "block pool: bad tier");
  // A disabled preferred tier (e.g. no device) is no spill: start at the first enabled one.
  while (p < last && !store_[size_t(p)]) ++p;
  for (int t = p; t <= last; ++t) {
    TierStats& s = st_[size_t(t)];
    if (free_slots(t) == 0) {
      if (store_[size_t(t)]) ++s.full_refusals;
      continue;
    }
    const int64_t slot = free_slots_[size_t(t)].back();
    free_slots_[size_t(t)].pop_back();
    BlockId id;
    if (!free_ids_.empty()) {
      id = free_ids_.back();
      free_ids_.pop_back();
    } else {
      id = BlockId(entries_.size());
      entries_.emplace_back();
    }
    entries_[size_t(id)] = Entry{t, slot, 0};
    ++s.allocs;
    ++s.blocks;
    s.used_bytes += block_bytes_;
    if (t != p) ++s.spilled_in;
    return id;
  }
  std::string msg = "block pool: all tiers full from " + std::string(tier_name(Tier(p))) + " to " +
                    tier_name(Tier(last)) + ":";
  for (int t = p; t <= last; ++t)
    msg += std::string(" ") + tier_name(Tier(t)) + " " + std::to_string(st_[size_t(t)].used_bytes) +
           "/" + std::to_string(st_[size_t(t)].capacity_bytes) + " bytes";
  return SF_ERR(kResourceExhausted, msg);
}

Status BlockPool::free(BlockId id) {
  std::lock_guard<std::mutex> g(mu_);
  return free_locked(id);
}

Status BlockPool::free_locked(BlockId id) {
  SF_TRY(check_id(id));
  Entry& e = entries_[size_t(id)];
  if (e.pins > 0)
    return SF_ERR(kInvalidArgument, "block pool: block " + std::to_string(id) + " is pinned (" +
                                        std::to_string(e.pins) + "), cannot free");
  TierStats& s = st_[size_t(e.tier)];
  ++s.frees;
  --s.blocks;
  s.used_bytes -= block_bytes_;
  free_slots_[size_t(e.tier)].push_back(e.slot);
  e = Entry{};
  free_ids_.push_back(id);
  return Status::ok();
}

Status BlockPool::write(BlockId id, const float* k, const float* v) {
  return write_batch({&id, 1}, {&k, 1}, {&v, 1});
}

Status BlockPool::write_batch(std::span<const BlockId> ids, std::span<const float* const> k,
                              std::span<const float* const> v) {
  std::lock_guard<std::mutex> g(mu_);
  SF_ENSURE(k.size() == ids.size() && v.size() == ids.size(), kInvalidArgument,
            "block pool: write_batch with " + std::to_string(ids.size()) + " blocks, " +
                std::to_string(k.size()) + " K and " + std::to_string(v.size()) + " V sources");
  std::array<std::vector<size_t>, kNumTiers> by_tier;
  for (size_t i = 0; i < ids.size(); ++i) {
    SF_TRY(check_id(ids[i]));
    if (!k[i] || !v[i]) return SF_ERR(kInvalidArgument, "block pool: write with null k or v");
    by_tier[size_t(entries_[size_t(ids[i])].tier)].push_back(i);
  }
  const size_t half = size_t(block_bytes_ / 2);
  for (int t = 0; t < kNumTiers; ++t) {
    const std::vector<size_t>& idx = by_tier[size_t(t)];
    if (idx.empty()) continue;
    TierStore& s = *store_[size_t(t)];
    if (s.host_ptr(entries_[size_t(ids[idx[0]])].slot)) {
      parallel_for(idx.size(), [&](size_t b, size_t e) {
        for (size_t j = b; j < e; ++j) {
          const size_t i = idx[j];
          char* p = s.host_ptr(entries_[size_t(ids[i])].slot);
          std::memcpy(p, k[i], half);
          std::memcpy(p + half, v[i], half);
        }
      }, 8);  // a few blocks (a single write()) copy inline
      continue;
    }
    std::vector<int64_t> slots(idx.size());
    std::vector<const float*> ks(idx.size()), vs(idx.size());
    for (size_t j = 0; j < idx.size(); ++j) {
      slots[j] = entries_[size_t(ids[idx[j]])].slot;
      ks[j] = k[idx[j]];
      vs[j] = v[idx[j]];
    }
    const Status st = s.write_blocks(slots, ks, vs, int64_t(half), &staging_);
    if (!st.is_ok()) {
      ++st_[size_t(t)].io_errors;
      return st;
    }
  }
  return Status::ok();
}

Status BlockPool::read(BlockId id, float* k, float* v) const {
  std::lock_guard<std::mutex> g(mu_);
  SF_TRY(check_id(id));
  if (!k || !v) return SF_ERR(kInvalidArgument, "block pool: read with null k or v");
  const Entry& e = entries_[size_t(id)];
  const size_t half = size_t(block_bytes_ / 2);
  const TierStore& s = *store_[size_t(e.tier)];
  const char* p = s.host_ptr(e.slot);
  if (!p) {
    Status st = s.read(e.slot, staging_.data(), block_bytes_);
    if (!st.is_ok()) {
      ++st_[size_t(e.tier)].io_errors;
      return st;
    }
    p = reinterpret_cast<const char*>(staging_.data());
  }
  std::memcpy(k, p, half);
  std::memcpy(v, p + half, half);
  return Status::ok();
}

Result<Tier> BlockPool::tier_of(BlockId id) const {
  std::lock_guard<std::mutex> g(mu_);
  SF_TRY(check_id(id));
  return Tier(entries_[size_t(id)].tier);
}

Status BlockPool::pin(BlockId id) {
  std::lock_guard<std::mutex> g(mu_);
  SF_TRY(check_id(id));
  ++entries_[size_t(id)].pins;
  return Status::ok();
}

Status BlockPool::unpin(BlockId id) {
  std::lock_guard<std::mutex> g(mu_);
  SF_TRY(check_id(id));
  Entry& e = entries_[size_t(id)];
  if (e.pins == 0)
    return SF_ERR(kInvalidArgument, "block pool: unpin of unpinned block " + std::to_string(id));
  --e.pins;
  return Status::ok();
}

Result<int> BlockPool::pins(BlockId id) const {
  std::lock_guard<std::mutex> g(mu_);
  SF_TRY(check_id(id));
  return entries_[size_t(id)].pins;
}

Status BlockPool::move(BlockId id, Tier to) {
  std::lock_guard<std::mutex> g(mu_);
  return move_locked(id, int(to));
}

Status BlockPool::move_locked(BlockId id, int to) {
  SF_TRY(check_id(id));
  if (to < 0 || to >= kNumTiers) return SF_ERR(kInvalidArgument, "block pool: bad tier");
  Entry& e = entries_[size_t(id)];
  const int from = e.tier;
  if (from == to) return Status::ok();
  if (e.pins > 0)
    return SF_ERR(kInvalidArgument, "block pool: block " + std::to_string(id) +
                                        " is pinned, cannot move it to " + tier_name(Tier(to)));
  TierStats& d = st_[size_t(to)];
  TierStats& s = st_[size_t(from)];
  if (!store_[size_t(to)])
    return SF_ERR(kInvalidArgument, std::string("block pool: cannot move block ") +
                                        std::to_string(id) + " to " + tier_name(Tier(to)) +
                                        ": tier disabled (budget 0)");
  if (free_slots(to) == 0) {
    ++d.full_refusals;
    return SF_ERR(kResourceExhausted, std::string("block pool: cannot move block ") +
                                          std::to_string(id) + " to " + tier_name(Tier(to)) +
                                          ": tier full (" + std::to_string(d.used_bytes) + "/" +
                                          std::to_string(d.capacity_bytes) + " bytes)");
  }
  const int64_t slot = free_slots_[size_t(to)].back();
  TierStore& src = *store_[size_t(from)];
  TierStore& dst = *store_[size_t(to)];
  // One copy when either side is host memory; disk<->device goes through the staging block.
  // On failure the block stays where it was, intact.
  Status st;
  if (char* dp = dst.host_ptr(slot)) {
    st = src.read(e.slot, dp, block_bytes_);
    if (!st.is_ok()) ++s.io_errors;
  } else if (const char* sp = src.host_ptr(e.slot)) {
    st = dst.write(slot, sp, block_bytes_);
    if (!st.is_ok()) ++d.io_errors;
  } else {
    st = src.read(e.slot, staging_.data(), block_bytes_);
    if (!st.is_ok()) {
      ++s.io_errors;
    } else {
      st = dst.write(slot, staging_.data(), block_bytes_);
      if (!st.is_ok()) ++d.io_errors;
    }
  }
  SF_TRY(st);
  free_slots_[size_t(to)].pop_back();
  free_slots_[size_t(from)].push_back(e.slot);
  e.tier = to;
  e.slot = slot;
  count_move(from, to);
  return Status::ok();
}

void BlockPool::count_move(int from, int to) {
  TierStats& s = st_[size_t(from)];
  TierStats& d = st_[size_t(to)];
  s.used_bytes -= block_bytes_;
  --s.blocks;
  d.used_bytes += block_bytes_;
  ++d.blocks;
  if (to > from) {
    ++s.demoted_out;
    s.bytes_down_out += block_bytes_;
    ++d.demoted_in;
    d.bytes_down_in += block_bytes_;
  } else {
    ++s.promoted_out;
    s.bytes_up_out += block_bytes_;
    ++d.promoted_in;
    d.bytes_up_in += block_bytes_;
  }
}

Status BlockPool::move_batch(std::span<const BlockId> ids, Tier to) {
  std::lock_guard<std::mutex> g(mu_);
  return move_batch_locked(ids, int(to));
}

Status BlockPool::move_batch_locked(std::span<const BlockId> ids, int to) {
  if (to < 0 || to >= kNumTiers) return SF_ERR(kInvalidArgument, "block pool: bad tier");
  if (!store_[size_t(to)])
    return SF_ERR(kInvalidArgument, std::string("block pool: cannot move to ") +
                                        tier_name(Tier(to)) + ": tier disabled (budget 0)");
  std::vector<BlockId> moving;
  for (BlockId id : ids) {
    SF_TRY(check_id(id));
    const Entry& e = entries_[size_t(id)];
    if (e.pins > 0)
      return SF_ERR(kInvalidArgument, "block pool: block " + std::to_string(id) +
                                          " is pinned, cannot move it to " + tier_name(Tier(to)));
    if (e.tier != to) moving.push_back(id);
  }
  std::vector<BlockId> sorted = moving;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    return SF_ERR(kInvalidArgument, "block pool: move_batch lists a block twice");
  TierStats& d = st_[size_t(to)];
  if (int64_t(moving.size()) > free_slots(to)) {
    ++d.full_refusals;
    return SF_ERR(kResourceExhausted, "block pool: cannot move " + std::to_string(moving.size()) +
                                          " blocks to " + tier_name(Tier(to)) + ": room for " +
                                          std::to_string(free_slots(to)));
  }
  // Queue every copy that has a host-side end; the rest (disk<->device) go through staging at
  // once. Destination slots are taken from the back of the free list (ascending) and only
  // committed after every copy has completed. Runs of blocks whose source and destination slots
  // are both consecutive go as one copy: per-copy overhead (a few us) otherwise caps small
  // blocks far below the link's bandwidth.
  auto& fl = free_slots_[size_t(to)];
  TierStore& dst = *store_[size_t(to)];
  auto dst_slot = [&](size_t i) { return fl[fl.size() - 1 - i]; };
  std::array<bool, kNumTiers> used{};
  Status st;
  for (size_t i = 0; i < moving.size() && st.is_ok();) {
    const Entry& e = entries_[size_t(moving[i])];
    TierStore& src = *store_[size_t(e.tier)];
    used[size_t(e.tier)] = true;
    const int64_t slot = dst_slot(i);
    size_t run = 1;
    while (i + run < moving.size()) {
      const Entry& n = entries_[size_t(moving[i + run])];
      if (n.tier != e.tier || n.slot != e.slot + int64_t(run) ||
          dst_slot(i + run) != slot + int64_t(run))
        break;
      ++run;
    }
    if (char* dp = dst.host_ptr(slot)) {
      st = src.read_async(e.slot, dp, int64_t(run) * block_bytes_);
      if (!st.is_ok()) ++st_[size_t(e.tier)].io_errors;
    } else if (const char* sp = src.host_ptr(e.slot)) {
      st = dst.write_async(slot, sp, int64_t(run) * block_bytes_);
      if (!st.is_ok()) ++d.io_errors;
    } else {
      run = 1;  // one staging block
      st = src.read(e.slot, staging_.data(), block_bytes_);
      if (!st.is_ok()) {
        ++st_[size_t(e.tier)].io_errors;  // the tier that failed, as move_locked counts it
      } else {
        st = dst.write(slot, staging_.data(), block_bytes_);
        if (!st.is_ok()) ++d.io_errors;
      }
    }
    i += run;
  }
  // Wait for whatever was queued even after a failure: the slots must be quiet before reuse.
  for (int t = 0; t < kNumTiers; ++t) {
    if (!store_[size_t(t)] || !(used[size_t(t)] || t == to)) continue;
    const Status s = store_[size_t(t)]->sync();
    if (!s.is_ok()) {
      ++st_[size_t(t)].io_errors;
      if (st.is_ok()) st = s;
    }
  }
  SF_TRY(st);
  for (size_t i = 0; i < moving.size(); ++i) {
    Entry& e = entries_[size_t(moving[i])];
    const int from = e.tier;
    free_slots_[size_t(from)].push_back(e.slot);
    e.tier = to;
    e.slot = fl[fl.size() - 1 - i];
    count_move(from, to);
  }
  fl.resize(fl.size() - moving.size());
  return Status::ok();
}

Result<PlacementResult> BlockPool::place(std::span<const BlockId> blocks,
                                         std::span<const float> scores, int64_t sink_blocks,
                                         int64_t recent_blocks, Tier fast, int64_t max_hot) {
  std::lock_guard<std::mutex> g(mu_);
  const int f = int(fast);
  if (f < 0 || f + 1 >= kNumTiers)
    return SF_ERR(kInvalidArgument, "block pool: place needs a fast tier with a slower one below");
  if (scores.size() != blocks.size())
    return SF_ERR(kInvalidArgument, "block pool: place got " + std::to_string(scores.size()) +
                                        " scores for " + std::to_string(blocks.size()) + " blocks");
  if (sink_blocks < 0 || recent_blocks < 0)
    return SF_ERR(kInvalidArgument, "block pool: sink_blocks and recent_blocks must be >= 0");
  const int64_t n = int64_t(blocks.size());
  int64_t room = free_slots(f);
  for (BlockId id : blocks) {
    SF_TRY(check_id(id));
    if (entries_[size_t(id)].tier == f) ++room;
  }
  const std::vector<int64_t> order = placement_order(scores, sink_blocks, recent_blocks);
  // Pinned blocks on the fast tier hold their slot whatever their rank.
  for (BlockId id : blocks) {
    const Entry& e = entries_[size_t(id)];
    if (e.pins > 0 && e.tier == f) --room;
  }
  if (max_hot >= 0) room = std::min(room, max_hot);
  std::vector<char> hot(static_cast<size_t>(n), 0);
  PlacementResult r;
  for (int64_t i : order) {
    const Entry& e = entries_[size_t(blocks[size_t(i)])];
    if (e.pins > 0) continue;
    if (room == 0) break;
    hot[size_t(i)] = 1;
    --room;
  }
  // Demote cold blocks first so promotions find free slots.
  std::vector<BlockId> down, up;
  for (int64_t i = 0; i < n; ++i) {
    const Entry& e = entries_[size_t(blocks[size_t(i)])];
    if (e.pins > 0) {
      ++r.pinned_skipped;
      continue;
    }
    if (!hot[size_t(i)] && e.tier == f) down.push_back(blocks[size_t(i)]);
  }
  for (int64_t i : order) {
    if (!hot[size_t(i)]) continue;
    ++r.hot;
    if (entries_[size_t(blocks[size_t(i)])].tier != f) up.push_back(blocks[size_t(i)]);
  }
  // Demotions free fast slots for promotions, which free slow ones for the next demotions: in
  // rounds sized to the room each side has, so a swap needs one free slot on either tier, not
  // room for every cold block at once.
  size_t di = 0, ui = 0;
  while (di < down.size() || ui < up.size()) {
    const size_t nd = std::min(down.size() - di, size_t(free_slots(f + 1)));
    if (nd > 0) {
      SF_TRY(move_batch_locked(std::span<const BlockId>(down).subspan(di, nd), f + 1));
      di += nd;
      r.demoted += int64_t(nd);
    }
    const size_t nu = std::min(up.size() - ui, size_t(free_slots(f)));
    if (nu > 0) {
      SF_TRY(move_batch_locked(std::span<const BlockId>(up).subspan(ui, nu), f));
      ui += nu;
      r.promoted += int64_t(nu);
    }
    if (nd == 0 && nu == 0) {
      ++st_[size_t(f + 1)].full_refusals;
      return SF_ERR(kResourceExhausted,
                    "block pool: place cannot swap " + std::to_string(down.size() - di) +
                        " cold blocks to " + tier_name(Tier(f + 1)) + " for " +
                        std::to_string(up.size() - ui) + " hot ones: both " + tier_name(Tier(f)) +
                        " and " + tier_name(Tier(f + 1)) + " are full (one free block on either "
                        "tier is enough)");
    }
  }
  return r;
}

std::vector<int64_t> placement_order(std::span<const float> scores, int64_t sink_blocks,
                                     int64_t recent_blocks) {
  const int64_t n = int64_t(scores.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t(0));
  auto rank = [&](int64_t i) { return i < sink_blocks ? 0 : (i >= n - recent_blocks ? 1 : 2); };
  auto key = [&](int64_t i) { return nan_last(scores[size_t(i)]); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int ra = rank(a), rb = rank(b);
    if (ra != rb) return ra < rb;
    return ra == 2 && key(a) > key(b);
  });
  return order;
}

TierStats BlockPool::stats(Tier t) const {
  std::lock_guard<std::mutex> g(mu_);
  return st_[size_t(int(t))];
}

int64_t BlockPool::live_blocks() const {
  std::lock_guard<std::mutex> g(mu_);
  return int64_t(entries_.size() - free_ids_.size());
}

}  // namespace sf::kvstore
