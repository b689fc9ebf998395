// The decode node's step on a GPU host: decode::DeviceDecodeSession over a cache of N tokens, a
// model of a named shape with deterministic synthetic weights (model::DeviceModel::synthetic),
// timed per token as a caller sees it (step() returns the logits; the next token is their argmax
// on the host). Four sessions side by side: the step's kernels launched one by one or replayed
// as one CUDA graph, each with the unfused step (a kernel per op) and the fused one (Q/K/V in
// one GEMV, gate/up/SwiGLU in one, each residual add joined to the next norm), timed in
// alternating rounds of `steps` tokens, median of three. A fifth session, graph and fused, launches
// its kernels without programmatic dependent launch (kernels/cuda/dependent_launch.cuh), the
// A/B of that launch in the same rounds. Keys N(0, 0.3), values N(0, 1), every position kept (the
// timing does not depend on their values). One JSON line per (weights, pool, graph, fused,
// dependent launch) configuration.
//
// verify: attention modes with verified drafts (e.g. psa-avg:0.95:verify8), each a fused graph
// session timed the same way over generate_greedy (a round's `steps` tokens: drafts as graph
// steps, then the eager verification pass), one more JSON line each with the drafts' and passes'
// counts. The cache's random keys spread attention evenly and the synthetic weights draft
// tokens of their own, so PSA visits and acceptance here are not a real model's: the figure is
// the mechanism's cost on the device at these counts, not its speed-up on real text.
//   sf_bench_decode_session [shape=smollm2|llama3-8b] [tokens=4096] [steps=64]
//                           [pools=f32,int8] [weights=bf16,f32] [verify=]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "decode/device_session.h"
#include "kernels/cuda/cuda_ops.h"
#include "kvstore/kv_quant.h"
#include "worker/model/device_model.h"

using namespace sf;
using sf::bench::fail;
using sf::bench::now_s;

namespace {
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t c = std::min(s.find(',', at), s.size());
    v.push_back(s.substr(at, c - at));
    at = c + 1;
  }
  return v;
}

