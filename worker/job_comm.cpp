#include "worker/job_comm.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "common/checksum.h"
#include "common/file_io.h"
#include "common/text.h"

namespace sf::worker {

void end_job(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  comm::mpi_abort_job(1);
}

Status agree(comm::Communicator& world, const Status& mine) {
  int32_t cand = mine.is_ok() ? INT32_MAX : world.rank(), first = INT32_MAX;
  SF_TRY(world.all_reduce(&cand, &first, 1, DType::kI32, comm::ReduceOp::kMin));
  if (first == INT32_MAX) return Status::ok();
  std::string msg = first == world.rank() ? mine.message() : std::string();
  int64_t len = int64_t(msg.size());
  SF_TRY(world.bcast(&len, 1, DType::kI64, first));
  msg.resize(size_t(len));
  SF_TRY(world.bcast(msg.data(), len, DType::kU8, first));
  return Status(mine.is_ok() ? Code::kInternal : mine.code(), msg);
}

// One all-reduce of (fp, -fp) under min gives each item's min and max.
Result<std::vector<bool>> same_on_every_rank(comm::Communicator& world,
                                             const std::vector<int64_t>& fp) {
  const size_t n = fp.size();
  std::vector<int64_t> both(2 * n), lo(2 * n);
  for (size_t i = 0; i < n; ++i) {
    both[i] = fp[i];
    both[n + i] = -fp[i];
  }
  SF_TRY(
      world.all_reduce(both.data(), lo.data(), int64_t(2 * n), DType::kI64, comm::ReduceOp::kMin));
  std::vector<bool> same(n);
  for (size_t i = 0; i < n; ++i) same[i] = lo[i] == -lo[n + i];
  return same;
}

Result<HostPeers> host_peers(comm::Communicator& world) {
  constexpr int kWords = CPU_SETSIZE / 64;
  std::vector<int64_t> mine(size_t(kWords) + 1, 0), all;
  const std::string h = host_name();
  mine[0] = int64_t(xxh64_bytes(h.data(), h.size()) & 0x7fffffffffffffffULL);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) mine[size_t(1 + c / 64)] |= int64_t(uint64_t(1) << (c % 64));
  all.resize(mine.size() * size_t(world.size()));
  SF_TRY(world.all_gather(mine.data(), all.data(), int64_t(mine.size()), DType::kI64));
  HostPeers p{0, 0, {}};
  for (int r = 0; r < world.size(); ++r) {
    const int64_t* o = all.data() + size_t(r) * mine.size();
    if (o[0] != mine[0]) continue;
    ++p.local_ranks;
    p.ranks.push_back(r);
    bool overlap = false;
    for (int w = 1; w <= kWords && !overlap; ++w) overlap = (o[w] & mine[size_t(w)]) != 0;
    p.cpu_sharers += overlap;
  }
  p.cpu_sharers = std::max(p.cpu_sharers, 1);  // a rank with no readable mask counts itself
  return p;
}

GroupProgress::GroupProgress(std::unique_ptr<comm::Heartbeat> hb, bool leader, int group,
                             int n_groups, int group_size)
    : hb_(std::move(hb)),
      leader_(leader),
      group_(group),
      n_groups_(n_groups),
      group_size_(group_size),
      seen_(size_t(n_groups), clock::now()),
      done_(size_t(n_groups), 0),
      last_beat_(clock::now() - std::chrono::hours(1)) {
  for (int q = 0; q < n_groups; ++q) leaders_.push_back(q * group_size);
}

// What each group last said and when: a leader receives while it beats, so notes do not pile up
// unreceived while it works.
Status GroupProgress::drain() {
  notes_.clear();
  SF_TRY(hb_->poll(&notes_));
  for (const auto& [src, v] : notes_) {
    seen_[size_t(src / group_size_)] = clock::now();
    if (v < 0) done_[size_t(src / group_size_)] = 1;
  }
  return Status::ok();
}

Status GroupProgress::beat(int64_t value) {
  if (!hb_ || !leader_) return Status::ok();
  const auto now = clock::now();
  if (value >= 0 && now - last_beat_ < std::chrono::seconds(1)) return Status::ok();
  last_beat_ = now;
  SF_TRY(hb_->beat(leaders_, value));
  return drain();
}

Status GroupProgress::finish(double stall_timeout_s) {
  if (!hb_ || !leader_) return Status::ok();
  SF_TRY(beat(-1));
  done_[size_t(group_)] = 1;
  // The silence is counted from here at the earliest: a group busy with a long request while
  // this one worked is not held to notes this leader was not reading.
  const auto start = clock::now();
  for (auto& t : seen_) t = std::max(t, start);
  for (;;) {
    SF_TRY(drain());
    if (std::all_of(done_.begin(), done_.end(), [](char d) { return d != 0; })) return Status::ok();
    for (int q = 0; q < n_groups_; ++q)
      if (!done_[size_t(q)] &&
          std::chrono::duration<double>(clock::now() - seen_[size_t(q)]).count() > stall_timeout_s)
        return SF_ERR(kDeadlineExceeded,
                      sformat("group %d (world ranks %d-%d) sent no progress for %.0f s while "
                              "group %d waited for it to finish: a rank stopped or hung (or a "
                              "layer takes longer than --stall-timeout); ending the job",
                              q, q * group_size_, q * group_size_ + group_size_ - 1,
                              stall_timeout_s, group_));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace sf::worker
