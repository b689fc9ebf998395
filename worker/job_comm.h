// The worker job's agreements over MPI: every rank learns any rank's failure, whether every rank
// holds the same setting, and which ranks share its host (memory) and its CPUs.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "common/status.h"

namespace sf::worker {

// After a communication failure ranks may be stuck in a collective: the error on stderr, and the
// whole job ends (MPI_Abort).
[[noreturn]] void end_job(const Status& st);

// A communicator's deadline raised to at least `seconds` for a scope: a wait that may take far
// longer than --comm-timeout (a peer's export files on a slow filesystem, the model load).
class DeadlineAtLeast {
 public:
  DeadlineAtLeast(comm::Communicator& c, double seconds) : c_(c), was_(c.timeout()) {
    c_.set_timeout(std::max(was_, std::chrono::milliseconds(int64_t(seconds * 1000))));
  }
  ~DeadlineAtLeast() { c_.set_timeout(was_); }
  DeadlineAtLeast(const DeadlineAtLeast&) = delete;
  DeadlineAtLeast& operator=(const DeadlineAtLeast&) = delete;

 private:
  comm::Communicator& c_;
  const std::chrono::milliseconds was_;
};

// Every rank learns whether any rank failed; the lowest failing rank's message reaches all.
// Returns ok on every rank, or the same error on every rank.
Status agree(comm::Communicator& world, const Status& mine);

// Per item, whether every rank holds the same fingerprint (fingerprints >= 0, -1: the rank has
// no such item).
Result<std::vector<bool>> same_on_every_rank(comm::Communicator& world,
                                             const std::vector<int64_t>& fp);

// This rank's neighbours on its host, from one all-gather of (host, CPU affinity mask) over the
// world, made by every rank at start. local_ranks: the ranks on this host (they share its memory).
// cpu_sharers: those whose CPU sets overlap this rank's (launched unbound, --bind-to none, or
// bound to a shared socket or cpuset), itself included.
struct HostPeers {
  int local_ranks = 1, cpu_sharers = 1;
  std::vector<int> ranks;  // the world ranks on this host, this one included
};
Result<HostPeers> host_peers(comm::Communicator& world);

// Groups finish at different times and wait for each other only in the final tally. Each leader
// notes its progress to the other leaders (at most once a second, and at each layer and
// request), and "done" at the end; a leader that has finished waits for every other group's
// "done" and ends the job when one sends nothing for --stall-timeout. Without a heartbeat (one
// group, or no MPI) and on other ranks than leaders every call does nothing.
class GroupProgress {
 public:
  GroupProgress(std::unique_ptr<comm::Heartbeat> hb, bool leader, int group, int n_groups,
                int group_size);
  // A progress note (value >= 0: at most once a second), and what the others said since.
  Status beat(int64_t value);
  // "Done", then every other group's "done"; kDeadlineExceeded naming the group that went quiet
  // for stall_timeout_s.
  Status finish(double stall_timeout_s);
  void close() { hb_.reset(); }  // before MPI finalizes

 private:
  using clock = std::chrono::steady_clock;
  Status drain();
  std::unique_ptr<comm::Heartbeat> hb_;
  bool leader_;
  int group_, n_groups_, group_size_;
  std::vector<int> leaders_;
  std::vector<clock::time_point> seen_;  // when each group last said anything
  std::vector<char> done_;
  std::vector<std::pair<int, int64_t>> notes_;
  clock::time_point last_beat_;
};

}  // namespace sf::worker
