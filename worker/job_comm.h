// The worker job's agreements over MPI: every rank learns any rank's failure, whether every rank
// holds the same setting, and which ranks share its host (memory) and its CPUs.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"

namespace sf::worker {

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

}  // namespace sf::worker
