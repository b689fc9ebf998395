#include "comm/nccl_communicator.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if SF_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace sf::comm {

#if SF_HAVE_NCCL
namespace {

using clock = std::chrono::steady_clock;

Result<ncclDataType_t> nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;
  }
  return SF_ERR(kUnsupported, "comm: dtype not supported by NCCL");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

std::string seconds_str(std::chrono::milliseconds ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", double(ms.count()) / 1000.0);
  return b;
}

// Polls a non-blocking NCCL communicator's async state until its pending operation (init, split,
// enqueue) leaves ncclInProgress, or the deadline passes. get_error(&state) is
// ncclCommGetAsyncError on the communicator (a live NcclCommunicator's under its API lock).
template <typename GetError>
ncclResult_t poll_until_ready(GetError&& get_error, clock::time_point deadline, bool* timed_out) {
  *timed_out = false;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t rc = get_error(&st);
    if (rc != ncclSuccess) return rc;
    if (st != ncclInProgress) return st;
    if (clock::now() >= deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}
ncclResult_t wait_ready(ncclComm_t c, clock::time_point deadline, bool* timed_out) {
  return poll_until_ready([c](ncclResult_t* st) { return ncclCommGetAsyncError(c, st); }, deadline,
                          timed_out);
}

// Enqueued sums (all_reduce_enqueue) have a watchdog thread. The caller does not wait for them:
// it goes on enqueuing its own work, some of it behind the sums. When a peer has stopped, a sum
// never completes, the caller's stream stalls behind it, and once the driver's launch queue is
// full the caller blocks inside a kernel launch, which no deadline of ours reaches (bench/NOTES.md,
// fifty-fourth and fifty-fifth sessions). So a thread watches the sums in order: a sum that
// started (its `begin` event, recorded after the caller's `ready`, completed) and has not
// completed within timeout() aborts the communicator. ncclCommAbort makes the NCCL kernels
// return, the streams behind them drain, the blocked launch returns, and the caller's next call
// here fails with the watchdog's error.
//
// ncclCommAbort frees the communicator, so every NCCL call on comm_ runs under api_mu_ and only
// while the communicator is not aborted (nccl()). The watchdog aborts under api_mu_ too. So that
// the caller is never blocked inside an NCCL call (holding api_mu_) behind a stuck sum, at most
// kMaxPending sums are in flight: a few entries each on the communicator's stream, well below
// the launch queue's depth (about a thousand entries on H200; bench/NOTES.md, fifty-fifth
// session), so NCCL's own launch never waits for room. Should the caller still hold api_mu_ for a
// second, the watchdog aborts without it (the caller is then blocked in an NCCL call that only
// the abort releases; it may crash on the freed communicator, but does not hang).
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t c, int device, int rank, int size, std::string name)
      : comm_(c), device_(device), rank_(rank), size_(size) {
    name_ = std::move(name);
  }
  // Stream and scratch come after construction so their errors become a Status.
  Status init_resources() {
    SF_TRY(cuda("cudaSetDevice", cudaSetDevice(device_)));
    SF_TRY(cuda("cudaStreamCreateWithFlags",
                cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)));
    return cuda("cudaMalloc", cudaMalloc(&scratch_, sizeof(int32_t)));
  }
  ~NcclCommunicator() override {
    stop_watchdog();
    // Work still on the stream (a caller that failed elsewhere with sums behind a stopped peer):
    // ncclCommDestroy would wait for it for good, so abort instead. After an abort the stream,
    // scratch word and events are left to the process's end, as after any abort.
    if (!gone() && stream_) {
      const auto until = clock::now() + std::chrono::seconds(1);
      while (cudaStreamQuery(stream_) == cudaErrorNotReady && clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (cudaStreamQuery(stream_) == cudaErrorNotReady && claim_abort(kCallerAborted))
        ncclCommAbort(comm_);
    }
    if (!gone()) {
      ncclCommDestroy(comm_);
      if (scratch_) cudaFree(scratch_);
      if (stream_) cudaStreamDestroy(stream_);
      for (const Pending& p : pending_) spare_.insert(spare_.end(), {p.begin, p.end});
      for (cudaEvent_t e : spare_) cudaEventDestroy(e);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }
  const Status& abort_status() const override {
    if (!abort_status_.is_ok()) return abort_status_;
    // watch_status_ is written once, before the watchdog's abort is published.
    if (state_.load(std::memory_order_acquire) == kWatchdogAborted) return watch_status_;
    return abort_status_;
  }

  Status all_reduce(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    SF_TRY(check_usable("all_reduce", count));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("all_reduce", group(), [&] {
      return ncclAllReduce(send, recv, size_t(count), nt, nccl_op(op), comm_, stream_);
    }));
    bytes_sent_ += count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status all_reduce_enqueue(void* buf, int64_t count, DType t, ReduceOp op, void* ready,
                            void* done) override {
    SF_TRY(check_usable("all_reduce", count));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    const auto deadline = clock::now() + timeout_;
    SF_TRY(cuda("cudaSetDevice", cudaSetDevice(device_)));
    if (ready)
      SF_TRY(cuda("cudaStreamWaitEvent",
                  cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ready), 0)));
    SF_TRY(start_watchdog());
    SF_TRY(wait_for_room(deadline));
    Pending p;
    SF_TRY(take_events(p));
    Status st = cuda("cudaEventRecord", cudaEventRecord(p.begin, stream_));
    if (st.is_ok()) {
      ncclResult_t rc =
          nccl([&] { return ncclAllReduce(buf, buf, size_t(count), nt, nccl_op(op), comm_, stream_); });
      if (rc != ncclSuccess && rc != ncclInProgress) {
        st = fail("all_reduce", group(), ncclGetErrorString(rc));
      } else {
        bool timed_out = false;
        rc = poll_ready(deadline, &timed_out);  // the enqueue itself, not the transfer
        if (timed_out)
          st = deadline_passed("all_reduce", group());
        else if (rc != ncclSuccess)
          st = fail("all_reduce", group(), ncclGetErrorString(rc));
      }
    }
    // A sum enqueued but not watched (its `end` not recorded) could hang its caller unseen: the
    // communicator is aborted instead.
    if (st.is_ok())
      if (const cudaError_t e = cudaEventRecord(p.end, stream_); e != cudaSuccess)
        st = fail("all_reduce", group(), std::string("cudaEventRecord: ") + cudaGetErrorString(e));
    if (!st.is_ok()) {
      std::lock_guard<std::mutex> lk(watch_mu_);
      spare_.insert(spare_.end(), {p.begin, p.end});
      return st;
    }
    watch(p);
    if (done)
      if (const cudaError_t e = cudaEventRecord(static_cast<cudaEvent_t>(done), stream_);
          e != cudaSuccess)
        return fail("all_reduce", group(), std::string("cudaEventRecord: ") + cudaGetErrorString(e));
    bytes_sent_ += count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status wait_enqueued() override {
    SF_TRY(check_usable("wait", 0));
    SF_TRY(cuda("cudaSetDevice", cudaSetDevice(device_)));
    return drain("all_reduce (enqueued)", group(), clock::now() + timeout_);
  }
  Status all_gather(const void* send, void* recv, int64_t count, DType t) override {
    SF_TRY(check_usable("all_gather", count));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("all_gather", group(),
               [&] { return ncclAllGather(send, recv, size_t(count), nt, comm_, stream_); }));
    bytes_sent_ += count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status all_gatherv(const void* send, int64_t send_count, void* recv,
                     std::span<const int64_t> counts, DType t) override {
    if (int(counts.size()) != size_ || counts[size_t(rank_)] != send_count)
      return SF_ERR(kInvalidArgument, "comm: all_gatherv on '" + name_ +
                                          "': counts must have one entry per rank and "
                                          "counts[rank] == send_count");
    SF_TRY(check_usable("all_gatherv", send_count));
    for (const int64_t c : counts)  // (another rank's count too: a negative one wraps to size_t)
      SF_TRY(check_usable("all_gatherv", c));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    const size_t es = dtype_size(t);
    SF_TRY(run("all_gatherv", group(), [&] {
      ncclResult_t rc = ncclGroupStart();
      size_t off = 0;
      for (int r = 0; r < size_ && rc == ncclSuccess; ++r) {
        char* dst = static_cast<char*>(recv) + off * es;
        rc = ncclBroadcast(r == rank_ ? send : dst, dst, size_t(counts[size_t(r)]), nt, r, comm_,
                           stream_);
        off += size_t(counts[size_t(r)]);
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    }));
    bytes_sent_ += send_count * int64_t(es);
    return Status::ok();
  }
  Status reduce_scatter(const void* send, void* recv, int64_t recv_count, DType t,
                        ReduceOp op) override {
    SF_TRY(check_usable("reduce_scatter", recv_count));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("reduce_scatter", group(), [&] {
      return ncclReduceScatter(send, recv, size_t(recv_count), nt, nccl_op(op), comm_, stream_);
    }));
    bytes_sent_ += recv_count * size_ * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status send(const void* buf, int64_t count, DType t, int peer, int) override {
    SF_TRY(check_usable("send", count));
    SF_TRY(check_peer("send", peer));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("send", pair(peer),
               [&] { return ncclSend(buf, size_t(count), nt, peer, comm_, stream_); }));
    bytes_sent_ += count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status recv(void* buf, int64_t count, DType t, int peer, int) override {
    SF_TRY(check_usable("recv", count));
    SF_TRY(check_peer("recv", peer));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    return run("recv", pair(peer),
               [&] { return ncclRecv(buf, size_t(count), nt, peer, comm_, stream_); });
  }
  Status sendrecv(const void* sbuf, int64_t send_count, int dest, void* rbuf, int64_t recv_count,
                  int src, DType t, int) override {
    SF_TRY(check_usable("sendrecv", std::min(send_count, recv_count)));  // (either negative)
    SF_TRY(check_peer("sendrecv", dest));
    SF_TRY(check_peer("sendrecv", src));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("sendrecv", pair(dest) + " and " + pair(src), [&] {
      ncclResult_t rc = ncclGroupStart();
      if (rc == ncclSuccess) rc = ncclSend(sbuf, size_t(send_count), nt, dest, comm_, stream_);
      if (rc == ncclSuccess) rc = ncclRecv(rbuf, size_t(recv_count), nt, src, comm_, stream_);
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    }));
    bytes_sent_ += send_count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status bcast(void* buf, int64_t count, DType t, int root) override {
    SF_TRY(check_usable("bcast", count));
    SF_TRY(check_peer("bcast", root));
    SF_ASSIGN(ncclDataType_t nt, nccl_type(t));
    SF_TRY(run("bcast", group(),
               [&] { return ncclBroadcast(buf, buf, size_t(count), nt, root, comm_, stream_); }));
    if (rank_ == root) bytes_sent_ += count * int64_t(dtype_size(t));
    return Status::ok();
  }
  Status barrier() override {
    SF_TRY(check_usable("barrier", 1));
    return run("barrier", group(), [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }
  Result<std::unique_ptr<Communicator>> split(int color, int key,
                                              const std::string& name) override {
    SF_TRY(check_usable("split", 0));
    if (color < 0) return SF_ERR(kInvalidArgument, "comm: split: color must be >= 0");
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nc = nullptr;
    const auto deadline = clock::now() + timeout_;
    ncclResult_t rc = nccl([&] { return ncclCommSplit(comm_, color, key, &nc, &cfg); });
    if (gone()) {
      if (nc) ncclCommAbort(nc);  // the child, half made
      return check_usable("split", 0);
    }
    if (rc != ncclSuccess && rc != ncclInProgress)
      return fail("split", group(), ncclGetErrorString(rc));
    bool timed_out = false;
    rc = poll_ready(deadline, &timed_out);
    if (!timed_out && rc == ncclSuccess && nc) rc = wait_ready(nc, deadline, &timed_out);
    if ((timed_out || rc != ncclSuccess || gone()) && nc) ncclCommAbort(nc);  // the child, half made
    if (gone()) return check_usable("split", 0);
    if (timed_out) return deadline_passed("split", group());
    if (rc != ncclSuccess) return fail("split", group(), ncclGetErrorString(rc));
    int r = 0, n = 0;
    ncclCommUserRank(nc, &r);
    ncclCommCount(nc, &n);
    auto c = std::make_unique<NcclCommunicator>(nc, device_, r, n, name);
    c->set_timeout(timeout_);
    SF_TRY(c->init_resources());
    return std::unique_ptr<Communicator>(std::move(c));
  }

 private:
  // One enqueued sum: `begin` is recorded after the caller's `ready`, `end` after the sum.
  struct Pending {
    cudaEvent_t begin = nullptr, end = nullptr;
    std::chrono::milliseconds limit{0};  // timeout() when it was enqueued
    bool started = false;                // `begin` seen complete, at `began`
    clock::time_point began{};
  };

  Status cuda(const char* what, cudaError_t e) {
    if (e == cudaSuccess) return Status::ok();
    return SF_ERR(kInternal, std::string("comm: ") + what + ": " + cudaGetErrorString(e));
  }

  std::string group() const {
    return "'" + name_ + "' (nccl, " + std::to_string(size_) + " ranks; this is rank " +
           std::to_string(rank_) + ", cuda:" + std::to_string(device_) + ")";
  }
  std::string pair(int peer) const {
    return "'" + name_ + "' rank " + std::to_string(rank_) + " <-> rank " + std::to_string(peer);
  }

  // True once comm_ is aborted (freed), by a failed call or by the watchdog.
  bool gone() const { return state_.load(std::memory_order_acquire) != kLive; }
  // Moves the state from live to `to`; false when it was already aborted.
  bool claim_abort(int to) {
    int live = kLive;
    return state_.compare_exchange_strong(live, to, std::memory_order_acq_rel);
  }
  // Runs NCCL calls on comm_ under the API lock; after an abort they are not run (and the caller
  // checks gone()).
  template <typename F>
  ncclResult_t nccl(F&& f) {
    std::lock_guard<std::timed_mutex> lk(api_mu_);
    if (gone()) return ncclInvalidUsage;
    return f();
  }
  // wait_ready on comm_, a call at a time under the API lock.
  ncclResult_t poll_ready(clock::time_point deadline, bool* timed_out) {
    return poll_until_ready(
        [this](ncclResult_t* st) { return nccl([&] { return ncclCommGetAsyncError(comm_, st); }); },
        deadline, timed_out);
  }

  Status fail(const char* op, const std::string& who, const std::string& why,
              Code code = Code::kInternal) {
    {
      std::lock_guard<std::timed_mutex> lk(api_mu_);
      if (!claim_abort(kCallerAborted))
        return check_usable(op, 0);  // the watchdog aborted it first: its error
      ncclCommAbort(comm_);
    }
    abort_status_ = Status(
        code, "comm: " + std::string(op) + " on " + who + ": " + why + "; communicator aborted",
        __FILE__, __LINE__);
    return abort_status_;
  }
  Status deadline_passed(const char* op, const std::string& who) {
    return fail(op, who,
                "did not complete within its deadline of " + seconds_str(timeout_) +
                    " (a peer is stuck, dead or not calling it)",
                Code::kDeadlineExceeded);
  }

  // Enqueues on the stream, then polls NCCL's async state and the stream against the deadline.
  template <typename F>
  Status run(const char* op, const std::string& who, F&& enqueue) {
    const auto deadline = clock::now() + timeout_;
    cudaSetDevice(device_);
    ncclResult_t rc = nccl(enqueue);
    if (gone()) return check_usable(op, 0);
    if (rc != ncclSuccess && rc != ncclInProgress) return fail(op, who, ncclGetErrorString(rc));
    bool timed_out = false;
    rc = poll_ready(deadline, &timed_out);
    if (gone()) return check_usable(op, 0);
    if (timed_out) return deadline_passed(op, who);
    if (rc != ncclSuccess) return fail(op, who, ncclGetErrorString(rc));
    return drain(op, who, deadline);
  }

  // Polls the stream until everything on it has completed, watching NCCL's async error and the
  // deadline.
  Status drain(const char* op, const std::string& who, clock::time_point deadline) {
    for (int spins = 0;; ++spins) {
      if (gone()) return check_usable(op, 0);
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return Status::ok();
      if (e != cudaErrorNotReady) return fail(op, who, cudaGetErrorString(e));
      ncclResult_t st = ncclSuccess;
      nccl([&] { return ncclCommGetAsyncError(comm_, &st); });
      if (gone()) return check_usable(op, 0);
      if (st != ncclSuccess && st != ncclInProgress) return fail(op, who, ncclGetErrorString(st));
      if (clock::now() >= deadline) return deadline_passed(op, who);
      if (spins < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // ---- The watchdog of enqueued sums (see the class comment). ----
  Status take_events(Pending& p) {
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      for (cudaEvent_t* e : {&p.begin, &p.end})
        if (!spare_.empty()) {
          *e = spare_.back();
          spare_.pop_back();
        }
    }
    for (cudaEvent_t* e : {&p.begin, &p.end})
      if (!*e) SF_TRY(cuda("cudaEventCreateWithFlags",
                           cudaEventCreateWithFlags(e, cudaEventDisableTiming)));
    p.limit = timeout_;
    return Status::ok();
  }
  // Retires the completed sums at the front (they complete in stream order). Under watch_mu_.
  void retire_locked() {
    while (!pending_.empty() && cudaEventQuery(pending_.front().end) == cudaSuccess) {
      spare_.insert(spare_.end(), {pending_.front().begin, pending_.front().end});
      pending_.pop_front();
    }
  }
  // Waits until fewer than kMaxPending sums are in flight (see the class comment), up to twice the
  // deadline: a stuck sum is the watchdog's to abort at one.
  Status wait_for_room(clock::time_point deadline) {
    const auto until = deadline + timeout_;
    std::unique_lock<std::mutex> lk(watch_mu_);
    for (;;) {
      retire_locked();
      if (pending_.size() < kMaxPending || gone()) break;
      if (clock::now() >= until) {
        lk.unlock();
        return fail("all_reduce", group(),
                    "no room for another sum within twice its deadline of " +
                        seconds_str(timeout_) + " (a peer is stuck, dead or not calling it)",
                    Code::kDeadlineExceeded);
      }
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lk.lock();
    }
    lk.unlock();
    return gone() ? check_usable("all_reduce", 0) : Status::ok();
  }
  // Started with the first enqueued sum (most communicators never enqueue one), before that sum
  // goes in: a thread that cannot start is this call's error, not std::thread's exception, and no
  // sum is ever in flight unwatched. Nothing is enqueued yet, so the communicator stays usable.
  Status start_watchdog() {
    if (watch_.joinable()) return Status::ok();
    try {
      watch_ = std::thread([this] { watch_loop(); });
    } catch (const std::exception& e) {
      return SF_ERR(kResourceExhausted, "comm: all_reduce (enqueued) on " + group() +
                                            ": cannot start the sums' watchdog thread: " + e.what());
    }
    return Status::ok();
  }
  void watch(const Pending& p) {
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      pending_.push_back(p);
    }
    watch_cv_.notify_one();
  }
  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      watch_stop_ = true;
    }
    watch_cv_.notify_one();
    if (watch_.joinable()) watch_.join();
  }
  void watch_loop() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lk(watch_mu_);
    while (!watch_stop_ && !gone()) {
      watch_cv_.wait_for(lk, pending_.empty() ? std::chrono::milliseconds(100)
                                              : std::chrono::milliseconds(5));
      // Sums complete in stream order: retire the finished ones, then look at the oldest.
      retire_locked();
      if (pending_.empty()) continue;
      Pending& p = pending_.front();
      const auto now = clock::now();
      if (!p.started) {
        if (cudaEventQuery(p.begin) == cudaSuccess) p.started = true, p.began = now;
        continue;
      }
      if (now - p.began < p.limit) continue;
      char ran[32];
      std::snprintf(ran, sizeof ran, "%.1f s",
                    std::chrono::duration<double>(now - p.began).count());
      watch_status_ = Status(
          Code::kDeadlineExceeded,
          "comm: all_reduce (enqueued) on " + group() + ": a sum running for " + ran +
              " did not complete within its deadline of " + seconds_str(p.limit) +
              " (a peer is stuck, dead or not calling it); communicator aborted by its watchdog",
          __FILE__, __LINE__);
      lk.unlock();
      {
        // Under the API lock unless the caller has held it for a second: then it is blocked in
        // an NCCL call that only the abort releases.
        std::unique_lock<std::timed_mutex> api(api_mu_, std::defer_lock);
        (void)api.try_lock_for(std::chrono::seconds(1));
        if (claim_abort(kWatchdogAborted)) ncclCommAbort(comm_);
      }
      lk.lock();
    }
  }

  ncclComm_t comm_;
  int device_ = 0, rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::timed_mutex api_mu_;             // held around every NCCL call on comm_
  static constexpr size_t kMaxPending = 96;  // sums in flight (see the class comment)
  // Whether comm_ is live or aborted (freed), and by whom.
  static constexpr int kLive = 0, kCallerAborted = 1, kWatchdogAborted = 2;
  std::atomic<int> state_{kLive};
  Status watch_status_;  // the watchdog's error, written before it claims the abort
  std::mutex watch_mu_;  // pending_, spare_, watch_stop_
  std::condition_variable watch_cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_;
  bool watch_stop_ = false;
  std::thread watch_;
};

}  // namespace

