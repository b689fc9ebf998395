// NCCL implementation of Communicator on device buffers (built when CUDA and NCCL are found:
// SF_HAVE_NCCL=1). Its test (tests/comm/test_comm_nccl.cpp, label gpu, np 2) skips without two
// GPUs; it runs on 2x H200 over NVLink, and the GPU runtime (worker/runtime/device_parallel.h)
// is built on it.
//
// - Bootstrapped over another communicator (MPI): rank 0 draws the ncclUniqueId and broadcasts it
//   with that communicator's deadline.
// - Non-blocking NCCL (config.blocking = 0) on its own stream (cudaStreamNonBlocking, on the
//   given device). Every call enqueues, then polls ncclCommGetAsyncError and cudaStreamQuery
//   against the deadline; when it passes, ncclCommAbort and the communicator fails fast from then
//   on, as the MPI one. all_reduce_enqueue only enqueues (behind the caller's event) and
//   wait_enqueued polls the same way for everything enqueued. Enqueued sums also have a watchdog
//   thread: one that started and did not complete within the deadline aborts the communicator,
//   since its caller may be blocked in a CUDA launch behind it (nccl_communicator.cpp).
// - All pointers are device pointers of that device. all_gatherv is one grouped broadcast per
//   rank (NCCL has no gatherv); barrier all-reduces one int in a device scratch word.
#pragma once
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace sf::comm {

// True when this build has the NCCL communicator.
bool nccl_available();

// Collective over bootstrap: a communicator of bootstrap.size() ranks on CUDA device `device`.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap, int device,
                                                             const std::string& name = "nccl");

}  // namespace sf::comm
