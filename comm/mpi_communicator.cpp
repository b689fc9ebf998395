#include "comm/mpi_communicator.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if SF_HAVE_MPI
#include <mpi.h>
#endif

namespace sf::comm {

#if SF_HAVE_MPI
namespace {

using clock = std::chrono::steady_clock;

// Set when any communicator aborts: finalization could then block on its pending requests.
bool g_any_abort = false;

// Elements one MPI call may carry (its counts are ints); larger calls go in pieces. Lowered only
// by tests (mpi_set_call_limit_for_tests), so the pieces run without gigabytes of data.
std::atomic<int64_t> g_call_limit{INT_MAX};
int64_t call_limit() { return g_call_limit.load(std::memory_order_relaxed); }

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, size_t(len));
}

// Reductions are defined on these; any dtype can be moved as raw elements.
Result<MPI_Datatype> mpi_type(DType t, bool reduce) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kI64:
      return MPI_INT64_T;
    case DType::kF16:
    case DType::kBF16:
      if (!reduce) return MPI_UINT16_T;
      break;
    case DType::kU8:
      if (!reduce) return MPI_UINT8_T;
      break;
  }
  return SF_ERR(kUnsupported, std::string("comm: no reduction on dtype ") + dtype_name(t));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  return MPI_SUM;
}

