// `sparsefill prefill`: tokenize, run the prefill forward, report TTFT, optionally export KV.
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "common/file_io.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "common/timing.h"
#include "kvstore/kv_export.h"
#include "kvstore/tiered_kv.h"
#include "tools/cli/cli.h"
#include "worker/model/device_model.h"
#include "worker/model/gguf.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/model/tokenizer.h"

namespace sf::cli {
namespace {

Result<std::vector<int32_t>> parse_token_file(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream ss(text);
  std::string w;
  while (ss >> w) {
    char* end = nullptr;
    const long v = std::strtol(w.c_str(), &end, 10);
    if (*end || v < 0 || v > INT32_MAX) return SF_ERR(kInvalidArgument, "prompt token file: '" + w + "' is not a token id");
    ids.push_back(int32_t(v));
  }
  return ids;
}

}  // namespace

int cmd_prefill(int argc, char** argv) {
  auto args_r = parse_args(
      argc, argv, 2,
      {"model", "prompt-file", "prompt", "prompt-tokens", "export-kv", "chunk", "tokenizer",
       "attention", "device", "retention", "kv-pool", "dump-attention", "importance", "kv-dtype",
       "metrics-file"},
      {"force", "allow-long", "print-tokens"});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  if (!a.has("model")) return fail(SF_ERR(kInvalidArgument, "--model is required (a .gguf file, a HF directory, or 'default')"));
  const int n_src = int(a.has("prompt-file")) + int(a.has("prompt")) + int(a.has("prompt-tokens"));
  if (n_src != 1) return fail(SF_ERR(kInvalidArgument, "give exactly one of --prompt-file, --prompt, --prompt-tokens"));

  // Check cheap inputs before the (slow) model load.
  std::string text;
  if (a.has("prompt-file")) {
    auto t = read_file(a.get("prompt-file"), "prompt file");
    if (!t.is_ok()) return fail(t.status());
    text = std::move(t).value();
  } else if (a.has("prompt")) {
    text = a.get("prompt");
  }
  if (!a.has("prompt-tokens") && text.empty()) return fail(SF_ERR(kInvalidArgument, "the prompt is empty"));
  std::vector<int32_t> token_file_ids;
  if (a.has("prompt-tokens")) {
    auto t = read_file(a.get("prompt-tokens"), "prompt token file");
    if (!t.is_ok()) return fail(t.status());
    auto r = parse_token_file(t.value());
    if (!r.is_ok()) return fail(r.status());
    token_file_ids = std::move(r).value();
  }
  if (a.has("export-kv")) {
    if (Status st = kvstore::export_dir_check(a.get("export-kv"), a.has("force")); !st.is_ok())
      return fail(st);
    if (Status st = check_output_dir(a.get("export-kv"), "--export-kv"); !st.is_ok()) return fail(st);
  }
  for (const char* k : {"importance", "force"})
    if (a.has(k) && !a.has("export-kv"))
      return fail(SF_ERR(kInvalidArgument, std::string("--") + k + " applies to --export-kv"));
  const std::string importance_src = a.get("importance", "lse");
  if (importance_src != "lse" && importance_src != "estimator")
    return fail(SF_ERR(kInvalidArgument, "--importance '" + importance_src + "' is not lse or estimator"));
  kvstore::RetentionPolicy retention;
  if (a.has("retention")) {
    if (!a.has("export-kv")) return fail(SF_ERR(kInvalidArgument, "--retention applies to --export-kv"));
    auto rp = kvstore::retention_parse(a.get("retention"));
    if (!rp.is_ok()) return fail(rp.status());
    retention = std::move(rp).value();
  }
  // --kv-dtype: how the export stores K and V (kvstore/kv_quant.h); HIGH+LOW pairs with a
  // retention whose high= splits the kept tokens into two tiers.
  // auto (the default): the forward's own dtype, bf16 on --device cuda (BF16 weights), else f32.
  if (a.has("kv-dtype") && !a.has("export-kv"))
    return fail(SF_ERR(kInvalidArgument, "--kv-dtype applies to --export-kv"));
  auto kv_dtype_r = kvstore::kv_encodings_parse(
      a.get("kv-dtype", "auto"), a.get("device", "cpu") == "cuda" ? DType::kBF16 : DType::kF32);
  if (!kv_dtype_r.is_ok()) return fail(kv_dtype_r.status());
  const kvstore::KvEncodings kv_dtype = kv_dtype_r.value();
  if (kv_dtype.low.has_value() != (retention.high > 0))
    return fail(SF_ERR(kInvalidArgument,
                       kv_dtype.low ? "--kv-dtype HIGH+LOW needs a --retention with high=TOKENS"
                                    : "--retention high=TOKENS needs --kv-dtype HIGH+LOW"));
  // --kv-pool: prefill-driven tiering into a host/disk block pool; spec and directory are
  // checked before the model load.
  std::optional<kvstore::KvPoolSpec> kv_pool;
  if (a.has("kv-pool")) {
    auto sp = kvstore::kv_pool_spec_parse(a.get("kv-pool"));
    if (!sp.is_ok()) return fail(sp.status());
    kv_pool = std::move(sp).value();
  }
  // --metrics-file: the pool's per-tier counters (Prometheus text) once the prefill is done; its
  // directory is checked here, before the model load.
  std::string metrics_file;
  if (a.has("metrics-file")) {
    if (!kv_pool)
      return fail(SF_ERR(kInvalidArgument, "--metrics-file writes the --kv-pool tiers' counters; give --kv-pool"));
    metrics_file = a.get("metrics-file");
    if (Status st = check_output_file(metrics_file, "--metrics-file"); !st.is_ok()) return fail(st);
  }
  // gguf: the model's own metadata (pre-tokenizer, add_bos), as llama.cpp does.
  // hf: what transformers' GGUF conversion does (always BOS, GPT-2 regex); the golden reference.
  model::TokenizerCompat compat = model::TokenizerCompat::kGguf;
  if (a.has("tokenizer")) {
    if (a.get("tokenizer") == "hf") compat = model::TokenizerCompat::kHfTransformers;
    else if (a.get("tokenizer") != "gguf") return fail(SF_ERR(kInvalidArgument, "--tokenizer must be 'gguf' or 'hf'"));
  }
  // --device cuda: BF16 weights on GPU 0, any --attention mode (DevicePrefill). Checked before
  // the slow model load.
  const std::string device = a.get("device", "cpu");
  if (device != "cpu" && device != "cuda") return fail(SF_ERR(kInvalidArgument, "--device must be 'cpu' or 'cuda'"));
  auto chunk_r = a.get_int(
      "chunk", device == "cuda" ? model::kDefaultChunkDevice : model::kDefaultChunkCpu, 1,
      int64_t(1) << 30);
  if (!chunk_r.is_ok()) return fail(chunk_r.status());
  const int64_t chunk = chunk_r.value();
  if (device == "cuda") {
    // The device forward scores importance by its LSE pass only; the estimator's column sums
    // stay on the device's estimate and are not kept.
    if (importance_src == "estimator")
      return fail(SF_ERR(kUnsupported, "--importance estimator runs on the CPU forward; --device cuda computes "
                                       "importance by the LSE pass (--importance lse)"));
    const Status st = model::cuda_device_check(0);
    if (!st.is_ok()) return fail(SF_ERR(kUnsupported, "--device cuda: " + st.message()));
  }
  if (kv_pool && kv_pool->device_bytes > 0 && device != "cuda")
    return fail(SF_ERR(kInvalidArgument, "--kv-pool device= needs --device cuda"));
  const std::string mode = a.get("attention", "dense");
  if (mode.rfind("config:", 0) == 0) {
    if (auto t = read_file(mode.substr(7), "--attention config"); !t.is_ok()) return fail(t.status());
  } else if (mode != "dense") {
    // The name alone (one layer, one head): an unknown mode fails before the model loads.
    if (auto sc = model::sparse_config_for_mode(mode, 1, 1); !sc.is_ok()) return fail(sc.status());
  }

  // --dump-attention LAYER:FILE: that layer's attention inputs (q, and the final k, v) as F32
  // safetensors, for `sparsefill bench attention --inputs FILE` (real-model tensors on the GPU).
  int dump_layer = -1;
  std::string dump_path;
  if (a.has("dump-attention")) {
    const std::string spec = a.get("dump-attention");
    const size_t colon = spec.find(':');
    int64_t l = -1;
    if (colon == std::string::npos || !whole_int(std::string_view(spec).substr(0, colon), &l) ||
        l < 0 || l > INT32_MAX || colon + 1 == spec.size())
      return fail(SF_ERR(kInvalidArgument, "--dump-attention: expected LAYER:FILE, got '" + spec + "'"));
    if (device != "cpu") return fail(SF_ERR(kUnsupported, "--dump-attention reads the CPU forward"));
    dump_layer = int(l);
    dump_path = spec.substr(colon + 1);
    if (Status st = check_output_file(dump_path, "--dump-attention"); !st.is_ok()) return fail(st);
  }
  // Nothing else may live inside the export's directory (it must be empty, or an earlier export
  // that --force replaces whole): not the pool's disk tier (nor the export inside it), the
  // metrics file or the attention dump.
  if (a.has("export-kv")) {
    const std::string e = a.get("export-kv");
    auto overlap = [&](const std::string& what) {
      return SF_ERR(kInvalidArgument, what + " and --export-kv '" + e + "' overlap; give them separate places");
    };
    if (kv_pool && !kv_pool->disk_dir.empty() &&
        (path_within(kv_pool->disk_dir, e) || path_within(e, kv_pool->disk_dir)))
      return fail(overlap("--kv-pool disk='" + kv_pool->disk_dir + "'"));
    if (!metrics_file.empty() && path_within(metrics_file, e))
      return fail(overlap("--metrics-file '" + metrics_file + "'"));
    if (!dump_path.empty() && path_within(dump_path, e))
      return fail(overlap("--dump-attention '" + dump_path + "'"));
  }
  // Created last among the checks, so a refused command leaves no directory behind.
  if (kv_pool && !kv_pool->disk_dir.empty()) {
    if (Status st = kvstore::kv_pool_dir_check(kv_pool->disk_dir); !st.is_ok()) return fail(st);
  }

  const std::string model_path = resolve_model(a.get("model"));
  auto mr = model::Model::load(model_path);
  if (!mr.is_ok()) return fail(mr.status());
  const model::Model& m = mr.value();
  const model::ModelConfig& cfg = m.config();
  // A moa config for another model fails before the prefill.
  if (Status st = kvstore::retention_check_geometry(retention, cfg.n_layers, cfg.n_kv_heads);
      !st.is_ok())
    return fail(st);

  std::vector<int32_t> ids;
  std::optional<model::Tokenizer> tok;
  if (m.format() == model::ModelFormat::kGguf) {
    auto g = model::GgufFile::open(model_path);
    if (!g.is_ok()) return fail(g.status());
    auto spec = model::tokenizer_spec_from_gguf(g.value(), compat);
    // With --prompt-tokens the tokenizer only names the first token: a GGUF without one (tests'
    // synthetic models, stripped files) still runs.
    if (!spec.is_ok() && !a.has("prompt-tokens")) return fail(spec.status());
    if (spec.is_ok()) {
      auto t = model::Tokenizer::create(std::move(spec).value());
      if (!t.is_ok()) return fail(t.status());
      tok.emplace(std::move(t).value());
    }
  }
  if (a.has("prompt-tokens")) {
    ids = std::move(token_file_ids);
  } else {
    if (!tok) return fail(SF_ERR(kUnsupported, "this model format has no tokenizer support yet; pass --prompt-tokens"));
    ids = tok->encode(text, /*add_special=*/true, /*parse_special=*/true);
  }
  if (ids.empty()) return fail(SF_ERR(kInvalidArgument, "the prompt is empty"));
  if (int64_t(ids.size()) > cfg.max_context && !a.has("allow-long"))
    return fail(SF_ERR(kOutOfRange, "prompt has " + std::to_string(ids.size()) + " tokens, more than the model context of " +
                                        std::to_string(cfg.max_context) + " (use --allow-long to run anyway)"));
  // Budgets against this prompt, before a prefill that may take hours.
  if (Status st = kvstore::retention_check_prompt(retention, cfg.n_layers, cfg.n_kv_heads,
                                                  int64_t(ids.size()));
      !st.is_ok())
    return fail(st);

  std::printf("model: %s (%s, %d layers, hidden %d, heads %d/%d)\n", cfg.name.c_str(), model::arch_name(cfg.arch),
              cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads);
  std::printf("prompt tokens: %zu\n", ids.size());
  if (a.has("print-tokens")) {
    std::printf("token ids:");
    for (int32_t t : ids) std::printf(" %d", t);
    std::printf("\n");
  }
  if (dump_layer >= cfg.n_layers)
    return fail(SF_ERR(kInvalidArgument, "--dump-attention: layer " + std::to_string(dump_layer) + " of a " +
                                              std::to_string(cfg.n_layers) + "-layer model"));
  model::PrefillOptions opt;
  opt.chunk = chunk;
  // With --kv-pool the export reads the pool, which holds every layer's K/V: the forward need
  // not keep a second copy (it drops each layer once tiered).
  opt.keep_kv = (a.has("export-kv") && !kv_pool) || dump_layer >= 0;
  std::vector<float> dump_q;
  int64_t dump_rows = 0;
  if (dump_layer >= 0)
    opt.on_attention = [&](int layer, const TensorView& q, const TensorView&, const kernels::SparseIndex*) {
      if (layer != dump_layer) return;
      dump_rows = q.shape[0];
      dump_q.assign(q.ptr<float>(), q.ptr<float>() + q.numel());
    };
  if (a.has("export-kv")) {
    // Exports carry per-block importance (CPU and GPU forward alike); scored retention policies
    // select with it.
    opt.importance_window = 32;
    // --importance estimator: groups whose heads the sparse estimator scored reuse those scores.
    opt.importance_from_estimator = importance_src == "estimator";
    opt.importance_pool = retention.kind == kvstore::RetentionKind::kSnapKV ||
                                  retention.kind == kvstore::RetentionKind::kAdaKV
                              ? retention.pool
                              : 7;
  }
  std::unique_ptr<kvstore::BlockPool> pool;
  std::unique_ptr<kvstore::TieredKv> tiered;
  if (kv_pool) {
    kvstore::BlockPoolConfig pc;
    pc.n_kv_heads = cfg.n_kv_heads;
    pc.head_dim = cfg.head_dim;
    pc.device_bytes = kv_pool->device_bytes;
    pc.host_bytes = kv_pool->host_bytes;
    pc.disk_dir = kv_pool->disk_dir;
    const int64_t block_bytes = int64_t(2) * kvstore::kPoolBlockTokens * cfg.n_kv_heads * cfg.head_dim * 4;
    const int64_t n_blocks = (int64_t(ids.size()) + kvstore::kPoolBlockTokens - 1) / kvstore::kPoolBlockTokens;
    // disk=DIR without a size: room for the whole KV of this prompt, so only the host budget binds.
    if (!kv_pool->disk_dir.empty())
      pc.disk_bytes = kv_pool->disk_bytes >= 0 ? kv_pool->disk_bytes : int64_t(cfg.n_layers) * n_blocks * block_bytes;
    auto p = kvstore::BlockPool::create(pc);
    if (!p.is_ok()) return fail(p.status());
    pool = std::move(p).value();
    kvstore::TieredKvConfig tc;
    tc.n_layers = cfg.n_layers;
    tc.n_kv_heads = cfg.n_kv_heads;
    tc.head_dim = cfg.head_dim;
    if (kv_pool->device_bytes > 0) tc.fast = kvstore::Tier::kDevice;
    auto t = kvstore::TieredKv::create(pool.get(), tc);
    if (!t.is_ok()) return fail(t.status());
    tiered = std::move(t).value();
    // device=: the device forward hands each layer's K/V over on its copy stream (no host copy
    // for the pool); otherwise the forward's host K/V go through the per-layer hook.
    const Status room = tiered->check_room(int64_t(ids.size()));
    if (!room.is_ok()) return fail(Status(room.code(), "--kv-pool: " + room.message()));
    if (kv_pool->device_bytes > 0) {
      opt.on_layer_kv_device = tiered->device_sink();
    } else {
      opt.on_layer_kv = tiered->hook();
    }
    // Block scores come from the SnapKV importance; the same window as exports use.
    if (opt.importance_window == 0) opt.importance_window = 32;
  }
  std::optional<model::SparseConfig> sparse;
  if (mode != "dense") {
    auto sc = model::sparse_config_for_mode(mode, cfg.n_layers, cfg.n_heads);
    if (!sc.is_ok()) return fail(sc.status());
    sparse.emplace(std::move(sc).value());
    opt.sparse = &*sparse;
  }
  Result<model::PrefillResult> pr = SF_ERR(kInternal, "prefill did not run");
  if (device == "cuda") {
    // TTFT below is the run alone, as on the CPU (where the model load is not counted either):
    // upload and plan (allocation, GEMM algorithm choice) are one-time costs, reported here.
    const auto t0 = std::chrono::steady_clock::now();
    auto dm = model::DeviceModel::upload(m, DType::kBF16, 0);
    if (!dm.is_ok()) return fail(dm.status());
    const double upload_s = sf::seconds_since(t0);
    auto plan = model::DevicePrefill::plan(dm.value(), int64_t(ids.size()), opt);
    if (!plan.is_ok()) return fail(plan.status());
    std::printf("device: cuda:0 %s, bf16 weights %.2f GiB (upload %.3f s), workspace %.2f GiB (plan %.3f s), "
                "attention: %s\n",
                dm->device_name().c_str(), double(dm->weight_bytes()) / double(1 << 30), upload_s,
                double(plan->workspace_bytes()) / double(1 << 30), plan->plan_seconds(), plan->attention_kernel());
    pr = plan->run(ids);
  } else {
    pr = model::prefill(m, ids, opt);
  }
  if (!pr.is_ok()) return fail(pr.status());
  const model::PrefillResult& r = pr.value();
  std::printf("time to first token: %.3f s\n", r.seconds);
  std::printf("prefill throughput: %.1f tokens/s\n", double(ids.size()) / r.seconds);
  std::string piece = tok ? tok->token_to_piece(r.first_token) : "";
  std::printf("first token: %d \"%s\"\n", r.first_token, piece.c_str());
  std::printf("attention: %s, density %.3f, estimate %.3f s, attention %.3f s%s\n", mode.c_str(),
              r.density, r.estimate_s, r.attention_s,
              r.sparse_grows > 0
                  ? sformat(" (the sparse plan grew %d time(s) during the run)", r.sparse_grows)
                        .c_str()
                  : "");

  if (dump_layer >= 0) {
    const auto& kv = r.kv;
    const int64_t n = kv.n_tokens, hq = cfg.n_heads, hk = cfg.n_kv_heads, d = cfg.head_dim;
    if (dump_rows != n || int64_t(dump_q.size()) != n * hq * d)
      return fail(SF_ERR(kInternal, "--dump-attention: layer " + std::to_string(dump_layer) + " saw " +
                                        std::to_string(dump_rows) + " query rows, expected " + std::to_string(n)));
    SafetensorsWriter w;
    w.add("q", DType::kF32, {n, hq, d}, dump_q.data(), dump_q.size() * 4);
    w.add("k", DType::kF32, {n, hk, d}, kv.k[size_t(dump_layer)].data(), size_t(n * hk * d) * 4);
    w.add("v", DType::kF32, {n, hk, d}, kv.v[size_t(dump_layer)].data(), size_t(n * hk * d) * 4);
    w.set_metadata("model", cfg.name);
    w.set_metadata("layer", std::to_string(dump_layer));
    w.set_metadata("rope", "applied to q and k (the model's own rotary convention)");
    const auto wr = w.write(dump_path);
    if (!wr.is_ok()) return fail(wr.status());
    std::printf("attention inputs of layer %d: %s (q [%lld, %lld, %lld], k and v [%lld, %lld, %lld], F32)\n",
                dump_layer, dump_path.c_str(), static_cast<long long>(n), static_cast<long long>(hq),
                static_cast<long long>(d), static_cast<long long>(n), static_cast<long long>(hk),
                static_cast<long long>(d));
  }
  if (pool) {
    // With device, host and disk tiers, cold host blocks may still be on their way to disk.
    if (Status st = tiered->wait_drained(); !st.is_ok()) return fail(st);
    std::printf("kv pool:");
    for (kvstore::Tier t : {kvstore::Tier::kDevice, kvstore::Tier::kHost, kvstore::Tier::kDisk}) {
      const kvstore::TierStats s = pool->stats(t);
      if (s.capacity_bytes == 0) continue;
      std::printf(" %s %lld blocks %lld bytes (budget %lld);", kvstore::tier_name(t), static_cast<long long>(s.blocks),
                  static_cast<long long>(s.used_bytes), static_cast<long long>(s.capacity_bytes));
    }
    const kvstore::Tier fast = kv_pool->device_bytes > 0 ? kvstore::Tier::kDevice : kvstore::Tier::kHost;
    const kvstore::TierStats h = pool->stats(fast);
    const char* fn = kvstore::tier_name(fast);
    const char* cn = kvstore::tier_name(kvstore::Tier(int(fast) + 1));
    std::printf(" moved %s->%s %lld, %s->%s %lld blocks", fn, cn, static_cast<long long>(h.demoted_out), cn, fn,
                static_cast<long long>(h.promoted_in));
    if (fast == kvstore::Tier::kDevice && !kv_pool->disk_dir.empty())
      std::printf(", host->disk %lld (the forward waited %.3f s for host room)",
                  static_cast<long long>(pool->stats(kvstore::Tier::kHost).demoted_out), tiered->host_wait_seconds());
    std::printf("; the forward held at most %lld bytes of KV\n", static_cast<long long>(r.kv_peak_bytes));
  }
  if (a.has("export-kv")) {
    kvstore::KvExportSpec spec = kvstore::model_export_spec(m);
    spec.n_tokens = int64_t(ids.size());
    spec.token_ids = ids;
    spec.first_token = r.first_token;
    spec.encoding = kv_dtype.high;
    spec.encoding_low = kv_dtype.low;
    const auto& kv = r.kv;
    const int64_t S = int64_t(ids.size());
    std::optional<kvstore::ImportanceScores> imp;
    if (!r.importance.empty())
      imp = kvstore::ImportanceScores{cfg.n_layers, cfg.n_kv_heads, S, opt.importance_window,
                                      opt.importance_pool, r.importance};
    if (imp && opt.importance_from_estimator)
        imp->method =
            "per KV group: the sparse estimator's softmax column sums of its scoring rows "
            "(vertical-slash: last 64 plus spread rows; block family: the last query block), "
            "rescaled to the observation window's row count, when every query head of the group "
            "has them, else the attention LSE pass over the observation window";
    auto ret = kvstore::retention_apply(retention, cfg.n_layers, cfg.n_kv_heads, S, imp ? &*imp : nullptr);
    if (!ret.is_ok()) return fail(ret.status());
    spec.retention = &ret.value();
    spec.importance = imp ? &*imp : nullptr;
    std::printf(
        "retention: %s%s%s, %.1f%% of the tokens; K/V stored as %s, %.1f%% of an F32 full cache's "
        "bytes\n",
        ret->policy.c_str(), ret->params.empty() ? "" : " ", ret->params.c_str(),
        100.0 * double(ret->kept_total()) /
            double(int64_t(cfg.n_layers) * cfg.n_kv_heads * S),
        kvstore::kv_encodings_name(kv_dtype).c_str(),
        100.0 * double(kvstore::kv_bytes(ret.value(), cfg.head_dim, kv_dtype.high, kv_dtype.low)) /
            double(
                int64_t(cfg.n_layers) * cfg.n_kv_heads *
                kvstore::kv_encoded_bytes(kvstore::KvEncoding::kF32, S, cfg.head_dim)));
    // Without a pool, the forward's kept KV. With one, each export thread reads the layer it
    // writes back into buffers of its own (export_kv asks for a layer's K, then its V, on one
    // thread): one layer a thread in host memory at a time.
    struct Held {
      int layer = -1;
      std::vector<float> k, v;
    };
    std::mutex held_mu;
    std::map<std::thread::id, Held> held;  // nodes stay put as threads are added
    Status read_st;                         // the first read error
    const kvstore::LayerSource src = [&](int l, bool v) -> const float* {
      if (!tiered) return (v ? kv.v : kv.k)[size_t(l)].data();
      Held* h = nullptr;
      {
        std::lock_guard<std::mutex> g(held_mu);
        if (!read_st.is_ok()) return nullptr;
        h = &held[std::this_thread::get_id()];
      }
      if (h->layer != l) {
        h->layer = -1;
        const Status rs = tiered->read_layer(l, &h->k, &h->v);
        if (!rs.is_ok()) {
          std::lock_guard<std::mutex> g(held_mu);
          if (read_st.is_ok()) read_st = rs;
          return nullptr;
        }
        h->layer = l;
      }
      return v ? h->v.data() : h->k.data();
    };
    kvstore::ExportOptions eo;
    eo.layers_in_flight = kvstore::default_layers_in_flight();
    Status st = kvstore::export_kv(a.get("export-kv"), spec, src, a.has("force"), eo);
    if (!read_st.is_ok()) return fail(Status(read_st.code(), "kv export from the pool: " + read_st.message()));
    if (!st.is_ok()) return fail(st);
    std::printf("kv export: %s (%d layer shards%s + manifest.json)\n", a.get("export-kv").c_str(),
                cfg.n_layers * (kv_dtype.low ? 2 : 1), kv_dtype.low ? ", two tiers a layer," : "");
  }
  // After the export, so its reads from the pool count; a file that cannot be written costs the
  // operator the numbers, not the user the export (a warning, exit 0).
  if (pool && !metrics_file.empty()) {
    MetricsRegistry reg;
    Status st = kvstore::tiering_metrics_export(*tiered, *pool, &reg);
    if (st.is_ok()) st = reg.write_textfile(metrics_file);
    if (st.is_ok())
      std::printf("kv pool metrics: %s\n", metrics_file.c_str());
    else
      std::fprintf(stderr, "warning: --metrics-file: %s\n", st.message().c_str());
  }
  return 0;
}

int cmd_inspect(int argc, char** argv) {
  auto args_r = parse_args(argc, argv, 2, {"model"}, {});
  if (!args_r.is_ok()) return fail(args_r.status());
  const std::string path = resolve_model(args_r.value().get("model", "default"));
  auto g = model::GgufFile::open(path);
  if (!g.is_ok()) return fail(g.status());
  std::printf("gguf v%u, alignment %llu, %zu metadata keys, %zu tensors\n", g->version(),
              static_cast<unsigned long long>(g->alignment()), g->metadata().size(), g->tensors().size());
  for (const auto& [k, v] : g->metadata()) {
    if (v.type == model::GgufValueType::kArray) {
      std::printf("  %s: array[%zu]\n", k.c_str(), v.strings.size() + v.ints.size() + v.floats.size());
    } else if (auto* s = std::get_if<std::string>(&v.scalar)) {
      std::printf("  %s: %.80s\n", k.c_str(), s->c_str());
    } else if (auto* u = std::get_if<uint64_t>(&v.scalar)) {
      std::printf("  %s: %llu\n", k.c_str(), static_cast<unsigned long long>(*u));
    } else if (auto* i = std::get_if<int64_t>(&v.scalar)) {
      std::printf("  %s: %lld\n", k.c_str(), static_cast<long long>(*i));
    } else if (auto* d = std::get_if<double>(&v.scalar)) {
      std::printf("  %s: %g\n", k.c_str(), *d);
    } else if (auto* b = std::get_if<bool>(&v.scalar)) {
      std::printf("  %s: %s\n", k.c_str(), *b ? "true" : "false");
    }
  }
  return 0;
}

}  // namespace sf::cli
