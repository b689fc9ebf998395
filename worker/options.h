// sparsefill-worker's command line (the usage in kUsage; docs/distributed.md lists every flag)
// and its test-only fault injection (SF_WORKER_FAULT). Parsing validates each flag alone and
// the flags against each other; what needs the model or the batch is checked in the job.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"
#include "worker/model/config.h"

namespace sf::worker {

extern const char* const kUsage;

struct Options {
  std::string model, batch, out, attention = "dense";
  // sharded: every rank writes the shards of the KV it computed and the leader the manifest
  // (needs --out on a filesystem the group's ranks share); gathered: the leader gathers the
  // whole cache and writes every shard.
  std::string export_mode = "sharded";
  // on: a request's export files are written on another thread while the next request's
  // prefill runs (its manifest and summary follow that prefill), so a rank holds two requests'
  // KV at the peak; off: each export finishes before the next prefill starts.
  bool export_overlap = true;
  // A full-retention sharded export (no prefix cache) begins with its prefill and writes each
  // layer as the prefill makes it final (runtime::LayerGate), instead of after the prefill: the
  // request's export is then mostly written when its prefill ends. auto (-1): on with --device
  // cuda, where the host's cores are free during the prefill; off on CPUs, whose prefill uses
  // every core (on: there too).
  int export_stream = -1;
  // Shard files a rank writes at once (kvstore::ExportOptions::layers_in_flight); 0: half its
  // pool threads, 1 to 8, or 1 for a CPU prefill's overlapped export.
  int export_threads = 0;
  int kv_staging_layers = 8;  // --device cuda: pinned host slots for K/V on its way (0: a layer each)
  // --device cuda: a rank's K/V on the host (and in its pinned staging) in bf16 instead of F32
  // (model::PrefillOptions::kv_host_bf16): half the host memory. --kv-host-dtype auto (the
  // default, kv_host_auto) decides it once the batch is read: bf16 when every export of the job
  // is plain bf16 (whose K/V are then the same bytes either way), f32 otherwise.
  bool kv_host_bf16 = false;
  bool kv_host_auto = true;
  // --device cuda: at most this many GiB of those slots, at least two (0: no cap;
  // model::PrefillOptions::kv_staging_max_bytes).
  double kv_staging_max_gib = 8;
  int64_t kv_staging_max_bytes() const {  // a positive cap stays one (at least a byte)
    if (!(kv_staging_max_gib > 0)) return 0;
    return std::max<int64_t>(1, int64_t(kv_staging_max_gib * double(int64_t(1) << 30)));
  }
  // on: a request whose KV (with a device plan's pinned staging) does not fit in 0.8 of the
  // host memory available, counted for every rank on the host, fails before its prefill.
  bool host_memory_check = true;
  // The plan alone: every line checked (bad lines reported as a run reports them), each request's
  // group, resume status and KV sizes, the peak host memory for KV; no prefill, nothing written.
  bool dry_run = false;
  bool help = false;  // --help: the usage on stdout, exit 0
  // cuda: one GPU per rank (its host-local rank), the model's TP slice in BF16 on it, NCCL
  // along the grid (worker/runtime/device_parallel.h); exports are sharded.
  std::string device = "cpu";
  // The dtype the forward computes K/V in, which --kv-dtype auto (and a line's "auto") takes: the
  // GPU forward runs on BF16 weights.
  DType compute_dtype() const { return device == "cuda" ? DType::kBF16 : DType::kF32; }
  int tp = 1, cp = 1;
  int64_t chunk = 0;  // 0 until parsed: --chunk, or the device's default (model::kDefaultChunk*)
  double comm_timeout_s = 0;  // 0: SF_COMM_TIMEOUT_S or 120
  // Several groups: a group whose leader sends no progress note for this long (a layer, a
  // request's export) while the others wait for it to finish ends the job (comm::Heartbeat).
  double stall_timeout_s = 600;
  bool allow_long = false;
  bool cp_estimate = false, selective_kv = false;  // sparsity-aware CP (docs/distributed.md)
  // Applied before export to every request whose line names none (docs/distributed.md,
  // "Retention"); scored policies use the SnapKV importance computed during the prefill.
  kvstore::RetentionPolicy retention;
  // How exports store K and V (kvstore/kv_quant.h).
  kvstore::KvEncodings kv_dtype;  // HIGH or HIGH+LOW (with a retention's high=TOKENS)
  // > 0: each rank keeps a prefix cache of this many bytes of K/V (kvstore/prefix_cache.h), so a
  // request sharing whole 64-token blocks with an earlier one of the same rank computes only the
  // rest (docs/distributed.md, "Prefix cache"). CPU, groups of one rank, dense attention.
  int64_t prefix_cache_bytes = 0;
  // Each group leader's Prometheus text file (worker/runtime/batch_metrics.h); empty: none.
  std::string metrics_file;
  // --model synthetic:...: the shape, its weights drawn on each rank's GPU (--device cuda).
  std::optional<model::SyntheticModelSpec> synthetic;
};

// argv as sparsefill-worker's options, or kInvalidArgument naming the flag.
Result<Options> parse_options(int argc, char** argv);

// Whether an export in `e` stores F32 values (which --kv-host-dtype bf16 cannot give it).
bool stores_f32(const kvstore::KvEncodings& e);
// Whether it is plain bf16 (one tier), whose files are the same bytes from bf16 or F32 host K/V
// (ExportFromBf16HostKvIsTheF32ExportsKv).
bool plain_bf16(const kvstore::KvEncodings& e);

struct Fault {
  // Test-only (SF_WORKER_FAULT=KIND:RANK[:N]): load, kill and stop (at layer N of the first
  // request), slow (N ms slept at every layer), stop_end (before the final tally), fail_after
  // (every request fails on that rank after its prefill; with N, its streamed export sleeps N ms
  // after each layer, so it still reads the prefill's rows then), fail_nth (the same for the Nth request
  // of its group's share only), slow_export (N ms a layer of an export: the leader's gathered
  // one, or this rank's shards), slow_all (slow
  // and slow_export at once), low_memory (the rank sees no host memory beside a pending export:
  // the overlap's check), freeing (its export sleeps N ms after each layer it frees, and beside
  // a pending export it has room once that export has freed half its K/V), no_memory (none at
  // all: the request's own check), memory (N bytes available, for every check and the dry run's),
  // stop_sum (a GPU TP rank SIGSTOPs itself before enqueuing its Nth overlapped TP sum, from 0:
  // its peers' sums then wait on one that never runs), refuse_line (that rank's checks refuse
  // batch line N, as a moa config only some hosts can read would).
  std::string kind;
  int rank = -1;
  int64_t layer = -1;  // a layer, milliseconds, a request's number, or bytes (memory)
};
// SF_WORKER_FAULT, or no fault (kind empty) when unset.
Fault parse_fault();

}  // namespace sf::worker