// "0-3" or "0,2,5": the world ranks of a group, for error messages.
std::string rank_list(const std::vector<int>& r) {
  std::string s;
  for (size_t i = 0; i < r.size();) {
    size_t j = i;
    while (j + 1 < r.size() && r[j + 1] == r[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(r[i]);
    if (j > i) {
      s += '-';
      s += std::to_string(r[j]);
    }
    i = j + 1;
  }
  return s;
}

std::string seconds_str(std::chrono::milliseconds ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", double(ms.count()) / 1000.0);
  return b;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm c, std::string name) : comm_(c) {
    name_ = std::move(name);
    timeout_ = default_timeout();
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Group g, wg;
    MPI_Comm_group(comm_, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    std::vector<int> mine(size_t(size_), 0);
    for (int i = 0; i < size_; ++i) mine[size_t(i)] = i;
    world_ranks_.assign(size_t(size_), 0);
    MPI_Group_translate_ranks(g, size_, mine.data(), wg, world_ranks_.data());
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
  }
  ~MpiCommunicator() override {
    // A pending request may still reference comm_: leave it to MPI_Abort in that case.
    if (!aborted() && mpi_initialized()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  Status all_reduce(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    SF_TRY(usable("all_reduce", count));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, true));
    const size_t es = dtype_size(t), n = size_t(count) * es;
    stage_.resize(n);
    if (n) std::memcpy(stage_.data(), send, n);
    // Element-wise: a large array is reduced piece by piece, each piece under the deadline.
    const int64_t per = call_limit();
    for (int64_t o = 0; o < count || o == 0; o += per) {
      const int64_t len = std::min(per, count - o);
      SF_TRY(run("all_reduce", group_desc(), [&](Requests& r) {
        return MPI_Iallreduce(MPI_IN_PLACE, stage_.data() + size_t(o) * es, int(len), mt,
                              mpi_op(op), comm_, r.add());
      }));
    }
    if (n) std::memcpy(recv, stage_.data(), n);
    bytes_sent_ += int64_t(n);
    return Status::ok();
  }

  Status all_gather(const void* send, void* recv, int64_t count, DType t) override {
    SF_TRY(usable("all_gather", count * size_));
    // Past one call's limit, the general path's pieces.
    if (count * size_ > call_limit()) {
      const std::vector<int64_t> counts(size_t(size_), count);
      return all_gatherv(send, count, recv, counts, t);
    }
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    const size_t n = size_t(count) * dtype_size(t);
    stage_.resize(n * size_t(size_));
    if (n) std::memcpy(stage_.data() + n * size_t(rank_), send, n);
    SF_TRY(run("all_gather", group_desc(), [&](Requests& r) {
      return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, stage_.data(), int(count), mt,
                            comm_, r.add());
    }));
    if (n) std::memcpy(recv, stage_.data(), n * size_t(size_));
    bytes_sent_ += int64_t(n);
    return Status::ok();
  }

  Status all_gatherv(const void* send, int64_t send_count, void* recv,
                     std::span<const int64_t> counts, DType t) override {
    if (int(counts.size()) != size_)
      return SF_ERR(kInvalidArgument, "comm: all_gatherv on '" + name_ +
                                          "': " + std::to_string(counts.size()) + " counts for " +
                                          std::to_string(size_) + " ranks");
    if (counts[size_t(rank_)] != send_count)
      return SF_ERR(kInvalidArgument, "comm: all_gatherv on '" + name_ + "': counts[" +
                                          std::to_string(rank_) +
                                          "] = " + std::to_string(counts[size_t(rank_)]) +
                                          " but send_count is " + std::to_string(send_count));
    int64_t total = 0;
    for (int i = 0; i < size_; ++i) {
      if (counts[size_t(i)] < 0)
        return SF_ERR(kInvalidArgument, "comm: all_gatherv: negative count");
      total += counts[size_t(i)];
    }
    SF_TRY(usable("all_gatherv", total));
    const size_t es = dtype_size(t);
    // MPI counts and displacements are ints. Past one call's limit (K/V rows of a 1M-token
    // prompt: 2^31 floats at 8 KV heads x 128), each rank's contribution is broadcast from it
    // straight into its place (bcast goes in pieces): every rank still receives what the others
    // hold, and no scratch copy of the whole result is made.
    if (total > call_limit()) {
      char* out = static_cast<char*>(recv);
      int64_t at = 0;
      for (int i = 0; i < size_; ++i) {
        if (i == rank_ && send_count)
          std::memcpy(out + size_t(at) * es, send, size_t(send_count) * es);
        // (Its error names the all-gather: the caller asked for one, not for a broadcast.)
        if (Status st = bcast(out + size_t(at) * es, counts[size_t(i)], t, i); !st.is_ok())
          return Status(st.code(), "comm: all_gatherv on '" + name_ + "', past one call's limit " +
                                       "as a bcast from each rank, at rank " + std::to_string(i) +
                                       "'s part: " + st.message());
        at += counts[size_t(i)];
      }
      return Status::ok();  // (bcast counted this rank's bytes as the root's)
    }
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    stage_.resize(size_t(total) * es);
    // Members: MPI reads them until completion, which may come after a deadline.
    cnt_.assign(size_t(size_), 0);
    disp_.assign(size_t(size_), 0);
    for (int i = 0, off = 0; i < size_; ++i) {
      cnt_[size_t(i)] = int(counts[size_t(i)]);
      disp_[size_t(i)] = off;
      off += cnt_[size_t(i)];
    }
    if (send_count)
      std::memcpy(stage_.data() + size_t(disp_[size_t(rank_)]) * es, send,
                  size_t(send_count) * es);
    SF_TRY(run("all_gatherv", group_desc(), [&](Requests& r) {
      return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, stage_.data(), cnt_.data(),
                             disp_.data(), mt, comm_, r.add());
    }));
    if (total) std::memcpy(recv, stage_.data(), size_t(total) * es);
    bytes_sent_ += send_count * int64_t(es);
    return Status::ok();
  }

  Status reduce_scatter(const void* send, void* recv, int64_t recv_count, DType t,
                        ReduceOp op) override {
    SF_TRY(usable("reduce_scatter", recv_count * size_));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, true));
    const size_t es = dtype_size(t), n = size_t(recv_count) * es;
    // Piece p reduces elements [p*per, (p+1)*per) of every rank's block: they are packed side by
    // side ahead of the result, one call a piece.
    const int64_t per = std::max<int64_t>(1, std::min(recv_count, call_limit() / size_));
    const size_t packed = size_t(per) * es * size_t(size_);
    stage_.resize(packed + n);
    char* out = stage_.data() + packed;
    for (int64_t o = 0; o < recv_count || o == 0; o += per) {
      const int64_t len = std::min(per, recv_count - o);
      for (int i = 0; i < size_ && len > 0; ++i)
        std::memcpy(stage_.data() + size_t(i) * size_t(len) * es,
                    static_cast<const char*>(send) + (size_t(i) * size_t(recv_count) + size_t(o)) * es,
                    size_t(len) * es);
      SF_TRY(run("reduce_scatter", group_desc(), [&](Requests& r) {
        return MPI_Ireduce_scatter_block(stage_.data(), out + size_t(o) * es, int(len), mt,
                                         mpi_op(op), comm_, r.add());
      }));
    }
    if (n) std::memcpy(recv, out, n);
    bytes_sent_ += int64_t(n) * size_;
    return Status::ok();
  }

  Status send(const void* buf, int64_t count, DType t, int peer, int tag) override {
    SF_TRY(usable("send", count));
    SF_TRY(check_peer("send", peer));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    const size_t n = size_t(count) * dtype_size(t);
    stage_.resize(n);
    if (n) std::memcpy(stage_.data(), buf, n);
    SF_TRY(run("send", peer_desc(peer), [&](Requests& r) {
      return post_pieces(Dir::kSend, stage_.data(), count, mt, dtype_size(t), peer, tag, r);
    }));
    bytes_sent_ += int64_t(n);
    return Status::ok();
  }

  Status recv(void* buf, int64_t count, DType t, int peer, int tag) override {
    SF_TRY(usable("recv", count));
    SF_TRY(check_peer("recv", peer));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    const size_t n = size_t(count) * dtype_size(t);
    stage_.resize(n);
    SF_TRY(run("recv", peer_desc(peer), [&](Requests& r) {
      return post_pieces(Dir::kRecv, stage_.data(), count, mt, dtype_size(t), peer, tag, r);
    }));
    if (n) std::memcpy(buf, stage_.data(), n);
    return Status::ok();
  }

  Status sendrecv(const void* send, int64_t send_count, int dest, void* recv, int64_t recv_count,
                  int src, DType t, int tag) override {
    SF_TRY(usable("sendrecv", std::max(send_count, recv_count)));
    SF_TRY(usable("sendrecv", std::min(send_count, recv_count)));
    SF_TRY(check_peer("sendrecv", dest));
    SF_TRY(check_peer("sendrecv", src));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    const size_t es = dtype_size(t), ns = size_t(send_count) * es, nr = size_t(recv_count) * es;
    stage_.resize(ns + nr);
    if (ns) std::memcpy(stage_.data(), send, ns);
    const std::string who =
        "'" + name_ + "': rank " + std::to_string(rank_) + " (world " +
        std::to_string(world_ranks_[size_t(rank_)]) + ") sending to rank " + std::to_string(dest) +
        " (world " + std::to_string(world_ranks_[size_t(dest)]) + "), receiving from rank " +
        std::to_string(src) + " (world " + std::to_string(world_ranks_[size_t(src)]) + ")";
    SF_TRY(run("sendrecv", who, [&](Requests& r) {
      const int rc = post_pieces(Dir::kRecv, stage_.data() + ns, recv_count, mt, es, src, tag, r);
      if (rc != MPI_SUCCESS) return rc;
      return post_pieces(Dir::kSend, stage_.data(), send_count, mt, es, dest, tag, r);
    }));
    if (nr) std::memcpy(recv, stage_.data() + ns, nr);
    bytes_sent_ += int64_t(ns);
    return Status::ok();
  }

  Status bcast(void* buf, int64_t count, DType t, int root) override {
    // One MPI call takes at most INT_MAX elements: larger broadcasts (a batch file past 2 GiB)
    // go in pieces, each under the deadline.
    const int64_t kPiece = call_limit();
    if (count > kPiece) {
      const size_t es = dtype_size(t);
      for (int64_t o = 0; o < count; o += kPiece)
        SF_TRY(bcast(static_cast<char*>(buf) + size_t(o) * es, std::min(kPiece, count - o), t, root));
      return Status::ok();
    }
    SF_TRY(usable("bcast", count));
    SF_TRY(check_peer("bcast", root));
    SF_ASSIGN(MPI_Datatype mt, mpi_type(t, false));
    const size_t n = size_t(count) * dtype_size(t);
    stage_.resize(n);
    if (n && rank_ == root) std::memcpy(stage_.data(), buf, n);
    SF_TRY(run("bcast", group_desc() + ", root " + std::to_string(root), [&](Requests& r) {
      return MPI_Ibcast(stage_.data(), int(count), mt, root, comm_, r.add());
    }));
    if (n && rank_ != root) std::memcpy(buf, stage_.data(), n);
    if (rank_ == root) bytes_sent_ += int64_t(n);
    return Status::ok();
  }

  Status barrier() override {
    SF_TRY(usable("barrier", 0));
    return run("barrier", group_desc(), [&](Requests& r) { return MPI_Ibarrier(comm_, r.add()); });
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key,
                                              const std::string& name) override {
    SF_TRY(usable("split", 0));
    if (color < 0) return SF_ERR(kInvalidArgument, "comm: split: color must be >= 0");
    // Everyone is here once the barrier completes, so the blocking split cannot hang on a rank
    // that never came (see the header for the one race left to the caller).
    SF_TRY(run("split (barrier)", group_desc(),
               [&](Requests& r) { return MPI_Ibarrier(comm_, r.add()); }));
    MPI_Comm nc = MPI_COMM_NULL;
    const int rc = MPI_Comm_split(comm_, color, key, &nc);
    if (rc != MPI_SUCCESS)
      return fail("split", group_desc(), "MPI_Comm_split: " + mpi_error_string(rc));
    auto c = std::make_unique<MpiCommunicator>(nc, name);
    c->set_timeout(timeout_);
    return std::unique_ptr<Communicator>(std::move(c));
  }

 private:
  // The base's checks (counts past one MPI call's limit go in pieces).
  Status usable(const char* op, int64_t count) { return check_usable(op, count); }
  std::string group_desc() const {
    return "'" + name_ + "' (" + std::to_string(size_) + " ranks: world " +
           rank_list(world_ranks_) + "; this is rank " + std::to_string(rank_) + ", world " +
           std::to_string(world_ranks_[size_t(rank_)]) + ")";
  }
  std::string peer_desc(int peer) const {
    return "'" + name_ + "' between rank " + std::to_string(rank_) + " (world " +
           std::to_string(world_ranks_[size_t(rank_)]) + ") and rank " + std::to_string(peer) +
           " (world " + std::to_string(world_ranks_[size_t(peer)]) + ")";
  }
  Status fail(const char* op, const std::string& who, const std::string& why,
              Code code = Code::kInternal) {
    g_any_abort = true;
    abort_status_ = Status(
        code, "comm: " + std::string(op) + " on " + who + ": " + why + "; communicator aborted",
        __FILE__, __LINE__);
    return abort_status_;
  }

  // The requests one call posts: a collective's one, or a point-to-point message's pieces.
  struct Requests {
    std::vector<MPI_Request> v;
    MPI_Request* add() { return &v.emplace_back(MPI_REQUEST_NULL); }
  };
  // Posts `count` elements at `buf` to or from `peer` as messages of at most call_limit()
  // elements, in order (MPI keeps one sender's messages of a tag in order, so both sides' pieces
  // pair up); one empty message for a count of 0.
  enum class Dir { kSend, kRecv };
  int post_pieces(Dir dir, char* buf, int64_t count, MPI_Datatype mt, size_t es, int peer,
                  int tag, Requests& r) {
    const int64_t per = call_limit();
    for (int64_t o = 0; o < count || o == 0; o += per) {
      char* at = buf + size_t(o) * es;
      const int len = int(std::min(per, count - o));
      const int rc = dir == Dir::kSend ? MPI_Isend(at, len, mt, peer, tag, comm_, r.add())
                                       : MPI_Irecv(at, len, mt, peer, tag, comm_, r.add());
      if (rc != MPI_SUCCESS) return rc;
    }
    return MPI_SUCCESS;
  }
  // MPI may still write the staging buffers (a request posted and never completed): give them
  // away for good.
  void leak_staging() {
    new std::vector<char>(std::move(stage_));  // NOLINT: deliberately leaked
    new std::vector<int>(std::move(cnt_));     // NOLINT
    new std::vector<int>(std::move(disp_));    // NOLINT
    stage_ = {};
    cnt_ = {};
    disp_ = {};
  }

  // Starts one non-blocking call (or a message's pieces) and polls it until it completes or the
  // deadline passes. On any failure once a request may be posted, the staging is left to MPI.
  Status run(const char* op, const std::string& who,
             const std::function<int(Requests&)>& start) {
    const auto t0 = clock::now();
    const auto deadline = t0 + timeout_;
    Requests req;
    int rc = start(req);
    if (rc != MPI_SUCCESS) {
      if (!req.v.empty()) leak_staging();
      return fail(op, who, mpi_error_string(rc));
    }
    int spins = 0;
    for (;;) {
      int done = 0;
      rc = MPI_Testall(int(req.v.size()), req.v.data(), &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        leak_staging();
        return fail(op, who, mpi_error_string(rc));
      }
      if (done) return Status::ok();
      if (clock::now() >= deadline) {
        leak_staging();
        return fail(op, who,
                    "did not complete within its deadline of " + seconds_str(timeout_) +
                        " (a peer is stuck, dead or not calling it)",
                    Code::kDeadlineExceeded);
      }
      if (++spins < 32) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 256 ? 20 : 200));
      }
    }
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  std::vector<char> stage_;
  std::vector<int> cnt_, disp_;
};

}  // namespace

