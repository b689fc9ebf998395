#include "comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/args.h"
#include "common/log.h"

namespace sf::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  if (const char* e = std::getenv("SF_COMM_TIMEOUT_S")) {
    double s = 0;
    // Up to 1e6 s (11.6 days): a larger value would overflow the deadline's clock arithmetic.
    if (whole_number(e, &s) && s > 0 && s <= kMaxTimeoutS)
      return std::chrono::milliseconds(std::max<int64_t>(1, int64_t(s * 1000)));
    static bool warned = false;  // once a process, not at every communicator
    if (!warned) {
      warned = true;
      SF_LOG(kWarn, "comm", "SF_COMM_TIMEOUT_S='" << e << "' is not a number of seconds in (0, "
                                                  << kMaxTimeoutS << "]; using 120");
    }
  }
  return std::chrono::milliseconds(120000);
}

namespace {

// Size 1: the group is this rank alone, so nothing ever waits.
class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) { name_ = std::move(name); }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend() const override { return "self"; }

  Status all_reduce(const void* send, void* recv, int64_t count, DType t, ReduceOp) override {
    return copy(send, recv, count, t, "all_reduce");
  }
  Status all_gather(const void* send, void* recv, int64_t count, DType t) override {
    return copy(send, recv, count, t, "all_gather");
  }
  Status all_gatherv(const void* send, int64_t send_count, void* recv,
                     std::span<const int64_t> counts, DType t) override {
    if (counts.size() != 1 || counts[0] != send_count)
      return SF_ERR(kInvalidArgument,
                    "comm: all_gatherv on '" + name_ + "': counts must be {send_count}");
    return copy(send, recv, send_count, t, "all_gatherv");
  }
  Status reduce_scatter(const void* send, void* recv, int64_t recv_count, DType t,
                        ReduceOp) override {
    return copy(send, recv, recv_count, t, "reduce_scatter");
  }
  Status send(const void*, int64_t, DType, int peer, int) override {
    return SF_ERR(kInvalidArgument, "comm: send to rank " + std::to_string(peer) +
                                        " on the one-rank communicator '" + name_ + "'");
  }
  Status recv(void*, int64_t, DType, int peer, int) override {
    return SF_ERR(kInvalidArgument, "comm: recv from rank " + std::to_string(peer) +
                                        " on the one-rank communicator '" + name_ + "'");
  }
  Status sendrecv(const void* send, int64_t send_count, int dest, void* recv, int64_t recv_count,
                  int src, DType t, int) override {
    if (dest != 0 || src != 0 || send_count != recv_count)
      return SF_ERR(kInvalidArgument, "comm: sendrecv on the one-rank communicator '" + name_ +
                                          "' must be with rank 0, equal counts");
    return copy(send, recv, send_count, t, "sendrecv");
  }
  Status bcast(void*, int64_t count, DType, int root) override {
    if (root != 0 || count < 0)
      return SF_ERR(kInvalidArgument, "comm: bcast on '" + name_ + "': root must be 0");
    return Status::ok();
  }
  Status barrier() override { return Status::ok(); }
  Result<std::unique_ptr<Communicator>> split(int, int, const std::string& name) override {
    return std::unique_ptr<Communicator>(std::make_unique<SelfCommunicator>(name));
  }

 private:
  Status copy(const void* send, void* recv, int64_t count, DType t, const char* op) {
    if (count < 0) return SF_ERR(kInvalidArgument, std::string("comm: ") + op + ": negative count");
    const size_t n = size_t(count) * dtype_size(t);
    if (n && send != recv) std::memmove(recv, send, n);
    bytes_sent_ += int64_t(n);
    return Status::ok();
  }
};

}  // namespace

Status Communicator::all_reduce_enqueue(void*, int64_t, DType, ReduceOp, void*, void*) {
  return SF_ERR(kUnsupported, std::string("comm: stream-ordered all_reduce on '") + name_ + "' (" +
                                  backend() + "): only device communicators have it");
}
Status Communicator::wait_enqueued() { return Status::ok(); }

Status Communicator::check_usable(const char* op, int64_t count) const {
  if (const Status& first = abort_status(); !first.is_ok())
    return Status(first.code(),
                  "comm: " + std::string(op) + " on the aborted communicator '" + name_ +
                      "' (first error: " + first.message() + ")",
                  __FILE__, __LINE__);
  if (count < 0) return SF_ERR(kInvalidArgument, "comm: " + std::string(op) + ": negative count");
  return Status::ok();
}

Status Communicator::check_peer(const char* op, int peer) const {
  if (peer < 0 || peer >= size())
    return SF_ERR(kInvalidArgument, "comm: " + std::string(op) + ": rank " + std::to_string(peer) +
                                        " outside '" + name_ + "' of size " +
                                        std::to_string(size()));
  return Status::ok();
}

std::unique_ptr<Communicator> make_self_communicator(const std::string& name) {
  return std::make_unique<SelfCommunicator>(name);
}

}  // namespace sf::comm
