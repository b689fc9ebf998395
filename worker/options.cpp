#include "worker/options.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <vector>

#include "comm/communicator.h"
#include "common/args.h"
#include "kvstore/tiered_kv.h"
#include "worker/model/model.h"

namespace sf::worker {

const char* const kUsage =
    "usage: mpirun -np N sparsefill-worker --model PATH|default|synthetic:llama3-8b[:L[:SEED]]\n"
    "                  --batch prompts.jsonl --out DIR\n"
    "                  [--tp T] [--cp C] [--attention MODE] [--chunk N] [--comm-timeout S] "
    "[--stall-timeout S] [--allow-long]\n"
    "                  [--cp-estimate [--selective-kv]] [--export sharded|gathered] "
    "[--export-overlap on|off] [--export-stream auto|on|off] [--export-threads N]\n"
    "                  [--kv-staging-layers N] "
    "[--kv-staging-max-gib G] [--kv-host-dtype auto|f32|bf16] [--dry-run]\n"
    "                  [--host-memory-check on|off] [--metrics-file PATH.prom]\n"
    "                  [--device cpu|cuda] [--retention POLICY] [--kv-dtype "
    "auto|f32|bf16|int8|int4|HIGH+LOW]\n"
    "                  [--prefix-cache BYTES]  (TP = CP = 1, dense; on the GPU with --device cuda)\n";

namespace {

// Whole numbers in [lo, hi] (hi: what the int fields hold, so --tp 4294967298 is not 2).
Result<int64_t> parse_int(const std::string& k, const std::string& v, int64_t lo = 1,
                          int64_t hi = INT32_MAX) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || (errno && errno != ERANGE) || x < lo)  // (x < lo: a negative overflow too)
    return SF_ERR(kInvalidArgument, "--" + k + " must be a " +
                                        (lo == 1 ? "positive" : ">= " + std::to_string(lo)) +
                                        " integer, got '" + v + "'");
  if (errno == ERANGE || x > hi)
    return SF_ERR(kInvalidArgument,
                  "--" + k + " must be at most " + std::to_string(hi) + ", got '" + v + "'");
  return int64_t(x);
}

// An on|off flag, when given.
Status on_off(const std::map<std::string, std::string>& kv, const std::string& k, bool* out) {
  const auto it = kv.find(k);
  if (it == kv.end()) return Status::ok();
  if (it->second != "on" && it->second != "off")
    return SF_ERR(kInvalidArgument, "--" + k + " must be on or off, got '" + it->second + "'");
  *out = it->second == "on";
  return Status::ok();
}

}  // namespace

// Whether an export in `e` stores F32 values (which --kv-host-dtype bf16 cannot give it).
bool stores_f32(const kvstore::KvEncodings& e) {
  return e.high == kvstore::KvEncoding::kF32 || e.low == kvstore::KvEncoding::kF32;
}
// Whether it is plain bf16 (one tier), whose files are the same bytes from bf16 or F32 host K/V
// (ExportFromBf16HostKvIsTheF32ExportsKv).
bool plain_bf16(const kvstore::KvEncodings& e) {
  return e.high == kvstore::KvEncoding::kBF16 && !e.low;
}

