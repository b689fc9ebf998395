// Communicator: the collectives and point-to-point calls the TP x CP runtime needs, over one
// group of ranks. Implementations: mpi_communicator (host buffers, CPU), self_communicator (one
// rank, no transport), nccl_communicator (device buffers, its own stream).
//
// Deadlines: every call that waits has one (timeout() from the call's start). When it passes,
// the call returns kDeadlineExceeded naming the collective, the ranks involved and the deadline,
// and the communicator is aborted: every later call fails at once with that first error. A
// timed-out transfer may still complete later; implementations stage buffers so that it never
// touches the caller's memory after the call returned.
//
// Buffers: counts are in elements of dtype. Reductions take kF32, kI32 or kI64; every dtype can
// be moved. send and recv buffers must not overlap unless stated.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace sf::comm {

enum class ReduceOp { kSum, kMax, kMin };
const char* reduce_op_name(ReduceOp op);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "mpi", "self"
  // Human-readable group name ("world", "tp", "cp") used in error messages.
  const std::string& name() const { return name_; }

  // recv = op over ranks of send; send == recv is allowed (in place).
  virtual Status all_reduce(const void* send, void* recv, int64_t count, DType t, ReduceOp op) = 0;
  // recv[size * count] = every rank's send[count] in rank order.
  virtual Status all_gather(const void* send, void* recv, int64_t count, DType t) = 0;
  // Variable counts: counts[size] (the same on every rank, counts[rank()] == send_count); recv
  // holds the rank blocks back to back in rank order.
  virtual Status all_gatherv(const void* send, int64_t send_count, void* recv,
                             std::span<const int64_t> counts, DType t) = 0;
  // send[size * recv_count] is reduced elementwise; rank r keeps block r.
  virtual Status reduce_scatter(const void* send, void* recv, int64_t recv_count, DType t,
                                ReduceOp op) = 0;
  virtual Status send(const void* buf, int64_t count, DType t, int peer, int tag) = 0;
  virtual Status recv(void* buf, int64_t count, DType t, int peer, int tag) = 0;
  // Sends to dest and receives from src in one step (both posted before either is waited on), so
  // a ring or pairwise exchange where every rank sends first cannot deadlock.
  virtual Status sendrecv(const void* send, int64_t send_count, int dest, void* recv,
                          int64_t recv_count, int src, DType t, int tag) = 0;
  virtual Status bcast(void* buf, int64_t count, DType t, int root) = 0;
  virtual Status barrier() = 0;
  // Ranks with the same color form a new communicator, ordered by key then by rank here.
  // Collective over this communicator.
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key,
                                                      const std::string& name) = 0;

  // Stream-ordered all-reduce, in place, for device communicators whose callers overlap it with
  // their own GPU work: enqueued on the communicator's stream after `ready` (a cudaEvent_t the
  // caller recorded on its stream), with `done` (a cudaEvent_t, may be null) recorded after it.
  // Returns once enqueued, without waiting for the result; wait_enqueued() then waits for
  // everything enqueued so far against the deadline (timeout() from its call), with the same
  // abort-on-deadline contract as the blocking calls; a sum that runs longer than timeout() also
  // aborts the communicator while nobody waits (the NCCL one's watchdog), and the next call
  // returns that error. Host communicators: kUnsupported.
  virtual Status all_reduce_enqueue(void* buf, int64_t count, DType t, ReduceOp op, void* ready,
                                    void* done);
  virtual Status wait_enqueued();

  std::chrono::milliseconds timeout() const { return timeout_; }
  // For calls made from now on: a sum already enqueued keeps the deadline it was enqueued with.
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  bool aborted() const { return !abort_status().is_ok(); }
  // The error that aborted the communicator (ok when it is not aborted). Virtual: a device
  // communicator's watchdog can abort it from its own thread (nccl_communicator.h).
  virtual const Status& abort_status() const { return abort_status_; }

  // Bytes this rank sent through collectives and send() since construction (payload only, as
  // the caller counted them; what the algorithm moves on the wire is the implementation's).
  int64_t bytes_sent() const { return bytes_sent_; }

 protected:
  // The checks every implementation's calls start with: the communicator not aborted (its first
  // error named), a count not negative, a peer inside the group.
  Status check_usable(const char* op, int64_t count) const;
  Status check_peer(const char* op, int peer) const;

  std::string name_ = "world";
  std::chrono::milliseconds timeout_{120000};
  Status abort_status_;
  int64_t bytes_sent_ = 0;
};

// The longest deadline a wait takes, in seconds (11.6 days).
inline constexpr double kMaxTimeoutS = 1e6;
// Default deadline of one wait: SF_COMM_TIMEOUT_S seconds when set (a number in (0, 1e6]; another
// value is warned about once and ignored), else 120.
std::chrono::milliseconds default_timeout();

// A one-rank communicator: every collective is a copy. Lets the TP x CP runtime run unchanged
// without MPI (and unit tests run without mpirun).
std::unique_ptr<Communicator> make_self_communicator(const std::string& name = "self");

}  // namespace sf::comm