Status mpi_init(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return Status::ok();
  int provided = 0;
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS)
    return SF_ERR(kInternal, "MPI_Init_thread failed: " + mpi_error_string(rc));
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  // The job runs threads of its own beside MPI (export writers, the NCCL watchdog, the CPU
  // pool): an MPI that grants only MPI_THREAD_SINGLE does not allow that.
  if (provided < MPI_THREAD_FUNNELED)
    return SF_ERR(kUnsupported, "MPI granted thread level " + std::to_string(provided) +
                                    ", below MPI_THREAD_FUNNELED; use an MPI built with thread "
                                    "support (OpenMPI and MPICH are by default)");
  return Status::ok();
}

bool mpi_initialized() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  return inited && !finalized;
}

void mpi_finalize() {
  if (mpi_initialized()) MPI_Finalize();
}

bool mpi_any_aborted() { return g_any_abort; }

void mpi_set_call_limit_for_tests(int64_t elements) {
  g_call_limit.store(elements > 0 && elements < INT_MAX ? elements : INT_MAX);
}

void mpi_abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int mpi_world_rank() {
  int r = 0;
  if (mpi_initialized()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int mpi_world_size() {
  int n = 1;
  if (mpi_initialized()) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

namespace {
// MPI_Comm_idup of the world: even duplicating it waits with a deadline. `what` names it in the
// error.
Result<MPI_Comm> dup_world(const std::string& what, std::chrono::milliseconds timeout) {
  if (!mpi_initialized())
    return SF_ERR(kInvalidArgument, "comm: MPI is not initialized (call mpi_init first)");
  // MPI writes the new communicator when the duplication completes, which after a deadline may
  // be later: into a cell that outlives this frame (leaked then).
  auto dup = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, dup.get(), &req);
  if (rc != MPI_SUCCESS) return SF_ERR(kInternal, "comm: MPI_Comm_idup: " + mpi_error_string(rc));
  const auto deadline = clock::now() + timeout;
  for (;;) {
    int done = 0;
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      (void)dup.release();  // NOLINT: MPI may still write it
      return SF_ERR(kInternal, "comm: MPI_Comm_idup: " + mpi_error_string(rc));
    }
    if (done) break;
    if (clock::now() >= deadline) {
      g_any_abort = true;
      (void)dup.release();  // NOLINT: MPI may still write it
      return SF_ERR(kDeadlineExceeded, "comm: " + what + " (" + std::to_string(mpi_world_size()) +
                                           " ranks) did not complete within " +
                                           seconds_str(timeout));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return *dup;
}
}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_world(const std::string& name) {
  SF_ASSIGN(MPI_Comm dup, dup_world("duplicating the world communicator", default_timeout()));
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(dup, name));
}

struct Heartbeat::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  // Sends in flight, each with the value it points at (stable: one allocation a note).
  std::vector<std::pair<MPI_Request, std::unique_ptr<int64_t>>> sends;
  void reap() {
    std::erase_if(sends, [](auto& s) {
      int done = 0;
      if (MPI_Test(&s.first, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        (void)s.second.release();  // MPI may still read it: left to the job's end
        return true;
      }
      return done != 0;
    });
  }
};

Result<std::unique_ptr<Heartbeat>> Heartbeat::create(std::chrono::milliseconds timeout) {
  SF_ASSIGN(MPI_Comm dup, dup_world("creating the heartbeat communicator", timeout));
  std::unique_ptr<Heartbeat> h(new Heartbeat());
  h->impl_ = std::make_unique<Impl>();
  h->impl_->comm = dup;
  return h;
}

Heartbeat::~Heartbeat() {
  if (!impl_) return;
  // Every note of a job that ends normally has been received (the worker's leaders poll for
  // every "done"), so its sends complete; a few seconds bound the wait otherwise, and what is
  // still pending is left to the job's end (freeing its buffers would race MPI).
  const auto deadline = clock::now() + std::chrono::seconds(5);
  for (impl_->reap(); !impl_->sends.empty() && clock::now() < deadline; impl_->reap())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (auto& s : impl_->sends) (void)s.second.release();
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

Status Heartbeat::beat(std::span<const int> to, int64_t value) {
  impl_->reap();
  int me = 0;
  MPI_Comm_rank(impl_->comm, &me);
  for (int r : to) {
    if (r == me) continue;
    auto v = std::make_unique<int64_t>(value);
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Isend(v.get(), 1, MPI_INT64_T, r, 0, impl_->comm, &req);
    if (rc != MPI_SUCCESS)
      return SF_ERR(kInternal, "comm: heartbeat to rank " + std::to_string(r) + ": " +
                                   mpi_error_string(rc));
    impl_->sends.emplace_back(req, std::move(v));
  }
  return Status::ok();
}

Status Heartbeat::poll(std::vector<std::pair<int, int64_t>>* got) {
  impl_->reap();
  for (;;) {
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Iprobe(MPI_ANY_SOURCE, 0, impl_->comm, &flag, &st);
    if (rc != MPI_SUCCESS) return SF_ERR(kInternal, "comm: heartbeat probe: " + mpi_error_string(rc));
    if (!flag) return Status::ok();
    int64_t v = 0;
    rc = MPI_Recv(&v, 1, MPI_INT64_T, st.MPI_SOURCE, 0, impl_->comm, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return SF_ERR(kInternal, "comm: heartbeat receive: " + mpi_error_string(rc));
    got->emplace_back(st.MPI_SOURCE, v);
  }
}

#else  // !SF_HAVE_MPI

Status mpi_init(int*, char***) {
  return SF_ERR(kUnsupported, "built without MPI (SF_MPI=OFF or MPI not found)");
}
bool mpi_initialized() { return false; }
void mpi_finalize() {}
bool mpi_any_aborted() { return false; }
void mpi_set_call_limit_for_tests(int64_t) {}
void mpi_abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}
int mpi_world_rank() { return 0; }
int mpi_world_size() { return 1; }
Result<std::unique_ptr<Communicator>> make_mpi_world(const std::string&) {
  return SF_ERR(kUnsupported, "built without MPI (SF_MPI=OFF or MPI not found)");
}
struct Heartbeat::Impl {};
Result<std::unique_ptr<Heartbeat>> Heartbeat::create(std::chrono::milliseconds) {
  return SF_ERR(kUnsupported, "built without MPI (SF_MPI=OFF or MPI not found)");
}
Heartbeat::~Heartbeat() = default;
Status Heartbeat::beat(std::span<const int>, int64_t) {
  return SF_ERR(kUnsupported, "built without MPI");
}
Status Heartbeat::poll(std::vector<std::pair<int, int64_t>>*) {
  return SF_ERR(kUnsupported, "built without MPI");
}

#endif

}  // namespace sf::comm
