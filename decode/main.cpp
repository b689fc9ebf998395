// sparsefill-decode: the reference decode node. Loads a KV export (verified: version, compat
// hash, shard checksums), assembles the paged cache and generates greedily on CPU.
//   sparsefill-decode --model PATH|default --kv DIR [--tokens N] [--device auto|cpu|cuda]
//                     [--attention full|psa:EPS|psa-avg:EPS|psa-strict:EPS] (psa modes: +gqa;
//                     :MARGIN and :verifyN after EPS, the host's guard and verified drafts:
//                     decode/decode_attention.h)
//                     [--pool-dtype f32|bf16|int8] [--no-cuda-graph] [--no-fused-step]
//                     [--reference]
// --pool-dtype: how the device block pool stores K/V (decode/device_session.h); int8 holds a
// quarter of F32's bytes and reads that much less per step. Device only.
// --no-cuda-graph: launch each step's kernels one by one (by default the device session replays
// them as one CUDA graph from the second step on).
// --no-fused-step: one kernel per op in the device step (by default Q/K/V are one GEMV, the MLP's
// gate, up and SwiGLU one, each residual add joined to the next norm).
// --reference also runs the dense prefill + greedy continuation of the manifest's prompt and
// reports how many tokens match. Process edge: errors become one line and exit code 1.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "common/args.h"
#include "common/file_io.h"
#include "decode/decode_session.h"
#include "decode/device_session.h"
#include "worker/model/gguf.h"
#include "worker/model/tokenizer.h"

