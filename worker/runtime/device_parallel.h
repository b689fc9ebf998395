// The TP x CP prefill on GPUs: one rank per GPU, NCCL along each grid row (TP) and column (CP),
// bootstrapped over the rank's MPI grid communicators (grid.h). Each rank holds its TP slice of
// the model (model::DeviceModel with a TpSlice) and its two zigzag CP chunks; it runs the device
// forward as a shard (model::DevicePrefill::plan_shard) whose hooks are these collectives:
//   per layer, CP: all-gather of this slice's K and V rows (in the attention's dtype: BF16 with
//     cuDNN, half the bytes of the F32 all-gather of the CPU runtime), unpacked to prompt order;
//   per layer, TP: all-reduce of the O projection's and the down projection's partial sums (F32).
// The CP exchange runs on NCCL's stream once the compute stream has drained (attention needs
// every key at once). The TP all-reduces are overlapped by default (overlap_tp): each chunk's
// partial sums are summed on NCCL's stream while the next chunk's GEMMs run, and the compute
// stream waits on an event before the residual add, with no host wait inside the layer; without
// it they run synchronously after a drain. stats.comm_s is the time the host waited on
// communication (drained exchanges, blocking all-reduces, the final wait for enqueued sums).
//
// Attention: dense, or sparse (PrefillOptions::sparse) with the device estimators run per piece
// where its queries live: each TP slice scores its own heads (as one GPU does per head), each CP
// piece builds its index from its own rows against keys [0, end), so vertical-slash heads score
// from the piece's last 64 queries rather than the prompt's (and MoA spans scale with the
// piece's key count): on CP > 1 those indices differ from one GPU's. Equality with one GPU: the
// same kernels on the same rows; TP adds partial sums in another order (tests state bounds).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "comm/communicator.h"
#include "worker/model/device_model.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf::runtime {

// This rank's GPU: its rank on its host (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
// SLURM_LOCALID, else the world rank) modulo the visible devices.
Result<int> local_device(int world_rank);

// NCCL communicators of one rank over its grid's TP row and CP column, on `device`. Collective
// over g.tp and g.cp (each bootstraps over its MPI counterpart); a size-1 row or column gets the
// one-rank communicator. Deadlines as the MPI ones (comm/nccl_communicator.h).
struct DeviceGrid {
  int device = 0;
  std::unique_ptr<comm::Communicator> tp, cp;
};
Result<DeviceGrid> make_device_grid(GridComms& g, int device);

struct DeviceParallelOptions {
  bool overlap_tp = true;  // enqueue the TP all-reduces per chunk (see above)
  // Test hook: called before each overlapped TP sum is enqueued, with its number since the plan
  // was made (from 0). The worker's fault injection stops a rank there (SF_WORKER_FAULT=stop_sum),
  // the one place where a stopped TP peer leaves the other ranks' sums behind a sum that never
  // runs.
  std::function<void(int64_t sum)> before_tp_sum;
};

class DeviceParallelPrefill {
 public:
  // Plans this rank's shard of an n_tokens prompt. dm is this rank's TP slice (slice().ways ==
  // g.shape.tp, slice().index == g.tp_rank) on dg.device. opt: chunk, sparse, keep_kv (this
  // rank's rows, pieces in prompt order) and importance_window/pool (SnapKV scores, computed by
  // the CP rank holding the prompt's end against every key, then sent to every rank: run's
  // ParallelResult::importance) are used; all_logits and hooks are refused. A prompt shorter than
  // 2 x CP x 64 tokens (no 64-token block for some CP rank) runs whole on every CP rank, with no
  // exchange, and each rank keeps its own pieces' rows.
  static Result<DeviceParallelPrefill> plan(const model::DeviceModel& dm, GridComms& g,
                                            DeviceGrid& dg, int64_t n_tokens,
                                            const model::PrefillOptions& opt = {},
                                            const DeviceParallelOptions& popt = {});
  // Collective over the group. Every rank passes the whole prompt. first_token on every rank;
  // logits (the last row) on the leader; kv: this rank's rows when keep_kv; stats: this rank's.
  // kv (keep_kv): this run's K/V hooks (model::LayerKvHooks; the result's kv then holds the
  // published rows in place, and a failed run hands its K/V to kv.failed, this rank's run or a
  // peer's; a plan's own kv_hooks are refused: they belong to a run). kv.final is not called
  // for a prompt run whole (shorter than 2 x CP x 64 tokens), whose rows are cut to this rank's
  // after the run.
  Result<ParallelResult> run(std::span<const int32_t> tokens,
                             const model::LayerKvHooks& kv = {});

  // This rank's prompt rows: [begin, end) pieces in prompt order.
  const std::vector<std::array<int64_t, 2>>& pieces() const;
  // Per-layer device time of the last run (DevicePrefill::layer_seconds).
  std::vector<double> layer_seconds() const;
  const model::DevicePrefill& prefill() const;

  DeviceParallelPrefill(DeviceParallelPrefill&&) noexcept;
  DeviceParallelPrefill& operator=(DeviceParallelPrefill&&) noexcept;
  ~DeviceParallelPrefill();

 private:
  struct Impl;
  DeviceParallelPrefill();
  std::unique_ptr<Impl> impl_;
};

}  // namespace sf::runtime
