// The host memory a worker rank holds for one request's K/V, which the host memory check (before
// each prefill) and --dry-run's plan count. Pure arithmetic over the job's options, the model's
// shape and which world ranks share this host: no MPI, no device.
#pragma once
#include <cstdint>
#include <vector>

#include "worker/model/config.h"
#include "worker/options.h"

namespace sf::worker {

class HostKvSizing {
 public:
  // host_bf16: the job keeps K/V on the host in bf16 (--kv-host-dtype, decided once the batch is
  // read). host_ranks: the world ranks on this host, this one included (HostPeers::ranks).
  HostKvSizing(const Options& o, const model::ModelConfig& cfg, bool host_bf16,
               std::vector<int> host_ranks);

  // This rank's rows of a T-token prompt: its share with a sharded export, or all of them (a
  // gathered export, and on the GPU a prompt too short for a 64-token block on every CP rank,
  // which each CP rank computes whole: runtime::DeviceParallelPrefill).
  int64_t rank_rows(int64_t T) const;
  // One layer of this rank's K/V: its rows of its KV heads, K and V.
  int64_t rank_layer_bytes(int64_t T) const;
  // What this rank holds: every layer of its K/V, plus on the CPU one layer's whole-prompt K/V
  // twice (its own and the exchanged).
  int64_t rank_bytes(int64_t T) const;
  // What this host's ranks hold together, each by its place in its group (runtime::make_grid:
  // group rank r % (tp x cp), TP rank its group rank % tp, CP rank its group rank / tp): a
  // sharded export's ranks their own rows; a gathered one's leader the whole cache, each other
  // CP rank 0 its TP slice's heads of every token, the others their own rows with
  // --selective-kv and nothing beyond the forward's layer buffers without.
  int64_t host_bytes(int64_t T) const;
  // --device cuda: a plan's pinned slots for K/V on its way to the host (a ring of
  // --kv-staging-layers layers within --kv-staging-max-gib, as model::kv_staging_slots counts);
  // 0 on the CPU.
  int64_t staging_bytes(int64_t T) const;

  bool host_bf16() const { return host_bf16_; }

 private:
  model::ModelConfig cfg_;
  bool cuda_, sharded_, selective_kv_, host_bf16_;
  int tp_, cp_, staging_layers_;
  int64_t staging_max_bytes_;
  int64_t row_;  // K and V of one token and head on the host
  std::vector<int> host_ranks_;
};

}  // namespace sf::worker