Result<Options> parse_options(int argc, char** argv) {
  Options o;
  // The same parser as sparsefill's and sparsefill-decode's (common/args.h).
  SF_ASSIGN(Args args,
            parse_args(argc, argv, 1,
                       {"model", "batch", "out", "tp", "cp", "attention", "chunk", "comm-timeout",
                        "export", "device", "retention", "kv-dtype", "prefix-cache",
                        "stall-timeout", "metrics-file", "export-overlap", "export-stream", "export-threads",
                        "kv-staging-layers", "kv-staging-max-gib", "host-memory-check", "kv-host-dtype"},
                       {"allow-long", "cp-estimate", "selective-kv", "dry-run"}));
  if (args.help) {
    o.help = true;
    return o;
  }
  o.allow_long = args.has("allow-long");
  o.cp_estimate = args.has("cp-estimate");
  o.selective_kv = args.has("selective-kv");
  o.dry_run = args.has("dry-run");
  std::map<std::string, std::string>& kv = args.opts;
  for (const char* req : {"model", "batch", "out"})
    if (!kv.count(req)) return SF_ERR(kInvalidArgument, std::string("--") + req + " is required");
  o.model = kv["model"];
  o.batch = kv["batch"];
  o.out = kv["out"];
  if (kv.count("attention")) o.attention = kv["attention"];
  if (kv.count("export")) o.export_mode = kv["export"];
  if (o.export_mode != "sharded" && o.export_mode != "gathered")
    return SF_ERR(kInvalidArgument,
                  "--export must be sharded or gathered, got '" + o.export_mode + "'");
  SF_TRY(on_off(kv, "export-overlap", &o.export_overlap));
  if (kv.count("export-stream")) {
    const std::string& v = kv["export-stream"];
    if (v != "auto" && v != "on" && v != "off")
      return SF_ERR(kInvalidArgument, "--export-stream must be auto, on or off, got '" + v + "'");
    o.export_stream = v == "auto" ? -1 : v == "on" ? 1 : 0;
  }
  SF_TRY(on_off(kv, "host-memory-check", &o.host_memory_check));
  if (kv.count("tp")) {
    SF_ASSIGN(const int64_t x, parse_int("tp", kv["tp"]));
    o.tp = decltype(o.tp)(x);
  }
  if (kv.count("cp")) {
    SF_ASSIGN(const int64_t x, parse_int("cp", kv["cp"]));
    o.cp = decltype(o.cp)(x);
  }
  if (kv.count("chunk")) {
    SF_ASSIGN(const int64_t x, parse_int("chunk", kv["chunk"]));
    o.chunk = decltype(o.chunk)(x);
  }
  if (kv.count("export-threads")) {
    SF_ASSIGN(const int64_t x, parse_int("export-threads", kv["export-threads"]));
    if (x < 1 || x > 64)
      return SF_ERR(kInvalidArgument, "--export-threads must be in [1, 64], got " + kv["export-threads"]);
    o.export_threads = int(x);
  }
  if (kv.count("kv-staging-layers")) {
    const std::string& v = kv["kv-staging-layers"];
    const auto x = parse_int("kv-staging-layers", v, 0);  // 0 is allowed: a slot per layer
    if (!x.is_ok() || x.value() > 4096)
      return SF_ERR(kInvalidArgument, "--kv-staging-layers must be in [0, 4096], got " + v);
    o.kv_staging_layers = int(x.value());
  }
  SF_ASSIGN(o.kv_staging_max_gib,
            args.get_double("kv-staging-max-gib", o.kv_staging_max_gib, 0, 65536));
  if (kv.count("kv-host-dtype")) {
    const std::string& v = kv["kv-host-dtype"];
    if (v != "auto" && v != "f32" && v != "bf16")
      return SF_ERR(kInvalidArgument, "--kv-host-dtype must be auto, f32 or bf16, got '" + v + "'");
    o.kv_host_auto = v == "auto";
    o.kv_host_bf16 = v == "bf16";
  }
  if (kv.count("comm-timeout")) {
    // At least 1 ms: the deadlines are whole milliseconds, and a smaller value would be 0 ms
    // (every wait failing at once as "a peer is stuck").
    if (!whole_number(kv["comm-timeout"], &o.comm_timeout_s) || !(o.comm_timeout_s >= 1e-3) || o.comm_timeout_s > comm::kMaxTimeoutS)
      return SF_ERR(kInvalidArgument, "--comm-timeout must be a number of seconds in [0.001, 1e6]");
  }
  if (kv.count("stall-timeout")) {
    if (!whole_number(kv["stall-timeout"], &o.stall_timeout_s) || !(o.stall_timeout_s >= 1e-3) || o.stall_timeout_s > comm::kMaxTimeoutS)
      return SF_ERR(kInvalidArgument, "--stall-timeout must be a number of seconds in [0.001, 1e6]");
  }
  if (o.cp_estimate && o.attention == "dense")
    return SF_ERR(kInvalidArgument, "--cp-estimate needs a sparse --attention");
  if (o.selective_kv && !o.cp_estimate)
    return SF_ERR(kInvalidArgument,
                  "--selective-kv needs --cp-estimate (the index must exist before keys move)");
  if (kv.count("retention")) {
    auto rp = kvstore::retention_parse(kv["retention"]);
    if (!rp.is_ok()) return SF_ERR(kInvalidArgument, "--retention: " + rp.status().message());
    o.retention = std::move(rp).value();
  }
  if (kv.count("metrics-file")) {
    o.metrics_file = kv["metrics-file"];
    if (o.metrics_file.empty() || o.metrics_file.back() == '/')
      return SF_ERR(kInvalidArgument, "--metrics-file must name a file, got '" + o.metrics_file + "'");
  }
  if (kv.count("device")) o.device = kv["device"];
  if (o.device != "cpu" && o.device != "cuda")
    return SF_ERR(kInvalidArgument, "--device must be cpu or cuda, got '" + o.device + "'");
  if (o.chunk == 0) o.chunk = o.device == "cuda" ? model::kDefaultChunkDevice : model::kDefaultChunkCpu;
  {
    // auto (the default): bf16 on the GPU, whose forward runs on BF16 weights; f32 on the CPU.
    auto e = kvstore::kv_encodings_parse(kv.count("kv-dtype") ? kv["kv-dtype"] : "auto",
                                         o.compute_dtype());
    if (!e.is_ok()) return SF_ERR(kInvalidArgument, "--kv-dtype: " + e.status().message());
    o.kv_dtype = e.value();
  }
  if (o.device == "cuda" && (o.cp_estimate || o.export_mode != "sharded"))
    return SF_ERR(kInvalidArgument,
                  "--device cuda runs per-piece estimation and sharded exports only (no "
                  "--cp-estimate, --selective-kv or --export gathered)");
  if (kv.count("prefix-cache")) {
    SF_ASSIGN(o.prefix_cache_bytes, kvstore::parse_byte_size(kv["prefix-cache"], "--prefix-cache"));
    // Another rank's prefix would need its KV moved, and the sparse estimators score the rows a
    // call computes, so a hit's index would not be a full prefill's.
    if (o.prefix_cache_bytes <= 0 || o.tp != 1 || o.cp != 1 || o.attention != "dense")
      return SF_ERR(kInvalidArgument,
                    "--prefix-cache needs a positive size, --tp 1 --cp 1 and dense attention "
                    "(each rank then serves its own requests from its own cache)");
  }
  if (o.kv_host_bf16 && (o.device != "cuda" || o.prefix_cache_bytes > 0))
    return SF_ERR(kInvalidArgument,
                  "--kv-host-dtype bf16 is the device prefill's (--device cuda, no --prefix-cache, "
                  "whose cache holds F32)");
  if (o.kv_host_bf16 && stores_f32(o.kv_dtype))
    return SF_ERR(kInvalidArgument, "--kv-host-dtype bf16 keeps bf16 values: an f32 export "
                                    "(--kv-dtype) needs --kv-host-dtype f32");
  o.model = model::resolve_model_path(o.model, SF_SOURCE_DIR);
  SF_ASSIGN(o.synthetic, model::parse_synthetic_model(o.model));
  if (o.synthetic && o.device != "cuda")
    return SF_ERR(kInvalidArgument, "--model " + o.model +
                                        " draws its weights on the GPU: it needs --device cuda");
  return o;
}

Fault parse_fault() {
  Fault f;
  const char* e = std::getenv("SF_WORKER_FAULT");
  if (!e) return f;
  std::string s(e);
  std::istringstream ss(s);
  std::string part;
  std::vector<std::string> p;
  while (std::getline(ss, part, ':')) p.push_back(part);
  if (p.size() >= 2) {
    f.kind = p[0];
    f.rank = std::atoi(p[1].c_str());
    if (p.size() >= 3) f.layer = std::atoll(p[2].c_str());
  }
  return f;
}

}  // namespace sf::worker