// SmolLM2-135M (the default model's shape) and Llama-3-8B (config.json of each).
Result<model::ModelConfig> shape(const std::string& name) {
  model::ModelConfig c;
  c.name = name + "-shaped (synthetic weights)";
  c.max_context = 1 << 20;
  if (name == "smollm2") {
    c.n_layers = 30, c.hidden = 576, c.n_heads = 9, c.n_kv_heads = 3, c.head_dim = 64;
    c.intermediate = 1536, c.vocab = 49152, c.rms_eps = 1e-5f, c.tied_embeddings = true;
    c.rope.theta = 100000.f;
  } else if (name == "llama3-8b") {
    c = model::llama3_8b_config();
  } else {
    return SF_ERR(kInvalidArgument, "shape '" + name + "' is not smollm2 or llama3-8b");
  }
  SF_TRY(c.validate());
  return c;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string shape_name = argc > 1 ? argv[1] : "smollm2";
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 64;
  const auto pools = split(argc > 4 ? argv[4] : "f32,int8");
  const auto weights = split(argc > 5 ? argv[5] : "bf16,f32");
  const auto verify = argc > 6 && argv[6][0] ? split(argv[6]) : std::vector<std::string>{};

  auto cfg = shape(shape_name);
  if (!cfg.is_ok()) return fail("shape", cfg.status());
  if (n < 1 || steps < 1) {
    std::fprintf(stderr, "usage: sf_bench_decode_session [smollm2|llama3-8b] [tokens>=1] "
                         "[steps>=1] [pools] [weights]\n");
    return 2;
  }
  const model::ModelConfig& c = cfg.value();
  // The cache: every layer and KV head holds positions 0 .. n-1.
  decode::PagedKvCache cache;
  {
    model::KvCache kv;
    kv.n_layers = c.n_layers;
    kv.n_kv_heads = c.n_kv_heads;
    kv.head_dim = c.head_dim;
    kv.n_tokens = n;
    std::mt19937_64 rng(20261125);
    std::normal_distribution<float> nd(0.f, 1.f);
    const size_t per = size_t(n) * size_t(c.n_kv_heads) * size_t(c.head_dim);
    for (int l = 0; l < c.n_layers; ++l) {
      kv.k.emplace_back(per);
      kv.v.emplace_back(per);
      for (auto& x : kv.k.back()) x = 0.3f * nd(rng);
      for (auto& x : kv.v.back()) x = nd(rng);
    }
    auto ret = kvstore::retention_apply(kvstore::RetentionPolicy{}, c.n_layers, c.n_kv_heads, n,
                                        nullptr);
    if (!ret.is_ok()) return fail("retention", ret.status());
    auto pc = decode::PagedKvCache::from_prefill(kv, ret.value());
    if (!pc.is_ok()) return fail("paged cache", pc.status());
    cache = std::move(pc).value();
  }
  const std::string commit = bench::source_commit(), command = bench::command_line(argc, argv),
                    date = now_iso8601();
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  const auto ap = decode::decode_attn_parse("full").value();
  const bool pdl0 = kernels::cuda::dependent_launch();  // SF_PDL=0 turns it off everywhere
  for (const std::string& wname : weights) {
    const DType wdt = wname == "f32" ? DType::kF32 : DType::kBF16;
    if (wname != "f32" && wname != "bf16") return fail("weights", SF_ERR(kInvalidArgument, wname));
    auto dm = model::DeviceModel::synthetic(c, 7, wdt);
    if (!dm.is_ok()) return fail("device model", dm.status());
    for (const std::string& pname : pools) {
      auto enc = kvstore::kv_encoding_parse(pname);
      if (!enc.is_ok()) return fail("pool", enc.status());
      // The five sessions open at once; their timed rounds alternate (eager, graph, eager fused,
      // graph fused, graph fused without dependent launch, eager, ...) so that clocks and host
      // noise fall on all alike. The median round is reported.
      constexpr int kRounds = 3;  // the record below prints three rounds
      constexpr int kSessions = 5;  // bit 0: CUDA graph, bit 1: fused step; 4: 3 without PDL
      const auto graph_of = [](int si) { return si == 4 || (si & 1) != 0; };
      const auto fused_of = [](int si) { return si == 4 || (si & 2) != 0; };
      const auto pdl_of = [pdl0](int si) { return si != 4 && pdl0; };
      std::vector<std::optional<decode::DeviceDecodeSession>> sess(static_cast<size_t>(kSessions));
      std::vector<int32_t> tok(static_cast<size_t>(kSessions), 1);
      std::vector<float> z;
      for (int si = 0; si < kSessions; ++si) {
        auto s = decode::DeviceDecodeSession::open(dm.value(), cache, n, ap, 2 + kRounds * steps,
                                                   enc.value(), graph_of(si), fused_of(si));
        if (!s.is_ok()) return fail("session", s.status());
        sess[size_t(si)].emplace(std::move(s).value());
      }
      auto next = [&](int si) -> Status {
        kernels::cuda::set_dependent_launch(pdl_of(si));  // read at each launch (and capture)
        SF_TRY(sess[size_t(si)]->step(tok[size_t(si)], &z));
        tok[size_t(si)] = int32_t(std::max_element(z.begin(), z.end()) - z.begin());
        return Status::ok();
      };
      // Two untimed steps each: the first runs eagerly (plans, caches), the second captures.
      for (int si = 0; si < kSessions; ++si)
        for (int i = 0; i < 2; ++i)
          if (Status st = next(si); !st.is_ok()) return fail("warm-up step", st);
      std::vector<std::vector<double>> ms(static_cast<size_t>(kSessions));
      for (int r = 0; r < kRounds; ++r)
        for (int si = 0; si < kSessions; ++si) {
          const double t0 = now_s();
          for (int i = 0; i < steps; ++i)
            if (Status st = next(si); !st.is_ok()) return fail("step", st);
          ms[size_t(si)].push_back(1e3 * (now_s() - t0) / steps);
        }
      kernels::cuda::set_dependent_launch(pdl0);
      for (int si = 0; si < kSessions; ++si) {
        std::vector<double> sorted = ms[size_t(si)];
        std::sort(sorted.begin(), sorted.end());
        const double med = sorted[sorted.size() / 2];
        std::printf(
            "{\"device\": \"%s\", \"shape\": \"%s\", \"layers\": %d, \"weights\": \"%s\", "
            "\"pool\": \"%s\", \"pool_bytes\": %zu, \"tokens\": %lld, \"steps\": %d, "
            "\"cuda_graph\": %s, \"fused_step\": %s, \"dependent_launch\": %s, "
            "\"graph_steps\": %lld, "
            "\"ms_per_token\": %.3f, \"ms_per_token_rounds\": [%.3f, %.3f, %.3f], "
            "\"tokens_per_s\": %.1f, \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\"}\n",
            prop.name, shape_name.c_str(), c.n_layers, wname.c_str(), pname.c_str(),
            sess[size_t(si)]->pool_bytes(), static_cast<long long>(n), steps,
            graph_of(si) ? "true" : "false", fused_of(si) ? "true" : "false",
            pdl_of(si) ? "true" : "false",
            static_cast<long long>(sess[size_t(si)]->graph_steps()), med, ms[size_t(si)][0], ms[size_t(si)][1], ms[size_t(si)][2],
            1e3 / med, date.c_str(), commit.c_str(), command.c_str());
        std::fflush(stdout);
      }
      // Verified drafts: rounds of `steps` generated tokens, median of three, as above.
      for (const std::string& spec : verify) {
        auto vp = decode::decode_attn_parse(spec);
        if (!vp.is_ok()) return fail("verify mode", vp.status());
        auto s = decode::DeviceDecodeSession::open(dm.value(), cache, n, vp.value(),
                                                   1 + (kRounds + 1) * steps, enc.value());
        if (!s.is_ok()) return fail("verify session", s.status());
        int32_t t = 1;
        std::vector<double> vms;
        for (int r = 0; r <= kRounds; ++r) {  // round 0 untimed (plans, the graph's capture)
          const double t0 = now_s();
          auto g = s->generate_greedy(t, steps + 1);
          if (!g.is_ok()) return fail("verify generate", g.status());
          if (r > 0) vms.push_back(1e3 * (now_s() - t0) / steps);
          t = g->back();
        }
        std::vector<double> sorted = vms;
        std::sort(sorted.begin(), sorted.end());
        const double med = sorted[sorted.size() / 2];
        const decode::DecodeAttnStats& st = s->stats();
        const double tot = double(std::max<int64_t>(st.blocks_total, 1));
        std::printf(
            "{\"device\": \"%s\", \"shape\": \"%s\", \"layers\": %d, \"weights\": \"%s\", "
            "\"pool\": \"%s\", \"tokens\": %lld, \"steps\": %d, \"attention\": \"%s\", "
            "\"draft_steps\": %lld, \"draft_accepted\": %lld, \"verify_passes\": %lld, "
            "\"tokens_per_pass\": %.2f, \"blocks_visited_frac\": %.4f, "
            "\"blocks_computed_frac\": %.4f, \"ms_per_token\": %.3f, "
            "\"ms_per_token_rounds\": [%.3f, %.3f, %.3f], \"tokens_per_s\": %.1f, "
            "\"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\"}\n",
            prop.name, shape_name.c_str(), c.n_layers, wname.c_str(), pname.c_str(),
            static_cast<long long>(n), steps, spec.c_str(), static_cast<long long>(st.draft_steps),
            static_cast<long long>(st.draft_accepted), static_cast<long long>(st.verify_passes),
            double(st.steps) / double(std::max<int64_t>(st.verify_passes, 1)),
            double(st.blocks_visited) / tot, double(st.blocks_computed) / tot, med, vms[0], vms[1],
            vms[2], 1e3 / med, date.c_str(), commit.c_str(), command.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