namespace {

int fail(const sf::Status& st) {
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  return 1;
}

void usage(FILE* to = stderr) {
  std::fprintf(to,
               "usage: sparsefill-decode --model PATH|default --kv DIR [--tokens N] [--attention "
               "full|psa[-avg|-strict][+gqa]:EPS[:MARGIN][:verifyN]]\n"
               "                         [--device auto|cpu|cuda] [--pool-dtype f32|bf16|int8]\n"
               "                         [--no-cuda-graph] [--no-fused-step] [--reference]\n");
}

int run(int argc, char** argv) {
  // The same parser as sparsefill's and sparsefill-worker's (common/args.h).
  auto parsed = sf::parse_args(argc, argv, 1,
                               {"model", "kv", "tokens", "attention", "device", "pool-dtype"},
                               {"reference", "no-cuda-graph", "no-fused-step"});
  if (!parsed.is_ok()) return fail(parsed.status());  // one line, as the sparsefill CLI's
  if (parsed->help) {
    usage(stdout);
    return 0;
  }
  std::map<std::string, std::string>& a = parsed->opts;
  if (!a.count("kv")) {
    usage();
    return fail(SF_ERR(kInvalidArgument, "--kv DIR is required"));
  }
  int n_new = 32;
  if (a.count("tokens")) {
    int64_t n = 0;
    if (!sf::whole_int(a["tokens"], &n) || n < 1 || n > 100000)
      return fail(SF_ERR(kInvalidArgument, "--tokens must be in [1, 100000]"));
    n_new = int(n);
  }
  const std::string dev = a.count("device") ? a["device"] : "auto";
  if (dev != "auto" && dev != "cpu" && dev != "cuda")
    return fail(SF_ERR(kInvalidArgument, "--device '" + dev + "' is not auto, cpu or cuda"));
  auto pool_enc = sf::kvstore::kv_encoding_parse(a.count("pool-dtype") ? a["pool-dtype"] : "f32");
  if (!pool_enc.is_ok() || pool_enc.value() == sf::kvstore::KvEncoding::kInt4)
    return fail(SF_ERR(kInvalidArgument, "--pool-dtype '" + a["pool-dtype"] +
                                             "' is not f32, bf16 or int8 (the device pool's)"));
  if (dev == "cpu" && pool_enc.value() != sf::kvstore::KvEncoding::kF32)
    return fail(SF_ERR(kInvalidArgument, "--pool-dtype is the device pool's; the cpu decodes F32"));
  // auto: the GPU when this build and machine have one; cuda without one fails before the load.
  const sf::Status cuda_ok = dev == "cpu" ? sf::Status::ok() : sf::model::cuda_device_check(0);
  if (dev == "cuda" && !cuda_ok.is_ok())
    return fail(SF_ERR(kUnsupported, "--device cuda: " + cuda_ok.message()));
  const bool on_gpu = dev == "cuda" || (dev == "auto" && cuda_ok.is_ok());
  auto ap = sf::decode::decode_attn_parse(a.count("attention") ? a["attention"] : "full");
  if (!ap.is_ok()) return fail(ap.status());
  {
    // Before the model load: a wrong --kv should not cost it.
    std::error_code ec;
    if (!std::filesystem::is_regular_file(std::filesystem::path(a["kv"]) / "manifest.json", ec))
      return fail(SF_ERR(kNotFound, "--kv: no manifest.json in '" + a["kv"] + "' (not a KV export)"));
  }
  const std::string path = sf::model::resolve_model_path(a.count("model") ? a["model"] : "default", SF_SOURCE_DIR);
  auto mr = sf::model::Model::load(path);
  if (!mr.is_ok()) return fail(mr.status());
  const sf::model::Model& m = mr.value();

  sf::decode::KvExport man;
  const auto t0 = std::chrono::steady_clock::now();
  auto sr = sf::decode::open_decode_session(m, a["kv"], ap.value(), &man);
  if (!sr.is_ok()) return fail(sr.status());
  // The device session: F32 weights, so the GPU reproduces the CPU's continuation (a reference
  // node); the cache goes up once, with room for the tokens to decode.
  std::optional<sf::model::DeviceModel> dm;
  std::optional<sf::decode::DeviceDecodeSession> ds;
  bool gpu = on_gpu;
  if (gpu) {
    auto open = [&]() -> sf::Status {
      SF_ASSIGN(sf::model::DeviceModel up, sf::model::DeviceModel::upload(m, sf::DType::kF32));
      dm.emplace(std::move(up));
      SF_ASSIGN(sf::decode::DeviceDecodeSession s,
                sf::decode::DeviceDecodeSession::open(*dm, sr->cache(), man.n_tokens, ap.value(),
                                                      n_new, pool_enc.value(),
                                                      /*cuda_graph=*/!a.count("no-cuda-graph"),
                                                      /*fused_step=*/!a.count("no-fused-step")));
      ds.emplace(std::move(s));
      return sf::Status::ok();
    };
    const sf::Status op = open();
    if (!op.is_ok() && dev == "auto" &&
        (op.code() == sf::Code::kUnsupported || op.code() == sf::Code::kResourceExhausted)) {
      // auto: a model or mode the device session does not take, or a GPU without room for the
      // F32 weights and the pool, decodes on the CPU (the device memory given back first).
      std::fprintf(stderr, "note: decoding on cpu: %s\n", op.message().c_str());
      ds.reset();
      dm.reset();
      gpu = false;
    } else if (!op.is_ok()) {
      return fail(op);
    }
  }
  // auto that ended on the cpu: a --pool-dtype given for the device pool is not used.
  if (!gpu && a.count("pool-dtype") && pool_enc.value() != sf::kvstore::KvEncoding::kF32)
    std::fprintf(stderr, "note: --pool-dtype %s is the device pool's; decoding on cpu in F32\n",
                 a["pool-dtype"].c_str());
  const auto t1 = std::chrono::steady_clock::now();
  auto gen = gpu ? ds->generate_greedy(man.first_token, n_new)
                 : sr->generate_greedy(man.first_token, n_new);
  if (!gen.is_ok()) return fail(gen.status());
  const auto t2 = std::chrono::steady_clock::now();
  const auto& st = gpu ? ds->stats() : sr->stats();
  std::printf(
      "kv: %s, %lld prompt tokens, retention %s%s%s, K/V stored as %s: %lld of %lld KV bytes "
      "(%.1f%%)\n",
      a["kv"].c_str(), static_cast<long long>(man.n_tokens), man.retention_policy.c_str(),
      man.retention_params.empty() ? "" : ":", man.retention_params.c_str(),
      (man.kv_dtype + (man.kv_dtype_low.empty() ? "" : "+" + man.kv_dtype_low)).c_str(),
      static_cast<long long>(man.kv_bytes), static_cast<long long>(man.kv_bytes_full),
      100.0 * double(man.kv_bytes) / double(man.kv_bytes_full));
  // The N tokens start with the prefill's first token: N - 1 decode steps.
  std::printf("load + verify: %.3f s; %d tokens (%d decode steps) on %s: %.3f s\n",
              std::chrono::duration<double>(t1 - t0).count(), n_new, n_new - 1,
              gpu ? dm->device_name().c_str() : "cpu",
              std::chrono::duration<double>(t2 - t1).count());
  if (gpu)
    std::printf("device pool: %s, %.1f MiB; %lld of %d steps replayed as a CUDA graph\n",
                sf::kvstore::kv_encoding_name(pool_enc.value()),
                double(ds->pool_bytes()) / (1 << 20), static_cast<long long>(ds->graph_steps()),
                n_new - 1);
  std::printf("attention %s: blocks visited %.4f of available\n",
              a.count("attention") ? a["attention"].c_str() : "full",
              st.blocks_total ? double(st.blocks_visited) / double(st.blocks_total) : 1.0);
  if (st.verify_passes > 0)
    std::printf("verified drafts: %lld drafted, %lld kept, %lld full-attention passes; blocks "
                "computed %.4f of available\n",
                static_cast<long long>(st.draft_steps), static_cast<long long>(st.draft_accepted),
                static_cast<long long>(st.verify_passes),
                double(st.blocks_computed) / double(st.blocks_total));
  std::printf("tokens:");
  for (int32_t t : gen.value()) std::printf(" %d", t);
  std::printf("\n");
  if (m.format() == sf::model::ModelFormat::kGguf) {
    auto g = sf::model::GgufFile::open(path);
    if (g.is_ok()) {
      auto spec = sf::model::tokenizer_spec_from_gguf(g.value(), sf::model::TokenizerCompat::kGguf);
      if (spec.is_ok()) {
        auto tok = sf::model::Tokenizer::create(std::move(spec).value());
        if (tok.is_ok()) std::printf("text: %s\n", tok->decode(gen.value()).c_str());
      }
    }
  }
  if (a.count("reference")) {
    auto ref = sf::model::generate_greedy(m, man.token_ids, n_new);
    if (!ref.is_ok()) return fail(ref.status());
    int match = 0;
    while (match < n_new && ref.value()[size_t(match)] == gen.value()[size_t(match)]) ++match;
    std::printf("reference (dense prefill + greedy): first %d of %d tokens equal\n", match, n_new);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return sf::exit_status_after_stdout(run(argc, argv));  // the tokens are its result
  } catch (const std::exception& e) {  // process edge
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
