// MPI implementation of Communicator on host buffers, plus the process-edge helpers a job's
// main() needs (init, world communicator, job-wide abort). Only built when SF_MPI found MPI
// (SF_HAVE_MPI=1); without it make_mpi_world() returns kUnsupported.
//
// Every wait is a non-blocking MPI call polled against the call's deadline (MPI_Test, yielding
// then sleeping up to 200 us between polls: ranks are often oversubscribed on CPU). Buffers are
// staged in memory the communicator owns; on a deadline (or an error once a request is posted) the
// staging is handed to the pending request and never freed, because MPI cannot cancel a
// collective. MPI counts are ints: a call past INT_MAX elements goes in pieces, each under the
// deadline (a message's pieces are posted together, so a sendrecv pairs up whatever its sizes).
//
// MPI_Comm_split has no non-blocking form: split() first passes a deadline-bounded barrier, so a
// rank that never comes shows as a deadline error on every rank rather than a hang. Not proof
// against every race: a rank whose deadline passes just as the last rank arrives fails while the
// others, whose barrier completed, wait in the blocking split; the caller must then end the job
// (sparsefill-worker aborts on any failure to build its grid, which frees them).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace sf::comm {

// MPI_Init_thread (funneled: only the calling thread talks MPI). Idempotent.
Status mpi_init(int* argc, char*** argv);
bool mpi_initialized();
// MPI_Finalize. After a communicator aborted (mpi_any_aborted), its pending requests may block
// finalization forever: end the job with mpi_abort_job instead.
void mpi_finalize();
bool mpi_any_aborted();
// Tests only: the elements one MPI call may carry (default INT_MAX, MPI's int counts; 0 restores
// it). Calls past it go in pieces, which a test can then run on small buffers.
void mpi_set_call_limit_for_tests(int64_t elements);
// Ends every rank of the job (MPI_Abort on the world) with the given exit code. Process edge
// only: library code returns a Status instead.
[[noreturn]] void mpi_abort_job(int code);
// World rank and size, or 0 / 1 when MPI is not initialized (a plain process).
int mpi_world_rank();
int mpi_world_size();

// A communicator over a duplicate of MPI_COMM_WORLD (errors return, never abort).
Result<std::unique_ptr<Communicator>> make_mpi_world(const std::string& name = "world");

// Liveness notes beside the collectives, for waits no collective deadline can bound: a batch
// job's groups finish at different times, so its final tally waits for the slowest group, and a
// rank that stops (SIGSTOP, a hung device) in a group of one would hold it until that deadline.
// beat() posts a small value to some world ranks without waiting (MPI_Isend); poll() receives
// whatever has arrived (MPI_Iprobe), never waiting either. Its own duplicate of the world, so
// notes never match another communicator's messages. Notes from one rank arrive in the order
// sent. A rank must poll until every note meant for it has arrived before MPI_Finalize (the
// worker's senders end with a "done" note, and its receivers poll until they have every one).
class Heartbeat {
 public:
  // Collective over the world (like make_mpi_world), within `timeout`.
  static Result<std::unique_ptr<Heartbeat>> create(
      std::chrono::milliseconds timeout = default_timeout());
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  // Posts `value` to each world rank in `to` (this rank is skipped).
  Status beat(std::span<const int> to, int64_t value);
  // Appends every note received since the last call: (source world rank, value).
  Status poll(std::vector<std::pair<int, int64_t>>* got);

 private:
  Heartbeat() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sf::comm
