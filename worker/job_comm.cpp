#include "worker/job_comm.h"

#include <sched.h>

#include <algorithm>
#include <string>

#include "common/checksum.h"
#include "common/file_io.h"

namespace sf::worker {

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

}  // namespace sf::worker