bool nccl_available() { return true; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap, int device,
                                                             const std::string& name) {
  if (cudaSetDevice(device) != cudaSuccess)
    return SF_ERR(kUnsupported, "comm: nccl: cannot use cuda:" + std::to_string(device));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  Status got = Status::ok();
  if (bootstrap.rank() == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess)
      got = SF_ERR(kInternal, std::string("comm: ncclGetUniqueId: ") + ncclGetErrorString(rc));
  }
  // Rank 0's failure still reaches the others (an all-zero id), so nobody waits on init.
  int32_t ok = got.is_ok() ? 1 : 0;
  SF_TRY(bootstrap.bcast(&ok, 1, DType::kI32, 0));
  if (!ok)
    return got.is_ok() ? SF_ERR(kInternal, "comm: nccl: rank 0 could not create the id") : got;
  SF_TRY(bootstrap.bcast(&id, int64_t(sizeof id), DType::kU8, 0));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = nullptr;
  const auto deadline = clock::now() + bootstrap.timeout();
  ncclResult_t rc = ncclCommInitRankConfig(&c, bootstrap.size(), id, bootstrap.rank(), &cfg);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    if (c) ncclCommAbort(c);
    return SF_ERR(kInternal,
                  std::string("comm: ncclCommInitRankConfig: ") + ncclGetErrorString(rc));
  }
  bool timed_out = false;
  rc = wait_ready(c, deadline, &timed_out);
  if (timed_out || rc != ncclSuccess) {
    ncclCommAbort(c);
    if (timed_out)
      return SF_ERR(kDeadlineExceeded,
                    "comm: nccl init of '" + name + "' (" + std::to_string(bootstrap.size()) +
                        " ranks) did not complete within " + seconds_str(bootstrap.timeout()));
    return SF_ERR(kInternal, std::string("comm: nccl init: ") + ncclGetErrorString(rc));
  }
  auto n = std::make_unique<NcclCommunicator>(c, device, bootstrap.rank(), bootstrap.size(), name);
  n->set_timeout(bootstrap.timeout());
  SF_TRY(n->init_resources());
  return std::unique_ptr<Communicator>(std::move(n));
}

#else  // !SF_HAVE_NCCL

bool nccl_available() { return false; }
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator&, int,
                                                             const std::string&) {
  return SF_ERR(kUnsupported, "built without NCCL (needs the CUDA build and nccl.h / libnccl)");
}

#endif

}  // namespace sf::comm
