// Decode attention on a GPU host: one new token per query head over a paged cache of N tokens
// (the Llama-3-8B attention shape by default: 32 query heads, 8 KV heads, head_dim 128, fp32
// pool), for the device kernel (kernels/decode_attention.h) and the host reference
// (decode/decode_attention.h) on the same cache, in full, psa:0.95, psa-avg:0.95 and their +gqa
// forms (one visit per KV head), with the device pool in each of the listed encodings (f32, bf16,
// int8; the host reference is F32).
// Planted keys (as in test_device_decode): N(0, 0.3) with a few blocks per KV head pulled toward
// one query head's direction, so PSA has mass to find. Prints one JSON line per mode: time per
// call, blocks visited (over all query heads; the most any one head visited, which sets a PSA
// launch's time; and, host, the distinct blocks per KV head), and the K/V bytes of the visited
// blocks per second (each KV head's blocks counted once, though its 4 query heads each read
// them, in the pool's encoding with its scales and zeros). Then, per pool, a verification pass's
// attention ("full-pass": 8, 16, 32 and 64 tokens at once, PagedDecodeParams::n_tokens) against
// as many single-token full calls.
//   sf_bench_decode [tokens=32768] [heads=32] [kv_heads=8] [head_dim=128] [pull=0.15]
//                   [pools=f32,bf16,int8]
// pull: how far the planted blocks' keys move toward the query (larger: PSA stops sooner).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "decode/decode_attention.h"
#include "decode/device_session.h"
#include "kernels/cuda/cuda_ops.h"
#include "kvstore/retention.h"

using namespace sf;
using sf::bench::fail;
using sf::bench::now_s;


int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int hq = argc > 2 ? std::atoi(argv[2]) : 32;
  const int hkv = argc > 3 ? std::atoi(argv[3]) : 8;
  const int d = argc > 4 ? std::atoi(argv[4]) : 128;
  const float pull = argc > 5 ? float(std::atof(argv[5])) : 0.15f;
  std::vector<kvstore::KvEncoding> pools;
  {
    const std::string list = argc > 6 ? argv[6] : "f32,bf16,int8";
    size_t at = 0;
    while (at <= list.size()) {
      const size_t comma = std::min(list.find(',', at), list.size());
      auto e = kvstore::kv_encoding_parse(list.substr(at, comma - at));
      if (!e.is_ok()) return fail("pools", e.status());
      pools.push_back(e.value());
      at = comma + 1;
    }
  }
  if (n < 64 || hq <= 0 || hkv <= 0 || hq % hkv || (d != 32 && d != 64 && d != 128) ||
      !(pull >= 0.f)) {
    std::fprintf(stderr,
                 "usage: sf_bench_decode [tokens>=64] [heads] [kv_heads | heads] [d: 32|64|128] "
                 "[pull>=0] [pools=f32,bf16,int8]\n");
    return 2;
  }
  std::mt19937_64 rng(20261124);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(size_t(hq) * d);
  for (auto& x : q) x = nd(rng);
  model::KvCache kv;
  kv.n_layers = 1;
  kv.n_kv_heads = hkv;
  kv.head_dim = d;
  kv.n_tokens = n;
  kv.k.assign(1, std::vector<float>(size_t(n) * hkv * d));
  kv.v.assign(1, std::vector<float>(size_t(n) * hkv * d));
  for (auto& x : kv.k[0]) x = 0.3f * nd(rng);
  for (auto& x : kv.v[0]) x = nd(rng);
  const int64_t nb = (n + 63) / 64;
  const int group = hq / hkv;
  for (int g = 0; g < hkv; ++g)
    for (int hot = 0; hot < 16; ++hot) {
      const int64_t b = int64_t(rng() % uint64_t(nb));
      const int h = g * group + int(rng() % uint64_t(group));
      for (int64_t t = b * 64; t < std::min(n, b * 64 + 64); t += 3)
        for (int c = 0; c < d; ++c)
          kv.k[0][(size_t(t) * hkv + g) * d + c] += pull * q[size_t(h) * d + c];
    }
  auto ret = kvstore::retention_apply(kvstore::RetentionPolicy{}, 1, hkv, n, nullptr);
  if (!ret.is_ok()) return fail("retention", ret.status());
  auto cache = decode::PagedKvCache::from_prefill(kv, ret.value());
  if (!cache.is_ok()) return fail("paged cache", cache.status());
  kv = model::KvCache{};  // the paged copy is all that is needed now
  kernels::cuda::DeviceBuffer dq, dout, dvis;
  if (!dq.alloc(q.size() * 4).is_ok() || !dq.upload(q.data(), q.size() * 4).is_ok() ||
      !dout.alloc(q.size() * 4).is_ok() || !dvis.alloc(size_t(hq) * 4).is_ok())
    return fail("device buffers", SF_ERR(kResourceExhausted, "alloc/upload"));
  const std::string commit = bench::source_commit(), command = bench::command_line(argc, argv),
                    date = now_iso8601();
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  cudaEvent_t e0, e1;
  (void)cudaEventCreate(&e0);
  (void)cudaEventCreate(&e1);
  const kernels::Stream s{Device::kCuda, nullptr};
  // The device's copy rate in the same run, for scale: a 256 MB device-to-device copy reads and
  // writes 512 MB.
  double copy_GBps = 0;  // 0: not measured (a failed call)
  {
    const size_t cb = size_t(256) << 20;
    kernels::cuda::DeviceBuffer a, b;
    bool ok =
        a.alloc(cb).is_ok() && b.alloc(cb).is_ok() && cudaMemset(a.data(), 1, cb) == cudaSuccess;
    for (int i = 0; ok && i < 2; ++i)
      ok = cudaMemcpyAsync(b.data(), a.data(), cb, cudaMemcpyDeviceToDevice) == cudaSuccess;
    ok = ok && cudaEventRecord(e0, nullptr) == cudaSuccess;
    for (int i = 0; ok && i < 10; ++i)
      ok = cudaMemcpyAsync(b.data(), a.data(), cb, cudaMemcpyDeviceToDevice) == cudaSuccess;
    ok = ok && cudaEventRecord(e1, nullptr) == cudaSuccess &&
         cudaEventSynchronize(e1) == cudaSuccess;
    float ms = 0.f;
    if (ok && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0.f)
      copy_GBps = 10.0 * 2.0 * double(cb) / (1e-3 * double(ms)) / 1e9;
  }
  // Host reference per mode on the F32 cache (this machine's cores, the decode node's CPU path).
  const char* specs[] = {"full", "psa:0.95", "psa-avg:0.95", "psa+gqa:0.95", "psa-avg+gqa:0.95"};
  constexpr int kSpecs = 5;
  double host_us[kSpecs] = {};
  int64_t host_visited[kSpecs] = {};
  double host_kv_loaded[kSpecs] = {};  // blocks any query head of a KV head visited / available
  for (int si = 0; si < kSpecs; ++si) {
    auto p = decode::decode_attn_parse(specs[si]);
    std::vector<float> out(q.size());
    decode::DecodeAttnStats hs;
    const double t0 = now_s();
    const int host_reps = 3;
    for (int i = 0; i < host_reps; ++i) {
      hs = {};
      if (Status st = decode::decode_attention(cache.value(), 0, q.data(), hq, p.value(),
                                               out.data(), &hs);
          !st.is_ok())
        return fail(specs[si], st);
    }
    host_us[si] = 1e6 * (now_s() - t0) / host_reps;
    host_visited[si] = hs.blocks_visited;
    host_kv_loaded[si] = double(hs.kv_blocks_loaded) / double(hs.kv_blocks_total);
  }
  // Microseconds a call of `launch` takes: three warm-up calls, then `reps` timed by events.
  const auto time_us = [&](const auto& launch, int reps) -> Result<double> {
    for (int i = 0; i < 3; ++i) SF_TRY(launch());
    (void)cudaEventRecord(e0, nullptr);
    for (int i = 0; i < reps; ++i) (void)launch();
    (void)cudaEventRecord(e1, nullptr);
    SF_TRY(kernels::cuda::stream_synchronize(nullptr));
    float ms = 0.f;
    (void)cudaEventElapsedTime(&ms, e0, e1);
    return 1e3 * double(ms) / reps;
  };
  for (const kvstore::KvEncoding enc : pools) {
    auto pool = decode::DevicePagedPool::upload(cache.value(), 0, enc);
    if (!pool.is_ok()) return fail("device pool", pool.status());
    kernels::cuda::DeviceBuffer dws;
    size_t ws = 0;  // the most any mode here needs
    for (const char* spec : specs)
      ws = std::max(ws, kernels::paged_decode_workspace_bytes(
                            hq, pool->layer(0),
                            decode::device_attn_params(decode::decode_attn_parse(spec).value())));
    if (ws > 0 && !dws.alloc(ws).is_ok())
      return fail("device buffers", SF_ERR(kResourceExhausted, "workspace"));
    // K and V bytes of one block of one KV head as the pool stores them.
    const double block_bytes = enc == kvstore::KvEncoding::kInt8 ? 64.0 * d * 2 + 4.0 * d + 4.0 * 64
                               : enc == kvstore::KvEncoding::kBF16 ? 64.0 * d * 2 * 2
                                                                   : 64.0 * d * 4 * 2;
    // Full mode runs twice, the default and then the other kernel: blocks staged in shared
    // memory by bulk copies (staged true), then over F32 and BF16 a warp per query head loading
    // its own rows, over an INT8 pool the query heads of a KV head sharing each block's codes
    // loaded by the warp (kv_shared true).
    const bool encoded = enc == kvstore::KvEncoding::kInt8;
    for (int run = 0; run < kSpecs + 1; ++run) {
      const int si = run < kSpecs ? run : 0;
      const char* spec = specs[si];
      auto p = decode::decode_attn_parse(spec);
      kernels::PagedDecodeParams kp = decode::device_attn_params(p.value());
      kp.full_staged = run < kSpecs;
      // The plan's own choice (INT8 stages only from kStagedInt8MinBlocks on), then the staged
      // kernel asked for outright, so both kernels are timed at every length.
      const bool plan_staged = kernels::paged_decode_staged(hq, pool->layer(0), kp);
      kp.staged_int8_min_blocks = 0;
      const bool staged = kernels::paged_decode_staged(hq, pool->layer(0), kp);
      const bool shared = si == 0 && !staged && encoded && kp.share_kv_heads && hq / hkv >= 2;
      auto launch = [&] {
        return kernels::paged_decode_attention(dq.as<float>(), hq, pool->layer(0), kp,
                                               dout.as<float>(), dvis.as<int32_t>(), dws.data(),
                                               dws.size(), s);
      };
      auto timed = time_us(launch, 20);
      if (!timed.is_ok()) return fail(spec, timed.status());
      const double dev_us = timed.value();
      std::vector<int32_t> vis(static_cast<size_t>(hq));
      (void)dvis.download(vis.data(), vis.size() * 4);
      int64_t visited = 0;
      int32_t most = 0;  // the query head that visits most sets a PSA launch's time
      for (int32_t v : vis) visited += v, most = std::max(most, v);
      const double visited_frac = double(visited) / double(int64_t(hq) * nb);
      const double bytes = visited_frac * double(nb) * hkv * block_bytes;
      std::printf(
          "{\"device\": \"%s\", \"pool\": \"%s\", \"pool_bytes\": %zu, \"pull\": %.2f, "
          "\"tokens\": %lld, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, "
          "\"mode\": \"%s\", \"blocks_visited_frac\": %.4f, \"host_blocks_visited\": %lld, "
          "\"device_blocks_visited\": %lld, \"max_head_blocks_visited_frac\": %.4f, "
          "\"kv_blocks_loaded_frac\": %.4f, \"device_us\": %.1f, \"host_us\": %.1f, "
          "\"device_kv_GBps\": %.1f, \"device_copy_GBps\": %.1f, \"kv_shared\": %s, "
          "\"staged\": %s, \"plan_staged\": %s, \"date\": \"%s\", \"commit\": \"%s\", "
          "\"command\": \"%s\"}\n",
          prop.name, kvstore::kv_encoding_name(enc), pool->bytes(), double(pull),
          static_cast<long long>(n), hq, hkv, d, spec, visited_frac,
          static_cast<long long>(host_visited[si]), static_cast<long long>(visited),
          double(most) / double(nb), host_kv_loaded[si], dev_us,
          host_us[si], bytes / (dev_us * 1e-6) / 1e9, copy_GBps, shared ? "true" : "false",
          staged ? "true" : "false", plan_staged ? "true" : "false", date.c_str(), commit.c_str(),
          command.c_str());
    }
    // A verification pass's attention (full mode, PagedDecodeParams::n_tokens): the newest
    // `nt` keys of each KV head taken as the pass's tokens, against nt single-token full calls.
    // The query rows are random (not the planted query): the time does not depend on them.
    {
      constexpr int kMaxPass = 64;
      std::vector<float> qp(size_t(kMaxPass) * hq * d);
      for (auto& x : qp) x = nd(rng);
      kernels::cuda::DeviceBuffer dqp, doutp, dwsp;
      if (!dqp.alloc(qp.size() * 4).is_ok() || !dqp.upload(qp.data(), qp.size() * 4).is_ok() ||
          !doutp.alloc(qp.size() * 4).is_ok())
        return fail("pass buffers", SF_ERR(kResourceExhausted, "alloc/upload"));
      auto pass_us = [&](int nt) -> Result<double> {
        kernels::PagedDecodeParams kp;
        kp.n_tokens = nt;
        const size_t need = kernels::paged_decode_workspace_bytes(hq, pool->layer(0), kp);
        if (need > dwsp.size()) SF_TRY(dwsp.alloc(need));
        return time_us(
            [&] {
              return kernels::paged_decode_attention(dqp.as<float>(), hq, pool->layer(0), kp,
                                                     doutp.as<float>(), nullptr, dwsp.data(),
                                                     dwsp.size(), s);
            },
            10);
      };
      auto one = pass_us(1);
      if (!one.is_ok()) return fail("pass", one.status());
      const double one_us = one.value();
      for (const int nt : {8, 16, 32, 64}) {
        auto timed = pass_us(nt);
        if (!timed.is_ok()) return fail("pass", timed.status());
        const double us = timed.value();
        std::printf(
            "{\"device\": \"%s\", \"pool\": \"%s\", \"tokens\": %lld, \"heads\": %d, "
            "\"kv_heads\": %d, \"head_dim\": %d, \"mode\": \"full-pass\", \"pass_tokens\": %d, "
            "\"device_us\": %.1f, \"single_token_full_us\": %.1f, \"per_token_us\": %.1f, "
            "\"speedup_vs_single_calls\": %.2f, \"date\": \"%s\", \"commit\": \"%s\", "
            "\"command\": \"%s\"}\n",
            prop.name, kvstore::kv_encoding_name(enc), static_cast<long long>(n), hq, hkv, d, nt,
            us, one_us, us / nt, double(nt) * one_us / us, date.c_str(), commit.c_str(),
            command.c_str());
      }
    }
  }
  return 0;
}
